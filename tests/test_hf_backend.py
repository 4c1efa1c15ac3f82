"""moegemm as a transformers experts backend (moegemm.hf.register): tiny random models of five
families run with experts_implementation="moegemm" against transformers' own "eager" experts,
outputs and gradients; the formats, the weight cache and the errors. CPU here (the reference
backend; bf16 experts: 2e-2 relative on the experts' outputs, 3e-2 on the gradients); the GPU
tests at real sizes are marked gpu."""

import inspect

import pytest
import torch

import moegemm

transformers = pytest.importorskip("transformers")
from transformers.integrations.moe import ExpertsInterface, use_experts_implementation  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
KINDS = ("qwen3_moe", "gpt_oss", "mixtral", "qwen2_moe", "deepseek_v3")
SMALL = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4)


def _config(kind: str, hidden: int = 64, width: int = 32, experts: int = 8, top_k: int = 2):
    """A random-init config of `kind` with two decoder layers, every MLP an MoE."""
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(hidden_size=hidden, intermediate_size=3 * width, moe_intermediate_size=width,
                                           num_experts=experts, num_experts_per_tok=top_k, num_key_value_heads=2,
                                           head_dim=16, **SMALL)
    if kind == "gpt_oss":
        return transformers.GptOssConfig(hidden_size=hidden, intermediate_size=width, num_local_experts=experts,
                                         num_experts_per_tok=top_k, num_key_value_heads=2, head_dim=16,
                                         layer_types=["full_attention"] * 2, **SMALL)
    if kind == "mixtral":
        return transformers.MixtralConfig(hidden_size=hidden, intermediate_size=width, num_local_experts=experts,
                                          num_experts_per_tok=top_k, num_key_value_heads=2, head_dim=16, **SMALL)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(hidden_size=hidden, intermediate_size=3 * width, moe_intermediate_size=width,
                                           shared_expert_intermediate_size=width, num_experts=experts,
                                           num_experts_per_tok=top_k, num_key_value_heads=2, **SMALL)
    return transformers.DeepseekV3Config(hidden_size=hidden, intermediate_size=3 * width, moe_intermediate_size=width,
                                         n_routed_experts=experts, num_experts_per_tok=top_k, n_group=2, topk_group=1,
                                         first_k_dense_replace=0, num_key_value_heads=4, q_lora_rank=None,
                                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                         **SMALL)


def _model(kind: str, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, **sizes):
    """A tiny random model of `kind` in `dtype`; every parameter drawn N(0, 0.1) (routers
    included, so that the choices spread over the experts)."""
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **sizes), dtype=dtype).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.fixture(autouse=True)
def registered():
    moegemm.hf.register()
    yield
    moegemm.hf.register()  # back to the defaults for the next test


def _experts_calls(model, ids, implementation):
    """(inputs, output) of every experts module in one forward of `model` under `implementation`."""
    calls = []
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args, out)))
             for m in moegemm.hf.experts_modules(model)]
    model.set_experts_implementation(implementation)
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, calls


def _eager_experts(module, *inputs):
    module.config._experts_implementation = "eager"
    try:
        return module(*inputs)
    finally:
        module.config._experts_implementation = "moegemm"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_match_the_eager_experts(kind, device):
    """A model run with experts_implementation="moegemm": each experts call computes what the
    eager experts compute on the same inputs. (The logits of the two runs are not compared: a
    rounding difference can flip a later router's choice, which changes them by more than any
    tolerance.)"""
    model = _model(kind, device, **({} if device == "cpu" else dict(hidden=256, width=128)))
    ids = torch.randint(0, 128, (2, 9), device=device)
    logits, calls = _experts_calls(model, ids, "moegemm")
    assert len(calls) == 2 and torch.isfinite(logits).all()
    for module, inputs, got in calls:
        with torch.no_grad():
            want = _eager_experts(module, *inputs)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel(got, want) < 2e-2, (kind, _rel(got, want))


