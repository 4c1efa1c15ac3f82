"""Routing: top-k choices -> grouped layout -> combine, against naive loops."""

import pytest
import torch

import moegemm


def random_topk(t, k, e, drop=0.0):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[torch.rand(t, k) < drop] = -1
    return ids.to(torch.int32), torch.rand(t, k)


def test_route_groups_by_expert_stably():
    t, k, e = 37, 4, 9
    ids, weights = random_topk(t, k, e, drop=0.1)
    ids[0, 0] = e + 3  # an id past E is dropped too
    plan = moegemm.route(ids, e, weights)
    counts = [int(((ids == x)).sum()) for x in range(e)]
    assert plan.a_offsets.dtype == torch.int32 and plan.a_offsets.tolist() == [0] + torch.tensor(counts).cumsum(0).tolist()
    assert plan.expert_ids.tolist() == list(range(e))
    offsets = plan.a_offsets.tolist()
    for x in range(e):
        rows = plan.token_index[offsets[x]:offsets[x + 1]].tolist()
        assert rows == sorted(int(r) for r in torch.nonzero((ids == x).any(1)).flatten())
    for ti in range(t):
        for j in range(k):
            valid = 0 <= int(ids[ti, j]) < e
            assert bool(plan.valid[ti, j]) == valid
            if valid:
                row = int(plan.grouped_row[ti, j])
                assert int(plan.token_index[row]) == ti and offsets[int(ids[ti, j])] <= row < offsets[int(ids[ti, j]) + 1]
    assert torch.equal(plan.a_scale_offsets, moegemm.layouts.a_scale_offsets(plan.a_offsets))
    assert plan.scale_blocks_bound >= moegemm.layouts.num_a_scale_blocks(plan.a_offsets)


def test_permute_unpermute_round_trip():
    t, k, e, h = 50, 3, 6, 16
    ids, weights = random_topk(t, k, e, drop=0.2)
    plan = moegemm.route(ids, e, weights)
    x = torch.randn(t, h)
    grouped = moegemm.permute_tokens(x, plan)
    grouped[plan.a_offsets[-1]:] = float("nan")  # rows of dropped choices hold garbage
    y = moegemm.unpermute_tokens(grouped, plan)
    want = x * (weights * plan.valid).sum(1, keepdim=True)
    assert torch.allclose(y, want, rtol=1e-6, atol=1e-6)


def test_moe_layer_through_routing_matches_naive_loop():
    t, k, e, h, n = 40, 2, 5, 64, 24
    ids, weights = random_topk(t, k, e)
    x = torch.randn(t, h).bfloat16().float()
    w = torch.randn(e, n, h).bfloat16().float()
    plan = moegemm.route(ids, e, weights)
    qa = moegemm.quantize(moegemm.permute_tokens(x, plan), "bf16")
    qw = moegemm.quantize_weights(w, "bf16")
    c = moegemm.grouped_matmul(qa.data, qw.data, None, None, plan.a_offsets, plan.expert_ids, fmt="bf16",
                               out_dtype=torch.float32)
    y = moegemm.unpermute_tokens(c, plan)
    want = torch.zeros(t, n)
    for ti in range(t):
        for j in range(k):
            want[ti] += weights[ti, j] * (x[ti] @ w[int(ids[ti, j])].T)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4)


def test_routing_bad_input():
    with pytest.raises(ValueError, match="^topk_ids"):
        moegemm.route(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="^topk_ids"):
        moegemm.route(torch.zeros(4, 2), 4)
    with pytest.raises(ValueError, match="^num_experts"):
        moegemm.route(torch.zeros(4, 2, dtype=torch.int32), -1)
    with pytest.raises(ValueError, match="^topk_weights"):
        moegemm.route(torch.zeros(4, 2, dtype=torch.int32), 4, torch.ones(4, 3))
    plan = moegemm.route(torch.zeros(4, 2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="^x"):
        moegemm.permute_tokens(torch.ones(5, 8), plan)
    with pytest.raises(ValueError, match="^y"):
        moegemm.unpermute_tokens(torch.ones(5, 8), plan)


@pytest.mark.gpu
def test_routing_captures_in_a_cuda_graph():
    # No host synchronization: the whole route -> permute -> unpermute chain captures.
    t, k, e, h = 64, 4, 16, 32
    ids = torch.randint(0, e, (t, k), dtype=torch.int32, device="cuda")
    weights = torch.rand(t, k, device="cuda")
    x = torch.randn(t, h, device="cuda")
    moegemm.unpermute_tokens(moegemm.permute_tokens(x, moegemm.route(ids, e, weights)), moegemm.route(ids, e, weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = moegemm.route(ids, e, weights)
        y = moegemm.unpermute_tokens(moegemm.permute_tokens(x, plan), plan)
    ids.copy_(torch.randint(0, e, (t, k), dtype=torch.int32, device="cuda"))
    x.copy_(torch.randn(t, h, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, x * weights.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
