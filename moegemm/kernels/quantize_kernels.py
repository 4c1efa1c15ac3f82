"""Host side of the row quantizer kernels (_activation_tl.py; the tokens' amax, _amax_tl.py):
compiled for CUDA tensors, Triton's interpreter for CPU tensors.

    quantize_rows(x, f, ...)     one launch of activation_quantize_kernel (a gather, a scatter or a
                                 SwiGLU in front of the quantizer) into fresh storage of fmt's A
                                 operand or of a token form; the scatter form's scales then moved
                                 by kb_major_scales_kernel

No device value is read on the host. The arguments are checked by the callers
(moegemm/token_quantizers.py).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from .. import layouts
from ..formats import E2M1, E4M3, Format
from ..quantized_tensor import QuantizedTensor, allocate_a_operand, as_quantized
from ..token_forms import kb_major_columns
from . import tl_source
from .compiled_launch import launch

_SOURCE = Path(__file__).with_name("_activation_tl.py")
_AMAX_SOURCE = Path(__file__).with_name("_amax_tl.py")
# Rows per program of the activation kernel on the GPU (x 128 output columns): 16, and 4 up to
# 2048 rows, where more programs hide the latency (gpt-oss SwiGLU + MXFP4 at 256 rows: 9.7 ->
# 8.4 us; 4 rows 3.6 -> 2.8 us; H100).
CUDA_BLOCK_M = 16
CUDA_SMALL_BLOCK_M = 4
# The gather (no activation, a program a row tile) above 2048 rows: 32 rows, 32 elements a
# thread, which halves the program's and the blocks' fixed work an element (sm_90 SASS,
# bench/quantize_sass.py: nvfp4 28.6 -> 25.7 instructions an element, mxfp8 swizzled 16.7 ->
# 11.1). Not the scatter form, latency-bound, whose programs take tokens (k rows each).
CUDA_GATHER_BLOCK_M = 32
CUDA_WARPS = 4
# CUDA's limit on a grid's second and third dimensions.
MAX_GRID_Y = 65535
# Tile of absolute_max_bits_kernel (nvfp4's default global scale): rows x columns.
AMAX_ROWS, AMAX_COLUMNS = 16, 1024
# Tile of kb_major_scales_kernel (the scatter form's scale move): rows x scale blocks.
SCALE_MOVE_ROWS = 64
SCALE_MOVE_BLOCKS = 32


@functools.cache
def kernel_module(interpret: bool):
    """_activation_tl.py compiled (interpret=False) or for the CPU interpreter (kernels/tl_source.py)."""
    return tl_source.load(_SOURCE, interpret)


@functools.cache
def amax_module(interpret: bool):
    """_amax_tl.py (absolute_max_bits_kernel) compiled or for the CPU interpreter."""
    return tl_source.load(_AMAX_SOURCE, interpret)


def kernel_usable(device: torch.device) -> bool:
    """Whether the kernels run on `device`: compiled on CUDA, interpreted on the CPU where usable."""
    return device.type == "cuda" or (device.type == "cpu" and tl_source.interpreter_usable())


def output_code(f: Format, module) -> tuple[int, int, int]:
    """(OUT code, scale block VEC, scale blocks per program NB) of format f's A operand."""
    op = f.a
    if op.scale is None:
        return module.OUT_BF16.value, 32, 4
    if op.scale == "fp32":
        return module.OUT_FP8_BLOCK.value, 128, 1
    if op.element is E4M3:
        return module.OUT_E4M3_E8M0.value, op.block_k, 4
    if op.element is E2M1 and op.scale == "e8m0":
        return module.OUT_E2M1_E8M0.value, op.block_k, 4
    return module.OUT_E2M1_E4M3.value, op.block_k, 8


