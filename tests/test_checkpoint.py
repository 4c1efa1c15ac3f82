"""The MoE layer's state dict (MoE.get_extra_state, MoE._load_from_state_dict): what its expert
tensors mean travels with them, loading converts to the loading layer's order or refuses naming
both sides, and a freshly built layer takes a checkpoint. CPU: the reference backend on tiny
layers; GPU: the sm90 kernels on prepacked weights, and checkpoints crossing between devices."""

import io

import pytest
import torch
from ep_workers import spawn

import moegemm
from moegemm.formats import PREPACK_FORMATS

# N and K of both products are multiples of 64, so that the prepacked order applies.
H, I, E, K = 64, 64, 4, 2
GPU_H, GPU_I, GPU_E = 256, 256, 8
# A gpt-oss-like layer: router and expert biases, so that every kind of buffer travels.
LAYER = dict(activation="swiglu_oai", router="topk_softmax", router_bias=True, expert_bias=True,
             shared_intermediate_size=64)


def _experts(h, i, e, seed):
    gen = torch.Generator().manual_seed(seed)
    return dict(gate=torch.randn(e, i, h, generator=gen) / h ** 0.5, up=torch.randn(e, i, h, generator=gen) / h ** 0.5,
                down=torch.randn(e, h, i, generator=gen) / i ** 0.5, gate_bias=torch.randn(e, i, generator=gen) / 10,
                up_bias=torch.randn(e, i, generator=gen) / 10, down_bias=torch.randn(e, h, generator=gen) / 10)


def _layer(fmt, *, seed=0, device="cpu", sizes=(H, I, E), **kw):
    """A layer of LAYER's kind with its weights loaded (the router, the shared expert and the
    experts from `seed`)."""
    h, i, e = sizes
    layer = moegemm.MoE(h, i, e, K, fmt=fmt, device=device, **LAYER, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    layer.load_router(torch.randn(e, h, generator=gen).to(device, torch.bfloat16),
                      torch.randn(e, generator=gen).to(device, torch.bfloat16))
    with torch.no_grad():
        for linear in layer.shared.values():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) / 8)
    layer.load_experts(**{name: w.to(device) for name, w in _experts(h, i, e, seed).items()})
    if layer.fmt == "nvfp4":  # a static intermediate global scale: a buffer a fresh layer lacks
        layer.intermediate_global_scale = torch.tensor(0.01, device=device)
    return layer


def _fresh(fmt, *, device="cpu", sizes=(H, I, E), **kw):
    h, i, e = sizes
    return moegemm.MoE(h, i, e, K, fmt=fmt, device=device, **LAYER, **kw)


def _through_file(obj, **load):
    """obj after torch.save and torch.load (weights_only=True unless `load` says otherwise)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **{"weights_only": True, **load})


def _tokens(h=H, device="cpu"):
    return torch.randn(5, h, dtype=torch.bfloat16).to(device)


def _plain_bytes(q):
    """A weight's codes in the plain order, as bytes."""
    return (moegemm.unpack_weights(q) if q.prepacked else q).data.view(torch.uint8)


@pytest.mark.parametrize("fmt", list(moegemm.FORMATS))
def test_state_dict_restores_into_a_freshly_built_layer(fmt):
    """torch.save of the state dict, torch.load(weights_only=True), load_state_dict into a layer
    built with the same arguments (no weights yet): every buffer is made, the outputs are the
    same bits; so after torch.save of the whole module."""
    layer = _layer(fmt, prepack=True)  # prepacked where the format has the order
    x = _tokens()
    want = layer(x)
    state = _through_file(layer.state_dict())
    fresh = _fresh(fmt, prepack=True)
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    assert fresh.get_extra_state() == layer.get_extra_state()
    assert fresh.gate_up_prepacked == (fmt in PREPACK_FORMATS)
    assert torch.equal(fresh(x), want)
    whole = _through_file(layer, weights_only=False)
    assert torch.equal(whole(x), want)


@pytest.mark.parametrize("fmt", PREPACK_FORMATS)
@pytest.mark.parametrize("saved_prepacked", [True, False])
@pytest.mark.parametrize("loaded_before", [False, True], ids=["fresh", "loaded"])
def test_the_weight_order_converts_to_the_loading_layers(fmt, saved_prepacked, loaded_before):
    """Prepacked codes loaded into a layer that keeps them plain (prepack=False, or any layer on a
    CPU by default) are unpacked, and plain ones prepacked for a layer that prepacks: the outputs
    are the source layer's, the codes what the loading layer's own loaders make."""
    source = _layer(fmt, prepack=saved_prepacked)
    assert source.gate_up_prepacked == source.down_prepacked == saved_prepacked
    target = _layer(fmt, seed=7, prepack=not saved_prepacked) if loaded_before else _fresh(
        fmt, prepack=not saved_prepacked)
    target.load_state_dict(_through_file(source.state_dict()))
    assert target.gate_up_prepacked == target.down_prepacked == (not saved_prepacked)
    x = _tokens()
    assert torch.equal(target(x), source(x))
    own = _layer(fmt, prepack=not saved_prepacked)
    for got, want in zip(target.weights(), own.weights()):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))


