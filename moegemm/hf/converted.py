"""The weights an experts module's calls read: converted once from the module's parameters, kept
with the module, checked at every call.

The format is the weights' own unless register(fmt=...) names one: bf16 experts run bf16 read in
place in either layout ([E, out, in] as the kernels' [E, N, K]; gpt-oss's [E, in, out] as its
transpose, which the kernels read N-major: no copy), FP8Experts run fp8_block on their own bytes
and scales (with dynamic 1x128 activation scales: a module calibrated with static ones raises
unless fmt="fp8_block" is named), and a named format quantizes the experts once (moe.weights;
e.g. fmt="bf16_mxfp4" for gpt-oss: MXFP4 weights, bf16 activations; a gpt-oss checkpoint that
transformers dequantized to bf16 gets back exactly its MXFP4 codes). Converted weights are made
again when a source parameter is replaced (its identity or address), changed in place (its
version counter: load_state_dict, copy_ or mul_ under no_grad, most optimizers) or held by a
torch optimizer's step (moegemm.optimizer_steps: fused optimizers write in place without
advancing the version counter). Changes made through `.data` outside an optimizer's step are not
seen: call refresh(model).

Freeing the source (free_sources): a module whose weights are copied (a named format) may keep
only the converted copy: its gate_up_proj and down_proj (and FP8 experts' scale_inv) become empty
tensors that require no grad, and anything that would need them raises (check_sources).

A compiled call is given the module's source tensors, not the module: owner() finds the module
by them (every module converted here is remembered, weakly).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .. import graphed, optimizer_steps
from ..moe import weights
from ..quantize import dequantize_operand
from ..quantized_tensor import QuantizedTensor
from ..validation import readable_weights
from .spec import ExpertsSpec, unsupported

__all__ = ["ConvertedExperts", "check_sources", "converted", "forget", "format_of", "free_sources", "freed", "owner",
           "source_tensors"]


@dataclass
class ConvertedExperts:
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


_SOURCE_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "gate_up_proj_scale_inv",
                 "down_proj_scale_inv")


def _attribute(module, name: str):
    """getattr(module, name, None) without nn.Module.__getattr__'s AttributeError for a name the
    module lacks (most of _SOURCE_NAMES; raised and caught, it cost half of every call's check)."""
    for table in (module._parameters, module._buffers, module.__dict__):
        found = table.get(name)
        if found is not None:
            return found
    return getattr(module, name, None) if hasattr(type(module), name) else None


def source_tensors(module) -> tuple:
    return tuple(t for t in (_attribute(module, n) for n in _SOURCE_NAMES) if isinstance(t, torch.Tensor))


def _float_weights(module, spec: ExpertsSpec) -> tuple[torch.Tensor, torch.Tensor]:
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
def _convert(module, spec: ExpertsSpec, fmt: str, sources: tuple, free_source: bool) -> ConvertedExperts:
    check_sources(module, fmt)
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
        return ConvertedExperts(fmt, sources, w_gate_up, w_down, spec.gate_up_layout, _bias(gate_up_bias),
                                _bias(down_bias))
    gate_up, down = _float_weights(module, spec)
    num_experts, two_i, hidden = gate_up.shape
    weights.check_sizes(fmt, hidden, two_i // 2)
    made = weights.from_float(gate_up=gate_up, gate_up_order=spec.gate_up_layout, down=down, gate_up_bias=gate_up_bias,
                              down_bias=down_bias, sizes=(num_experts, two_i // 2, hidden),
                              form=weights.WeightForm(fmt))
    experts = ConvertedExperts(fmt, sources, made.w_gate_up, made.w_down, weights.gate_up_layout(fmt),
                               made.gate_up_bias, made.down_bias)
    if free_source:
        free_sources(module, experts)
    return experts


# module.__dict__ key of a module whose source weights were freed: the format of the converted
# weights, which are then all that is left of them.
_FREED = "_moegemm_freed"


def free_sources(module, experts: ConvertedExperts) -> None:
    """Release the storage of the module's expert weights (gate_up_proj, down_proj and FP8 experts'
    scale_inv), of which `experts` holds a converted copy: they become empty tensors (numel 0, same
    dtype and device) that require no grad, whoever else holds them (an optimizer), and the module
    is marked, so that nothing converts them again (check_sources). Weights read in place (bf16,
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


def check_sources(module, fmt: str | None = None) -> None:
    """ValueError where the module's source weights were freed and something needs them: a
    conversion into another format than the one kept (fmt), or gradients (fmt None)."""
    freed = module.__dict__.get(_FREED)
    if freed is not None and freed != fmt:
        need = "gradients" if fmt is None else f"a conversion to {fmt}"
        raise ValueError(f"{type(module).__name__}: its source weights were freed (free_source=True) once converted "
                         f"to {freed}, and {need} would need them; reload the model to run it otherwise")


def format_of(module, spec: ExpertsSpec, named: str | None) -> str:
    """The format the module's experts run in: `named` (register's fmt) where given, else the
    weights' own (fp8_block for FP8 experts, bf16 otherwise)."""
    if named is not None:
        return named
    scheme = getattr(module, "activation_scheme", "dynamic")
    if spec.fp8_block and scheme != "dynamic":
        # The module's own math quantizes activations with calibrated scales; ours computes them
        # for every 1x128 block: run that only when asked for by name.
        raise unsupported(module, f"quantizes activations with dynamic 1x128 scales, and this module's "
                                   f"activation_scheme is {scheme!r} (moegemm.hf.register(fmt='fp8_block') runs "
                                   f"its weights with dynamic activation scales)")
    return "fp8_block" if spec.fp8_block else "bf16"


def converted(module, spec: ExpertsSpec, named: str | None, free_source: bool) -> ConvertedExperts:
    """The module's converted weights in format_of(module, spec, named), made again where a source
    changed (module docstring); free_source: free the sources of a copy once made. Eager only:
    compiled code reaches it through the moegemm::hf_experts op."""
    fmt = format_of(module, spec, named)
    cached = module.__dict__.get("_moegemm_experts")
    if module.__dict__.get(_FREED) is not None and cached is not None:  # (the converted weights are all there is)
        check_sources(module, fmt)
        return cached
    sources = source_tensors(module)
    if cached is None or not cached.current(fmt, sources):
        module.__dict__["_moegemm_experts"] = None  # (the old copy freed before the new one is made)
        cached = _convert(module, spec, fmt, tuple(_stamp(t) for t in sources), free_source)
        module.__dict__["_moegemm_experts"] = cached
        _remember_owner(module)
    return cached


def freed(module) -> str | None:
    """The format of the converted weights that are all that is left of a module whose sources
    were freed; None where they were not."""
    return module.__dict__.get(_FREED)


def forget(module) -> None:
    """Make the module's converted weights again at its next call."""
    module.__dict__.pop("_moegemm_experts", None)


# The experts module of each gate_up_proj moegemm has converted, by the tensor's id (weakly):
# how the compiled call, which is given the module's tensors, finds the module.
_owners: dict[int, weakref.ref] = {}


def _remember_owner(module) -> None:
    weight = module.gate_up_proj
    if id(weight) not in _owners:
        weakref.finalize(weight, _owners.pop, id(weight), None)  # (gone with the tensor, before its id is reused)
    _owners[id(weight)] = weakref.ref(module)


def owner(sources: list[torch.Tensor]):
    """The experts module whose source tensors are `sources` (_remember_owner)."""
    ref = _owners.get(id(sources[0])) if sources else None
    module = ref() if ref is not None else None
    held = source_tensors(module) if module is not None else ()
    if len(sources) != len(held) or any(a is not b for a, b in zip(sources, held)):
        raise RuntimeError("moegemm.hf: a compiled experts call was given weights moegemm has not seen (compiled "
                           "before moegemm.hf.prepare(model), or parameters replaced since): call "
                           "moegemm.hf.prepare(model)")
    return module
