"""The experts backend's converted weights (moegemm.hf) follow the parameters they were made
from, however those change: optimizer steps (fused ones too, which leave version counters as
they were: moegemm/optimizer_steps.py), in-place ops under no_grad, and both seen by a
torch.compile'd call; changes through `.data` need moegemm.hf.refresh(model), as documented.

Each case runs on weights the backend reads from a copy it makes (the cache under test): gpt-oss
with fp32 master weights (a bf16 copy), Qwen3-MoE under register(fmt="mxfp8") (quantized), and
gpt-oss in bf16 (its [in, out] weights). CPU here (the reference backend); GPU cases marked gpu."""

import gc

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import moegemm
from moegemm import optimizer_steps

transformers = pytest.importorskip("transformers")
from test_hf_backend import _eager_experts, _model, _rel, registered  # noqa: E402, F401 (registered: the autouse fixture)

# kind, weights' dtype, register(fmt=...)
PATHS = {"fp32_copy": ("gpt_oss", torch.float32, None), "mxfp8": ("qwen3_moe", torch.float32, "mxfp8"),
         "bf16_transposed": ("gpt_oss", torch.bfloat16, None)}
GPU_SIZES = dict(hidden=256, width=128)


class DataSGD(torch.optim.Optimizer):
    """SGD written through `.data`, as some optimizers are: no version counter moves."""

    def __init__(self, params, lr: float):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


# Each moves weights drawn N(0, 0.1) by about 10% on random N(0, 1) gradients.
OPTIMIZERS = {
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True),
    "adagrad_fused": lambda params: torch.optim.Adagrad(params, lr=1e-2, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "data_sgd": lambda params: DataSGD(params, lr=1e-2),
}
# torch 2.13's fused SGD on CPU leaves most elements of bf16 parameters unchanged (its
# vectorized body): nothing for the backend to see.
_CPU_CASES = [(path, opt, "cpu") for path in PATHS for opt in OPTIMIZERS
              if (path, opt) != ("bf16_transposed", "sgd_fused")]
_GPU_CASES = [pytest.param(path, "adamw_fused", "cuda", marks=pytest.mark.gpu) for path in PATHS]


def _experts_model(path: str, device: str = "cpu"):
    """(model, its first experts module) on `path`'s weights, running through moegemm."""
    kind, dtype, fmt = PATHS[path]
    moegemm.hf.register(fmt=fmt)
    model = _model(kind, device, dtype, **({} if device == "cpu" else GPU_SIZES))
    model.set_experts_implementation("moegemm")
    return model, moegemm.hf.experts_modules(model)[0]


def _inputs(module, device: str = "cpu", tokens: int = 13):
    """Random (hidden_states, top_k_index, top_k_weights) of an experts call of `module`."""
    x = torch.randn(tokens, module.config.hidden_size, device=device, dtype=module.down_proj.dtype)
    index = torch.stack([torch.randperm(8, device=device)[:2] for _ in range(tokens)])
    return x, index, torch.rand(tokens, 2, device=device)


def _run(fn, inputs, times: int = 1) -> torch.Tensor:
    """fn(*inputs) under no_grad, `times` times (on a GPU, a call of few tokens replays a CUDA
    graph from its second call); the last output."""
    with torch.no_grad():
        for _ in range(times):
            out = fn(*inputs).clone()
    return out


def _step(model, optimizer: str) -> None:
    """One step of `optimizer` on random gradients for every parameter of `model`."""
    opt = OPTIMIZERS[optimizer](model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


@pytest.mark.parametrize(("path", "optimizer", "device"), _CPU_CASES + _GPU_CASES)
def test_an_optimizer_step_is_seen(path, optimizer, device):
    """After one step of each optimizer (fused ones and one writing through `.data` leave the
    version counters as they were) the next call computes on the new weights: what a fresh
    conversion of them computes, and for float formats the eager experts' result."""
    model, module = _experts_model(path, device)
    inputs = _inputs(module, device)
    times = 3 if device == "cuda" else 1
    before = _run(module, inputs, times)
    _step(model, optimizer)
    got = _run(module, inputs, times)
    moegemm.hf.refresh(model)
    want = _run(module, inputs)
    assert _rel(want, before) > 0.05, "the step changed too little for the check to tell"
    assert _rel(got, want) < 1e-3, (path, optimizer, _rel(got, want), _rel(got, before))
    if PATHS[path][2] is None:
        with torch.no_grad():
            assert _rel(got, _eager_experts(module, *inputs)) < 2e-2


def test_a_step_makes_again_only_the_weights_it_held():
    """An optimizer holding one model's parameters leaves another model's converted weights
    as they were (kept, not made again)."""
    (trained, trained_module), (_, other_module) = _experts_model("mxfp8"), _experts_model("mxfp8")
    inputs = _inputs(trained_module)
    _run(trained_module, inputs)
    _run(other_module, inputs)
    kept = other_module._moegemm_experts
    stale = trained_module._moegemm_experts
    _step(trained, "adamw_fused")
    _run(trained_module, inputs)
    _run(other_module, inputs)
    assert trained_module._moegemm_experts is not stale
    assert other_module._moegemm_experts is kept


def test_fused_steps_advance_generations_not_version_counters():
    """Why the backend watches optimizer steps: a fused step writes a parameter in place and
    leaves its version counter; the step hook gives every watched tensor it held (only those) a
    new generation; an entry goes with its tensor."""
    held, other = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(64))
    stamps = optimizer_steps.watch(held), optimizer_steps.watch(other)
    held.grad = torch.randn(64)
    version, values = held._version, held.detach().clone()
    torch.optim.AdamW([held], lr=1e-2, fused=True).step()
    assert held._version == version and not torch.equal(held.detach(), values)
    assert optimizer_steps.generation(held) != stamps[0]
    assert optimizer_steps.generation(other) == stamps[1]
    key = id(held)
    del held
    gc.collect()
    assert key not in optimizer_steps._generations


