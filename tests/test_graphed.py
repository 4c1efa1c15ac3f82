"""Eager calls replayed from CUDA graphs (moegemm/graphed.py) give the bits of the direct calls:
the MoE layer and the transformers experts backend at decode sizes, fresh inputs every call,
new weights after a reload, and a user's own capture around them. GPU only."""

import copy
import pickle
import weakref

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
    before = dict(layer._graphs.stats)
    with torch.cuda.graph(graph):
        out = layer(static)
    assert layer._graphs.stats == before  # (no graph of the layer's own captured or replayed)
    for _ in range(2):
        x2 = torch.randn_like(x)
        static.copy_(x2)
        graph.replay()
        torch.testing.assert_close(out, layer(x2), rtol=0, atol=0)
    assert torch.equal(want, layer(x))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@torch.no_grad()
def test_calls_on_the_same_tensors_replay_a_pointer_graph_with_the_direct_bits(fmt, monkeypatch):
    """A caller's buffer given new values every call, its results dropped (decode steps): replayed
    from a pointer graph, bits of the direct call; a result kept stays as it was."""
    layer = _layer(fmt)
    xs = [torch.randn(1, 512, device="cuda", dtype=torch.bfloat16) for _ in range(12)]
    wants = [_direct(layer, given, monkeypatch=monkeypatch) for given in xs]
    x = torch.empty_like(xs[0])
    for step in range(8):
        x.copy_(xs[step])
        assert torch.equal(layer(x), wants[step]), step
    stats = layer._graphs.stats
    assert stats["captures"] == 1 and stats["pointer_captures"] >= 1 and stats["pointer_replays"] >= 3, stats
    x.copy_(xs[8])
    kept = layer(x)
    for step in (9, 10, 11):  # (the output's address moves: a miss, and perhaps another pointer graph)
        x.copy_(xs[step])
        assert torch.equal(layer(x), wants[step]), step
    assert torch.equal(kept, wants[8])
    assert torch.equal(layer(xs[0]), wants[0])  # (another address)


@pytest.mark.gpu
@torch.no_grad()
def test_inputs_cycling_through_more_addresses_than_pointer_graphs_stop_their_captures(monkeypatch):
    layer = _layer("bf16")
    xs = [torch.randn(1, 512, device="cuda", dtype=torch.bfloat16) for _ in range(graphed.MAX_POINTER_GRAPHS + 2)]
    wants = [_direct(layer, x, monkeypatch=monkeypatch) for x in xs]
    for _ in range(4):
        for x, want in zip(xs, wants):
            assert torch.equal(layer(x), want)
    stats = layer._graphs.stats
    assert stats["pointer_captures"] <= graphed.MAX_POINTER_GRAPHS and stats["pointer_replays"] == 0, stats
    assert layer._graphs.no_pointers and not layer._graphs.pointer_graphs


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
    calls = graphed.GraphedCalls(max_graphs=3, max_pointer_graphs=2)
    calls.graphs["key"] = object()  # (a stand-in: a CUDAGraph can be neither copied nor pickled)
    calls.pointer_graphs["pointer key"] = object()
    calls.no_pointers.add("key")
    for twin in (copy.deepcopy(calls), pickle.loads(pickle.dumps(calls))):
        assert twin.max_graphs == 3 and not twin.graphs and not twin.seen
        assert twin.max_pointer_graphs == 2 and not twin.pointer_graphs and not twin.no_pointers


# CPU stand-ins for the graphs and the allocator, to test GraphedCalls' keying (CUDA graphs
# cannot run on a CPU). The stand-in graphs run fn at each replay where the real ones replay
# its launches, and read and write the same places.

class _Memory:
    """The caching allocator's reuse: a fresh output takes the first slot whose last tenant is
    gone, so a dropped result's address comes back and a kept one's does not."""

    def __init__(self, slots=16, numel=64):
        self.memory = torch.zeros(slots, numel)
        self.tenants = [lambda: None] * slots

    def __call__(self, like):
        slot = next(i for i, tenant in enumerate(self.tenants) if tenant() is None)
        fresh = self.memory[slot, :like.numel()].view(like.shape)
        self.tenants[slot] = weakref.ref(fresh)
        return fresh


def _alias(t):
    """Another tensor at t's address (a graph holds addresses, not the caller's tensors)."""
    return t.as_strided(t.shape, t.stride())


class _FakeGraph:
    def __init__(self, fn, inputs):
        self.fn, self.inputs = fn, [t.clone() for t in inputs]
        self.output = fn(*self.inputs)

    def __call__(self, inputs, out):
        for static, given in zip(self.inputs, inputs):
            static.copy_(given)
        return out.copy_(self.fn(*self.inputs))


class _FakePointerGraph:
    def __init__(self, fn, inputs, out, pool):
        assert pool == "pool"
        self.fn, self.inputs, self.out = fn, [_alias(t) for t in inputs], _alias(out)

    def __call__(self):
        self.out.copy_(self.fn(*self.inputs))


def _scaled(x, scale):
    return x * scale


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(graphed, "_Graph", _FakeGraph)
    monkeypatch.setattr(graphed, "_PointerGraph", _FakePointerGraph)
    monkeypatch.setattr(graphed, "_fresh_output", _Memory())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")


