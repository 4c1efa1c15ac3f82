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
from typing import NamedTuple

import torch

from .. import layouts
from ..formats import E2M1, E4M3, Format, get_format
from ..quantized_tensor import QuantizedTensor, a_operand_storage, a_operand_views
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
    kind = device.type
    return kind == "cuda" or (kind == "cpu" and tl_source.interpreter_usable())


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


class RowsLaunch(NamedTuple):
    """What quantize_rows needs of one launch shape, from host values alone (rows_launch): the
    output's storage, the kernel's grid, sizes, launch key and constexprs, and the scatter form's
    scale move."""

    swizzled: bool  # the output's scales placed by slot (the swizzled layout, a scaled A operand)
    derive_scale_offsets: bool  # a_scale_offsets made from a_offsets (not given)
    data: tuple  # (shape, dtype) of the data the kernel writes (bytes for fp8 and e2m1)
    data_view: torch.dtype | None  # the data's dtype in the result (None: as written)
    scales: tuple | None  # (shape, dtype, zeroed) of the scales the kernel writes
    scales_view: torch.dtype | None  # the scales' dtype in the result
    scale_bytes: tuple | None  # (shape) of the scatter form's byte scales, moved by kb_major_scales_kernel
    pair_words: bool  # bf16 x read as int32 words (the kernel's PAIR_WORDS)
    kernel: tuple | None  # (kernel, grid, sizes, key, constexprs) of activation_quantize_kernel; None: no launch
    move: tuple | None  # (kernel, grid, sizes, key, constexprs) of kb_major_scales_kernel


@functools.lru_cache(maxsize=1024)
def rows_launch(fmt: str, cuda: bool, rows: int, x_rows: int, x_stride: int, bf16_pairs: bool, act: str | None,
                concat: bool,
                k_out: int, src_rows: bool, bias: bool, num_groups: int | None, expert_ids: bool, a_scale_offsets: bool,
                global_scale: bool, scale_layout: layouts.ScaleLayout, num_scale_blocks: int | None,
                topk: int) -> RowsLaunch:
    """The launch of quantize_rows for these host values (its arguments as they are, each tensor by
    whether it is given; act: None (the gather) or the activation's name; num_groups None: no a_offsets; bf16_pairs: x is bf16, contiguous, at an
    even element offset), made once. ValueError where a_offsets (and expert_ids for a bias) are
    missing where the output needs them."""
    f = get_format(fmt)
    module = kernel_module(not cuda)
    out_code, vec, nb = output_code(f, module)
    act = {None: module.ACT_NONE, "swiglu": module.ACT_SWIGLU, "swiglu_oai": module.ACT_SWIGLU_OAI}[act].value
    op = f.a
    form = scale_layout.form
    swizzled = scale_layout.swizzled and op.scale is not None
    has_offsets = num_groups is not None
    if (swizzled or bias or form is not None) and (not has_offsets or (bias and not expert_ids)):
        raise ValueError("a_offsets: required (with expert_ids for a bias) to place rows in their groups")
    num_groups = num_groups or 0
    nkb = math.ceil(k_out / op.block_k) if op.scale is not None else 0
    form_code, m_pad = 0, 0
    if form is None:
        data, scales, num_scale_rows = a_operand_storage(f, rows, k_out, swizzled, num_scale_blocks, num_groups)
        # Zeroed where the kernel leaves entries unwritten: the swizzled layout's padding and rows
        # of no slot, the scatter form's rows of dropped choices. Plain scales of every other
        # launch are all written (each row < rows, each K block): no fill.
        scales = None if scales is None else (*scales, swizzled or bool(topk))
        data_view, scales_view = a_operand_views(f)
    else:
        # (the form's scale columns follow a_offsets; its formats have no global scale)
        num_scale_rows, a_scale_offsets, global_scale, scales_view = 0, False, False, None
        if form.kind == "bf16":
            form_code, data, scales, data_view = module.FORM_BF16.value, ((rows, k_out), torch.bfloat16), None, None
        else:
            form_code, m_pad = module.FORM_E4M3.value, kb_major_columns(rows, num_groups, form.column_block)
            data, scales = ((rows, k_out), torch.uint8), ((nkb, m_pad), torch.float32, False)
            data_view = torch.float8_e4m3fn
    # bf16 pairs are read as one int32 word each (the kernel's PAIR_WORDS): interleaved gate/up
    # pairs; and the gather's pairs of elements into bf16 or e2m1 operands, where that takes fewer
    # instructions (sm_90 SASS, bench/quantize_sass.py: nvfp4 25.7 -> 22.5 an element; e4m3 outputs
    # take more, their blocks spread over more threads).
    gather_words = act == module.ACT_NONE.value and form is None and op.element is not E4M3
    pair_words = (gather_words or (act != module.ACT_NONE.value and not concat)) and bf16_pairs
    if pair_words:
        x_stride //= 2  # (of x seen as int32 words)
    # The scatter form stores its scales as bytes by grouped row, then moves them (module docstring
    # of _activation_tl.py, kb_major_scales_kernel).
    scale_bytes = move = kernel = None
    if topk and form_code == module.FORM_E4M3.value and rows and nkb:
        scale_bytes = (rows, nkb)
        move = (module.kb_major_scales_kernel, (math.ceil(rows / SCALE_MOVE_ROWS), math.ceil(nkb / SCALE_MOVE_BLOCKS)),
                (rows, num_groups, nkb, m_pad), (rows, num_groups, nkb, m_pad, form.column_block),
                dict(COLUMN_BLOCK=form.column_block, BLOCK_R=SCALE_MOVE_ROWS, BLOCK_KB=SCALE_MOVE_BLOCKS, num_warps=4))
    if rows and k_out:
        block_m = cuda_block_m(rows, act == module.ACT_NONE.value and not topk) if cuda else 32
        # (the scatter form's programs take tokens, each stored to its topk grouped rows)
        row_tiles = math.ceil((x_rows if topk else rows) / block_m)
        grid = (math.ceil(k_out / (nb * vec)), min(row_tiles, MAX_GRID_Y), math.ceil(row_tiles / MAX_GRID_Y))
        sizes = (rows, x_rows, x_stride, k_out, num_groups, nkb, math.ceil(nkb / 4), num_scale_rows, m_pad)
        consts = dict(
            ACT=act, CONCAT=concat, OUT=out_code, SWIZZLED=swizzled, GATHER=src_rows,
            HAS_BIAS=bias, LOG_G=max(num_groups, 1).bit_length() + 1,
            BLOCK_M=block_m, NB=nb, VEC=vec, FORM=form_code, EXP=form.exponent if form else 0,
            EVEN_ODD=bool(form and form.even_odd), TOPK=topk, TOPK_P2=1 << (max(topk, 1) - 1).bit_length(),
            PAIR_WORDS=pair_words, COLUMN_BLOCK=form.column_block if form else 4,
            num_warps=CUDA_WARPS if cuda else 4)
        derived = swizzled and not a_scale_offsets  # (made from a_offsets for the launch)
        given = (not expert_ids, not has_offsets, not (a_scale_offsets or derived), not global_scale,
                 scales is None, scale_bytes is None)
        kernel = (module.activation_quantize_kernel, grid, sizes, (sizes, given, *consts.values()), consts)
    return RowsLaunch(swizzled, swizzled and not a_scale_offsets, data, data_view, scales,
                      scales_view, scale_bytes, pair_words, kernel, move)


