"""Routing: top-k choices -> grouped layout -> combine, against naive loops."""

import dataclasses

import pytest
import torch

import moegemm
from moegemm import plan as plan_module
from moegemm import routing
from moegemm.kernels import routing_kernels
from moegemm.kernels import tl_source


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


# --- Triton routing kernels (kernels/_routing_tl.py) against the PyTorch reference ------------
needs_interpreter = pytest.mark.skipif(not tl_source.interpreter_usable(),
                                       reason="Triton's CPU interpreter needs numpy < 2.4")

PLAN_FIELDS = ("token_index", "grouped_row", "valid", "a_offsets", "expert_ids", "a_scale_offsets", "expert_of_row")

# (T, k, E, dropped fraction): T = 0 and 1, E = 0, 1 and past 256 (1024 histogram bins), k = 8
ROUTE_CASES = [(0, 4, 8, 0.0), (3, 0, 8, 0.0), (1, 1, 1, 0.0), (1, 8, 16, 0.3), (7, 2, 0, 0.0), (9, 3, 1, 0.2),
               (37, 4, 9, 0.1), (40, 8, 300, 0.1), (25, 6, 512, 0.2)]


def messy_topk(t, k, e, drop, dtype=torch.int32, device="cpu"):
    """Router-like ids (distinct per token when k <= E) plus repeats, dropped ones (-1, -7, E, E+5)."""
    if k <= e:
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    else:
        ids = torch.randint(0, max(e, 1), (t, k))
    bad = torch.tensor([-1, -7, e, e + 5])[torch.randint(0, 4, (t, k))]
    ids = torch.where(torch.rand(t, k) < drop, bad, ids)
    if e == 0:
        ids = bad
    return ids.to(dtype).to(device), torch.rand(t, k, device=device)


def assert_same_plan(got, want):
    for name in PLAN_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), name
    assert got.topk_weights is want.topk_weights


def check_route(t, k, e, drop, device, dtype=torch.int32, **tiling):
    ids, weights = messy_topk(t, k, e, drop, dtype, device)
    want = routing.route_reference(ids, e, weights)
    assert_same_plan(routing.route(ids, e, weights, backend="triton"), want)
    if tiling:  # many programs, many SUB-chunks per program
        assert_same_plan(routing.RoutingPlan(topk_weights=weights, **routing_kernels.route(ids, e, **tiling)), want)


@needs_interpreter
@pytest.mark.parametrize("t,k,e,drop", ROUTE_CASES)
def test_triton_route_matches_reference_bitwise(t, k, e, drop):
    check_route(t, k, e, drop, "cpu", block=32, sub=8)


@needs_interpreter
def test_triton_route_plans_each_shape_of_one_choice_count():
    """The routing launches are planned once per (choices, experts, k, tiling) (routing_kernels'
    cache): 24 choices as 6 x 4 and as 12 x 2, over 8 then 5 experts, each get the reference's
    plan, as does a shape seen before; a tiling that is no power of two raises at every call."""
    for t, k, e in ((6, 4, 8), (12, 2, 8), (6, 4, 5), (6, 4, 8)):
        check_route(t, k, e, 0.2, "cpu")
    ids, _ = messy_topk(6, 4, 8, 0.0)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^block, sub: expected powers of two with sub <= block, got 48, 8"):
            routing_kernels.route(ids, 8, block=48, sub=8)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8])
def test_triton_route_id_dtypes(dtype):
    check_route(23, 3, 6, 0.3 if dtype != torch.uint8 else 0.0, "cpu", dtype)


def test_route_reference_fills_expert_of_row():
    ids, _ = messy_topk(30, 4, 7, 0.2)
    plan = routing.route_reference(ids, 7)
    key = torch.where(plan.valid, ids.long(), 7).reshape(-1)
    assert torch.equal(plan.expert_of_row.long(), key[torch.argsort(plan.grouped_row.reshape(-1))])
    assert_same_plan(moegemm.route(ids, 7), plan)  # auto on the CPU is the reference


