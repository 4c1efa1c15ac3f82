"""Calls a new user makes that could go wrong without an error: each answers right or raises,
naming the argument. CPU (reference backend, or Triton's interpreter)."""

import pytest
import torch

import moegemm
from moegemm.kernels.tl_source import interpreter_usable

needs_interpreter = pytest.mark.skipif(not interpreter_usable(), reason="Triton's CPU interpreter needs numpy < 2.4")


def rel_err(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def truth(qa, qw, a_offsets, expert_ids):
    """fp64 product of the dequantized operands (global scales included), valid rows only."""
    a, w = moegemm.dequantize(qa, torch.float64), moegemm.dequantize(qw, torch.float64)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    bounds = a_offsets.tolist()
    for g, e in enumerate(expert_ids.tolist()):
        if e >= 0:
            out[bounds[g]:bounds[g + 1]] = a[bounds[g]:bounds[g + 1]] @ w[e].T
    return out


# ---- a. QuantizedTensor operands --------------------------------------------------------

@pytest.mark.parametrize("fmt,layout", [("nvfp4", "swizzled"), ("nvfp4", "plain"), ("mxfp8", "swizzled"),
                                        ("fp8_block", "plain"), ("bf16", "plain")])
def test_quantized_tensor_operands_carry_their_scales(fmt, layout):
    # nvfp4's global scales ride in the QuantizedTensors: the raw-tensor call without
    # expert_scales left them out (4e5 off); given the QuantizedTensors, the call folds them in.
    a_offsets = torch.tensor([0, 5, 5, 19], dtype=torch.int32)
    ids = torch.tensor([1, -1, 0], dtype=torch.int32)
    qa = moegemm.quantize(torch.randn(21, 64) * 40, fmt, scale_layout=layout, a_offsets=a_offsets)
    qw = moegemm.quantize_weights(torch.randn(2, 32, 64) * 3, fmt, scale_layout=layout)
    got = moegemm.grouped_matmul(qa, qw, None, None, a_offsets, ids, fmt=fmt, out_dtype=torch.float32)
    want = truth(qa, qw, a_offsets, ids)
    assert rel_err(got[:19], want[:19]) < 1e-5
    assert torch.equal(got[19:], torch.zeros(2, 32))  # rows past the last group: the fresh zeros
    scales = torch.tensor([0.5, 2.0])
    got = moegemm.grouped_matmul(qa, qw, None, None, a_offsets, ids, fmt=fmt, expert_scales=scales,
                                 out_dtype=torch.float32)
    assert rel_err(got[:5], want[:5] * 2.0) < 1e-5 and rel_err(got[5:19], want[5:19] * 0.5) < 1e-5


def test_quantized_tensor_operands_must_be_consistent():
    a_offsets = torch.tensor([0, 8, 20], dtype=torch.int32)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    qa = moegemm.quantize(torch.randn(20, 64), "mxfp8", scale_layout="swizzled", a_offsets=a_offsets)
    qw = moegemm.quantize_weights(torch.randn(2, 16, 64), "mxfp8", scale_layout="swizzled")
    with pytest.raises(ValueError, match="^a_scales:"):
        moegemm.grouped_matmul(qa, qw, qa.scales, None, a_offsets, ids, fmt="mxfp8")
    with pytest.raises(ValueError, match="^fmt:"):
        moegemm.grouped_matmul(qa, qw, None, None, a_offsets, ids, fmt="mxfp4")
    with pytest.raises(ValueError, match="^scale_layout:"):
        moegemm.grouped_matmul(qa, qw, None, None, a_offsets, ids, fmt="mxfp8", scale_layout="plain")
    with pytest.raises(ValueError, match="^b:"):
        moegemm.grouped_matmul(qa, qa, None, None, a_offsets, ids, fmt="mxfp8")


def test_a_layout_is_checked_where_it_enters_and_users_see_its_name():
    """A misspelt layout is refused, named as the argument it came in (dequantize_operand decoded
    it as plain before; grouped_matmul_swiglu named its quantizer's argument); a QuantizedTensor
    made with a layout object reads as the name."""
    from moegemm import layouts

    a_offsets = torch.tensor([0, 8, 20], dtype=torch.int32)
    qa = moegemm.quantize(torch.randn(20, 64), "mxfp8", scale_layout="swizzled", a_offsets=a_offsets)
    with pytest.raises(ValueError, match="^scale_layout: expected 'plain', 'swizzled'"):
        moegemm.dequantize_operand(qa.data, qa.scales, "mxfp8", "a", scale_layout="Swizzled", a_offsets=a_offsets)
    w = torch.randn(2, 32, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="^out_scale_layout: expected 'plain', 'swizzled'"):
        moegemm.grouped_matmul_swiglu(torch.zeros(20, 64, dtype=torch.bfloat16), w, None, None, a_offsets,
                                      torch.tensor([0, 1], dtype=torch.int32), fmt="bf16", out_fmt="mxfp8",
                                      gate_up_layout="interleaved", out_scale_layout="Swizzled", backend="reference")
    made = moegemm.QuantizedTensor(qa.data, qa.scales, "mxfp8", "a", layouts.SWIZZLED, None, a_offsets)
    assert made.scale_layout == "swizzled" and type(made.scale_layout) is str and made.layout is layouts.SWIZZLED
    # (the layout object is kept from construction: a copy with another name has that name's)
    import copy
    import dataclasses

    assert dataclasses.replace(made, scale_layout="plain").layout is layouts.PLAIN
    assert copy.deepcopy(made).layout is layouts.SWIZZLED
    misspelt = dataclasses.replace(made, scale_layout="Swizzled")
    with pytest.raises(ValueError, match="^scale_layout: expected 'plain', 'swizzled' or a TokenForm, got 'Swizzled'"):
        misspelt.layout


# ---- b. swizzled A scales placed for other offsets --------------------------------------

def test_swizzled_scales_for_other_offsets_are_refused():
    # Both offset sets need one 128-row scale block a group, so the shapes cannot tell them
    # apart; rows 8..11 would read scales placed for the other group (0.35 off).
    placed = torch.tensor([0, 8, 20], dtype=torch.int32)
    other = torch.tensor([0, 12, 20], dtype=torch.int32)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    qa = moegemm.quantize(torch.randn(20, 64) * torch.logspace(-2, 2, 20)[:, None], "mxfp4", scale_layout="swizzled",
                          a_offsets=placed)
    qw = moegemm.quantize_weights(torch.randn(2, 16, 64), "mxfp4", scale_layout="swizzled")
    with pytest.raises(ValueError, match="^a_offsets:.*placed for other group offsets"):
        moegemm.grouped_matmul(qa, qw, None, None, other, ids, fmt="mxfp4")
    with pytest.raises(ValueError, match="^a_offsets:"):
        moegemm.grouped_matmul(qa, qw, None, None, torch.tensor([0, 20], dtype=torch.int32), ids[:1], fmt="mxfp4")
    got = moegemm.grouped_matmul(qa, qw, None, None, placed, ids, fmt="mxfp4", out_dtype=torch.float32)
    assert rel_err(got, truth(qa, qw, placed, ids)) < 1e-5


# ---- c. the gate/up order is stated ------------------------------------------------------

def _concat_layer_inputs(fmt):
    torch.manual_seed(0)
    e, i, h, t, k = 4, 32, 64, 6, 2
    gate, up, down = torch.randn(e, i, h) * 0.2, torch.randn(e, i, h) * 0.2, torch.randn(e, h, i) * 0.2
    w_gate_up = moegemm.quantize_weights(torch.cat([gate, up], dim=1), fmt)  # transformers' [gate; up]
    w_down = moegemm.quantize_weights(down, fmt)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, k)
    return x, ids, weights, w_gate_up, w_down


