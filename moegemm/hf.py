"""transformers integration: an experts backend, and drop-in construction of `moegemm.MoE`.

The experts backend (transformers 5.x ExpertsInterface):

    moegemm.hf.register()                                   # once: adds "moegemm"
    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="moegemm")
    model.set_experts_implementation("moegemm")             # or switch an existing model

Every experts module that dispatches through the interface then runs here: transformers'
router picks (top_k_index, top_k_weights) and moegemm computes the routed experts (moe_forward).
Supported: gated experts (gate_up_proj + down_proj, optional biases) in any of transformers'
layouts ([out, in] or transposed [in, out]; gate and up rows concatenated or interleaved) whose
`_apply_gate` is SwiGLU (silu(gate) * up) or gpt-oss's clamped SwiGLU, recognised by computing
it once on a probe (alpha and limit read off its outputs, wherever and whether the module stores
them); transformers' fine-grained FP8 experts (FP8Experts, 128x128 block scales).
Anything else (no gate, a post-expert norm, another activation) raises a ValueError naming the
module.

Weights: the format is the weights' own unless register(fmt=...) names one: bf16 experts run
bf16 read in place in either layout ([E, out, in] as the kernels' [E, N, K]; gpt-oss's
[E, in, out] as its transpose, which the kernels read N-major: no copy), FP8Experts run
fp8_block on their own bytes and scales (with dynamic 1x128 activation scales: a module
calibrated with static ones raises unless fmt="fp8_block" is named), and a named format
quantizes the experts once (e.g. fmt="bf16_mxfp4" for gpt-oss: MXFP4 weights, bf16 activations; a
gpt-oss checkpoint that transformers dequantized to bf16 gets back exactly its MXFP4 codes).
Converted weights are kept with the module and checked at every call: made again when a source
parameter is replaced (its identity or address), changed in place (its version counter:
load_state_dict, copy_ or mul_ under no_grad, most optimizers) or held by a torch optimizer's
step (moegemm.optimizer_steps: fused optimizers write in place without advancing the version
counter). Changes made through `.data` outside an optimizer's step are not seen: call
refresh(model). prepare(model) converts every module up front; call it before torch.compile:
compiled code runs the call as the moegemm::hf_experts op (opaque to the compiler and to its CUDA
graphs), which finds its module by the weights prepare saw and checks them at every call, so
changes are seen there too, with no graph break and no recompile.

Freeing the source: register(..., free_source=True) or prepare(model, free_source=True) keep only
the converted copy of a module whose weights are copied (a named format, e.g. a bf16 checkpoint
run in fp8_block): right after its conversion, layer by layer, its gate_up_proj and down_proj
(and FP8 experts' scale_inv) become empty tensors that require no grad. The module then runs
through this backend alone, on the kept copy: another experts_implementation fails on the empty
weights, and gradients, refresh(model) and another format raise a ValueError saying the sources
were freed; the model's state dict holds the empty tensors. Weights read in place have nothing
to free and stay.

Gradients (training): a call under grad runs moegemm.training (gradients to the hidden states,
the router weights, the expert weights and biases): bf16 products for bf16 weights and for fp32
master weights under torch.autocast to bf16 (gradients in the weights' dtype), fp32 products for
float weights otherwise; quantized formats raise.

from_transformers(block) builds a standalone moegemm.MoE from a whole MoE block (router
included). Supported blocks and the checkpoint layouts they hold (read from transformers 5.23):
    Qwen3MoeSparseMoeBlock  experts.gate_up_proj [E, 2I, H] ([out, in], gate rows then up rows),
                            experts.down_proj [E, H, I]; router gate.weight [E, H], softmax then
                            top-k, renormalized when norm_topk_prob
    GptOssMLP               experts.gate_up_proj [E, H, 2I] ([in, out], gate and up columns
                            interleaved) + gate_up_proj_bias [E, 2I], down_proj [E, I, H] +
                            down_proj_bias [E, H]; router.weight/bias, top-k then softmax;
                            clamped SwiGLU (alpha, limit)
    DeepseekV3MoE           experts as Qwen3; gate.weight, gate.e_score_correction_bias,
                            grouped sigmoid routing, routed_scaling_factor; shared_experts MLP
transformers is imported only by register(): the modules' tensors are read by attribute.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from . import graphed, optimizer_steps
from .formats import get_format
from .gate_up import swiglu
from .layer_forward import moe_forward
from .moe import MoE
from .ops import BACKENDS
from .quantize import dequantize_operand
from .quantized_tensor import QuantizedTensor
from .training import experts_with_grad
from .validation import readable_weights

__all__ = ["from_transformers", "register", "prepare", "refresh", "experts_forward", "experts_modules", "NAME"]

NAME = "moegemm"

# register()'s choices: the format (None: the weights' own), the backend, the fused epilogue and
# whether a conversion that copies the weights frees their source.
_settings = {"fmt": None, "backend": "auto", "fused": True, "free_source": False}


def register(fmt: str | None = None, *, backend: str = "auto", fused: bool = True, free_source: bool = False) -> str:
    """Add "moegemm" to transformers' experts interfaces (the bf16 one and the fine-grained FP8
    one); calling it again only changes the settings, which the next forward uses. fmt: the
    experts' format (any of moegemm.FORMATS; None: the weights' own, module docstring).
    free_source: a module whose weights are converted into a copy (a named format) then keeps
    that copy alone (module docstring, freeing the source).
    Returns the name to pass as experts_implementation."""
    from transformers.integrations.moe import ExpertsInterface

    if fmt is not None:
        fmt = get_format(fmt).name
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    _settings.update(fmt=fmt, backend=backend, fused=bool(fused), free_source=bool(free_source))
    ExpertsInterface.register(NAME, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # (a transformers without fine-grained FP8 experts)
        return NAME
    FP8ExpertsInterface.register(NAME, experts_forward)
    return NAME


@dataclass(frozen=True)
class _Spec:
    """How an experts module computes: its activation, gate/up order and weight layout."""

    activation: str  # "swiglu" or "swiglu_oai"
    gate_up_layout: str  # of gate_up_proj's output columns: "concat" or "interleaved"
    transposed: bool  # weights [E, in, out] (gpt-oss) rather than [E, out, in]
    alpha: float
    limit: float
    fp8_block: bool  # FP8Experts: e4m3 weights with 128x128 scale_inv


def _unsupported(module, why: str) -> ValueError:
    return ValueError(f"{type(module).__name__}: moegemm's experts backend {why}; run this model with another "
                      f"experts_implementation (e.g. 'grouped_mm')")


# The probe of a module's _apply_gate: (gate, up) pairs in float64, so that the constants they reveal
# come out exact. (g, 0) with g < 0 is below any clamp: a clamped SwiGLU gives g * sigmoid(alpha * g),
# which reveals alpha; (-1, 2**40) against (-1, 0) gives the up clamp's (limit + 1) / 1, which reveals
# the limit. The other pairs (magnitudes 2**-8 to 2**60, random ones) check that the form found
# reproduces the module's outputs, a clamp at any magnitude included.
_ALPHA_GATES = tuple(-(2.0 ** k) for k in range(-4, 5))
_LIMIT_PAIRS = ((-1.0, 0.0), (-1.0, 2.0 ** 40))
_PROBE_WIDTH = 8  # outputs a probe row (from 16 gate/up columns)


def _probe() -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up), each [rows, _PROBE_WIDTH] float64: the alpha pairs, the limit pairs, then the check's."""
    pairs = [(g, 0.0) for g in _ALPHA_GATES] + list(_LIMIT_PAIRS)
    for k in range(-8, 61, 4):
        pairs += [(2.0 ** k, 1.5), (-(2.0 ** k), 1.5), (0.5, 2.0 ** k), (0.5, -(2.0 ** k))]
    rows = -(-(len(pairs) + 64) // _PROBE_WIDTH)
    count = rows * _PROBE_WIDTH - len(pairs)
    random = torch.randn(count, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    both = torch.cat([torch.tensor(pairs, dtype=torch.float64), random * torch.logspace(0, 2, count,
                                                                                       dtype=torch.float64)[:, None]])
    return both[:, 0].reshape(rows, _PROBE_WIDTH), both[:, 1].reshape(rows, _PROBE_WIDTH)


def _shortest(x: float) -> float:
    """x in the fewest significant digits within 1e-9 of it (relative): the constant as its source
    wrote it (1.702, not the probe's 1.7020000000000002)."""
    for digits in range(1, 18):
        short = float(f"{x:.{digits}g}")
        if abs(short - x) <= 1e-9 * abs(x):
            return short
    return x


def _fit_clamped_swiglu(out: torch.Tensor) -> tuple[float, float] | None:
    """(alpha, limit) of a clamped SwiGLU read off the probe's outputs (flattened, float64), or None
    where they cannot come from one."""
    alpha_out = out[:len(_ALPHA_GATES)]
    gates = torch.tensor(_ALPHA_GATES, dtype=torch.float64)
    p = alpha_out / gates  # sigmoid(alpha * g)
    usable = (p > 0) & (p < 1)
    if not usable.any():
        return None
    logit = torch.log(p) - torch.log1p(-p)
    # The pair least disturbed by rounding: sigmoid neither flat (saturated) nor its argument tiny.
    best = torch.where(usable, p * (1 - p) * logit.abs(), torch.tensor(-1.0, dtype=torch.float64)).argmax()
    alpha = float(logit[best] / gates[best])
    below, above = (float(v) for v in out[len(_ALPHA_GATES):len(_ALPHA_GATES) + 2])
    if below == 0 or not math.isfinite(above / below):
        return None
    limit = above / below - 1
    if not (math.isfinite(alpha) and limit > 0):
        return None
    return _shortest(alpha), _shortest(limit)


def _gate_kind(module) -> tuple[str, str, float, float]:
    """(activation, gate/up order, alpha, limit) of the module's _apply_gate, found by computing it on
    a probe: SwiGLU, or gpt-oss's clamped SwiGLU with the alpha and limit its outputs reveal, each
    kept only where it reproduces every output of the probe. Per module, not per class: one class
    (transformers' FP8Experts) computes another gate for another config; the constants are read from
    what the gate computes, not from the names of the attributes that hold them."""
    gate, up = _probe()
    device = module.down_proj.device
    for layout in ("concat", "interleaved"):
        probe = torch.cat([gate, up], 1) if layout == "concat" else torch.stack([gate, up], 2).flatten(1)
        with torch.no_grad():
            got = module._apply_gate(probe.to(device)).cpu()
        if got.shape != gate.shape:
            continue
        got = got.double()
        candidates = [("swiglu", 1.702, 7.0)]
        fit = _fit_clamped_swiglu(got.flatten())
        if fit is not None:
            candidates.append(("swiglu_oai", *fit))
        for activation, alpha, limit in candidates:
            want = swiglu(probe, activation, gate_up_layout=layout, alpha=alpha, limit=limit).double()
            if torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                return activation, layout, alpha, limit
    raise _unsupported(module, "runs SwiGLU and gpt-oss's clamped SwiGLU only, and this module's _apply_gate "
                               "computes neither")


def _spec(module) -> _Spec:
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        raise _unsupported(module, "needs gated experts (gate_up_proj)")
    if getattr(module, "has_post_expert_norm", False):
        raise _unsupported(module, "has no post-expert norm")
    fp8_block = hasattr(module, "gate_up_proj_scale_inv")
    if fp8_block and (tuple(getattr(module, "block_size", None) or ()) != (128, 128)
                      or module.gate_up_proj.dtype != torch.float8_e4m3fn):
        raise _unsupported(module, f"reads FP8 experts with 128x128 e4m3 blocks only (block_size "
                                   f"{getattr(module, 'block_size', None)}, {module.gate_up_proj.dtype})")
    activation, layout, alpha, limit = _gate_kind(module)
    return _Spec(activation, layout, bool(getattr(module, "is_transposed", False)), alpha, limit, fp8_block)


@dataclass
class _Experts:
    """The weights a module's calls read, and what they were made from."""

    fmt: str
    sources: tuple  # _stamp() of each source parameter, to notice a change
    w_gate_up: QuantizedTensor
    w_down: QuantizedTensor
    gate_up_layout: str
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    graphs: graphed.GraphedCalls = field(default_factory=graphed.GraphedCalls)  # calls replayed at decode sizes

    def current(self, fmt: str, sources: tuple) -> bool:
        return self.fmt == fmt and len(sources) == len(self.sources) and all(
            a is b and a._version == v and a.data_ptr() == p and optimizer_steps.generation(a) == g
            for a, (b, v, p, g) in zip(sources, self.sources))


def _stamp(t: torch.Tensor) -> tuple:
    """What tells a later call that `t` changed: the tensor itself (replaced), its version counter
    (in-place ops), its address (`.data` reassigned) and its optimizer step generation (fused
    optimizers write in place without advancing the version counter)."""
    return t, t._version, t.data_ptr(), optimizer_steps.watch(t)


def _source_tensors(module) -> tuple:
    names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "gate_up_proj_scale_inv",
             "down_proj_scale_inv")
    return tuple(t for t in (getattr(module, n, None) for n in names) if isinstance(t, torch.Tensor))


def _float_weights(module, spec: _Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) in nn.Linear's [out, in] convention for the quantizers:
    views of float parameters (transposed ones too; MoE.load_experts quantizes a few experts at a
    time, so no whole-layer copy is made), FP8 experts dequantized with their 128x128 scales (fp32
    copies)."""
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    if spec.fp8_block:
        gate_up = dequantize_operand(gate_up, module.gate_up_proj_scale_inv.detach().float(), "fp8_block", "b")
        down = dequantize_operand(down, module.down_proj_scale_inv.detach().float(), "fp8_block", "b")
    if spec.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def _bias(t) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


@torch.no_grad()
def _convert(module, spec: _Spec, fmt: str, sources: tuple) -> _Experts:
    _check_sources(module, fmt)
    gate_up_bias, down_bias = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)
    if (fmt == "fp8_block" and spec.fp8_block) or (fmt == "bf16" and module.gate_up_proj.dtype == torch.bfloat16):
        # The weights as transformers holds them are the kernels' B operand, read in place: [E, N, K],
        # or for bf16 [E, in, out] (gpt-oss), whose transpose the kernels read N-major.
        scale = (lambda name: getattr(module, name).detach().float().contiguous()) if spec.fp8_block else \
            (lambda name: None)
        gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
        if spec.transposed and not spec.fp8_block:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        w_gate_up = QuantizedTensor(readable_weights(gate_up, fmt), scale("gate_up_proj_scale_inv"), fmt, "b")
        w_down = QuantizedTensor(readable_weights(down, fmt), scale("down_proj_scale_inv"), fmt, "b")
        return _Experts(fmt, sources, w_gate_up, w_down, spec.gate_up_layout, _bias(gate_up_bias), _bias(down_bias))
    gate_up, down = _float_weights(module, spec)
    num_experts, two_i, hidden = gate_up.shape
    layer = MoE(hidden, two_i // 2, num_experts, 1, fmt=fmt, activation=spec.activation, expert_bias=(
        gate_up_bias is not None or down_bias is not None), device=gate_up.device)
    layer.load_experts(gate_up=gate_up, gate_up_order=spec.gate_up_layout, down=down, gate_up_bias=gate_up_bias,
                       down_bias=down_bias)
    w_gate_up, w_down = layer.weights()
    experts = _Experts(fmt, sources, w_gate_up, w_down, layer.gate_up_layout, layer.gate_up_bias, layer.down_bias)
    if _settings["free_source"]:
        _free_sources(module, experts)
    return experts


# module.__dict__ key of a module whose source weights were freed: the format of the converted
# weights, which are then all that is left of them.
_FREED = "_moegemm_freed"


def _free_sources(module, experts: _Experts) -> None:
    """Release the storage of the module's expert weights (gate_up_proj, down_proj and FP8 experts'
    scale_inv), of which `experts` holds a converted copy: they become empty tensors (numel 0, same
    dtype and device) that require no grad, whoever else holds them (an optimizer), and the module
    is marked, so that nothing converts them again (_check_sources). Weights read in place (bf16,
    FP8Experts run fp8_block) are the converted weights themselves: kept."""
    if module.__dict__.get(_FREED) is not None:
        return
    names = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
    sources = [t for t in (getattr(module, n, None) for n in names) if isinstance(t, torch.Tensor)]
    kept = {t.untyped_storage().data_ptr() for t in (experts.w_gate_up.data, experts.w_down.data)}
    if any(t.untyped_storage().data_ptr() in kept for t in sources):
        return
    for t in sources:
        t.grad = None
        t.requires_grad_(False)
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    module.__dict__[_FREED] = experts.fmt


def _check_sources(module, fmt: str | None = None) -> None:
    """ValueError where the module's source weights were freed and something needs them: a
    conversion into another format than the one kept (fmt), or gradients (fmt None)."""
    freed = module.__dict__.get(_FREED)
    if freed is not None and freed != fmt:
        need = "gradients" if fmt is None else f"a conversion to {fmt}"
        raise ValueError(f"{type(module).__name__}: its source weights were freed (free_source=True) once converted "
                         f"to {freed}, and {need} would need them; reload the model to run it otherwise")


def _format_of(module, spec: _Spec) -> str:
    if _settings["fmt"] is not None:
        return _settings["fmt"]
    scheme = getattr(module, "activation_scheme", "dynamic")
    if spec.fp8_block and scheme != "dynamic":
        # The module's own math quantizes activations with calibrated scales; ours computes them
        # for every 1x128 block: run that only when asked for by name.
        raise _unsupported(module, f"quantizes activations with dynamic 1x128 scales, and this module's "
                                   f"activation_scheme is {scheme!r} (moegemm.hf.register(fmt='fp8_block') runs "
                                   f"its weights with dynamic activation scales)")
    return "fp8_block" if spec.fp8_block else "bf16"


def _experts(module, spec: _Spec) -> _Experts:
    """The module's converted weights, made again where a source changed (module docstring).
    Eager only: compiled code reaches it through the moegemm::hf_experts op."""
    fmt = _format_of(module, spec)
    cached = module.__dict__.get("_moegemm_experts")
    if module.__dict__.get(_FREED) is not None and cached is not None:  # (the converted weights are all there is)
        _check_sources(module, fmt)
        return cached
    sources = _source_tensors(module)
    if cached is None or not cached.current(fmt, sources):
        module.__dict__["_moegemm_experts"] = None  # (the old copy freed before the new one is made)
        cached = _convert(module, spec, fmt, tuple(_stamp(t) for t in sources))
        module.__dict__["_moegemm_experts"] = cached
        _remember_owner(module)
    return cached


def _module_spec(module) -> _Spec:
    spec = module.__dict__.get("_moegemm_spec")
    if spec is None:
        spec = module.__dict__["_moegemm_spec"] = _spec(module)
    return spec


def _needs_grad(module, hidden_states, top_k_weights) -> bool:
    """Whether the call must give gradients: to its inputs, or to trainable (not 1-byte, not
    block-scale) weights and biases."""
    if not torch.is_grad_enabled():
        return False
    trainable = (getattr(module, n, None) for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"))
    return hidden_states.requires_grad or top_k_weights.requires_grad or any(
        t.requires_grad and t.element_size() > 1 for t in trainable if isinstance(t, torch.Tensor))


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call: hidden_states [T, H], top_k_index [T, k] (ids outside [0, E)
    are dropped), top_k_weights [T, k] -> [T, H] in hidden_states' dtype (module docstring)."""
    if _needs_grad(self, hidden_states, top_k_weights):
        _check_sources(self)
        spec = _module_spec(self)
        fmt = _format_of(self, spec)
        if fmt != "bf16":
            raise ValueError(f"{type(self).__name__}: gradients run on float experts in their own dtype, these run "
                             f"{fmt} ({self.gate_up_proj.dtype} weights); train with moegemm.hf.register(fmt=None) "
                             f"on float weights or another experts_implementation, or call under torch.no_grad()")
        return experts_with_grad(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                 gate_up_layout=spec.gate_up_layout, activation=spec.activation,
                                 gate_up_bias=getattr(self, "gate_up_proj_bias", None),
                                 down_bias=getattr(self, "down_proj_bias", None), alpha=spec.alpha,
                                 limit=spec.limit, transposed=spec.transposed, backend=_settings["backend"])
    if torch.compiler.is_compiling():
        # Traced code cannot see a version counter or an optimizer step: the call, and the check
        # of the converted weights with it, runs when the compiled code runs (_compiled_call).
        return torch.ops.moegemm.hf_experts(hidden_states, top_k_index, top_k_weights, list(_source_tensors(self)))
    return _call(self, hidden_states, top_k_index, top_k_weights)