def reference_combine(y, plan, weights, bias):
    """out[t] = sum_j w[t, j] * (y[row] + bias[e]) over valid choices, in float64."""
    rows = y.double()[plan.grouped_row]
    if bias is not None:
        experts = torch.where(plan.valid, plan.expert_of_row.long()[plan.grouped_row], 0)
        rows = rows + bias.double()[experts]
    if weights is not None:
        rows = rows * weights.double().unsqueeze(-1)
    return torch.where(plan.valid.unsqueeze(-1), rows, 0).sum(1)


def check_combine(device, t, k, e, n, with_weights, with_bias, y_dtype, out_dtype, plan_without_experts=False):
    ids, weights = messy_topk(t, k, e, 0.25, device=device)
    weights[~((ids >= 0) & (ids < e))] = float("nan")  # a dropped choice's weight is never used either
    plan = routing.route(ids, e, weights if with_weights else None, backend="triton")
    if plan_without_experts:  # a plan built by hand: experts come from a_offsets
        plan = dataclasses.replace(plan, expert_of_row=None)
    y = torch.randn(t * k, n, device=device).to(y_dtype)
    y[plan.a_offsets[-1]:] = float("nan")  # rows of dropped choices hold garbage
    bias = torch.randn(e, n, device=device).to(y_dtype) if with_bias else None
    got = routing.unpermute_tokens(y, plan, out_dtype=out_dtype, expert_bias=bias, backend="triton")
    want = routing.unpermute_tokens_reference(y, plan, out_dtype=out_dtype, expert_bias=bias)
    assert got.dtype == want.dtype == (out_dtype or y_dtype) and got.shape == (t, n)
    assert not got.isnan().any()
    tol = 1e-6 if got.dtype == torch.float32 else 8e-3
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    exact = reference_combine(y, routing.route_reference(ids, e), plan.topk_weights, bias)
    assert torch.allclose(got.double(), exact, rtol=tol, atol=1e-5 if tol == 1e-6 else tol)


@needs_interpreter
@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_unpermute_matches_reference(with_weights, with_bias):
    check_combine("cpu", 21, 3, 5, 40, with_weights, with_bias, torch.float32, None)


@needs_interpreter
@pytest.mark.parametrize("y_dtype,out_dtype,without_experts", [(torch.bfloat16, None, False),
                                                               (torch.bfloat16, torch.float32, True),
                                                               (torch.float32, torch.bfloat16, True)])
def test_triton_unpermute_dtypes(y_dtype, out_dtype, without_experts):
    check_combine("cpu", 9, 4, 6, 24, True, True, y_dtype, out_dtype, without_experts)


@needs_interpreter
def test_triton_unpermute_edges():
    plan = routing.route(torch.zeros(0, 2, dtype=torch.int32), 4, backend="triton")
    assert routing.unpermute_tokens(torch.zeros(0, 8), plan, backend="triton").shape == (0, 8)
    plan = routing.route(torch.full((3, 2), -1, dtype=torch.int32), 4, backend="triton")
    y = torch.full((6, 8), float("nan"))
    out = routing.unpermute_tokens(y, plan, expert_bias=torch.ones(4, 8), backend="triton")
    assert torch.equal(out, torch.zeros(3, 8))  # every choice dropped: nothing, not NaN
    plan = routing.route(torch.zeros(3, 0, dtype=torch.int32), 4, backend="triton")
    assert torch.equal(routing.unpermute_tokens(torch.zeros(0, 8), plan, backend="triton"), torch.zeros(3, 8))


def test_routing_backend_and_bias_bad_input():
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^backend"):
        moegemm.route(ids, 4, backend="cuda")
    plan = moegemm.route(ids, 4)
    y = torch.ones(8, 6)
    with pytest.raises(ValueError, match="^backend"):
        moegemm.unpermute_tokens(y, plan, backend="reference")
    with pytest.raises(ValueError, match="^expert_bias"):
        moegemm.unpermute_tokens(y, plan, expert_bias=torch.ones(3, 6))
    with pytest.raises(TypeError, match="^expert_bias"):
        moegemm.unpermute_tokens(y, plan, expert_bias=torch.ones(4, 6, dtype=torch.int32))
    with pytest.raises(TypeError, match="^out_dtype"):
        moegemm.unpermute_tokens(y, plan, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="^topk_weights"):
        moegemm.unpermute_tokens(y, plan, torch.ones(4, 3))


