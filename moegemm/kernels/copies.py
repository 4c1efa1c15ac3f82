"""copy_into(dsts, srcs): dst.copy_(src) for each pair, as one kernel launch where it can be.

A CUDA graph replayed at decode sizes takes its inputs by copy (graphed.py): three copy_ calls
are three cudaMemcpyAsync of about 11 us of host time each (torch's dispatch included, one H100
host), a launch of copy_kernel through its compiled launcher about 6. The tensors are passed as
they are (the kernel is specialized for their dtypes): no view is made, each costs host time
too. Pairs of one dtype and shape, both contiguous CUDA tensors, up to three a launch; anything
else goes through copy_.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from . import tl_source
from .compiled_launch import launch

_SOURCE = Path(__file__).with_name("_copy_tl.py")
BLOCK = 2048  # elements a program copies of each pair
PAIRS = 3  # pairs a launch copies


@functools.cache
def _module():
    return tl_source.load(_SOURCE, False)


def _launchable(d: torch.Tensor, s: torch.Tensor) -> bool:
    return (d.is_cuda and s.is_cuda and d.dtype == s.dtype and d.shape == s.shape and d.is_contiguous()
            and s.is_contiguous() and d.numel() > 0)


def copy_into(dsts, srcs) -> None:
    """dst.copy_(src) for each pair of dsts and srcs (same lengths; each pair on one device)."""
    args, key, most = [], [], 0
    for d, s in zip(dsts, srcs):
        if not _launchable(d, s):
            d.copy_(s)
            continue
        n = d.numel()
        args += [d, s, n]
        key += [d.dtype, n]
        most = max(most, n)
        if len(args) == 3 * PAIRS:
            _launch(args, key, most)
            args, key, most = [], [], 0
    if args:
        _launch(args, key, most)


def _launch(args: list, key: list, most: int) -> None:
    while len(args) < 3 * PAIRS:  # (unused pairs: any pointers, nothing copied)
        args += [args[0], args[1], 0]
        key += [args[0].dtype, 0]
    launch(_module().copy_kernel, (*key, BLOCK), (math.ceil(most / BLOCK), ), tuple(args),
           {"BLOCK": BLOCK, "num_warps": 4})
