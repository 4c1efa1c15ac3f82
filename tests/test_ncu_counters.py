"""bench/ncu_counters.py: an Nsight Compute raw page read into base units and set beside a peer's."""

import csv
import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def _raw_page(path: Path, values: dict):
    """An ncu raw CSV page: metric names, their units, one kernel's values."""
    names = ["Kernel Name", *values]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        writer.writerow(["", *(unit for unit, _ in values.values())])
        writer.writerow(["void k<1, 2>(float *)", *(value for _, value in values.values())])


def test_counters_table_units_stalls_and_timed_rows(tmp_path):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import ncu_counters

    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    _raw_page(tmp_path / "ours.csv", {
        "gpu__time_duration.sum": ("ms", "2.5"), "dram__bytes_read.sum": ("Mbyte", "1,500"),
        "sm__cycles_elapsed.avg.per_second": ("Ghz", "1.5"), "launch__grid_size": ("", "132"),
        stall.format("barrier"): ("inst", "4.5"), stall.format("selected"): ("inst", "1.0"),
        stall.format("wait"): ("inst", "0.5")})
    _raw_page(tmp_path / "peer.csv", {
        "gpu__time_duration.sum": ("msecond", "2.0"), "dram__bytes_read.sum": ("Gbyte", "1.7"),
        stall.format("barrier"): ("inst", "2.5"), stall.format("misc"): ("inst", "0.75")})
    ours, peer = ncu_counters.read_raw(tmp_path / "ours.csv"), ncu_counters.read_raw(tmp_path / "peer.csv")
    assert ours["dram__bytes_read.sum"] == 1.5e9 and peer["gpu__time_duration.sum"] == 2.0e-3
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in ncu_counters.table(ours, peer)[2:]}
    assert rows["kernel time at ncu's clock (ms)"] == ["2.500", "2.000 |"]
    assert rows["DRAM read (GB)"] == ["1.50", "1.70 |"]
    assert rows["SM clock (GHz)"] == ["1.50", "- |"]  # a counter the peer's page lacks
    stalls = [name for name in rows if name.startswith("stall:")]
    assert stalls[0].startswith("stall: barrier") and not any("selected" in s for s in stalls)
    assert {s.split()[1] for s in stalls} == {"barrier", "wait", "misc"}
    assert ncu_counters._short("void k<1, 2>(float *)") == "k<1, 2>"
    bench = {"env": {"gpu": "G", "commit": "abcdef0"}, "rows": [
        dict(fmt="fp8_block", groups=4, nominal=8192, n=64, k=128, valid_tokens=1000, ms=2.0, deepgemm_ms=1.0,
             vs_deepgemm=0.5),
        dict(fmt="fp8_block", groups=8, nominal=4096, n=64, k=128, valid_tokens=1000, ms=1.0, deepgemm_ms=2.0,
             vs_deepgemm=2.0)]}
    lines = ncu_counters.bench_lines(bench)
    assert lines[-1].endswith("| 1.000 |")  # geomean of 0.5 and 2