def test_a_default_layer_on_the_cpu_unpacks():
    """prepack=None on the CPU keeps weights plain (the sm90 kernels are not there): prepacked
    checkpoint codes are unpacked for it."""
    source = _layer("nvfp4", prepack=True)
    target = _fresh("nvfp4")
    target.load_state_dict(source.state_dict())
    assert not target.gate_up_prepacked and not target.down_prepacked
    x = _tokens()
    assert torch.equal(target(x), source(x))


def test_another_format_is_refused_naming_both():
    """mxfp4 and bf16_mxfp4 weights have the same bytes and shapes but not the same tokens: a
    layer of one refuses the other's checkpoint, and keeps its weights."""
    source = _layer("mxfp4")
    target = _layer("bf16_mxfp4", seed=3)
    x = _tokens()
    before = target(x)
    with pytest.raises(ValueError, match=r"^state_dict: expected experts of format bf16_mxfp4 .*got mxfp4"):
        target.load_state_dict(source.state_dict())
    assert torch.equal(target(x), before)


def test_a_layer_built_without_a_format_takes_the_checkpoints():
    source = _layer("mxfp8")
    target = _fresh(None)
    assert target.fmt == "bf16"  # (the placeholder until weights come)
    target.load_state_dict(source.state_dict())
    assert (target.fmt, target.scale_layout) == ("mxfp8", "swizzled")
    x = _tokens()
    assert torch.equal(target(x), source(x))
    loaded = _layer(None, seed=5)  # bf16 weights already there: replaced by the checkpoint's format
    loaded.load_state_dict(source.state_dict())
    assert loaded.fmt == "mxfp8" and torch.equal(loaded(x), source(x))