def _call(calls, x, scale):
    """One call at x's address with new values there; the result checked and dropped."""
    x.copy_(torch.randn_like(x))
    assert torch.equal(calls("key", _scaled, x, scale), x * scale)


def test_a_pointer_graph_is_captured_at_the_second_call_at_the_same_addresses_and_replayed(fake_graphs):
    calls = graphed.GraphedCalls()
    x, scale = torch.randn(4, 8), torch.randn(8)
    for _ in range(8):
        _call(calls, x, scale)
    # eager; the shape's capture and its copying replay; the pointer capture; pointer replays
    assert calls.stats == {"eager": 1, "captures": 1, "replays": 1, "pointer_captures": 1, "pointer_replays": 5}
    assert len(calls.pointer_graphs) == 1
    other = torch.randn(4, 8)  # (the same shape at another address: the shape's copying graph)
    _call(calls, other, scale)
    assert calls.stats["replays"] == 2 and calls.stats["pointer_replays"] == 5
    _call(calls, x, scale)
    assert calls.stats["pointer_replays"] == 6


def test_results_kept_by_the_caller_are_fresh_and_never_overwritten(fake_graphs):
    calls = graphed.GraphedCalls()
    x, scale = torch.randn(4, 8), torch.randn(8)
    for _ in range(4):
        _call(calls, x, scale)
    assert calls.stats["pointer_replays"] == 1
    kept, want = calls("key", _scaled, x, scale), x * scale  # (from the pointer graph)
    assert calls.stats["pointer_replays"] == 2
    results = []
    for _ in range(6):
        x.copy_(torch.randn_like(x))
        results.append((calls("key", _scaled, x, scale), x * scale))
    assert torch.equal(kept, want)
    assert all(torch.equal(got, expected) for got, expected in results)
    assert len({got.data_ptr() for got, _ in results} | {kept.data_ptr()}) == 7
    assert calls.stats["pointer_replays"] == 2  # (kept results: the output's address is new every call)


def test_pointer_graphs_are_few_and_the_least_recently_used_is_freed(fake_graphs):
    calls = graphed.GraphedCalls(max_pointer_graphs=2)
    scale = torch.randn(8)
    buffers = [torch.randn(4, 8) for _ in range(3)]
    for x in buffers:  # (addresses that move now and then, each pointer graph replayed often)
        for _ in range(40):
            _call(calls, x, scale)
    assert calls.stats["pointer_captures"] == 3 and calls.stats["pointer_replays"] == 37 + 38 + 38
    assert [key[1] for key in calls.pointer_graphs] == [buffers[1].data_ptr(), buffers[2].data_ptr()]


def test_addresses_cycling_beyond_the_pointer_graphs_stop_their_captures(fake_graphs):
    calls = graphed.GraphedCalls(max_pointer_graphs=4)
    scale = torch.randn(8)
    buffers = [torch.randn(4, 8) for _ in range(6)]
    for _ in range(20):
        for x in buffers:
            _call(calls, x, scale)
    assert calls.stats["pointer_captures"] == 4 and calls.stats["pointer_replays"] == 0
    assert calls.stats["replays"] == 20 * 6 - 1 - 4 and not calls.pointer_graphs and calls.no_pointers


def test_a_failed_pointer_capture_leaves_its_shape_to_the_copying_graph(fake_graphs, monkeypatch):
    attempts = []

    def refused(*args):
        attempts.append(args)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed, "_PointerGraph", refused)
    calls = graphed.GraphedCalls()
    x, scale = torch.randn(4, 8), torch.randn(8)
    for _ in range(8):
        _call(calls, x, scale)
    assert len(attempts) == 1 and calls.stats["replays"] == 7 and not calls.eager  # (all but the eager first call)


def test_clear_drops_the_pointer_graphs(fake_graphs):
    calls = graphed.GraphedCalls()
    x, scale = torch.randn(4, 8), torch.randn(8)
    for _ in range(4):
        _call(calls, x, scale)
    calls.clear()
    assert not calls.pointer_graphs and not calls.pointers_seen and not calls.pointer_counts and not calls.stats
    _call(calls, x, scale)
    assert calls.stats == {"eager": 1}


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
@torch.no_grad()
def test_experts_calls_on_the_same_tensors_replay_a_pointer_graph_with_the_direct_bits(monkeypatch):
    moegemm.hf.register()
    module, top_k, experts = _experts("qwen3")
    steps = [_routing(1, top_k, experts, 2048) for _ in range(8)]
    wants = [_direct(module, *inputs, monkeypatch=monkeypatch) for inputs in steps]
    buffers = [torch.empty_like(t) for t in steps[0]]
    for step, (inputs, want) in enumerate(zip(steps, wants)):
        for buffer, given in zip(buffers, inputs):
            buffer.copy_(given)
        assert torch.equal(module(*buffers), want), step
    stats = module._moegemm_experts.graphs.stats
    assert stats["pointer_captures"] >= 1 and stats["pointer_replays"] >= 3, stats


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
