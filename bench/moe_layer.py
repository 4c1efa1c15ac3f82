"""The routed-expert part of a whole MoE layer: moegemm.moe_forward against plain PyTorch.

    python bench/moe_layer.py --out DIR [--quick] [--budget SECONDS]

Both sides start from the same topk_ids / topk_weights (router logits -> top-k is left out of
both) and run routing, gather (+ quantize), the gate/up product, SwiGLU (+ requantize), the
down product and the weighted combine. Models (tokens 1, 64, 512, 4096):

    DeepSeek-V3   H 7168, I 2048, 256 experts, top-8, swiglu        fp8_block, mxfp8
    gpt-oss-120b  H 2880, I 2880, 128 experts, top-4, swiglu_oai    mxfp4, bf16; bf16_mxfp4
                  (gate_up bias [E, 2I], down bias [E, H])           at 64 and 4096 tokens

bf16_mxfp4 is the weight-only MXFP4 format (bf16 activations, the mxfp4 rows' e2m1 weights and
e8m0 scales), timed where moegemm.FORMATS has it (layer_models.MODELS' table_fmts).

Ours: moegemm.moe_forward(fused=True, backend="auto"); the mxfp8, mxfp4 and bf16 rows also time the
unfused chain (fused=False) and the gate/up step alone (grouped_matmul_swiglu fused vs
unfused on the same routed, quantized tokens).

Baseline, what a user would write without moegemm: argsort (stable) of the flattened ids,
counts by torch.histc (no host sync, so it captures in a CUDA graph), offsets by cumsum,
index_select gather; DeepSeek-V3: rowwise FP8 (torch ops quantize each gathered row to e4m3,
scale amax/448) through torch._scaled_grouped_mm with per-(expert, row) fp32 weight scales, the
SwiGLU in bf16, rowwise requantization, the down product the same way; gpt-oss:
torch._grouped_mm on bf16 weights with the clamped gpt-oss activation and both biases in torch
ops; combine by index_add_ of the weighted rows. If _scaled_grouped_mm raises, the row falls
back to the bf16 _grouped_mm baseline and says so in baseline_kind.

Weights are random codes built on the GPU (no float master copy): e4m3 codes from randn,
packed e2m1 codes as random bytes, e8m0 scales in a narrow range (about 1/sqrt(K) overall).
The two DeepSeek-V3 formats share one set of e4m3 codes and one set of power-of-two scales,
constant along K and over 128-row blocks, so fp8_block (128x128 blocks), mxfp8 (1x32 blocks)
and the rowwise baseline all hold the same real weights (only the gate/up row order differs:
[gate; up] for fp8_block, interleaved for mxfp8; the baseline splits the product the same way).
gpt-oss: mxfp4 codes and scales (bf16_mxfp4 reads the same); the bf16 row and the baseline use
their exact bf16 decoding.

Timing: medians, L2 flushed before every run. *_us: one call captured in a CUDA graph and
replayed (kernel time, no host launch cost, as moegemm/benchmark.py reports), at least 30
samples a call, a row's calls a sample each a round in a shuffled order (bench/timing.py's Timer says why);
*_eager_us: the Python call, triton.testing.do_bench on its own. If any capture of a row
fails, that row reports eager times everywhere (timing = "eager"). The copy bandwidth (1 GiB
device-to-device, bytes read + written) is measured in the same run; read_time_us = bytes of
the weights and scales of the experts present in topk_ids / copy bandwidth (bf16_mxfp4: its
e2m1 codes and e8m0 scales, as mxfp4); ratio_to_read = ours_us / read_time_us.

Checks (outside timing): every output must be finite; at 64 tokens ours is compared with the
baseline (relative Frobenius error; tolerances in TOL) and the unfused chain with the fused
one. A failed check marks the row (check = "FAIL ..."), is printed, and makes the exit status
2 after the results are written. A row that raises records the error in `notes` and the run
goes on. Rows not started by --budget seconds are skipped (recorded as such).

Writes DIR/moe-layer-<GPU name, spaces as ->.json (rows + env: the script, the git commit of the
tree and whether it had uncommitted changes; MOEGEMM_COMMIT overrides the commit) and .csv.

The models, their weights, the baseline and our layer's calls are in bench/layer_models.py; the
timer in bench/timing.py.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# moegemm from MOEGEMM_TREE (bench/ab.py's two-revision runs: another revision's tree), else this one
sys.path.insert(0, os.environ.get("MOEGEMM_TREE") or str(Path(__file__).resolve().parents[1]))

from layer_models import (
    BASELINE_NAMES,
    MODELS,
    SMOKE_MODELS,
    GateUpStep,
    baseline_for,
    build_weights,
    layer_call,
    routing_inputs,
    weight_bytes_per_expert,
)
from timing import Timer, gpu_limits

import moegemm

TOKENS = (1, 64, 512, 4096)
QUICK_TOKENS = (64, 4096)
CHECK_TOKENS = (64,)
FUSED_FMTS = ("mxfp8", "mxfp4", "bf16")  # the fused-epilogue targets: fused vs unfused timed
# Relative Frobenius error of ours against the baseline on the same real weights. bf16: only
# rounding differs. fp8/mxfp8: the activations' 8-bit quantization (ours per 1x128 / 1x32
# block, the baseline per row). mxfp4: ours also quantizes the activations to e2m1 (the
# baseline keeps them bf16), about 0.2 measured at gpt-oss sizes; tests/test_moe.py allows 0.4.
# bf16_mxfp4: the baseline's bf16 weights are the exact decoding of ours and both keep the
# activations bf16, so only rounding differs, as for bf16.
TOL = {"bf16": 2e-2, "fp8_block": 0.1, "mxfp8": 0.1, "mxfp4": 0.3, "bf16_mxfp4": 2e-2}


def layer_fmts(cfg: dict) -> tuple[str, ...]:
    """The formats of a model in the table: those every script times, then the table's own."""
    return tuple(cfg["fmts"]) + tuple(cfg.get("table_fmts", {}))


