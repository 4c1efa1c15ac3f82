"""Host side of the routing kernels (_routing_tl.py): compiled for CUDA tensors, Triton's
interpreter for CPU tensors. No device value is read on the host: every size and grid comes
from T (tokens), k (top-k), E (experts) and N (columns). Inputs are validated by the callers
(moegemm.routing).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import NamedTuple

import torch

from . import tl_source
from .compiled_launch import launch

_SOURCE = Path(__file__).with_name("_routing_tl.py")

MAX_BLOCK = 2048  # flat choices per histogram / scatter program, at most
TARGET_PROGRAMS = 128  # blocks aimed at: more make the one-program offsets step longer
OFFSETS_ELEMS = 4096  # CHUNK * NUM_BINS: the offsets program's tile
COMBINE_WARPS = 8  # 32 x 128 tile with a bias: 4 warps spill one register on sm_90



@functools.cache
def kernel_module(interpret: bool):
    """_routing_tl.py compiled (interpret=False) or for the CPU interpreter (kernels/tl_source.py)."""
    return tl_source.load(_SOURCE, interpret)


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def num_bins(num_experts: int) -> int:
    """Histogram bins: experts plus the dropped key E, padded to a power of two."""
    return _pow2(num_experts + 1)


def offsets_chunk(bins: int) -> int:
    return max(1, min(64, OFFSETS_ELEMS // bins))


def tiling(num_choices: int, num_experts: int) -> tuple[int, int]:
    """(BLOCK, SUB) of the histogram and scatter programs.

    A scatter step costs about SUB^2 (the comparison) plus NUM_BINS (histogram and gather);
    the offsets program about num_blocks * NUM_BINS. Chosen from H100 timings of T in
    [16, 65536], k = 8, E in {8, 128, 512}.
    """
    bins = num_bins(num_experts)
    sub = 32 if bins <= 256 else 64 if bins <= 512 else 128
    block = min(MAX_BLOCK, max(128, _pow2(math.ceil(num_choices / TARGET_PROGRAMS))))
    return block, min(sub, block)


class _RouteLaunches(NamedTuple):
    """The three launches of route for one (choices, experts, k, tiling): their grids, launch keys
    and constexprs (host values only, made once)."""

    num_blocks: int
    key: tuple
    histogram: dict
    offsets: dict
    scatter: dict


@functools.lru_cache(maxsize=256)
def _route_launches(n: int, e: int, k: int, block: int | None, sub: int | None) -> _RouteLaunches:
    default_block, default_sub = tiling(n, e)
    block, sub = block or default_block, sub or default_sub
    if block & (block - 1) or sub & (sub - 1) or sub > block:
        raise ValueError(f"block, sub: expected powers of two with sub <= block, got {block}, {sub}")
    bins = num_bins(e)
    return _RouteLaunches(math.ceil(n / block), (n, e, k, block, sub), dict(NUM_BINS=bins, BLOCK=block, num_warps=4),
                          dict(NUM_BINS=bins, CHUNK=offsets_chunk(bins), num_warps=8),
                          dict(NUM_BINS=bins, BLOCK=block, SUB=sub, num_warps=4))


def _per_expert(e: int, device: torch.device) -> torch.Tensor:
    """int32 [e], on storage of size >= 1: no kernel is handed an empty (null) tensor when E == 0."""
    return torch.empty(e, dtype=torch.int32, device=device) if e else torch.empty(1, dtype=torch.int32,
                                                                                   device=device)[:0]


def route(topk_ids: torch.Tensor, num_experts: int, block: int | None = None, sub: int | None = None):
    """Stable sort of the T*k choices by expert (dropped last), on the device of topk_ids.

    Returns a dict of token_index int64 [T*k], grouped_row int64 [T, k], valid bool [T, k],
    expert_of_row int32 [T*k], a_offsets int32 [E+1], expert_ids int32 [E] (arange) and
    a_scale_offsets int32 [E]: the RoutingPlan fields but topk_weights. `block` / `sub` (powers of two,
    sub <= block) override the tiling (tests use small ones to cover many programs).
    """
    n = topk_ids.numel()
    e = num_experts
    if n >= 2**31:
        raise ValueError(f"topk_ids: at most 2**31 - 1 choices (int32 rows), got {n}")
    # Each output its own storage (the route op of torch.compile may return no aliases), every
    # element written by the kernels. (Sizes as ints: torch parses them faster than a tuple.)
    device, (t, k), i32 = topk_ids.device, topk_ids.shape, torch.int32
    token_index = torch.empty(n, dtype=torch.int64, device=device)
    grouped_row = torch.empty(t, k, dtype=torch.int64, device=device)
    valid = torch.empty(t, k, dtype=torch.bool, device=device)
    expert_of_row = torch.empty(n, dtype=i32, device=device)
    a_offsets = torch.empty(e + 1, dtype=i32, device=device)
    expert_ids, a_scale_offsets = _per_expert(e, device), _per_expert(e, device)
    plan = dict(token_index=token_index, grouped_row=grouped_row, valid=valid, expert_of_row=expert_of_row,
                a_offsets=a_offsets, expert_ids=expert_ids, a_scale_offsets=a_scale_offsets)
    if n == 0:  # nothing to launch for
        a_offsets.zero_()
        a_scale_offsets.zero_()
        torch.arange(e, out=expert_ids)
        return plan
    ids = topk_ids  # (the kernels read the T*k ids flat: a contiguous [T, k] as it is)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()  # as the reference reads them
    ids = ids.contiguous()
    module = kernel_module(device.type == "cpu")
    launches = _route_launches(n, e, k, block, sub)
    num_blocks, key = launches.num_blocks, launches.key
    counts, base = torch.empty(num_blocks, e + 1, dtype=i32, device=device), \
        torch.empty(num_blocks, e + 1, dtype=i32, device=device)
    launch(module.routing_histogram_kernel, key, (num_blocks,), (ids, counts, n, e), launches.histogram)
    launch(module.routing_offsets_kernel, key, (1,), (counts, base, a_offsets, a_scale_offsets, expert_ids, num_blocks, e),
           launches.offsets)
    launch(module.routing_scatter_kernel, key, (num_blocks,),
           (ids, base, grouped_row, token_index, expert_of_row, valid.view(torch.uint8), n, e, k),
           launches.scatter)
    return plan


def combine_blocks(num_cols: int, interpret: bool, num_tokens: int = 1 << 20) -> tuple[int, int]:
    """(tokens, columns) a program of the combine: 8 tokens below 1024 (decode: more programs
    for the few rows), else 32; 64 in the interpreter."""
    block_n = max(16, min(128, _pow2(num_cols)))
    return (64 if interpret else 32 if num_tokens >= 1024 else 8), block_n


@functools.lru_cache(maxsize=256)
def _combine_launch(t: int, n: int, k: int, strides: tuple, weights: bool, bias: bool, interpret: bool) -> tuple:
    """(grid, launch key, constexprs) of the combine for these host values, made once."""
    block_t, block_n = combine_blocks(n, interpret, t)
    return ((math.ceil(t / block_t), math.ceil(n / block_n)), (t, n, k, strides, not weights, bias, block_t, block_n),
            dict(K=k, HAS_WEIGHTS=weights, HAS_BIAS=bias, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=COMBINE_WARPS))


def unpermute(y: torch.Tensor, grouped_row: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor | None,
              expert_of_row: torch.Tensor | None, expert_bias: torch.Tensor | None, out_dtype: torch.dtype):
    """out[t] = sum_j w[t, j] * (y[grouped_row[t, j]] + bias[expert]) over valid choices, fp32 accumulation.

    grouped_row int64 [T, k], valid bool [T, k], weights [T, k] or None (ones), expert_of_row
    int32 [T*k] (needed with expert_bias), expert_bias [E, N] or None.
    """
    t, k = grouped_row.shape
    n = y.shape[1]
    device = y.device
    out = torch.empty(t, n, dtype=out_dtype, device=device)
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    interpret = device.type == "cpu"
    grouped_row = grouped_row.contiguous()
    valid = valid.contiguous().view(torch.uint8)
    dummy = grouped_row  # stands in for absent optional pointers; never read
    has_bias = expert_bias is not None and expert_bias.numel() > 0  # E == 0: every choice is dropped
    strides = (y.stride(0), y.stride(1), expert_bias.stride(0) if has_bias else 0,
               expert_bias.stride(1) if has_bias else 0)
    grid, key, consts = _combine_launch(t, n, k, strides, weights is not None, has_bias, interpret)
    launch(kernel_module(interpret).routing_combine_kernel, key, grid, (
        y, grouped_row, valid,
        weights.contiguous() if weights is not None else dummy,
        expert_of_row.contiguous() if has_bias else dummy,
        expert_bias if has_bias else dummy,
        out, t, n, *strides), consts)
    return out


SCATTER_ROWS_BLOCK = (16, 1024)  # (tokens, bytes) a program of scatter_rows


def scatter_rows(src: torch.Tensor, grouped_row: torch.Tensor, valid: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows src [T, C] of 1-, 2-, 4- or 8-byte words (unit column stride) -> [num_rows, C] with
    out[grouped_row[t, j]] = src[t] for every valid choice; the other rows are left unwritten."""
    t, k = grouped_row.shape
    c = src.shape[1]
    out = torch.empty(num_rows, c, dtype=src.dtype, device=src.device)
    if t == 0 or c == 0 or k == 0:
        return out
    module = kernel_module(src.device.type == "cpu")
    block_t, block_c = SCATTER_ROWS_BLOCK[0], max(16, SCATTER_ROWS_BLOCK[1] // src.element_size())
    grid = (math.ceil(t / block_t), math.ceil(c / block_c))
    launch(module.routing_scatter_rows_kernel, (t, c, src.stride(0), k, block_c), grid,
           (src, grouped_row.contiguous(), valid.contiguous().view(torch.uint8), out, t, c, src.stride(0),
            out.stride(0)), dict(K=k, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4))
    return out