@pytest.mark.parametrize("call", ["route", "unpermute_tokens", "grouped_matmul"])
def test_triton_on_the_cpu_without_the_interpreter_names_the_cpu_extra(monkeypatch, call):
    """Where numpy is too new for Triton's CPU interpreter, asking for the Triton kernels on CPU
    tensors fails naming the fix: moegemm's cpu extra, which pins numpy < 2.4."""
    monkeypatch.setattr(tl_source, "interpreter_usable", lambda: False)
    monkeypatch.setattr(plan_module, "interpreter_usable", lambda: False)  # (plan.py's name for it)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^backend: 'triton' cannot run tensors on cpu") as caught:
        if call == "route":
            moegemm.route(ids, 4, backend="triton")
        elif call == "unpermute_tokens":
            moegemm.unpermute_tokens(torch.ones(8, 6), moegemm.route(ids, 4), backend="triton")
        else:
            moegemm.grouped_matmul(torch.ones(4, 32, dtype=torch.bfloat16), torch.ones(2, 16, 32, dtype=torch.bfloat16),
                                   None, None, torch.tensor([0, 2, 4], dtype=torch.int32),
                                   torch.tensor([0, 1], dtype=torch.int32), fmt="bf16", backend="triton")
    assert str(caught.value).endswith(' (Triton\'s CPU interpreter needs numpy < 2.4: pip install "moegemm[cpu]")')
    assert tl_source.interpreter_note("cuda") == ""


def check_scatter_tokens(device, t, k, e, drop, dtype, cols):
    """scatter_tokens (Triton) against the PyTorch form and against permute_tokens: the valid
    choices' rows bit for bit, the dropped choices' rows left as they were (poisoned here)."""
    ids, _ = messy_topk(t, k, e, drop, device=device)
    plan = routing.route(ids, e, backend="torch")
    x = torch.randn(t, cols + 3, device=device).to(dtype)[:, :cols]  # strided rows
    got = routing.scatter_tokens(x, plan)
    want = routing.scatter_tokens(x, plan, backend="torch")
    rows = plan.grouped_row[plan.valid]
    bits = lambda v: v.view(torch.uint8)  # noqa: E731  (NaN-safe, float8-safe comparison)
    assert torch.equal(bits(got[rows]), bits(want[rows]))
    assert torch.equal(bits(got[rows]), bits(routing.permute_tokens(x.contiguous(), plan)[rows]))
    assert got.shape == (t * k, cols) and got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.float32])
def test_scatter_tokens_writes_the_valid_choices(dtype):
    check_scatter_tokens("cpu", 37, 3, 5, 0.3, dtype, 70)
    check_scatter_tokens("cpu", 0, 3, 5, 0.3, dtype, 70)


def test_sum_rows_matches_torch():
    y = torch.randn(50, 33)
    y[7] = float("nan")  # read by no valid entry
    rows = torch.randint(0, 50, (20, 3))
    valid = torch.rand(20, 3) < 0.7
    valid[rows == 7] = False
    got = routing.sum_rows(y, rows, valid, torch.bfloat16)
    want = routing.sum_rows(y, rows, valid, torch.bfloat16, backend="torch")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="rows, valid"):
        routing.sum_rows(y, rows, valid[:, :2])


