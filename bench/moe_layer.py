"""The routed-expert part of a whole MoE layer: moegemm.moe_forward against plain PyTorch.

    python bench/moe_layer.py --out DIR [--quick] [--budget SECONDS]

Both sides start from the same topk_ids / topk_weights (router logits -> top-k is left out of
both) and run routing, gather (+ quantize), the gate/up product, SwiGLU (+ requantize), the
down product and the weighted combine. Models (tokens 1, 64, 512, 4096):

    DeepSeek-V3   H 7168, I 2048, 256 experts, top-8, swiglu        fp8_block, mxfp8
    gpt-oss-120b  H 2880, I 2880, 128 experts, top-4, swiglu_oai    mxfp4, bf16
                  (gate_up bias [E, 2I], down bias [E, H])

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
gpt-oss: mxfp4 codes and scales; the bf16 row and the baseline use their exact bf16 decoding.

Timing: medians, L2 flushed before every run. *_us: one call captured in a CUDA graph and
replayed (kernel time, no host launch cost, as moegemm/benchmark.py reports), at least 30
samples a call, a row's calls a sample each a round in a shuffled order (Timer says why);
*_eager_us: the Python call, triton.testing.do_bench on its own. If any capture of a row
fails, that row reports eager times everywhere (timing = "eager"). The copy bandwidth (1 GiB
device-to-device, bytes read + written) is measured in the same run; read_time_us = bytes of
the weights and scales of the experts present in topk_ids / copy bandwidth; ratio_to_read =
ours_us / read_time_us.

Checks (outside timing): every output must be finite; at 64 tokens ours is compared with the
baseline (relative Frobenius error; tolerances in TOL) and the unfused chain with the fused
one. A failed check marks the row (check = "FAIL ..."), is printed, and makes the exit status
2 after the results are written. A row that raises records the error in `notes` and the run
goes on. Rows not started by --budget seconds are skipped (recorded as such).

Writes DIR/moe-layer-<GPU name, spaces as ->.json (rows + env: the script, the git commit of the
tree and whether it had uncommitted changes; MOEGEMM_COMMIT overrides the commit) and .csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

# moegemm from MOEGEMM_TREE (bench/ab.py's two-revision runs: another revision's tree), else this one
sys.path.insert(0, os.environ.get("MOEGEMM_TREE") or str(Path(__file__).resolve().parents[1]))

import moegemm
from moegemm import layouts

MODELS = {
    "DeepSeek-V3": {"hidden": 7168, "width": 2048, "experts": 256, "top_k": 8, "activation": "swiglu",
                    "family": "fp8", "fmts": ("fp8_block", "mxfp8")},
    "gpt-oss-120b": {"hidden": 2880, "width": 2880, "experts": 128, "top_k": 4, "activation": "swiglu_oai",
                     "family": "mxfp4", "fmts": ("mxfp4", "bf16")},
}
# --cpu-smoke: the same two families at toy sizes.
SMOKE_MODELS = {
    "tiny-dsv3": {"hidden": 256, "width": 128, "experts": 8, "top_k": 2, "activation": "swiglu",
                  "family": "fp8", "fmts": ("fp8_block", "mxfp8")},
    "tiny-gpt-oss": {"hidden": 256, "width": 128, "experts": 8, "top_k": 2, "activation": "swiglu_oai",
                     "family": "mxfp4", "fmts": ("mxfp4", "bf16")},
}
TOKENS = (1, 64, 512, 4096)
QUICK_TOKENS = (64, 4096)
CHECK_TOKENS = (64,)
FUSED_FMTS = ("mxfp8", "mxfp4", "bf16")  # the fused-epilogue targets: fused vs unfused timed
# Relative Frobenius error of ours against the baseline on the same real weights. bf16: only
# rounding differs. fp8/mxfp8: the activations' 8-bit quantization (ours per 1x128 / 1x32
# block, the baseline per row). mxfp4: ours also quantizes the activations to e2m1 (the
# baseline keeps them bf16), about 0.2 measured at gpt-oss sizes; tests/test_moe.py allows 0.4.
TOL = {"bf16": 2e-2, "fp8_block": 0.1, "mxfp8": 0.1, "mxfp4": 0.3}
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU



def gate_up_layout(fmt: str) -> str:
    """The gate/up row order of the layer's weights (moegemm.MoE's): [gate; up] for fp8_block."""
    return "concat" if fmt == "fp8_block" else "interleaved"

def log(msg: str, start: float):
    print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)


# ---- random weights, built on the device -------------------------------------------------

def random_e4m3(shape, device, gen) -> torch.Tensor:
    """e4m3 codes of randn values (unit scale), in slices to keep the fp32 temporaries small."""
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    flat = out.view(-1, shape[-1])
    step = max(1, (1 << 26) // shape[-1])
    for i in range(0, flat.shape[0], step):
        rows = flat[i:i + step]
        rows.copy_(torch.randn(rows.shape, device=device, generator=gen))
    return out


def e8m0_value(b: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> fp32 2^(b - 127)."""
    return torch.exp2(b.float() - 127.0)


