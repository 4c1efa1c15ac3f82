"""The MoE layer as a module: router, routed experts (forward.moe_forward), optional shared expert,
loaders for checkpoints (weights.py), its state dict (state.py) and the graphs of its decode calls.

    layer = moegemm.MoE(hidden, width, experts, top_k, fmt="mxfp8"); layer.load_experts(...)
    y = layer(x)

Gate/up weights are one [E, 2I, H] operand. For every format but fp8_block its rows are
interleaved (2j = gate_j, 2j+1 = up_j: moegemm.interleave_gate_up), the layout the fused
epilogue wants. fp8_block keeps DeepSeek's concatenated [gate; up] rows, because interleaving
would split the 128x128 scale blocks of an FP8 checkpoint; its SwiGLU runs after the matmul.

Expert parallelism (ep_group): rank r of W keeps experts [r*E/W, (r+1)*E/W); parallel.py,
forward.py and distributed.py move the tokens.

Routers (MoE.route_tokens): routing.select_experts, the three the supported checkpoints use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import distributed, graphed
from ..formats import get_format
from ..gate_up import check_activation
from ..quantized_tensor import QuantizedTensor
from ..routing import ROUTERS, select_experts
from . import parallel, weights
from .forward import moe_forward
from .state import EXPERT_WEIGHTS, STATE_VERSION, state_change

__all__ = ["MoE"]


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
    same arguments with or without weights, or raises naming both sides (state.py).
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
        check_activation(activation)
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
        self.chosen_fmt = None if fmt is None else get_format(fmt).name
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
                fmt=self.chosen_fmt, activation=activation, router=router, ep_path=ep_path, ep_capacity=ep_capacity,
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
        fmt = get_format(fmt).name
        weights.check_sizes(fmt, self.hidden_size, self.intermediate_size)
        self.fmt = fmt
        self.gate_up_layout = weights.gate_up_layout(fmt)
        self.scale_layout = weights.weight_scale_layout(fmt).name

    def _form(self, fmt: str | None = None) -> weights.WeightForm:
        """What the loaders make weights into: this layer's format, or `fmt` (a loader's own)."""
        return weights.WeightForm(fmt or self.fmt, self.prepack, self.backend)

    def _sizes(self) -> tuple[int, int, int]:
        """(E, I, H) of the weights this rank keeps."""
        return self.num_local_experts, self.intermediate_size, self.hidden_size

    def _own(self, *tensors):
        return parallel.own_experts(tensors, self.expert_range, self.num_experts)

    def _check_biases(self, *biases):
        if self.has_expert_bias != any(b is not None for b in biases):
            raise ValueError(f"gate_up_bias, down_bias: this MoE was built with expert_bias={self.has_expert_bias}")

    def _store(self, experts: weights.ExpertWeights, loader: str):
        for prefix, q in (("gate_up", experts.w_gate_up), ("down", experts.w_down)):
            setattr(self, f"{prefix}_prepacked", q.prepacked)
            setattr(self, f"{prefix}_data", q.data)
            setattr(self, f"{prefix}_scales", q.scales)
            setattr(self, f"{prefix}_global", q.global_scale)
        if experts.gate_up_bias is not None:
            self.gate_up_bias = experts.gate_up_bias
        if experts.down_bias is not None:
            self.down_bias = experts.down_bias
        return self._loaded(loader)

    @torch.no_grad()
    def load_experts(self, *, gate=None, up=None, gate_up=None, down, gate_up_order: str = "concat",
                     gate_bias=None, up_bias=None, gate_up_bias=None, down_bias=None):
        """Float expert weights in nn.Linear's [out, in] convention, quantized into `fmt`.

        Per expert: gate, up [E, I, H] and down [E, H, I]; or a fused gate_up [E, 2I, H] whose
        rows are [gate; up] (gate_up_order="concat") or alternate (gate_up_order="interleaved",
        gpt-oss). Biases likewise: gate_bias/up_bias [E, I] or gate_up_bias [E, 2I], down_bias [E, H].
        With expert parallelism, E may also be this rank's experts alone (num_local_experts).
        """
        self._check_biases(gate_bias, up_bias, gate_up_bias, down_bias)
        gate, up, gate_up, down, gate_bias, up_bias, gate_up_bias, down_bias = self._own(
            gate, up, gate_up, down, gate_bias, up_bias, gate_up_bias, down_bias)
        return self._store(weights.from_float(
            gate=gate, up=up, gate_up=gate_up, down=down, gate_up_order=gate_up_order, gate_bias=gate_bias,
            up_bias=up_bias, gate_up_bias=gate_up_bias, down_bias=down_bias, sizes=self._sizes(), form=self._form(),
            hint=parallel.shape_hint(self.ep_group, self.num_experts)), "load_experts")

    @torch.no_grad()
    def load_fp8_block(self, *, gate, up, down, gate_scale_inv, up_scale_inv, down_scale_inv):
        """DeepSeek-V3 FP8 experts: e4m3 [E, out, in] with fp32 scale_inv [E, ceil(out/128), ceil(in/128)]
        (weight = e4m3 * scale_inv per 128x128 block). Exact for fmt="fp8_block" when I % 128 == 0
        (gate and up blocks stay whole); other formats dequantize and requantize. With expert
        parallelism, E may also be this rank's experts alone. FP8 block checkpoints carry no
        expert biases: a layer built with expert_bias=True raises a ValueError."""
        self._check_biases()
        gate, up, down, gate_scale_inv, up_scale_inv, down_scale_inv = self._own(
            gate, up, down, gate_scale_inv, up_scale_inv, down_scale_inv)
        return self._store(weights.from_fp8_block(
            gate=gate, up=up, down=down, gate_scale_inv=gate_scale_inv, up_scale_inv=up_scale_inv,
            down_scale_inv=down_scale_inv, sizes=self._sizes(), form=self._form(),
            hint=parallel.shape_hint(self.ep_group, self.num_experts)), "load_fp8_block")

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
        fmt = "bf16_mxfp4" if self.chosen_fmt is None else self.fmt
        weights.check_sizes(fmt, self.hidden_size, self.intermediate_size)
        self._check_biases(gate_up_bias, down_bias)
        gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias, down_bias = self._own(
            gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias, down_bias)
        experts = weights.from_mxfp4(
            gate_up_blocks=gate_up_blocks, gate_up_scales=gate_up_scales, down_blocks=down_blocks,
            down_scales=down_scales, gate_up_bias=gate_up_bias, down_bias=down_bias, sizes=self._sizes(),
            form=self._form(fmt), hint=parallel.shape_hint(self.ep_group, self.num_experts))
        self._use_format(fmt)  # (once the weights are made: a loader that raises changes nothing)
        return self._store(experts, "load_mxfp4")

    @torch.no_grad()
    def load_router(self, weight, bias=None, correction_bias=None):
        """Router weight [E, H] (and gpt-oss's bias [E], DeepSeek's e_score_correction_bias [E])."""
        weights.check_weight("weight", weight, (self.num_experts, self.hidden_size))
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
        had its loaders run (state_change: the format, the codes' order, the scale layout, the
        experts): the buffers they fill are made where none (or one of another shape) is, and
        copied into in place otherwise. Graphs captured on the old weights are dropped. With
        expert parallelism no rank changes its weights unless every rank can, and the ranks'
        loaded weights are compared after (two small collectives)."""
        try:
            change, failure = state_change(self, state_dict, prefix), None
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
                for name in EXPERT_WEIGHTS:
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
