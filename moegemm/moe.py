"""The MoE layer: router -> routing -> gate/up product + SwiGLU -> down product -> combine.

    y = moegemm.moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_layout="interleaved")
    layer = moegemm.MoE(hidden, width, experts, top_k, fmt="mxfp8"); layer.load_experts(...)

Data flow of moe_forward (T tokens, k choices, H hidden, I expert width, E experts):
    plan = route(topk_ids)                          counts, offsets, permutation (GPU kernels)
    a    = scatter_quantize(x, plan.grouped_row)    [T*k, H] in fmt's A operand, grouped by expert (each
                                                    token quantized once, stored to its k rows)
    h    = grouped_matmul_swiglu(a, w_gate_up)      [T*k, I]: product, expert scale, bias,
                                                    SwiGLU, requantized into fmt's A operand
                                                    (fused into the sm90 epilogue)
    c    = grouped_matmul(h, w_down)                [T*k, H]
    y    = unpermute_tokens(c, plan, topk_weights)  [T, H]: weighted sum over the k choices
No step reads a device value on the host: every size is T*k, E or a bound of them. Where both
products run on the sm90 block-format kernels, a and h are written in the token forms those
kernels read (token_forms.py), so the products run no pre-pass. How the products run is
decided once per shape (_steps).

Gate/up weights are one [E, 2I, H] operand. For every format but fp8_block its rows are
interleaved (2j = gate_j, 2j+1 = up_j: moegemm.interleave_gate_up), the layout the fused
epilogue wants. fp8_block keeps DeepSeek's concatenated [gate; up] rows, because interleaving
would split the 128x128 scale blocks of an FP8 checkpoint; its SwiGLU runs after the matmul.

Expert parallelism (distributed.py): with ep_group, w_gate_up and w_down hold the rank's own
experts (rank r of W: [r*E/W, (r+1)*E/W)); the tokens are dispatched, quantized once, to the
ranks that own their choices, each rank runs the layer above on what it received (its A operand
placed by rows, not quantized again), and the partial sums come back in fp32 to be added at
the source.

Routers (MoE.route_tokens): routing.select_experts, the three the supported checkpoints use.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import activation as act
from . import config, distributed, graphed, layouts
from .formats import FORMATS, PREPACK_BY_DEFAULT, PREPACK_FORMATS, get_format
from .fused import fused_pays, fused_supports
from .ops import available_backends, grouped_matmul, grouped_matmul_swiglu, resolve_backend
from .prepack import PREPACK_K, PREPACK_ROWS, check_prepackable, prepack_codes, unpack_codes
from .quantize import QuantizedTensor, dequantize_operand, prepack_weights, quantize_weights
from .routing import ROUTERS, RoutingPlan, route, row_experts, scatter_tokens, select_experts, unpermute_tokens
from .token_forms import TokenForm, token_form
from .validation import GroupedProblem, check_no_grad

__all__ = ["MoE", "moe_forward", "moe_forward_received", "ROUTERS"]

def _weight_scale_layout(fmt: str) -> str:
    return "swizzled" if get_format(fmt).swizzle_capable else "plain"


def _gate_up_layout(fmt: str) -> str:
    return "concat" if fmt == "fp8_block" else "interleaved"


def _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down):
    if isinstance(x, QuantizedTensor):  # tokens already in the format's A operand (expert parallelism)
        if x.operand != "a" or x.scale_layout != "plain" or x.fmt != getattr(w_gate_up, "fmt", x.fmt):
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


def _check_device(device) -> None:
    """ValueError naming `device` unless it is None or a device this torch can allocate on (a CUDA
    device asked of a torch without one fails here, not in an allocation's assertion)."""
    if device is None:
        return
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a device this torch can use ('cpu', 'cuda', 'cuda:1', ...), got "
                         f"{device!r} ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: expected a device this torch can use, got {str(device)!r}, but no CUDA device is "
                         f"available (torch {torch.__version__}, CUDA {torch.version.cuda or 'not built'})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device: expected one of the {torch.cuda.device_count()} CUDA devices, got {str(device)!r}")


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
    if ep_group is not None:
        return _ep_moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, ep_group=ep_group, ep_path=ep_path,
                               ep_capacity=ep_capacity,
                               activation=activation, gate_up_layout=gate_up_layout, gate_up_bias=gate_up_bias,
                               down_bias=down_bias, gate_up_scales=gate_up_scales, down_scales=down_scales,
                               input_global_scale=input_global_scale,
                               intermediate_global_scale=intermediate_global_scale, alpha=alpha, limit=limit,
                               fused=fused, backend=backend)
    if torch.compiler.is_compiling() and not isinstance(x, QuantizedTensor):
        return torch.ops.moegemm.moe_forward(
            x, topk_ids, topk_weights, w_gate_up.data, w_gate_up.scales, w_gate_up.global_scale, w_down.data,
            w_down.scales, w_down.global_scale, w_gate_up.fmt, w_gate_up.scale_layout, activation,
            gate_up_layout, gate_up_bias, down_bias, gate_up_scales, down_scales,
            input_global_scale, intermediate_global_scale, float(alpha), float(limit), fused, backend,
            w_gate_up.prepacked, w_down.prepacked)
    return _moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, activation=activation,
                        gate_up_layout=gate_up_layout, gate_up_bias=gate_up_bias, down_bias=down_bias,
                        gate_up_scales=gate_up_scales, down_scales=down_scales,
                        input_global_scale=input_global_scale, intermediate_global_scale=intermediate_global_scale,
                        alpha=alpha, limit=limit, fused=fused, backend=backend)


@torch.compiler.disable  # collectives and a host read of the counts: not traced
def _ep_moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, *, ep_group, ep_path, ep_capacity, **layer):
    """moe_forward over an expert-parallel group: dispatch, this rank's experts, combine."""
    _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    _, world = distributed.rank_and_size(ep_group)
    sent = distributed.dispatch(x, topk_ids, topk_weights, w_gate_up.fmt,
                                num_experts=w_gate_up.data.shape[0] * world, group=ep_group, path=ep_path,
                                global_scale=layer.pop("input_global_scale"), capacity=ep_capacity)
    return distributed.combine(moe_forward_received(sent, w_gate_up, w_down, **layer), sent, out_dtype=x.dtype)


