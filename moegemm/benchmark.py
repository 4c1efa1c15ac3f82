"""`python -m moegemm bench`: grouped products on named model shapes against the best
baselines available in the same run, with ceilings measured in that run.

Per row: median ms of the kernel (a CUDA graph of one call, replayed under
triton.testing.do_bench, which flushes L2 before every timed call: no host launch time, as
DeepGEMM's own kernel-time benchmark), the median ms of an eager Python call (launch
overhead included), TFLOP/s counting valid tokens only, GB/s counting the weights of the experts used, the
activations and the output once each, the percent of the measured ceilings (copy bandwidth,
dense GEMM of the same input type at 8192^3), and ratios to torch's grouped kernels
(`torch._scaled_grouped_mm`, FP8 rowwise; `torch._grouped_mm`, BF16) on the same groups, and to
DeepGEMM (`deep_gemm.m_grouped_fp8_gemm_nt_contiguous`, 128-row padded groups) when it imports.
Quoted figures of another library (peer_figure, vs_peer) come from bench/data/peers.json when
that file is present (a source checkout, or MOEGEMM_PEERS naming one); an installed package
without it leaves those columns empty. The result files name the command and the git commit of
the tree that made them (MOEGEMM_COMMIT overrides it, for a copy of the tree without its history).

The rows (formats, model shapes, presets): benchmark_rows.py; their operands: benchmark_inputs.py.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import __version__
from .benchmark_inputs import Inputs, deepgemm_runner
from .benchmark_rows import BF16_BASELINE_FORMATS, MODEL_SHAPES, TARGET_SHAPES, WARMUP_MS, default_rows, group_sizes

ROOT = Path(__file__).resolve().parents[1]
PEERS_FILE = ROOT / "bench" / "data" / "peers.json"  # present in a source checkout only


def load_peers(path: str | Path | None = None) -> dict:
    """Quoted peer figures: {"peer", "source", "gpu", "format", "unit", "figures": {(shape, groups,
    nominal): value}} from `path`, else MOEGEMM_PEERS, else bench/data/peers.json beside the
    package; {} when none of them exists (an installed package: the peer columns stay empty)."""
    path = path or os.environ.get("MOEGEMM_PEERS") or PEERS_FILE
    path = Path(path)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    figures = {(r["shape"], int(r["groups"]), int(r["nominal"])): float(r["value"]) for r in data["rows"]}
    return {**{k: v for k, v in data.items() if k != "rows"}, "figures": figures, "file": str(path)}


def provenance(script: str, root: str | Path = ROOT) -> dict:
    """What made a result file: the script (or command), the git commit of the tree at `root` and
    whether that tree had uncommitted changes. MOEGEMM_COMMIT overrides the commit (a copy of the
    tree on another machine may carry a stale or no git history); dirty is then unknown (None)."""
    commit = os.environ.get("MOEGEMM_COMMIT")
    if commit:
        return {"script": script, "commit": commit, "dirty": None}

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"script": script, "commit": "unknown", "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"script": script, "commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"script": script, "commit": "unknown", "dirty": None}


@dataclass
class Row:
    fmt: str
    shape: str
    n: int
    k: int
    groups: int
    nominal: int
    valid_tokens: int
    ms: float = math.nan  # kernel time (graph replay); every figure below derives from it
    eager_ms: float = math.nan
    tflops: float = math.nan
    gbps: float = math.nan
    pct_copy_bw: float = math.nan
    pct_dense: float = math.nan
    torch_ms: float = math.nan
    torch_eager_ms: float = math.nan
    vs_torch: float = math.nan
    deepgemm_ms: float = math.nan
    vs_deepgemm: float = math.nan
    peer_figure: float = math.nan  # the quoted peer's figure (TFLOP/s; decode rows TB/s), if any
    vs_peer: float = math.nan  # ours over it, in the same unit
    vs_fp8_block: float = math.nan  # our fp8_block time on the same shape / ours (other formats)
    notes: list = field(default_factory=list)


def _bench(fn, warmup_ms: float = WARMUP_MS) -> float:
    """do_bench's median (ms) over 100 ms of calls, L2 flushed before each."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=100, return_mode="median"))


