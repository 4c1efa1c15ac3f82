"""Debug mode: MOEGEMM_DEBUG=1 turns on the checks that read device values.

Those checks synchronize the GPU, so they run by default only where reading values is free:
on the CPU.
"""

from __future__ import annotations

import os

import torch

__all__ = ["debug_mode", "values_checked"]


def debug_mode() -> bool:
    """MOEGEMM_DEBUG=1 turns on the checks that read device values (they synchronize)."""
    return os.environ.get("MOEGEMM_DEBUG", "0") not in ("", "0")


def values_checked(device: torch.device) -> bool:
    """Whether a call on `device` checks tensor values: on the CPU, where reading them is free,
    and in debug mode."""
    return device.type == "cpu" or debug_mode()
