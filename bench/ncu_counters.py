"""Nsight Compute counters of our fp8_block prefill kernel beside DeepGEMM's, as one table (no GPU:
it reads the two profiles' raw pages).

On the GPU (DeepGEMM built from the git-ignored peers/DeepGEMM, on PYTHONPATH), for each side:

    ncu --set full --import-source no --nvtx --nvtx-include "profile/" -k regex:"dense_kernel|sm90_fp8_gemm" \\
        -c 1 -o ours python bench/profiling.py kernel                  # (--peer deepgemm: DeepGEMM's)
    ncu --import ours.ncu-rep --csv --page raw > ours-raw.csv

then here:

    python bench/ncu_counters.py ours-raw.csv deepgemm-raw.csv [--bench bench-GPU.json] --out DIR

writes DIR/counters-fp8-block-<GPU>.md: the counters (ncu replays each kernel at its locked base
clock, so its durations are not the timed figures), the stall reasons that lead on either side,
and with --bench the same call's timed figures of both (`python -m moegemm bench --formats
fp8_block`, which times DeepGEMM when it imports).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegemm.benchmark import provenance  # noqa: E402

# (label, metric, scale, digits): value shown = metric (in base units: read_raw) * scale
COUNTERS = [
    ("kernel time at ncu's clock (ms)", "gpu__time_duration.sum", 1e3, 3),
    ("SM clock (GHz)", "sm__cycles_elapsed.avg.per_second", 1e-9, 2),
    ("grid x block (cluster size)", None, None, None),
    ("tensor pipe active, % of elapsed cycles", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", 1, 1),
    ("issue slots busy, %", "sm__inst_issued.avg.pct_of_peak_sustained_elapsed", 1, 1),
    ("instructions executed (millions)", "smsp__inst_executed.sum", 1e-6, 1),
    ("L2 throughput, % of peak", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1, 1),
    ("L2 sectors from the SMs (GB)", "lts__t_sectors_srcunit_tex.sum", 32e-9, 2),
    ("L2 hit rate, %", "lts__t_sector_hit_rate.pct", 1, 1),
    ("DRAM read (GB)", "dram__bytes_read.sum", 1e-9, 2),
    ("DRAM write (GB)", "dram__bytes_write.sum", 1e-9, 2),
    ("shared-memory bank conflicts (thousands)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", 1e-3, 0),
    ("registers a thread (launch)", "launch__registers_per_thread", 1, 0),
    ("local-memory (spill) instructions (thousands)", None, 1e-3, 0),
    ("global load instructions (millions)", "smsp__sass_inst_executed_op_global_ld.sum", 1e-6, 2),
    ("active warps an SM (achieved occupancy)", "sm__warps_active.avg.per_cycle_active", 1, 1),
]
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
UNITS = {"Gbyte": 1e9, "Mbyte": 1e6, "Kbyte": 1e3, "byte": 1, "Tbyte/s": 1e12, "Gbyte/s": 1e9, "Mbyte/s": 1e6,
         "Ghz": 1e9, "Mhz": 1e6, "hz": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "msecond": 1e-3, "usecond": 1e-6,
         "nsecond": 1e-9}


def read_raw(path: Path) -> dict:
    """{metric: value in base units (bytes, Hz, seconds)} of the first kernel of an ncu raw CSV page
    (row 0 the metric names, row 1 their units, row 2 on the kernels' values)."""
    rows = list(csv.reader(path.open()))
    if len(rows) < 3:
        raise ValueError(f"{path}: no profiled kernel in the raw page")
    names, units, values = rows[0], rows[1], rows[2]
    out = {}
    for name, unit, value in zip(names, units, values):
        try:
            number = float(value.replace(",", ""))
        except ValueError:
            out[name] = value
            continue
        out[name] = number * UNITS.get(unit.strip(), 1)
    return out


def _cell(raw: dict, label: str, metric, scale, digits) -> str:
    if label.startswith("grid"):
        cluster = raw.get("launch__cluster_size", 0) or raw.get("launch__cluster_dim_x", 0)
        return f"{raw.get('launch__grid_size', 0):.0f} x {raw.get('launch__block_size', 0):.0f} ({cluster:.0f})"
    if label.startswith("local-memory"):
        value = raw.get("smsp__sass_inst_executed_op_local_ld.sum", 0) + raw.get("smsp__sass_inst_executed_op_local_st.sum", 0)
    else:
        value = raw.get(metric)
    if not isinstance(value, float):
        return "-"
    return f"{value * scale:.{digits}f}"


def stall_reasons(raw: dict) -> dict:
    """{reason: warp cycles stalled per issued instruction}, 'selected' (issuing) left out."""
    return {name[len(STALL_PREFIX):-len(STALL_SUFFIX)]: value for name, value in raw.items()
            if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and isinstance(value, float)
            and "not_issued" not in name and not name.endswith("_selected" + STALL_SUFFIX)}


def table(ours: dict, peer: dict, top: int = 5) -> list[str]:
    lines = ["| counter | moegemm | DeepGEMM |", "|---|---|---|"]
    for label, metric, scale, digits in COUNTERS:
        lines.append(f"| {label} | {_cell(ours, label, metric, scale, digits)} | "
                     f"{_cell(peer, label, metric, scale, digits)} |")
    ours_stalls, peer_stalls = stall_reasons(ours), stall_reasons(peer)
    leading = sorted(set(sorted(ours_stalls, key=ours_stalls.get)[-top:]) | set(sorted(peer_stalls, key=peer_stalls.get)[-top:]),
                     key=lambda r: -max(ours_stalls.get(r, 0), peer_stalls.get(r, 0)))
    for reason in leading:
        lines.append(f"| stall: {reason} (warp cycles an issued instruction) | {ours_stalls.get(reason, 0):.2f} | "
                     f"{peer_stalls.get(reason, 0):.2f} |")
    return lines


def bench_lines(bench: dict) -> list[str]:
    rows = [r for r in bench.get("rows", []) if r.get("fmt") == "fp8_block" and r.get("deepgemm_ms")]
    if not rows:
        return []
    env = bench.get("env", {})
    lines = ["", f"Timed in one call (`{env.get('script', 'python -m moegemm bench')}`, commit "
                 f"{str(env.get('commit', '?'))[:7]}, {env.get('gpu', '?')}: CUDA-graph replays, L2 flushed, medians;"
                 " valid-token TFLOP/s):", "",
             "| shape (G x ~rows, N, K) | moegemm ms | DeepGEMM ms | moegemm TFLOP/s | DeepGEMM TFLOP/s | ratio |",
             "|---|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        flops = 2.0 * r["valid_tokens"] * r["n"] * r["k"]
        ratios.append(r["vs_deepgemm"])
        lines.append(f"| {r['groups']} x {r['nominal']}, {r['n']}, {r['k']} | {r['ms']:.3f} | {r['deepgemm_ms']:.3f} | "
                     f"{flops / r['ms'] / 1e9:.0f} | {flops / r['deepgemm_ms'] / 1e9:.0f} | {r['vs_deepgemm']:.3f} |")
    geomean = 1.0
    for x in ratios:
        geomean *= x
    lines.append(f"| geomean | | | | | {geomean ** (1 / len(ratios)):.3f} |")
    return lines


def _short(kernel_name: str) -> str:
    """A kernel's name with its template arguments (DeepGEMM's config) but not its parameter list."""
    return kernel_name.split("(")[0].strip().removeprefix("void ")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ours", type=Path, help="ncu raw CSV page of `bench/profiling.py kernel`")
    parser.add_argument("peer", type=Path, help="the same of `bench/profiling.py kernel --peer deepgemm`")
    parser.add_argument("--bench", type=Path, help="bench-<GPU>.json of `python -m moegemm bench` in the same call")
    parser.add_argument("--gpu", default=None, help="GPU name for the file name (default: the bench's, else 'gpu')")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    ours, peer = read_raw(args.ours), read_raw(args.peer)
    bench = json.loads(args.bench.read_text()) if args.bench else {}
    gpu = args.gpu or bench.get("env", {}).get("gpu", "gpu")
    origin = provenance("bench/ncu_counters.py")
    lines = [f"# fp8_block prefill against DeepGEMM: Nsight Compute counters ({gpu})", "",
             f"`python bench/ncu_counters.py` ({origin['commit'][:7]}) over the ncu raw pages of "
             f"`{_short(ours.get('Kernel Name', '?'))}` and `{_short(peer.get('Kernel Name', '?'))}` (the commands: the script's "
             "docstring): `python bench/profiling.py kernel` and `kernel --peer deepgemm`, 4 groups of ~8192 tokens "
             "(the benchmark's groups), N 6144, K 7168, ncu --set full at its locked clock.", ""]
    lines += table(ours, peer) + bench_lines(bench)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"counters-fp8-block-{gpu.replace(' ', '-')}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