def _bench_graph(fn, warmup_ms: float = WARMUP_MS) -> float:
    """Kernel time: one call captured in a CUDA graph, replayed (fn must have run once)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench(graph.replay, warmup_ms)


def _time_both(fn, warmup_ms: float = WARMUP_MS) -> tuple[float, float]:
    eager = _bench(fn, warmup_ms)
    return _bench_graph(fn, warmup_ms), eager


def _copy_ms(n: int, device) -> float:
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _bench(lambda: dst.copy_(src))


def measure_ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written) and dense 8192^3 GEMMs, measured in this run."""
    n = 1 << 30
    copy_ms = _copy_ms(n, device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    flops = 2 * 8192**3
    bf16_ms = _bench(lambda: a @ b.T)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa = torch.ones(8192, 1, device=device)
    sb = torch.ones(1, 8192, device=device)
    fp8_ms = _bench(lambda: torch._scaled_mm(a8, b8.T, sa, sb, out_dtype=torch.bfloat16))
    return {"copy_tbps": 2 * n / copy_ms / 1e9, "bf16_tflops": flops / bf16_ms / 1e9,
            "fp8_rowwise_tflops": flops / fp8_ms / 1e9}


def run(rows=None, out_dir: str | Path = "bench/results", tag: str = "", progress: bool = True,
        peers: dict | None = None, warmup_ms: float = WARMUP_MS) -> list[Row]:
    device = torch.device("cuda")
    rows = rows or default_rows()
    peers = load_peers() if peers is None else peers
    ceilings = measure_ceilings(device)
    env = {**provenance("python -m moegemm bench (moegemm/benchmark.py)"),
           "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "moegemm": __version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "warmup_ms": warmup_ms,
           **{k: round(v, 3) for k, v in ceilings.items()},
           "peer": {k: v for k, v in peers.items() if k != "figures"} or None}
    print(f"# {env['gpu']} | torch {env['torch']} | triton {env['triton']} | copy {ceilings['copy_tbps']:.2f} TB/s"
          f" | dense bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s | dense fp8 {ceilings['fp8_rowwise_tflops']:.0f} TFLOP/s",
          flush=True)
    results = []
    bf16_torch: dict = {}  # (shape, groups, nominal) -> torch._grouped_mm (kernel ms, eager ms)
    fp8_block_ms: dict = {}  # (shape, groups, nominal) -> our fp8_block kernel ms
    start = time.time()
    for i, (fmt, shape, groups, nominal) in enumerate(rows):
        n, k = {**MODEL_SHAPES, **TARGET_SHAPES}[shape]
        sizes = group_sizes(groups, nominal, seed=groups * 100003 + nominal)
        row = Row(fmt, shape, n, k, groups, nominal, sum(sizes))
        torch.cuda.empty_cache()  # one row's operands on the GPU at a time (decode weights are GBs)
        inp = Inputs(fmt, n, k, sizes, device)
        try:
            row.ms, row.eager_ms = _time_both(inp.ours, warmup_ms)
        except Exception as exc:  # recorded, the run goes on
            row.notes.append(f"ours failed: {type(exc).__name__}: {str(exc)[:120]}")
        flops = 2.0 * row.valid_tokens * n * k
        row.tflops = flops / row.ms / 1e9
        row.gbps = inp.bytes_moved() / row.ms / 1e6
        row.pct_copy_bw = 100 * row.gbps / 1e3 / ceilings["copy_tbps"]
        dense = ceilings["fp8_rowwise_tflops" if fmt == "fp8_block" else "bf16_tflops"]
        row.pct_dense = 100 * row.tflops / dense
        # Block and weight-only formats compare with BF16 torch._grouped_mm on the same groups
        # (PyTorch has no grouped product of these formats on Hopper): the bf16 row of the same
        # key, or the first such format's row, measured it already, else it is timed here.
        key = (shape, groups, nominal)
        try:
            if fmt in BF16_BASELINE_FORMATS and key in bf16_torch:
                row.torch_ms, row.torch_eager_ms = bf16_torch[key]
            else:
                if fmt in BF16_BASELINE_FORMATS:
                    del inp
                    torch.cuda.empty_cache()
                    inp = Inputs("bf16", n, k, sizes, device)
                row.torch_ms, row.torch_eager_ms = _time_both(inp.torch_baseline, warmup_ms)
                if fmt in BF16_BASELINE_FORMATS or fmt == "bf16":
                    bf16_torch[key] = (row.torch_ms, row.torch_eager_ms)
            row.vs_torch = row.torch_ms / row.ms
        except Exception as exc:
            row.notes.append(f"torch baseline failed: {type(exc).__name__}: {str(exc)[:120]}")
        if key in fp8_block_ms and fmt != "fp8_block":
            row.vs_fp8_block = fp8_block_ms[key] / row.ms
        if fmt == "fp8_block":
            fp8_block_ms[key] = row.ms
        deepgemm = deepgemm_runner(inp)
        if deepgemm is not None:
            try:
                deepgemm()  # its JIT compiles on the first call, outside the capture
                row.deepgemm_ms = _bench_graph(deepgemm, warmup_ms)
                row.vs_deepgemm = row.deepgemm_ms / row.ms
            except Exception as exc:
                row.notes.append(f"deep_gemm failed: {type(exc).__name__}: {str(exc)[:120]}")
        figure = peers.get("figures", {}).get((shape, groups, nominal)) if fmt == peers.get("format") else None
        if figure is not None:
            row.peer_figure = figure
            ours_figure = row.gbps / 1e3 if nominal <= 32 else row.tflops  # decode figures are TB/s
            row.vs_peer = ours_figure / figure
        results.append(row)
        del inp
        if progress:
            done = i + 1
            bar = "#" * (30 * done // len(rows))
            eta = (time.time() - start) / done * (len(rows) - done)
            print(f"\r[{bar:<30}] {done}/{len(rows)} {fmt} {shape} {groups}x{nominal}  eta {eta:4.0f}s",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    print_table(results, peer=peers.get("peer"))
    print_summary(results)
    write_results(results, env, Path(out_dir), tag)
    return results


def print_table(results: list[Row], peer: str | None = None):
    """The rows as a text table; the peer columns only when peer figures were loaded."""
    print("ms: kernel (graph replay); eager: one Python call; xtorch, xDG: speedup over them (kernel time;"
          " block and weight-only formats: over BF16 torch._grouped_mm); xfp8b: over our fp8_block on the same shape"
          + (f"; peer: {peer}'s quoted figure (TFLOP/s, decode TB/s), xpeer: ours over it" if peer else ""))
    head = (f"{'fmt':<10} {'shape':<15} {'N':>5} {'K':>5} {'groups':>9} {'ms':>8} {'eager':>7} {'TFLOP/s':>8} "
            f"{'GB/s':>7} {'%bw':>5} {'%dense':>6} {'torch ms':>8} {'xtorch':>6} {'xDG':>5}"
            + (f" {'peer':>7} {'xpeer':>6}" if peer else "") + f" {'xfp8b':>5}")
    print(head)
    for r in results:
        print(f"{r.fmt:<10} {r.shape:<15} {r.n:>5} {r.k:>5} {f'{r.groups}x{r.nominal}':>9} {r.ms:>8.3f} "
              f"{r.eager_ms:>7.3f} {r.tflops:>8.1f} {r.gbps:>7.0f} {r.pct_copy_bw:>5.1f} {r.pct_dense:>6.1f} "
              f"{r.torch_ms:>8.3f} {r.vs_torch:>6.2f} {r.vs_deepgemm:>5.2f}"
              + (f" {r.peer_figure:>7.2f} {r.vs_peer:>6.2f}" if peer else "")
              + f" {r.vs_fp8_block:>5.2f}" + (f"  {'; '.join(r.notes)}" if r.notes else ""))


def _cell(value: float, width: int, prec: int) -> str:
    return f"{value:>{width}.{prec}f}" if math.isfinite(value) else f"{'-':>{width}}"


def print_summary(results: list[Row]):
    """Per shape, each format's kernel ms, xtorch and xfp8b in each groups x tokens regime."""
    print("\nsummary by shape: ms (kernel), xtorch (fp8_block: over torch's FP8 rowwise; bf16, block and "
          "weight-only formats: over BF16 torch._grouped_mm), xfp8b (over our fp8_block), per groups x tokens")
    for shape in dict.fromkeys(r.shape for r in results):
        rows = [r for r in results if r.shape == shape]
        regimes = list(dict.fromkeys((r.groups, r.nominal) for r in rows))
        by_key = {(r.fmt, r.groups, r.nominal): r for r in rows}
        print(f"\n{shape} (N {rows[0].n}, K {rows[0].k})")
        print(f"{'':<10}" + "".join(f"{f'{g}x{t}':>22}" for g, t in regimes))
        print(f"{'fmt':<10}" + f" {'ms':>8} {'xtorch':>6} {'xfp8b':>5}" * len(regimes))
        for fmt in dict.fromkeys(r.fmt for r in rows):
            cells = []
            for g, t in regimes:
                r = by_key.get((fmt, g, t))
                cells.append(f" {_cell(r.ms, 8, 3)} {_cell(r.vs_torch, 6, 2)} {_cell(r.vs_fp8_block, 5, 2)}"
                             if r else " " * 22)
            print(f"{fmt:<10}" + "".join(cells))


def write_results(results: list[Row], env: dict, out_dir: Path, tag: str):
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = env["gpu"].replace(" ", "-")
    stem = out_dir / f"bench-{gpu}{('-' + tag) if tag else ''}"
    data = {"env": env, "rows": [asdict(r) for r in results]}
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(results[0]).keys()))
        writer.writeheader()
        for r in results:
            writer.writerow({**asdict(r), "notes": "; ".join(r.notes)})
    try:
        plot(results, env, stem.with_suffix(".png"))
    except Exception as exc:  # matplotlib missing: the table and files are the result
        print(f"(no plot: {exc})")
    print(f"wrote {stem}.json, .csv, .png")


def plot(results: list[Row], env: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = list(dict.fromkeys(r.fmt for r in results))
    fig, axes = plt.subplots(1, len(fmts), figsize=(6.5 * len(fmts), 6), squeeze=False)
    for ax, fmt in zip(axes[0], fmts):
        rows = [r for r in results if r.fmt == fmt]
        labels = [f"{r.shape}\n{r.groups}x{r.nominal}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r.tflops for r in rows], width=0.4, label="moegemm")
        ax.bar([i + 0.2 for i in x], [2.0 * r.valid_tokens * r.n * r.k / r.torch_ms / 1e9 for r in rows],
               width=0.4, label="torch grouped")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_ylabel("TFLOP/s (valid tokens)")
        ax.set_title(f"{fmt} on {env['gpu']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
