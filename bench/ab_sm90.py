"""A/B of sm90 kernel configurations on grouped_matmul, in one run on one GPU.

    python3 bench/ab_sm90.py OUT.json [PLAN ...]

For each case (format, shape, group sizes) every variant (a forced Sm90Config, or None for
the default choice) runs once for its output, which must match the first variant's within
`rtol` of the largest output (bit-identical is reported) and is captured in a CUDA graph, the
swizzled A-scale offsets passed so that no torch set-up kernel runs inside the call. Then the
case's graphs are timed together by bench/moe_layer.py's Timer (a sample of each a round, in a
shuffled order, L2 flushed; medians): under the H100's power cap, timing each in its own burst
gave each a different clock. The copy bandwidth is measured in
the same run; pct_copy = bytes of the touched weights and scales (+ tokens, output) / time /
copy bandwidth. A case whose fifth entry is "swiglu" times the gate/up step
(grouped_matmul_swiglu) fused and unfused instead of the product alone. PLANS below name the
sets of cases; the default runs all of them.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer  # noqa: E402
from moegemm import benchmark, grouped_matmul, grouped_matmul_swiglu, layouts  # noqa: E402
from moegemm.config import (Sm90Config, deepest_ring, override_config, sm90_config,  # noqa: E402
                            sm90_mx_config, weight_bytes)
from moegemm.formats import FORMATS  # noqa: E402

SHAPES = {"gptoss-up": (5760, 2880), "gptoss-down": (2880, 2880), "dsv3-up": (4096, 7168),
          "dsv3-down": (7168, 2048),
          # (time against tiles and stages: where a call's fixed cost goes)
          "n5760-k5760": (5760, 5760), "n11520-k2880": (11520, 2880), "n5760-k1408": (5760, 1408),
          "n2816-k2880": (2816, 2880), "n128-k256": (128, 256), "n128-k2880": (128, 2880)}


def poisson_sizes(groups: int, mean: float, seed: int) -> list[int]:
    """Tokens an expert of a layer with random routing (Poisson around `mean`)."""
    gen = torch.Generator().manual_seed(seed)
    return [int(v) for v in torch.poisson(torch.full((groups, ), float(mean)), generator=gen)]


def default_config(fmt: str, n: int, k: int, sizes: list[int]):
    if fmt in ("bf16", "fp8_block"):
        return sm90_config(FORMATS[fmt], n, k, sum(sizes) / len(sizes))
    return sm90_mx_config(FORMATS[fmt], n, k, sum(sizes) / len(sizes))


def bf16_tile_variants(fmt, n, k, sizes):
    """The bf16 kernel's tile arrangements at ~128 tokens a slot (gpt-oss-120b at 4096 tokens)."""
    tiles = {"split-64x128": dict(block_n=64, split_n=True, group_m=4),
             "split-64x256": dict(block_n=128, split_n=True, group_m=4),
             "normal-128x128": dict(block_n=128, group_m=4),
             "normal-128x256": dict(block_n=256, group_m=4)}
    return {"default": default_config(fmt, n, k, sizes),
            **{name: deepest_ring(Sm90Config(block_k=64, stages=2, **kw), 2, 2) for name, kw in tiles.items()}}


def bf16_swiglu_variants(fmt, n, k, sizes):
    """The library's choice (None: no override, so the fused step gets its own config) against
    the plain kernel's config forced on both steps."""
    return {"default": None, "plain-ring": default_config(fmt, n, k, sizes)}


def mxfp8_swiglu_variants(fmt, n, k, sizes):
    """The library's choice (None: the fused step gets its own config, the ring as deep as its
    epilogue's shared memory leaves) against the ring of 4 stages that the fused epilogue's
    [64, tokens] fp32 conversion left until the twentieth session, forced on both steps."""
    base = default_config(fmt, n, k, sizes)
    return {"default": None, "ring-4": replace(base, stages=4)}


def e2m1_variants(fmt, n, k, sizes):
    base = default_config(fmt, n, k, sizes)
    two = replace(base, split_k=False, consumer_regs=192)
    four = replace(base, split_k=True, consumer_regs=112)
    return {"two-warpgroups": _deepest(two, fmt), "split-k": _deepest(four, fmt)}


def default_variant(fmt, n, k, sizes):
    return {"default": default_config(fmt, n, k, sizes)}


def library_variant(fmt, n, k, sizes):
    """No override: every step (the fused one included) gets the library's own config."""
    return {"library": None}


def mxfp8_tile_variants(fmt, n, k, sizes):
    base = default_config(fmt, n, k, sizes)
    return {f"tokens-{t}": _deepest(replace(base, block_n=t), fmt) for t in (128, 64)}


