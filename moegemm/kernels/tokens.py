"""The token pre-passes of the block formats: A brought into the form a sm90 kernel reads
(token_forms.py) where the layer's kernels have not written it so already. Their kernels are tl
(_portable_tl.py), so they run on any CUDA GPU and under the CPU interpreter.

    dequantize   bf16 tokens, decoded and scaled                     (sm90/decode.py)
    row scales   fp32 token scales, plain or K-block-major; w4a8's   (sm90/mxfp8.py, sm90/e2m1.py)
                 tokens reordered to the decoded weights' K order
                 in the same launch
    e2m1         mxfp4 tokens as e4m3 times 2^6 with their scales,   (sm90/mxfp8.py, sm90/e2m1.py)
                 one launch

`plan_tokens` plans the pre-pass of a problem once (output shapes, grid, launch key, every scalar
argument and constexpr: they depend on the shapes only); `TokenPass.run` then allocates and
launches. No device value is read: grids come from upper bounds of the rows.

A pre-pass that launches also zeroes, given the product's fresh output (`TokenPass.run`'s
`fresh_out`, allocated uninitialized), that output's rows no valid slot owns, in the same launch
(more programs, `TokenPass.fill`): the product runs after it on the same stream and writes the
rest, so a fresh output reads zero outside valid slots (docs/contract.md section 2) without a
fill of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import layouts
from ..problem import GroupedProblem
from ..token_forms import kb_major_columns
from .compiled_launch import LaunchSite, launch, site
from .portable import as_bytes, format_constexprs, kernel_module, num_programs

__all__ = ["TokenPass", "plan_tokens", "dequantize_rows", "decode_row_scales", "token_prepass", "e2m1_to_e4m3",
           "even_odd_k"]

_E2M1_BLOCK = 1024  # bytes of packed e2m1 tokens a program of the e2m1 conversion


@dataclass(frozen=True, eq=False)
class _RowScalesPlan:
    """decode_row_scales planned for one problem: its output's shape, the kernel's scalar
    arguments (after the tensors), its constexprs and its parts a slot (0: nothing to launch)."""

    shape: tuple[int, int]
    scalars: tuple
    consts: dict
    parts: int
    swizzled: bool

    @classmethod
    def of(cls, p: GroupedProblem, scale_blocks: int, device: torch.device, pad_stages: bool, kb_major: bool,
           stage_blocks: int, column_block: int) -> _RowScalesPlan:
        num_kb = p.num_k_scales
        columns = stage_blocks * (math.ceil(num_kb / stage_blocks) + 1) if pad_stages else num_kb
        if kb_major:
            m_pad = kb_major_columns(p.m, p.num_groups, column_block)
            shape, row_stride, kb_stride = (columns, m_pad), 1, m_pad
        else:
            shape, row_stride, kb_stride = (p.m, columns), columns, 1
        swizzled = p.scale_layout.swizzled
        block_m = 32
        parts = 0
        if p.num_groups and p.m:
            parts = max(1, min(math.ceil(p.m / block_m), math.ceil(4 * num_programs(device, 1 << 30, 1) / p.num_groups)))
        scalars = (p.m, p.num_experts, p.num_groups, num_kb, math.ceil(num_kb / 4),
                   scale_blocks * 128 if swizzled else p.m, columns, row_stride, kb_stride, p.n)
        consts = dict(SWIZZLED=swizzled, ALIGN_GROUPS=column_block if kb_major else 0, BLOCK_M=block_m, BLOCK_KB=64)
        return cls(shape, scalars, consts, parts, swizzled)

    def tensors(self, a_scales, a_offsets, expert_ids, a_scale_offsets, out, c) -> tuple:
        """The kernel's tensor arguments (a_scale_offsets made here where swizzled and not given)."""
        if self.swizzled and a_scale_offsets is None and self.parts:
            a_scale_offsets = layouts.a_scale_offsets(a_offsets)  # (device ops, no host read)
        return (as_bytes(a_scales), a_offsets, expert_ids, a_scale_offsets if a_scale_offsets is not None else a_offsets,
                out, c)


