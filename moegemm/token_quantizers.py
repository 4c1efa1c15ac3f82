"""The token quantizers: rows of tokens into a format's A operand, one kernel pass each.

    quantize(x, fmt)                 x quantized into fmt's A operand (moegemm.quantize)
    gather_quantize(x, fmt, rows)    x[rows] quantized into fmt's A operand (routing's gather)
    scatter_quantize(x, fmt, ...)    the same, each token read once and stored to its k rows
    swiglu_quantize(h, fmt)          the activation of a gate/up product (gate_up.py), quantized
                                     into fmt's A operand

The quantizers run one Triton kernel (kernels/quantize_kernels.py) on CUDA and, through
Triton's interpreter, on the CPU (`quantize` there only when asked: backend="triton"); their
bytes equal quantize.reference_quantize's (PyTorch: moegemm.reference.quantize) of the same
fp32 rows.
The A operand of bf16 and of the weight-only formats (bf16_mxfp4, bf16_nvfp4, bf16_mxfp8) is
the rows rounded to bf16, without scales.
Given a TokenForm as scale_layout they write the tokens in the form the next product's sm90
kernel reads instead (token_forms.py), as a QuantizedTensor of that layout.
torch.compile traces gather_quantize and swiglu_quantize as one op each (library.py).
"""

from __future__ import annotations

import math
import operator

import torch

from . import layouts
from .compile_boundary import traced_as
from .formats import get_format
from .gate_up import check_activation, reference_activation, slot_rows
from .kernels import quantize_kernels as kernels
from .kernels import tl_source
from .quantize import check_activations, check_scale_layout, nvfp4_global_scale, reference_quantize
from .quantized_tensor import QuantizedTensor
from .token_forms import FORM_FORMATS, TokenForm, kb_major_columns

__all__ = ["QUANTIZE_BACKENDS", "gather_quantize", "quantize", "scatter_quantize", "swiglu_quantize"]


def tokens_global_scale(x: torch.Tensor) -> torch.Tensor:
    """nvfp4's default global scale of the tokens x [R, K] (quantize.nvfp4_global_scale(x)): where
    the kernels run, its amax in one pass of a kernel, no copy of x."""
    if x.numel() and kernels.kernel_usable(x.device):
        x = kernels.tokens_amax_bits(x).view(torch.float32).reshape(())  # (then the rule, on the amax)
    return nvfp4_global_scale(x)


def _check_rows_input(x: torch.Tensor, name: str):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected [rows, columns], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride along columns, got strides {x.stride()}")


def _check_index(t: torch.Tensor | None, name: str, device, numel: int | None = None):
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}: expected {numel} entries, got {t.numel()}")


def _prepare_common(device, fmt, scale_layout, a_offsets, global_scale):
    """(format, ScaleLayout, global scale as a 0-d fp32 tensor or None) of a quantizer's call, after
    the checks of its index tensors."""
    f = get_format(fmt)
    layout = check_scale_layout(f, scale_layout, forms=True)
    if layout.form is not None:
        _check_form(device, f, layout.form, a_offsets)
    if global_scale is not None:
        global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale: expected one value, got {global_scale.numel()}")
        global_scale = global_scale.reshape(())  # a tensor-wide scalar, as quantize returns it
    return f, layout, global_scale


def _check_form(device, f, form: TokenForm, a_offsets):
    """A token form (token_forms.py) that the kernels can write for format f."""
    if f.name not in FORM_FORMATS:
        raise ValueError(f"scale_layout: token forms exist for {', '.join(FORM_FORMATS)}, not {f.name}")
    if form.kind not in ("e4m3", "bf16"):
        raise ValueError(f"scale_layout: a TokenForm of kind 'e4m3' or 'bf16', got {form.kind!r}")
    if form.kind == "e4m3":
        kb_major_columns(0, 0, form.column_block)  # (ValueError naming column_block)
    if a_offsets is None:
        raise ValueError("a_offsets: required to place rows in a token form")
    if not kernels.kernel_usable(device):
        raise ValueError(f"scale_layout: token forms are written by the Triton kernels, which cannot run on {device}"
                         + tl_source.interpreter_note(device))