def mxfp8_tail_variants(fmt, n, k, sizes):
    base = default_config(fmt, n, k, sizes)
    return {f"tail-{t}": _deepest(replace(base, tail_tokens=t, consumer_regs=240 if t else 232,
                                          short_tails=base.short_tails and t == 32), fmt)
            for t in (32, 0, 16)}


def short_tail_variants(fmt, n, k, sizes):
    """Tails of up to 16 tokens on a 16-wide accumulator, or every tail on the 32-wide one
    (config.Sm90Config.short_tails)."""
    base = default_config(fmt, n, k, sizes)
    return {"short-tails": replace(base, short_tails=True), "tails-32": replace(base, short_tails=False)}


CLAIM_ROUNDS = (0, 2, 4, 8, 16, 1000)


def _claim_variants(base):
    return {f"claim-{r}": replace(base, claim_rounds=r) for r in CLAIM_ROUNDS}


def schedule_variants(fmt, n, k, sizes):
    """The last rounds' tiles claimed as programs free up, against round-robin throughout (0) and
    claimed from the start (1000; kernels/sm90.py, schedule)."""
    return _claim_variants(default_config(fmt, n, k, sizes))


def fused_schedule_variants(fmt, n, k, sizes):
    """The same for the fused gate/up step's own config."""
    return _claim_variants(sm90_config(FORMATS[fmt], n, k, sum(sizes) / len(sizes), fused=True))


def walk_variants(fmt, n, k, sizes):
    """The narrow fp8_mma tiles' slot walk from chunks of slots, against three loads a slot
    (config.Sm90Config.chunk_walk)."""
    base = default_config(fmt, n, k, sizes)
    return {"walk-chunks": replace(base, chunk_walk=True), "walk-slots": replace(base, chunk_walk=False)}


def _deepest(cfg, fmt):
    """The ring as deep as shared memory allows (up to 12 stages), as the config functions do."""
    return deepest_ring(replace(cfg, stages=2), 1, 2, weight_bytes(FORMATS[fmt]))


