"""The routed experts of an MoE layer as a function: routing -> gate/up product + SwiGLU -> down
product -> combine (moegemm.MoE, module.py, is the module around it).

    y = moegemm.moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_layout="interleaved")

Data flow of moe_forward (T tokens, k choices, H hidden, I expert width, E experts):
    routing = route(topk_ids)                       counts, offsets, permutation (GPU kernels)
    plan = plan_layer(...)                          how the products run (plan.py: host values, once a shape)
    a    = scatter_quantize(x, routing.grouped_row) [T*k, H] in fmt's A operand, grouped by expert (each
                                                    token quantized once, stored to its k rows)
    h    = grouped_matmul_swiglu(a, w_gate_up)      [T*k, I]: product, expert scale, bias,
                                                    SwiGLU, requantized into fmt's A operand
                                                    (fused into the sm90 epilogue)
    c    = grouped_matmul(h, w_down)                [T*k, H]
    y    = unpermute_tokens(c, routing, topk_weights)  [T, H]: weighted sum over the k choices
No step reads a device value on the host: every size is T*k, E or a bound of them. Where both
products run on the sm90 block-format kernels, a and h are written in the token forms those
kernels read (token_forms.py), so the products run no pre-pass.

Two entries run the steps: the local path (moe_forward_local, which torch.compile traces as the
moegemm::moe_forward op: compile_boundary.py) and the received path (moe_forward_received).
Expert parallelism (parallel.py, distributed.py): with ep_group, w_gate_up and w_down hold the
rank's own experts (rank r of W: [r*E/W, (r+1)*E/W)); the tokens are dispatched, quantized once,
to the ranks that own their choices, each rank runs the received path on what it received (its
A operand placed by rows, not quantized again), and the partial sums come back in fp32 to be
added at the source.
"""

from __future__ import annotations

import torch

from .. import config, distributed, layouts, token_quantizers
from ..compile_boundary import traced_as
from ..gate_up import check_activation
from ..quantized_tensor import QuantizedTensor
from ..routing import RoutingPlan, route, row_experts, scatter_tokens, unpermute_tokens
from ..validation import check_no_grad
from . import parallel
from .plan import call_facts, plan_layer

__all__ = ["moe_forward", "moe_forward_local", "moe_forward_received"]


def _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down) -> int:
    """The layer's arguments' types and shapes (ValueError / TypeError naming the first bad one);
    returns the hidden size."""
    if isinstance(x, QuantizedTensor):  # tokens already in the format's A operand (expert parallelism)
        if x.operand != "a" or x.layout is not layouts.PLAIN or x.fmt != getattr(w_gate_up, "fmt", x.fmt):
            raise ValueError(f"x: expected the plain A operand of the weights' format, got {x.fmt} {x.operand} "
                             f"{x.scale_layout}")
        rows, hidden = x.data.shape[0], x.k
    elif not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a [T, H] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    elif not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    else:
        rows, hidden = x.shape
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != rows:
        raise ValueError(f"topk_ids: expected [{rows}, k], got {getattr(topk_ids, 'shape', None)}")
    if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor)
                                     or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}, got "
                         f"{getattr(topk_weights, 'shape', None)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, QuantizedTensor) or w.operand != "b":
            raise TypeError(f"{name}: expected a QuantizedTensor of weights (moegemm.quantize_weights)")
    if w_gate_up.fmt != w_down.fmt:
        raise ValueError(f"w_down: expected format {w_gate_up.fmt} (that of w_gate_up), got {w_down.fmt}")
    e, two_i, h = w_gate_up.data.shape[0], w_gate_up.data.shape[1], w_gate_up.k
    if h != hidden:
        raise ValueError(f"w_gate_up: expected K={hidden} (x's hidden size), got K={h}")
    if two_i % 2:
        raise ValueError(f"w_gate_up: expected 2I rows (gate and up), got {two_i}")
    if w_down.data.shape[0] != e or w_down.k != two_i // 2:
        raise ValueError(f"w_down: expected [{e}, H, {two_i // 2}] (E and I of w_gate_up), got K={w_down.k} "
                         f"and shape {tuple(w_down.data.shape)}")
    return hidden