def quantize_rows(x, f: Format, *, rows, src_rows, act, concat, k_out, bias, a_offsets, expert_ids, a_scale_offsets,
                  scale_layout, num_scale_blocks, global_scale, alpha, limit, topk: int = 0) -> QuantizedTensor:
    """One launch of the activation kernel into fresh storage of format f's A operand in scale_layout
    (a ScaleLayout: PLAIN, SWIZZLED, or a TokenForm); the token quantizers have checked the
    arguments."""
    device = x.device
    module = kernel_module(device.type != "cuda")
    out_code, vec, nb = output_code(f, module)
    op = f.a
    form = scale_layout.form
    swizzled = scale_layout.swizzled and op.scale is not None
    if (swizzled or bias is not None or form is not None) and (
            a_offsets is None or (bias is not None and expert_ids is None)):
        raise ValueError("a_offsets: required (with expert_ids for a bias) to place rows in their groups")
    num_groups = 0 if a_offsets is None else a_offsets.numel() - 1
    if swizzled and a_scale_offsets is None:
        a_scale_offsets = layouts.a_scale_offsets(a_offsets)
    nkb = math.ceil(k_out / op.block_k) if op.scale is not None else 0
    form_code, m_pad = 0, 0
    if form is None:
        data, scales, num_scale_rows = allocate_a_operand(f, rows, k_out, swizzled, num_scale_blocks,
                                                          num_groups, device)
    else:
        # (the form's scale columns follow a_offsets; its formats have no global scale)
        num_scale_rows, a_scale_offsets, global_scale = 0, None, None
        if form.kind == "bf16":
            form_code = module.FORM_BF16.value
            data, scales = torch.empty(rows, k_out, dtype=torch.bfloat16, device=device), None
        else:
            form_code, m_pad = module.FORM_E4M3.value, kb_major_columns(rows, num_groups, form.column_block)
            data = torch.empty(rows, k_out, dtype=torch.uint8, device=device)
            scales = torch.empty(nkb, m_pad, dtype=torch.float32, device=device)
    # bf16 pairs are read as one int32 word each (the kernel's PAIR_WORDS): interleaved gate/up
    # pairs; and the gather's pairs of elements into bf16 or e2m1 operands, where that takes fewer
    # instructions (sm_90 SASS, bench/quantize_sass.py: nvfp4 25.7 -> 22.5 an element; e4m3 outputs
    # take more, their blocks spread over more threads).
    gather_words = act == module.ACT_NONE.value and form is None and op.element is not E4M3
    pair_words = ((gather_words or (act != module.ACT_NONE.value and not concat)) and x.dtype == torch.bfloat16
                  and x.is_contiguous() and x.storage_offset() % 2 == 0)
    if pair_words:
        x = x.view(torch.int32)
    # The scatter form stores its scales as bytes by grouped row, then moves them (module docstring
    # of _activation_tl.py, kb_major_scales_kernel).
    scale_bytes = None
    if topk and form_code == module.FORM_E4M3.value and rows and nkb:
        scale_bytes = torch.empty(rows, nkb, dtype=torch.uint8, device=device)
    if rows and k_out:
        dummy = data
        block_m = cuda_block_m(rows, act == module.ACT_NONE.value and not topk) if device.type == "cuda" else 32
        # (the scatter form's programs take tokens, each stored to its topk grouped rows)
        row_tiles = math.ceil((x.shape[0] if topk else rows) / block_m)
        grid = (math.ceil(k_out / (nb * vec)), min(row_tiles, MAX_GRID_Y), math.ceil(row_tiles / MAX_GRID_Y))
        sizes = (rows, x.shape[0], x.stride(0), k_out, num_groups, nkb, math.ceil(nkb / 4), num_scale_rows, m_pad)
        consts = dict(
            ACT=act, CONCAT=concat, OUT=out_code, SWIZZLED=swizzled, GATHER=src_rows is not None,
            HAS_BIAS=bias is not None, LOG_G=max(num_groups, 1).bit_length() + 1,
            BLOCK_M=block_m, NB=nb, VEC=vec, FORM=form_code, EXP=form.exponent if form else 0,
            EVEN_ODD=bool(form and form.even_odd), TOPK=topk, TOPK_P2=1 << (max(topk, 1) - 1).bit_length(),
            PAIR_WORDS=pair_words, COLUMN_BLOCK=form.column_block if form else 4,
            num_warps=CUDA_WARPS if device.type == "cuda" else 4)
        given = (expert_ids is None, a_offsets is None, a_scale_offsets is None, global_scale is None, scales is None,
                 scale_bytes is None)
        launch(module.activation_quantize_kernel, (sizes, given, *consts.values()), grid, (
            x, src_rows if src_rows is not None else dummy, bias if bias is not None else dummy,
            expert_ids if expert_ids is not None else dummy, a_offsets if a_offsets is not None else dummy,
            a_scale_offsets if a_scale_offsets is not None else dummy,
            global_scale if global_scale is not None else dummy,
            data, scales if scales is not None else dummy, scale_bytes if scale_bytes is not None else dummy,
            *sizes, float(alpha), float(limit)), consts)
    if scale_bytes is not None:
        grid = (math.ceil(rows / SCALE_MOVE_ROWS), math.ceil(nkb / SCALE_MOVE_BLOCKS))
        launch(module.kb_major_scales_kernel, (rows, num_groups, nkb, m_pad, form.column_block), grid,
               (scale_bytes, expert_ids, a_offsets, scales, rows, num_groups, nkb, m_pad),
               dict(COLUMN_BLOCK=form.column_block, BLOCK_R=SCALE_MOVE_ROWS, BLOCK_KB=SCALE_MOVE_BLOCKS, num_warps=4))
    if form is not None:
        if form.kind == "e4m3":
            data = data.view(torch.float8_e4m3fn)
        return QuantizedTensor(data, scales, f.name, "a", form, None, a_offsets)
    return as_quantized(f, data, scales, swizzled, global_scale, a_offsets, a_scale_offsets)


def tokens_amax_bits(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) of the tokens x [R, K] as fp32 bits (int32 [1]; a NaN wins): one pass of
    absolute_max_bits_kernel, no copy of x."""
    module = amax_module(x.device.type != "cuda")
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    rows, k = x.shape
    grid = (math.ceil(rows / AMAX_ROWS), math.ceil(k / AMAX_COLUMNS))
    launch(module.absolute_max_bits_kernel, ("amax", x.dtype, rows, k, x.stride(0)), grid,
           (x, bits, rows, k, x.stride(0)), {"BLOCK_R": AMAX_ROWS, "BLOCK_K": AMAX_COLUMNS, "num_warps": 4})
    return bits


def cuda_block_m(rows: int, gather: bool) -> int:
    """BLOCK_M of the activation kernel on CUDA for `rows` output rows: of the gather (no
    activation, not the scatter form) or another step."""
    if rows <= 2048:
        return CUDA_SMALL_BLOCK_M
    return CUDA_GATHER_BLOCK_M if gather else CUDA_BLOCK_M