def _call(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The call without gradients, eagerly: on the converted weights, made again where stale."""
    spec = _module_spec(module)
    backend = _settings["backend"]
    experts = _experts(module, spec)

    def call(hidden_states, top_k_index, top_k_weights):
        return moe_forward(hidden_states, top_k_index, top_k_weights, experts.w_gate_up, experts.w_down,
                           gate_up_layout=experts.gate_up_layout, activation=spec.activation,
                           gate_up_bias=experts.gate_up_bias, down_bias=experts.down_bias, alpha=spec.alpha,
                           limit=spec.limit, fused=_settings["fused"], backend=backend)

    if graphed.usable(hidden_states, backend=backend):  # (decode sizes: a graph of the call, captured once a shape)
        return experts.graphs((spec, _settings["fused"], backend), call, hidden_states, top_k_index, top_k_weights)
    return call(hidden_states, top_k_index, top_k_weights)


# The experts module of each gate_up_proj moegemm has converted, by the tensor's id (weakly):
# how the compiled call, which is given the module's tensors, finds the module.
_owners: dict[int, weakref.ref] = {}


def _remember_owner(module) -> None:
    weight = module.gate_up_proj
    if id(weight) not in _owners:
        weakref.finalize(weight, _owners.pop, id(weight), None)  # (gone with the tensor, before its id is reused)
    _owners[id(weight)] = weakref.ref(module)


def _owner(sources: list[torch.Tensor]):
    """The experts module whose source tensors are `sources` (_remember_owner)."""
    ref = _owners.get(id(sources[0])) if sources else None
    module = ref() if ref is not None else None
    held = _source_tensors(module) if module is not None else ()
    if len(sources) != len(held) or any(a is not b for a, b in zip(sources, held)):
        raise RuntimeError("moegemm.hf: a compiled experts call was given weights moegemm has not seen (compiled "
                           "before moegemm.hf.prepare(model), or parameters replaced since): call "
                           "moegemm.hf.prepare(model)")
    return module


# Never captured into a CUDA graph (torch.compile's "reduce-overhead" runs the op between its
# graphs): a replay would skip the check and read the converted weights it was captured with.
_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("moegemm::hf_experts", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def _compiled_call(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   sources: list[torch.Tensor]) -> torch.Tensor:
    """experts_forward without gradients as compiled code runs it: opaque to the compiler, which
    passes the module's source tensors (_source_tensors) as they are, so the op finds the module
    by them and runs the eager call (its converted weights checked and made again where stale).
    A pure function of its inputs; the converted weights are its cache."""
    return _call(_owner(sources), hidden_states, top_k_index, top_k_weights)


@_compiled_call.register_fake
def _(hidden_states, top_k_index, top_k_weights, sources):
    return hidden_states.new_empty(hidden_states.shape)


def experts_modules(model) -> list:
    """The experts modules of `model` that dispatch through transformers' experts interface."""
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")
            and hasattr(m, "_apply_gate")]