def moe_forward(
    x: torch.Tensor | QuantizedTensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    w_gate_up: QuantizedTensor,
    w_down: QuantizedTensor,
    *,
    gate_up_layout: str,
    activation: str = "swiglu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_scales: torch.Tensor | None = None,
    down_scales: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
    intermediate_global_scale: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    fused: bool = True,
    backend: str = "auto",
    ep_group=None,
    ep_path: str = "auto",
    ep_capacity: int | None = None,
) -> torch.Tensor:
    """The routed experts of an MoE layer for tokens x [T, H] and router choices topk_ids [T, k].

    w_gate_up: [E, 2I, H] weights of the format, w_down: [E, H, I]. gate_up_layout states the
    order of w_gate_up's rows, never guessed: "interleaved" (2j = gate_j, 2j+1 = up_j, what
    moegemm.interleave_gate_up makes; the fused epilogue's order) or "concat" ([gate; up], as
    transformers' Qwen3 and DeepSeek checkpoints store them; MoE.gate_up_layout of a layer). Biases
    (gpt-oss): gate_up_bias [E, 2I] in w_gate_up's row order, down_bias [E, H]. Extra per-expert
    fp32 scales multiply each product. nvfp4: the token global scale defaults to amax(x)/2688,
    the intermediate's to a dynamic one (unfused) — pass `intermediate_global_scale` to fuse.
    fused=True uses the sm90 fused SwiGLU epilogue where it measured faster than the unfused
    chain (not for mxfp8 weights at prefill, nor mxfp4/w4a8 at decode on the plain order:
    fused.fused_pays). Choices with
    ids outside [0, E) are dropped. Returns [T, H] in x's dtype.

    ep_group (a torch.distributed process group of W ranks): expert parallelism. x and
    topk_ids are this rank's tokens and their choices among all E = W * E_local experts; the
    weights, biases and expert scales are this rank's E_local experts, [r*E_local, (r+1)*E_local).
    ep_path: "prefill" (counts read on the host), "decode" (fixed rows, no host read while a
    CUDA graph is captured) or "auto" (decode while a CUDA graph is captured); distributed.py.
    ep_capacity: the decode path's tokens a rank, the same on every rank; each rank then passes
    any T <= ep_capacity (a rank above it raises after its part of the exchange, so no rank
    hangs); None: the same T on every rank.
    nvfp4: the token global scale defaults to the amax over every rank's tokens. Custom layers
    may run the steps themselves: distributed.dispatch, moe_forward_received, distributed.combine.
    Ranks whose calls disagree on what sizes the exchanges (the format, k, the hidden size, the
    expert count, the path, the capacity; on the decode path without a capacity, T) all raise a
    ValueError naming it and every rank's value, checked at every call outside a CUDA-graph
    capture (distributed.py): the decode path is checked at the eager call before its capture.

    x may be any view (transposed, sliced): the kernels read token rows of unit column stride,
    so x whose columns are strided is copied once; others are read in place.
    """
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.stride(-1) != 1:
        x = x.contiguous()
    if ep_group is None:
        return moe_forward_local(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_layout=gate_up_layout,
                                 activation=activation, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                 gate_up_scales=gate_up_scales, down_scales=down_scales,
                                 input_global_scale=input_global_scale,
                                 intermediate_global_scale=intermediate_global_scale, alpha=alpha, limit=limit,
                                 fused=fused, backend=backend)
    return _moe_forward_parallel(x, topk_ids, topk_weights, w_gate_up, w_down, group=ep_group, path=ep_path,
                                 capacity=ep_capacity, input_global_scale=input_global_scale, activation=activation,
                                 gate_up_layout=gate_up_layout, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                 gate_up_scales=gate_up_scales, down_scales=down_scales,
                                 intermediate_global_scale=intermediate_global_scale, alpha=alpha, limit=limit,
                                 fused=fused, backend=backend)