def table_rows(cfg: dict, fmts, tokens) -> list[tuple[str, int]]:
    """(format, tokens) of a model's rows: each of `fmts` at `tokens`, a format of the model's
    table_fmts only at its own token counts among them."""
    only = cfg.get("table_fmts", {})
    return [(fmt, t) for fmt in fmts for t in tokens if t in only.get(fmt, tokens)]


def log(msg: str, start: float):
    print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)


# ---- one row -----------------------------------------------------------------------------

@dataclass
class Row:
    model: str
    fmt: str
    tokens: int
    experts: int
    top_k: int
    experts_touched: int = 0
    ours_us: float = math.nan
    ours_unfused_us: float = math.nan
    fused_speedup: float = math.nan  # whole layer: unfused / fused
    gate_up_fused_us: float = math.nan
    gate_up_unfused_us: float = math.nan
    gate_up_speedup: float = math.nan  # gate/up step alone: unfused / fused
    baseline_us: float = math.nan
    baseline_kind: str = ""
    speedup: float = math.nan  # baseline / ours
    weight_bytes_touched: int = 0
    read_time_us: float = math.nan
    ratio_to_read: float = math.nan  # ours / read time (64-token target <= 1.25)
    error: float = math.nan  # relative Frobenius error of ours vs the baseline (check tokens)
    error_tol: float = math.nan
    fused_unfused_error: float = math.nan
    check: str = ""  # "ok", "finite" (not compared), "FAIL ..." (wrong result), "ERROR ..." (raised), "" (skipped)
    timing: str = ""  # "graph" (kernel time) or "eager" (Python call); *_us below are always eager
    ours_eager_us: float = math.nan
    ours_unfused_eager_us: float = math.nan
    baseline_eager_us: float = math.nan
    gate_up_fused_eager_us: float = math.nan
    gate_up_unfused_eager_us: float = math.nan
    seconds: float = math.nan  # wall time of the row (compilation included)
    notes: list = field(default_factory=list)
    # ours: mean device time of each kernel in one graph replay, by name (torch profiler, L2
    # warm, so their sum is below ours_us), and the sum (*_us above all flush L2 first)
    kernels_us: dict = field(default_factory=dict)
    kernels_sum_us: float = math.nan


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def run_row(model: str, cfg: dict, fmt: str, tokens: int, weights, timer: Timer, copy_tbps: float, seed: int,
            device) -> Row:
    t_row = time.time()
    row = Row(model, fmt, tokens, cfg["experts"], cfg["top_k"])
    x, ids, topk_weights = routing_inputs(cfg, tokens, seed, device)
    row.experts_touched = int(torch.unique(ids).numel())  # host sync, outside any timing
    w_gu, w_dn = weights.ours(fmt)
    row.weight_bytes_touched = round(row.experts_touched * weight_bytes_per_expert(w_gu, w_dn))
    row.read_time_us = row.weight_bytes_touched / (copy_tbps * 1e12) * 1e6
    timed: dict = {}  # name -> Timed, timed in turns once all are prepared
    outs: dict = {}

    def measure(name, fn, keep_output=False):
        try:
            out = fn()  # compiles outside timing; also the output the checks read
            if keep_output:
                outs[name] = out
            timed[name] = timer.prepare(fn)
            return True
        except Exception as exc:  # noqa: BLE001
            row.notes.append(f"{name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            return False

    def ours(fused):
        return layer_call(cfg, x, ids, topk_weights, weights, fmt, fused)

    measure("ours", ours(True), keep_output=True)
    row.kernels_us = timer.kernel_times(ours(True))
    row.kernels_sum_us = sum(row.kernels_us.values()) if row.kernels_us else math.nan
    if fmt in FUSED_FMTS:
        measure("ours_unfused", ours(False), keep_output=True)
        try:  # the gate/up step alone, on tokens routed and quantized once as moe_forward does
            gate_up = GateUpStep.build(cfg, x, ids, topk_weights, weights, fmt)
            measure("gate_up_fused", gate_up.call(True))
            measure("gate_up_unfused", gate_up.call(False))
        except Exception as exc:  # noqa: BLE001
            row.notes.append(f"gate_up inputs failed: {type(exc).__name__}: {str(exc)[:200]}")

    kinds = ["fp8_rowwise", "bf16"] if weights.rowwise() is not None else ["bf16"]
    for i, kind in enumerate(kinds):
        try:
            base = baseline_for(weights, fmt, cfg, kind)
        except Exception as exc:  # noqa: BLE001
            row.notes.append(f"baseline {kind} weights failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if measure("baseline", lambda base=base: base(x, ids, topk_weights), keep_output=True):
            row.baseline_kind = BASELINE_NAMES[kind] + (" (fallback: _scaled_grouped_mm failed)" if i else "")
            break

    times = timer.in_turns(timed)  # name -> (graph ms, eager ms, why)
    timed.clear()  # the graphs' memory
    for name, (_, _, why) in times.items():
        if why and device.type == "cuda":
            row.notes.append(f"{name}: {why}")
    # Times: graph replay where every capture of the row worked, else eager everywhere.
    use_graph = bool(times) and all(math.isfinite(g) for g, _, _ in times.values())
    row.timing = "graph" if use_graph else "eager"
    pick = {name: (g if use_graph else e) * 1e3 for name, (g, e, _) in times.items()}
    eager = {name: e * 1e3 for name, (_, e, _) in times.items()}
    nan = math.nan
    row.ours_us, row.ours_eager_us = pick.get("ours", nan), eager.get("ours", nan)
    row.ours_unfused_us, row.ours_unfused_eager_us = pick.get("ours_unfused", nan), eager.get("ours_unfused", nan)
    row.gate_up_fused_us, row.gate_up_fused_eager_us = pick.get("gate_up_fused", nan), eager.get("gate_up_fused", nan)
    row.gate_up_unfused_us = pick.get("gate_up_unfused", nan)
    row.gate_up_unfused_eager_us = eager.get("gate_up_unfused", nan)
    row.baseline_us, row.baseline_eager_us = pick.get("baseline", nan), eager.get("baseline", nan)
    row.speedup = row.baseline_us / row.ours_us
    row.fused_speedup = row.ours_unfused_us / row.ours_us
    row.gate_up_speedup = row.gate_up_unfused_us / row.gate_up_fused_us
    row.ratio_to_read = row.ours_us / row.read_time_us

    # Checks, outside timing.
    failures = []
    for name in ("ours", "ours_unfused", "baseline"):
        if name in outs and not bool(torch.isfinite(outs[name]).all()):
            failures.append(f"{name} not finite")
    if tokens in CHECK_TOKENS or device.type != "cuda":
        row.error_tol = TOL[fmt]
        if "ours" in outs and "baseline" in outs:
            row.error = rel_err(outs["ours"], outs["baseline"])
            if not row.error < row.error_tol:
                failures.append(f"error {row.error:.3g} >= {row.error_tol:g} vs baseline")
        elif "ours" in outs:
            row.notes.append("no baseline output to check against")
        if "ours" in outs and "ours_unfused" in outs:
            row.fused_unfused_error = rel_err(outs["ours"], outs["ours_unfused"])
            if not row.fused_unfused_error < row.error_tol:
                failures.append(f"fused vs unfused {row.fused_unfused_error:.3g} >= {row.error_tol:g}")
    if failures:
        row.check = "FAIL: " + "; ".join(failures)
    elif "ours" in outs and math.isfinite(row.error):
        row.check = "ok"
    elif "ours" in outs:
        row.check = "finite"
    else:
        row.check = "ERROR: ours did not run (see notes)"
    outs.clear()
    row.seconds = time.time() - t_row
    return row


# ---- the run -----------------------------------------------------------------------------

def free_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(models: dict, tokens, fmts_per_model, device, out_dir: Path, budget_s: float, tag_name: str,
        quick: bool) -> list[Row]:
    start = time.time()
    timer = Timer(device)
    from moegemm.benchmark import provenance

    env = {**provenance("bench/moe_layer.py"),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else tag_name,
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "moegemm": moegemm.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": quick, "tokens": list(tokens)}
    env["gpu_limits"] = gpu_limits() if device.type == "cuda" else ""
    copy_tbps = timer.copy_tbps()
    env["copy_tbps"] = round(copy_tbps, 4)
    log(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | copy {copy_tbps:.3f} TB/s", start)
    rows: list[Row] = []
    for m_index, (model, cfg) in enumerate(models.items()):
        fmts = fmts_per_model(cfg)
        plan = table_rows(cfg, fmts, tokens)
        if not plan:
            continue
        if time.time() - start > budget_s:
            for fmt, t in plan:
                rows.append(Row(model, fmt, t, cfg["experts"], cfg["top_k"], notes=["skipped: time budget"]))
            continue
        free_device(device)
        log(f"{model}: building weights (H {cfg['hidden']}, I {cfg['width']}, E {cfg['experts']}, "
            f"top-{cfg['top_k']})", start)
        try:
            weights = build_weights(cfg, m_index, device)
        except Exception as exc:  # noqa: BLE001
            log(f"{model}: weights failed: {type(exc).__name__}: {exc}", start)
            for fmt, t in plan:
                rows.append(Row(model, fmt, t, cfg["experts"], cfg["top_k"],
                                notes=[f"weights failed: {type(exc).__name__}: {str(exc)[:200]}"]))
            free_device(device)
            continue
        if device.type == "cuda":
            log(f"{model}: weights built, {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated", start)
        for fmt, t in plan:
            if time.time() - start > budget_s:
                rows.append(Row(model, fmt, t, cfg["experts"], cfg["top_k"], notes=["skipped: time budget"]))
                log(f"{model} {fmt} T={t}: skipped (budget {budget_s:.0f}s)", start)
                continue
            log(f"{model} {fmt} T={t}: running", start)
            try:
                row = run_row(model, cfg, fmt, t, weights, timer, copy_tbps, seed=t * 7919 + m_index, device=device)
            except Exception as exc:  # noqa: BLE001  # recorded, the run goes on
                row = Row(model, fmt, t, cfg["experts"], cfg["top_k"], check="ERROR: row failed (see notes)",
                          notes=[f"row failed: {type(exc).__name__}: {str(exc)[:200]}"])
            rows.append(row)
            free_device(device)
            log(f"{model} {fmt} T={t}: ours {row.ours_us:.1f} us, baseline {row.baseline_us:.1f} us "
                f"({row.baseline_kind or '-'}), x{row.speedup:.2f}, read {row.read_time_us:.1f} us, "
                f"ratio {row.ratio_to_read:.2f}, check {row.check or '-'}"
                + (f" | {'; '.join(row.notes)}" if row.notes else ""), start)
        del weights
        free_device(device)
    print_table(rows, env)
    write_results(rows, env, out_dir)
    log("done", start)
    return rows


def _f(v, width, prec):
    return f"{v:>{width}.{prec}f}" if isinstance(v, float) and math.isfinite(v) else f"{'-':>{width}}"


def print_table(rows: list[Row], env: dict):
    print(f"\n# {env['gpu']} | torch {env['torch']} | triton {env['triton']} | copy {env['copy_tbps']:.3f} TB/s")
    print("us: kernel time (CUDA graph replay; timing=eager rows: Python call), median of >= 30 samples, a row's "
          "calls in shuffled turns (L2 flushed).\n"
          "xbase = baseline/ours; xfuse = unfused/fused (layer); xgu = unfused/fused (gate/up step); "
          "read = touched weight bytes / copy BW; ratio = ours/read (64-token target <= 1.25)")
    head = (f"{'model':<13} {'fmt':<10} {'T':>5} {'ours':>9} {'unfused':>9} {'xfuse':>6} {'gu fused':>9} "
            f"{'gu unf':>9} {'xgu':>5} {'baseline':>9} {'xbase':>6} {'read':>8} {'ratio':>6} {'error':>8} "
            f"{'timing':<6} check / baseline kind")
    print(head)
    for r in rows:
        print(f"{r.model:<13} {r.fmt:<10} {r.tokens:>5} {_f(r.ours_us, 9, 1)} {_f(r.ours_unfused_us, 9, 1)} "
              f"{_f(r.fused_speedup, 6, 2)} {_f(r.gate_up_fused_us, 9, 1)} {_f(r.gate_up_unfused_us, 9, 1)} "
              f"{_f(r.gate_up_speedup, 5, 2)} {_f(r.baseline_us, 9, 1)} {_f(r.speedup, 6, 2)} "
              f"{_f(r.read_time_us, 8, 1)} {_f(r.ratio_to_read, 6, 2)} {_f(r.error, 8, 4)} {r.timing:<6} "
              f"{r.check or '-'} / {r.baseline_kind or '-'}" + (f"  [{'; '.join(r.notes)}]" if r.notes else ""))
        if r.kernels_us:
            print("    kernels (us, L2 warm): " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in list(r.kernels_us.items())[:8])
                  + f" | sum {r.kernels_sum_us:.1f}")
    fails = [r for r in rows if r.check.startswith("FAIL")]
    if fails:
        print(f"\n!!! {len(fails)} row(s) FAILED a correctness check: "
              + ", ".join(f"{r.model} {r.fmt} T={r.tokens} ({r.check})" for r in fails), flush=True)
    errors = [r for r in rows if r.check.startswith("ERROR")]
    if errors:
        print(f"\n!!! {len(errors)} row(s) did not run ours: "
              + ", ".join(f"{r.model} {r.fmt} T={r.tokens}" for r in errors), flush=True)


def write_results(rows: list[Row], env: dict, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"moe-layer-{env['gpu'].replace(' ', '-')}"
    data = {"env": env, "rows": [asdict(r) for r in rows]}
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(Row("", "", 0, 0, 0)).keys()))
        writer.writeheader()
        for r in rows:
            writer.writerow({**asdict(r), "notes": "; ".join(r.notes),
                             "kernels_us": "; ".join(f"{k}={v}" for k, v in r.kernels_us.items())})
    print(f"wrote {stem}.json, {stem}.csv", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="tokens 64 and 4096, the first format of each model")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="start no row after this many seconds (the rest are recorded as skipped)")
    parser.add_argument("--model", help="only these models (comma-separated names)")
    parser.add_argument("--fmt", help="only these formats (comma-separated)")
    parser.add_argument("--tokens", help="only these token counts (comma-separated)")
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # toy sizes on the CPU
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, models, tokens, name = torch.device("cpu"), SMOKE_MODELS, (5,), "cpu-smoke"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device (use --cpu-smoke for the CPU dry run)", file=sys.stderr)
            return 1
        device, models, name = torch.device("cuda"), MODELS, ""
        tokens = QUICK_TOKENS if args.quick else TOKENS
    fmts_per_model = (lambda cfg: cfg["fmts"][:1]) if args.quick else layer_fmts
    if args.model:  # (the other models' rows are recorded as skipped: seeds stay those of a full run)
        chosen_fmts = fmts_per_model
        fmts_per_model = lambda cfg: chosen_fmts(cfg) if cfg["name"] in args.model.split(",") else ()  # noqa: E731
        models = {name: {**cfg, "name": name} for name, cfg in models.items()}
    if args.fmt:
        chosen = fmts_per_model
        fmts_per_model = lambda cfg: tuple(f for f in chosen(cfg) if f in args.fmt.split(","))  # noqa: E731
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    with torch.no_grad():
        rows = run(models, tokens, fmts_per_model, device, Path(args.out), args.budget, name, args.quick)
    return 2 if any(r.check.startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
