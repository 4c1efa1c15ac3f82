"""How a transformers experts module computes, read off the module itself.

Supported: gated experts (gate_up_proj + down_proj, optional biases) in any of transformers'
layouts ([out, in] or transposed [in, out]; gate and up rows concatenated or interleaved) whose
`_apply_gate` is SwiGLU (silu(gate) * up) or gpt-oss's clamped SwiGLU, recognised by computing
it once on a probe (alpha and limit read off its outputs, wherever and whether the module stores
them); transformers' fine-grained FP8 experts (FP8Experts, 128x128 block scales).
Anything else (no gate, a post-expert norm, another activation) raises a ValueError naming the
module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..gate_up import swiglu

__all__ = ["ExpertsSpec", "forget_spec", "spec_of", "unsupported"]


@dataclass(frozen=True)
class ExpertsSpec:
    """How an experts module computes: its activation, gate/up order and weight layout."""

    activation: str  # "swiglu" or "swiglu_oai"
    gate_up_layout: str  # of gate_up_proj's output columns: "concat" or "interleaved"
    transposed: bool  # weights [E, in, out] (gpt-oss) rather than [E, out, in]
    alpha: float
    limit: float
    fp8_block: bool  # FP8Experts: e4m3 weights with 128x128 scale_inv


def unsupported(module, why: str) -> ValueError:
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
    raise unsupported(module, "runs SwiGLU and gpt-oss's clamped SwiGLU only, and this module's _apply_gate "
                               "computes neither")


def _read_spec(module) -> ExpertsSpec:
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        raise unsupported(module, "needs gated experts (gate_up_proj)")
    if getattr(module, "has_post_expert_norm", False):
        raise unsupported(module, "has no post-expert norm")
    fp8_block = hasattr(module, "gate_up_proj_scale_inv")
    if fp8_block and (tuple(getattr(module, "block_size", None) or ()) != (128, 128)
                      or module.gate_up_proj.dtype != torch.float8_e4m3fn):
        raise unsupported(module, f"reads FP8 experts with 128x128 e4m3 blocks only (block_size "
                                   f"{getattr(module, 'block_size', None)}, {module.gate_up_proj.dtype})")
    activation, layout, alpha, limit = _gate_kind(module)
    return ExpertsSpec(activation, layout, bool(getattr(module, "is_transposed", False)), alpha, limit, fp8_block)


def spec_of(module) -> ExpertsSpec:
    """How `module` computes, read once (kept with the module until forget_spec)."""
    spec = module.__dict__.get("_moegemm_spec")
    if spec is None:
        spec = module.__dict__["_moegemm_spec"] = _read_spec(module)
    return spec


def forget_spec(module) -> None:
    """Read the module's spec again at its next call."""
    module.__dict__.pop("_moegemm_spec", None)