@torch.compiler.disable  # collectives and a host read of the counts: not traced
def _moe_forward_parallel(x, topk_ids, topk_weights, w_gate_up, w_down, *, group, path, capacity, input_global_scale,
                          **layer):
    """moe_forward over an expert-parallel group: dispatch, this rank's experts, combine."""
    _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    sent = parallel.dispatch(x, topk_ids, topk_weights, w_gate_up, group=group, path=path, capacity=capacity,
                             global_scale=input_global_scale)
    return distributed.combine(moe_forward_received(sent, w_gate_up, w_down, **layer), sent, out_dtype=x.dtype)


def moe_forward_received(sent: distributed.Dispatched, w_gate_up: QuantizedTensor, w_down: QuantizedTensor, *,
                         gate_up_layout: str, activation: str = "swiglu", gate_up_bias: torch.Tensor | None = None,
                         down_bias: torch.Tensor | None = None, gate_up_scales: torch.Tensor | None = None,
                         down_scales: torch.Tensor | None = None,
                         intermediate_global_scale: torch.Tensor | None = None, alpha: float = 1.702,
                         limit: float = 7.0, fused: bool = True, backend: str = "auto") -> torch.Tensor:
    """This rank's experts (w_gate_up, w_down: its E_local) on the tokens distributed.dispatch
    brought, with moe_forward's keyword arguments (but input_global_scale, which the tokens carry,
    and ep_*): the fp32 partial sums [R, H] that distributed.combine sends back. The layer's
    choices (the fused epilogue, the kernels and their tiles) are those one GPU would make for the
    group's whole batch, so that each rank runs the same arithmetic as that GPU."""
    per_expert = parallel.group_tokens_per_expert(sent, w_gate_up.data.shape[0])
    with config.planned_tokens_per_slot(per_expert):
        return moe_forward_local(sent.tokens, sent.topk_ids, sent.topk_weights, w_gate_up, w_down,
                                 gate_up_layout=gate_up_layout, activation=activation, gate_up_bias=gate_up_bias,
                                 down_bias=down_bias, gate_up_scales=gate_up_scales, down_scales=down_scales,
                                 input_global_scale=None, intermediate_global_scale=intermediate_global_scale,
                                 alpha=alpha, limit=limit, fused=fused, backend=backend,
                                 tokens_per_expert=per_expert)


