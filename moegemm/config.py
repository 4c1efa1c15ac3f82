"""Kernel configurations: frozen data from a pure function of (format, shape, device).

MOEGEMM_PRINT_CONFIG=1 prints each choice once. Tests may override the choice with
`override_portable_config`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

from .formats import Format

__all__ = ["PortableConfig", "portable_config", "override_portable_config"]


@dataclass(frozen=True)
class PortableConfig:
    """Tile shape and launch shape of the portable tl kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int  # persistent grid: programs = SMs * this (capped by an upper bound of the tiles)

    def check(self, fmt: Format):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"config: {name} must be a power of two >= 16, got {value}")
        if fmt.name == "fp8_block":
            if fmt.a.block_k % self.block_k:
                raise ValueError(f"config: fp8_block K steps must not straddle its 128-wide scale blocks, got block_k={self.block_k}")
        elif fmt.scaled and self.block_k % fmt.scale_vec:
            raise ValueError(f"config: block_k={self.block_k} must be a multiple of the scale block {fmt.scale_vec}")


_override: PortableConfig | None = None


@contextlib.contextmanager
def override_portable_config(config: PortableConfig):
    """Force a config inside the block (for tests that must cover tile edge cases)."""
    global _override
    previous, _override = _override, config
    try:
        yield
    finally:
        _override = previous


def portable_config(fmt: Format, n: int, k: int, device_type: str) -> PortableConfig:
    if _override is not None:
        config = _override
    else:
        config = _portable_config(fmt.name, fmt.scale_vec, n, k, device_type)
    config.check(fmt)
    return config


@functools.lru_cache(maxsize=None)
def _portable_config(fmt_name: str, scale_vec: int, n: int, k: int, device_type: str) -> PortableConfig:
    if device_type == "cpu":
        # The interpreter pays per operation, not per element: few large tiles (128^3 ran the
        # 6512-row test pattern 5x faster than 64^3); three programs so the persistent stride
        # is exercised on the CPU too.
        config = PortableConfig(block_m=128, block_n=128, block_k=128, num_warps=4, num_stages=1, programs_per_sm=3)
    else:
        # Operands are decoded in registers before the dot, so register pressure decides the
        # tile. With 32-wide K steps on 8 warps, 64x128 compiled without spills for every
        # format but mxfp8 with plain scales (15), which is clean at 128x64 (where w4a8
        # spilled 27). 64-wide K steps spilled 11-46 registers, 4 warps 5-72 (sm_90 SASS,
        # tests/test_compile_sm90.py keeps this true).
        block_m, block_n = (128, 64) if fmt_name == "mxfp8" else (64, 64 if n <= 64 else 128)
        config = PortableConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=8, num_stages=3,
                                programs_per_sm=2)
    if os.environ.get("MOEGEMM_PRINT_CONFIG", "0") not in ("", "0"):
        print(f"[moegemm] portable config fmt={fmt_name} N={n} K={k} device={device_type}: {config}")
    return config