# How a call under grad computes (moegemm.training): bf16 weights; fp32 master weights under
# torch.autocast to bf16 (mixed precision: moegemm's kernels on bf16 casts, fp32 gradients); fp32
# weights without autocast (fp32 products, torch._grouped_mm). Each: its weights' dtype, whether
# autocast is on, the dtype of the kernels' operands (None: not run), the tolerance.
PRECISIONS = {"bf16": (torch.bfloat16, False, torch.bfloat16, 3e-2),
              "autocast": (torch.float32, True, torch.bfloat16, 3e-2),
              "fp32": (torch.float32, False, None, 1e-4)}


def _kernel_calls(monkeypatch) -> list:
    """The dtypes of the A operands moegemm.training passes to moegemm's grouped product."""
    calls = []
    real = moegemm.training.grouped_matmul

    def spy(a, *args, **kwargs):
        calls.append(a.dtype)
        return real(a, *args, **kwargs)

    monkeypatch.setattr(moegemm.training, "grouped_matmul", spy)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_the_eager_experts(kind, precision, device, monkeypatch):
    """Each family's experts module alone, under grad, in each precision: the gradients to the
    hidden states, the router weights, the expert weights and biases against the eager experts'
    in the same precision (under the same autocast); each gradient in its tensor's dtype."""
    dtype, autocast, kernel_dtype, tolerance = PRECISIONS[precision]
    model = _model(kind, device, dtype, **({} if device == "cpu" else dict(hidden=256, width=128)))
    module = moegemm.hf.experts_modules(model)[0]
    module.config._experts_implementation = "moegemm"
    tokens, hidden = 37, model.config.hidden_size
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(8, device=device)[:2] for _ in range(tokens)])
    top_k_weights = torch.rand(tokens, 2, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(tokens, hidden, device=device, dtype=dtype)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    assert len(params) == (4 if kind == "gpt_oss" else 2)
    kernel_calls = _kernel_calls(monkeypatch)
    grads = []
    for run in (lambda: _eager_experts(module, x, top_k_index, top_k_weights),
                lambda: module(x, top_k_index, top_k_weights)):
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            out = run()
        grads.append(torch.autograd.grad(out, [x, top_k_weights, *params], dout))
    assert kernel_calls == ([] if kernel_dtype is None else [kernel_dtype] * 2)  # (gate/up, then down)
    for name, want, got in zip(["x", "top_k_weights", *names], *grads):
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
        assert _rel(got, want) < tolerance, (kind, name, _rel(got, want))


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_hidden_states_of_any_strides(kind):
    """The backend takes hidden states of any strides, as transformers' own experts do: a
    transposed view gives the contiguous tensor's outputs and gradients, with and without grad
    (it raised "x: expected unit stride along columns")."""
    model = _model(kind)
    module = moegemm.hf.experts_modules(model)[0]
    module.config._experts_implementation = "moegemm"
    tokens, hidden = 7, model.config.hidden_size
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    top_k_index = torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
    top_k_weights = torch.rand(tokens, 2, dtype=torch.bfloat16)
    transposed = x.t().contiguous().t()
    with torch.no_grad():
        assert torch.equal(module(transposed, top_k_index, top_k_weights), module(x, top_k_index, top_k_weights))
    dout = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    grads = []
    for given in (x, transposed):
        given = given.detach().requires_grad_()
        grads.append(torch.autograd.grad(module(given, top_k_index, top_k_weights), [given, module.down_proj], dout))
    for want, got in zip(*grads):
        assert torch.equal(got, want)


# Real models' experts (hidden, intermediate, experts, top-k): Qwen3-30B-A3B, gpt-oss-20b.
REAL_SIZES = {"qwen3_moe": dict(hidden=2048, width=768, experts=128, top_k=8),
              "gpt_oss": dict(hidden=2880, width=2880, experts=32, top_k=4)}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", REAL_SIZES)
def test_mixed_precision_gradients_at_real_sizes(kind, monkeypatch):
    """fp32 master weights under torch.autocast("cuda", torch.bfloat16) (the transformers
    Trainer's bf16=True), an experts module of a real model's sizes alone, 384 tokens: moegemm's
    kernels run on bf16, and every gradient (fp32) is within 3e-2 of the eager experts' under the
    same autocast."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    sizes = REAL_SIZES[kind]
    config = _config(kind, **sizes)
    config._experts_implementation = "moegemm"
    with torch.device("cuda"):
        module = (Qwen3MoeExperts if kind == "qwen3_moe" else GptOssExperts)(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)  # (hidden states of unit scale through both products)
    tokens, hidden, top_k = 384, sizes["hidden"], sizes["top_k"]
    x = torch.randn(tokens, hidden, device="cuda", requires_grad=True)
    top_k_index = torch.rand(tokens, sizes["experts"], device="cuda").topk(top_k, dim=1).indices
    top_k_weights = torch.rand(tokens, top_k, device="cuda").softmax(dim=1).requires_grad_()
    dout = torch.randn(tokens, hidden, device="cuda")
    names, params = zip(*module.named_parameters())
    kernel_calls = _kernel_calls(monkeypatch)
    grads = []
    for run in (lambda: _eager_experts(module, x, top_k_index, top_k_weights),
                lambda: module(x, top_k_index, top_k_weights)):
        with torch.autocast("cuda", torch.bfloat16):
            out = run()
        grads.append(torch.autograd.grad(out, [x, top_k_weights, *params], dout))
    assert kernel_calls == [torch.bfloat16] * 2
    for name, want, got in zip(["x", "top_k_weights", *names], *grads):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, name
        assert _rel(got, want) < 3e-2, (kind, name, _rel(got, want))


@pytest.mark.parametrize("precision", ["bf16", "autocast"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_training_step_runs_through_the_backend(kind, precision):
    """A whole model's loss.backward() with the moegemm experts, bf16 or fp32 master weights
    under autocast (the transformers Trainer's bf16=True): every expert weight (and bias) and
    router gets a finite, nonzero gradient in its dtype, and the loss is the eager experts' (the
    gradients themselves: test_gradients_match_the_eager_experts)."""
    dtype, autocast, _, _ = PRECISIONS[precision]
    model = _model(kind, dtype=dtype).train()
    ids = torch.randint(0, 128, (2, 9))
    model.set_experts_implementation("eager")
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        eager_loss = model(ids, labels=ids).loss
    model.set_experts_implementation("moegemm")
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - eager_loss.item()) < 2e-2 * abs(eager_loss.item())
    trained = [(n, p) for n, p in model.named_parameters() if ".experts." in n or ".gate." in n or ".router." in n]
    assert trained and all(p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all()
                           and p.grad.abs().sum() > 0 for _, p in trained), [n for n, p in trained if p.grad is None]


def test_register_is_idempotent_and_fills_both_interfaces():
    assert moegemm.hf.register() == "moegemm" == moegemm.hf.register()
    assert ExpertsInterface._global_mapping["moegemm"] is moegemm.hf.experts_forward
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    assert FP8ExpertsInterface._global_mapping["moegemm"] is moegemm.hf.experts_forward
    with pytest.raises(ValueError, match="fmt"):
        moegemm.hf.register(fmt="fp7")
    with pytest.raises(ValueError, match="backend"):
        moegemm.hf.register(backend="cuda")


def test_a_named_format_quantizes_the_experts_once():
    model = _model("qwen3_moe")
    with torch.no_grad():  # weights holding MXFP8 values: the reference differs by the tokens' quantization
        for module in moegemm.hf.experts_modules(model):
            for w in (module.gate_up_proj, module.down_proj):
                w.copy_(moegemm.dequantize(moegemm.quantize_weights(w.float(), "mxfp8")))
    ids = torch.randint(0, 128, (2, 9))
    moegemm.hf.register(fmt="mxfp8")
    logits, calls = _experts_calls(model, ids, "moegemm")
    # Each call against the eager experts on its own inputs (a later layer's inputs differ between two runs).
    for module, inputs, got in calls:
        assert module._moegemm_experts.fmt == "mxfp8"
        with torch.no_grad():
            want = _eager_experts(module, *inputs)
        assert _rel(got, want) < 0.1  # mxfp8's layer error on its own weights (tests/test_moe_parity.py)
    first = [m._moegemm_experts for m in moegemm.hf.experts_modules(model)]
    _experts_calls(model, ids, "moegemm")
    assert [m._moegemm_experts for m in moegemm.hf.experts_modules(model)] == first  # kept, not made again


def test_a_named_format_converts_without_building_a_layer(monkeypatch):
    """A conversion into a named format runs moegemm.moe.weights' functions, the ones MoE's
    loaders run, and builds no moegemm.MoE: its weights and biases are, byte for byte, what
    MoE.load_experts makes of the same parameters."""
    model = _model("gpt_oss")
    module = moegemm.hf.experts_modules(model)[0]
    moegemm.hf.register(fmt="mxfp8")

    def refuse(*args, **kwargs):
        raise AssertionError("a conversion built a moegemm.MoE")

    with monkeypatch.context() as patched:
        patched.setattr(moegemm.MoE, "__init__", refuse)
        moegemm.hf.prepare(model)
    experts = module._moegemm_experts
    e, h, two_i = module.gate_up_proj.shape
    layer = moegemm.MoE(h, two_i // 2, e, 1, fmt="mxfp8", expert_bias=True).load_experts(
        gate_up=module.gate_up_proj.transpose(1, 2), gate_up_order="interleaved",
        down=module.down_proj.transpose(1, 2), gate_up_bias=module.gate_up_proj_bias,
        down_bias=module.down_proj_bias)
    assert experts.gate_up_layout == layer.gate_up_layout
    for got, want in zip((experts.w_gate_up, experts.w_down), layer.weights()):
        assert (got.fmt, got.scale_layout, got.prepacked) == (want.fmt, want.scale_layout, want.prepacked)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert torch.equal(experts.gate_up_bias, layer.gate_up_bias) and torch.equal(experts.down_bias, layer.down_bias)


def test_gpt_oss_mxfp4_weights_round_trip_exactly():
    """bf16 weights holding MXFP4 values (a dequantized gpt-oss checkpoint) quantize back to the
    same codes: fmt="bf16_mxfp4" then computes what the bf16 experts compute."""
    model = _model("gpt_oss")
    with torch.no_grad():
        for module in moegemm.hf.experts_modules(model):
            for w in (module.gate_up_proj, module.down_proj):  # [E, in, out]: MXFP4 blocks along `in`
                q = moegemm.quantize_weights(w.transpose(1, 2).float(), "mxfp4")
                w.copy_(moegemm.dequantize(q).transpose(1, 2))
    ids = torch.randint(0, 128, (2, 9))
    _, bf16_calls = _experts_calls(model, ids, "moegemm")
    moegemm.hf.register(fmt="bf16_mxfp4")
    _, mxfp4_calls = _experts_calls(model, ids, "moegemm")
    for (_, _, want), (_, _, got) in zip(bf16_calls, mxfp4_calls):
        assert _rel(got, want) < 1e-2


def test_weights_are_converted_again_after_an_optimizer_step():
    """gpt-oss's [in, out] weights run from a copy: an in-place update (an optimizer step) makes
    it again, so the next call reads the new weights."""
    model = _model("gpt_oss").train()
    ids = torch.randint(0, 128, (2, 9))
    _experts_calls(model, ids, "moegemm")  # (converts the weights)
    before = [m._moegemm_experts for m in moegemm.hf.experts_modules(model)]
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    _, calls = _experts_calls(model, ids, "moegemm")
    for (module, inputs, got), old in zip(calls, before):
        assert module._moegemm_experts is not old
        with torch.no_grad():
            assert _rel(got, _eager_experts(module, *inputs)) < 2e-2


def test_quantized_formats_refuse_gradients():
    model = _model("qwen3_moe").train()
    ids = torch.randint(0, 128, (1, 5))
    moegemm.hf.register(fmt="mxfp8")
    model.set_experts_implementation("moegemm")
    with pytest.raises(ValueError, match="Qwen3MoeExperts: gradients run on float experts.*these run mxfp8"):
        model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        model(ids)  # inference still runs


def _custom_experts(**flags):
    """An experts class of the interface's shape with a GELU gate (no SwiGLU)."""

    @use_experts_implementation(**flags)
    class GeluExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 32, 16, dtype=torch.bfloat16))
            self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 16, dtype=torch.bfloat16))
            self.act_fn = torch.nn.GELU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the interface dispatches to the backend")

    return GeluExperts(transformers.PretrainedConfig(experts_implementation="moegemm"))