def quantize_rows(x, f: Format, *, rows, src_rows, act, concat, k_out, bias, a_offsets, expert_ids, a_scale_offsets,
                  scale_layout, num_scale_blocks, global_scale, alpha, limit, topk: int = 0) -> QuantizedTensor:
    """One launch of the activation kernel into fresh storage of format f's A operand in scale_layout
    (a ScaleLayout: PLAIN, SWIZZLED, or a TokenForm): act None gathers the rows of x (through
    src_rows where given; into topk grouped rows each in the scatter form), an activation's name
    ("swiglu", "swiglu_oai") applies it to gate/up rows. The token quantizers have checked the
    arguments; the host values are planned once (rows_launch)."""
    device = x.device
    plan = rows_launch(f.name, device.type == "cuda", rows, x.shape[0], x.stride(0),
                       x.dtype == torch.bfloat16 and x.is_contiguous() and x.storage_offset() % 2 == 0, act, concat,
                       k_out, src_rows is not None, bias is not None,
                       None if a_offsets is None else a_offsets.numel() - 1, expert_ids is not None,
                       a_scale_offsets is not None, global_scale is not None, scale_layout, num_scale_blocks, topk)
    form = scale_layout.form
    if plan.derive_scale_offsets:
        a_scale_offsets = layouts.a_scale_offsets(a_offsets)
    if form is not None:  # (the form's scale columns follow a_offsets; its formats have no global scale)
        a_scale_offsets = global_scale = None
    # (sizes unpacked: torch parses ints faster than a tuple)
    data = torch.empty(*plan.data[0], dtype=plan.data[1], device=device)
    scales = None
    if plan.scales is not None:
        shape, dtype, zeroed = plan.scales
        scales = (torch.zeros if zeroed else torch.empty)(*shape, dtype=dtype, device=device)
    scale_bytes = None if plan.scale_bytes is None else torch.empty(*plan.scale_bytes, dtype=torch.uint8,
                                                                    device=device)
    if plan.kernel is not None:
        kernel, grid, sizes, key, consts = plan.kernel
        dummy = data
        launch(kernel, key, grid, (
            x.view(torch.int32) if plan.pair_words else x, src_rows if src_rows is not None else dummy,
            bias if bias is not None else dummy, expert_ids if expert_ids is not None else dummy,
            a_offsets if a_offsets is not None else dummy, a_scale_offsets if a_scale_offsets is not None else dummy,
            global_scale if global_scale is not None else dummy, data, scales if scales is not None else dummy,
            scale_bytes if scale_bytes is not None else dummy, *sizes, float(alpha), float(limit)), consts)
    if plan.move is not None:
        kernel, grid, sizes, key, consts = plan.move
        launch(kernel, key, grid,
               (scale_bytes, expert_ids, a_offsets, scales, *sizes), consts)
    if plan.data_view is not None:
        data = data.view(plan.data_view)
    if plan.scales_view is not None:
        scales = scales.view(plan.scales_view)
    if form is not None:
        return QuantizedTensor(data, scales, f.name, "a", form, None, a_offsets)
    if not plan.swizzled:
        return QuantizedTensor(data, scales, f.name, "a", layouts.PLAIN, global_scale if f.a.global_scale else None)
    return QuantizedTensor(data, scales, f.name, "a", layouts.SWIZZLED, global_scale if f.a.global_scale else None,
                           a_offsets, a_scale_offsets)


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
