"""The transformers experts backend on the experts of every model family of the installed
transformers, and how it recognises a module's gate: by what its _apply_gate computes (SwiGLU, or
gpt-oss's clamped SwiGLU with the alpha and limit read off its outputs), whatever the attributes
holding the constants are named, or with no attribute at all. Anything else raises a ValueError
naming the module: never a silent wrong answer. CPU (the reference backend, bf16 experts)."""

import functools
import importlib
import inspect
import pathlib

import pytest
import torch

import moegemm

transformers = pytest.importorskip("transformers")
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

from test_hf_backend import _rel, registered  # noqa: E402, F401 (registered: the autouse fixture)

# Families whose experts moegemm does not run (transformers 5.25): another activation (GELU, ReLU^2),
# no gate, SwiGLU with its inputs clamped (DeepSeek-V4, GLM-5-Next, HY-V4) or soft-capped (Inkling2),
# a post-expert norm (MuseSpark). Every other family's experts must run and match transformers' eager
# experts.
REFUSED = {"deepseek_v4", "diffusion_gemma", "ergo", "gemma4", "glm5_next", "hy_v4", "hy_v4_vl", "inkling2",
           "inkling2_loop", "muse_spark", "nemotron_h"}
HIDDEN, WIDTH, EXPERTS = 64, 32, 8


def _families() -> list[str]:
    """The model families of the installed transformers whose experts dispatch through its experts
    interface (their modeling file uses use_experts_implementation)."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    return sorted(d.name for d in root.iterdir() if (d / f"modeling_{d.name}.py").exists()
                  and "use_experts_implementation" in (d / f"modeling_{d.name}.py").read_text(encoding="utf-8"))


def _experts_classes(family: str) -> list[type]:
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return [c for c in vars(modeling).values() if inspect.isclass(c) and c.__module__ == modeling.__name__
            and issubclass(c, torch.nn.Module) and hasattr(c, "_apply_gate") and hasattr(c.forward, "__wrapped__")]


def _tiny(cls: type, family: str):
    """`cls` built from its family's config with HIDDEN, WIDTH and EXPERTS, in bf16, every weight
    N(0, 0.1); else the reason it cannot be built that way (a string)."""
    configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    prefix = cls.__name__.removesuffix("Experts")
    # The experts' own config (e.g. Qwen3VLMoeTextConfig for Qwen3VLMoeTextExperts), else the family's.
    family_configs = sorted((n for n in vars(configs) if n.endswith("Config") and n not in ("PretrainedConfig",
                                                                                           "PreTrainedConfig")),
                            key=lambda n: ("TextConfig" not in n, len(n)))
    names = [f"{prefix}TextConfig", f"{prefix}Config", *family_configs]
    config = next(getattr(configs, n) for n in names if hasattr(configs, n))()
    sizes = {"hidden_size": HIDDEN, "intermediate_size": WIDTH, "moe_intermediate_size": WIDTH, "num_experts": EXPERTS,
             "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS}
    for name, value in sizes.items():
        try:
            setattr(config, name, value)
        except Exception:  # noqa: BLE001 (a config that holds this size in another form: the build says)
            pass
    config._experts_implementation = "moegemm"
    extra = {"layer_idx": 0} if "layer_idx" in inspect.signature(cls.__init__).parameters else {}
    try:
        module = cls(config, **extra).to(torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 (another family's config needs sizes of its own)
        return f"{cls.__name__}: {type(exc).__name__}: {exc}"
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.1)
    return module


@functools.cache
def _built(family: str) -> list:
    """_tiny of each experts class of `family` (kept: both tests below read them)."""
    return [_tiny(cls, family) for cls in _experts_classes(family)]


def _route(tokens: int = 11, top_k: int = 2):
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(EXPERTS)[:top_k] for _ in range(tokens)])
    return x, index, torch.rand(tokens, top_k, dtype=torch.bfloat16)


@pytest.mark.parametrize("family", _families())
def test_every_family_runs_or_raises(family):
    """Each family's experts, tiny: moegemm's output is the eager experts' (2e-2), or, for the
    families in REFUSED, a ValueError naming the module."""
    built = _built(family)
    modules = [m for m in built if not isinstance(m, str)]
    if not modules:
        pytest.skip(f"{family}: no experts class builds from its config with the generic sizes ({built})")
    for module in modules:
        module.config._experts_implementation = "moegemm"
        x, index, weights = _route()
        if family in REFUSED:
            with torch.no_grad(), pytest.raises(ValueError, match=type(module).__name__):
                module(x, index, weights)
            continue
        with torch.no_grad():
            got = module(x, index, weights)
            module.config._experts_implementation = "eager"
            want = module(x, index, weights)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel(got, want) < 2e-2, (family, type(module).__name__, _rel(got, want))


def test_the_families_run_include_the_tested_models():
    """The sweep above runs (does not skip) the families whose whole models tests/test_hf_backend.py
    runs, and more: a sweep that built nothing cannot pass silently."""
    ran = {f for f in _families() if f not in REFUSED and any(not isinstance(m, str) for m in _built(f))}
    assert {"qwen3_moe", "gpt_oss", "mixtral", "qwen2_moe", "deepseek_v3"} <= ran
    assert len(ran) >= 10, sorted(ran)


def _gated_experts(apply_gate, **attributes):
    """An experts class of the interface's shape, [out, in] weights, whose _apply_gate is
    `apply_gate` (the gate/up order is its own); `attributes` set on the module."""

    @use_experts_implementation
    class CustomExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = EXPERTS
            self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, dtype=torch.bfloat16) / 8)
            self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH, dtype=torch.bfloat16) / 6)
            for name, value in attributes.items():
                setattr(self, name, value)

        _apply_gate = apply_gate

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the interface dispatches to the backend")

    return CustomExperts(transformers.PretrainedConfig(experts_implementation="moegemm"))


def _split(gate_up, layout):
    return gate_up.chunk(2, dim=-1) if layout == "concat" else (gate_up[..., 0::2], gate_up[..., 1::2])


def _own_experts(module, x, index, weights, layout):
    """The routed experts computed with the module's own _apply_gate, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = index[t, j]
            h = module._apply_gate((module.gate_up_proj[e].double() @ x[t].double())[None])[0]
            out[t] += weights[t, j].double() * (module.down_proj[e].double() @ h)
    return out