def test_moe_forward_needs_the_gate_up_order():
    x, ids, weights, w_gate_up, w_down = _concat_layer_inputs("bf16")
    with pytest.raises(TypeError, match="gate_up_layout"):
        moegemm.moe_forward(x, ids, weights, w_gate_up, w_down)
    with pytest.raises(TypeError, match="gate_up_layout"):
        moegemm.grouped_matmul_swiglu(torch.zeros(2, 64, dtype=torch.bfloat16), w_gate_up.data, None, None,
                                      torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                      fmt="bf16")
    with pytest.raises(TypeError, match="gate_up_layout"):
        moegemm.swiglu_quantize(torch.zeros(2, 64), "bf16")
    with pytest.raises(ValueError, match="^gate_up_layout:"):
        moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout="gate_first")


@needs_interpreter
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_moe_forward_with_concatenated_gate_up(fmt):
    # [gate; up] rows stated as such: the layer matches the fp64 layer of the same quantized
    # weights (read as interleaved, it was 1.4 off).
    x, ids, weights, w_gate_up, w_down = _concat_layer_inputs(fmt)
    y = moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout="concat")
    gate_up, down = moegemm.dequantize(w_gate_up, torch.float64), moegemm.dequantize(w_down, torch.float64)
    gate, up = gate_up.chunk(2, dim=1)
    want = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            xt = x[t].double()
            hidden = torch.nn.functional.silu(gate[e] @ xt) * (up[e] @ xt)
            want[t] += weights[t, slot].double() * (down[e] @ hidden)
    assert rel_err(y, want) < (2e-2 if fmt == "bf16" else 6e-2)