# (format, shape, group sizes, variants)
PLANS = {
    "e2m1": [
        ("mxfp4", "gptoss-up", lambda: [2] * 128, e2m1_variants),
        ("mxfp4", "gptoss-down", lambda: [2] * 128, e2m1_variants),
        ("mxfp4", "gptoss-up", lambda: poisson_sizes(128, 2, 1), e2m1_variants),
        ("mxfp4", "gptoss-down", lambda: poisson_sizes(128, 2, 2), e2m1_variants),
        ("w4a8", "gptoss-up", lambda: [2] * 128, e2m1_variants),
        ("mxfp4", "gptoss-up", lambda: [8] * 128, e2m1_variants),
        ("mxfp4", "gptoss-down", lambda: [8] * 128, e2m1_variants),
        ("mxfp4", "gptoss-up", lambda: [1] * 4 + [0] * 124, e2m1_variants),
        ("mxfp4", "dsv3-up", lambda: [2] * 256, e2m1_variants),
    ],
    "e2m1-scaling": [
        (fmt, shape, lambda: [2] * 128, default_variant)
        for fmt in ("mxfp4", ) for shape in ("gptoss-up", "n5760-k5760", "n11520-k2880", "n5760-k1408",
                                               "gptoss-down", "n2816-k2880")
    ] + [("mxfp4", "gptoss-up", lambda: [1] * 4 + [0] * 124, e2m1_variants),
         ("mxfp4", "gptoss-up", lambda: [2] * 16 + [0] * 112, e2m1_variants)],
    "half-tiles": [
        ("mxfp4", shape, lambda: [2] * 128, default_variant) for shape in ("gptoss-down", "n2816-k2880", "gptoss-up")
    ],
    # a call's fixed cost: one tile of one stage, then slots to walk, then one tile a CTA
    "overhead": [
        ("mxfp4", shape, sizes, e2m1_variants)
        for shape in ("n128-k256", "n128-k2880")
        for sizes in (lambda: [1], lambda: [1] + [0] * 127, lambda: [0] * 127 + [1], lambda: [1] * 132)
    ],
    # a slot's last tile with up to 32 (16) more tokens, or a tile of its own for them
    "mxfp8-tail": [
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 3), mxfp8_tail_variants),
        ("mxfp8", "dsv3-down", lambda: poisson_sizes(256, 128, 4), mxfp8_tail_variants),
        ("mxfp8", "dsv3-up", lambda: [1024] * 32, mxfp8_tail_variants),
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 1024, 5)[:32], mxfp8_tail_variants),
    ],
    # tails of up to 16 tokens on their own narrow accumulator (~128 tokens an expert: ~40% of
    # the experts have 129-144), the fused gate/up step beside the products
    "short-tails": [
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 3), short_tail_variants),
        ("mxfp8", "dsv3-down", lambda: poisson_sizes(256, 128, 4), short_tail_variants),
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 11), short_tail_variants),
        ("mxfp8", "dsv3-up", lambda: [136] * 256, short_tail_variants),
        ("mxfp8", "dsv3-up", lambda: [152] * 256, short_tail_variants),
    ],
    # the promotion kernel's default configs at prefill (run under each kernel variant)
    "mxfp8-prefill": [
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 3), default_variant),
        ("mxfp8", "dsv3-down", lambda: poisson_sizes(256, 128, 4), default_variant),
        ("mxfp8", "dsv3-up", lambda: [1024] * 32, default_variant),
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 1024, 5)[:32], default_variant),
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(64, 40, 6), default_variant),
    ],
    # the bf16 kernel's tiles at ~128 tokens a slot, plain and with the fused SwiGLU epilogue
    "bf16-tiles": [
        ("bf16", "gptoss-up", lambda: poisson_sizes(128, 128, 7), bf16_tile_variants),
        ("bf16", "gptoss-down", lambda: poisson_sizes(128, 128, 8), bf16_tile_variants),
    ],
    # the fused gate/up step of the wide mxfp8 tiles (row pairs by shuffles, mxfp8 out) and the
    # unfused chain it replaces
    "mxfp8-swiglu": [
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 3), mxfp8_swiglu_variants, "swiglu"),
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 11), mxfp8_swiglu_variants, "swiglu"),
    ],
    # the fused gate/up step against the unfused chain: DeepSeek-V3 mxfp8 and gpt-oss-120b mxfp4
    # at ~128 tokens a slot (4096 tokens), gpt-oss-120b mxfp4 at ~16 (512 tokens)
    "fused-swiglu": [
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 3), library_variant, "swiglu"),
        ("mxfp4", "gptoss-up", lambda: poisson_sizes(128, 128, 7), library_variant, "swiglu"),
        ("mxfp4", "gptoss-up", lambda: poisson_sizes(128, 16, 17), library_variant, "swiglu"),
    ],
    "bf16-swiglu": [
        ("bf16", "gptoss-up", lambda: poisson_sizes(128, 128, 7), bf16_swiglu_variants, "swiglu"),
    ],
    "schedule": [
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 3), schedule_variants),
        ("mxfp8", "dsv3-down", lambda: poisson_sizes(256, 128, 4), schedule_variants),
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 11), schedule_variants),
        ("fp8_block", "dsv3-up", lambda: poisson_sizes(256, 128, 3), schedule_variants),
        ("fp8_block", "dsv3-down", lambda: poisson_sizes(256, 128, 4), schedule_variants),
        ("bf16", "gptoss-up", lambda: poisson_sizes(128, 128, 7), schedule_variants),
        ("bf16", "gptoss-down", lambda: poisson_sizes(128, 128, 8), schedule_variants),
        ("bf16", "gptoss-up", lambda: poisson_sizes(128, 128, 7), fused_schedule_variants, "swiglu-fused"),
    ],
    "walk": [
        ("mxfp8", "dsv3-down", lambda: poisson_sizes(256, 16, 13), walk_variants),
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 16, 15), walk_variants),
        ("mxfp8", "dsv3-down", lambda: poisson_sizes(256, 2, 14), walk_variants),
        ("mxfp8", "dsv3-up", lambda: [1] * 8 + [0] * 248, walk_variants),
        ("mxfp8", "dsv3-down", lambda: [0] * 100 + [1] * 8 + [0] * 148, walk_variants),
        ("mxfp4", "gptoss-up", lambda: poisson_sizes(128, 2, 1), walk_variants),
        ("mxfp4", "gptoss-down", lambda: poisson_sizes(128, 2, 2), walk_variants),
        ("mxfp4", "gptoss-up", lambda: poisson_sizes(128, 8, 16), walk_variants),
        ("mxfp4", "gptoss-up", lambda: [1] * 4 + [0] * 124, walk_variants),
        ("mxfp4", "gptoss-down", lambda: [0] * 60 + [1] * 4 + [0] * 64, walk_variants),
    ],
    "mxfp8-tiles": [
        ("mxfp8", "dsv3-up", lambda: poisson_sizes(256, 128, 3), mxfp8_tile_variants),
        ("mxfp8", "dsv3-down", lambda: poisson_sizes(256, 128, 4), mxfp8_tile_variants),
    ],
}


