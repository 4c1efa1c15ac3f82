"""Host side of the portable tl kernel: pick the compiled or interpreted build, size the
persistent grid, launch. No device value is read: the grid comes from an upper bound on
the tile count, and the kernel itself skips the tiles that do not exist.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from .. import layouts
from ..config import portable_config
from ..formats import E2M1, E4M3
from ..token_forms import kb_major_columns
from ..problem import GroupedProblem
from . import tl_source
from .compiled_launch import launch

_SOURCE = Path(__file__).with_name("_portable_tl.py")


@functools.cache
def kernel_module(interpret: bool):
    """_portable_tl.py compiled (interpret=False) or for the CPU interpreter (kernels/tl_source.py)."""
    return tl_source.load(_SOURCE, interpret)


def _elem_code(element, module) -> int:
    if element is E4M3:
        return module.ELEM_E4M3.value
    if element is E2M1:
        return module.ELEM_E2M1.value
    return module.ELEM_BF16.value


def _scale_code(scale: str | None, module) -> int:
    code = {None: module.SCALE_NONE, "fp32": module.SCALE_FP32_BLOCK, "e8m0": module.SCALE_E8M0,
            "e4m3": module.SCALE_E4M3}[scale]
    return code.value


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """1-byte fp8 tensors travel as uint8: the kernel decodes the bits itself."""
    if t is not None and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _num_programs(device: torch.device, upper_bound_tiles: int, programs_per_sm: int) -> int:
    return max(1, min(_sm_count(device) * programs_per_sm, upper_bound_tiles))


def kernel_constexprs(p: GroupedProblem, cfg, interpret: bool) -> dict:
    """The compile-time arguments of one launch (also used by the offline sm_90 compile test)."""
    module = kernel_module(interpret)
    f = p.fmt
    return dict(
        A_ELEM=_elem_code(f.a.element, module), B_ELEM=_elem_code(f.b.element, module),
        A_SCALE=_scale_code(f.a.scale, module), B_SCALE=_scale_code(f.b.scale, module), VEC=max(f.scale_vec, 1),
        SWIZZLED=f.scaled and p.scale_layout == "swizzled",
        # The CPU interpreter's bf16 dot multiplies raw bits: it gets fp32 operands, which hold
        # the same (exactly decoded) values.
        DOT_DTYPE=module.tl.float32 if interpret else module.tl.bfloat16,
        DOT_PRECISION="ieee",
        INTERPRETED=interpret,
        B_N_MAJOR=p.b_n_major,  # (bf16 weights read in place as the transpose of [E, K, N])
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
    )


def grouped_matmul(p: GroupedProblem, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets,
                   expert_scales, row_scales, out):
    """Launch the portable kernel into `out` (already allocated, [M, N])."""
    if p.num_groups == 0 or p.m == 0 or p.n == 0:
        return out
    interpret = a.device.type == "cpu"
    module = kernel_module(interpret)
    cfg = portable_config(p.fmt, p.n, p.k, a.device.type)
    constexprs = kernel_constexprs(p, cfg, interpret)
    a_swizzled = constexprs["SWIZZLED"] and p.fmt.a_scaled  # (weight-only: the weights' scales only)
    num_kb = p.num_k_scales
    if a_swizzled and a_scale_offsets is None:
        a_scale_offsets = layouts.a_scale_offsets(a_offsets)  # device ops, no host read
    # Valid tiles <= sum_g ceil(tokens_g / BLOCK_M) * n_tiles <= (ceil(M / BLOCK_M) + G) * n_tiles.
    upper_tiles = (math.ceil(p.m / cfg.block_m) + p.num_groups) * math.ceil(p.n / cfg.block_n)
    grid = (_num_programs(a.device, upper_tiles, cfg.programs_per_sm),)
    dummy = a_offsets  # stands in for absent optional pointers; never read
    key = (p.key, cfg, expert_scales is None, row_scales is None, a_scale_offsets is None,
           a_scales.shape[0] if a_swizzled else 0, interpret)
    launch(module.grouped_matmul_kernel, key, grid, (
        _bytes(a), _bytes(b),
        _bytes(a_scales) if a_scales is not None else dummy,
        _bytes(b_scales) if b_scales is not None else dummy,
        a_offsets, expert_ids,
        a_scale_offsets if a_scale_offsets is not None else dummy,
        expert_scales if expert_scales is not None else dummy,
        row_scales if row_scales is not None else dummy,
        out,
        p.m, p.n, p.k, p.num_experts, p.num_groups,
        num_kb, math.ceil(num_kb / 4), a_scales.shape[0] * 128 if a_swizzled else p.m), dict(
        HAS_EXPERT_SCALES=expert_scales is not None, HAS_ROW_SCALES=row_scales is not None,
        **constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return out


def dequantize_rows(p: GroupedProblem, a, a_scales, a_offsets, expert_ids, a_scale_offsets) -> torch.Tensor:
    """bf16 [M, K]: the rows of every valid slot of A decoded and scaled (exact, see
    dequantize_rows_kernel); rows outside them are left unwritten. The MX/NV sm90 kernel reads
    its tokens from here. Unscaled bf16 activations (the weight-only formats') are those tokens
    already: `a` itself is returned."""
    if not p.fmt.a_scaled:
        return a
    out = torch.empty(p.m, p.k, dtype=torch.bfloat16, device=a.device)
    if p.num_groups == 0 or p.m == 0:
        return out
    interpret = a.device.type == "cpu"
    module = kernel_module(interpret)
    f = p.fmt
    swizzled = p.scale_layout == "swizzled"
    if swizzled and a_scale_offsets is None:
        a_scale_offsets = layouts.a_scale_offsets(a_offsets)
    block_m, block_k = (32, 128) if not interpret else (64, 128)
    # Enough programs to fill the GPU whatever the group sizes: parts per slot.
    parts = max(1, min(math.ceil(p.m / block_m), math.ceil(4 * _num_programs(a.device, 1 << 30, 1) / p.num_groups)))
    num_kb = p.num_k_scales
    launch(module.dequantize_rows_kernel, (p.key, a_scales.shape[0], interpret), (p.num_groups, parts), (
        _bytes(a), _bytes(a_scales), a_offsets, expert_ids,
        a_scale_offsets if a_scale_offsets is not None else a_offsets, out,
        p.m, p.k, p.num_experts, p.num_groups, num_kb, math.ceil(num_kb / 4),
        a_scales.shape[0] * 128 if swizzled else p.m), dict(
        A_ELEM=_elem_code(f.a.element, module), SCALE=_scale_code(f.a.scale, module), VEC=f.scale_vec,
        SWIZZLED=swizzled, INTERPRETED=interpret, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4))
    return out


def e2m1_to_e4m3(a: torch.Tensor, exponent: int = 0, even_odd: bool = False) -> torch.Tensor:
    """Packed e2m1 [R, K/2] (uint8, element 2i in the low nibble) -> e4m3 [R, K] of the values
    times 2^exponent (0..6), exact (every e2m1 value times 2^0..2^6 is an e4m3 value; see
    e2m1_to_e4m3_kernel): mxfp4 tokens for the fp8 tensor cores (kernels/sm90/e2m1.py, which
    takes them times 2^6, even_odd). even_odd: within each group of 8 elements of K the order
    is 0, 2, 4, 6, 1, 3, 5, 7 (see even_odd_k). Every row is converted, so no slot data is read
    on the host."""
    _check_e2m1_to_e4m3(a, exponent, even_odd and a.numel() > 0)  # (no rows, no groups to check)
    out = torch.empty(*a.shape[:-1], 2 * a.shape[-1], dtype=torch.float8_e4m3fn, device=a.device)
    num_bytes = a.numel()
    if num_bytes == 0:
        return out
    block = 1024
    launch(kernel_module(a.device.type == "cpu").e2m1_to_e4m3_kernel, (num_bytes, exponent, even_odd),
           (math.ceil(num_bytes / block), ), (_bytes(a.contiguous()), out.view(torch.uint8), num_bytes),
           dict(EXP=exponent, EVEN_ODD=even_odd, BLOCK=block, num_warps=4))
    return out


def _check_e2m1_to_e4m3(a: torch.Tensor, exponent: int, even_odd: bool):
    if not 0 <= exponent <= 6:
        raise ValueError(f"exponent must be in 0..6 (e4m3 holds 6 * 2^6 = 384), got {exponent}")
    if even_odd and a.shape[-1] % 4:
        raise ValueError(f"even_odd needs rows of whole 8-element groups, got {2 * a.shape[-1]} elements")


def even_odd_k(a: torch.Tensor) -> torch.Tensor:
    """A copy of the 1-byte [R, K] rows with each group of 8 elements of K reordered as 0, 2, 4,
    6, 1, 3, 5, 7: the order kernels/sm90/e2m1.py decodes e2m1 weights into (the low nibbles of
    four bytes, then the high ones), so that w4a8's e4m3 tokens meet them. A dot product over a
    group is unchanged; the groups stay inside their 32-element scale blocks."""
    rows, k = a.shape
    if k % 8:
        raise ValueError(f"even_odd_k needs rows of whole 8-element groups, got {k} elements")
    grouped = a.contiguous().view(torch.uint8).view(rows, k // 8, 4, 2)
    return grouped.transpose(-1, -2).contiguous().view(rows, k).view(a.dtype)


def decode_row_scales(p: GroupedProblem, a_scales, a_offsets, expert_ids, a_scale_offsets,
                      pad_stages: bool = False, kb_major: bool = False, stage_blocks: int = 4,
                      column_block: int = 4) -> torch.Tensor:
    """fp32 [M, num_k_scales]: A's e8m0 scales decoded (2^(b-127); 0 -> 2^-127, 255 -> NaN) into
    the plain layout, for the rows of every valid slot; other rows are left unwritten.

    pad_stages: rows hold stage_blocks * (ceil(num_k_scales / stage_blocks) + 1) columns, those
    past num_k_scales 2^-127, so the promotion kernel's narrow tiles (kernels/sm90/mxfp8.py) load
    the scales of a stage of stage_blocks K blocks, and the next stage's ahead of time, with no
    K mask.
    kb_major: the transpose, [num_k_scales, B * ceil(M / B) + B * G] (B = column_block, 4 or
    16), so that a [4, tokens] box holds one ring stage's token scales (the kernel's wide tiles).
    TMA needs a box to start 16-byte aligned on the contiguous axis (an illegal instruction
    otherwise, H100), so slot g's row s + r sits at column token_forms.kb_major_column(r, s, g, B)
    (s: the slot's clamped first row): every slot starts at a multiple of B, and the slots stay in
    order without overlapping; B = 16 also orders each 16 rows as the wgmma accumulator's columns."""
    out, args, consts, parts = _row_scales_launch(p, a_scales, a_offsets, expert_ids, a_scale_offsets, pad_stages,
                                                  kb_major, stage_blocks, column_block)
    if parts:
        launch(kernel_module(a_scales.device.type == "cpu").decode_row_scales_kernel,
               (p.key, a_scales.shape[0], *args[11:], *consts.values()), (p.num_groups, parts), args,
               dict(consts, num_warps=4))
    return out


def token_prepass(p: GroupedProblem, a, a_scales, a_offsets, expert_ids, a_scale_offsets, pad_stages: bool = False,
                  kb_major: bool = False, stage_blocks: int = 4, exponent: int = 0,
                  even_odd: bool = False, column_block: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode_row_scales(...), e2m1_to_e4m3(a, exponent, even_odd)) in one launch: the two
    pre-passes of packed e2m1 tokens before the sm90 promotion kernel (kernels/sm90/e2m1.py),
    one launch less before each product (~2 us each at decode, H100)."""
    _check_e2m1_to_e4m3(a, exponent, even_odd)
    out, args, consts, parts = _row_scales_launch(p, a_scales, a_offsets, expert_ids, a_scale_offsets, pad_stages,
                                                  kb_major, stage_blocks, column_block)
    tokens = torch.empty(*a.shape[:-1], 2 * a.shape[-1], dtype=torch.float8_e4m3fn, device=a.device)
    num_bytes, block = a.numel(), 1024
    programs = p.num_groups * parts + math.ceil(num_bytes / block)
    if programs:
        launch(kernel_module(a.device.type == "cpu").token_prepass_kernel,
               (p.key, a_scales.shape[0], *args[11:], *consts.values(), exponent, even_odd, parts), (programs, ),
               (*args[:5], _bytes(a.contiguous()), tokens.view(torch.uint8), *args[5:], max(parts, 1), num_bytes),
               dict(consts, EXP=exponent, EVEN_ODD=even_odd, BLOCK=block, num_warps=4))
    return out, tokens


def _row_scales_launch(p: GroupedProblem, a_scales, a_offsets, expert_ids, a_scale_offsets, pad_stages, kb_major,
                       stage_blocks, column_block):
    """decode_row_scales' output, its kernel's arguments and constexprs, and its parts a slot
    (0: nothing to launch)."""
    num_kb = p.num_k_scales
    columns = stage_blocks * (math.ceil(num_kb / stage_blocks) + 1) if pad_stages else num_kb
    if kb_major:
        m_pad = kb_major_columns(p.m, p.num_groups, column_block)
        out = torch.empty(columns, m_pad, dtype=torch.float32, device=a_scales.device)
        row_stride, kb_stride = 1, m_pad
    else:
        out = torch.empty(p.m, columns, dtype=torch.float32, device=a_scales.device)
        row_stride, kb_stride = columns, 1
    swizzled = p.scale_layout == "swizzled"
    if swizzled and a_scale_offsets is None and p.num_groups and p.m:
        a_scale_offsets = layouts.a_scale_offsets(a_offsets)
    block_m = 32
    parts = 0
    if p.num_groups and p.m:
        parts = max(1, min(math.ceil(p.m / block_m),
                           math.ceil(4 * _num_programs(a_scales.device, 1 << 30, 1) / p.num_groups)))
    args = (_bytes(a_scales), a_offsets, expert_ids, a_scale_offsets if a_scale_offsets is not None else a_offsets,
            out, p.m, p.num_experts, p.num_groups, num_kb, math.ceil(num_kb / 4),
            a_scales.shape[0] * 128 if swizzled else p.m, columns, row_stride, kb_stride)
    consts = dict(SWIZZLED=swizzled, ALIGN_GROUPS=column_block if kb_major else 0, BLOCK_M=block_m, BLOCK_KB=64)
    return out, args, consts, parts
