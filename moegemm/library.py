"""Every public op as a `torch.library.custom_op` with a fake implementation (torch.compile).

    torch.ops.moegemm.grouped_matmul          -> C [M, N]
    torch.ops.moegemm.grouped_matmul_swiglu   -> (data, scales, global_scale) of the A operand
    torch.ops.moegemm.gather_quantize         -> (data, scales, global_scale); also moegemm.quantize's kernel
    torch.ops.moegemm.swiglu_quantize         -> (data, scales, global_scale)
    torch.ops.moegemm.route                   -> the RoutingPlan's tensors
    torch.ops.moegemm.unpermute_tokens        -> [T, N]
    torch.ops.moegemm.moe_forward             -> [T, H]

The public Python functions call these ops when torch.compile traces them (dynamo cannot
trace a Triton/Gluon launch); eager calls go straight to the implementation. For the ops
declared with compile_boundary.traced_as, this module registers what a traced call runs
(register_traced), and the op's body runs the implementation (`public.eager`). A missing scale
or global scale travels as an empty tensor, since an op cannot return None. Fakes compute
every output shape from the input shapes alone, as the kernels' host code does: no device
value is read (the sizes are bounds of T*k and E). The layer is inference-only: no autograd.
The ops take a scale layout by its name ("plain" or "swizzled"; layouts.ScaleLayout.name): the
traced calls below name the layout they made of the argument.
"""

from __future__ import annotations

import torch

from . import layouts
from .compile_boundary import register_traced
from .formats import get_format
from .gate_up import check_activation
from .moe.forward import moe_forward_local
from .ops import grouped_matmul, grouped_matmul_swiglu
from .problem import Operands, operands_of
from .quantized_tensor import QuantizedTensor, allocate_a_operand, as_quantized, quantized_from_op, quantized_to_op
from .routing import RoutingPlan, route, unpermute_tokens
from .token_quantizers import gather_quantize, swiglu_quantize

__all__: list[str] = []


def _fake_a_operand(fmt: str, rows: int, k: int, swizzled: bool, num_scale_blocks, num_groups: int, like):
    """Empty outputs with the shapes and dtypes the kernels produce (allocate_a_operand's rules)."""
    f = get_format(fmt)
    data, scales, _ = allocate_a_operand(f, rows, k, swizzled, num_scale_blocks, num_groups, like.device)
    q = as_quantized(f, data, scales, swizzled, like.new_empty((), dtype=torch.float32), None)
    return quantized_to_op(q, like)


# ---- grouped matmuls ---------------------------------------------------------------------

@torch.library.custom_op("moegemm::grouped_matmul", mutates_args=())
def grouped_matmul_op(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor | None, b_scales: torch.Tensor | None,
                      a_offsets: torch.Tensor, expert_ids: torch.Tensor, fmt: str,
                      a_scale_offsets: torch.Tensor | None, expert_scales: torch.Tensor | None,
                      row_scales: torch.Tensor | None, scale_layout: str, out_dtype: torch.dtype,
                      backend: str, b_prepacked: bool) -> torch.Tensor:
    return grouped_matmul.eager(a, _weights(b, b_scales, fmt, scale_layout, b_prepacked), a_scales,
                                None if b_prepacked else b_scales, a_offsets, expert_ids, fmt=fmt,
                                a_scale_offsets=a_scale_offsets, expert_scales=expert_scales, row_scales=row_scales,
                                scale_layout=scale_layout, out_dtype=out_dtype, backend=backend)


def _weights(b, b_scales, fmt: str, scale_layout: str, prepacked: bool):
    """b as the ops take it: prepacked codes travel through an op as their tensors and a flag."""
    return QuantizedTensor(b, b_scales, fmt, "b", scale_layout, prepacked=True) if prepacked else b


@grouped_matmul_op.register_fake
def _(a, b, a_scales, b_scales, a_offsets, expert_ids, fmt, a_scale_offsets, expert_scales, row_scales, scale_layout,
      out_dtype, backend, b_prepacked):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@torch.library.custom_op("moegemm::grouped_matmul_swiglu", mutates_args=())
