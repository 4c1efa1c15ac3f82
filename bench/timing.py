"""Timing shared by the bench scripts (moe_layer.py, ab.py, profiling.py): calls captured in CUDA
graphs and timed in shuffled turns with L2 flushed (Timer), per-kernel device times from the
torch profiler, and the GPU's power limit and top clock that make the turns necessary."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph. Call fn once before: a first call compiles, which a capture
    cannot."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_times(replay, reps: int, per_launch: bool = True) -> dict:
    """Mean device time (us) of each kernel of one replay() by name, largest first (torch
    profiler; L2 warm, so they add up to less than a flushed replay's time). per_launch: a
    kernel launched several times a replay (both products of a layer) is listed once per
    launch, name#i in launch order; otherwise its launches add up under its name."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    launches: dict = {}
    for event in events:
        launches.setdefault(event.name, []).append(event.device_time)
    totals: dict = {}
    for name, times in launches.items():
        per_replay = max(1, len(times) // reps) if per_launch else 1
        for i, us in enumerate(times):
            key = name if per_replay == 1 else f"{name}#{i % per_replay}"
            totals[key] = totals.get(key, 0.0) + us / reps
    return {name: round(us, 2) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def gpu_limits() -> str:
    """The GPU's power limit and top SM clock (nvidia-smi; "" without it): under a sustained load
    such as a row's rounds of turns the H100 runs at its power cap, at SM clocks down to ~1.4 GHz
    from 1.98 (throttle reason SW power cap: docs/perf-notes.md, "Timing")."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@dataclass
class Timed:
    """A call prepared for Timer.in_turns."""

    graph: object  # torch.cuda.CUDAGraph, or None (CPU, or the capture failed)
    eager_ms: float
    why: str


class Timer:
    """Times of a set of calls, taken call by call in a shuffled order: medians of at least
    MIN_SAMPLES samples, L2 flushed before each (as do_bench does); on the CPU (moe_layer.py's
    smoke run) one wall-clock call each.

    Under a sustained load the H100 runs at its power cap, its SM clock moving between ~1.4 and
    1.98 GHz within a second (docs/perf-notes.md, "Timing"; bench/ab.py power-cap). Timing each
    call in its own burst (do_bench) gave each a different power state: the same graph measured
    5.3 to 6.4 ms, and a call that always ran after another (in fixed turns) kept that one's
    bias. A sample of every call in each round, in a new random order every round, gives each
    call the same mix of states, so their ratios hold."""

    MIN_SAMPLES = 30
    ROUND_BUDGET_MS = 400  # rounds run until the samples of all calls take about this long

    def __init__(self, device, warmup=5, rep=40):
        self.device, self.warmup, self.rep = device, warmup, rep

    def bench(self, fn) -> float:
        """do_bench median (ms) of fn called on its own: eager times, the copy bandwidth."""
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median"))

    def prepare(self, fn) -> Timed:
        """fn timed eagerly (its first call warms up and compiles outside the capture), then
        captured in a CUDA graph for in_turns."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return Timed(None, (time.perf_counter() - t0) * 1e3, "no graph on the CPU")
        eager = self.bench(fn)
        try:
            return Timed(capture(fn), eager, "")
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            return Timed(None, eager, f"graph capture failed: {type(exc).__name__}: {str(exc)[:160]}")

    def in_turns(self, timed: dict) -> dict:
        """name -> (graph ms, eager ms, why): the graphs replayed a sample each a round, in a
        shuffled order."""
        graphs = {name: t.graph for name, t in timed.items() if t.graph is not None}
        medians: dict = {}
        if graphs:  # (only CUDA calls have one)
            import triton

            driver = triton.runtime.driver.active
            cache = driver.get_empty_cache_for_benchmark()
            total_ms = sum(max(timed[name].eager_ms, 1e-3) for name in graphs)
            rounds = max(self.MIN_SAMPLES, min(2000, int(self.ROUND_BUDGET_MS / total_ms)))
            order = random.Random(0)
            names = list(graphs)
            for graph in graphs.values():  # warm-up
                graph.replay()
            events = {name: [] for name in names}
            for _ in range(rounds):
                order.shuffle(names)
                for name in names:
                    driver.clear_cache(cache)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graphs[name].replay()
                    end.record()
                    events[name].append((start, end))
            torch.cuda.synchronize()
            medians = {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}
        return {name: (medians.get(name, math.nan), t.eager_ms, t.why) for name, t in timed.items()}

    def kernel_times(self, fn, reps: int = 10) -> dict:
        """kernel_times of one graph replay of fn, per launch (empty on the CPU or if the
        capture fails)."""
        if self.device.type != "cuda":
            return {}
        try:
            graph = capture(fn)
            return kernel_times(graph.replay, reps)
        except Exception:  # noqa: BLE001
            torch.cuda.synchronize()
            return {}

    def copy_tbps(self) -> float:
        """Copy bandwidth in TB/s, bytes read + written."""
        n = 1 << 30 if self.device.type == "cuda" else 1 << 26
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        if self.device.type == "cuda":
            ms = self.bench(lambda: dst.copy_(src))
        else:
            dst.copy_(src)
            t0 = time.perf_counter()
            dst.copy_(src)
            ms = (time.perf_counter() - t0) * 1e3
        return 2 * n / ms / 1e9
