"""The problem model of a grouped matmul call: its operands as tensors (`operands_of`, which
unwraps QuantizedTensor arguments and looks the format up) and its validated sizes (`GroupedProblem`, what every plan
and launcher takes). The checks that make a GroupedProblem are validation.py's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .formats import Format, get_format
from .layouts import PLAIN, ScaleLayout, scale_layout_of
from .quantize import QuantizedTensor, check_scale_layout
from .token_forms import TokenForm

__all__ = ["GroupedProblem", "Operands", "operands_of"]


@dataclass(frozen=True)
class GroupedProblem:
    """The validated sizes of one grouped matmul call (scale_layout: a ScaleLayout, or its name;
    one the format has, else ValueError naming scale_layout)."""

    fmt: Format
    m: int
    n: int
    k: int
    num_experts: int
    num_groups: int
    scale_layout: ScaleLayout
    out_dtype: torch.dtype
    prepacked: bool = False  # b's codes in moegemm.prepack's order
    b_n_major: bool = False  # b [E, N, K] is the transpose(1, 2) of a contiguous [E, K, N] (bf16 only)

    def __post_init__(self):
        object.__setattr__(self, "scale_layout", check_scale_layout(self.fmt, self.scale_layout))

    @property
    def num_k_scales(self) -> int:
        return math.ceil(self.k / self.fmt.scale_vec) if self.fmt.scaled else 0

    @functools.cached_property
    def key(self) -> tuple:
        """The problem as a tuple of plain values (cheap to hash: the kernels' launch keys)."""
        return (self.fmt.name, self.m, self.n, self.k, self.num_experts, self.num_groups, self.scale_layout,
                self.out_dtype, self.prepacked, self.b_n_major)


class Operands(NamedTuple):
    """A call's operands as tensors: what operands_of made of QuantizedTensor arguments. (A
    NamedTuple: made on every call, and a frozen dataclass costs several times as much to make.)"""

    fmt: Format  # the call's format, looked up once
    a: torch.Tensor
    b: torch.Tensor
    a_scales: torch.Tensor | None
    b_scales: torch.Tensor | None
    scale_layout: ScaleLayout  # b's (and a's plain or swizzled scales')
    expert_scales: torch.Tensor | None
    quantized_a_offsets: torch.Tensor | None  # the offsets a's swizzled scales or token form were placed by
    a_form: TokenForm | None = None  # a holds tokens in this form (token_forms.py), a_scales its scales
    a_scale_offsets: torch.Tensor | None = None  # the call's, else those of a QuantizedTensor's swizzled scales
    b_prepacked: bool = False  # b's codes in moegemm.prepack's order (a QuantizedTensor of prepack_weights)


def _layout_of(q: QuantizedTensor, name: str, scales, f: Format, fmt) -> ScaleLayout:
    """The scale layout of QuantizedTensor operand `name`, once it is checked to be the call's
    operand and format, with no scales given besides its own."""
    if q.operand != name:
        made_by = "moegemm.quantize" if name == "a" else "moegemm.quantize_weights"
        raise ValueError(f"{name}: expected the QuantizedTensor of {made_by}, got one of operand {q.operand!r}")
    if scales is not None:
        raise ValueError(f"{name}_scales: expected None when {name} is a QuantizedTensor (its own scales are "
                         f"used), got a {type(scales).__name__}")
    if q.fmt != f.name:
        raise ValueError(f"fmt: {name} was quantized as {q.fmt!r}, the call says {fmt!r}")
    return q.layout


def operands_of(a, b, a_scales, b_scales, a_offsets, *, fmt, scale_layout, expert_scales,
                a_scale_offsets=None) -> Operands:
    """Unwrap QuantizedTensor operands (moegemm.quantize / quantize_weights): their data and
    scales are used, so a_scales / b_scales must then be None; their format and scale layout must
    be the call's (scale_layout None: theirs, else "plain"; the result holds it as a ScaleLayout,
    ValueError naming scale_layout for another value); nvfp4's global scales are folded into
    expert_scales (one per expert; ones where not given). Raw tensors pass through unchanged.
    An A operand in a token form (its scale_layout a TokenForm) keeps its form: the call's
    scale_layout is then that of b (and of a swiglu output). a_scale_offsets: the call's, else
    those an A QuantizedTensor made with its swizzled scales (for as many slots as a_offsets has:
    other offsets are named by validation, as placed elsewhere)."""
    f = get_format(fmt)
    if scale_layout is not None:
        scale_layout = scale_layout_of(scale_layout, forms=False)
    a_quantized, b_quantized = isinstance(a, QuantizedTensor), isinstance(b, QuantizedTensor)
    if not a_quantized and not b_quantized:
        return Operands(f, a, b, a_scales, b_scales, scale_layout or PLAIN, expert_scales, None, None, a_scale_offsets)
    a_form = placed_scale_offsets = global_scale = quantized_a_offsets = a_layout = b_layout = None
    if a_quantized:
        layout = _layout_of(a, "a", a_scales, f, fmt)
        if layout.form is not None:
            a_form, quantized_a_offsets = layout.form, a.a_offsets
        else:
            a_layout = layout if a.scales is not None else None
            if a.global_scale is not None:
                global_scale = a.global_scale.float()
            if layout.swizzled:
                quantized_a_offsets, placed_scale_offsets = a.a_offsets, a.a_scale_offsets
    if b_quantized:
        layout = _layout_of(b, "b", b_scales, f, fmt)
        if layout.form is not None:
            a_form, quantized_a_offsets = layout.form, b.a_offsets
        else:
            b_layout = layout if b.scales is not None else None
            if b.global_scale is not None:
                global_scale = b.global_scale.float() if global_scale is None else global_scale * b.global_scale.float()
    # (a's scales first: the layout the call takes where it names none)
    for name, layout in (("a", a_layout), ("b", b_layout)):
        if layout is not None:
            if scale_layout is not None and layout != scale_layout:
                raise ValueError(f"scale_layout: {name} carries {layout!r} scales, the call says {scale_layout!r}")
            scale_layout = scale_layout or layout
    scale_layout = scale_layout or PLAIN
    if a_quantized:
        a, a_scales = a.data, a.scales
    b_prepacked = b_quantized and b.prepacked
    if b_quantized:
        b, b_scales = b.data, b.scales
    if global_scale is not None and isinstance(b, torch.Tensor) and b.dim() == 3:  # (else validation names b)
        experts = b.shape[0]
        if expert_scales is None:
            # (the product of the two global scales is already one per expert where b has them: no
            # fill and multiply of ones, two launches fewer; the same values, 1 * x being x)
            expert_scales = (global_scale if global_scale.shape == (experts,)
                             else global_scale.expand(experts).contiguous())
        elif isinstance(expert_scales, torch.Tensor) and expert_scales.shape == (experts,):
            expert_scales = expert_scales * global_scale  # (another shape: validate_grouped_matmul names it)
    if (a_scale_offsets is None and placed_scale_offsets is not None and isinstance(a_offsets, torch.Tensor)
            and a_offsets.shape == (placed_scale_offsets.shape[0] + 1,)):
        a_scale_offsets = placed_scale_offsets
    return Operands(f, a, b, a_scales, b_scales, scale_layout, expert_scales, quantized_a_offsets, a_form,
                    a_scale_offsets, b_prepacked)
