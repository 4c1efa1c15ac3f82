"""QuantizedTensor, a quantized operand as the ops take it, and the storage of an A operand.

    QuantizedTensor       data and scales in their layout, with the format, the operand, the
                          global scale and the group offsets its A scales were placed by
    allocate_a_operand    an A operand's storage as the kernels write it (bytes, zeroed scales);
                          a_operand_storage its shapes and dtypes, as host values
    as_quantized          those buffers viewed with the format's dtypes, as a QuantizedTensor
    quantized_to_op       an A operand as a torch.library op returns it (three tensors)
    quantized_from_op     and back

quantize.py and the token quantizers produce QuantizedTensors; the ops take them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

import torch

from . import layouts
from .formats import E2M1, E4M3, Format, get_format
from .token_forms import TokenForm

__all__ = ["QuantizedTensor", "a_operand_storage", "a_operand_views", "allocate_a_operand", "as_quantized", "quantized_from_op", "quantized_to_op"]


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized operand exactly as `grouped_matmul` consumes it.

    data:          A [M, K] / packed [M, K/2];  B [E, N, K] / packed [E, N, K/2]
    scales:        None for bf16 (and a weight-only format's A); otherwise in `scale_layout`
    scale_layout:  "plain" or "swizzled" (docs/contract.md section 5); for A also a TokenForm,
                   the form an sm90 kernel reads (token_forms.py): data e4m3 or bf16 [M, K],
                   scales fp32 K-block-major or None, placed by a_offsets. Given a ScaleLayout
                   object, it holds that layout's argument (the name users see); `layout` is the
                   object
    global_scale:  nvfp4 only (bf16_nvfp4: B only): fp32 scalar (A) or [E] (B); fold into expert_scales
    a_offsets:     swizzled A and token forms: the group offsets the rows were placed by
    a_scale_offsets: swizzled A: where each slot's scale tiles start (layouts.a_scale_offsets of
                   a_offsets), so that the products need not derive them again
    prepacked:     B only: data in moegemm.prepack's order (prepack_weights), the shape and dtype
                   of the plain order; the scales keep their layout
    """

    data: torch.Tensor
    scales: torch.Tensor | None
    fmt: str
    operand: str  # "a" or "b"
    scale_layout: str | TokenForm = "plain"
    global_scale: torch.Tensor | None = None
    a_offsets: torch.Tensor | None = None
    a_scale_offsets: torch.Tensor | None = None
    prepacked: bool = False

    def __post_init__(self):
        if self.scale_layout.__class__ is not str:  # (a layout object made inside: users see its name)
            layout = layouts.scale_layout_of(self.scale_layout)
            object.__setattr__(self, "scale_layout", layout.argument)
        else:  # (None for a name no layout has: `layout` raises, naming it)
            layout = layouts.layout_named(self.scale_layout)
        object.__setattr__(self, "_layout", layout)  # (looked up once: every op asks for it)

    @property
    def layout(self) -> layouts.ScaleLayout:
        """scale_layout as a ScaleLayout object (ValueError naming scale_layout for another value)."""
        layout = self._layout
        return layout if layout is not None else layouts.scale_layout_of(self.scale_layout)

    @property
    def k(self) -> int:
        if self.layout.form is not None:
            return self.data.shape[-1]
        operand = get_format(self.fmt).a if self.operand == "a" else get_format(self.fmt).b
        return operand.logical_k(self.data.shape[-1])

    def experts(self, first: int, last: int) -> QuantizedTensor:
        """Weights only: experts [first, last) with every field kept (codes, scales in their
        layout, per-expert global scales, prepacked order), views of this tensor's storage. The
        way to cut a rank's share (expert parallelism): a QuantizedTensor rebuilt by hand from
        its tensors loses what its fields record (e.g. that prepacked codes are prepacked, which
        no kernel could tell from the bytes). first and last: ints, numpy integers or 0-d integer
        tensors, as torch's indexing takes them."""
        if self.operand != "b":
            raise ValueError(f"experts: only weights (operand 'b') have experts, this is operand {self.operand!r}")
        first, last = _expert_index(first, "first"), _expert_index(last, "last")
        count = self.data.shape[0]
        if not 0 <= first <= last <= count:
            raise ValueError(f"first, last: expected 0 <= first <= last <= {count} (the experts), got {first!r}, "
                             f"{last!r}")
        return replace(self, data=self.data[first:last],
                       scales=None if self.scales is None else self.scales[first:last],
                       global_scale=None if self.global_scale is None or self.global_scale.dim() == 0
                       else self.global_scale[first:last])


