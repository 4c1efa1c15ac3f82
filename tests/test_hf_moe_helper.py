"""tests/hf_moe.py against transformers itself: the extracted layouts and the pure-torch reference_moe reproduce
Qwen3MoeSparseMoeBlock, GptOssMLP and DeepseekV3MoE. Skipped where transformers is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_moe

H = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: with a second busy process on a 2-core machine, torch's intra-op threads spin and waiting on them
    turned a 3 s module into 30 s. One thread for this module, restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

CASES = [
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": False, "num_experts": 16, "top_k": 4}),
    ("gpt_oss", {}),
    ("gpt_oss", {"swiglu_limit": 0.5, "top_k": 4}),  # a limit small enough that both clamps bite
    ("deepseek_v3", {}),  # 16 experts, 4 groups, 2 kept, top-4, 1 shared expert, scale 2.5
    ("deepseek_v3", {"norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_shared_experts": 2,
                     "num_experts": 32, "n_group": 8, "topk_group": 3, "top_k": 6}),
]
IDS = ["qwen3-renorm", "qwen3-norenorm-k4", "gptoss", "gptoss-clamped-k4", "dsv3", "dsv3-norenorm-k6-2shared"]


def _x(dtype, b=3, s=37):
    return torch.randn(b, s, H).to(dtype)


def _router_out(block, x):
    """(weights [T, k], ids [T, k]) as the block's own router computes them."""
    router = block.router if hf_moe.block_kind(block) == "gpt_oss" else block.gate
    with torch.no_grad():
        _, w, ids = router(x.reshape(-1, H))
    return w, ids


def _sorted_by_id(w, ids):
    ids_s, order = ids.sort(dim=-1)
    return w.gather(1, order), ids_s


@pytest.mark.parametrize("kind,kw", CASES, ids=IDS)
def test_extracted_layouts(kind, kw):
    block = hf_moe.build_block(kind, **kw)
    p = hf_moe.extract_params(block)
    e, i = p.num_experts, p.intermediate_size
    assert p.kind == kind and p.hidden_size == H
    assert p.router_weight.shape == (e, H)
    assert p.gate.shape == p.up.shape == (e, i, H) and p.down.shape == (e, H, i)
    assert p.router_kind == {"qwen3_moe": "softmax_topk", "gpt_oss": "topk_softmax",
                             "deepseek_v3": "sigmoid_grouped"}[kind]
    ex = block.experts
    if kind == "gpt_oss":
        assert p.gate_bias.shape == p.up_bias.shape == (e, i) and p.down_bias.shape == (e, H)
        assert p.router_bias.shape == (e,)
        # rebuild the interleaved [E, H, 2I] tensor from the extracted [E, I, H] pair
        rebuilt = torch.stack([p.gate.transpose(1, 2), p.up.transpose(1, 2)], dim=-1).reshape(e, H, 2 * i)
        assert torch.equal(rebuilt, ex.gate_up_proj)
        assert torch.equal(torch.stack([p.gate_bias, p.up_bias], -1).reshape(e, 2 * i), ex.gate_up_proj_bias)
        assert torch.equal(p.down.transpose(1, 2), ex.down_proj)
        assert p.activation == "swiglu_oai" and p.swiglu_alpha == 1.702
    else:
        assert p.gate_bias is None and p.up_bias is None and p.down_bias is None and p.router_bias is None
        assert torch.equal(torch.cat([p.gate, p.up], dim=1), ex.gate_up_proj)
        assert torch.equal(p.down, ex.down_proj)
        assert p.activation == "swiglu"
    if kind == "deepseek_v3":
        i_s = i * kw.get("n_shared_experts", 1)
        assert p.shared_gate.shape == p.shared_up.shape == (i_s, H) and p.shared_down.shape == (H, i_s)
        assert p.e_score_correction_bias.shape == (e,) and p.e_score_correction_bias.abs().sum() > 0
        assert p.routed_scaling_factor == kw.get("routed_scaling_factor", 2.5) and e % p.n_group == 0
    else:
        assert p.shared_gate is None and p.e_score_correction_bias is None
    # the extracted tensors are copies, not views of the block's parameters
    p.router_weight.zero_()
    assert hf_moe.extract_params(block).router_weight.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,kw", CASES, ids=IDS)