QUANTIZE_BACKENDS = ("auto", "reference", "triton")


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    scale_layout: str = "plain",
    a_offsets: torch.Tensor | None = None,
    num_scale_blocks: int | None = None,
    global_scale: torch.Tensor | float | None = None,
    backend: str = "auto",
) -> QuantizedTensor:
    """Quantize activations [M, K] into the A operand of `fmt` (docs/contract.md section 3).

    On a CUDA tensor one pass of the activation kernel (gather_quantize's, reading x once): the
    bytes of the PyTorch quantizer (moegemm.reference.quantize) bit for bit, no host read, so
    that it captures in a CUDA graph; torch.compile traces it as one op.
    scale_layout="swizzled" places each group's scale rows by `a_offsets` (required); rows
    outside every slot get no scales, and entries that hold no scale are zero. num_scale_blocks:
    the first dimension of swizzled scales, at least the blocks the groups need; left out, the
    kernel takes the bound ceil(M / 128) + G (no device value read; the blocks past the groups
    zero) and the reference the exact count (reading a_offsets). A value below that bound is
    checked against a_offsets, which reads them. nvfp4 uses one global scale for the whole
    tensor: `global_scale`, else amax(x) / 2688, computed on the device. bf16 and the weight-only
    formats (bf16 activations) return x rounded to bf16, without scales.
    backend: "auto" (the kernel on CUDA tensors, the reference elsewhere), "reference", or
    "triton" (the kernel: compiled on CUDA, Triton's interpreter on CPU tensors).
    """
    if backend not in QUANTIZE_BACKENDS:
        raise ValueError(f"backend: expected one of {list(QUANTIZE_BACKENDS)}, got {backend!r}")
    on_cuda = isinstance(x, torch.Tensor) and x.device.type == "cuda"
    if backend == "reference" or (backend == "auto" and not on_cuda):
        return reference_quantize(x, fmt, scale_layout=scale_layout, a_offsets=a_offsets,
                                  num_scale_blocks=num_scale_blocks, global_scale=global_scale)
    f, layout, global_scale = check_activations(x, fmt, scale_layout, a_offsets, global_scale)
    if not kernels.kernel_usable(x.device):
        raise ValueError(f"backend: 'triton' runs the kernel on CUDA tensors, or through Triton's interpreter on CPU "
                         f"ones; x is on {x.device}" + tl_source.interpreter_note(x.device))
    x = _kernel_rows(x)
    swizzled = layout.swizzled and f.a.scale is not None
    if swizzled:
        _check_index(a_offsets, "a_offsets", x.device)
        if a_offsets.numel() < 1:
            raise ValueError(f"a_offsets: expected a 1-D tensor [G+1] with G >= 0, got shape {tuple(a_offsets.shape)}")
        a_offsets = a_offsets.contiguous()  # (the kernel reads it as one run of values)
        num_scale_blocks = _checked_scale_blocks(num_scale_blocks, a_offsets, x.shape[0])
    else:
        a_offsets = None  # (plain scales are by row: the reference ignores a_offsets there)
    q = gather_quantize(x, f.name, a_offsets=a_offsets, scale_layout=layouts.SWIZZLED if swizzled else layouts.PLAIN,
                        num_scale_blocks=num_scale_blocks, global_scale=global_scale)
    if f.a.scale is None:  # (unscaled activations keep the layout asked for, as the reference's do)
        return QuantizedTensor(q.data, None, f.name, "a", layout)
    return q


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the activation kernel reads it: bf16, fp16 or fp32 rows of unit column stride (other
    floating dtypes converted to fp32 first, as the reference reads them)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _checked_scale_blocks(num_scale_blocks, a_offsets: torch.Tensor, rows: int) -> int | None:
    """num_scale_blocks of swizzled token scales: None, or an integer (as operator.index takes it,
    bools aside) that holds the groups' blocks. Only a value below the host-known bound
    ceil(rows / 128) + G is checked against a_offsets (a read of device values: callers that
    must not read pass the bound or more)."""
    if num_scale_blocks is None:
        return None
    try:
        if isinstance(num_scale_blocks, bool):
            raise TypeError
        blocks = operator.index(num_scale_blocks)
    except TypeError:
        raise TypeError(f"num_scale_blocks: expected an int, got {num_scale_blocks!r}") from None
    if blocks < math.ceil(rows / layouts.ROWS_PER_BLOCK) + a_offsets.numel() - 1:
        needed = layouts.num_a_scale_blocks(a_offsets)
        if blocks < needed:
            raise ValueError(f"num_scale_blocks: the groups need {needed} 128-row scale blocks, got {blocks}")
    return blocks