def grouped_matmul_swiglu_op(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor | None,
                             b_scales: torch.Tensor | None, a_offsets: torch.Tensor, expert_ids: torch.Tensor,
                             fmt: str, out_fmt: str, activation: str, a_scale_offsets: torch.Tensor | None,
                             expert_scales: torch.Tensor | None, bias: torch.Tensor | None, scale_layout: str,
                             out_scale_layout: str, num_scale_blocks: int | None,
                             out_global_scale: torch.Tensor | None, alpha: float, limit: float, fused: bool,
                             backend: str, gate_up_layout: str, b_prepacked: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = grouped_matmul_swiglu.eager(a, _weights(b, b_scales, fmt, scale_layout, b_prepacked), a_scales,
                                    None if b_prepacked else b_scales, a_offsets, expert_ids, fmt=fmt,
                                    out_fmt=out_fmt, activation=activation, a_scale_offsets=a_scale_offsets,
                                    expert_scales=expert_scales, bias=bias, scale_layout=scale_layout,
                                    out_scale_layout=out_scale_layout, num_scale_blocks=num_scale_blocks,
                                    out_global_scale=out_global_scale, alpha=alpha, limit=limit, fused=fused,
                                    backend=backend, gate_up_layout=gate_up_layout)
    return quantized_to_op(q, a)


@grouped_matmul_swiglu_op.register_fake
def _(a, b, a_scales, b_scales, a_offsets, expert_ids, fmt, out_fmt, activation, a_scale_offsets, expert_scales, bias,
      scale_layout, out_scale_layout, num_scale_blocks, out_global_scale, alpha, limit, fused, backend,
      gate_up_layout, b_prepacked):
    return _fake_a_operand(out_fmt, a.shape[0], b.shape[1] // 2, layouts.scale_layout_of(out_scale_layout).swizzled,
                           num_scale_blocks, expert_ids.shape[0], a)


def _not_traced(operands: Operands):
    if operands.a_form is not None:
        raise ValueError("a: tokens in a token form are not traced by torch.compile (the MoE layer, one op there, "
                         "passes them)")


def _traced_grouped_matmul(a, b, a_scales, b_scales, a_offsets, expert_ids, *, fmt, a_scale_offsets=None,
                           expert_scales=None, row_scales=None, scale_layout=None, out=None,
                           out_dtype=torch.bfloat16, backend="auto"):
    """grouped_matmul as torch.compile traces it: one grouped_matmul op of the operands' tensors
    (a call into a given `out` is traced as written)."""
    if out is not None:
        return grouped_matmul.eager(a, b, a_scales, b_scales, a_offsets, expert_ids, fmt=fmt,
                                    a_scale_offsets=a_scale_offsets, expert_scales=expert_scales,
                                    row_scales=row_scales, scale_layout=scale_layout, out=out, out_dtype=out_dtype,
                                    backend=backend)
    operands = operands_of(a, b, a_scales, b_scales, a_offsets, fmt=fmt, scale_layout=scale_layout,
                           expert_scales=expert_scales, a_scale_offsets=a_scale_offsets)
    _not_traced(operands)
    return torch.ops.moegemm.grouped_matmul(operands.a, operands.b, operands.a_scales, operands.b_scales, a_offsets,
                                            expert_ids, fmt, operands.a_scale_offsets, operands.expert_scales,
                                            row_scales, operands.scale_layout.name, out_dtype, backend,
                                            operands.b_prepacked)


def _traced_grouped_matmul_swiglu(a, b, a_scales, b_scales, a_offsets, expert_ids, *, fmt, gate_up_layout,
                                  out_fmt="bf16", activation="swiglu", a_scale_offsets=None, expert_scales=None,
                                  bias=None, scale_layout=None, out_scale_layout=None, num_scale_blocks=None,
                                  out_global_scale=None, alpha=1.702, limit=7.0, fused=True, backend="auto"):
    """grouped_matmul_swiglu as torch.compile traces it: one grouped_matmul_swiglu op."""
    check_activation(activation, gate_up_layout)
    operands = operands_of(a, b, a_scales, b_scales, a_offsets, fmt=fmt, scale_layout=scale_layout,
                           expert_scales=expert_scales, a_scale_offsets=a_scale_offsets)
    if out_scale_layout is None:
        out_layout = layouts.SWIZZLED if get_format(out_fmt).swizzle_capable else layouts.PLAIN
    else:
        out_layout = _traced_layout(out_scale_layout, "out_scale_layout")
    _not_traced(operands)
    outputs = torch.ops.moegemm.grouped_matmul_swiglu(
        operands.a, operands.b, operands.a_scales, operands.b_scales, a_offsets, expert_ids, fmt, out_fmt,
        activation, operands.a_scale_offsets, operands.expert_scales, bias, operands.scale_layout.name,
        out_layout.name, num_scale_blocks, out_global_scale, alpha, limit, fused, backend, gate_up_layout,
        operands.b_prepacked)
    return quantized_from_op(outputs, out_fmt, out_layout.swizzled, a_offsets)


register_traced("grouped_matmul", _traced_grouped_matmul)
register_traced("grouped_matmul_swiglu", _traced_grouped_matmul_swiglu)


# ---- activation quantizers ---------------------------------------------------------------

@torch.library.custom_op("moegemm::gather_quantize", mutates_args=())
def gather_quantize_op(x: torch.Tensor, fmt: str, src_rows: torch.Tensor | None, a_offsets: torch.Tensor | None,
                       a_scale_offsets: torch.Tensor | None, scale_layout: str, num_scale_blocks: int | None,
                       global_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = gather_quantize.eager(x, fmt, src_rows, a_offsets=a_offsets, a_scale_offsets=a_scale_offsets,
                              scale_layout=scale_layout, num_scale_blocks=num_scale_blocks, global_scale=global_scale)
    data, scales, g = quantized_to_op(q, x)
    return (data.clone() if data is x else data), scales, g


@gather_quantize_op.register_fake
def _(x, fmt, src_rows, a_offsets, a_scale_offsets, scale_layout, num_scale_blocks, global_scale):
    rows = x.shape[0] if src_rows is None else src_rows.shape[0]
    groups = 0 if a_offsets is None else a_offsets.shape[0] - 1
    return _fake_a_operand(fmt, rows, x.shape[1], layouts.scale_layout_of(scale_layout).swizzled, num_scale_blocks,
                           groups, x)


def _traced_layout(scale_layout, name: str = "scale_layout") -> layouts.ScaleLayout:
    """The ScaleLayout of a traced call's argument `name`: the ops write plain or swizzled
    scales only, not token forms."""
    layout = layouts.scale_layout_of(scale_layout, name)
    if layout.form is not None:
        raise ValueError(f"{name}: token forms are not traced by torch.compile (the MoE layer, one op there, "
                         f"writes them)")
    return layout


def _traced_scale_offsets(layout: layouts.ScaleLayout, a_offsets, a_scale_offsets):
    """The a_scale_offsets a traced quantizer passes its op and returns: as the eager call derives
    them for swizzled scales."""
    if layout.swizzled and a_scale_offsets is None and a_offsets is not None:
        return layouts.a_scale_offsets(a_offsets)
    return a_scale_offsets


def _traced_gather_quantize(x, fmt, src_rows=None, *, a_offsets=None, a_scale_offsets=None, scale_layout="plain",
                            num_scale_blocks=None, global_scale=None) -> QuantizedTensor:
    """A traced gather_quantize: its op, the outputs as the QuantizedTensor of the eager call."""
    layout = _traced_layout(scale_layout)
    a_scale_offsets = _traced_scale_offsets(layout, a_offsets, a_scale_offsets)
    outputs = torch.ops.moegemm.gather_quantize(x, fmt, src_rows, a_offsets, a_scale_offsets, layout.name,
                                                num_scale_blocks, global_scale)
    return quantized_from_op(outputs, fmt, layout.swizzled, a_offsets, a_scale_offsets)


register_traced("gather_quantize", _traced_gather_quantize)


@torch.library.custom_op("moegemm::swiglu_quantize", mutates_args=())
def swiglu_quantize_op(h: torch.Tensor, fmt: str, activation: str, gate_up_layout: str, bias: torch.Tensor | None,
                       a_offsets: torch.Tensor | None, expert_ids: torch.Tensor | None,
                       a_scale_offsets: torch.Tensor | None, scale_layout: str, num_scale_blocks: int | None,
                       global_scale: torch.Tensor | None, alpha: float,
                       limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = swiglu_quantize.eager(h, fmt, activation=activation, gate_up_layout=gate_up_layout, bias=bias,
                              a_offsets=a_offsets, expert_ids=expert_ids, a_scale_offsets=a_scale_offsets,
                              scale_layout=scale_layout, num_scale_blocks=num_scale_blocks,
                              global_scale=global_scale, alpha=alpha, limit=limit)
    return quantized_to_op(q, h)


@swiglu_quantize_op.register_fake
def _(h, fmt, activation, gate_up_layout, bias, a_offsets, expert_ids, a_scale_offsets, scale_layout,
      num_scale_blocks, global_scale, alpha, limit):
    groups = 0 if a_offsets is None else a_offsets.shape[0] - 1
    return _fake_a_operand(fmt, h.shape[0], h.shape[1] // 2, layouts.scale_layout_of(scale_layout).swizzled,
                           num_scale_blocks, groups, h)


def _traced_swiglu_quantize(h, fmt, *, gate_up_layout, activation="swiglu", bias=None, a_offsets=None,
                            expert_ids=None, a_scale_offsets=None, scale_layout="plain", num_scale_blocks=None,
                            global_scale=None, alpha=1.702, limit=7.0) -> QuantizedTensor:
    """A traced swiglu_quantize: its op, the outputs as the QuantizedTensor of the eager call."""
    layout = _traced_layout(scale_layout)
    a_scale_offsets = _traced_scale_offsets(layout, a_offsets, a_scale_offsets)
    outputs = torch.ops.moegemm.swiglu_quantize(h, fmt, activation, gate_up_layout, bias, a_offsets, expert_ids,
                                                a_scale_offsets, layout.name, num_scale_blocks, global_scale,
                                                alpha, limit)
    return quantized_from_op(outputs, fmt, layout.swizzled, a_offsets, a_scale_offsets)


register_traced("swiglu_quantize", _traced_swiglu_quantize)


# ---- routing -----------------------------------------------------------------------------

@torch.library.custom_op("moegemm::route", mutates_args=())
def route_op(topk_ids: torch.Tensor, num_experts: int, backend: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = route.eager(topk_ids, num_experts, None, backend=backend)
    expert_of_row = plan.expert_of_row
    if expert_of_row is None:
        expert_of_row = topk_ids.new_empty(plan.num_grouped_rows, dtype=torch.int32)
    return (plan.token_index, plan.grouped_row, plan.valid, plan.a_offsets, plan.expert_ids, plan.a_scale_offsets,
            expert_of_row)


@route_op.register_fake
def _(topk_ids, num_experts, backend):
    t, k = topk_ids.shape
    e = num_experts
    new = topk_ids.new_empty
    return (new(t * k, dtype=torch.int64), new(t, k, dtype=torch.int64), new(t, k, dtype=torch.bool),
            new(e + 1, dtype=torch.int32), new(e, dtype=torch.int32), new(e, dtype=torch.int32),
            new(t * k, dtype=torch.int32))


def _traced_route(topk_ids, num_experts, topk_weights=None, *, backend="auto") -> RoutingPlan:
    """A traced route: its op, the outputs as the RoutingPlan of the eager call."""
    tensors = torch.ops.moegemm.route(topk_ids, num_experts, backend)
    return RoutingPlan(*tensors[:6], topk_weights, tensors[6])


register_traced("route", _traced_route)


@torch.library.custom_op("moegemm::unpermute_tokens", mutates_args=())
def unpermute_tokens_op(y: torch.Tensor, token_index: torch.Tensor, grouped_row: torch.Tensor, valid: torch.Tensor,
                        a_offsets: torch.Tensor, expert_ids: torch.Tensor, a_scale_offsets: torch.Tensor,
                        expert_of_row: torch.Tensor | None, topk_weights: torch.Tensor | None,
                        expert_bias: torch.Tensor | None, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    plan = RoutingPlan(token_index, grouped_row, valid, a_offsets, expert_ids, a_scale_offsets, None, expert_of_row)
    return unpermute_tokens.eager(y, plan, topk_weights, out_dtype, expert_bias=expert_bias, backend=backend)


@unpermute_tokens_op.register_fake
def _(y, token_index, grouped_row, valid, a_offsets, expert_ids, a_scale_offsets, expert_of_row, topk_weights,
      expert_bias, out_dtype, backend):
    return y.new_empty(grouped_row.shape[0], y.shape[1], dtype=out_dtype)


def _traced_unpermute_tokens(y, plan, topk_weights=None, out_dtype=None, *, expert_bias=None,
                             backend="auto") -> torch.Tensor:
    """A traced unpermute_tokens: its op on the plan's tensors."""
    return torch.ops.moegemm.unpermute_tokens(
        y, plan.token_index, plan.grouped_row, plan.valid, plan.a_offsets, plan.expert_ids, plan.a_scale_offsets,
        plan.expert_of_row, topk_weights if topk_weights is not None else plan.topk_weights, expert_bias,
        out_dtype or y.dtype, backend)


register_traced("unpermute_tokens", _traced_unpermute_tokens)


# ---- the layer -------------------------------------------------------------------------

@torch.library.custom_op("moegemm::moe_forward", mutates_args=())
def moe_forward_op(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
    gate_up_data: torch.Tensor, gate_up_scales_q: torch.Tensor | None, gate_up_global: torch.Tensor | None,
    down_data: torch.Tensor, down_scales_q: torch.Tensor | None, down_global: torch.Tensor | None,
    fmt: str, scale_layout: str, activation: str, gate_up_layout: str,
    gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
    gate_up_scales: torch.Tensor | None, down_scales: torch.Tensor | None,
    input_global_scale: torch.Tensor | None, intermediate_global_scale: torch.Tensor | None,
    alpha: float, limit: float, fused: bool, backend: str, gate_up_prepacked: bool, down_prepacked: bool,
) -> torch.Tensor:
    w_gate_up = QuantizedTensor(gate_up_data, gate_up_scales_q, fmt, "b", scale_layout, gate_up_global,
                                prepacked=gate_up_prepacked)
    w_down = QuantizedTensor(down_data, down_scales_q, fmt, "b", scale_layout, down_global, prepacked=down_prepacked)
    return moe_forward_local.eager(x, topk_ids, topk_weights, w_gate_up, w_down, activation=activation,
                                   gate_up_layout=gate_up_layout, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                   gate_up_scales=gate_up_scales, down_scales=down_scales,
                                   input_global_scale=input_global_scale,
                                   intermediate_global_scale=intermediate_global_scale, alpha=alpha, limit=limit,
                                   fused=fused, backend=backend)


@moe_forward_op.register_fake
def _(x, topk_ids, topk_weights, gate_up_data, gate_up_scales_q, gate_up_global, down_data, down_scales_q,
      down_global, fmt, scale_layout, activation, gate_up_layout, gate_up_bias, down_bias, gate_up_scales,
      down_scales, input_global_scale, intermediate_global_scale, alpha, limit, fused, backend, gate_up_prepacked,
      down_prepacked):
    return x.new_empty(x.shape[0], down_data.shape[1])


def _moe_forward_traced(x, topk_ids, topk_weights, w_gate_up, w_down, **layer):
    """moe_forward_local as torch.compile traces it: float tokens go through the op; tokens already
    in the format's operand (the received path of expert parallelism) run as written."""
    if isinstance(x, QuantizedTensor):
        return moe_forward_local.eager(x, topk_ids, topk_weights, w_gate_up, w_down, **layer)
    return moe_forward_op(
        x, topk_ids, topk_weights, w_gate_up.data, w_gate_up.scales, w_gate_up.global_scale, w_down.data,
        w_down.scales, w_down.global_scale, w_gate_up.fmt, w_gate_up.scale_layout, layer["activation"],
        layer["gate_up_layout"], layer["gate_up_bias"], layer["down_bias"], layer["gate_up_scales"],
        layer["down_scales"], layer["input_global_scale"], layer["intermediate_global_scale"], float(layer["alpha"]),
        float(layer["limit"]), layer["fused"], layer["backend"], w_gate_up.prepacked, w_down.prepacked)


register_traced("moe_forward", _moe_forward_traced)
