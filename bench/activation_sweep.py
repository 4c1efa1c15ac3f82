"""Launch-shape sweep of the activation kernel (gather+quantize, SwiGLU+quantize) at prefill sizes:
rows a program (CUDA_BLOCK_M) x scale blocks a program (NB, times 1/2/4) x warps, graph replay,
median; writes activation-sweep-<GPU>.json under $OUT. Usage: OUT=dir [CASES=a,b] python bench/activation_sweep.py"""
import json, os, sys

import torch
import triton.testing
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import moegemm
from moegemm import activation as act
from moegemm.routing import row_experts
from moegemm.token_forms import TokenForm
from moe_layer import MODELS, routing_inputs
dev = torch.device("cuda")
out = os.environ.get("OUT", ".")
orig_out_code = act._out_code
results = []

def timed(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median") * 1e3

ds, go = MODELS["DeepSeek-V3"], MODELS["gpt-oss-120b"]
x, ids, tw = routing_inputs(ds, 4096, 3, dev)
plan = moegemm.route(ids, ds["experts"], tw)
bound = plan.scale_blocks_bound
h = torch.randn(ids.numel(), 4096, device=dev).bfloat16()
xg, idsg, twg = routing_inputs(go, 4096, 3, dev)
plang = moegemm.route(idsg, go["experts"], twg)
cases = {
    "dsv3-gather-mxfp8": (lambda: act.gather_quantize(x, "mxfp8", plan.token_index, a_offsets=plan.a_offsets,
                          a_scale_offsets=plan.a_scale_offsets, scale_layout="swizzled", num_scale_blocks=bound),
                          x.numel() * 2 + ids.numel() * 7168),
    "dsv3-gather-mxfp8-e4m3form": (lambda: act.gather_kernel_tokens(x, "mxfp8", plan.token_index, TokenForm("e4m3"),
                                   plan.a_offsets), x.numel() * 2 + ids.numel() * 7168),
    "dsv3-gather-fp8block": (lambda: act.gather_quantize(x, "fp8_block", plan.token_index), x.numel() * 2 + ids.numel() * 7168),
    "dsv3-swiglu-mxfp8": (lambda: act.swiglu_quantize(h, "mxfp8", gate_up_layout="interleaved", a_offsets=plan.a_offsets, expert_ids=plan.expert_ids,
                          a_scale_offsets=plan.a_scale_offsets, scale_layout="swizzled", num_scale_blocks=bound),
                          h.numel() * 2 + h.numel() // 2),
    "dsv3-swiglu-fp8block-concat": (lambda: act.swiglu_quantize(h, "fp8_block", gate_up_layout="concat"),
                                    h.numel() * 2 + h.numel() // 2),
    "dsv3-scatter-mxfp8-e4m3form": (lambda: act.scatter_kernel_tokens(x, "mxfp8", plan.grouped_row,
                                    row_experts(plan), TokenForm("e4m3"), plan.a_offsets),
                                    x.numel() * 2 + ids.numel() * 7168),
    "dsv3-swiglu-mxfp8-e4m3form": (lambda: act.swiglu_kernel_tokens(h, "mxfp8", TokenForm("e4m3"), activation="swiglu",
                                   gate_up_layout="interleaved", bias=None, a_offsets=plan.a_offsets,
                                   expert_ids=plan.expert_ids, alpha=1.702, limit=7.0),
                                   h.numel() * 2 + h.numel() // 2),
    "gptoss-gather-mxfp4-bf16form": (lambda: act.gather_kernel_tokens(xg, "mxfp4", plang.token_index, TokenForm("bf16"),
                                     plang.a_offsets), xg.numel() * 2 + idsg.numel() * 2880 * 2),
}
only = os.environ.get("CASES")  # comma-separated case names, or all
for name, (fn, nbytes) in cases.items():
    if only and name not in only.split(","):
        continue
    for bm in (8, 16, 32):
        for factor in (1, 2, 4):
            for nw in (4, 8):
                act.CUDA_BLOCK_M = bm; act.CUDA_WARPS = nw
                act._out_code = lambda f, m, _o=orig_out_code, _k=factor: (lambda r: (r[0], r[1], r[2] * _k))(_o(f, m))
                try:
                    us = timed(fn)
                except Exception as exc:  # noqa
                    print(name, bm, factor, nw, "FAILED", type(exc).__name__, str(exc)[:200], flush=True)
                    continue
                results.append(dict(case=name, block_m=bm, nb_factor=factor, warps=nw, us=us,
                                    tbps=nbytes / us / 1e6))
                print(f"{name} bm={bm} nbx{factor} warps={nw}: {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s)", flush=True)
    best = min((r for r in results if r["case"] == name), key=lambda r: r["us"])
    base = [r for r in results if r["case"] == name and r["block_m"] == 16 and r["nb_factor"] == 1 and r["warps"] == 4]
    print("BEST", name, best, "default", base[0]["us"] if base else None, flush=True)
act._out_code = orig_out_code
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results=results),
          open(os.path.join(out, "activation-sweep-" + torch.cuda.get_device_name().replace(" ", "-") + ".json"), "w"), indent=1)