class Fp8Weights:
    """DeepSeek-V3-like: one set of e4m3 codes [E, 2I, H] / [E, H, I] and power-of-two scales
    per (expert, 128-row block), constant along K: the same real weights in fp8_block, mxfp8,
    rowwise FP8 and bf16."""

    def __init__(self, cfg: dict, device, gen):
        e, h, i = cfg["experts"], cfg["hidden"], cfg["width"]
        self.cfg, self.device = cfg, device
        self.gu_codes = random_e4m3((e, 2 * i, h), device, gen)
        self.dn_codes = random_e4m3((e, h, i), device, gen)

        def row_bytes(n):  # scale byte of every row, constant over 128-row blocks; ~2^-6 (1/sqrt(K))
            blocks = torch.randint(120, 123, (e, math.ceil(n / 128)), dtype=torch.uint8, device=device, generator=gen)
            return blocks.repeat_interleave(128, dim=1)[:, :n].contiguous()

        self.gu_bytes, self.dn_bytes = row_bytes(2 * i), row_bytes(h)
        self._ours: dict = {}
        self._bf16 = None

    def ours(self, fmt: str):
        if fmt not in self._ours:
            self._ours = {fmt: (self._operand(self.gu_codes, self.gu_bytes, fmt),
                                self._operand(self.dn_codes, self.dn_bytes, fmt))}
        return self._ours[fmt]

    @staticmethod
    def _operand(codes, row_bytes, fmt):
        e, n, k = codes.shape
        if fmt == "fp8_block":
            blocks = e8m0_value(row_bytes[:, ::128])  # [E, ceil(N/128)]
            scales = blocks[:, :, None].expand(e, blocks.shape[1], math.ceil(k / 128)).contiguous()
            return moegemm.QuantizedTensor(codes, scales, "fp8_block", "b", "plain")
        if fmt == "mxfp8":
            plain = row_bytes[:, :, None].expand(e, n, k // 32).contiguous()
            scales = layouts.swizzle_b_scales(plain).view(torch.float8_e8m0fnu)
            return moegemm.QuantizedTensor(codes, scales, "mxfp8", "b", "swizzled")
        raise ValueError(fmt)

    def gate_up_layout(self, fmt: str) -> str:
        return "concat" if fmt == "fp8_block" else "interleaved"

    def rowwise(self):
        """(e4m3 [E, 2I, H], fp32 [E, 2I], e4m3 [E, H, I], fp32 [E, H]) for _scaled_grouped_mm."""
        return self.gu_codes, e8m0_value(self.gu_bytes), self.dn_codes, e8m0_value(self.dn_bytes)

    def bf16(self):
        """The same real weights in bf16 (built on first use, in slices of experts)."""
        if self._bf16 is None:
            def dequant(codes, row_bytes):
                out = torch.empty(codes.shape, dtype=torch.bfloat16, device=codes.device)
                for s in range(0, codes.shape[0], 8):
                    out[s:s + 8] = (codes[s:s + 8].float() * e8m0_value(row_bytes[s:s + 8])[:, :, None])
                return out
            self._bf16 = (dequant(self.gu_codes, self.gu_bytes), dequant(self.dn_codes, self.dn_bytes))
        return self._bf16

    def biases(self):
        return None, None


class Mxfp4Weights:
    """gpt-oss-like: packed e2m1 codes (random bytes) with e8m0 scales per 1x32 block, gate/up
    rows interleaved, biases; the bf16 row and the baseline use the exact bf16 decoding."""

    def __init__(self, cfg: dict, device, gen):
        e, h, i = cfg["experts"], cfg["hidden"], cfg["width"]
        self.cfg, self.device = cfg, device

        def operand(n, k):  # codes RMS ~2.9, scales ~2^-7: ~1/sqrt(K) overall
            data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
            sb = torch.randint(118, 122, (e, n, k // 32), dtype=torch.uint8, device=device, generator=gen)
            return data, sb

        self.gu_data, self.gu_sbytes = operand(2 * i, h)
        self.dn_data, self.dn_sbytes = operand(h, i)
        self._mx = None
        self._bf16 = (self._decode(self.gu_data, self.gu_sbytes), self._decode(self.dn_data, self.dn_sbytes))
        # bf16-representable values, so that ours (fp32 bias) and the baseline (bf16) add the same bias
        self.gu_bias = (torch.randn(e, 2 * i, device=device, generator=gen) * 0.1).bfloat16().float()
        self.dn_bias = (torch.randn(e, h, device=device, generator=gen) * 0.1).bfloat16().float()

    @staticmethod
    def _decode(data, sbytes):
        out = torch.empty(*data.shape[:2], data.shape[2] * 2, dtype=torch.bfloat16, device=data.device)
        for s in range(0, data.shape[0], 4):
            out[s:s + 4] = moegemm.dequantize_operand(data[s:s + 4], sbytes[s:s + 4].view(torch.float8_e8m0fnu),
                                                      "mxfp4", "b")
        return out

    def ours(self, fmt: str):
        if fmt == "bf16":
            return (moegemm.QuantizedTensor(self._bf16[0], None, "bf16", "b", "plain"),
                    moegemm.QuantizedTensor(self._bf16[1], None, "bf16", "b", "plain"))
        if fmt == "mxfp4":
            if self._mx is None:
                def swz(sb):
                    return layouts.swizzle_b_scales(sb).view(torch.float8_e8m0fnu)

                self._mx = (moegemm.QuantizedTensor(self.gu_data, swz(self.gu_sbytes), "mxfp4", "b", "swizzled"),
                            moegemm.QuantizedTensor(self.dn_data, swz(self.dn_sbytes), "mxfp4", "b", "swizzled"))
            return self._mx
        raise ValueError(fmt)

    def gate_up_layout(self, fmt: str) -> str:
        return "interleaved"

    def rowwise(self):
        return None

    def bf16(self):
        return self._bf16

    def biases(self):
        return self.gu_bias, self.dn_bias


def weight_bytes_per_expert(w_gate_up, w_down) -> float:
    total = 0
    for q in (w_gate_up, w_down):
        total += q.data.numel() * q.data.element_size()
        if q.scales is not None:
            total += q.scales.numel() * q.scales.element_size()
    return total / w_gate_up.data.shape[0]


# ---- the PyTorch baseline ----------------------------------------------------------------

def rowwise_fp8(a: torch.Tensor):
    """[M, K] -> (e4m3 [M, K], fp32 [M]): scale = amax / 448 per row."""
    scale = a.abs().amax(dim=1).float().clamp(min=1e-12) / 448.0
    return (a.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


class TorchMoE:
    """The routed experts in plain PyTorch. kind: "fp8_rowwise" (torch._scaled_grouped_mm) or
    "bf16" (torch._grouped_mm). Weights [E, N, K] (nn.Linear's layout), passed transposed."""

    def __init__(self, kind, w_gu, w_dn, s_gu=None, s_dn=None, *, gate_up_layout, activation, gu_bias=None,
                 dn_bias=None):
        self.kind, self.w_gu, self.w_dn, self.s_gu, self.s_dn = kind, w_gu, w_dn, s_gu, s_dn
        self.layout, self.activation = gate_up_layout, activation
        self.gu_bias = None if gu_bias is None else gu_bias.to(torch.bfloat16)
        self.dn_bias = None if dn_bias is None else dn_bias.to(torch.bfloat16)
        self.num_experts = w_gu.shape[0]

    def _mm(self, a, w, s, offs):
        if self.kind == "fp8_rowwise":
            aq, sa = rowwise_fp8(a)
            return torch._scaled_grouped_mm(aq, w.transpose(-2, -1), sa, s, offs=offs, out_dtype=torch.bfloat16,
                                            use_fast_accum=True)
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)

    def __call__(self, x, topk_ids, topk_weights):
        t, k = topk_ids.shape
        e = self.num_experts
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=e, min=0, max=e)  # ids are integers in [0, E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        token = order // k
        expert = flat.index_select(0, order).long()
        a = x.index_select(0, token)
        h = self._mm(a, self.w_gu, self.s_gu, offs)
        if self.gu_bias is not None:
            h = h + self.gu_bias.index_select(0, expert)
        if self.layout == "interleaved":
            gate, up = h[:, 0::2], h[:, 1::2]
        else:
            gate, up = h.chunk(2, dim=-1)
        if self.activation == "swiglu":
            mid = F.silu(gate) * up
        else:
            gate = gate.clamp(max=LIMIT)
            up = up.clamp(min=-LIMIT, max=LIMIT)
            mid = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
        c = self._mm(mid, self.w_dn, self.s_dn, offs)
        if self.dn_bias is not None:
            c = c + self.dn_bias.index_select(0, expert)
        w = topk_weights.reshape(-1).index_select(0, order).float()
        out = torch.zeros(t, c.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token, c.float() * w[:, None])
        return out.to(x.dtype)


# ---- timing ------------------------------------------------------------------------------

@dataclass
class Timed:
    """A call of a row, prepared for Timer.in_turns."""

    graph: object  # torch.cuda.CUDAGraph, or None (CPU, or the capture failed)
    eager_ms: float
    why: str


class Timer:
    """Times of a row's calls, taken call by call in a shuffled order: medians of at least
    MIN_SAMPLES samples, L2 flushed before each (as do_bench does); on the CPU (smoke) one
    wall-clock call each.

    Under a sustained load the H100 runs at its power cap, its SM clock moving between ~1.4 and
    1.98 GHz within a second (docs/perf-notes.md, "Timing"; bench/ab.py power-cap). Timing each call in its
    own burst (do_bench) gave each a different power state: the same graph measured 5.3 to 6.4
    ms, and a call that always ran after another (in fixed turns) kept that one's bias. A
    sample of every call in each round, in a new random order every round, gives each call the
    same mix of states, so their ratios hold."""

    MIN_SAMPLES = 30
    ROUND_BUDGET_MS = 400  # rounds run until the samples of all calls take about this long

    def __init__(self, device, warmup=5, rep=40):
        self.device, self.warmup, self.rep = device, warmup, rep

    def bench(self, fn) -> float:
        """do_bench median of one call (eager times and the copy bandwidth)."""
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
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return Timed(g, eager, "")
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
        """Mean device time (us) of each kernel of one graph replay of fn, by name (empty on
        the CPU or if the capture fails)."""
        if self.device.type != "cuda":
            return {}
        from torch.profiler import ProfilerActivity, profile

        try:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    g.replay()
                torch.cuda.synchronize()
            del g
        except Exception:  # noqa: BLE001
            torch.cuda.synchronize()
            return {}
        # A kernel launched several times a replay (both products) is listed once per launch,
        # name#i in launch order.
        events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
        launches: dict = {}
        for event in events:
            launches.setdefault(event.name, []).append(event.device_time)
        totals: dict = {}
        for name, times in launches.items():
            per_replay = max(1, len(times) // reps)
            for i, us in enumerate(times):
                key = name if per_replay == 1 else f"{name}#{i % per_replay}"
                totals[key] = totals.get(key, 0.0) + us / reps
        return {name: round(us, 2) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}

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


def routing_inputs(cfg: dict, tokens: int, seed: int, device):
    """x [T, H] bf16, topk_ids int32 [T, k] (distinct, uniform), topk_weights fp32 [T, k] (positive, sum 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, k = cfg["experts"], cfg["top_k"]
    x = torch.randn(tokens, cfg["hidden"], device=device, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, e, device=device, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, k, device=device, generator=gen) + 0.05
    weights = weights / weights.sum(dim=1, keepdim=True)
    return x, ids, weights


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def baseline_for(weights, fmt: str, cfg: dict, kind: str) -> TorchMoE:
    gu_bias, dn_bias = weights.biases()
    common = {"gate_up_layout": weights.gate_up_layout(fmt), "activation": cfg["activation"], "gu_bias": gu_bias,
              "dn_bias": dn_bias}
    if kind == "fp8_rowwise":
        w_gu, s_gu, w_dn, s_dn = weights.rowwise()
        return TorchMoE("fp8_rowwise", w_gu, w_dn, s_gu, s_dn, **common)
    w_gu, w_dn = weights.bf16()
    return TorchMoE("bf16", w_gu, w_dn, **common)


BASELINE_NAMES = {"fp8_rowwise": "torch._scaled_grouped_mm fp8 rowwise", "bf16": "torch._grouped_mm bf16"}


def build_weights(cfg: dict, m_index: int, device):
    """The model's weights (its index in MODELS seeds them)."""
    gen = torch.Generator(device=device).manual_seed(1234 + m_index)
    return (Fp8Weights if cfg["family"] == "fp8" else Mxfp4Weights)(cfg, device, gen)


def layer_call(cfg: dict, x, ids, topk_weights, weights, fmt: str, fused: bool):
    """Our layer on the row's inputs: moe_forward with fmt's weights (and the model's biases)."""
    w_gu, w_dn = weights.ours(fmt)
    gu_bias, dn_bias = weights.biases()
    return lambda: moegemm.moe_forward(x, ids, topk_weights, w_gu, w_dn, gate_up_layout=gate_up_layout(fmt),
                                       activation=cfg["activation"],
                                       gate_up_bias=gu_bias, down_bias=dn_bias, alpha=ALPHA, limit=LIMIT,
                                       fused=fused, backend="auto")


@dataclass
class GateUpStep:
    """The gate/up step alone, on tokens routed and quantized once as moe_forward does."""

    cfg: dict
    fmt: str
    w_gu: object
    bias: torch.Tensor | None
    plan: object
    a: object  # the quantized, routed tokens (moegemm.gather_quantize)
    layout: str
    a_scale_offsets: torch.Tensor | None

    @classmethod
    def build(cls, cfg: dict, x, ids, topk_weights, weights, fmt: str) -> "GateUpStep":
        w_gu, _ = weights.ours(fmt)
        gu_bias, _ = weights.biases()
        plan = moegemm.route(ids, cfg["experts"], topk_weights)
        layout = w_gu.scale_layout if w_gu.scales is not None else "plain"
        aso = plan.a_scale_offsets if layout == "swizzled" else None
        a = moegemm.gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, a_scale_offsets=aso,
                                    scale_layout=layout, num_scale_blocks=plan.scale_blocks_bound)
        return cls(cfg, fmt, w_gu, gu_bias, plan, a, layout, aso)

    def call(self, fused: bool):
        """grouped_matmul_swiglu with the fused epilogue or the unfused chain."""
        return lambda: moegemm.grouped_matmul_swiglu(
            self.a.data, self.w_gu.data, self.a.scales, self.w_gu.scales, self.plan.a_offsets, self.plan.expert_ids,
            fmt=self.fmt, gate_up_layout=gate_up_layout(self.fmt), out_fmt=self.fmt,
            activation=self.cfg["activation"], a_scale_offsets=self.a_scale_offsets,
            bias=self.bias, scale_layout=self.layout, out_scale_layout=self.layout,
            num_scale_blocks=self.plan.scale_blocks_bound, alpha=ALPHA, limit=LIMIT, fused=fused, backend="auto")


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


def gpu_limits() -> str:
    """The GPU's power limit and top SM clock (nvidia-smi; "" without it): under a sustained load
    such as a row's rounds of turns the H100 runs at its power cap, at SM clocks down to ~1.4 GHz
    from 1.98 (throttle reason SW power cap: docs/perf-notes.md, "Timing")."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


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
        plan = [(fmt, t) for fmt in fmts for t in tokens]
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
    head = (f"{'model':<13} {'fmt':<9} {'T':>5} {'ours':>9} {'unfused':>9} {'xfuse':>6} {'gu fused':>9} "
            f"{'gu unf':>9} {'xgu':>5} {'baseline':>9} {'xbase':>6} {'read':>8} {'ratio':>6} {'error':>8} "
            f"{'timing':<6} check / baseline kind")
    print(head)
    for r in rows:
        print(f"{r.model:<13} {r.fmt:<9} {r.tokens:>5} {_f(r.ours_us, 9, 1)} {_f(r.ours_unfused_us, 9, 1)} "
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
    fmts_per_model = (lambda cfg: cfg["fmts"][:1]) if args.quick else (lambda cfg: cfg["fmts"])
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
