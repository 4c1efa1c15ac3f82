"""Command line: `python -m moegemm demo | info | bench`."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import platform
import sys
import time

import torch

from . import __version__, benchmark, benchmark_rows, ops, reference
from .formats import FORMATS
from .moe import MoE, moe_forward
from .quantize import quantize_weights
from .token_quantizers import quantize
from .validation import validate_grouped_matmul

# A DeepSeek-V3-like up projection (N=4096, K=7168) over a few experts with ragged, unaligned
# token counts, one skipped slot (-1) and one empty group. The CPU run keeps the ragged
# pattern at a size the interpreter finishes in seconds.
DEMO_GPU = dict(n=4096, k=7168, tokens=(1333, 257, 0, 3001, 611, 2048, 97), ids=(3, 0, 5, -1, 7, 1, 3), experts=8)
DEMO_CPU = dict(n=256, k=512, tokens=(37, 200, 0, 91, 129), ids=(3, 0, 5, -1, 1), experts=8)


def _time_call(fn, device: torch.device):
    """(milliseconds, fn's result): the benchmark's do_bench median on the GPU, then one more call for
    the result; on the CPU one wall-clock run, whose result it is (the interpreter's time says how slow
    interpreting is, not how fast a kernel is; one run keeps the demo short)."""
    if device.type == "cuda":
        return benchmark._bench(fn), fn()
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1e3, result


def demo(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    shape = DEMO_GPU if device.type == "cuda" else DEMO_CPU
    # The GPU runs what `auto` picks; the CPU runs the portable kernel under the interpreter.
    backend = "auto" if device.type == "cuda" else ("triton" if "triton" in ops.available_backends(device) else "reference")
    n, k, e = shape["n"], shape["k"], shape["experts"]
    bounds = [0]
    for t in shape["tokens"]:
        bounds.append(bounds[-1] + t)
    a_offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
    expert_ids = torch.tensor(shape["ids"], dtype=torch.int32, device=device)
    m = bounds[-1]
    valid_rows = sum(t for t, i in zip(shape["tokens"], shape["ids"]) if i >= 0)
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device)
    w = torch.randn(e, n, k, device=device) / k**0.5
    print(f"moegemm {__version__} demo on {_device_name(device)}: N={n}, K={k}, "
          f"E={e}, tokens per slot {list(shape['tokens'])}, expert_ids {list(shape['ids'])}")
    print("  error vs reference: ||C - reference(C)|| / ||reference(C)|| on the same quantized inputs (fp64 oracle;")
    print("                      the bf16 rounding of C alone gives about 1.6e-3)")
    print("  quantization error: the same against the unquantized fp32 product")
    print(f"{'format':<10} {'layout':<9} {'backend':<9} {'error vs reference':>18} {'quantization error':>18} "
          f"{'time ms':>9} {'TFLOP/s':>8}")
    full = _unquantized(x, w, bounds, shape["ids"])
    for name, f in FORMATS.items():
        layout = "swizzled" if f.swizzle_capable else "plain"
        qa = quantize(x, name, scale_layout=layout, a_offsets=a_offsets)
        qw = quantize_weights(w, name, scale_layout=layout)
        # Raw tensors: nvfp4's global scales go in expert_scales (bf16_nvfp4: the weights' alone).
        globals_ = [g for g in (qa.global_scale, qw.global_scale) if g is not None]
        expert_scales = math.prod(globals_).float() if globals_ else None
        call_args = (qa.data, qw.data, qa.scales, qw.scales, a_offsets, expert_ids)
        kwargs = dict(fmt=name, scale_layout=layout, expert_scales=expert_scales)
        out = torch.zeros(m, n, dtype=torch.bfloat16, device=device)  # (rows of skipped groups stay zero)
        problem = validate_grouped_matmul(*call_args, **{**kwargs, "fmt": f}, a_scale_offsets=None, row_scales=None, out=out,
                                          out_dtype=torch.bfloat16)
        chosen = ops.resolve_backend(backend, problem, device)
        ms, got = _time_call(lambda: ops.grouped_matmul(*call_args, **kwargs, out=out, backend=backend), device)
        got = got.double()
        ref = reference.grouped_matmul(*call_args, **kwargs, out_dtype=torch.float32, compute_dtype=torch.float64)
        err = float((got - ref.double()).norm() / ref.double().norm())
        qerr = float((got - full).norm() / full.norm())
        tflops = 2.0 * valid_rows * n * k / (ms * 1e-3) / 1e12
        print(f"{name:<10} {layout:<9} {chosen:<9} {err:>18.2e} {qerr:>18.2e} {ms:>9.3f} {tflops:>8.1f}")
    _demo_layer(device, backend)
    return 0


DEMO_LAYER_GPU = dict(hidden=2048, width=1024, experts=32, top_k=4, tokens=256)
DEMO_LAYER_CPU = dict(hidden=128, width=64, experts=8, top_k=2, tokens=12)


def _demo_layer(device: torch.device, backend: str):
    """The whole routed-expert layer (moe_forward) in every format against fp32 math."""
    cfg = DEMO_LAYER_GPU if device.type == "cuda" else DEMO_LAYER_CPU
    h, i, e, k, t = cfg["hidden"], cfg["width"], cfg["experts"], cfg["top_k"], cfg["tokens"]
    gate, up, down = (torch.randn(e, i, h, device=device) / h**0.5, torch.randn(e, i, h, device=device) / h**0.5,
                      torch.randn(e, h, i, device=device) / i**0.5)
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.softmax(torch.randn(t, k, device=device), dim=-1)
    ref = torch.zeros(t, h, device=device)
    for ex in range(e):
        tok, slot = torch.nonzero(ids == ex, as_tuple=True)
        xt = x[tok].float()
        hid = torch.nn.functional.silu(xt @ gate[ex].T) * (xt @ up[ex].T)
        ref.index_add_(0, tok, (hid @ down[ex].T) * weights[tok, slot, None])
    print(f"\nMoE layer (moe_forward: route, gather+quantize, gate/up + SwiGLU, down, combine): H={h}, I={i}, "
          f"E={e}, top-{k}, {t} tokens; error vs the fp32 layer on unquantized weights")
    print(f"{'format':<10} {'error':>10} {'time ms':>9}")
    for name in FORMATS:
        layer = MoE(h, i, e, k, fmt=name, backend=backend, device=device).load_experts(gate=gate, up=up, down=down)
        w_gate_up, w_down = layer.weights()
        run = lambda: moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout=layer.gate_up_layout,
                                  backend=backend)  # noqa: E731
        ms, got = _time_call(run, device)
        err = float((got.float() - ref).norm() / ref.norm())
        print(f"{name:<10} {err:>10.2e} {ms:>9.3f}")


def _unquantized(x, w, bounds, ids) -> torch.Tensor:
    full = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for g, e in enumerate(ids):
        if e >= 0 and bounds[g + 1] > bounds[g]:
            full[bounds[g]:bounds[g + 1]] = x[bounds[g]:bounds[g + 1]].double() @ w[e].double().T
    return full


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def info(args) -> int:
    import numpy
    import triton

    print(f"moegemm  {__version__}")
    print(f"python   {platform.python_version()}")
    print(f"torch    {torch.__version__}")
    print(f"triton   {triton.__version__}")
    print(f"numpy    {numpy.__version__}")
    try:  # (its version without importing it: `import moegemm` never does)
        print(f"transformers {importlib.metadata.version('transformers')}")
    except importlib.metadata.PackageNotFoundError:
        print("transformers not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"cuda:{i}   {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                  f"{props.total_memory / 2**30:.0f} GiB")
        print(f"backends on cuda: {', '.join(ops.available_backends('cuda'))}")
    else:
        print("cuda     not available")
    interp = "usable" if ops.interpreter_usable() else "not usable (needs numpy < 2.4)"
    print(f"backends on cpu: {', '.join(ops.available_backends('cpu'))} (Triton interpreter {interp})")
    print(f"formats  {', '.join(FORMATS)}")
    return 0


def bench(args) -> int:
    try:
        rows = benchmark_rows.select_rows(args.preset or "", args.formats, args.only)
    except ValueError as exc:
        print(f"bench: {exc}")
        return 2
    if not rows:
        print("bench: no rows match --formats / --only")
        return 2
    if args.dry_run:
        for fmt, shape, groups, nominal in rows:
            print(f"{fmt} {shape} {groups}x{nominal}")
        print(f"{len(rows)} rows")
        return 0
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (the CPU path is `python -m moegemm demo`)")
        return 2
    warmup_ms = benchmark_rows.PRESETS[args.preset].warmup_ms if args.preset else benchmark_rows.WARMUP_MS
    peers = {} if args.peers == "none" else benchmark.load_peers(args.peers or None)
    if args.peers not in ("", "none") and not peers:
        print(f"bench: no peer figures at {args.peers}")
        return 2
    # A preset's results go to files of their own (bench-<GPU>-<preset>), not over the default run's.
    benchmark.run(rows, out_dir=args.out, tag=args.tag or args.preset, peers=peers, warmup_ms=warmup_ms)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moegemm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run a DeepSeek-V3-like grouped product in every format")
    p_demo.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p_demo.set_defaults(func=demo)
    sub.add_parser("info", help="versions, devices, backends").set_defaults(func=info)
    p_bench = sub.add_parser("bench", help="grouped products on model shapes vs baselines and ceilings (GPU)")
    p_bench.add_argument("--preset", choices=list(benchmark_rows.PRESETS),
                         help="named rows instead of the default ones: "
                         + "; ".join(f"{name}: {p.about}" for name, p in benchmark_rows.PRESETS.items()))
    p_bench.add_argument("--formats", default="", help="comma-separated formats (default: "
                         f"{','.join(benchmark_rows.DEFAULT_FORMATS)}; with --preset, every format)")
    p_bench.add_argument("--only", default="", help="comma-separated substrings of 'fmt shape GxT' to keep")
    p_bench.add_argument("--dry-run", action="store_true", help="print the rows and exit (no GPU needed)")
    p_bench.add_argument("--out", default="bench/results")
    p_bench.add_argument("--tag", default="")
    p_bench.add_argument("--peers", default="", help="JSON of quoted peer figures (default: bench/data/peers.json "
                         "of a source checkout, or $MOEGEMM_PEERS, when present; 'none': no peer columns)")
    p_bench.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
