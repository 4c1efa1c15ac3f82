"""Host side of the portable tl kernel: pick the compiled or interpreted build, size the
persistent grid, launch. `plan` does all of that once per problem (PortablePlan: the config, the
grid, the launch key, the constexprs); `PortablePlan.run` launches. No device value is read: the
grid comes from an upper bound on the tile count, and the kernel itself skips the tiles that do
not exist. The token pre-passes of the sm90 family, tl kernels of the same source, are tokens.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import layouts
from ..config import portable_config
from ..formats import E2M1, E4M3, Format
from ..problem import GroupedProblem
from . import tl_source
from .compiled_launch import launch

_SOURCE = Path(__file__).with_name("_portable_tl.py")


@functools.cache
def kernel_module(interpret: bool):
    """_portable_tl.py compiled (interpret=False) or for the CPU interpreter (kernels/tl_source.py)."""
    return tl_source.load(_SOURCE, interpret)


def as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """1-byte fp8 tensors travel as uint8: the kernel decodes the bits itself."""
    if t is not None and t.dtype is not torch.uint8 and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_programs(device: torch.device, upper_bound_tiles: int, programs_per_sm: int) -> int:
    return max(1, min(_sm_count(device) * programs_per_sm, upper_bound_tiles))


@functools.cache
def format_constexprs(f: Format, swizzled: bool, b_n_major: bool, interpret: bool) -> dict:
    """The compile-time arguments that depend on the format and the operands' layouts: the kernel
    module's codes (of the token pre-passes' kernels too: A_ELEM, A_SCALE), read once a build."""
    module = kernel_module(interpret)
    elements = {E4M3: module.ELEM_E4M3, E2M1: module.ELEM_E2M1}
    scales = {None: module.SCALE_NONE, "fp32": module.SCALE_FP32_BLOCK, "e8m0": module.SCALE_E8M0,
              "e4m3": module.SCALE_E4M3}
    return dict(
        A_ELEM=elements.get(f.a.element, module.ELEM_BF16).value,
        B_ELEM=elements.get(f.b.element, module.ELEM_BF16).value,
        A_SCALE=scales[f.a.scale].value, B_SCALE=scales[f.b.scale].value, VEC=max(f.scale_vec, 1),
        SWIZZLED=swizzled,
        # The CPU interpreter's bf16 dot multiplies raw bits: it gets fp32 operands, which hold
        # the same (exactly decoded) values.
        DOT_DTYPE=module.tl.float32 if interpret else module.tl.bfloat16,
        DOT_PRECISION="ieee",
        INTERPRETED=interpret,
        B_N_MAJOR=b_n_major,  # (bf16 weights read in place as the transpose of [E, K, N])
    )


def kernel_constexprs(p: GroupedProblem, cfg, interpret: bool) -> dict:
    """The compile-time arguments of one launch (also used by the offline sm_90 compile test)."""
    codes = format_constexprs(p.fmt, p.fmt.scaled and p.scale_layout.swizzled, p.b_n_major, interpret)
    return dict(codes, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)


@dataclass(frozen=True, eq=False)
class PortablePlan:
    """One problem's launch of the portable kernel, planned (`plan`): everything but the tensors."""

    problem: GroupedProblem
    interpret: bool
    key: tuple
    grid: tuple
    scalars: tuple
    kwargs: dict
    a_swizzled: bool  # (swizzled A scales: their padded rows a slot, made here where not given)

    def run(self, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets, expert_scales, row_scales, out):
        """Launch the portable kernel into `out` (already allocated, [M, N])."""
        p = self.problem
        if p.num_groups == 0 or p.m == 0 or p.n == 0:
            return out
        if self.a_swizzled and a_scale_offsets is None:
            a_scale_offsets = layouts.a_scale_offsets(a_offsets)  # device ops, no host read
        dummy = a_offsets  # stands in for absent optional pointers; never read
        launch(kernel_module(self.interpret).grouped_matmul_kernel, self.key, self.grid, (
            as_bytes(a), as_bytes(b),
            as_bytes(a_scales) if a_scales is not None else dummy,
            as_bytes(b_scales) if b_scales is not None else dummy,
            a_offsets, expert_ids,
            a_scale_offsets if a_scale_offsets is not None else dummy,
            expert_scales if expert_scales is not None else dummy,
            row_scales if row_scales is not None else dummy,
            out, *self.scalars), self.kwargs)
        return out


def plan(p: GroupedProblem, device: torch.device, *, expert_scales: bool, row_scales: bool, a_scale_offsets: bool,
         scale_blocks: int) -> PortablePlan:
    """The portable kernel's launch of problem p on `device`: expert_scales, row_scales,
    a_scale_offsets say which of those the calls give; scale_blocks: the first dimension of A's
    scales (their 128-row blocks where swizzled)."""
    interpret = device.type == "cpu"
    swizzled = p.fmt.scaled and p.scale_layout.swizzled
    codes = format_constexprs(p.fmt, swizzled, p.b_n_major, interpret)
    cfg = portable_config(p.fmt, p.n, p.k, device.type)
    a_swizzled = swizzled and p.fmt.a_scaled  # (weight-only: the weights' scales only)
    num_kb = p.num_k_scales
    # Valid tiles <= sum_g ceil(tokens_g / BLOCK_M) * n_tiles <= (ceil(M / BLOCK_M) + G) * n_tiles.
    upper_tiles = (math.ceil(p.m / cfg.block_m) + p.num_groups) * math.ceil(p.n / cfg.block_n)
    grid = (num_programs(device, upper_tiles, cfg.programs_per_sm),)
    key = (p.key, cfg, not expert_scales, not row_scales, not (a_scale_offsets or a_swizzled),
           scale_blocks if a_swizzled else 0, interpret)
    scalars = (p.m, p.n, p.k, p.num_experts, p.num_groups, num_kb, math.ceil(num_kb / 4),
               scale_blocks * 128 if a_swizzled else p.m)
    kwargs = dict(HAS_EXPERT_SCALES=expert_scales, HAS_ROW_SCALES=row_scales, **codes, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return PortablePlan(p, interpret, key, grid, scalars, kwargs, a_swizzled)
