"""Profiling targets: a grouped product or the MoE layer, for Nsight Compute / Nsight Systems, or
the layer's steps timed one by one.

    python bench/profiling.py kernel [SHAPE] [GxT] [FMT] [--peer deepgemm]
                                                         one grouped_matmul of `python -m moegemm bench`'s
                                                         shapes (default t-6144x7168 4x8192 fp8_block), or
                                                         DeepGEMM's product of the same groups
    python bench/profiling.py layer [--model M] [--fmt F] [--tokens T]
                                                         moe_forward of bench/moe_layer.py's models
    python bench/profiling.py layer --steps [--out DIR]    each step of the layer timed alone, and
                                                         the device time of each kernel of one replay
    python bench/profiling.py host --products [--out DIR]  grouped_matmul at decode size in every format
                                                         beside torch._grouped_mm
    python bench/profiling.py host --blocks [--out DIR]  grouped_matmul at decode size in every format and
                                                         transformers' MoE blocks (Qwen3-30B-A3B, gpt-oss-20b)
                                                         with each experts backend: eager, host and graph time
    python bench/profiling.py host [--model M] [--fmt F] [--tokens T] [--out DIR]
                                                         where an eager call's host time goes:
                                                         grouped_matmul and the layer at decode sizes
                                                         beside their graph time and their launches'
                                                         floor (bench/host_time.py)

`kernel` and `layer` run their call --warmup times (compiling it), synchronize, then --runs more
times inside an NVTX range "profile": e.g.
    ncu --set full --nvtx --nvtx-include "profile/" -k regex:sm90 -c 1 -o OUT python bench/profiling.py kernel ...
    nsys profile -o OUT python bench/profiling.py layer --model gpt-oss-120b --fmt mxfp4 --tokens 64
`layer --steps` (do_bench medians, L2 flushed, eager calls: each step's host time included, so
the steps sum to more than the layer's graph time) writes DIR/profile-layer-<GPU>.json naming
this script and the commit of the tree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moegemm  # noqa: E402
from moegemm import benchmark, benchmark_inputs, benchmark_rows  # noqa: E402


def _profiled(call, warmup: int, runs: int):
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    for _ in range(runs):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def kernel(args):
    n, k = {**benchmark_rows.MODEL_SHAPES, **benchmark_rows.TARGET_SHAPES}[args.shape]
    groups, nominal = (int(x) for x in args.groups.split("x"))
    sizes = benchmark_rows.group_sizes(groups, nominal, seed=groups * 100003 + nominal)
    inp = benchmark_inputs.Inputs(args.fmt, n, k, sizes, "cuda")
    call = inp.ours
    if args.peer == "deepgemm":
        call = benchmark_inputs.deepgemm_runner(inp)
        if call is None:
            raise SystemExit("--peer deepgemm: deep_gemm does not import, or the format is not fp8_block")
    print(f"{args.peer or 'moegemm'}: {args.fmt} {args.shape} (N={n}, K={k}) {groups} groups x ~{nominal} tokens"
          f" ({sum(sizes)} in all)")
    _profiled(call, args.warmup, args.runs)


def _layer_inputs(args):
    import layer_models as L

    cfg = L.MODELS[args.model]
    m_index = list(L.MODELS).index(args.model)
    weights = L.build_weights(cfg, m_index, torch.device("cuda"))
    x, ids, topk_weights = L.routing_inputs(cfg, args.tokens, args.tokens * 7919 + m_index, torch.device("cuda"))
    return L, cfg, weights, x, ids, topk_weights


def layer(args):
    L, cfg, weights, x, ids, topk_weights = _layer_inputs(args)
    call = L.layer_call(cfg, x, ids, topk_weights, weights, args.fmt, fused=True)
    print(f"moe_forward {args.model} {args.fmt} {args.tokens} tokens")
    _profiled(call, args.warmup, args.runs)


def layer_steps(args) -> dict:
    """Each step of the layer alone (do_bench median, L2 flushed, eager), then the device time of
    each kernel in one graph replay of the whole layer (torch profiler, L2 warm)."""
    from timing import Timer

    L, cfg, weights, x, ids, topk_weights = _layer_inputs(args)
    fmt = args.fmt
    timer = Timer(torch.device("cuda"))

    def bench(fn) -> float:
        return timer.bench(fn) * 1e3

    step = L.GateUpStep.build(cfg, x, ids, topk_weights, weights, fmt)
    plan, layout, aso = step.plan, step.layout, step.a_scale_offsets
    _, w_dn = weights.ours(fmt)
    _, dn_bias = weights.biases()
    mid = step.call(True)()
    out = moegemm.grouped_matmul(mid.data, w_dn, mid.scales, None, plan.a_offsets, plan.expert_ids,
                                 fmt=fmt, a_scale_offsets=aso, scale_layout=layout)
    steps = {
        "route": bench(lambda: moegemm.route(ids, cfg["experts"], topk_weights)),
        "gather + quantize": bench(lambda: moegemm.gather_quantize(
            x, fmt, plan.token_index, a_offsets=plan.a_offsets, a_scale_offsets=aso, scale_layout=layout,
            num_scale_blocks=plan.scale_blocks_bound)),
        "gate/up + SwiGLU, fused": bench(step.call(True)),
        "gate/up + SwiGLU, unfused": bench(step.call(False)),
        "down": bench(lambda: moegemm.grouped_matmul(mid.data, w_dn, mid.scales, None, plan.a_offsets,
                                                     plan.expert_ids, fmt=fmt, a_scale_offsets=aso,
                                                     scale_layout=layout)),
        "combine": bench(lambda: moegemm.unpermute_tokens(out, plan, topk_weights, out_dtype=x.dtype,
                                                          expert_bias=dn_bias)),
        "whole layer (eager)": bench(L.layer_call(cfg, x, ids, topk_weights, weights, fmt, fused=True)),
    }
    kernels = timer.kernel_times(L.layer_call(cfg, x, ids, topk_weights, weights, fmt, fused=True))
    print(f"{args.model} {fmt} {args.tokens} tokens: each step alone (us, eager, L2 flushed)")
    for name, us in steps.items():
        print(f"  {name:<28} {us:10.1f}")
    print("kernels of one graph replay of the layer (us, L2 warm)")
    for name, us in kernels.items():
        print(f"  {name[:60]:<60} {us:10.1f}")
    return dict(model=args.model, fmt=fmt, tokens=args.tokens, steps_us=steps, kernels_us=kernels,
                kernels_sum_us=round(sum(kernels.values()), 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="target", required=True)
    p_kernel = sub.add_parser("kernel", help="one grouped_matmul, repeated")
    p_kernel.add_argument("shape", nargs="?", default="t-6144x7168")
    p_kernel.add_argument("groups", nargs="?", default="4x8192", help="GROUPSxTOKENS")
    p_kernel.add_argument("fmt", nargs="?", default="fp8_block")
    p_kernel.add_argument("--peer", choices=("deepgemm",), default=None,
                          help="profile DeepGEMM's grouped fp8 GEMM on the same groups instead (fp8_block)")
    p_layer = sub.add_parser("layer", help="moe_forward, repeated; --steps: its steps timed alone")
    p_layer.add_argument("--model", default="gpt-oss-120b", choices=("DeepSeek-V3", "gpt-oss-120b"))
    p_layer.add_argument("--fmt", default="mxfp4")
    p_layer.add_argument("--tokens", type=int, default=64)
    p_layer.add_argument("--steps", action="store_true")
    p_layer.add_argument("--out", type=Path, default=None, help="--steps: folder of the JSON record")
    p_host = sub.add_parser("host", help="host time of eager calls, graph time, launch floors")
    p_host.add_argument("--out", type=Path, default=None, help="folder of the JSON record")
    p_host.add_argument("--model", action="append", help="only this model (repeatable; default all)")
    p_host.add_argument("--fmt", action="append", help="only this format (repeatable; default all)")
    p_host.add_argument("--tokens", type=int, action="append", help="layer tokens (repeatable; default 1 and 64)")
    p_host.add_argument("--blocks", action="store_true", help="grouped_matmul at decode size in every format beside "
                        "torch._grouped_mm, and transformers' MoE blocks with each experts backend "
                        "(host_time.decode_products, transformers_blocks)")
    p_host.add_argument("--products", action="store_true", help="only grouped_matmul at decode size in every "
                        "format beside torch._grouped_mm (host_time.decode_products)")
    for p in (p_kernel, p_layer):
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile: needs a CUDA GPU", file=sys.stderr)
        return 1
    with torch.no_grad():
        if args.target == "host":
            import host_time

            if args.products:
                rows = host_time.decode_products()
            elif args.blocks:
                rows = host_time.decode_products() + host_time.transformers_blocks()
            else:
                rows = host_time.measure(tuple(args.tokens or (1, 64)), args.model, args.fmt)
            if args.out:
                flag = " --products" if args.products else " --blocks" if args.blocks else ""
                _write(args.out, "host-time", "bench/profiling.py host" + flag, dict(rows=rows))
        elif args.target == "kernel":
            kernel(args)
        elif not args.steps:
            layer(args)
        else:
            result = layer_steps(args)
            if args.out:
                _write(args.out, "profile-layer", "bench/profiling.py layer --steps", result)
    return 0


def _write(out: Path, stem: str, command: str, result: dict):
    """out/<stem>-<GPU>.json with the record naming the command and the commit of the tree."""
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "-")
    record = dict(benchmark.provenance(command), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    path = out / f"{stem}-{name}.json"
    path.write_text(json.dumps(dict(record=record, **result), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