def test_changes_through_data_need_refresh():
    """Documented: a change through `.data` moves neither the parameter's version counter nor
    its address, and no optimizer step ran: the converted weights keep computing the old result
    until moegemm.hf.refresh(model) makes them again from the new values."""
    model, module = _experts_model("mxfp8")
    with torch.no_grad():  # weights holding MXFP8 values: the quantized experts lose only the tokens' rounding
        for m in moegemm.hf.experts_modules(model):
            for w in (m.gate_up_proj, m.down_proj):
                w.copy_(moegemm.dequantize(moegemm.quantize_weights(w, "mxfp8")))
    inputs = _inputs(module)
    before = _run(module, inputs)
    version = module.gate_up_proj._version
    module.gate_up_proj.data.mul_(-2)  # (a power of two: the weights still hold MXFP8 values)
    assert module.gate_up_proj._version == version
    assert torch.equal(_run(module, inputs), before)  # the old weights' result
    moegemm.hf.refresh(model)
    after = _run(module, inputs)
    with torch.no_grad():
        want = _eager_experts(module, *inputs)
    assert _rel(before, want) > 0.5 and _rel(after, want) < 0.1  # mxfp8's layer error on its own weights


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("path", ["fp32_copy", "mxfp8"])
def test_a_compiled_model_sees_changed_weights(path):
    """prepare(), then torch.compile of the whole model (one graph: fullgraph): an in-place
    update under no_grad and a fused optimizer step are seen by the next compiled call, which
    computes what the eager model computes on freshly converted weights; neither recompiles."""
    model, _ = _experts_model(path)
    model.eval()
    moegemm.hf.prepare(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    ids = torch.randint(0, 128, (2, 9))
    before = _logits(compiled, ids)
    for change in (lambda: [m.down_proj.mul_(-4) for m in moegemm.hf.experts_modules(model)],
                   lambda: _step(model, "adamw_fused")):
        with torch.no_grad():
            change()
        got = _logits(compiled, ids)
        moegemm.hf.refresh(model)
        want = _logits(model, ids)
        assert _rel(want, before) > 1e-2, "the change changed too little for the check to tell"
        assert _rel(got, want) < 1e-5, (path, _rel(got, want), _rel(got, before))
        before = want
    assert counter.frame_count == 1


def test_the_default_compiler_sees_changed_weights():
    """The experts module compiled by torch.compile's default backend (inductor): an in-place
    update is seen by the next compiled call."""
    model, module = _experts_model("fp32_copy")
    moegemm.hf.prepare(model)
    compiled = torch.compile(module, fullgraph=True)
    inputs = _inputs(module)
    before = _run(compiled, inputs)
    with torch.no_grad():
        module.down_proj.mul_(-1.5)
    got = _run(compiled, inputs)
    moegemm.hf.refresh(model)
    want = _run(module, inputs)
    assert _rel(want, before) > 0.5 and torch.equal(got, want)


def test_a_module_compiled_before_prepare_raises():
    """A compiled call finds its module by the weights prepare() (or an eager call) saw: one
    compiled before either raises, naming prepare, and runs once prepared."""
    model, module = _experts_model("mxfp8")
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    inputs = _inputs(module)
    with pytest.raises(RuntimeError, match=r"moegemm\.hf\.prepare\(model\)"):
        _run(compiled, inputs)
    moegemm.hf.prepare(model)
    assert torch.equal(_run(compiled, inputs), _run(module, inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["fp32_copy", "mxfp8", "bf16_transposed"])
def test_a_compiled_call_under_cuda_graphs_sees_changed_weights(path):
    """torch.compile(mode="reduce-overhead") (inductor's CUDA graphs) around an experts call:
    the experts op runs outside the graphs (its check would not run in a replay), so an in-place
    update and a fused optimizer step are seen by the next replays."""
    assert torch.Tag.cudagraph_unsafe in torch.ops.moegemm.hf_experts.default.tags
    model, module = _experts_model(path, "cuda")
    moegemm.hf.prepare(model)

    def layer(x, index, weights):  # (inductor's own kernels around the op: graphs on both sides)
        return module(x * 2, index, weights) + 1

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    inputs = _inputs(module, "cuda")

    def replay():
        torch.compiler.cudagraph_mark_step_begin()
        return _run(compiled, inputs)

    for _ in range(3):  # warm-up, capture, replay
        before = replay()
    for change in (lambda: module.gate_up_proj.mul_(-1.5), lambda: _step(model, "adamw_fused")):
        with torch.no_grad():
            change()
        got = [replay() for _ in range(2)]
        moegemm.hf.refresh(model)
        want = _run(layer, inputs)
        assert _rel(want, before) > 0.05, "the change changed too little for the check to tell"
        assert all(_rel(g, want) < 1e-3 for g in got), (path, [_rel(g, want) for g in got])
        before = want
