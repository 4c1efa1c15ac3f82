"""copy_into(dsts, srcs): dst.copy_(src) for each pair, as one kernel launch where it can be.

A CUDA graph replayed at decode sizes takes its inputs by copy (graphed.py): three copy_ calls
are three cudaMemcpyAsync of about 11 us of host time each (torch's dispatch included, one H100
host), a launch of copy_bytes_kernel through its compiled launcher about 6. Pairs of one dtype
and shape, both contiguous, up to three a launch; anything else (other strides, the CPU) goes
through copy_.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from . import tl_source
from .compiled_launch import launch

_SOURCE = Path(__file__).with_name("_copy_tl.py")
BLOCK = 4096  # bytes a program copies of each pair
PAIRS = 3  # pairs a launch copies


@functools.cache
def _module():
    return tl_source.load(_SOURCE, False)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def copy_into(dsts, srcs) -> None:
    """dst.copy_(src) for each pair of dsts and srcs (same lengths)."""
    fast = [(d, s) for d, s in zip(dsts, srcs)
            if d.is_cuda and d.device == s.device and d.dtype == s.dtype and d.shape == s.shape
            and d.is_contiguous() and s.is_contiguous() and d.numel()]
    for d, s in zip(dsts, srcs):
        if not any(d is f for f, _ in fast):
            d.copy_(s)
    for start in range(0, len(fast), PAIRS):
        pairs = fast[start:start + PAIRS]
        args, sizes = [], []
        for d, s in pairs:
            n = d.numel() * d.element_size()
            args += [_bytes(d), _bytes(s), n]
            sizes.append(n)
        while len(args) < 3 * PAIRS:  # (unused pairs: any pointers, nothing copied)
            args += [args[0], args[1], 0]
            sizes.append(0)
        grid = (math.ceil(max(sizes) / BLOCK), )
        launch(_module().copy_bytes_kernel, (*sizes, BLOCK), grid, tuple(args), {"BLOCK": BLOCK, "num_warps": 4})