def prepare(model, *, free_source: bool = False) -> int:
    """Convert the weights of every experts module of `model` now (and check that moegemm runs
    them: a ValueError names a module it cannot); returns how many there are. Before
    torch.compile: a compiled call finds its module by the weights converted here (or by an
    eager call), and raises a RuntimeError for weights it has not seen. free_source: free each
    module's source weights right after its conversion into a copy, as
    register(free_source=True) does at every conversion (module docstring): a bf16 model runs a
    quantized format in the memory of the model's other weights, its quantized experts and a
    workspace of one layer."""
    modules = experts_modules(model)
    for module in modules:
        experts = _experts(module, _module_spec(module))
        if free_source:
            _free_sources(module, experts)
    return len(modules)


def refresh(model) -> None:
    """Forget the converted weights of every experts module of `model` (the next call makes
    them again from the parameters). A model whose source weights were freed raises."""
    freed = [m for m in experts_modules(model) if m.__dict__.get(_FREED) is not None]
    if freed:
        raise ValueError(f"model: the source weights of {len(freed)} experts modules ({type(freed[0]).__name__}) were "
                         f"freed (free_source=True) once converted: their converted weights are all there is, and "
                         f"nothing can be converted again")
    for module in experts_modules(model):
        module.__dict__.pop("_moegemm_experts", None)
        module.__dict__.pop("_moegemm_spec", None)


