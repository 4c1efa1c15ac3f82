"""Eager calls replayed from CUDA graphs (moegemm/graphed.py) give the bits of the direct calls:
the MoE layer and the transformers experts backend at decode sizes, fresh inputs every call,
new weights after a reload, and a user's own capture around them. GPU only."""

import copy
import pickle

import pytest
import torch

import moegemm
from moegemm import graphed


def _layer(fmt: str, hidden=512, width=256, experts=16, top_k=4):
    layer = moegemm.MoE(hidden, width, experts, top_k, fmt=fmt, device="cuda", dtype=torch.bfloat16)
    layer.load_experts(gate=torch.randn(experts, width, hidden, device="cuda") / hidden**0.5,
                       up=torch.randn(experts, width, hidden, device="cuda") / hidden**0.5,
                       down=torch.randn(experts, hidden, width, device="cuda") / width**0.5)
    return layer.load_router(torch.randn(experts, hidden, device="cuda"))


def _direct(fn, *args, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("MOEGEMM_EAGER_GRAPHS", "0")
        return fn(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "bf16_mxfp4"])
@pytest.mark.parametrize("tokens", [1, 32])
@torch.no_grad()
def test_layer_calls_replayed_from_a_graph_give_the_direct_bits(fmt, tokens, monkeypatch):
    layer = _layer(fmt)
    for call in range(4):  # direct, captured, replayed, replayed
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        got = layer(x)
        assert torch.equal(got, _direct(layer, x, monkeypatch=monkeypatch)), call
    assert len(layer._graphs.graphs) == 1
    layer.load_experts(gate=torch.randn(16, 256, 512, device="cuda") / 20, up=torch.randn(16, 256, 512, device="cuda") / 20,
                       down=torch.randn(16, 512, 256, device="cuda") / 16)  # new weights: a new key
    for _ in range(3):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(layer(x), _direct(layer, x, monkeypatch=monkeypatch))


@pytest.mark.gpu
@torch.no_grad()
def test_a_users_capture_records_the_launches_not_a_graph():
    layer = _layer("bf16")
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    want = [layer(x) for _ in range(3)][-1]  # (the layer's own graph exists now)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for _ in range(2):
        x2 = torch.randn_like(x)
        static.copy_(x2)
        graph.replay()
        torch.testing.assert_close(out, layer(x2), rtol=0, atol=0)
    assert torch.equal(want, layer(x))


@pytest.mark.gpu
def test_graphs_are_not_used_where_unsafe(monkeypatch):
    x = torch.randn(4, 8, device="cuda")
    assert graphed.usable(x)
    assert not graphed.usable(torch.randn(graphed.MAX_TOKENS + 1, 8, device="cuda"))
    assert not graphed.usable(x.cpu())
    assert not graphed.usable(x, backend="reference")  # (reads offsets on the host)
    monkeypatch.setenv("MOEGEMM_DEBUG", "1")  # (value checks read device values)
    assert not graphed.usable(x)
    monkeypatch.delenv("MOEGEMM_DEBUG")
    assert not graphed.usable(x.requires_grad_())


@pytest.mark.gpu
def test_a_shape_captured_under_inference_mode_replays_outside_it():
    layer = _layer("bf16")
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(3):
            inside = layer(x)
    with torch.no_grad():
        outside = [layer(x) for _ in range(3)][-1]
    assert torch.equal(inside, outside)


@pytest.mark.gpu
@torch.no_grad()
def test_a_copy_of_a_layer_starts_without_graphs():
    layer = _layer("bf16")
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    want = [layer(x) for _ in range(3)][-1]
    twin = copy.deepcopy(layer)
    assert len(layer._graphs.graphs) == 1 and not twin._graphs.graphs
    assert torch.equal([twin(x) for _ in range(3)][-1], want)


def test_graphed_calls_copy_and_pickle_without_their_graphs():
    calls = graphed.GraphedCalls(max_graphs=3)
    calls.graphs["key"] = object()  # (a stand-in: a CUDAGraph can be neither copied nor pickled)
    for twin in (copy.deepcopy(calls), pickle.loads(pickle.dumps(calls))):
        assert twin.max_graphs == 3 and not twin.graphs and not twin.seen


transformers = pytest.importorskip("transformers")


def _experts(kind: str):
    """One experts module at real sizes: Qwen3-30B-A3B's or gpt-oss-20b's (bf16, random)."""
    if kind == "qwen3":
        config = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                             num_experts_per_tok=8)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls
    else:
        config = transformers.GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                           num_experts_per_tok=4)
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls
    with torch.device("cuda"):
        module = cls(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    config._experts_implementation = "moegemm"
    return module, config.num_experts_per_tok, module.num_experts


def _routing(tokens, top_k, experts, hidden):
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), -1).to(torch.bfloat16)
    return x, index, weights


def _with(module, implementation, *inputs):
    module.config._experts_implementation = implementation
    try:
        return module(*inputs)
    finally:
        module.config._experts_implementation = "moegemm"


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
@torch.no_grad()
def test_experts_backend_at_real_sizes(kind, monkeypatch):
    """Decode sizes (replayed from a graph from the second call, bits of the direct call) and a
    prefill size (direct) against transformers' grouped_mm experts."""
    moegemm.hf.register()
    module, top_k, experts = _experts(kind)
    hidden = 2048 if kind == "qwen3" else 2880
    for tokens in (1, 1, 1, 32, 32, 32, 1024):
        inputs = _routing(tokens, top_k, experts, hidden)
        got = module(*inputs)
        if tokens <= graphed.MAX_TOKENS:
            assert torch.equal(got, _direct(module, *inputs, monkeypatch=monkeypatch))
        assert _rel(got, _with(module, "grouped_mm", *inputs)) < 2e-2
    assert len(module._moegemm_experts.graphs.graphs) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_experts_gradients_at_real_sizes(kind):
    moegemm.hf.register()
    module, top_k, experts = _experts(kind)
    hidden = 2048 if kind == "qwen3" else 2880
    x, index, weights = _routing(512, top_k, experts, hidden)
    x.requires_grad_(), weights.requires_grad_()
    params = [p for p in module.parameters() if p.requires_grad]
    dout = torch.randn_like(x)
    grads = [torch.autograd.grad(_with(module, impl, x, index, weights), [x, weights, *params], dout)
             for impl in ("grouped_mm", "moegemm")]
    for want, got in zip(*grads):
        assert _rel(got, want) < 3e-2