@traced_as("gather_quantize")
def gather_quantize(
    x: torch.Tensor,
    fmt: str,
    src_rows: torch.Tensor | None = None,
    *,
    a_offsets: torch.Tensor | None = None,
    a_scale_offsets: torch.Tensor | None = None,
    scale_layout: str | TokenForm = "plain",
    num_scale_blocks: int | None = None,
    global_scale: torch.Tensor | float | None = None,
) -> QuantizedTensor:
    """Rows x[src_rows] (all rows when None) quantized into fmt's A operand, in one pass.

    The swizzled layout places each row's scales by its slot in `a_offsets`; rows outside
    every slot get data but no scales. nvfp4: `global_scale` defaults to amax(x) / 2688.
    scale_layout a TokenForm (mxfp8, mxfp4, w4a8; a_offsets required): the same values in the
    form the sm90 kernel of the next product reads (token_forms.py), so that it runs no pre-pass;
    CUDA tensors, or the CPU through Triton's interpreter.
    """
    _check_rows_input(x, "x")
    device = x.device
    _check_index(a_offsets, "a_offsets", device)
    _check_index(a_scale_offsets, "a_scale_offsets", device)
    f, layout, global_scale = _prepare_common(device, fmt, scale_layout, a_offsets, global_scale)
    _check_index(src_rows, "src_rows", device)
    k = x.shape[1]
    if k % f.k_multiple:
        raise ValueError(f"x: K must be a multiple of {f.k_multiple} for {f.name}, got K={k}")
    if f.a.global_scale and global_scale is None:
        global_scale = tokens_global_scale(x)
    rows = x.shape[0] if src_rows is None else src_rows.numel()
    if not kernels.kernel_usable(x.device):
        picked = x if src_rows is None else x.index_select(0, src_rows.long())
        return reference_quantize(picked, f.name, scale_layout=layout, a_offsets=a_offsets,
                                  num_scale_blocks=num_scale_blocks, global_scale=global_scale)
    return kernels.quantize_rows(x, f, rows=rows, src_rows=src_rows, act=None, concat=False,
                                 k_out=k, bias=None, a_offsets=a_offsets, expert_ids=None,
                                 a_scale_offsets=a_scale_offsets, scale_layout=layout,
                                 num_scale_blocks=num_scale_blocks, global_scale=global_scale, alpha=1.0, limit=0.0)


def _check_scatter_rows(x: torch.Tensor, grouped_row: torch.Tensor, row_slot: torch.Tensor, a_offsets: torch.Tensor,
                        fmt: str):
    """The arguments of the gather in scatter form (scatter_quantize)."""
    _check_rows_input(x, "x")
    device = x.device
    _check_index(a_offsets, "a_offsets", device)
    grouped = isinstance(grouped_row, torch.Tensor)
    _check_index(row_slot, "row_slot", device, grouped_row.numel() if grouped else None)
    if not grouped or grouped_row.dtype not in (torch.int32, torch.int64):  # (_check_index of it flattened)
        _check_index(grouped_row.reshape(-1) if grouped else grouped_row, "grouped_row", device)
    if grouped_row.device != device:
        raise ValueError(f"grouped_row: expected device {device}, got {grouped_row.device}")
    if grouped_row.dim() != 2 or grouped_row.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_row: expected [T, k] with T = x.shape[0] = {x.shape[0]}, "
                         f"got {tuple(grouped_row.shape)}")
    f = get_format(fmt)
    if x.shape[1] % f.k_multiple:
        raise ValueError(f"x: K must be a multiple of {f.k_multiple} for {f.name}, got K={x.shape[1]}")
    return f


def token_of_row(grouped_row: torch.Tensor) -> torch.Tensor:
    """The gather's src_rows for the scatter form's grouped_row [T, k]: grouped row p holds token t
    where grouped_row[t, j] = p (the routing plan's token_index, rebuilt from grouped_row)."""
    choices = torch.arange(grouped_row.numel(), device=grouped_row.device) // max(grouped_row.shape[1], 1)
    return torch.empty_like(choices).scatter_(0, grouped_row.reshape(-1).long(), choices)