class _Fill(NamedTuple):
    """A pre-pass's launch that also zeroes the product's fresh output (module docstring): its
    launch key, grid and constexprs, and its kernel's launches under that key."""

    key: tuple
    grid: tuple
    consts: dict
    site: LaunchSite


def _fill(p: GroupedProblem, fn, key: tuple, grid: tuple, consts: dict) -> _Fill:
    """The filling launch of a pre-pass of `grid` over the [M, N] output's BLOCK_M-row blocks:
    programs (G + i, part) take block i * parts + part of a (slot, part) grid, the programs after
    the listed ones of a 1-D grid one block each (an output of no element: the launch itself)."""
    if not (p.m and p.n):
        return _Fill(key, grid, consts, site(fn, key))
    blocks = math.ceil(p.m / consts["BLOCK_M"])
    if len(grid) == 2:
        parts = max(grid[1], 1)
        fill_grid = (p.num_groups + math.ceil(blocks / parts), parts)
    else:
        fill_grid = (grid[0] + blocks, )
    return _Fill((*key, "fill"), fill_grid, dict(consts, FILL=True), site(fn, (*key, "fill")))


@dataclass(frozen=True, eq=False)
class TokenPass:
    """The pre-pass of one problem's tokens, planned (plan_tokens). run() returns (token scales or
    None, tokens) as the problem's sm90 kernel reads them."""

    kind: str  # "dequantize", "row scales" or "e2m1" (module docstring)
    problem: GroupedProblem
    interpret: bool
    key: tuple
    site: LaunchSite | None  # its kernel's launches under key (None: no pass, bf16 tokens as they are)
    grid: tuple
    scalars: tuple
    consts: dict
    row_scales: _RowScalesPlan | None = None
    even_odd: bool = False  # ("row scales": w4a8's tokens reordered as even_odd_k)
    fill: _Fill | None = None  # its launch that zeroes a fresh output too (None: the pass cannot)

    def run(self, a, a_scales, a_offsets, expert_ids, a_scale_offsets,
            fresh_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """fresh_out: the product's [M, N] output (contiguous, of the problem's out_dtype), whose
        rows no valid slot owns the same launch zeroes (ValueError where self.fill is None)."""
        p, runs, grid, consts = self.problem, self.site, self.grid, self.consts
        if fresh_out is not None:
            if self.fill is None:
                raise ValueError(f"fresh_out: the {self.kind} pre-pass of this problem zeroes no output "
                                 f"(M={p.m}, N={p.n}, fmt={p.fmt.name})")
            _, grid, consts, runs = self.fill
        if self.kind == "dequantize":
            if runs is None:  # (the weight-only formats' bf16 tokens are the kernel's already)
                return None, a
            out = torch.empty(p.m, p.k, dtype=torch.bfloat16, device=a.device)
            if grid[0] and grid[1]:
                if self.consts["SWIZZLED"] and a_scale_offsets is None:
                    a_scale_offsets = layouts.a_scale_offsets(a_offsets)
                runs.launch(grid, (
                    as_bytes(a), as_bytes(a_scales), a_offsets, expert_ids,
                    a_scale_offsets if a_scale_offsets is not None else a_offsets, out,
                    fresh_out if fresh_out is not None else out, *self.scalars), consts)
            return None, out
        rows = self.row_scales
        scales = torch.empty(*rows.shape, dtype=torch.float32, device=a_scales.device)
        scale_args = rows.tensors(a_scales, a_offsets, expert_ids, a_scale_offsets, scales,
                                  fresh_out if fresh_out is not None else scales)
        if self.kind == "row scales" and not self.even_odd:
            if grid[0] and grid[1]:
                runs.launch(grid, (*scale_args, *rows.scalars), consts)
            return scales, a
        # token_prepass_kernel: the scales and the tokens in one launch, e2m1 bytes re-encoded as
        # e4m3, or w4a8's e4m3 tokens (byte pairs) in the even/odd order
        if self.kind == "e2m1":
            source = as_bytes(a.contiguous())
            tokens = torch.empty(p.m, p.k, dtype=torch.float8_e4m3fn, device=a.device)  # (a: [M, K/2] bytes)
        else:
            source = a.contiguous().view(torch.int16)
            tokens = torch.empty(p.m, p.k, dtype=a.dtype, device=a.device)
        if grid[0]:
            runs.launch(grid, (*scale_args, source, tokens.view(torch.uint8), *rows.scalars, *self.scalars), consts)
        return scales, tokens


def plan_tokens(p: GroupedProblem, kind: str, device: torch.device, scale_blocks: int, *, pad_stages: bool = False,
                kb_major: bool = False, stage_blocks: int = 4, column_block: int = 4, exponent: int = 0,
                even_odd: bool = False) -> TokenPass:
    """The pre-pass `kind` (module docstring) of problem p's tokens on `device`; scale_blocks: the
    first dimension of A's scales (their 128-row blocks where swizzled). The row-scale options
    are decode_row_scales', exponent and even_odd e2m1_to_e4m3's."""
    interpret = device.type == "cpu"
    if kind == "dequantize":
        f = p.fmt
        swizzled = p.scale_layout.swizzled
        block_m, block_k = (32, 128) if not interpret else (64, 128)
        # Enough programs to fill the GPU whatever the group sizes: parts per slot.
        parts = 0
        if p.num_groups and p.m:
            parts = max(1, min(math.ceil(p.m / block_m), math.ceil(4 * num_programs(device, 1 << 30, 1) / p.num_groups)))
        codes = format_constexprs(f, swizzled, False, interpret)
        num_kb = p.num_k_scales
        scalars = (p.m, p.k, p.num_experts, p.num_groups, num_kb, math.ceil(num_kb / 4),
                   scale_blocks * 128 if swizzled else p.m, p.n)
        consts = dict(A_ELEM=codes["A_ELEM"], SCALE=codes["A_SCALE"], VEC=f.scale_vec,
                      SWIZZLED=swizzled, INTERPRETED=interpret, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)
        key, grid = (p.key, scale_blocks, interpret), (p.num_groups, parts)
        if not f.a_scaled:  # (the weight-only formats' bf16 tokens are the kernel's already: no pass)
            return TokenPass(kind, p, interpret, key, None, grid, scalars, consts)
        fn = kernel_module(interpret).dequantize_rows_kernel
        return TokenPass(kind, p, interpret, key, site(fn, key), grid, scalars, consts,
                         fill=_fill(p, fn, key, grid, consts))
    rows = _RowScalesPlan.of(p, scale_blocks, device, pad_stages, kb_major, stage_blocks, column_block)
    row_key = (p.key, scale_blocks, *rows.scalars[-4:], *rows.consts.values())
    module = kernel_module(interpret)
    if kind == "row scales" and not even_odd:
        fn, grid, consts = module.decode_row_scales_kernel, (p.num_groups, rows.parts), dict(rows.consts, num_warps=4)
        return TokenPass(kind, p, interpret, row_key, site(fn, row_key), grid, (), consts, rows,
                         fill=_fill(p, fn, row_key, grid, consts))
    if kind not in ("row scales", "e2m1"):
        raise ValueError(f"kind: expected 'dequantize', 'row scales' or 'e2m1', got {kind!r}")
    # token_prepass_kernel: e2m1 tokens as bytes, or (w4a8, "row scales" in the even/odd order)
    # e4m3 tokens as byte pairs; K/2 of either a row
    packed = kind == "e2m1"
    _check_e2m1_to_e4m3(p.k // 2, exponent, even_odd)
    units = p.m * (p.k // 2)
    programs = p.num_groups * rows.parts + math.ceil(units / _E2M1_BLOCK)
    fn, key, grid = module.token_prepass_kernel, (*row_key, exponent, even_odd, packed, rows.parts), (programs, )
    consts = dict(rows.consts, EXP=exponent, EVEN_ODD=even_odd, BLOCK=_E2M1_BLOCK, PACKED=packed, num_warps=4)
    return TokenPass(kind, p, interpret, key, site(fn, key), grid, (max(rows.parts, 1), units), consts, rows,
                     even_odd, _fill(p, fn, key, grid, consts))


def dequantize_rows(p: GroupedProblem, a, a_scales, a_offsets, expert_ids, a_scale_offsets) -> torch.Tensor:
    """bf16 [M, K]: the rows of every valid slot of A decoded and scaled (exact, see
    dequantize_rows_kernel); rows outside them are left unwritten. The MX/NV sm90 kernel reads
    its tokens from here. Unscaled bf16 activations (the weight-only formats') are those tokens
    already: `a` itself is returned."""
    scale_blocks = a_scales.shape[0] if a_scales is not None else 0
    return plan_tokens(p, "dequantize", a.device, scale_blocks).run(a, a_scales, a_offsets, expert_ids,
                                                                   a_scale_offsets)[1]


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
    plan = plan_tokens(p, "row scales", a_scales.device, a_scales.shape[0], pad_stages=pad_stages, kb_major=kb_major,
                       stage_blocks=stage_blocks, column_block=column_block)
    return plan.run(None, a_scales, a_offsets, expert_ids, a_scale_offsets)[0]


def token_prepass(p: GroupedProblem, a, a_scales, a_offsets, expert_ids, a_scale_offsets, pad_stages: bool = False,
                  kb_major: bool = False, stage_blocks: int = 4, exponent: int = 0,
                  even_odd: bool = False, column_block: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode_row_scales(...), e2m1_to_e4m3(a, exponent, even_odd)) in one launch: the two
    pre-passes of packed e2m1 tokens before the sm90 promotion kernel (kernels/sm90/e2m1.py),
    one launch less before each product (~2 us each at decode, H100)."""
    _check_e2m1_to_e4m3(a.shape[-1], exponent, even_odd)
    plan = plan_tokens(p, "e2m1", a.device, a_scales.shape[0], pad_stages=pad_stages, kb_major=kb_major,
                       stage_blocks=stage_blocks, column_block=column_block, exponent=exponent, even_odd=even_odd)
    return plan.run(a, a_scales, a_offsets, expert_ids, a_scale_offsets)


def e2m1_to_e4m3(a: torch.Tensor, exponent: int = 0, even_odd: bool = False) -> torch.Tensor:
    """Packed e2m1 [R, K/2] (uint8, element 2i in the low nibble) -> e4m3 [R, K] of the values
    times 2^exponent (0..6), exact (every e2m1 value times 2^0..2^6 is an e4m3 value; see
    e2m1_to_e4m3_kernel): mxfp4 tokens for the fp8 tensor cores (kernels/sm90/e2m1.py, which
    takes them times 2^6, even_odd). even_odd: within each group of 8 elements of K the order
    is 0, 2, 4, 6, 1, 3, 5, 7 (see even_odd_k). Every row is converted, so no slot data is read
    on the host."""
    _check_e2m1_to_e4m3(a.shape[-1], exponent, even_odd and a.numel() > 0)  # (no rows, no groups to check)
    out = torch.empty(*a.shape[:-1], 2 * a.shape[-1], dtype=torch.float8_e4m3fn, device=a.device)
    num_bytes = a.numel()
    if num_bytes == 0:
        return out
    launch(kernel_module(a.device.type == "cpu").e2m1_to_e4m3_kernel, (num_bytes, exponent, even_odd),
           (math.ceil(num_bytes / _E2M1_BLOCK), ), (as_bytes(a.contiguous()), out.view(torch.uint8), num_bytes),
           dict(EXP=exponent, EVEN_ODD=even_odd, BLOCK=_E2M1_BLOCK, num_warps=4))
    return out


def _check_e2m1_to_e4m3(row_bytes: int, exponent: int, even_odd: bool):
    if not 0 <= exponent <= 6:
        raise ValueError(f"exponent must be in 0..6 (e4m3 holds 6 * 2^6 = 384), got {exponent}")
    if even_odd and row_bytes % 4:
        raise ValueError(f"even_odd needs rows of whole 8-element groups, got {2 * row_bytes} elements")


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
