"""transformers' experts backend (transformers 5.x ExpertsInterface):

    moegemm.hf.register()                                   # once: adds "moegemm"
    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="moegemm")
    model.set_experts_implementation("moegemm")             # or switch an existing model

Every experts module that dispatches through the interface then runs here: transformers'
router picks (top_k_index, top_k_weights) and moegemm computes the routed experts (moe_forward)
on the module's converted weights (converted.py; which modules: spec.py).

prepare(model) converts every module up front; call it before torch.compile: compiled code runs
the call as the moegemm::hf_experts op (opaque to the compiler and to its CUDA graphs), which
finds its module by the weights prepare saw and checks them at every call, so changes are seen
there too, with no graph break and no recompile.

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

transformers is imported only by register(): the modules' tensors are read by attribute.
"""

from __future__ import annotations

import torch

from .. import graphed
from ..compile_boundary import register_traced, traced_as
from ..formats import get_format
from ..moe import moe_forward
from ..ops import BACKENDS
from ..training import experts_with_grad
from .converted import check_sources, converted, forget, format_of, free_sources, freed, owner, source_tensors
from .spec import forget_spec, spec_of

__all__ = ["NAME", "experts_forward", "experts_modules", "experts_without_grad", "prepare", "refresh", "register"]

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
        check_sources(self)
        spec = spec_of(self)
        fmt = format_of(self, spec, _settings["fmt"])
        if fmt != "bf16":
            raise ValueError(f"{type(self).__name__}: gradients run on float experts in their own dtype, these run "
                             f"{fmt} ({self.gate_up_proj.dtype} weights); train with moegemm.hf.register(fmt=None) "
                             f"on float weights or another experts_implementation, or call under torch.no_grad()")
        return experts_with_grad(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                 gate_up_layout=spec.gate_up_layout, activation=spec.activation,
                                 gate_up_bias=getattr(self, "gate_up_proj_bias", None),
                                 down_bias=getattr(self, "down_proj_bias", None), alpha=spec.alpha,
                                 limit=spec.limit, transposed=spec.transposed, backend=_settings["backend"])
    return experts_without_grad(self, hidden_states, top_k_index, top_k_weights)


@traced_as("hf_experts")
def experts_without_grad(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """The call without gradients, eagerly: on the converted weights, made again where stale."""
    spec = spec_of(module)
    backend = _settings["backend"]
    experts = converted(module, spec, _settings["fmt"], _settings["free_source"])

    def call(hidden_states, top_k_index, top_k_weights):
        return moe_forward(hidden_states, top_k_index, top_k_weights, experts.w_gate_up, experts.w_down,
                           gate_up_layout=experts.gate_up_layout, activation=spec.activation,
                           gate_up_bias=experts.gate_up_bias, down_bias=experts.down_bias, alpha=spec.alpha,
                           limit=spec.limit, fused=_settings["fused"], backend=backend)

    if graphed.usable(hidden_states, backend=backend):  # (decode sizes: a graph of the call, captured once a shape)
        return experts.graphs((spec, _settings["fused"], backend), call, hidden_states, top_k_index, top_k_weights)
    return call(hidden_states, top_k_index, top_k_weights)


# Never captured into a CUDA graph (torch.compile's "reduce-overhead" runs the op between its
# graphs): a replay would skip the check and read the converted weights it was captured with.
_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("moegemm::hf_experts", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def _compiled_call(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   sources: list[torch.Tensor]) -> torch.Tensor:
    """experts_forward without gradients as compiled code runs it: opaque to the compiler, which
    passes the module's source tensors (source_tensors) as they are, so the op finds the module
    by them and runs the eager call (its converted weights checked and made again where stale).
    A pure function of its inputs; the converted weights are its cache."""
    return experts_without_grad.eager(owner(sources), hidden_states, top_k_index, top_k_weights)


@_compiled_call.register_fake
def _(hidden_states, top_k_index, top_k_weights, sources):
    return hidden_states.new_empty(hidden_states.shape)


def _traced_call(module, hidden_states, top_k_index, top_k_weights):
    """experts_without_grad as torch.compile traces it. Traced code cannot see a version counter or
    an optimizer step: the call, and the check of the converted weights with it, runs when the
    compiled code runs (_compiled_call)."""
    return _compiled_call(hidden_states, top_k_index, top_k_weights, list(source_tensors(module)))


register_traced("hf_experts", _traced_call)


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
        experts = converted(module, spec_of(module), _settings["fmt"], _settings["free_source"])
        if free_source:
            free_sources(module, experts)
    return len(modules)


def refresh(model) -> None:
    """Forget the converted weights of every experts module of `model` (the next call makes
    them again from the parameters). A model whose source weights were freed raises."""
    were_freed = [m for m in experts_modules(model) if freed(m) is not None]
    if were_freed:
        raise ValueError(f"model: the source weights of {len(were_freed)} experts modules ({type(were_freed[0]).__name__}) were "
                         f"freed (free_source=True) once converted: their converted weights are all there is, and "
                         f"nothing can be converted again")
    for module in experts_modules(model):
        forget(module)
        forget_spec(module)