def _clamped(alpha_of, limit_of, layout):
    """gpt-oss's clamped SwiGLU, its constants read through alpha_of(self) and limit_of(self)."""

    def apply_gate(self, gate_up):
        gate, up = _split(gate_up, layout)
        gate, up = gate.clamp(max=limit_of(self)), up.clamp(min=-limit_of(self), max=limit_of(self))
        return (up + 1) * gate * torch.sigmoid(gate * alpha_of(self))

    return apply_gate


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("stored", ["unusual names", "not stored"])
def test_a_clamped_swiglu_is_read_from_what_it_computes(layout, stored):
    """Constants under names no table knows, or literals in the code: alpha and limit come out
    exactly, and the outputs are the module's own experts'."""
    alpha, limit = (1.25, 3.5) if stored == "unusual names" else (2.375, 0.875)
    if stored == "unusual names":
        module = _gated_experts(_clamped(lambda m: m.sharpness, lambda m: m.ceiling, layout), sharpness=alpha,
                                ceiling=limit)
    else:
        module = _gated_experts(_clamped(lambda m: 2.375, lambda m: 0.875, layout))
    spec = moegemm.hf.spec.spec_of(module)
    assert (spec.activation, spec.gate_up_layout, spec.alpha, spec.limit) == ("swiglu_oai", layout, alpha, limit)
    x, index, weights = _route()
    x = x * 8  # (gate values beyond the limit, both signs)
    with torch.no_grad():
        got = module(x, index, weights)
    assert _rel(got, _own_experts(module, x, index, weights, layout)) < 2e-2


def test_a_gate_unlike_both_raises_even_where_it_differs_only_at_large_values():
    """SwiGLU with its inputs clamped at 1000 (as DeepSeek-V4's at a smaller limit) equals SwiGLU
    on every value below 1000: the probe's large values tell them apart, and it raises."""

    def apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=1000.0)) * up.clamp(min=-1000.0, max=1000.0)

    module = _gated_experts(apply_gate)
    with torch.no_grad(), pytest.raises(ValueError, match="CustomExperts.*computes neither"):
        module(*_route())


def test_a_large_limit_is_read_exactly():
    module = _gated_experts(_clamped(lambda m: 1.702, lambda m: 12345.5, "interleaved"))
    spec = moegemm.hf.spec.spec_of(module)
    assert (spec.activation, spec.alpha, spec.limit) == ("swiglu_oai", 1.702, 12345.5)