@traced_as("moe_forward")
def moe_forward_local(x, topk_ids, topk_weights, w_gate_up, w_down, *, gate_up_layout, activation, gate_up_bias,
                      down_bias, gate_up_scales, down_scales, input_global_scale, intermediate_global_scale, alpha,
                      limit, fused, backend, tokens_per_expert=None):
    """moe_forward on this process's experts. x: [T, H] float tokens, or their plain A operand of the
    weights' format (a QuantizedTensor: placed, not quantized again; the result is then fp32, a
    partial sum for the combine). tokens_per_expert: the batch's average that decides the fused
    epilogue (rows / E when None); expert parallelism passes the group's, so that every rank
    decides as one GPU would."""
    hidden = _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    given = isinstance(x, QuantizedTensor)
    out_dtype = torch.float32 if given else x.dtype
    check_no_grad("moe_forward", x=x.data if given else x, topk_weights=topk_weights, gate_up_bias=gate_up_bias,
                  down_bias=down_bias, gate_up_scales=gate_up_scales, down_scales=down_scales, w_gate_up=w_gate_up.data,
                  w_down=w_down.data)
    fmt = w_gate_up.fmt
    check_activation(activation, gate_up_layout)
    if w_gate_up.scales is not None and (w_gate_up.layout != w_down.layout):
        raise ValueError(f"w_down: expected scale layout {w_gate_up.scale_layout!r}, got {w_down.scale_layout!r}")
    layout = w_gate_up.layout if w_gate_up.scales is not None else layouts.PLAIN  # the tokens follow the weights
    num_experts, two_i = w_gate_up.data.shape[0], w_gate_up.data.shape[1]
    rows = topk_ids.numel()  # (the routing's grouped rows, one a choice)
    per_expert = rows / max(num_experts, 1) if tokens_per_expert is None else tokens_per_expert
    shapes = (fmt, layout, rows, num_experts, hidden, two_i, num_experts, gate_up_layout, backend, topk_ids.device,
              bool(fused), intermediate_global_scale is not None, given, float(per_expert), w_gate_up.prepacked,
              w_down.prepacked)
    plan = plan_layer(*shapes) if isinstance(backend, str) else plan_layer.__wrapped__(*shapes)
    routing = route(topk_ids, num_experts, topk_weights)
    row_slot = row_experts(routing)  # (the slot of each grouped row, for the gather's stores)
    # Only swizzled token scales have them (a weight-only format's bf16 tokens have no scales).
    aso = routing.a_scale_offsets if plan.token_scale_offsets else None
    # Every row the combine reads lies in a group, and the down product writes all of them: no zero
    # fill (it took 143 us of DeepSeek-V3's layer at 4096 tokens, H100).
    c = torch.empty(rows, w_down.data.shape[1], dtype=torch.bfloat16, device=topk_ids.device)
    # Where both products run on the sm90 block-format kernels, the gather and the activation
    # write the tokens in the form the next kernel reads (token_forms.py): no pre-pass.
    if given:
        a = _place_tokens(x, routing, row_slot, layout, aso, plan.scale_blocks)
    else:
        a = token_quantizers.scatter_quantize(x, fmt, routing.grouped_row, row_slot, a_offsets=routing.a_offsets,
                                              a_scale_offsets=aso, scale_layout=plan.up_form or layout,
                                              num_scale_blocks=plan.scale_blocks, global_scale=input_global_scale)
    facts = call_facts(w_gate_up.data, w_gate_up.scales, w_gate_up.global_scale, w_down.data, w_down.scales,
                       w_down.global_scale, gate_up_scales, down_scales,
                       *((x.data, x.scales, x.global_scale) if given else ()))
    plan.run_products(a, w_gate_up, w_down, routing.a_offsets, routing.expert_ids, aso, c, facts=facts,
                      activation=activation, gate_up_bias=gate_up_bias, gate_up_scales=gate_up_scales,
                      down_scales=down_scales, intermediate_global_scale=intermediate_global_scale, alpha=alpha,
                      limit=limit)
    return unpermute_tokens(c, routing, topk_weights, out_dtype=out_dtype, expert_bias=down_bias)


def _place_tokens(tokens: QuantizedTensor, routing: RoutingPlan, row_slot: torch.Tensor, layout: layouts.ScaleLayout,
                  a_scale_offsets, bound: int):
    """Tokens already in the plain A operand -> the grouped rows of the routing, in `layout` (the
    byte moves of scatter_quantize without its quantization: the same operand; rows of dropped
    choices unwritten, as there)."""
    data = scatter_tokens(tokens.data, routing)
    scales = None if tokens.scales is None else scatter_tokens(tokens.scales, routing)
    if scales is None or not layout.swizzled:
        return QuantizedTensor(data, scales, tokens.fmt, "a", layouts.PLAIN, tokens.global_scale)
    scales = layouts.place_a_scales(scales, row_slot, routing.a_offsets, a_scale_offsets, bound)
    return QuantizedTensor(data, scales, tokens.fmt, "a", layouts.SWIZZLED, tokens.global_scale, routing.a_offsets,
                           a_scale_offsets)