def test_route_matches_block_router(kind, kw, dtype):
    """Same experts chosen, same weights. In bf16 too: route() repeats transformers' ops in its dtypes
    (Qwen3 logits bf16 then fp32 softmax; gpt-oss all bf16; DeepSeek-V3 all fp32), so even near-ties agree."""
    block = hf_moe.build_block(kind, dtype=dtype, **kw)
    p = hf_moe.extract_params(block)
    x = _x(dtype)
    w_ref, ids_ref = _sorted_by_id(*hf_moe.route(x, p))
    w_hf, ids_hf = _sorted_by_id(*_router_out(block, x))
    assert torch.equal(ids_ref, ids_hf)
    assert w_ref.dtype == w_hf.dtype
    torch.testing.assert_close(w_ref, w_hf, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind,kw", CASES, ids=IDS)
def test_reference_matches_block_fp32(kind, kw):
    block = hf_moe.build_block(kind, **kw)
    p = hf_moe.extract_params(block)
    x = _x(torch.float32)
    y = hf_moe.run_block(block, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert 0.03 < y.std() < 1.0  # outputs of a sensible scale
    torch.testing.assert_close(hf_moe.reference_moe(x, p), y, atol=1e-5, rtol=0)
    torch.testing.assert_close(hf_moe.reference_moe(x, p, compute_dtype=torch.float32), y, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,kw", CASES, ids=IDS)
def test_reference_matches_block_bf16(kind, kw):
    """bf16 weights and input. Routing is identical (test above), every matmul and activation is the same op in the
    same dtype, so the one difference is the combine: transformers' eager path index_add_s the k weighted expert
    rows into a bf16 buffer (k-1 roundings of the running sum), the reference sums them in fp32 and rounds once.
    That is at most about k/2 bf16 ulps of the largest partial sum, and one ulp is <= 2**-7 of a value: tolerance
    atol = k * 2**-7 * max|y| (partial sums taken as at most twice the largest output), rtol 0. Seen: 0 for k=2
    (two terms round once either way), 1 ulp for DeepSeek-V3's k=4."""
    block = hf_moe.build_block(kind, dtype=torch.bfloat16, **kw)
    p = hf_moe.extract_params(block)
    x = _x(torch.bfloat16)
    y = hf_moe.run_block(block, x)
    assert y.dtype == torch.bfloat16
    ref = hf_moe.reference_moe(x, p)
    assert ref.dtype == torch.bfloat16
    atol = p.top_k * 2**-7 * y.float().abs().max().item()
    torch.testing.assert_close(ref.float(), y.float(), atol=atol, rtol=0)
    # fp32 experts on the same bf16 weights: what an fp32-accumulating kernel should land near
    ref32 = hf_moe.reference_moe(x, p, compute_dtype=torch.float32)
    torch.testing.assert_close(ref32.float(), y.float(), atol=2 * atol, rtol=0)


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("kind", hf_moe.KINDS)
def test_reference_matches_other_experts_implementations(kind, impl):
    """from_pretrained picks experts_implementation="grouped_mm" by default (standalone blocks built here use
    "eager"); the layouts read the same through all three."""
    block = hf_moe.build_block(kind, experts_implementation=impl)
    x = _x(torch.float32)
    torch.testing.assert_close(hf_moe.reference_moe(x, hf_moe.extract_params(block)), hf_moe.run_block(block, x),
                               atol=1e-5, rtol=0)


def test_gpt_oss_clamps_are_exercised():
    block = hf_moe.build_block("gpt_oss", swiglu_limit=0.5)
    p = hf_moe.extract_params(block)
    x = _x(torch.float32).reshape(-1, H)
    g = torch.einsum("th,eih->tei", x, p.gate) + p.gate_bias
    u = torch.einsum("th,eih->tei", x, p.up) + p.up_bias
    assert (g > 0.5).float().mean() > 0.05
    assert (u > 0.5).float().mean() > 0.05 and (u < -0.5).float().mean() > 0.05
    # and clamping changes the answer (so the parity above is not vacuous)
    p.swiglu_limit = 100.0
    assert (hf_moe.reference_moe(x, p) - hf_moe.run_block(block, x[None])[0]).abs().max() > 1e-2


def test_deepseek_correction_bias_and_groups_are_exercised():
    block = hf_moe.build_block("deepseek_v3")
    p = hf_moe.extract_params(block)
    x = _x(torch.float32)
    _, ids = hf_moe.route(x, p)
    # the chosen experts lie in at most topk_group groups
    groups = ids // (p.num_experts // p.n_group)
    assert all(len(set(row.tolist())) <= p.topk_group for row in groups)
    # the correction bias and the group limit each change some token's choice
    no_bias = hf_moe.MoEParams(**{**p.__dict__, "e_score_correction_bias": None})
    assert not torch.equal(hf_moe.route(x, no_bias)[1].sort(-1)[0], ids.sort(-1)[0])
    no_groups = hf_moe.MoEParams(**{**p.__dict__, "topk_group": p.n_group})
    assert not torch.equal(hf_moe.route(x, no_groups)[1].sort(-1)[0], ids.sort(-1)[0])
    # the weights are the uncorrected sigmoids, renormalised then scaled: each row sums to routed_scaling_factor
    w, _ = hf_moe.route(x, p)
    torch.testing.assert_close(w.sum(-1), torch.full((w.shape[0],), p.routed_scaling_factor))