def scatter_quantize(x: torch.Tensor, fmt: str, grouped_row: torch.Tensor, row_slot: torch.Tensor, *,
                     a_offsets: torch.Tensor, a_scale_offsets: torch.Tensor | None = None,
                     scale_layout: str | TokenForm = "plain", num_scale_blocks: int | None = None,
                     global_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """gather_quantize in scatter form, for the MoE layer: grouped_row [T, k]
    (routing.RoutingPlan.grouped_row) names the grouped row of each choice of each token of x
    [T, K], row_slot [T*k] the slot of each grouped row (the plan's expert_of_row: slot e holds
    expert e). Each token is read and quantized once, then stored to its k rows; the gather
    reads and quantizes it k times (DeepSeek-V3's fp8_block gather at 4096 tokens: 342 us on an
    H100). Every row inside its slot gets the bytes and scales of gather_quantize with src_rows =
    the plan's token_index, in any scale_layout, token forms included; rows outside their slot
    (dropped choices) are left unwritten, as are their scales."""
    f = _check_scatter_rows(x, grouped_row, row_slot, a_offsets, fmt)
    if not kernels.kernel_usable(x.device):  # (gather_quantize checks the rest and takes nvfp4's global over x)
        return gather_quantize(x, f.name, token_of_row(grouped_row), a_offsets=a_offsets,
                               a_scale_offsets=a_scale_offsets, scale_layout=scale_layout,
                               num_scale_blocks=num_scale_blocks, global_scale=global_scale)
    _check_index(a_scale_offsets, "a_scale_offsets", x.device)
    f, layout, global_scale = _prepare_common(x.device, f.name, scale_layout, a_offsets, global_scale)
    if f.a.global_scale and global_scale is None:
        global_scale = tokens_global_scale(x)  # (over x, as gather_quantize's)
    return kernels.quantize_rows(x, f, rows=grouped_row.numel(), src_rows=grouped_row.contiguous(),
                                 act=None, concat=False, k_out=x.shape[1], bias=None,
                                 a_offsets=a_offsets, expert_ids=row_slot, a_scale_offsets=a_scale_offsets,
                                 scale_layout=layout, num_scale_blocks=num_scale_blocks,
                                 global_scale=global_scale, alpha=1.0, limit=0.0, topk=grouped_row.shape[1])


@traced_as("swiglu_quantize")
def swiglu_quantize(
    h: torch.Tensor,
    fmt: str,
    *,
    gate_up_layout: str,
    activation: str = "swiglu",
    bias: torch.Tensor | None = None,
    a_offsets: torch.Tensor | None = None,
    expert_ids: torch.Tensor | None = None,
    a_scale_offsets: torch.Tensor | None = None,
    scale_layout: str | TokenForm = "plain",
    num_scale_blocks: int | None = None,
    global_scale: torch.Tensor | float | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> QuantizedTensor:
    """SwiGLU of a gate/up product h [M, 2I] quantized into fmt's A operand [M, I], in one pass.

    bias [E, 2I] (in h's column order) is added per row's expert (slot from a_offsets,
    expert from expert_ids). nvfp4: `global_scale` defaults to amax of the activation over the
    rows of valid slots / 2688 (one extra pass; pass a static value in a serving path).
    scale_layout a TokenForm: the result in that token form, as gather_quantize's.
    """
    _check_rows_input(h, "h")
    check_activation(activation, gate_up_layout)
    device = h.device
    _check_index(a_offsets, "a_offsets", device)
    _check_index(expert_ids, "expert_ids", device)
    _check_index(a_scale_offsets, "a_scale_offsets", device)
    f, layout, global_scale = _prepare_common(device, fmt, scale_layout, a_offsets, global_scale)
    if h.shape[1] % 2:
        raise ValueError(f"h: expected an even number of columns (gate and up), got {h.shape[1]}")
    k_out = h.shape[1] // 2
    if k_out % f.k_multiple:
        raise ValueError(f"h: the activation's width {k_out} must be a multiple of {f.k_multiple} for {f.name}")
    bias = _checked_bias(bias, h)
    usable = kernels.kernel_usable(h.device)
    dynamic_global = f.a.global_scale and global_scale is None
    # The activation in torch, computed once where the global scale or the CPU path needs it.
    y = None if usable and not dynamic_global else reference_activation(
        h, activation, gate_up_layout, bias, a_offsets, expert_ids, alpha, limit)
    if dynamic_global:
        # amax over the rows of valid slots only: the others are unspecified (an unfilled h)
        valid, _ = slot_rows(a_offsets, expert_ids, h.shape[0], h.device)
        global_scale = nvfp4_global_scale(torch.where(valid[:, None], y, torch.zeros_like(y)))
    if not usable:
        return reference_quantize(y, f.name, scale_layout=layout, a_offsets=a_offsets,
                                  num_scale_blocks=num_scale_blocks, global_scale=global_scale)
    return kernels.quantize_rows(h, f, rows=h.shape[0], src_rows=None, act=activation,
                                 concat=gate_up_layout == "concat", k_out=k_out, bias=bias, a_offsets=a_offsets,
                                 expert_ids=expert_ids, a_scale_offsets=a_scale_offsets, scale_layout=layout,
                                 num_scale_blocks=num_scale_blocks, global_scale=global_scale, alpha=alpha,
                                 limit=limit)


def _checked_bias(bias: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor | None:
    """An expert bias [E, 2I] for the gate/up product h [M, 2I], contiguous (or None)."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dim() != 2 or bias.shape[1] != h.shape[1]:
        raise ValueError(f"bias: expected [E, {h.shape[1]}], got {tuple(getattr(bias, 'shape', ()))}")
    if bias.device != h.device:
        raise ValueError(f"bias: expected device {h.device}, got {bias.device}")
    return bias.contiguous()