# ---- d. the layer's input dtype -----------------------------------------------------------

@needs_interpreter
def test_moe_module_takes_other_float_dtypes():
    torch.manual_seed(1)
    layer = moegemm.MoE(64, 32, 4, 2).load_experts(gate=torch.randn(4, 32, 64) * 0.2, up=torch.randn(4, 32, 64) * 0.2,
                                                   down=torch.randn(4, 64, 32) * 0.2)
    layer.load_router(torch.randn(4, 64))
    x = torch.randn(3, 5, 64)
    y32 = layer(x)
    assert y32.dtype == torch.float32 and y32.shape == x.shape
    assert torch.equal(y32, layer(x.bfloat16()).float())  # computed in the layer's bf16 either way
    with pytest.raises(TypeError, match="^hidden_states:"):
        layer(torch.zeros(3, 64, dtype=torch.int32))


# ---- e. inputs that require grad ---------------------------------------------------------

@needs_interpreter
def test_kernel_backends_refuse_inputs_that_require_grad():
    a_offsets = torch.tensor([0, 8, 20], dtype=torch.int32)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    a = torch.randn(20, 64, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^a: requires grad, but backend 'triton'"):
        moegemm.grouped_matmul(a, b, None, None, a_offsets, ids, fmt="bf16", backend="triton")
    with torch.no_grad():
        assert moegemm.grouped_matmul(a, b, None, None, a_offsets, ids, fmt="bf16", backend="triton").shape == (20, 16)
    with torch.inference_mode():
        moegemm.grouped_matmul(a, b, None, None, a_offsets, ids, fmt="bf16", backend="triton")
    c = moegemm.grouped_matmul(a, b, None, None, a_offsets, ids, fmt="bf16", backend="reference")
    assert c.requires_grad  # the reference is torch: the gradient reaches a
    c.float().sum().backward()
    assert a.grad is not None and a.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="^expert_scales: requires grad"):
        moegemm.grouped_matmul(a.detach(), b, None, None, a_offsets, ids, fmt="bf16", backend="triton",
                               expert_scales=torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="^row_scales: requires grad"):
        moegemm.grouped_matmul(a.detach(), b, None, None, a_offsets, ids, fmt="bf16", backend="triton",
                               row_scales=torch.ones(20, requires_grad=True))
    with pytest.raises(ValueError, match="^b: requires grad"):
        moegemm.grouped_matmul(a.detach(), b.clone().requires_grad_(), None, None, a_offsets, ids, fmt="bf16",
                               backend="triton")
    with pytest.raises(ValueError, match="^bias: requires grad, but grouped_matmul_swiglu"):
        moegemm.grouped_matmul_swiglu(a.detach(), b, None, None, a_offsets, ids, fmt="bf16",
                                      gate_up_layout="interleaved", bias=torch.zeros(2, 16, requires_grad=True),
                                      backend="triton")


@needs_interpreter
def test_moe_layer_refuses_inputs_that_require_grad():
    layer = moegemm.MoE(64, 32, 4, 2).load_experts(gate=torch.randn(4, 32, 64), up=torch.randn(4, 32, 64),
                                                   down=torch.randn(4, 64, 32))
    x = torch.randn(3, 64, requires_grad=True)
    with pytest.raises(ValueError, match="^x: requires grad, but moe_forward has no backward"):
        layer(x)
    with torch.no_grad():
        assert layer(x).shape == (3, 64)


def test_nvfp4_expert_scales_of_another_shape_are_named():
    a_offsets = torch.tensor([0, 8, 20], dtype=torch.int32)
    qa = moegemm.quantize(torch.randn(20, 64), "nvfp4", a_offsets=a_offsets)
    qw = moegemm.quantize_weights(torch.randn(2, 16, 64), "nvfp4")
    with pytest.raises(ValueError, match="^expert_scales:"):
        moegemm.grouped_matmul(qa, qw, None, None, a_offsets, torch.tensor([0, 1], dtype=torch.int32), fmt="nvfp4",
                               expert_scales=torch.ones(3))


# ---- f. inputs as users pass them -------------------------------------------------------