def _expert_index(value, name: str) -> int:
    """An expert bound as an int: anything operator.index takes (int, numpy integer, 0-d integer
    tensor) but the bools it takes too (Python's and torch's) and tensors of more dimensions."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dim() or value.dtype == torch.bool)):
        raise TypeError(f"{name}: expected an integer (int, numpy integer or 0-d integer tensor), got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer (int, numpy integer or 0-d integer tensor), got "
                        f"{value!r}") from None


# ---- the A operand as the kernels write it, and as the torch.library ops return it ----------

def a_operand_storage(f: Format, rows: int, k: int, swizzled: bool, num_scale_blocks: int | None,
                      num_groups: int) -> tuple[tuple, tuple | None, int]:
    """The storage allocate_a_operand makes, as host values: ((shape, dtype) of the data,
    (shape, dtype) of the scales or None, the number of swizzled scale rows)."""
    op = f.a
    if op.element is E2M1:
        data = ((rows, k // 2), torch.uint8)
    elif op.element is E4M3:
        data = ((rows, k), torch.uint8)
    else:
        data = ((rows, k), torch.bfloat16)
    if op.scale is None:
        return data, None, 0
    nkb = math.ceil(k / op.block_k)
    if swizzled:
        if num_scale_blocks is None:
            num_scale_blocks = math.ceil(rows / layouts.ROWS_PER_BLOCK) + num_groups
        return data, (layouts.swizzled_a_shape(num_scale_blocks, nkb), torch.uint8), \
            num_scale_blocks * layouts.ROWS_PER_BLOCK
    return data, ((rows, nkb), torch.float32 if op.scale == "fp32" else torch.uint8), 0


def allocate_a_operand(f: Format, rows: int, k: int, swizzled: bool, num_scale_blocks: int | None,
                       num_groups: int, device) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Storage for `rows` rows of fmt's A operand, K = k, as the kernels write it: data (bytes for
    fp8/fp4), scales zeroed (padding rows of the swizzled layout must read as zero), and the
    number of swizzled scale rows (ceil(rows/128) + groups blocks unless given)."""
    (data_shape, data_dtype), scales, num_scale_rows = a_operand_storage(f, rows, k, swizzled, num_scale_blocks,
                                                                         num_groups)
    data = torch.empty(data_shape, dtype=data_dtype, device=device)
    if scales is None:
        return data, None, 0
    return data, torch.zeros(scales[0], dtype=scales[1], device=device), num_scale_rows


def a_operand_views(f: Format) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The dtypes as_quantized views allocate_a_operand's data and scales with (None: as stored)."""
    op = f.a
    return (torch.float8_e4m3fn if op.element is E4M3 else None,
            {"e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}.get(op.scale))


def as_quantized(f: Format, data, scales, swizzled: bool, global_scale, a_offsets,
                 a_scale_offsets=None) -> QuantizedTensor:
    """The kernels' byte buffers viewed with the format's dtypes, as a QuantizedTensor (swizzled
    scales placed by a_offsets, their slots' tiles starting at a_scale_offsets)."""
    data_view, scales_view = a_operand_views(f)
    if data_view is not None:
        data = data.view(data_view)
    if scales is not None and scales_view is not None:
        scales = scales.view(scales_view)
    layout = layouts.SWIZZLED if swizzled else layouts.PLAIN
    return QuantizedTensor(data, scales, f.name, "a", layout, global_scale if f.a.global_scale else None,
                           a_offsets if swizzled else None, a_scale_offsets if swizzled else None)


def quantized_to_op(q: QuantizedTensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A QuantizedTensor as the torch.library ops return it: (data, scales or empty, global scale
    or empty), since an op cannot return None."""
    # Outputs must not alias an input (the global scale may be the caller's) nor one another.
    return (q.data, q.scales if q.scales is not None else like.new_empty(0, dtype=torch.float32),
            q.global_scale.reshape(()).clone() if q.global_scale is not None else like.new_empty(0, dtype=torch.float32))


def quantized_from_op(outputs, fmt: str, swizzled: bool, a_offsets, a_scale_offsets=None) -> QuantizedTensor:
    """Inverse of quantized_to_op for an A operand of `fmt` (swizzled scales placed by a_offsets,
    their slots' tiles starting at a_scale_offsets where given)."""
    data, scales, global_scale = outputs
    f = get_format(fmt)
    scales = scales if f.a.scale is not None else None
    global_scale = global_scale if f.a.global_scale else None
    placed = swizzled and scales is not None
    layout = layouts.SWIZZLED if placed else layouts.PLAIN
    return QuantizedTensor(data, scales, f.name, "a", layout, global_scale, a_offsets if placed else None,
                           a_scale_offsets if placed else None)