def test_strict_loading_still_reports_keys_that_are_wrong():
    layer = _layer("nvfp4")
    state = layer.state_dict()
    with pytest.raises(RuntimeError, match='Unexpected key.*"bogus"') as caught:
        _fresh("nvfp4").load_state_dict({**state, "bogus": torch.zeros(1)})
    assert "gate_up_data" not in str(caught.value)  # the experts' buffers are made, not unexpected
    fresh = _fresh("nvfp4")
    result = fresh.load_state_dict({**state, "bogus": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["bogus"] and not result.missing_keys
    x = _tokens()
    assert torch.equal(fresh(x), layer(x))
    without_router = {key: value for key, value in state.items() if key != "router_weight"}
    with pytest.raises(RuntimeError, match='Missing key.*"router_weight"'):
        _fresh("nvfp4").load_state_dict(without_router)
    no_bias = moegemm.MoE(H, I, E, K, fmt="nvfp4", **{**LAYER, "expert_bias": False})
    with pytest.raises(RuntimeError, match='Unexpected key.*"gate_up_bias"'):
        no_bias.load_state_dict(state)  # biases a layer without them would never add


@pytest.mark.parametrize("drop, message", [
    ("_extra_state", r"^state_dict: expected '_extra_state' \(what the expert tensors mean"),
    ("down_scales", r"^state_dict: expected 'down_data', 'down_scales', 'down_global' \(nvfp4 weights\)"),
])
def test_expert_tensors_without_their_meaning_or_parts_are_refused(drop, message):
    """Codes without the extra state that says their order, or without the scales that go with
    them, cannot be read right: a ValueError names the key, loaded or fresh."""
    state = _layer("nvfp4", prepack=True).state_dict()
    del state[drop]
    for target in (_layer("nvfp4", seed=2), _fresh("nvfp4")):
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(state, strict=False)


def test_tensors_of_another_shape_or_dtype_are_refused_naming_the_key():
    """A checkpoint of a layer of other sizes, or codes of another dtype (which a copy would
    convert by value), loaded or fresh."""
    wider = _layer("mxfp8", sizes=(H, 2 * I, E)).state_dict()
    for target in (_layer("mxfp8", seed=2), _fresh("mxfp8")):
        with pytest.raises(ValueError, match=r"^state_dict\['gate_up_data'\]: expected shape \(4, 128, 64\), "
                                             r"got \(4, 256, 64\)"):
            target.load_state_dict(wider)
    state = _layer("mxfp8").state_dict()
    state["down_data"] = state["down_data"].float()
    with pytest.raises(TypeError, match=r"^state_dict\['down_data'\]: expected torch.float8_e4m3fn, got "
                                        r"torch.float32"):
        _layer("mxfp8", seed=2).load_state_dict(state)


def test_a_checkpoint_with_plain_scales_is_swizzled():
    """The scale layout is part of the meaning: plain scales in a checkpoint that says so are
    placed in the layer's swizzled layout."""
    layer = _layer("mxfp8")
    state = layer.state_dict()
    for name, n, k in (("gate_up_scales", 2 * I, H), ("down_scales", H, I)):
        state[name] = moegemm.layouts.unswizzle_b_scales(state[name], n, k // 32)
    state["_extra_state"] = {**state["_extra_state"], "scale_layout": "plain"}
    fresh = _fresh("mxfp8")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.gate_up_scales.view(torch.uint8), layer.gate_up_scales.view(torch.uint8))
    x = _tokens()
    assert torch.equal(fresh(x), layer(x))


@pytest.mark.parametrize("fmt, field, value, message", [
    ("mxfp8", "gate_up_layout", "concat",
     r"^state_dict: expected gate/up rows 'interleaved' \(this layer's order\), got 'concat'"),
    ("fp8_block", "scale_layout", "swizzled",
     r"^state_dict: expected scale layout 'plain' \(the only one of fp8_block\), got 'swizzled'"),
    ("mxfp8", "gate_up_order", "prepacked",
     r"^state_dict\['_extra_state'\] \(gate_up_order 'prepacked'\): prepacked weights are for .*not mxfp8"),
    ("mxfp8", "version", 2, r"^state_dict\['_extra_state'\]: expected an MoE state of version 1, got version 2"),
    ("mxfp8", "experts", (0, 2), r"^state_dict: holds experts \[0, 2\) of 4, this layer keeps \[0, 4\) of 4"),
])
def test_what_cannot_be_converted_is_refused_naming_both(fmt, field, value, message):
    state = _layer(fmt).state_dict()
    state["_extra_state"] = {**state["_extra_state"], field: value}
    with pytest.raises(ValueError, match=message):
        _fresh(fmt).load_state_dict(state)


def test_loading_drops_graphs_captured_on_the_old_weights():
    """Eager CUDA graphs read the weights' addresses; a load that copies in place keeps them, so
    the graphs of the old weights go (none is replayed with another layer's meaning)."""
    target = _layer("nvfp4", seed=4)
    target._graphs.graphs["a captured call"] = object()
    target._graphs.seen["a call seen once"] = True
    address = target.gate_up_data.data_ptr()
    target.load_state_dict(_layer("nvfp4").state_dict())
    assert target.gate_up_data.data_ptr() == address  # copied in place
    assert not target._graphs.graphs and not target._graphs.seen


def test_state_dict_into_expert_parallel_ranks_cpu():
    """A rank takes the full checkpoint or its own experts' (any order), and refuses another
    rank's: a ValueError on every rank, no rank's weights changed."""
    spawn(2, "gloo", "check_state_dict", timeout=120)


# ---- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(moegemm.FORMATS))
@torch.no_grad()
def test_state_dict_round_trip_gpu(fmt):
    """On the GPU (weights prepacked where the loaders prepack them): the state dict into a fresh
    GPU layer, and the whole module, give the same bits; the GPU checkpoint loaded into a CPU
    layer holds the plain codes and gives the bits of a CPU layer loaded from the same float
    weights; a CPU checkpoint into a GPU layer those of the GPU layer."""
    sizes = (GPU_H, GPU_I, GPU_E)
    layer = _layer(fmt, device="cuda", sizes=sizes)
    assert layer.gate_up_prepacked == (fmt in moegemm.formats.PREPACK_BY_DEFAULT)
    x = _tokens(GPU_H, "cuda")
    want = layer(x)
    fresh = _fresh(fmt, device="cuda", sizes=sizes)
    fresh.load_state_dict(_through_file(layer.state_dict()))
    assert fresh.gate_up_prepacked == layer.gate_up_prepacked
    assert torch.equal(fresh(x), want)
    assert torch.equal(_through_file(layer, weights_only=False)(x), want)

    on_cpu = _fresh(fmt, sizes=sizes)
    on_cpu.load_state_dict(_through_file(layer.state_dict(), map_location="cpu"))
    assert not on_cpu.gate_up_prepacked and not on_cpu.down_prepacked
    for got, gpu in zip(on_cpu.weights(), layer.weights()):
        assert torch.equal(_plain_bytes(got), _plain_bytes(gpu).cpu())
    cpu_layer = _layer(fmt, sizes=sizes)
    assert torch.equal(on_cpu(x.cpu()), cpu_layer(x.cpu()))

    back = _fresh(fmt, device="cuda", sizes=sizes)
    back.load_state_dict(_through_file(cpu_layer.state_dict()))
    assert back.gate_up_prepacked == layer.gate_up_prepacked
    assert torch.equal(back(x), want)


@pytest.mark.gpu
@torch.no_grad()  # (graphs replay calls that need no gradient: the shared expert's weights would)
def test_load_state_dict_after_graph_replay_gpu():
    """A layer whose decode-size calls replay a captured graph, then loads another layer's state
    (in place: the same addresses): its calls give the new layer's outputs, eager and replayed."""
    sizes = (GPU_H, GPU_I, GPU_E)
    layer = _layer("bf16_mxfp4", device="cuda", sizes=sizes)
    other = _layer("bf16_mxfp4", seed=9, device="cuda", sizes=sizes)
    x = torch.randn(2, GPU_H, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):  # warm-up, capture, replay
        layer(x)
    assert layer._graphs.graphs
    want = other(x)
    layer.load_state_dict(other.state_dict())
    for _ in range(3):
        assert torch.equal(layer(x), want)