def _views(x: torch.Tensor) -> dict:
    """x [T, H] as views of other strides on x's device, each equal to x: transposed, every other
    column of a wider tensor, and columns sliced out of a wider row."""
    t, h = x.shape
    wide = x.new_zeros(t, 2 * h)
    wide[:, ::2] = x
    padded = x.new_zeros(t, h + 40)
    padded[:, 8:8 + h] = x
    return {"transposed": x.t().contiguous().t(), "strided columns": wide[:, ::2], "sliced rows": padded[:, 8:8 + h]}


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_tokens_of_any_strides_give_the_contiguous_outputs(fmt):
    # As nn.Linear takes any view, so do moe_forward and the layer: the same bits as the
    # contiguous tokens' (a transposed view raised "x: expected unit stride along columns").
    torch.manual_seed(2)
    x, ids, weights, w_gate_up, w_down = _concat_layer_inputs(fmt)
    want = moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout="concat", backend="reference")
    for name, view in _views(x).items():
        got = moegemm.moe_forward(view, ids, weights, w_gate_up, w_down, gate_up_layout="concat", backend="reference")
        assert torch.equal(got, want), name


def test_the_layer_takes_hidden_states_of_any_strides():
    torch.manual_seed(3)
    x = torch.randn(6, 64)
    layer = moegemm.MoE(64, 32, 4, 2, backend="reference").load_experts(
        gate=torch.randn(4, 32, 64) * 0.2, up=torch.randn(4, 32, 64) * 0.2, down=torch.randn(4, 64, 32) * 0.2)
    layer.load_router(torch.randn(4, 64))
    want = layer(x)
    for name, view in _views(x).items():
        assert torch.equal(layer(view), want), name
    batch = x.reshape(2, 3, 64)  # [B, S, H] stored as [H, B, S]: its tokens [B*S, H] are a transposed view
    assert torch.equal(layer(batch.permute(2, 0, 1).contiguous().permute(1, 2, 0)), want.reshape(2, 3, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_tokens_of_any_strides_gpu(fmt):
    # The sm90 path: a decode-sized layer call (replayed from its CUDA graph from the second call
    # on) and a prefill-sized moe_forward, on views, give the contiguous tokens' bits.
    torch.manual_seed(4)
    h, i, e, k = 256, 256, 16, 4
    layer = moegemm.MoE(h, i, e, k, fmt=fmt, device="cuda").load_experts(
        gate=torch.randn(e, i, h, device="cuda") / 16, up=torch.randn(e, i, h, device="cuda") / 16,
        down=torch.randn(e, h, i, device="cuda") / 16)
    layer.load_router(torch.randn(e, h, device="cuda"))
    w_gate_up, w_down = layer.weights()
    for tokens in (4, 300):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        views = _views(x)
        want = layer(x)
        for name, view in views.items():
            for _ in range(3):  # (eager, captured, replayed)
                assert torch.equal(layer(view), want), (tokens, name)
        ids, weights = layer.route_tokens(x)
        want = moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout=layer.gate_up_layout)
        for name, view in views.items():
            got = moegemm.moe_forward(view, ids, weights, w_gate_up, w_down, gate_up_layout=layer.gate_up_layout)
            assert torch.equal(got, want), (tokens, name)


def test_weights_given_to_the_activation_quantizer_are_named():
    # quantize() takes activations [M, K]; weights [E, N, K] there are named as such, in every
    # layout, before anything else is checked (a 2-D tensor in the swizzled layout needs
    # a_offsets: the message says what quantize is for).
    w = torch.randn(4, 32, 64)
    for backend in ("auto", "triton"):  # (the kernel path's checks are the reference's)
        for fmt in ("mxfp8", "nvfp4", "fp8_block", "bf16"):
            for layout in ("plain", "swizzled"):
                with pytest.raises(ValueError, match=r"^x: expected 2 dimensions, got shape \(4, 32, 64\) "
                                                     r".*quantize_weights"):
                    moegemm.quantize(w, fmt, scale_layout=layout, backend=backend)
        with pytest.raises(ValueError, match="^a_offsets: required .*activations .*quantize_weights"):
            moegemm.quantize(w[0], "mxfp8", scale_layout="swizzled", backend=backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a torch without a CUDA device")
def test_a_cuda_layer_without_cuda_is_named():
    # Was torch's "AssertionError: Torch not compiled with CUDA enabled" from an allocation.
    for device in ("cuda", torch.device("cuda", 1)):
        with pytest.raises(ValueError, match="^device: .*no CUDA device is available"):
            moegemm.MoE(64, 32, 4, 2, device=device)


def test_a_device_torch_does_not_know_is_named():
    with pytest.raises(ValueError, match="^device: expected a device this torch can use.*'gpu'"):
        moegemm.MoE(64, 32, 4, 2, device="gpu")
    assert moegemm.MoE(64, 32, 4, 2, device="cpu").router_weight.device.type == "cpu"