def moe_forward_received(sent: distributed.Dispatched, w_gate_up: QuantizedTensor, w_down: QuantizedTensor,
                         **layer) -> torch.Tensor:
    """This rank's experts (w_gate_up, w_down: its E_local) on the tokens distributed.dispatch
    brought, with moe_forward's keyword arguments (but ep_*): the fp32 partial sums [R, H] that
    distributed.combine sends back. The layer's choices (the fused epilogue, the kernels and
    their tiles) are those one GPU would make for the group's whole batch, so that each rank
    runs the same arithmetic as that GPU."""
    _, world = distributed.rank_and_size(sent.group)
    per_expert = sent.group_tokens * sent.topk_ids.shape[1] / (w_gate_up.data.shape[0] * world)
    layer = {**_received_defaults(), **layer}
    with config.planned_tokens_per_slot(per_expert):
        return _moe_forward(sent.tokens, sent.topk_ids, sent.topk_weights, w_gate_up, w_down,
                            input_global_scale=None, tokens_per_expert=per_expert, **layer)  # (the tokens carry it)


@functools.cache
def _received_defaults() -> dict:
    """moe_forward's keyword defaults that moe_forward_received takes."""
    given_elsewhere = ("gate_up_layout", "input_global_scale", "ep_group", "ep_path", "ep_capacity")
    return {name: p.default for name, p in inspect.signature(moe_forward).parameters.items()
            if p.kind is p.KEYWORD_ONLY and name not in given_elsewhere}


def _place_tokens(tokens: QuantizedTensor, plan: RoutingPlan, layout: str, a_scale_offsets, bound: int):
    """Tokens already in the plain A operand -> the grouped rows of the plan, in `layout` (the
    byte moves of scatter_quantize without its quantization: the same operand; rows of dropped
    choices unwritten, as there)."""
    data = scatter_tokens(tokens.data, plan)
    scales = None if tokens.scales is None else scatter_tokens(tokens.scales, plan)
    if scales is None or layout == "plain":
        return QuantizedTensor(data, scales, tokens.fmt, "a", "plain", tokens.global_scale)
    scales = layouts.place_a_scales(scales, row_experts(plan), plan.a_offsets, a_scale_offsets, bound)
    return QuantizedTensor(data, scales, tokens.fmt, "a", "swizzled", tokens.global_scale, plan.a_offsets,
                           a_scale_offsets)


def _moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, *, activation, gate_up_layout, gate_up_bias,
                 down_bias, gate_up_scales, down_scales, input_global_scale, intermediate_global_scale, alpha, limit,
                 fused, backend, tokens_per_expert=None):
    """x: [T, H] float tokens, or their plain A operand of the weights' format (a QuantizedTensor:
    placed, not quantized again; the result is then fp32, a partial sum for the combine).
    tokens_per_expert: the batch's average that decides the fused epilogue (rows / E when None);
    expert parallelism passes the group's, so that every rank decides as one GPU would."""
    _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down)
    given = isinstance(x, QuantizedTensor)
    check_no_grad("moe_forward", x=x.data if given else x, topk_weights=topk_weights, gate_up_bias=gate_up_bias,
                  down_bias=down_bias, gate_up_scales=gate_up_scales, down_scales=down_scales, w_gate_up=w_gate_up.data,
                  w_down=w_down.data)
    fmt = w_gate_up.fmt
    act.check_activation(activation, gate_up_layout)
    if w_gate_up.scales is not None and (w_gate_up.scale_layout != w_down.scale_layout):
        raise ValueError(f"w_down: expected scale layout {w_gate_up.scale_layout!r}, got {w_down.scale_layout!r}")
    layout = w_gate_up.scale_layout if w_gate_up.scales is not None else "plain"  # the tokens follow the weights
    num_experts = w_gate_up.data.shape[0]
    plan = route(topk_ids, num_experts, topk_weights)
    bound = plan.scale_blocks_bound
    # Only swizzled token scales have them (a weight-only format's bf16 tokens have no scales).
    aso = plan.a_scale_offsets if layout == "swizzled" and get_format(fmt).a_scaled else None
    hidden = w_gate_up.k
    per_expert = plan.num_grouped_rows / max(num_experts, 1) if tokens_per_expert is None else tokens_per_expert
    shapes = (fmt, layout, plan.num_grouped_rows, plan.expert_ids.shape[0], hidden, w_gate_up.data.shape[1],
              num_experts, gate_up_layout, backend, topk_ids.device, bool(fused), intermediate_global_scale is not None,
              given, float(per_expert), w_gate_up.prepacked, w_down.prepacked)
    steps = _steps(*shapes) if isinstance(backend, str) else _steps.__wrapped__(*shapes)
    # Every row the combine reads lies in a group, and the down product writes all of them: no zero
    # fill (it took 143 us of DeepSeek-V3's layer at 4096 tokens, H100).
    c = torch.empty(plan.num_grouped_rows, w_down.data.shape[1], dtype=torch.bfloat16, device=topk_ids.device)
    # Where both products run on the sm90 block-format kernels, the gather and the activation
    # write the tokens in the form the next kernel reads (token_forms.py): no pre-pass.
    if given:
        a = _place_tokens(x, plan, layout, aso, bound)
    else:
        a = act.scatter_quantize(x, fmt, plan.grouped_row, row_experts(plan), a_offsets=plan.a_offsets,
                                 a_scale_offsets=aso, scale_layout=steps.up_form or layout, num_scale_blocks=bound,
                                 global_scale=input_global_scale)
    mid = grouped_matmul_swiglu(
        a, w_gate_up, None, None, plan.a_offsets, plan.expert_ids, fmt=fmt, out_fmt=fmt, activation=activation,
        a_scale_offsets=aso, expert_scales=gate_up_scales, bias=gate_up_bias, scale_layout=layout,
        out_scale_layout=steps.down_form or layout, num_scale_blocks=bound, out_global_scale=intermediate_global_scale,
        alpha=alpha, limit=limit, fused=steps.fused, backend=backend, gate_up_layout=gate_up_layout)
    grouped_matmul(mid, w_down, None, None, plan.a_offsets, plan.expert_ids, fmt=fmt, a_scale_offsets=aso,
                   expert_scales=down_scales, scale_layout=layout, backend=backend, out=c)
    return unpermute_tokens(c, plan, topk_weights, out_dtype=torch.float32 if given else x.dtype,
                            expert_bias=down_bias)


class _Steps(NamedTuple):
    up_form: TokenForm | None  # the gate/up product's A, written by the gather in this form
    down_form: TokenForm | None  # the down product's A, written by the gate/up step in this form
    fused: bool  # the gate/up step asks for the fused SwiGLU epilogue