def test_unsupported_experts_raise_naming_the_module():
    module = _custom_experts()
    x, index, weights = torch.randn(3, 16, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with torch.no_grad(), pytest.raises(ValueError, match="GeluExperts.*neither"):
        module(x, index, weights)
    ungated = _custom_experts(has_gate=False)
    with torch.no_grad(), pytest.raises(ValueError, match="GeluExperts.*gated experts"):
        ungated(x, index, weights)
    if "has_post_expert_norm" in inspect.signature(use_experts_implementation).parameters:  # (transformers >= 5.2x)
        normed = _custom_experts(has_post_expert_norm=True)
        with torch.no_grad(), pytest.raises(ValueError, match="GeluExperts.*post-expert norm"):
            normed(x, index, weights)


def _fp8_experts(config, device):
    """transformers' fine-grained FP8 experts with random e4m3 weights and 128x128 scales."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts

    cls = use_experts_implementation(FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    module = cls(config, block_size=(128, 128)).to(device)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(module, name)
            w.copy_(torch.randn(w.shape, device=device).clamp(-8, 8).to(torch.float8_e4m3fn))
            s = getattr(module, name + "_scale_inv")
            s.copy_(torch.rand(s.shape, device=device) * 0.01 + 0.005)
    return module


def _reference_experts(x, index, weights, gate_up, down):
    """The routed SwiGLU experts in fp64 on [out, in] weights, gate rows before up rows."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            gate, up = (gate_up[index[t, j]] @ x[t]).chunk(2)
            out[t] += weights[t, j].double() * (down[index[t, j]] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_fine_grained_fp8_experts_run_fp8_block_on_their_own_bytes(device):
    config = _config("qwen3_moe", hidden=256, width=128)
    config._experts_implementation = "moegemm"
    module = _fp8_experts(config, device)
    x = torch.randn(13, 256, device=device, dtype=torch.bfloat16)
    index = torch.randint(0, 8, (13, 2), device=device)
    weights = torch.rand(13, 2, device=device)
    with torch.no_grad():
        got = module(x, index, weights)
    experts = module._moegemm_experts
    assert experts.fmt == "fp8_block" and experts.w_gate_up.data.data_ptr() == module.gate_up_proj.data_ptr()
    dequant = [moegemm.dequantize_operand(getattr(module, n).detach(), getattr(module, n + "_scale_inv").detach(),
                                          "fp8_block", "b") for n in ("gate_up_proj", "down_proj")]
    want = _reference_experts(x.float(), index, weights, *dequant)
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 0.1  # fp8_block's layer error


def test_static_activation_scales_are_not_replaced_silently():
    # FP8Experts calibrated with static activation scales: the default (its own fp8_block math)
    # refuses, naming the module; fmt='fp8_block' by name runs it with dynamic scales.
    config = _config("qwen3_moe", hidden=256, width=128)
    config._experts_implementation = "moegemm"
    module = _fp8_experts(config, "cpu")
    module.activation_scheme = "static"
    x, index, weights = torch.randn(5, 256, dtype=torch.bfloat16), torch.randint(0, 8, (5, 2)), torch.rand(5, 2)
    with torch.no_grad(), pytest.raises(ValueError, match="FP8Experts.*activation_scheme is 'static'"):
        module(x, index, weights)
    moegemm.hf.register(fmt="fp8_block")
    try:
        with torch.no_grad():
            assert module(x, index, weights).shape == x.shape
    finally:
        moegemm.hf.register()


def test_import_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, moegemm; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_gate_is_read_from_each_module_not_its_class():
    """transformers' FP8Experts computes SwiGLU or gpt-oss's clamped SwiGLU by its config: two
    modules of the one class get their own activation (a class-wide cache gave the second the
    first's)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts

    cls = use_experts_implementation(FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    plain = _config("qwen3_moe", hidden=256, width=128)
    clamped = _config("qwen3_moe", hidden=256, width=128)
    clamped.swiglu_alpha, clamped.swiglu_limit = 1.702, 7.0
    specs = [moegemm.hf.spec.spec_of(cls(config, block_size=(128, 128))) for config in (plain, clamped, plain)]
    assert [s.activation for s in specs] == ["swiglu", "swiglu_oai", "swiglu"]
    assert (specs[1].alpha, specs[1].limit) == (1.702, 7.0)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_bf16_experts_are_read_in_place(kind):
    """bf16 experts in either layout (Qwen3's [E, out, in]; gpt-oss's [E, in, out], read N-major)
    run on the parameters' own storage: the backend holds no copy, and free_source has nothing to
    free."""
    model = _model(kind)
    moegemm.hf.register(free_source=True)
    assert moegemm.hf.prepare(model) == 2
    for module in moegemm.hf.experts_modules(model):
        experts = module._moegemm_experts
        for weights, param in ((experts.w_gate_up, module.gate_up_proj), (experts.w_down, module.down_proj)):
            assert _storage(weights.data) == _storage(param) and param.numel() > 0
            assert torch.equal(weights.data, param.transpose(1, 2) if kind == "gpt_oss" else param)
    ids = torch.randint(0, 128, (2, 9))
    _, calls = _experts_calls(model, ids, "moegemm")
    for module, inputs, got in calls:
        with torch.no_grad():
            assert _rel(got, _eager_experts(module, *inputs)) < 2e-2


@pytest.mark.parametrize("kind,fmt,how", [("qwen3_moe", "fp8_block", "prepare"), ("gpt_oss", "bf16_mxfp4", "prepare"),
                                          ("qwen3_moe", "bf16_nvfp4", "register")])
def test_free_source_keeps_the_converted_weights_alone(kind, fmt, how):
    """prepare(model, free_source=True), or register(fmt, free_source=True) at the first call: the
    source weights hold no storage and require no grad, the model computes what it computed
    before (the same converted weights), and what would need the sources raises, naming them:
    gradients, refresh, another format."""
    model = _model(kind)
    ids = torch.randint(0, 128, (2, 9))
    moegemm.hf.register(fmt=fmt)
    model.set_experts_implementation("moegemm")
    with torch.no_grad():
        before = model(ids).logits
    if how == "prepare":
        moegemm.hf.prepare(model, free_source=True)
    else:
        moegemm.hf.refresh(model)
        moegemm.hf.register(fmt=fmt, free_source=True)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)  # (converted again, then freed)
    modules = moegemm.hf.experts_modules(model)
    for module in modules:
        for param in (module.gate_up_proj, module.down_proj):
            assert param.numel() == 0 and param.untyped_storage().nbytes() == 0 and not param.requires_grad
        assert module._moegemm_experts.fmt == fmt
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    with pytest.raises(ValueError, match="source weights were freed.*gradients"):
        model.train()(ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match=r"^model: the source weights .* were freed"):
        moegemm.hf.refresh(model)
    moegemm.hf.register(fmt="nvfp4")
    with torch.no_grad(), pytest.raises(ValueError, match="source weights were freed.*conversion to nvfp4"):
        model(ids)
    moegemm.hf.register(fmt=fmt)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_gradients_read_gpt_oss_weights_in_place(monkeypatch):
    """Under grad, gpt-oss's [E, in, out] weights reach the forward's grouped products as views of
    the parameters (read N-major), not copies made every step; the gradients are checked against
    the eager experts in test_gradients_match_the_eager_experts."""
    model = _model("gpt_oss")
    module = moegemm.hf.experts_modules(model)[0]
    module.config._experts_implementation = "moegemm"
    seen = []
    product = moegemm.training.grouped_matmul
    monkeypatch.setattr(moegemm.training, "grouped_matmul", lambda a, b, *args, **kw: seen.append(b) or
                        product(a, b, *args, **kw))
    x = torch.randn(7, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    module(x, torch.randint(0, 8, (7, 2)), torch.rand(7, 2, dtype=torch.bfloat16)).sum().backward()
    assert [_storage(b) for b in seen] == [_storage(module.gate_up_proj), _storage(module.down_proj)]
    assert x.grad is not None and module.gate_up_proj.grad is not None


def _experts_on_gpu(cls, config, std: float = 0.02):
    """An experts module of `cls` in bf16 on the GPU, weights drawn N(0, std) (made on the meta
    device first: no fp32 copy of a real-size layer)."""
    with torch.device("meta"):
        module = cls(config)
    module = module.to(torch.bfloat16).to_empty(device="cuda")
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
    return module


@pytest.mark.gpu
def test_gpt_oss_experts_run_in_the_memory_of_their_weights():
    """gpt-oss-20b's experts layer (32 experts, H = I = 2880, bf16 [in, out] weights: 1.6 GB) on
    the GPU: converting it and a 256-token call grow the allocated memory by the call's workspace
    alone (< 64 MiB; a copy of the weights in the kernels' [E, out, in] order took 1.6 GB), and
    the call computes what the eager experts compute."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = _config("gpt_oss", hidden=2880, width=2880, experts=32, top_k=4)
    config._experts_implementation = "moegemm"
    module = _experts_on_gpu(GptOssExperts, config)
    tokens = 256
    x = torch.randn(tokens, 2880, device="cuda", dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(32, device="cuda")[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        assert moegemm.hf.prepare(module) == 1
        got = module(x, index, weights)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    weight_bytes = sum(p.numel() * p.element_size() for p in (module.gate_up_proj, module.down_proj))
    assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB allocated beyond {weight_bytes / 2**20:.0f} MiB of weights"
    with torch.no_grad():
        want = _eager_experts(module, x, index, weights)
    assert _rel(got, want) < 2e-2


@pytest.mark.gpu
def test_free_source_prepares_a_bf16_model_layer_by_layer():
    """Four layers of Qwen3-30B-A3B's experts (128 experts, H = 2048, I = 768: 1.2 GB of bf16
    each) prepared as fp8_block with free_source=True. The peak stays under the model plus one
    layer's bf16 size: the first layer's conversion adds its fp8 copy (0.6 GB) and one chunk's
    quantizer temporaries (moe.weights.QUANTIZE_CHUNK weights in a few fp32 copies, ~0.2 GB), and each
    later one starts with a freed layer to spare. Afterwards the experts take their fp8 size alone
    (a bf16-loaded Qwen3-30B-A3B then runs fp8_block on an 80 GB card), and compute what the bf16
    experts computed, within fp8_block's error."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = _config("qwen3_moe", hidden=2048, width=768, experts=128, top_k=8)
    config._experts_implementation = "moegemm"
    model = torch.nn.ModuleList([_experts_on_gpu(Qwen3MoeExperts, config) for _ in range(4)])
    tokens = 64
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(128, device="cuda")[:8] for _ in range(tokens)])
    weights = torch.rand(tokens, 8, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = _eager_experts(model[0], x, index, weights)
    layer_bytes = sum(p.numel() * p.element_size() for p in model[0].parameters())
    moegemm.hf.register(fmt="fp8_block")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    assert moegemm.hf.prepare(model, free_source=True) == 4
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < layer_bytes, f"peak {peak / 2**20:.0f} MiB beyond the model; a layer: {layer_bytes / 2**20:.0f} MiB"
    kept = sum(t.numel() * t.element_size() for m in model for q in (m._moegemm_experts.w_gate_up,
                                                                      m._moegemm_experts.w_down)
               for t in (q.data, q.scales))
    now = torch.cuda.memory_allocated() - (base - 4 * layer_bytes)
    assert abs(now - kept) < 8 * 2**20, f"{now / 2**20:.0f} MiB held for {kept / 2**20:.0f} MiB of fp8 experts"
    with torch.no_grad():
        got = model[0](x, index, weights)
    assert _rel(got, want) < 0.1  # fp8_block's layer error


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_bf16_experts_laid_out_otherwise_in_memory_still_run(kind):
    """Expert weights whose strides are neither layout the kernels read in place (here every
    other element of a wider tensor) run from a copy, computing what the eager experts compute."""
    model = _model(kind)
    with torch.no_grad():
        for module in moegemm.hf.experts_modules(model):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(module, name)
                wide = torch.zeros(*w.shape[:-1], 2 * w.shape[-1], dtype=w.dtype)
                wide[..., ::2] = w
                setattr(module, name, torch.nn.Parameter(wide[..., ::2]))
    ids = torch.randint(0, 128, (2, 9))
    _, calls = _experts_calls(model, ids, "moegemm")
    for module, inputs, got in calls:
        assert module.gate_up_proj.stride(-1) == 2
        with torch.no_grad():
            assert _rel(got, _eager_experts(module, *inputs)) < 2e-2
