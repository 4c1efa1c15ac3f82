"""Where the time of one MoE layer goes: each step of moe_forward timed on its own (do_bench
median, L2 flushed, eager calls), for gpt-oss-120b MXFP4 and DeepSeek-V3 fp8_block/mxfp8.

    python bench/profile_moe_layer.py [--tokens 64,4096] [--out DIR]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moegemm  # noqa: E402
from moegemm import activation as act  # noqa: E402
from moegemm.config import MX_FORMATS  # noqa: E402
from moegemm.kernels import portable  # noqa: E402
from moegemm.validation import validate_grouped_matmul  # noqa: E402
from moe_layer import MODELS, Fp8Weights, Mxfp4Weights, gate_up_layout, routing_inputs  # noqa: E402


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")) * 1e3


def profile(model: str, fmt: str, weights, tokens: int) -> dict:
    cfg = MODELS[model]
    x, ids, tw = routing_inputs(cfg, tokens, 1, "cuda")
    w_gu, w_dn = weights.ours(fmt)
    gu_bias, dn_bias = weights.biases() if cfg["activation"] == "swiglu_oai" else (None, None)
    layout = "swizzled" if fmt != "fp8_block" else "plain"
    act_kind = cfg["activation"]
    plan = moegemm.route(ids, cfg["experts"], tw)
    bound = plan.scale_blocks_bound
    aso = plan.a_scale_offsets if layout == "swizzled" else None
    a = act.gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, a_scale_offsets=aso,
                            scale_layout=layout, num_scale_blocks=bound)
    steps = {}
    steps["route"] = bench(lambda: moegemm.route(ids, cfg["experts"], tw))
    steps["gather_quantize"] = bench(lambda: act.gather_quantize(
        x, fmt, plan.token_index, a_offsets=plan.a_offsets, a_scale_offsets=aso, scale_layout=layout,
        num_scale_blocks=bound))
    if fmt in MX_FORMATS:
        p = validate_grouped_matmul(a.data, w_gu.data, a.scales, w_gu.scales, plan.a_offsets, plan.expert_ids, fmt=fmt,
                                    a_scale_offsets=aso, expert_scales=None, row_scales=None, scale_layout=layout,
                                    out=None, out_dtype=torch.bfloat16)
        steps["token_prepass (in gate_up)"] = bench(lambda: portable.dequantize_rows(
            p, a.data, a.scales, plan.a_offsets, plan.expert_ids, aso))
    if weights.gate_up_layout(fmt) == "concat":
        h = moegemm.grouped_matmul(a.data, w_gu.data, a.scales, w_gu.scales, plan.a_offsets, plan.expert_ids,
                                   fmt=fmt, a_scale_offsets=aso, scale_layout=layout)
        steps["gate_up matmul"] = bench(lambda: moegemm.grouped_matmul(
            a.data, w_gu.data, a.scales, w_gu.scales, plan.a_offsets, plan.expert_ids, fmt=fmt,
            a_scale_offsets=aso, scale_layout=layout))
        steps["swiglu_quantize"] = bench(lambda: act.swiglu_quantize(
            h, fmt, activation=act_kind, gate_up_layout="concat", a_offsets=plan.a_offsets,
            expert_ids=plan.expert_ids, scale_layout=layout, num_scale_blocks=bound))
        mid = act.swiglu_quantize(h, fmt, activation=act_kind, gate_up_layout="concat", a_offsets=plan.a_offsets,
                                  expert_ids=plan.expert_ids, scale_layout=layout, num_scale_blocks=bound)
    else:
        def gate_up():
            return moegemm.grouped_matmul_swiglu(
                a.data, w_gu.data, a.scales, w_gu.scales, plan.a_offsets, plan.expert_ids, fmt=fmt,
                gate_up_layout="interleaved", out_fmt=fmt,
                activation=act_kind, a_scale_offsets=aso, bias=gu_bias, scale_layout=layout, out_scale_layout=layout,
                num_scale_blocks=bound)
        steps["gate_up matmul + fused swiglu"] = bench(gate_up)
        mid = gate_up()
    steps["down matmul"] = bench(lambda: moegemm.grouped_matmul(
        mid.data, w_dn.data, mid.scales, w_dn.scales, plan.a_offsets, plan.expert_ids, fmt=fmt, a_scale_offsets=aso,
        scale_layout=layout))
    c = moegemm.grouped_matmul(mid.data, w_dn.data, mid.scales, w_dn.scales, plan.a_offsets, plan.expert_ids, fmt=fmt,
                               a_scale_offsets=aso, scale_layout=layout)
    steps["unpermute (combine)"] = bench(lambda: moegemm.unpermute_tokens(c, plan, tw, out_dtype=x.dtype,
                                                                          expert_bias=dn_bias))
    steps["whole moe_forward (eager)"] = bench(lambda: moegemm.moe_forward(
        x, ids, tw, w_gu, w_dn, gate_up_layout=gate_up_layout(fmt), activation=act_kind, gate_up_bias=gu_bias,
        down_bias=dn_bias))
    return steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="64,4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for model, cls, fmts in (("gpt-oss-120b", Mxfp4Weights, ("mxfp4",)),
                             ("DeepSeek-V3", Fp8Weights, ("fp8_block", "mxfp8"))):
        weights = cls(MODELS[model], "cuda", gen)
        for fmt in fmts:
            for t in tokens:
                steps = profile(model, fmt, weights, t)
                results[f"{model} {fmt} T={t}"] = steps
                print(f"\n{model} {fmt} T={t}", flush=True)
                for name, us in steps.items():
                    print(f"  {name:<32} {us:10.1f} us")
        del weights
        torch.cuda.empty_cache()
    if args.out:
        name = torch.cuda.get_device_name().replace(" ", "-")
        Path(args.out, f"profile-moe-layer-{name}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