@functools.lru_cache(maxsize=1024)
def _steps(fmt: str, layout: str, rows: int, groups: int, hidden: int, two_i: int, num_experts: int,
           gate_up_layout: str, backend: str, device: torch.device, fused: bool, static_intermediate: bool,
           tokens_given: bool, tokens_per_expert: float, up_prepacked: bool = False,
           down_prepacked: bool = False) -> _Steps:
    """How the layer runs its products for these shapes (host values only: the weight shapes and
    the plan's row and slot bounds), decided once per shape.

    fused: where the fused SwiGLU epilogue measured faster (fused.fused_pays at tokens_per_expert),
    and for nvfp4 only with a static intermediate global scale. Token forms: only where both products run on the
    sm90 block-format kernels, gate/up interleaved; the fused epilogue writes the down product's
    form only where it is the bf16 one, the format's operand otherwise. The weight-only formats
    have none: their tokens are bf16 as they are, as the bf16 format's. tokens_given: the tokens
    arrive as the format's operand (expert parallelism), placed as they are: no form of their own.
    up_prepacked, down_prepacked: the weights' order (mxfp4 and w4a8 run another kernel at decode
    on prepacked weights, with another token form)."""
    f = get_format(fmt)
    fused = fused and fused_pays(fmt, two_i, hidden, tokens_per_expert, up_prepacked) and (
        static_intermediate or not f.a.global_scale)
    up = GroupedProblem(f, rows, two_i, hidden, num_experts, groups, layout, torch.bfloat16, up_prepacked)
    down = GroupedProblem(f, rows, hidden, two_i // 2, num_experts, groups, layout, torch.bfloat16, down_prepacked)
    if gate_up_layout != "interleaved" or rows == 0 or groups == 0:
        return _Steps(None, None, fused)
    if resolve_backend(backend, up, device) != "sm90" or resolve_backend(backend, down, device) != "sm90":
        return _Steps(None, None, fused)
    up_form = None if tokens_given else token_form(fmt, up.n, up.k, rows, groups, up_prepacked)
    if up_form is None and not tokens_given:
        return _Steps(None, None, fused)
    down_form = token_form(fmt, down.n, down.k, rows, groups, down_prepacked)
    if down_form is not None and down_form.kind != "bf16" and fused and fused_supports(up, fmt):
        down_form = None
    return _Steps(up_form, down_form, fused)


# The MoE layer's state dict (MoE.get_extra_state): its tensors and, under "_extra_state", what they
# mean, in this version's form.
STATE_VERSION = 1
_WEIGHT_PARTS = ("data", "scales", "global")
_EXPERT_WEIGHTS = tuple(f"{w}_{part}" for w in ("gate_up", "down") for part in _WEIGHT_PARTS)
_STATE_CHOICES = {"fmt": tuple(FORMATS), "scale_layout": ("plain", "swizzled"),
                  "gate_up_layout": ("concat", "interleaved"), "gate_up_order": ("plain", "prepacked"),
                  "down_order": ("plain", "prepacked")}


def _weight_parts(fmt: str, scale_layout: str, experts: int, n: int, k: int) -> dict:
    """part ("data", "scales", "global") -> (shape, accepted dtypes) of `experts` experts' weights
    [n, k] in fmt's B operand, scales in `scale_layout`; only the parts the format has."""
    b = get_format(fmt).b
    parts = {"data": ((experts, n, b.stored_k(k)), (b.element.storage_dtype, ))}
    if b.scaled:
        k_scales = math.ceil(k / b.block_k)
        if b.block_n > 1:
            shape = (experts, math.ceil(n / b.block_n), k_scales)
        elif scale_layout == "swizzled":
            shape = layouts.swizzled_b_shape(experts, n, k_scales)
        else:
            shape = (experts, n, k_scales)
        parts["scales"] = (tuple(shape), b.accepted_scale_dtypes)
    if b.global_scale:
        parts["global"] = ((experts, ), (torch.float32, ))
    return parts


def _saved_meaning(saved, key: str) -> dict:
    """A checkpoint's MoE extra state (MoE.get_extra_state), checked: ValueError naming `key` unless
    it is a dict of this version with every field one of its values."""
    version = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
    if version != STATE_VERSION:
        raise ValueError(f"state_dict[{key!r}]: expected an MoE state of version {STATE_VERSION}, got version "
                         f"{version!r}")
    for field, choices in _STATE_CHOICES.items():
        if saved.get(field) not in choices:
            raise ValueError(f"state_dict[{key!r}]: expected {field} one of {list(choices)}, got {saved.get(field)!r}")
    experts, count = saved.get("experts"), saved.get("num_experts")
    if not (isinstance(count, int) and isinstance(experts, (tuple, list)) and len(experts) == 2
            and all(isinstance(v, int) for v in experts) and 0 <= experts[0] < experts[1] <= count):
        raise ValueError(f"state_dict[{key!r}]: expected experts (first, last) of num_experts, got {experts!r} of "
                         f"{count!r}")
    return saved


class _StateChange(NamedTuple):
    """What a checkpoint's expert tensors become in a layer (MoE._state_change)."""
    fmt: str  # the layer's format after the load
    tensors: dict  # state-dict key -> the tensor, converted to the layer's order, layout and experts
    prepacked: dict  # "gate_up" / "down" -> the order of its loaded codes


# Weights a chunk of load_experts' quantization holds (2^23: 32 MiB in fp32; MoE._store_quantized).
QUANTIZE_CHUNK = 1 << 23


class MoE(torch.nn.Module):
    """A drop-in MoE block: router, routed experts in `fmt`, optional shared expert (DeepSeek).

    Expert weights are buffers in the format's layout (see the module docstring); load them with
    load_experts (float weights, per-expert or fused gate_up), load_fp8_block (DeepSeek FP8,
    128x128 scale_inv) or load_mxfp4 (gpt-oss blocks and scales). forward(x [..., H]) -> [..., H].

    fmt None (the default) leaves the format to the loader: "bf16_mxfp4" for load_mxfp4 (gpt-oss's
    MXFP4 weights kept as they are, bf16 activations: how gpt-oss runs), "bf16" for the others.
    A format given here is the layer's, whichever loader runs.

    ep_group (a torch.distributed process group of W ranks, W dividing num_experts): expert
    parallelism. Every rank builds the layer with the same arguments; the loaders take the full
    checkpoint tensors [E, ...] or this rank's slice [E/W, ...] and keep experts
    [r*E/W, (r+1)*E/W) (expert_range); the router and the shared expert stay whole. forward takes
    this rank's tokens and returns their outputs, those of the single-GPU layer (within fp32
    rounding of the combine's order). ep_path, ep_capacity: moe_forward's. The ranks' layers are
    compared when built and when loaded (one small collective each): ranks that disagree on the
    format, the sizes, the path, the capacity or the loaded weights get a ValueError together.
    On the decode path without ep_capacity every call outside a CUDA-graph capture compares the
    ranks' token counts (moe_forward): unequal ones raise on every rank, naming them; pass
    ep_capacity where ranks hold different counts.

    prepack: the loaders keep the weights of formats.PREPACK_FORMATS (bf16_mxfp4, gpt-oss's, among
    them) in the order the sm90 decoding kernel reads (moegemm.prepack_weights), where N and K are
    multiples of 64; weights() returns them so. None (the default): those of
    formats.PREPACK_BY_DEFAULT (not mxfp4 and w4a8) where that kernel will read them, i.e. weights
    on a Hopper GPU and backend "auto" or "sm90" (elsewhere every call would unpack them); True:
    every format of PREPACK_FORMATS wherever N and K allow; False: never.

    state_dict() says what the expert tensors mean (get_extra_state); load_state_dict makes a
    checkpoint's tensors what this layer's loaders would have made, on a layer built with the
    same arguments with or without weights, or raises naming both sides (_state_change).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 fmt: str | None = None, activation: str = "swiglu", router: str = "softmax_topk",
                 norm_topk_prob: bool = True, router_bias: bool = False, expert_bias: bool = False,
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 correction_bias: bool = False, shared_intermediate_size: int = 0,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, backend: str = "auto",
                 fused: bool = True, ep_group=None, ep_path: str = "auto", ep_capacity: int | None = None,
                 prepack: bool | None = None, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        act.check_activation(activation)
        if router not in ROUTERS:
            raise ValueError(f"router: expected one of {list(ROUTERS)}, got {router!r}")
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k: expected <= num_experts ({num_experts}), got {top_k}")
        _check_device(device)
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group, topk_group: need n_group | num_experts and 1 <= topk_group <= n_group, "
                             f"got {n_group}, {topk_group}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        if ep_path not in distributed.EP_PATHS:
            raise ValueError(f"ep_path: expected one of {list(distributed.EP_PATHS)}, got {ep_path!r}")
        if ep_capacity is not None and (isinstance(ep_capacity, bool) or not isinstance(ep_capacity, int)
                                        or ep_capacity < 0):
            raise ValueError(f"ep_capacity: expected an int >= 0 (tokens a rank on the decode path) or None, got "
                             f"{ep_capacity!r}")
        self.ep_group, self.ep_path, self.ep_capacity = ep_group, ep_path, ep_capacity
        # This rank's experts: all of them without expert parallelism.
        self.expert_range = (0, num_experts) if ep_group is None else distributed.expert_range(num_experts, ep_group)
        self.num_local_experts = self.expert_range[1] - self.expert_range[0]
        # The format the caller chose, None: the loader's (_use_format); until a loader runs, bf16's.
        self._chosen_fmt = None if fmt is None else get_format(fmt).name
        self._use_format(fmt or "bf16")
        self.activation, self.router = activation, router
        self.norm_topk_prob, self.n_group, self.topk_group = norm_topk_prob, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.backend, self.fused, self.prepack = backend, fused, prepack
        self._graphs = graphed.GraphedCalls()
        self.gate_up_prepacked = self.down_prepacked = False
        factory = {"device": device, "dtype": dtype}
        # Inference only: the kernels have no backward, so the router is frozen too.
        self.router_weight = torch.nn.Parameter(torch.zeros(num_experts, hidden_size, **factory), requires_grad=False)
        self.router_bias = (torch.nn.Parameter(torch.zeros(num_experts, **factory), requires_grad=False)
                            if router_bias else None)
        self.register_buffer("correction_bias", torch.zeros(num_experts, device=device) if correction_bias else None)
        self.has_expert_bias = expert_bias
        self.register_buffer("gate_up_bias", None)
        self.register_buffer("down_bias", None)
        for prefix in ("gate_up", "down"):
            for part in ("data", "scales", "global"):
                self.register_buffer(f"{prefix}_{part}", None)
        # nvfp4 only: a static global scale of the intermediate lets the requantization fuse.
        self.register_buffer("intermediate_global_scale", None)
        self.shared = None
        if shared_intermediate_size:
            self.shared = torch.nn.ModuleDict({
                "gate": torch.nn.Linear(hidden_size, shared_intermediate_size, bias=False, **factory),
                "up": torch.nn.Linear(hidden_size, shared_intermediate_size, bias=False, **factory),
                "down": torch.nn.Linear(shared_intermediate_size, hidden_size, bias=False, **factory),
            })
        if ep_group is not None:  # every rank builds the same layer (one small collective)
            distributed.check_agreement("MoE", dict(
                hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts, top_k=top_k,
                fmt=self._chosen_fmt, activation=activation, router=router, ep_path=ep_path, ep_capacity=ep_capacity,
                dtype=str(dtype),
                norm_topk_prob=norm_topk_prob, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=routed_scaling_factor, correction_bias=correction_bias, router_bias=router_bias,
                expert_bias=expert_bias, shared_intermediate_size=shared_intermediate_size, swiglu_alpha=swiglu_alpha,
                swiglu_limit=swiglu_limit), ep_group)

    def _loaded(self, loader: str):
        """With expert parallelism: every rank loaded weights of the same format, shapes and order
        (one small collective), else a ValueError on every rank naming what differs."""
        if self.ep_group is None:
            return self
        parts = dict(fmt=self.fmt, scale_layout=self.scale_layout, gate_up_layout=self.gate_up_layout)
        for prefix in ("gate_up", "down"):
            for part in ("data", "scales", "global"):
                t = getattr(self, f"{prefix}_{part}")
                parts[f"{prefix}_{part}"] = None if t is None else (tuple(t.shape), str(t.dtype))
            parts[f"{prefix}_prepacked"] = getattr(self, f"{prefix}_prepacked")
        parts.update(gate_up_bias=self.gate_up_bias is not None, down_bias=self.down_bias is not None)
        distributed.check_agreement(f"MoE.{loader}", parts, self.ep_group)
        return self

    # ---- loading -------------------------------------------------------------------------

    def _use_format(self, fmt: str):
        """Set the experts' format and the weight layouts it implies (sizes checked against it)."""
        f = get_format(fmt)
        for name, size in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)):
            if size % f.k_multiple:
                raise ValueError(f"{name}: must be a multiple of {f.k_multiple} for {f.name}, got {size}")
        self.fmt = f.name
        self.gate_up_layout = _gate_up_layout(f.name)
        self.scale_layout = _weight_scale_layout(f.name)

    def _store(self, prefix: str, q: QuantizedTensor):
        if not q.prepacked and self._prepacks(q):
            q = prepack_weights(q)
        setattr(self, f"{prefix}_prepacked", q.prepacked)
        setattr(self, f"{prefix}_data", q.data)
        setattr(self, f"{prefix}_scales", q.scales)
        setattr(self, f"{prefix}_global", q.global_scale)

    def _prepacks(self, q: QuantizedTensor) -> bool:
        """Whether the loaders keep q prepacked (the class docstring's `prepack`)."""
        return self._keeps_prepacked(q.fmt, q.data.shape[1], q.k, q.data.device)

    def _keeps_prepacked(self, fmt: str, n: int, k: int, device: torch.device) -> bool:
        """Whether this layer keeps weights [E, n, k] of fmt on `device` prepacked (`prepack`)."""
        if self.prepack is False or fmt not in PREPACK_FORMATS:
            return False
        if self.prepack is None and fmt not in PREPACK_BY_DEFAULT:
            return False
        if n % PREPACK_ROWS or k % PREPACK_K:
            return False
        return bool(self.prepack) or (self.backend in ("auto", "sm90") and "sm90" in available_backends(device))

    def _check_weight(self, name, w, shape):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if tuple(w.shape) != tuple(shape):
            whole = (f" (this rank's experts; or all {self.num_experts})"
                     if self.ep_group is not None and shape[0] == self.num_local_experts else "")
            raise ValueError(f"{name}: expected shape {tuple(shape)}{whole}, got {tuple(w.shape)}")

    def _own(self, *tensors):
        """Per-expert checkpoint tensors as this rank keeps them: the full [E, ...] cut to its
        experts, anything else as given (the loaders check its shape next)."""
        first, last = self.expert_range
        return [w[first:last] if isinstance(w, torch.Tensor) and w.dim() and w.shape[0] == self.num_experts
                and last - first != self.num_experts else w for w in tensors]

    def _set_biases(self, gate_up_bias, down_bias):
        gate_up_bias, down_bias = self._own(gate_up_bias, down_bias)
        e, i, h = self.num_local_experts, self.intermediate_size, self.hidden_size
        if self.has_expert_bias != (gate_up_bias is not None or down_bias is not None):
            raise ValueError(f"gate_up_bias, down_bias: this MoE was built with expert_bias={self.has_expert_bias}")
        if gate_up_bias is not None:
            self._check_weight("gate_up_bias", gate_up_bias, (e, 2 * i))
            self.gate_up_bias = gate_up_bias.detach().float().contiguous()  # (a checkpoint's Parameter: no grad)
        if down_bias is not None:
            self._check_weight("down_bias", down_bias, (e, h))
            self.down_bias = down_bias.detach().float().contiguous()

    @torch.no_grad()
    def load_experts(self, *, gate=None, up=None, gate_up=None, down, gate_up_order: str = "concat",
                     gate_bias=None, up_bias=None, gate_up_bias=None, down_bias=None):
        """Float expert weights in nn.Linear's [out, in] convention, quantized into `fmt`.

        Per expert: gate, up [E, I, H] and down [E, H, I]; or a fused gate_up [E, 2I, H] whose
        rows are [gate; up] (gate_up_order="concat") or alternate (gate_up_order="interleaved",
        gpt-oss). Biases likewise: gate_bias/up_bias [E, I] or gate_up_bias [E, 2I], down_bias [E, H].
        With expert parallelism, E may also be this rank's experts alone (num_local_experts).
        """
        gate, up, gate_up, down, gate_bias, up_bias, gate_up_bias, down_bias = self._own(
            gate, up, gate_up, down, gate_bias, up_bias, gate_up_bias, down_bias)
        e, i, h = self.num_local_experts, self.intermediate_size, self.hidden_size
        if gate_up is None:
            if gate is None or up is None:
                raise ValueError("gate, up: give both, or gate_up")
            self._check_weight("gate", gate, (e, i, h))
            self._check_weight("up", up, (e, i, h))
        else:
            self._check_weight("gate_up", gate_up, (e, 2 * i, h))
            if gate_up_order not in ("concat", "interleaved"):
                raise ValueError(f"gate_up_order: expected 'concat' or 'interleaved', got {gate_up_order!r}")
            gate, up = gate_up.chunk(2, dim=1) if gate_up_order == "concat" else act.deinterleave_gate_up(gate_up)
        self._check_weight("down", down, (e, h, i))
        if gate_up_bias is not None and gate_up_order == "interleaved":
            gate_bias, up_bias = gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]
        elif gate_up_bias is not None:
            gate_bias, up_bias = gate_up_bias.chunk(2, dim=1)
        self._store_quantized("gate_up", lambda first, last: self._arrange(gate[first:last], up[first:last]), 2 * i * h)
        self._store_quantized("down", lambda first, last: down[first:last], h * i)
        bias = None
        if gate_bias is not None or up_bias is not None:
            zeros = torch.zeros(e, i, device=down.device)
            gb = gate_bias if gate_bias is not None else zeros
            ub = up_bias if up_bias is not None else zeros
            bias = self._arrange(gb.float().unsqueeze(-1), ub.float().unsqueeze(-1)).squeeze(-1)
        self._set_biases(bias, down_bias)
        return self._loaded("load_experts")

    def _store_quantized(self, prefix: str, experts, size: int):
        """Quantize (and prepack, as _store would) the layer's experts a chunk at a time:
        experts(first, last) gives float weights [last - first, N, K] of `size` = N * K elements
        an expert. The quantizers' temporaries are a few fp32 copies of their input, GBs for a
        whole layer of a large model (Qwen3-30B-A3B's gate/up: 1.6 GB in fp32), so each chunk
        holds at most QUANTIZE_CHUNK elements, written into tensors allocated once for the layer.
        Exact: quantization, nvfp4's global scale and the prepacked order are each expert's own."""
        count = self.num_local_experts
        step = max(1, QUANTIZE_CHUNK // max(size, 1))
        whole = None
        for first in range(0, count, step):
            last = min(first + step, count)
            q = quantize_weights(experts(first, last).float(), self.fmt, scale_layout=self.scale_layout)
            if self._prepacks(q):
                q = prepack_weights(q)
            if first == 0 and last == count:
                whole = q
                break
            if whole is None:
                grown = lambda t: None if t is None else t.new_empty((count, *t.shape[1:]))  # noqa: E731
                whole = replace(q, data=grown(q.data), scales=grown(q.scales), global_scale=grown(q.global_scale))
            for part, into in ((q.data, whole.data), (q.scales, whole.scales), (q.global_scale, whole.global_scale)):
                if part is not None:
                    into[first:last].copy_(part)
        self._store(prefix, whole)

    def _arrange(self, gate, up):
        """gate, up [E, I, X] -> the [E, 2I, X] row order of this format."""
        if self.gate_up_layout == "concat":
            return torch.cat((gate, up), dim=1)
        return act.interleave_gate_up(gate.contiguous(), up.contiguous())

    @torch.no_grad()
    def load_fp8_block(self, *, gate, up, down, gate_scale_inv, up_scale_inv, down_scale_inv):
        """DeepSeek-V3 FP8 experts: e4m3 [E, out, in] with fp32 scale_inv [E, ceil(out/128), ceil(in/128)]
        (weight = e4m3 * scale_inv per 128x128 block). Exact for fmt="fp8_block" when I % 128 == 0
        (gate and up blocks stay whole); other formats dequantize and requantize. With expert
        parallelism, E may also be this rank's experts alone."""
        gate, up, down, gate_scale_inv, up_scale_inv, down_scale_inv = self._own(
            gate, up, down, gate_scale_inv, up_scale_inv, down_scale_inv)
        e, i, h = self.num_local_experts, self.intermediate_size, self.hidden_size
        nb = lambda n: math.ceil(n / 128)  # noqa: E731
        for name, w, shape in (("gate", gate, (e, i, h)), ("up", up, (e, i, h)), ("down", down, (e, h, i))):
            self._check_weight(name, w, shape)
            if w.dtype != torch.float8_e4m3fn:
                raise TypeError(f"{name}: expected torch.float8_e4m3fn, got {w.dtype}")
        for name, s, w in (("gate_scale_inv", gate_scale_inv, gate), ("up_scale_inv", up_scale_inv, up),
                           ("down_scale_inv", down_scale_inv, down)):
            self._check_weight(name, s, (e, nb(w.shape[1]), nb(w.shape[2])))
        if self.fmt == "fp8_block" and i % 128 == 0:
            gate_up_scales = torch.cat((gate_scale_inv, up_scale_inv), dim=1).float().contiguous()
            self._store("gate_up", QuantizedTensor(torch.cat((gate, up), dim=1).contiguous(), gate_up_scales,
                                                   self.fmt, "b"))
            self._store("down", QuantizedTensor(down.contiguous(), down_scale_inv.float().contiguous(), self.fmt, "b"))
            return self._loaded("load_fp8_block")
        deq = lambda w, s: dequantize_operand(w, s.float(), "fp8_block", "b")  # noqa: E731
        return self.load_experts(gate=deq(gate, gate_scale_inv), up=deq(up, up_scale_inv),
                                 down=deq(down, down_scale_inv))

    @torch.no_grad()
    def load_mxfp4(self, *, gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias=None,
                   down_bias=None):
        """gpt-oss MXFP4 experts: blocks uint8 [E, out, in/32, 16] (two e2m1 a byte, element 2i in
        the low nibble), scales uint8 e8m0 [E, out, in/32]; gate_up rows interleaved (gate 0::2,
        up 1::2), biases [E, 2I] and [E, H].

        The layer's format: "bf16_mxfp4" unless the layer was built with another fmt, i.e. the
        weight bytes kept and bf16 activations, as gpt-oss runs. MoE(..., fmt="mxfp4") keeps the
        bytes too and quantizes the activations to MXFP4 as well (so does "w4a8", to MXFP8);
        other formats dequantize and requantize the weights. With expert parallelism, E may also
        be this rank's experts alone."""
        if self._chosen_fmt is None:
            self._use_format("bf16_mxfp4")
        gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias, down_bias = self._own(
            gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias, down_bias)
        e, i, h = self.num_local_experts, self.intermediate_size, self.hidden_size
        self._check_weight("gate_up_blocks", gate_up_blocks, (e, 2 * i, h // 32, 16))
        self._check_weight("gate_up_scales", gate_up_scales, (e, 2 * i, h // 32))
        self._check_weight("down_blocks", down_blocks, (e, h, i // 32, 16))
        self._check_weight("down_scales", down_scales, (e, h, i // 32))
        gu_data = gate_up_blocks.reshape(e, 2 * i, h // 2).view(torch.uint8).contiguous()
        dn_data = down_blocks.reshape(e, h, i // 2).view(torch.uint8).contiguous()
        gu_scales = gate_up_scales.view(torch.uint8).contiguous()
        dn_scales = down_scales.view(torch.uint8).contiguous()
        if get_format(self.fmt).b == get_format("mxfp4").b:  # (mxfp4, w4a8, bf16_mxfp4: MXFP4 weights)
            swz = self.scale_layout == "swizzled"
            for prefix, data, scales in (("gate_up", gu_data, gu_scales), ("down", dn_data, dn_scales)):
                scales = layouts.swizzle_b_scales(scales) if swz else scales
                self._store(prefix, QuantizedTensor(data, scales.view(torch.float8_e8m0fnu), self.fmt, "b",
                                                    self.scale_layout))
            self._set_biases(gate_up_bias, down_bias)
            return self._loaded("load_mxfp4")
        gate_up = dequantize_operand(gu_data, gu_scales.view(torch.float8_e8m0fnu), "mxfp4", "b")
        down = dequantize_operand(dn_data, dn_scales.view(torch.float8_e8m0fnu), "mxfp4", "b")
        return self.load_experts(gate_up=gate_up, gate_up_order="interleaved", down=down,
                                 gate_up_bias=gate_up_bias, down_bias=down_bias)

    @torch.no_grad()
    def load_router(self, weight, bias=None, correction_bias=None):
        """Router weight [E, H] (and gpt-oss's bias [E], DeepSeek's e_score_correction_bias [E])."""
        self._check_weight("weight", weight, (self.num_experts, self.hidden_size))
        self.router_weight.copy_(weight)
        if (bias is not None) != (self.router_bias is not None):
            raise ValueError(f"bias: this MoE was built with router_bias={self.router_bias is not None}")
        if bias is not None:
            self.router_bias.copy_(bias)
        if (correction_bias is not None) != (self.correction_bias is not None):
            raise ValueError("correction_bias: this MoE was built with "
                             f"correction_bias={self.correction_bias is not None}")
        if correction_bias is not None:
            self.correction_bias.copy_(correction_bias)
        return self

    # ---- state dict ----------------------------------------------------------------------

    def get_extra_state(self) -> dict:
        """What the expert tensors of state_dict() mean, as plain Python values (so that
        torch.load(weights_only=True) reads them): the format, the scale layout, the gate/up row
        order, the order of gate_up_data's and down_data's codes ("plain" or "prepacked") and the
        experts [first, last) of num_experts they hold (a rank's own with expert parallelism)."""
        return {"version": STATE_VERSION, "fmt": self.fmt, "scale_layout": self.scale_layout,
                "gate_up_layout": self.gate_up_layout,
                "gate_up_order": "prepacked" if self.gate_up_prepacked else "plain",
                "down_order": "prepacked" if self.down_prepacked else "plain",
                "experts": tuple(self.expert_range), "num_experts": self.num_experts}

    def set_extra_state(self, state: dict):
        """load_state_dict's last step, after _load_from_state_dict has turned the checkpoint's
        tensors into this layer's: `state` must describe the layer as it now is. A description of
        anything else raises rather than relabel tensors it does not convert."""
        if state != self.get_extra_state():
            raise ValueError(f"state: expected this layer's own description {self.get_extra_state()} "
                             f"(load_state_dict converts a checkpoint to it), got {state!r}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """torch's load, once the checkpoint's expert tensors are made what this layer would hold
        had its loaders run (_state_change: the format, the codes' order, the scale layout, the
        experts): the buffers they fill are made where none (or one of another shape) is, and
        copied into in place otherwise. Graphs captured on the old weights are dropped. With
        expert parallelism no rank changes its weights unless every rank can, and the ranks'
        loaded weights are compared after (two small collectives)."""
        try:
            change, failure = self._state_change(state_dict, prefix), None
        except (ValueError, TypeError) as error:
            change, failure = None, error
        if self.ep_group is not None:
            outcome = "ok" if failure is None else f"{type(failure).__name__}: {failure}"
            distributed.check_agreement("MoE.load_state_dict", {"load_state_dict": outcome}, self.ep_group)
        if failure is not None:
            raise failure
        state_dict = dict(state_dict)
        device = self.router_weight.device
        if change is not None:
            if change.fmt != self.fmt:  # (a layer built with fmt=None takes the checkpoint's)
                self._use_format(change.fmt)
                for name in _EXPERT_WEIGHTS:
                    setattr(self, name, None)
                self.gate_up_prepacked = self.down_prepacked = False
            for name, t in change.tensors.items():
                held = getattr(self, name)
                if held is None or held.shape != t.shape or held.dtype != t.dtype or held.device != device:
                    setattr(self, name, torch.empty(t.shape, dtype=t.dtype, device=device))
                state_dict[prefix + name] = t
            for weight, prepacked in change.prepacked.items():
                setattr(self, f"{weight}_prepacked", prepacked)
        given = state_dict.get(prefix + "intermediate_global_scale")
        if self.intermediate_global_scale is None and isinstance(given, torch.Tensor):
            self.intermediate_global_scale = torch.empty(given.shape, dtype=given.dtype, device=device)
        if prefix + "_extra_state" in state_dict:
            state_dict[prefix + "_extra_state"] = self.get_extra_state()
        self._graphs.clear()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self.ep_group is not None:
            self._loaded("load_state_dict")

    def _state_change(self, state_dict: dict, prefix: str) -> _StateChange | None:
        """The checkpoint's expert tensors (weights and biases) as this layer would hold them, or
        None where there are none; nothing on the layer changes. ValueError unless the
        checkpoint's extra state says what they mean, or where it differs in what cannot be
        converted: another format (unless the layer was built with fmt=None: then it takes the
        checkpoint's), another gate/up row order, other experts than the layer's or all of them.
        Converted: the codes' order (prepacked or plain, to what _keeps_prepacked says on the
        layer's device), the scale layout, the full checkpoint cut to a rank's experts."""
        names = _EXPERT_WEIGHTS + (("gate_up_bias", "down_bias") if self.has_expert_bias else ())
        given = {name: state_dict[prefix + name] for name in names if prefix + name in state_dict}
        if not given:
            return None
        key = prefix + "_extra_state"
        if key not in state_dict:
            raise ValueError(f"state_dict: expected {key!r} (what the expert tensors mean: format, order, scale "
                             f"layout) beside {', '.join(repr(prefix + name) for name in given)}")
        saved = _saved_meaning(state_dict[key], key)
        fmt = saved["fmt"]
        if fmt != self.fmt and self._chosen_fmt is not None:
            raise ValueError(f"state_dict: expected experts of format {self.fmt} (this layer's), got {fmt} (the "
                             f"checkpoint's); build the layer with fmt={fmt!r}, or fmt=None to take the checkpoint's")
        f = get_format(fmt)
        for name, size in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)):
            if size % f.k_multiple:
                raise ValueError(f"state_dict: the checkpoint's format {fmt} needs {name} a multiple of "
                                 f"{f.k_multiple}, this layer's is {size}")
        if saved["gate_up_layout"] != _gate_up_layout(fmt):
            raise ValueError(f"state_dict: expected gate/up rows {_gate_up_layout(fmt)!r} (this layer's order), got "
                             f"{saved['gate_up_layout']!r}")
        layout = _weight_scale_layout(fmt)
        if saved["scale_layout"] != layout and f.scaled and not f.swizzle_capable:
            raise ValueError(f"state_dict: expected scale layout {layout!r} (the only one of {fmt}), got "
                             f"{saved['scale_layout']!r}")
        first, last = self.expert_range
        saved_first, saved_last = saved["experts"]
        if saved["num_experts"] != self.num_experts or (saved_first, saved_last) not in ((first, last),
                                                                                        (0, self.num_experts)):
            raise ValueError(f"state_dict: holds experts [{saved_first}, {saved_last}) of {saved['num_experts']}, "
                             f"this layer keeps [{first}, {last}) of {self.num_experts}: expected those or all "
                             f"{self.num_experts}")
        cut = (saved_first, saved_last) != (first, last)
        device = self.router_weight.device
        e, i, h = self.num_local_experts, self.intermediate_size, self.hidden_size
        tensors, prepacked = {}, {}
        for weight, n, k in (("gate_up", 2 * i, h), ("down", h, i)):
            parts = _weight_parts(fmt, saved["scale_layout"], e, n, k)
            present = [part for part in _WEIGHT_PARTS if f"{weight}_{part}" in given]
            if not present:
                continue
            if list(parts) != present:  # (a weight's parts mean something only together)
                keys = lambda names: ", ".join(repr(f"{prefix}{weight}_{part}") for part in names)  # noqa: E731
                raise ValueError(f"state_dict: expected {keys(parts)} ({fmt} weights), got {keys(present)}")
            for part, (shape, dtypes) in parts.items():
                name = f"{weight}_{part}"
                t = self._checked_state(given[name], f"state_dict[{prefix + name!r}]", shape, dtypes, cut)
                if part == "scales":
                    t = t.view(dtypes[0])  # (e8m0 scales may come as their bytes)
                    if saved["scale_layout"] != layout:
                        t = (layouts.swizzle_b_scales(t) if layout == "swizzled"
                             else layouts.unswizzle_b_scales(t, n, math.ceil(k / f.b.block_k)))
                elif part == "data":
                    was = saved[f"{weight}_order"] == "prepacked"
                    if was:
                        check_prepackable(fmt, shape, f"state_dict[{key!r}] ({weight}_order 'prepacked')")
                    keeps = self._keeps_prepacked(fmt, n, k, device)
                    if was != keeps:  # (where the tensor lies: assign=True keeps the checkpoint's device)
                        t = prepack_codes(t) if keeps else unpack_codes(t)
                    prepacked[weight] = keeps
                tensors[name] = t
        for name, shape in (("gate_up_bias", (e, 2 * i)), ("down_bias", (e, h))):
            if name in given:
                t = self._checked_state(given[name], f"state_dict[{prefix + name!r}]", shape, None, cut)
                tensors[name] = t.float()
        return _StateChange(fmt, tensors, prepacked)

    def _checked_state(self, t, name: str, shape: tuple, dtypes, cut: bool) -> torch.Tensor:
        """A checkpoint's per-expert tensor: cut to this rank's experts where `cut` (it holds all
        of them), then of `shape` and one of `dtypes` (None: any float dtype), else ValueError
        naming it."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if cut:
            if t.dim() == 0 or t.shape[0] != self.num_experts:
                raise ValueError(f"{name}: expected the {self.num_experts} experts its extra state says it holds, "
                                 f"got shape {tuple(t.shape)}")
            t = t[self.expert_range[0]:self.expert_range[1]]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if dtypes is None and not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        if dtypes is not None and t.dtype not in dtypes:
            raise TypeError(f"{name}: expected {' or '.join(map(str, dtypes))}, got {t.dtype}")
        return t

    # ---- forward -------------------------------------------------------------------------

    def weights(self) -> tuple[QuantizedTensor, QuantizedTensor]:
        if self.gate_up_data is None or self.down_data is None:
            raise ValueError("MoE: no expert weights loaded (load_experts, load_fp8_block or load_mxfp4)")
        return (QuantizedTensor(self.gate_up_data, self.gate_up_scales, self.fmt, "b", self.scale_layout,
                                self.gate_up_global, prepacked=self.gate_up_prepacked),
                QuantizedTensor(self.down_data, self.down_scales, self.fmt, "b", self.scale_layout, self.down_global,
                                prepacked=self.down_prepacked))

    def route_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids int32 [T, k], topk_weights fp32 [T, k])."""
        if self.router == "sigmoid_grouped":
            logits = F.linear(x.float(), self.router_weight.float())
        else:
            logits = F.linear(x, self.router_weight, self.router_bias)
        return select_experts(logits, self.top_k, self.router, norm_topk_prob=self.norm_topk_prob,
                              correction_bias=self.correction_bias, n_group=self.n_group,
                              topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [..., H] of any float dtype -> [..., H] of the same dtype (computed in the
        layer's dtype, the router's). An eager call of few tokens replays a CUDA graph of the
        layer captured once for its shape (moegemm/graphed.py)."""
        if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states: expected a floating-point tensor, got "
                            f"{getattr(hidden_states, 'dtype', type(hidden_states).__name__)}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [..., {self.hidden_size}], got {tuple(hidden_states.shape)}")
        x = hidden_states.reshape(-1, self.hidden_size).to(self.router_weight.dtype)
        state = self._state()
        if self.ep_group is None and graphed.usable(x, *state, backend=self.backend):
            y = self._graphs(self._graph_key(state), self._forward_tokens, x)
        else:
            y = self._forward_tokens(x)
        return y.reshape(hidden_states.shape).to(hidden_states.dtype)

    def _state(self) -> list:
        """Every tensor the forward reads besides the tokens."""
        state = [self.router_weight, self.router_bias, self.correction_bias, self.gate_up_bias, self.down_bias,
                 self.intermediate_global_scale]
        for prefix in ("gate_up", "down"):
            state += [getattr(self, f"{prefix}_{part}") for part in ("data", "scales", "global")]
        if self.shared is not None:
            state += [linear.weight for linear in self.shared.values()]
        return state

    def _graph_key(self, state: list) -> tuple:
        """What a captured forward bakes in besides the tokens: the addresses of the tensors it reads
        (`state`, _state()) and the options."""
        return (tuple(None if t is None else t.data_ptr() for t in state), self.fmt, self.activation,
                self.router, self.backend, self.fused, self.swiglu_alpha, self.swiglu_limit, self.norm_topk_prob,
                self.routed_scaling_factor, self.gate_up_prepacked, self.down_prepacked)

    def _forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] in the layer's dtype -> [T, H]: the router, the routed experts, the shared expert."""
        topk_ids, topk_weights = self.route_tokens(x)
        w_gate_up, w_down = self.weights()
        y = moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, activation=self.activation,
                        gate_up_layout=self.gate_up_layout, gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                        intermediate_global_scale=self.intermediate_global_scale, alpha=self.swiglu_alpha,
                        limit=self.swiglu_limit, fused=self.fused, backend=self.backend, ep_group=self.ep_group,
                        ep_path=self.ep_path, ep_capacity=self.ep_capacity)
        if self.shared is not None:
            s = self.shared
            y = y + s["down"](F.silu(s["gate"](x)) * s["up"](x))
        return y
