"""The MoE layer's kernels under `compute-sanitizer --tool memcheck`: the fused SwiGLU epilogue
(swapped and normal tiles, every output format, ragged and skipped groups, bias), the routing
and activation kernels, and moe_forward with dropped choices. Also checks the results."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moegemm  # noqa: E402
from moegemm import activation as act  # noqa: E402

torch.manual_seed(0)
device = "cuda"
# (weight format, fused output format, tokens per slot, expert ids)
CASES = [
    ("bf16", "mxfp8", [65, 127, 3], [0, 1, 2]),  # normal tiles crossing group ends
    ("bf16", "nvfp4", [1, 2, 5, 9], [0, -1, 2, 3]),  # swapped tiles, a skipped slot
    ("mxfp8", "bf16", [0, 3, 1, 2], [-1, 2, -1, 0]),
    ("mxfp4", "mxfp4", [300, 17], [1, 0]),
    ("nvfp4", "mxfp8", [128, 256, 5], [-1, 0, 2]),
]
n, k = 256, 256
for fmt, out_fmt, counts, ids in CASES:
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    m = int(offsets[-1]) + 5
    layout = "swizzled" if fmt != "bf16" else "plain"
    a = moegemm.quantize(torch.randn(m, k, device=device), fmt, scale_layout=layout, a_offsets=offsets)
    b = moegemm.quantize_weights(torch.randn(4, n, k, device=device) * 0.1, fmt, scale_layout=layout)
    scales = torch.ones(4, device=device) if b.global_scale is None else (b.global_scale * a.global_scale).float()
    expert_ids = torch.tensor(ids, dtype=torch.int32, device=device)
    kw = dict(fmt=fmt, out_fmt=out_fmt, gate_up_layout="interleaved", activation="swiglu_oai", expert_scales=scales,
              bias=torch.randn(4, n, device=device) * 0.1, scale_layout=layout,
              out_global_scale=torch.tensor(0.01, device=device) if out_fmt == "nvfp4" else None)
    fused = moegemm.grouped_matmul_swiglu(a.data, b.data, a.scales, b.scales, offsets, expert_ids, fused=True,
                                          backend="sm90", **kw)
    unfused = moegemm.grouped_matmul_swiglu(a.data, b.data, a.scales, b.scales, offsets, expert_ids, fused=False,
                                            backend="sm90", **kw)
    torch.cuda.synchronize()
    valid = torch.zeros(m, dtype=torch.bool, device=device)
    for g, e in enumerate(ids):
        if e >= 0:
            valid[int(offsets[g]):int(offsets[g + 1])] = True
    got, want = moegemm.dequantize(fused)[valid], moegemm.dequantize(unfused)[valid]
    err = float((got - want).norm() / want.norm()) if valid.any() else 0.0
    print(f"fused {fmt:>6} -> {out_fmt:<6} counts {counts} ids {ids}: rel diff vs unfused {err:.2e}")
    assert err < 0.2, err

h, i, e, top_k, t = 256, 128, 8, 2, 37
layer = moegemm.MoE(h, i, e, top_k, fmt="mxfp8", device=device).load_experts(
    gate=torch.randn(e, i, h, device=device) * 0.1, up=torch.randn(e, i, h, device=device) * 0.1,
    down=torch.randn(e, h, i, device=device) * 0.1)
x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
topk_ids = torch.randint(-1, e + 2, (t, top_k), dtype=torch.int32, device=device)  # some dropped
w_gate_up, w_down = layer.weights()
y = moegemm.moe_forward(x, topk_ids, torch.rand(t, top_k, device=device), w_gate_up, w_down,
                        gate_up_layout=layer.gate_up_layout)
q = act.gather_quantize(x, "nvfp4", torch.randint(0, t, (50,), device=device))
torch.cuda.synchronize()
assert torch.isfinite(y).all()
print("moe_forward with dropped choices and gather_quantize: ok")

# The tokens' scatter form (activation.scatter_quantize: stores to k rows a token, none for a
# dropped choice), in the layer (fp8_block takes it) and alone in both scale layouts.
layer = moegemm.MoE(h, i, e, top_k, fmt="fp8_block", device=device).load_experts(
    gate=torch.randn(e, i, h, device=device) * 0.1, up=torch.randn(e, i, h, device=device) * 0.1,
    down=torch.randn(e, h, i, device=device) * 0.1)
w_gate_up, w_down = layer.weights()
y = moegemm.moe_forward(x, topk_ids, torch.rand(t, top_k, device=device), w_gate_up, w_down,
                        gate_up_layout=layer.gate_up_layout)
plan = moegemm.route(topk_ids, e)
for fmt, layout in (("fp8_block", "plain"), ("bf16", "plain"), ("mxfp8", "swizzled"), ("mxfp4", "swizzled"),
                    ("nvfp4", "swizzled"), ("w4a8", "plain")):
    act.scatter_quantize(x, fmt, plan.grouped_row, moegemm.routing.row_experts(plan), a_offsets=plan.a_offsets,
                         scale_layout=layout, num_scale_blocks=plan.scale_blocks_bound)
torch.cuda.synchronize()
assert torch.isfinite(y).all()
print("fp8_block moe_forward and scatter_quantize with dropped choices: ok")