ROUTING_SIGNATURES = {
    "routing_histogram_kernel": {"ids_ptr": "*i32", "counts_ptr": "*i32", "n": "i32", "E": "i32"},
    "routing_offsets_kernel": {"counts_ptr": "*i32", "base_ptr": "*i32", "a_offsets_ptr": "*i32",
                               "a_scale_offsets_ptr": "*i32", "expert_ids_ptr": "*i32", "num_blocks": "i32",
                               "E": "i32"},
    "routing_scatter_kernel": {"ids_ptr": "*i64", "base_ptr": "*i32", "grouped_row_ptr": "*i64",
                               "token_index_ptr": "*i64", "expert_of_row_ptr": "*i32", "valid_ptr": "*u8",
                               "n": "i32", "E": "i32", "k": "i32"},
    "routing_combine_kernel": {"y_ptr": "*bf16", "grouped_row_ptr": "*i64", "valid_ptr": "*u8", "weights_ptr": "*fp32",
                               "expert_of_row_ptr": "*i32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                               **{name: "i32" for name in ("T", "N", "stride_ym", "stride_yn", "stride_be",
                                                           "stride_bn")}},
    "routing_scatter_rows_kernel": {"src_ptr": "*i64", "grouped_row_ptr": "*i64", "valid_ptr": "*u8", "out_ptr": "*i64",
                                    **{name: "i32" for name in ("T", "C", "stride_src", "stride_out")}},
}


@pytest.mark.parametrize("name,experts", [(name, e) for name in ROUTING_SIGNATURES for e in (8, 512)
                                          if e == 8 or name not in ("routing_combine_kernel",
                                                                    "routing_scatter_rows_kernel")])
def test_routing_kernels_compile_for_sm90(name, experts):
    from moegemm.kernels import offline

    bins = routing_kernels.num_bins(experts)
    block, sub = routing_kernels.tiling(65536 * 8, experts)
    constexprs, warps = {
        "routing_histogram_kernel": ({"NUM_BINS": bins, "BLOCK": block}, 4),
        "routing_offsets_kernel": ({"NUM_BINS": bins, "CHUNK": routing_kernels.offsets_chunk(bins)}, 8),
        "routing_scatter_kernel": ({"NUM_BINS": bins, "BLOCK": block, "SUB": sub}, 4),
        "routing_combine_kernel": ({"K": 8, "HAS_WEIGHTS": True, "HAS_BIAS": True, "BLOCK_T": 32, "BLOCK_N": 128},
                                   routing_kernels.COMBINE_WARPS),
        "routing_scatter_rows_kernel": ({"K": 8, "BLOCK_T": routing_kernels.SCATTER_ROWS_BLOCK[0],
                                         "BLOCK_C": routing_kernels.SCATTER_ROWS_BLOCK[1] // 8}, 4),
    }[name]
    kernel = getattr(routing_kernels.kernel_module(False), name)
    compiled = offline.compile_for_sm90(kernel, ROUTING_SIGNATURES[name], constexprs, {"num_warps": warps})
    ops = offline.opcode_counts(offline.sass(compiled))
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,drop", [*ROUTE_CASES, (4096, 8, 256, 0.1), (3000, 4, 64, 0.5), (20000, 2, 512, 0.0)])
def test_triton_route_matches_reference_bitwise_gpu(t, k, e, drop):
    check_route(t, k, e, drop, "cuda", block=64, sub=32)
    ids, weights = messy_topk(t, k, e, drop, device="cuda")
    assert_same_plan(moegemm.route(ids, e, weights), routing.route_reference(ids, e, weights))  # auto: Triton


@pytest.mark.gpu
@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("y_dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float32)])
def test_triton_unpermute_matches_reference_gpu(with_weights, with_bias, y_dtype, out_dtype):
    check_combine("cuda", 1000, 8, 32, 200, with_weights, with_bias, y_dtype, out_dtype)
    check_combine("cuda", 5, 2, 3, 7, with_weights, with_bias, y_dtype, out_dtype, plan_without_experts=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_scatter_tokens_writes_the_valid_choices_gpu(dtype):
    check_scatter_tokens("cuda", 3000, 8, 64, 0.4, dtype, 7168)
    check_scatter_tokens("cuda", 5, 2, 3, 0.5, dtype, 90)