@torch.no_grad()
def from_transformers(block, fmt: str = "bf16", *, backend: str = "auto", fused: bool = True, ep_group=None,
                      ep_path: str = "auto", ep_capacity: int | None = None) -> MoE:
    """A moegemm.MoE computing `block`'s output, its experts quantized into `fmt` (any format; the
    weight-only ones, e.g. "bf16_mxfp4" for gpt-oss, keep the activations in bf16). ep_group,
    ep_path, ep_capacity: MoE's expert parallelism (this rank keeps its experts of the block's)."""
    name = type(block).__name__
    device = next(block.parameters()).device
    dtype = next(block.parameters()).dtype if name != "DeepseekV3MoE" else block.experts.gate_up_proj.dtype
    common = dict(fmt=fmt, backend=backend, fused=fused, device=device, dtype=dtype, ep_group=ep_group,
                  ep_path=ep_path, ep_capacity=ep_capacity)
    if name in ("Qwen3MoeSparseMoeBlock", "DeepseekV3MoE"):
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        num_experts, two_i, hidden = gate_up.shape
        gate = block.gate
        if name == "Qwen3MoeSparseMoeBlock":
            layer = MoE(hidden, two_i // 2, num_experts, int(gate.top_k), router="softmax_topk",
                        norm_topk_prob=bool(gate.norm_topk_prob), **common)
            layer.load_router(gate.weight)
        else:
            shared = block.shared_experts
            layer = MoE(hidden, two_i // 2, num_experts, int(gate.top_k), router="sigmoid_grouped",
                        norm_topk_prob=bool(gate.norm_topk_prob), n_group=int(gate.num_group),
                        topk_group=int(gate.topk_group), routed_scaling_factor=float(gate.routed_scaling_factor),
                        correction_bias=True, shared_intermediate_size=shared.gate_proj.weight.shape[0], **common)
            layer.load_router(gate.weight, correction_bias=gate.e_score_correction_bias.float())
            layer.shared["gate"].weight.copy_(shared.gate_proj.weight)
            layer.shared["up"].weight.copy_(shared.up_proj.weight)
            layer.shared["down"].weight.copy_(shared.down_proj.weight)
        return layer.load_experts(gate_up=gate_up, gate_up_order="concat", down=down)
    if name == "GptOssMLP":
        ex, router = block.experts, block.router
        num_experts, hidden, two_i = ex.gate_up_proj.shape
        layer = MoE(hidden, two_i // 2, num_experts, int(router.top_k), activation="swiglu_oai", router="topk_softmax",
                    router_bias=True, expert_bias=True, swiglu_alpha=float(ex.alpha), swiglu_limit=float(ex.limit),
                    **common)
        layer.load_router(router.weight, router.bias)
        return layer.load_experts(gate_up=ex.gate_up_proj.transpose(1, 2), gate_up_order="interleaved",
                                  down=ex.down_proj.transpose(1, 2), gate_up_bias=ex.gate_up_proj_bias,
                                  down_bias=ex.down_proj_bias)
    raise TypeError(f"block: expected Qwen3MoeSparseMoeBlock, GptOssMLP or DeepseekV3MoE, got {name}")