def kernel_times(replay, reps: int = 20) -> dict:
    """Mean device time (us) of each kernel in one replay, by name (torch profiler, L2 warm)."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    totals: dict = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / reps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _calls(inp, fmt, scale_offsets, step, bias):
    """{name: call} of a case: the product alone, or (step "swiglu") the gate/up step fused and
    unfused (gpt-oss's clamped SwiGLU with `bias`, bf16 out), or ("swiglu-fused") fused only."""
    if step not in ("swiglu", "swiglu-fused"):
        return {"": lambda: grouped_matmul(inp.a, inp.b, inp.a_scales, inp.b_scales, inp.a_offsets, inp.expert_ids,
                                           fmt=fmt, a_scale_offsets=scale_offsets, out=inp.out,
                                           scale_layout=inp.scale_layout)}
    def swiglu(fused):
        return lambda: grouped_matmul_swiglu(inp.a, inp.b, inp.a_scales, inp.b_scales, inp.a_offsets, inp.expert_ids,
                                             fmt=fmt, gate_up_layout="interleaved", out_fmt=fmt,
                                             activation="swiglu_oai", bias=bias,
                                             a_scale_offsets=scale_offsets, scale_layout=inp.scale_layout,
                                             fused=fused).data
    if step == "swiglu-fused":
        return {"/fused": swiglu(True)}
    return {"/fused": swiglu(True), "/unfused": swiglu(False)}


def run_case(fmt, shape, sizes, variants, copy_tbps, device, step=None, rtol=5e-3):
    n, k = SHAPES[shape]
    inp = benchmark.Inputs(fmt, n, k, sizes, device)
    scale_offsets = layouts.a_scale_offsets(inp.a_offsets) if inp.scale_layout == "swizzled" else None
    m = sum(sizes)
    bias = torch.randn(len(sizes), n, device=device)  # one for every variant (step "swiglu")

    rows, firsts, timed, pending = [], {}, {}, []
    timer = moe_layer.Timer(device)
    for name, cfg in variants(fmt, n, k, sizes).items():
        for suffix, call in _calls(inp, fmt, scale_offsets, step, bias).items():
            with override_config(cfg) if cfg is not None else contextlib.nullcontext():
                inp.out.fill_(float("nan"))
                out = call()
                torch.cuda.synchronize()
                out = (inp.out if out is None else out)[:m].float().clone()
                timed[name + suffix] = timer.prepare(call)
            pending.append((name, cfg, suffix, out))
    times = timer.in_turns(timed)
    for name, cfg, suffix, out in pending:
        ms = times[name + suffix][0]
        kernels = kernel_times(timed[name + suffix].graph.replay)
        first = firsts.setdefault(suffix, out)
        if first is out:
            diff, identical = 0.0, True
        else:
            scale = first.abs().max().clamp(min=1e-30)
            diff = float(((out - first).abs().max() / scale).nan_to_num(float("inf")))
            identical = bool(torch.equal(out.nan_to_num(0.0), first.nan_to_num(0.0)))
        variant = name + suffix
        row = dict(fmt=fmt, shape=shape, n=n, k=k, groups=len(sizes), tokens=m, variant=variant,
                   config=asdict(cfg) if cfg is not None else None, us=ms * 1e3, kernels_us=kernels,
                   pct_copy=100 * inp.bytes_moved() / (ms * 1e-3) / (copy_tbps * 1e12),
                   tflops=2.0 * m * n * k / (ms * 1e-3) / 1e12, max_diff=diff, identical=identical,
                   ok=diff <= rtol and bool(torch.isfinite(out).all()))
        rows.append(row)
        print(f"{fmt:<6} {shape:<12} {len(sizes):>3}x{m / len(sizes):<6.1f} {variant:<22} {row['us']:9.1f} us "
              f"{row['pct_copy']:5.1f}% copy {row['tflops']:6.1f} TFLOP/s  diff {diff:.1e}"
              f"{' =' if identical else ''}{'' if row['ok'] else '  MISMATCH'}  kernels " +
              " ".join(f"{kname[:24]}={us:.1f}" for kname, us in kernels.items()), flush=True)
    del inp
    torch.cuda.empty_cache()
    return rows


def main():
    out_path = Path(sys.argv[1])
    plans = sys.argv[2:] or list(PLANS)
    device = torch.device("cuda")
    copy_ms = benchmark._copy_ms(1 << 30, device)
    copy_tbps = 2 * (1 << 30) / (copy_ms * 1e-3) / 1e12
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tbps=copy_tbps,
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(env, flush=True)
    rows = []
    for plan in plans:
        for fmt, shape, sizes, variants, *step in PLANS[plan]:
            rows += run_case(fmt, shape, sizes(), variants, copy_tbps, device, *step)
    out_path.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} rows, {len(bad)} mismatched")
    sys.exit(2 if bad else 0)


if __name__ == "__main__":
    main()
