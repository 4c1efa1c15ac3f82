"""A/B measurements with named plans: kernel variants, layer variants, two revisions, or their SASS.

    python bench/ab.py --list                                    the plans, one line each
    python bench/ab.py PLAN [PLAN ...] [--out DIR]               timing plans (GPU), variants in one process
    python bench/ab.py PLAN --base REV [--head REV] [--rounds N] two revisions of the library (GPU)
    python bench/ab.py sass --base REV [--head REV] [--out DIR]  no GPU: the SASS of every offline compile

Timing plans (one H100 or H200; each writes DIR/<plan>-<GPU>.json):
- kernel plans: for each case (format, shape, group sizes) every variant (a forced kernel config,
  or the library's own choice) runs once for its output, which must match the first variant's
  within 5e-3 of the largest output (bit-identical is reported), and is captured in a CUDA graph
  (the swizzled A-scale offsets passed, so no torch set-up kernel runs inside the call). The
  case's graphs are then timed together by bench/moe_layer.py's Timer: a sample of each graph a
  round, in a new shuffled order every round, L2 flushed before each sample (do_bench's flush),
  a warm-up replay first, medians of >= 30 samples. Under a sustained load the H100 runs at its
  power cap with the SM clock moving within a second; timing each variant in a burst of its own
  gave each a different clock (plan power-cap). Per-kernel device times come from the torch
  profiler (L2 warm). pct_copy = bytes of the touched weights, scales, tokens and output / time /
  the copy bandwidth measured in the same run.
- layer plans (layer-*): the whole MoE layer of bench/moe_layer.py captured once per variant,
  timed in turns with the PyTorch baseline, twice.
- fused-ceiling, scatter-check, activation-sweep, power-cap: see their functions.

Two revisions (--base REV, --head REV or the working tree): each revision is checked out into a
temporary git worktree; the plan runs in a process of its own per revision, the two alternating
for --rounds rounds (base, head, head, base, ...), each case with the library's own choice (no
forced variant: the revisions differ in code). The library is imported from the revision's tree
(MOEGEMM_TREE), the harness (this file, moe_layer.py) from the current one. Processes cannot share
a power state as graphs in one process do, so compare only ratios that hold over the rounds.

sass (no GPU): runs `pytest -q tests/test_compile_sm90.py tests/test_routing.py -k compile` in each
revision's tree with MOEGEMM_SASS_DUMP=<dir> (moegemm/kernels/offline.py writes each compiled
kernel's SASS to <dir>/<pytest case>.sass; for a revision whose offline.py predates that, a
pytest plugin of this file adds it), then compares the dumps case by case after normalizing
(addresses, encodings, kernel names and section headers dropped; instructions and operands kept)
and writes DIR/sass.md and DIR/sass.json: case, identical or not, instruction counts, the first
differing instruction, the largest opcode count changes; cases present on one side only apart.

Every result file names this script, the plan and the commit of the tree that made it (dirty or
not; MOEGEMM_COMMIT overrides the commit where the tree's copy has a stale git history).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TREE = Path(os.environ.get("MOEGEMM_TREE") or ROOT)  # where moegemm is imported from
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TREE))

SCRIPT = "bench/ab.py"


# ---- provenance ---------------------------------------------------------------------------------

def _git(*args, cwd=ROOT, check=True) -> str:
    run = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    if check and run.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {run.stderr.strip()}")
    return run.stdout.strip()


def record(plan: str, **extra) -> dict:
    """This script, the plan and the commit of the harness's tree (MOEGEMM_COMMIT overrides it)."""
    commit, dirty = os.environ.get("MOEGEMM_COMMIT"), None
    if not commit:
        try:
            commit = _git("rev-parse", "HEAD")
            dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        except (SystemExit, OSError, subprocess.SubprocessError):
            commit = "unknown"
    return dict(script=SCRIPT, plan=plan, commit=commit, dirty=dirty, **extra)


def _gpu_env(timer) -> dict:
    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_tbps=round(timer.copy_tbps(), 4), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                library=str(TREE))


def _library_only() -> bool:
    """Set for the processes of a two-revision run: every case with the library's own choice."""
    return os.environ.get("AB_LIBRARY_ONLY") == "1"


# ---- kernel plans: variants of a grouped_matmul (or its gate/up step) in one process -------------

SHAPES = {"gptoss-up": (5760, 2880), "gptoss-down": (2880, 2880), "dsv3-up": (4096, 7168),
          "dsv3-down": (7168, 2048),
          # time against tiles and stages: where a call's fixed cost goes
          "n5760-k5760": (5760, 5760), "n11520-k2880": (11520, 2880), "n5760-k1408": (5760, 1408),
          "n2816-k2880": (2816, 2880), "n128-k256": (128, 256), "n128-k2880": (128, 2880)}


def poisson_sizes(groups: int, mean: float, seed: int) -> list[int]:
    """Tokens an expert of a layer with random routing (Poisson around `mean`)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [int(v) for v in torch.poisson(torch.full((groups, ), float(mean)), generator=gen)]


def _config():
    import moegemm.config as config

    return config


def default_config(fmt: str, n: int, k: int, sizes: list[int]):
    from moegemm.formats import FORMATS

    c = _config()
    mean = sum(sizes) / len(sizes)
    if fmt in ("bf16", "fp8_block"):
        return c.sm90_config(FORMATS[fmt], n, k, mean)
    return c.sm90_mx_config(FORMATS[fmt], n, k, mean)


def _deepest(cfg, fmt):
    """The ring as deep as shared memory allows (up to 12 stages), as the config functions do."""
    from moegemm.formats import FORMATS

    return _config().deepest_ring(replace(cfg, stages=2), FORMATS[fmt])


def library_variant(fmt, n, k, sizes):
    """No override: every step (the fused one included) gets the library's own config."""
    return {"library": None}


def default_variant(fmt, n, k, sizes):
    return {"default": default_config(fmt, n, k, sizes)}


def bf16_tile_variants(fmt, n, k, sizes):
    """The bf16 kernel's tile arrangements at ~128 tokens a slot (gpt-oss-120b at 4096 tokens)."""
    from moegemm.formats import FORMATS

    c = _config()
    tiles = {"split-64x128": dict(block_n=64, split_n=True, group_m=4),
             "split-64x256": dict(block_n=128, split_n=True, group_m=4),
             "normal-128x128": dict(block_n=128, group_m=4),
             "normal-128x256": dict(block_n=256, group_m=4)}
    return {"default": default_config(fmt, n, k, sizes),
            **{name: c.deepest_ring(c.DenseConfig(block_k=64, stages=2, **kw), FORMATS[fmt])
               for name, kw in tiles.items()}}


def bf16_fused_tile_variants(fmt, n, k, sizes):
    """The fused SwiGLU epilogue on each bf16 tile arrangement, its ring as deep as the fused
    scratch allows."""
    from moegemm.formats import FORMATS

    c = _config()
    tiles = {"split-64x128": dict(block_n=64, split_n=True, group_m=4),
             "split-64x256": dict(block_n=128, split_n=True, group_m=4),
             "normal-128x128": dict(block_n=128, group_m=4), "normal-128x256": dict(block_n=256, group_m=4)}
    return {name: c.deepest_ring(c.DenseConfig(block_k=64, stages=2, **kw), FORMATS[fmt], fused=True)
            for name, kw in tiles.items()}


def bf16_swiglu_variants(fmt, n, k, sizes):
    """The library's choice (None: the fused step gets its own config) against the plain
    kernel's config forced on both steps (its ring a stage shorter than the fused one's)."""
    return {"library": None, "plain-ring": default_config(fmt, n, k, sizes)}


def mxfp8_swiglu_variants(fmt, n, k, sizes):
    """The library's choice against a ring of 4 stages forced on both steps (what the fused
    epilogue's [64, tokens] fp32 conversion through shared memory left)."""
    return {"library": None, "ring-4": replace(default_config(fmt, n, k, sizes), stages=4)}


def e2m1_variants(fmt, n, k, sizes):
    """e2m1 weights at decode: two consumer warpgroups, or four splitting each stage's K (split-K)."""
    base = default_config(fmt, n, k, sizes)
    two = replace(base, split_k=False, consumer_regs=192)
    four = replace(base, split_k=True, consumer_regs=112)
    return {"two-warpgroups": _deepest(two, fmt), "split-k": _deepest(four, fmt)}


def mxfp8_tile_variants(fmt, n, k, sizes):
    """128-token tiles (with the default's tails) or 64-token tiles (no tails: they are for 128)."""
    base = default_config(fmt, n, k, sizes)
    narrow = replace(base, token_tile=64, tail_tokens=0, short_tails=False, consumer_regs=232)
    return {"tokens-128": base, "tokens-64": _deepest(narrow, fmt)}


def mxfp8_tail_variants(fmt, n, k, sizes):
    """A slot's last tile with up to 32 (16) more tokens, or none (a tile of their own)."""
    base = default_config(fmt, n, k, sizes)
    return {f"tail-{t}": _deepest(replace(base, tail_tokens=t, consumer_regs=240 if t else 232,
                                          short_tails=base.short_tails and t == 32), fmt)
            for t in (32, 0, 16)}


def short_tail_variants(fmt, n, k, sizes):
    """Tails of up to 16 tokens on a 16-wide accumulator, or every tail on the 32-wide one."""
    base = default_config(fmt, n, k, sizes)
    return {"short-tails": replace(base, short_tails=True), "tails-32": replace(base, short_tails=False)}


def mxfp8_kernel_variants(fmt, n, k, sizes):
    """mxfp8 by fp8 wgmma and per-k32 promotion (the default) or by the bf16-decoding kernel."""
    from moegemm.formats import FORMATS

    c = _config()
    base = default_config(fmt, n, k, sizes)
    tokens = base.token_tile
    decoding = c.DecodeConfig(token_tile=tokens, stages=2, group_m=base.group_m, consumer_regs=192,
                              sub_steps=2 if tokens < 128 else 1)
    return {"promotion": base, "decoding": c.deepest_ring(decoding, FORMATS[fmt])}


def stage_step_variants(fmt, n, k, sizes):
    """The decoding kernel's ring stage carrying 1, 2 or 4 block_k-wide K steps (the default: 2
    below 128-token tiles, 1 on them), the ring as deep as shared memory allows."""
    from moegemm.formats import FORMATS

    c = _config()
    base = default_config(fmt, n, k, sizes)
    return {f"steps-{s}": c.deepest_ring(replace(base, sub_steps=s, stages=2), FORMATS[fmt]) for s in (1, 2, 4)}


CLAIM_ROUNDS = (0, 2, 4, 8, 16, 1000)


def schedule_variants(fmt, n, k, sizes):
    """The last rounds' tiles claimed as programs free up, against round-robin throughout (0) and
    claimed from the start (1000)."""
    base = default_config(fmt, n, k, sizes)
    return {f"claim-{r}": replace(base, claim_rounds=r) for r in CLAIM_ROUNDS}


def fused_schedule_variants(fmt, n, k, sizes):
    """The same for the fused gate/up step's own config."""
    from moegemm.formats import FORMATS

    base = _config().sm90_config(FORMATS[fmt], n, k, sum(sizes) / len(sizes), fused=True)
    return {f"claim-{r}": replace(base, claim_rounds=r) for r in CLAIM_ROUNDS}


def walk_variants(fmt, n, k, sizes):
    """The narrow fp8-wgmma tiles' slot walk from chunks of slots, against three loads a slot."""
    base = default_config(fmt, n, k, sizes)
    return {"walk-chunks": replace(base, chunk_walk=True), "walk-slots": replace(base, chunk_walk=False)}


def ring_variants(fmt, n, k, sizes):
    """The ring as deep as shared memory allows (the config functions' rule) against shallower ones."""
    base = default_config(fmt, n, k, sizes)
    return {f"stages-{s}": replace(base, stages=s) for s in sorted({base.stages, max(2, base.stages - 2),
                                                                    max(2, base.stages // 2)}, reverse=True)}


def _fixed(sizes):
    return lambda: list(sizes)


def _poisson(groups, mean, seed, take=None):
    return lambda: poisson_sizes(groups, mean, seed)[:take]


# (format, shape, group sizes, variants[, step]); step "swiglu" times the gate/up step fused and
# unfused, "swiglu-fused" the fused step only
KERNEL_PLANS = {
    "e2m1": ("e2m1 weights at decode: two consumer warpgroups or split-K", [
        ("mxfp4", "gptoss-up", _fixed([2] * 128), e2m1_variants),
        ("mxfp4", "gptoss-down", _fixed([2] * 128), e2m1_variants),
        ("mxfp4", "gptoss-up", _poisson(128, 2, 1), e2m1_variants),
        ("mxfp4", "gptoss-down", _poisson(128, 2, 2), e2m1_variants),
        ("w4a8", "gptoss-up", _fixed([2] * 128), e2m1_variants),
        ("mxfp4", "gptoss-up", _fixed([8] * 128), e2m1_variants),
        ("mxfp4", "gptoss-down", _fixed([8] * 128), e2m1_variants),
        ("mxfp4", "gptoss-up", _fixed([1] * 4 + [0] * 124), e2m1_variants),
        ("mxfp4", "dsv3-up", _fixed([2] * 256), e2m1_variants),
    ]),
    "e2m1-scaling": ("e2m1 decode time against K and N (where a call's fixed cost goes)", [
        ("mxfp4", shape, _fixed([2] * 128), default_variant)
        for shape in ("gptoss-up", "n5760-k5760", "n11520-k2880", "n5760-k1408", "gptoss-down", "n2816-k2880")
    ] + [("mxfp4", "gptoss-up", _fixed([1] * 4 + [0] * 124), e2m1_variants),
         ("mxfp4", "gptoss-up", _fixed([2] * 16 + [0] * 112), e2m1_variants)]),
    "overhead": ("a call's fixed cost: one tile of one stage, slots to walk, one tile a CTA", [
        ("mxfp4", shape, _fixed(sizes), e2m1_variants)
        for shape in ("n128-k256", "n128-k2880")
        for sizes in ([1], [1] + [0] * 127, [0] * 127 + [1], [1] * 132)
    ]),
    "mxfp8-kernels": ("mxfp8 by fp8 wgmma + promotion or by bf16 decoding, decode to prefill", [
        ("mxfp8", "dsv3-up", _fixed([2] * 256), mxfp8_kernel_variants),
        ("mxfp8", "dsv3-down", _fixed([2] * 256), mxfp8_kernel_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 16, 13), mxfp8_kernel_variants),
        ("mxfp8", "dsv3-up", _poisson(64, 40, 6), mxfp8_kernel_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), mxfp8_kernel_variants),
        ("mxfp8", "dsv3-up", _fixed([1024] * 32), mxfp8_kernel_variants),
    ]),
    "mxfp8-tiles": ("mxfp8 at ~128 tokens an expert: 128- or 64-token promotion tiles", [
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), mxfp8_tile_variants),
        ("mxfp8", "dsv3-down", _poisson(256, 128, 4), mxfp8_tile_variants),
    ]),
    "mxfp8-tail": ("a slot's last 128-token tile with up to 32 (16) more tokens, or none", [
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), mxfp8_tail_variants),
        ("mxfp8", "dsv3-down", _poisson(256, 128, 4), mxfp8_tail_variants),
        ("mxfp8", "dsv3-up", _fixed([1024] * 32), mxfp8_tail_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 1024, 5, 32), mxfp8_tail_variants),
    ]),
    "short-tails": ("tails of <= 16 tokens on a 16-wide accumulator or on the 32-wide one", [
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), short_tail_variants),
        ("mxfp8", "dsv3-down", _poisson(256, 128, 4), short_tail_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 128, 11), short_tail_variants),
        ("mxfp8", "dsv3-up", _fixed([136] * 256), short_tail_variants),
        ("mxfp8", "dsv3-up", _fixed([152] * 256), short_tail_variants),
    ]),
    "mxfp8-prefill": ("the promotion kernel's default configs at prefill (for two revisions)", [
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), default_variant),
        ("mxfp8", "dsv3-down", _poisson(256, 128, 4), default_variant),
        ("mxfp8", "dsv3-up", _fixed([1024] * 32), default_variant),
        ("mxfp8", "dsv3-up", _poisson(256, 1024, 5, 32), default_variant),
        ("mxfp8", "dsv3-up", _poisson(64, 40, 6), default_variant),
    ]),
    "families": ("every sm90 kernel at the library's own config, decode to prefill (for two revisions)", [
        ("bf16", "gptoss-up", _poisson(128, 2, 21), library_variant),  # dense, swapped 16
        ("bf16", "gptoss-down", _poisson(128, 30, 22), library_variant),  # dense, swapped 64
        ("bf16", "gptoss-up", _poisson(128, 128, 7), library_variant),  # dense, split-n
        ("bf16", "gptoss-up", _fixed([4096] * 8), library_variant),  # dense, normal 128 x 256
        ("fp8_block", "dsv3-down", _poisson(256, 16, 23), library_variant),  # fp8_block, swapped 32
        ("fp8_block", "dsv3-up", _poisson(256, 128, 3), library_variant),  # fp8_block, split-n
        ("fp8_block", "dsv3-up", _fixed([4096] * 8), library_variant),  # fp8_block, 128 x 256 halves
        ("mxfp8", "dsv3-down", _poisson(256, 2, 24), library_variant),  # mxfp8, narrow 16
        ("mxfp8", "dsv3-up", _poisson(256, 16, 25), library_variant),  # mxfp8, narrow 32, chunked walk
        ("mxfp8", "dsv3-up", _poisson(64, 40, 6), library_variant),  # mxfp8, wide 64
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), library_variant),  # mxfp8, wide 128 with tails
        ("mxfp8", "dsv3-up", _fixed([4096] * 8), library_variant),  # mxfp8, wide 128
        ("mxfp4", "gptoss-up", _poisson(128, 2, 1), library_variant),  # e2m1 split-K, 8 tokens
        ("mxfp4", "gptoss-down", _poisson(128, 2, 2), library_variant),  # e2m1 split-K, half tiles
        ("w4a8", "dsv3-up", _poisson(256, 8, 26), library_variant),  # e2m1 split-K, 16 tokens
        ("nvfp4", "dsv3-down", _poisson(256, 16, 27), library_variant),  # decode kernel, 32 tokens
        ("mxfp4", "gptoss-up", _poisson(128, 40, 28), library_variant),  # decode kernel, 64 tokens
        ("nvfp4", "dsv3-up", _fixed([4096] * 8), library_variant),  # decode kernel, 128 tokens
        ("w4a8", "gptoss-up", _poisson(128, 128, 7), library_variant),  # decode kernel, 128 tokens
        ("bf16", "gptoss-up", _poisson(128, 32, 29), library_variant, "swiglu-fused"),  # fused, swapped
        ("bf16", "gptoss-up", _fixed([4096] * 8), library_variant, "swiglu-fused"),  # fused, normal
        ("mxfp8", "dsv3-up", _poisson(256, 16, 25), library_variant, "swiglu-fused"),  # fused, narrow
        ("mxfp8", "dsv3-up", _fixed([4096] * 8), library_variant, "swiglu-fused"),  # fused, wide
        ("mxfp4", "gptoss-up", _poisson(128, 0.2, 30), library_variant, "swiglu-fused"),  # fused, e2m1
        ("mxfp4", "gptoss-up", _poisson(128, 128, 7), library_variant, "swiglu-fused"),  # fused, decode 128
    ]),
    "bf16-tiles": ("the bf16 kernel's tile arrangements at ~128 tokens a slot", [
        ("bf16", "gptoss-up", _poisson(128, 128, 7), bf16_tile_variants),
        ("bf16", "gptoss-down", _poisson(128, 128, 8), bf16_tile_variants),
    ]),
    "bf16-fused-tiles": ("the bf16 fused gate/up step on each tile arrangement, and the unfused chain", [
        ("bf16", "gptoss-up", _poisson(128, 128, 7), library_variant, "swiglu"),
        ("bf16", "gptoss-up", _poisson(128, 128, 7), bf16_fused_tile_variants, "swiglu-fused"),
    ]),
    "bf16-swiglu": ("the bf16 gate/up step fused and unfused; the plain kernel's ring forced", [
        ("bf16", "gptoss-up", _poisson(128, 128, 7), bf16_swiglu_variants, "swiglu"),
    ]),
    "mxfp8-swiglu": ("the mxfp8 gate/up step fused (wide tiles) and unfused; a 4-stage ring forced", [
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), mxfp8_swiglu_variants, "swiglu"),
        ("mxfp8", "dsv3-up", _poisson(256, 128, 11), mxfp8_swiglu_variants, "swiglu"),
    ]),
    "fused-swiglu": ("the library's gate/up step fused and unfused: DeepSeek-V3 mxfp8, gpt-oss mxfp4", [
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), library_variant, "swiglu"),
        ("mxfp4", "gptoss-up", _poisson(128, 128, 7), library_variant, "swiglu"),
        ("mxfp4", "gptoss-up", _poisson(128, 16, 17), library_variant, "swiglu"),
    ]),
    "schedule": ("round-robin tiles, the last rounds claimed, or every tile claimed", [
        ("mxfp8", "dsv3-up", _poisson(256, 128, 3), schedule_variants),
        ("mxfp8", "dsv3-down", _poisson(256, 128, 4), schedule_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 128, 11), schedule_variants),
        ("fp8_block", "dsv3-up", _poisson(256, 128, 3), schedule_variants),
        ("fp8_block", "dsv3-down", _poisson(256, 128, 4), schedule_variants),
        ("bf16", "gptoss-up", _poisson(128, 128, 7), schedule_variants),
        ("bf16", "gptoss-down", _poisson(128, 128, 8), schedule_variants),
        ("bf16", "gptoss-up", _poisson(128, 128, 7), fused_schedule_variants, "swiglu-fused"),
    ]),
    "walk": ("the slot walk from chunks of 31 slots or three loads a slot, narrow tiles", [
        ("mxfp8", "dsv3-down", _poisson(256, 16, 13), walk_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 16, 15), walk_variants),
        ("mxfp8", "dsv3-down", _poisson(256, 2, 14), walk_variants),
        ("mxfp8", "dsv3-up", _fixed([1] * 8 + [0] * 248), walk_variants),
        ("mxfp8", "dsv3-down", _fixed([0] * 100 + [1] * 8 + [0] * 148), walk_variants),
        ("mxfp4", "gptoss-up", _poisson(128, 2, 1), walk_variants),
        ("mxfp4", "gptoss-down", _poisson(128, 2, 2), walk_variants),
        ("mxfp4", "gptoss-up", _poisson(128, 8, 16), walk_variants),
        ("mxfp4", "gptoss-up", _fixed([1] * 4 + [0] * 124), walk_variants),
        ("mxfp4", "gptoss-down", _fixed([0] * 60 + [1] * 4 + [0] * 64), walk_variants),
    ]),
    "stage-steps": ("the decoding kernel's stages of 1, 2 or 4 K steps (bytes of a weight row a stage)", [
        ("nvfp4", "gptoss-up", _fixed([16] * 128), stage_step_variants),
        ("mxfp4", "gptoss-up", _poisson(128, 16, 17), stage_step_variants),
        ("nvfp4", "gptoss-down", _fixed([2] * 128), stage_step_variants),
        ("nvfp4", "gptoss-up", _poisson(128, 128, 7), stage_step_variants),
    ]),
    "ring-depth": ("the ring as deep as shared memory allows, or shallower, decode and prefill", [
        ("fp8_block", "dsv3-up", _poisson(256, 16, 21), ring_variants),
        ("fp8_block", "dsv3-down", _poisson(32, 32, 22), ring_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 2, 23), ring_variants),
        ("bf16", "gptoss-up", _poisson(128, 128, 7), ring_variants),
    ]),
}


def kernel_times(replay, reps: int = 20) -> dict:
    """Mean device time (us) of each kernel in one replay, by name (torch profiler, L2 warm)."""
    import torch
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
    return {name: round(us, 2) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def _calls(inp, fmt, scale_offsets, step, bias):
    """{suffix: call} of a case: the product alone, or the gate/up step (gpt-oss's clamped SwiGLU
    with `bias`, out_fmt = fmt) fused and unfused ("swiglu") or fused only ("swiglu-fused")."""
    from moegemm import grouped_matmul, grouped_matmul_swiglu

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


def run_case(fmt, shape, sizes, variants, timer, copy_tbps, step=None, rtol=5e-3) -> list[dict]:
    import torch

    from moegemm import benchmark, layouts

    n, k = SHAPES[shape]
    device = torch.device("cuda")
    inp = benchmark.Inputs(fmt, n, k, sizes, device)
    scale_offsets = layouts.a_scale_offsets(inp.a_offsets) if inp.scale_layout == "swizzled" else None
    m = sum(sizes)
    bias = torch.randn(len(sizes), n, device=device)  # one for every variant
    chosen = library_variant(fmt, n, k, sizes) if _library_only() else variants(fmt, n, k, sizes)
    override = _config().override_config if any(cfg is not None for cfg in chosen.values()) else None
    firsts, timed, pending = {}, {}, []
    for name, cfg in chosen.items():
        for suffix, call in _calls(inp, fmt, scale_offsets, step, bias).items():
            with override(cfg) if cfg is not None else contextlib.nullcontext():
                inp.out.fill_(float("nan"))
                out = call()
                torch.cuda.synchronize()
                out = (inp.out if out is None else out)[:m].float().clone()
                timed[name + suffix] = timer.prepare(call)  # (the graph keeps the kernels the override chose)
            pending.append((name, cfg, suffix, out))
    times = timer.in_turns(timed)
    rows = []
    for name, cfg, suffix, out in pending:
        variant = name + suffix
        ms = times[variant][0]
        kernels = kernel_times(timed[variant].graph.replay)
        first = firsts.setdefault(suffix, out)
        if first is out:
            diff, identical = 0.0, True
        else:
            scale = first.abs().max().clamp(min=1e-30)
            diff = float(((out - first).abs().max() / scale).nan_to_num(float("inf")))
            identical = bool(torch.equal(out.nan_to_num(0.0), first.nan_to_num(0.0)))
        row = dict(key=f"{fmt} {shape} {len(sizes)}x{m / len(sizes):.1f} {variant}", fmt=fmt, shape=shape, n=n, k=k,
                   groups=len(sizes), tokens=m, variant=variant, config=asdict(cfg) if cfg is not None else None,
                   us=ms * 1e3, kernels_us=kernels,
                   pct_copy=100 * inp.bytes_moved() / (ms * 1e-3) / (copy_tbps * 1e12),
                   tflops=2.0 * m * n * k / (ms * 1e-3) / 1e12, max_diff=diff, identical=identical,
                   ok=diff <= rtol and bool(torch.isfinite(out).all()))
        rows.append(row)
        print(f"{fmt:<9} {shape:<12} {len(sizes):>3}x{m / len(sizes):<6.1f} {variant:<24} {row['us']:9.1f} us "
              f"{row['pct_copy']:5.1f}% copy {row['tflops']:6.1f} TFLOP/s  diff {diff:.1e}"
              f"{' =' if identical else ''}{'' if row['ok'] else '  MISMATCH'}  kernels "
              + " ".join(f"{kname[:24]}={us:.1f}" for kname, us in kernels.items()), flush=True)
    timed.clear()
    del inp
    torch.cuda.empty_cache()
    return rows


def run_kernel_plan(plan: str, args) -> dict:
    import moe_layer
    import torch

    timer = moe_layer.Timer(torch.device("cuda"))
    env = _gpu_env(timer)
    print(env, flush=True)
    rows = []
    for fmt, shape, sizes, variants, *step in KERNEL_PLANS[plan][1]:
        rows += run_case(fmt, shape, sizes(), variants, timer, env["copy_tbps"], *step)
    bad = [r["key"] for r in rows if not r["ok"]]
    return dict(env=env, rows=rows, mismatched=bad)


# ---- layer plans: the whole MoE layer under variants, timed in turns with the baseline -----------

def _claims(rounds):
    return lambda fmt_name, cfg: replace(cfg, claim_rounds=0 if fmt_name == "fp8_block" else rounds)


def _walk(chunks):
    return lambda fmt_name, cfg: (replace(cfg, chunk_walk=chunks) if isinstance(cfg, _config().Mxfp8Config)
                                  and not cfg.wide else cfg)


def _short_tails(short):
    return lambda fmt_name, cfg: replace(cfg, short_tails=short) if getattr(cfg, "tail_tokens", 0) == 32 else cfg


def _unchanged(fmt_name, cfg):
    return cfg


class Patch:
    """A variant that replaces `name` in the first of `modules` that has it, while captured
    (make_replacement(original) -> the replacement; None keeps it). Callers must look the name
    up on the module at call time (module.name), as the library's ops do."""

    def __init__(self, modules, name, make_replacement=None):
        self.modules, self.name, self.make_replacement = modules, name, make_replacement

    def __call__(self, fmt_name, cfg):
        return cfg

    def module(self):
        import importlib

        for name in self.modules:
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
                if hasattr(module, self.name):
                    return module
        raise SystemExit(f"no module of {self.modules} has {self.name}")


def _gathered(original):
    """scatter_quantize's result by the gather (each token read and quantized once per choice)."""
    import moegemm.activation as A

    return lambda x, fmt, grouped_row, row_slot, **kwargs: A.gather_quantize(x, fmt, A.token_of_row(grouped_row),
                                                                             **kwargs)


def _operand_out(launch_fused):
    """launch_fused without out_form: the fused epilogue's operand, which the down product then
    decodes in its own pre-pass."""
    return lambda *args, out_form=None, **kwargs: launch_fused(*args, **kwargs)


FUSED_MODULES = ("moegemm.fused", "moegemm.kernels.sm90.swiglu", "moegemm.kernels.sm90_epilogue")

# plan: (description, tokens, rows (index in moe_layer.MODELS, model, fmt), {variant: change})
LAYER_PLANS = {
    "layer-claims": ("the layer with claim_rounds 0 (round-robin), 2 (the default) and 1", 4096,
                     ((0, "DeepSeek-V3", "mxfp8"), (1, "gpt-oss-120b", "bf16")),
                     {f"claim-{r}": _claims(r) for r in (0, 2, 1)}),
    "layer-walk": ("the layer with the narrow mxfp8 tiles' slot walk from chunks or by slots", 512,
                   ((0, "DeepSeek-V3", "mxfp8"), ), {"walk-chunks": _walk(True), "walk-slots": _walk(False)}),
    "layer-short-tails": ("the layer with short tails or every tail 32 wide", 4096, ((0, "DeepSeek-V3", "mxfp8"), ),
                          {"short-tails": _short_tails(True), "tails-32": _short_tails(False)}),
    "layer-scatter": ("the layer's token step in scatter form or gathered k times", 4096,
                      ((0, "DeepSeek-V3", "fp8_block"), (1, "gpt-oss-120b", "bf16")),
                      {"scatter": Patch(("moegemm.activation", ), "scatter_quantize"),
                       "gather": Patch(("moegemm.activation", ), "scatter_quantize", _gathered)}),
    "layer-fused-form": ("the fused epilogue writing the down product's bf16 token form or its operand", 4096,
                         ((1, "gpt-oss-120b", "mxfp4"), ),
                         {"bf16-form": Patch(FUSED_MODULES, "launch_fused"),
                          "operand": Patch(FUSED_MODULES, "launch_fused", _operand_out)}),
}


def captured_with(timer, change, call):
    """call captured with every sm90 config function's answer changed by change(fmt name, config)."""
    c = _config()
    mx_config, config = c._sm90_mx_config, c._sm90_config
    c._sm90_mx_config = lambda *a: change(a[0], mx_config(*a))
    c._sm90_config = lambda *a: change(a[0], config(*a))
    patched = isinstance(change, Patch) and change.make_replacement is not None
    if patched:
        module = change.module()
        original = getattr(module, change.name)
        setattr(module, change.name, change.make_replacement(original))
    try:
        call()  # compile outside the capture
        return timer.prepare(call)
    finally:
        c._sm90_mx_config, c._sm90_config = mx_config, config
        if patched:
            setattr(module, change.name, original)


def _layer_rows(L, timer, m_index, model, fmt, tokens, variants) -> list[dict]:
    """One model's layer under every variant and its baseline, timed in turns, twice."""
    import torch

    device = torch.device("cuda")
    cfg = L.MODELS[model]
    weights = L.build_weights(cfg, m_index, device)
    x, ids, topk_weights = L.routing_inputs(cfg, tokens, tokens * 7919 + m_index, device)
    call = L.layer_call(cfg, x, ids, topk_weights, weights, fmt, fused=True)
    timed = {name: (timer.prepare(call) if change is _unchanged else captured_with(timer, change, call))
             for name, change in variants.items()}
    base = L.baseline_for(weights, fmt, cfg, "fp8_rowwise" if weights.rowwise() is not None else "bf16")
    base_call = lambda: base(x, ids, topk_weights)  # noqa: E731
    base_call()
    timed["baseline"] = timer.prepare(base_call)
    rows = []
    for run in range(2):
        times = {name: ms * 1e3 for name, (ms, _, _) in timer.in_turns(timed).items()}
        for name, us in times.items():
            rows.append(dict(key=f"{model} {fmt} {tokens} {name}", model=model, fmt=fmt, tokens=tokens,
                             variant=name, run=run, us=round(us, 1), x_baseline=round(times["baseline"] / us, 4)))
        print(model, fmt, {k: round(v, 1) for k, v in times.items()},
              {k: round(times["baseline"] / v, 3) for k, v in times.items()}, flush=True)
    return rows


def run_layer_plan(plan: str, args) -> dict:
    import moe_layer as L
    import torch

    _, tokens, models, variants = LAYER_PLANS[plan]
    if _library_only():
        variants = {"library": _unchanged}
    device = torch.device("cuda")
    timer = L.Timer(device)
    env = dict(_gpu_env(timer), tokens=tokens)
    rows = []
    for m_index, model, fmt in models:
        rows += _layer_rows(L, timer, m_index, model, fmt, tokens, variants)
        torch.cuda.empty_cache()
    return dict(env=env, rows=rows)


# ---- fused-ceiling: the most fusing SwiGLU into the gate/up product can gain --------------------

CEILING_ROWS = ((0, "DeepSeek-V3", "mxfp8"), (1, "gpt-oss-120b", "mxfp4"), (1, "gpt-oss-120b", "bf16"))
READ_SHAPES = ((2048, 4), (4096, 8), (8192, 8))  # (int32 elements a program and iteration, warps)


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(src, out, n, iterations, BLOCK: tl.constexpr):
        """Reads src[0:n] (int32) once, programs striding by BLOCK; stores the xor of what it read
        so that the loads are not dead."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(iterations):
            offsets = (i * programs + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(src + offsets, mask=offsets < n, other=0)
        tl.store(out + pid, tl.xor_sum(acc, axis=0))

    return read_kernel


def read_call(tensors, block: int, warps: int):
    """One call that reads every tensor of `tensors` once (their bytes as int32 words)."""
    import torch
    import triton

    kernel = _read_kernel()
    programs = torch.cuda.get_device_properties(0).multi_processor_count * 4
    sink = torch.empty(programs, dtype=torch.int32, device="cuda")
    words = []
    for t in tensors:
        flat = t.contiguous().view(torch.uint8).reshape(-1)
        flat = flat[:flat.numel() // 4 * 4]  # (the last < 4 bytes of a scale tensor: left out)
        words.append(flat.view(torch.int32))

    def call():
        for w in words:
            iterations = triton.cdiv(w.numel(), block * programs)
            kernel[(programs, )](w, sink, w.numel(), iterations, BLOCK=block, num_warps=warps)

    return call


def _ceiling_rows(L, timer, m_index, model, fmt, tokens):
    """One model's fused-ceiling times, in turns, twice."""
    import torch

    import moegemm

    device = torch.device("cuda")
    rows, summary = [], []
    cfg = L.MODELS[model]
    weights = L.build_weights(cfg, m_index, device)
    x, ids, topk_weights = L.routing_inputs(cfg, tokens, tokens * 7919 + m_index, device)
    if torch.unique(ids).numel() != cfg["experts"]:  # (the read kernel reads every expert's weights)
        raise SystemExit(f"{model} at {tokens} tokens leaves experts without tokens; use more tokens")
    step = L.GateUpStep.build(cfg, x, ids, topk_weights, weights, fmt)
    plan_, a, w_gu = step.plan, step.a, step.w_gu
    h = torch.empty(a.data.shape[0], w_gu.data.shape[1], dtype=torch.bfloat16, device=device)
    h_like = torch.empty_like(h)  # (write_h must not zero the h that the pass reads)

    def product():
        moegemm.grouped_matmul(a.data, w_gu.data, a.scales, w_gu.scales, plan_.a_offsets, plan_.expert_ids,
                               fmt=fmt, a_scale_offsets=step.a_scale_offsets, scale_layout=step.layout, out=h,
                               backend="auto")

    def swiglu_pass():
        return moegemm.swiglu_quantize(h, fmt, gate_up_layout="interleaved", activation=cfg["activation"],
                                       bias=step.bias, a_offsets=plan_.a_offsets, expert_ids=plan_.expert_ids,
                                       a_scale_offsets=step.a_scale_offsets, scale_layout=step.layout,
                                       num_scale_blocks=plan_.scale_blocks_bound, alpha=L.ALPHA, limit=L.LIMIT)

    calls = {"fused": step.call(True), "unfused": step.call(False), "product": product, "pass": swiglu_pass,
             "write_h": lambda: h_like.fill_(0)}
    weight_tensors = [t for t in (w_gu.data, w_gu.scales) if t is not None]
    for block, warps in READ_SHAPES:
        calls[f"read-{block}x{warps}"] = read_call(weight_tensors, block, warps)
    product()  # h as the pass reads it
    timed = {}
    for name, call in calls.items():
        call()  # compiles outside the capture
        timed[name] = timer.prepare(call)
    weight_bytes = sum(t.numel() * t.element_size() for t in weight_tensors)
    for run in range(2):
        times = {name: ms * 1e3 for name, (ms, _, _) in timer.in_turns(timed).items()}
        read = min(v for name, v in times.items() if name.startswith("read-"))
        rows += [dict(key=f"{model} {fmt} {tokens} {name}", model=model, fmt=fmt, variant=name, run=run,
                      us=round(us, 1)) for name, us in times.items()]
        summary.append(dict(model=model, fmt=fmt, run=run, read_us=round(read, 1),
                            read_tbps=round(weight_bytes / (read * 1e-6) / 1e12, 3), h_bytes=h.numel() * 2,
                            measured=round(times["unfused"] / times["fused"], 4),
                            ceiling=round((read + times["write_h"] + times["pass"]) / read, 4)))
        print(model, fmt, summary[-1], flush=True)
    timed.clear()
    return rows, summary


def run_fused_ceiling(plan: str, args) -> dict:
    """On the layer's routed and quantized tokens (moe_layer.GateUpStep), timed together in turns:
    fused (grouped_matmul_swiglu(fused=True)), unfused (the product to bf16 h, then
    swiglu_quantize), product (alone, writing h), pass (swiglu_quantize(h) alone), read (a kernel
    that reads the gate/up weights and scales once; the fastest of READ_SHAPES) and write_h
    (fill_(0) of a tensor of h's shape). Both steps run the same product kernel's K loop (the
    fused one may get a shorter ring for its epilogue's scratch, which only slows it); fusing
    replaces the epilogue, so it can save at most the pass and the write of h, while no product
    takes less than reading its weights once. Hence, for any product at or above the read time,

        unfused / fused  <=  ceiling = (read + write_h + pass) / read

    reached by a product at the read time, a free fused epilogue and a write of h not hidden
    behind the reads. It leaves out an unfused product whose own epilogue costs more than
    writing h (gpt-oss BF16 at 512 tokens measured above its ceiling that way)."""
    import moe_layer as L
    import torch

    device = torch.device("cuda")
    timer = L.Timer(device)
    env = dict(_gpu_env(timer), tokens=args.tokens)
    rows, summary = [], []
    for m_index, model, fmt in CEILING_ROWS:
        more_rows, more_summary = _ceiling_rows(L, timer, m_index, model, fmt, args.tokens)
        rows, summary = rows + more_rows, summary + more_summary
        torch.cuda.empty_cache()
    return dict(env=env, rows=rows, summary=summary)


# ---- scatter-check: the token gather in scatter form against the gather, bit for bit ------------

def run_scatter_check(plan: str, args) -> dict:
    """DeepSeek-V3 and gpt-oss token steps (mxfp8, mxfp4 in the kernels' e4m3 token form): the
    scatter form (each token read and quantized once, stored to its k rows; row-major scale bytes
    moved to the K-block-major form) against the gather form, bit for bit on every in-slot row and
    scale column (a NaN element and a zero row included), both timed by graph replay."""
    import torch

    import moegemm
    from moegemm import activation as act
    from moegemm import benchmark
    from moegemm.routing import row_experts
    from moegemm.token_forms import kb_major_column, token_form

    rows = []
    for t, k, e, hidden, n in ((4096, 8, 256, 7168, 4096), (512, 8, 256, 7168, 4096), (4096, 4, 128, 2880, 5760)):
        gen = torch.Generator(device="cuda").manual_seed(t + k)
        x = torch.randn(t, hidden, device="cuda", generator=gen).bfloat16()
        x[0, 5] = float("nan")
        x[1] = 0
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices.to(torch.int32)
        route = moegemm.route(ids, e)
        for fmt in ("mxfp8", "mxfp4"):
            form = token_form(fmt, n, hidden, t * k, e)
            if form is None or form.kind != "e4m3":
                continue
            slots = row_experts(route)

            def scatter(x=x, fmt=fmt, route=route, slots=slots, form=form):
                return act.scatter_kernel_tokens(x, fmt, route.grouped_row, slots, form, route.a_offsets)

            def gather(x=x, fmt=fmt, route=route, form=form):
                return act.gather_kernel_tokens(x, fmt, route.token_index, form, route.a_offsets)
            sc, ga = scatter(), gather()
            torch.cuda.synchronize()
            valid = int(route.valid.sum())
            same_data = torch.equal(sc.data[:valid].view(torch.uint8), ga.data[:valid].view(torch.uint8))
            bounds = route.a_offsets.tolist()
            cols = torch.tensor([kb_major_column(r, bounds[g], g, form.column_block)
                                 for g in range(e) for r in range(bounds[g + 1] - bounds[g])], device="cuda")
            a, b = sc.scales[:, cols], ga.scales[:, cols]
            row = dict(key=f"T{t}-k{k}-E{e}-H{hidden}-{fmt}", same_data=same_data,
                       same_scales=torch.equal(a.view(torch.int32), b.view(torch.int32)),
                       nan_scales=int(torch.isnan(a).sum()), rows=valid,
                       scatter_us=1e3 * benchmark._bench_graph(scatter), gather_us=1e3 * benchmark._bench_graph(gather))
            row["us"] = row["scatter_us"]
            rows.append(row)
            print(row, flush=True)
    return dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__), rows=rows,
                mismatched=[r["key"] for r in rows if not (r["same_data"] and r["same_scales"])])


# ---- activation-sweep: launch shapes of the activation kernels at prefill sizes ------------------

def run_activation_sweep(plan: str, args) -> dict:
    """Rows a program x scale blocks a program (times 1, 2, 4) x warps of the gather/scatter and
    SwiGLU quantization kernels at DeepSeek-V3 / gpt-oss 4096 tokens (graph replay, median)."""
    import moe_layer as L
    import torch
    import triton.testing

    import moegemm
    from moegemm import activation as act
    from moegemm.routing import row_experts
    from moegemm.token_forms import TokenForm

    dev = torch.device("cuda")

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3

    ds, go = L.MODELS["DeepSeek-V3"], L.MODELS["gpt-oss-120b"]
    x, ids, tw = L.routing_inputs(ds, 4096, 3, dev)
    route = moegemm.route(ids, ds["experts"], tw)
    h = torch.randn(ids.numel(), 4096, device=dev).bfloat16()
    xg, idsg, twg = L.routing_inputs(go, 4096, 3, dev)
    route_g = moegemm.route(idsg, go["experts"], twg)
    gather_bytes = x.numel() * 2 + ids.numel() * 7168
    cases = {
        "dsv3-scatter-mxfp8-e4m3form": (lambda: act.scatter_kernel_tokens(
            x, "mxfp8", route.grouped_row, row_experts(route), TokenForm("e4m3"), route.a_offsets), gather_bytes),
        "dsv3-scatter-fp8block": (lambda: act.scatter_quantize(
            x, "fp8_block", route.grouped_row, row_experts(route), a_offsets=route.a_offsets), gather_bytes),
        "dsv3-swiglu-mxfp8-e4m3form": (lambda: act.swiglu_kernel_tokens(
            h, "mxfp8", TokenForm("e4m3"), activation="swiglu", gate_up_layout="interleaved", bias=None,
            a_offsets=route.a_offsets, expert_ids=route.expert_ids, alpha=1.702, limit=7.0),
            h.numel() * 2 + h.numel() // 2),
        "dsv3-swiglu-fp8block-concat": (lambda: act.swiglu_quantize(h, "fp8_block", gate_up_layout="concat"),
                                        h.numel() * 2 + h.numel() // 2),
        "gptoss-gather-mxfp4-bf16form": (lambda: act.gather_kernel_tokens(
            xg, "mxfp4", route_g.token_index, TokenForm("bf16"), route_g.a_offsets),
            xg.numel() * 2 + idsg.numel() * 2880 * 2),
    }
    original = (act.CUDA_BLOCK_M, act.CUDA_WARPS, act._out_code)
    rows = []
    try:
        for name, (fn, nbytes) in cases.items():
            for block_m in (8, 16, 32):
                for factor in (1, 2, 4):
                    for warps in (4, 8):
                        act.CUDA_BLOCK_M, act.CUDA_WARPS = block_m, warps
                        act._out_code = lambda f, m, _o=original[2], _k=factor: (lambda r: (r[0], r[1], r[2] * _k))(
                            _o(f, m))
                        try:
                            us = timed(fn)
                        except Exception as exc:  # noqa: BLE001 (a shape the kernel refuses)
                            print(name, block_m, factor, warps, "failed", type(exc).__name__, flush=True)
                            continue
                        rows.append(dict(key=f"{name} bm{block_m} nbx{factor} w{warps}", case=name, block_m=block_m,
                                         nb_factor=factor, warps=warps, us=us, tbps=nbytes / us / 1e6))
                        print(rows[-1], flush=True)
    finally:
        act.CUDA_BLOCK_M, act.CUDA_WARPS, act._out_code = original
    return dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         defaults=dict(block_m=original[0], warps=original[1])), rows=rows)


# ---- power-cap: why calls timed in bursts of their own disagree ---------------------------------

def run_power_cap(plan: str, args) -> dict:
    """DeepSeek-V3 at 4096 tokens (mxfp8): the layer's graph timed alone, beside the baseline's,
    in turns with it and after a rest, while nvidia-smi logs SM clock, power and throttle
    reasons every 100 ms (rows `smi`). Under a sustained load the H100 reaches its power cap
    within ~0.5 s and its clock moves between ~1.4 and 1.98 GHz: the reason the timers take a
    sample of every call a round in a shuffled order."""
    import moe_layer as L
    import torch
    import triton.testing

    import moegemm

    dev = torch.device("cuda")
    log, out = [], {}

    def mark(msg):
        log.append((round(time.time(), 3), msg))
        print(f"{time.time():.2f} {msg}", flush=True)

    def graph(fn):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def med(fn, rep=100):
        return statistics.median(triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="all")) * 1e3

    smi_log = tempfile.NamedTemporaryFile("w+", suffix=".smi", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,"
                            "clocks_throttle_reasons.active", "--format=csv,noheader", "-lms", "100"], stdout=smi_log)
    try:
        cfg = L.MODELS["DeepSeek-V3"]
        weights = L.build_weights(cfg, 0, dev)
        x, ids, tw = L.routing_inputs(cfg, 4096, 4096 * 7919, dev)
        fmt = "mxfp8"
        w_gu, w_dn = weights.ours(fmt)
        ours = lambda: moegemm.moe_forward(x, ids, tw, w_gu, w_dn, gate_up_layout=L.gate_up_layout(fmt),  # noqa
                                           activation="swiglu", fused=True, backend="auto")
        base = L.baseline_for(weights, fmt, cfg, "fp8_rowwise")
        go = graph(ours)
        out["ours_alone"] = [med(go.replay) for _ in range(3)]
        mark(f"ours alone {out['ours_alone']}")
        gb = graph(lambda: base(x, ids, tw))
        out["ours_beside_baseline"] = [med(go.replay) for _ in range(3)]
        mark(f"ours with the baseline's graph alive {out['ours_beside_baseline']}")
        out["turns"] = []
        for turn in range(3):
            b, o = med(gb.replay), med(go.replay)
            out["turns"].append((b, o))
            mark(f"turn {turn}: baseline {b:.1f} ours {o:.1f}")
        time.sleep(3)
        out["ours_after_rest"] = med(go.replay)
        mark(f"ours after 3 s of rest {out['ours_after_rest']:.1f}")
    finally:
        smi.terminate()
        smi.wait()
    smi_rows = Path(smi_log.name).read_text().splitlines()
    os.unlink(smi_log.name)
    rows = [dict(key="ours_after_rest", us=out["ours_after_rest"])]
    return dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__), res=out, log=log, smi=smi_rows,
                rows=rows)


OTHER_PLANS = {
    "fused-ceiling": ("the most the fused SwiGLU epilogue can gain: (read + write_h + pass) / read",
                      run_fused_ceiling),
    "scatter-check": ("the token gather in scatter form against the gather, bit for bit, both timed",
                      run_scatter_check),
    "activation-sweep": ("launch shapes of the activation kernels at 4096 tokens", run_activation_sweep),
    "power-cap": ("the layer's graph alone, beside and in turns with the baseline, nvidia-smi clocks",
                  run_power_cap),
}


def plan_names() -> dict:
    names = {name: desc for name, (desc, _) in KERNEL_PLANS.items()}
    names.update({name: spec[0] for name, spec in LAYER_PLANS.items()})
    names.update({name: desc for name, (desc, _) in OTHER_PLANS.items()})
    names["sass"] = "(no GPU) the SASS of every offline compile in two revisions, case by case"
    return names


def run_plan(plan: str, args) -> dict:
    if plan in KERNEL_PLANS:
        return run_kernel_plan(plan, args)
    if plan in LAYER_PLANS:
        return run_layer_plan(plan, args)
    return OTHER_PLANS[plan][1](plan, args)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name().replace(" ", "-")


def run_timing(plans: list[str], args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the timing plans need a CUDA GPU (`sass` does not)", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for plan in plans:
        result = run_plan(plan, args)
        data = dict(record=record(plan, library_only=_library_only()), **result)
        path = args.out / f"{plan}-{_gpu_name()}.json"
        path.write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {path}", flush=True)
        if result.get("mismatched"):
            print(f"{plan}: {len(result['mismatched'])} mismatched: {result['mismatched'][:10]}", flush=True)
            status = 2
    return status


# ---- two revisions -------------------------------------------------------------------------------

@contextlib.contextmanager
def checked_out(revisions: dict):
    """{side: REV or None} -> {side: (tree, description)}: each REV in a temporary detached git
    worktree, removed afterwards; None is the current working tree as it is."""
    made, trees = [], {}
    top = Path(tempfile.mkdtemp(prefix="moegemm-ab-"))
    try:
        for side, rev in revisions.items():
            if rev is None:
                dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
                trees[side] = (ROOT, f"working tree at {_git('rev-parse', '--short', 'HEAD')}"
                                     + (" with uncommitted changes" if dirty else ""), _git("rev-parse", "HEAD"))
                continue
            sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
            path = top / side
            _git("worktree", "add", "--detach", "--quiet", str(path), sha)
            made.append(path)
            trees[side] = (path, f"{rev} ({sha[:10]})", sha)
        yield trees
    finally:
        for path in made:
            _git("worktree", "remove", "--force", str(path), check=False)
        _git("worktree", "prune", check=False)
        shutil.rmtree(top, ignore_errors=True)


def run_revisions(plans: list[str], args) -> int:
    """Each plan in a process per revision, alternating for args.rounds rounds; medians per key."""
    args.out.mkdir(parents=True, exist_ok=True)
    revisions = {"base": args.base, "head": args.head}
    with checked_out(revisions) as trees:
        for plan in plans:
            rounds = []
            for r in range(args.rounds):
                order = ("base", "head") if r % 2 == 0 else ("head", "base")
                for side in order:
                    tree = trees[side][0]
                    with tempfile.TemporaryDirectory() as tmp:
                        env = dict(os.environ, MOEGEMM_TREE=str(tree), AB_LIBRARY_ONLY="1")
                        cmd = [sys.executable, str(Path(__file__).resolve()), plan, "--out", tmp,
                               "--tokens", str(args.tokens)]
                        print(f"[{plan} round {r} {side}] {' '.join(cmd)}", flush=True)
                        run = subprocess.run(cmd, env=env, cwd=tree, check=False)
                        files = list(Path(tmp).glob(f"{plan}-*.json"))
                        if run.returncode not in (0, 2) or not files:
                            raise SystemExit(f"{plan} on {side} failed (rc {run.returncode})")
                        rounds.append(dict(round=r, side=side, **json.loads(files[0].read_text())))
            summary = _revision_summary(rounds)
            data = dict(record=record(plan, base=trees["base"][1], head=trees["head"][1],
                                      base_commit=trees["base"][2], head_commit=trees["head"][2],
                                      rounds=args.rounds),
                        summary=summary, rounds=rounds)
            gpu = rounds[0].get("env", {}).get("gpu", "gpu").replace(" ", "-")
            path = args.out / f"{plan}-revisions-{gpu}.json"
            path.write_text(json.dumps(data, indent=1, default=str))
            print(f"\n{plan}: base {trees['base'][1]} / head {trees['head'][1]}, medians over {args.rounds} rounds")
            print(f"{'case':<56} {'base us':>10} {'head us':>10} {'base/head':>10}")
            for row in summary:
                print(f"{row['key'][:56]:<56} {row['base_us']:>10.1f} {row['head_us']:>10.1f} {row['ratio']:>10.3f}")
            print(f"wrote {path}", flush=True)
    return 0


def _revision_summary(rounds: list[dict]) -> list[dict]:
    times: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for result in rounds:
        for row in result.get("rows", []):
            if isinstance(row.get("us"), (int, float)):
                times[row["key"]][result["side"]].append(row["us"])
    summary = []
    for key, sides in times.items():
        if sides.get("base") and sides.get("head"):
            base, head = statistics.median(sides["base"]), statistics.median(sides["head"])
            summary.append(dict(key=key, base_us=base, head_us=head, ratio=base / head,
                                base_samples=sides["base"], head_samples=sides["head"]))
    return summary


# ---- sass: the SASS of every offline compile in two revisions ------------------------------------

SASS_TESTS = ["tests/test_compile_sm90.py", "tests/test_routing.py"]

# A pytest plugin for revisions whose offline.py writes no dumps: it wraps the two compile helpers
# (the tests look them up after pytest_configure) and writes the same files the library does.
SASS_PLUGIN = textwrap.dedent('''
    import os
    import re
    from pathlib import Path


    def pytest_configure(config):
        folder = os.environ.get("MOEGEMM_SASS_DUMP")
        if not folder:
            return
        import moegemm
        from moegemm.kernels import offline

        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "_origin.txt").write_text(os.path.dirname(os.path.abspath(moegemm.__file__)))
        if "MOEGEMM_SASS_DUMP" in Path(offline.__file__).read_text():
            return  # the revision writes its dumps itself

        def dumping(compile_fn):
            def compile_and_dump(*args, **kwargs):
                compiled = compile_fn(*args, **kwargs)
                case = os.environ.get("PYTEST_CURRENT_TEST", "unnamed").split(" (")[0]
                name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", case)
                with open(Path(folder) / f"{name}.sass", "a") as f:
                    f.write(offline.sass(compiled))
                return compiled
            return compile_and_dump

        for name in ("compile_for_sm90", "gluon_compile_for_sm90"):
            if hasattr(offline, name):
                setattr(offline, name, dumping(getattr(offline, name)))
''')

_ADDR = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s*")
_ENCODING = re.compile(r"/\*\s*0x[0-9a-fA-F]+\s*\*/")
_JUMPS = ("BRA", "BSSY", "CALL", "JMP", "JMX", "BRX")  # their last hex operand is an address


def _relative_target(instr: str, address: int) -> str:
    """A jump's absolute target as an offset from its own address, so code inserted elsewhere
    does not change every later jump."""
    op = _opcode(instr)
    if not op.startswith(_JUMPS):
        return instr
    match = re.search(r"0x([0-9a-fA-F]+)\s*$", instr)
    if not match:
        return instr
    offset = int(match.group(1), 16) - address
    return instr[:match.start()] + (f".+{offset:#x}" if offset >= 0 else f".-{-offset:#x}")


def normalize_sass(text: str) -> list[str]:
    """Instructions and operands of a dump, one string each, in order: the /*addr*/ and encoding
    comments, function headers (names, flags, section and code headers), labels and blank lines
    dropped; jump targets made relative to the jump; each kernel's own name inside operands
    replaced by <kernel>; a kernel boundary kept as one '<next kernel>' line when a case
    compiled several."""
    names = set(re.findall(r"Function\s*:\s*(\S+)", text))
    out, kernels = [], 0
    for line in text.splitlines():
        if re.search(r"Function\s*:", line):
            kernels += 1
            if kernels > 1:
                out.append("<next kernel>")
            continue
        if not _ADDR.match(line):
            continue  # headers, .headerflags, section markers, labels, encoding-only lines
        address = int(re.match(r"\s*/\*([0-9a-fA-F]+)\*/", line).group(1), 16)
        instr = _ENCODING.sub("", _ADDR.sub("", line)).strip().rstrip(";").strip()
        if not instr:
            continue
        instr = _relative_target(instr, address)
        for name in names:
            instr = instr.replace(name, "<kernel>")
        out.append(re.sub(r"\s+", " ", instr))
    return out


def _opcode(instr: str) -> str:
    parts = instr.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def compare_sass(base: list[str], head: list[str]) -> dict:
    identical = base == head
    first = None
    if not identical:
        i = next((j for j, (b, h) in enumerate(zip(base, head)) if b != h), min(len(base), len(head)))
        first = dict(index=i, base=base[i] if i < len(base) else None, head=head[i] if i < len(head) else None)
    counts = collections.Counter(_opcode(x) for x in head)
    counts.subtract(collections.Counter(_opcode(x) for x in base))
    changes = sorted(((op, n) for op, n in counts.items() if n), key=lambda kv: (-abs(kv[1]), kv[0]))[:6]
    return dict(identical=identical, base_instructions=len(base), head_instructions=len(head), first_difference=first,
                opcode_changes=dict(changes))


def dump_sass(tree: Path, folder: Path, timeout: float) -> dict:
    """pytest's offline compile tests in `tree` with their SASS dumped to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    plugin_dir = folder.parent / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "ab_sass_dump.py").write_text(SASS_PLUGIN)
    env = dict(os.environ, MOEGEMM_SASS_DUMP=str(folder),
               PYTHONPATH=os.pathsep.join([str(tree), str(plugin_dir)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                            if p]))
    env.pop("MOEGEMM_TREE", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ab_sass_dump",
           *[t for t in SASS_TESTS if (tree / t.split("::")[0]).exists()], "-k", "compile"]
    t0 = time.time()
    try:
        run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        log, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as exc:
        log, rc = (exc.stdout or "") + "\n[timed out]", None
        log = log if isinstance(log, str) else log.decode(errors="replace")
    (folder.parent / f"{folder.name}.log").write_text(log)
    origin = (folder / "_origin.txt").read_text().strip() if (folder / "_origin.txt").exists() else None
    summary = next((line for line in reversed(log.splitlines()) if re.search(r"\d+ (passed|failed|error)", line)), "")
    return dict(command=" ".join(cmd[1:]), rc=rc, seconds=round(time.time() - t0, 1), pytest=summary.strip("= "),
                library=origin, cases=len(list(folder.glob("*.sass"))))


def run_sass(args) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="moegemm-sass-"))
    runs, dumps = {}, {}
    try:
        with checked_out({"base": args.base, "head": args.head}) as trees:
            for side in ("base", "head"):
                tree, described, _ = trees[side]
                print(f"[sass] {side}: {described}: pytest in {tree} ...", flush=True)
                runs[side] = dict(revision=described, commit=trees[side][2],
                                  **dump_sass(Path(tree), work / side, args.timeout))
                print(f"[sass] {side}: {runs[side]['cases']} cases, pytest: {runs[side]['pytest'] or runs[side]['rc']}"
                      f" ({runs[side]['seconds']} s)", flush=True)
                library = runs[side]["library"]
                if library and Path(library).resolve() != (Path(tree) / "moegemm").resolve():
                    raise SystemExit(f"{side}: the tests imported moegemm from {runs[side]['library']}, not {tree}")
                dumps[side] = {p.stem: normalize_sass(p.read_text()) for p in sorted((work / side).glob("*.sass"))}
        if args.keep_dumps:
            for side in ("base", "head"):
                shutil.copytree(work / side, out / f"sass-{side}", dirs_exist_ok=True)
                shutil.copy(work / f"{side}.log", out / f"sass-{side}.log")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base, head = dumps["base"], dumps["head"]
    cases = [dict(case=name, **compare_sass(base[name], head[name])) for name in sorted(set(base) & set(head))]
    data = dict(record=record("sass", base=runs["base"]["revision"], head=runs["head"]["revision"]),
                runs=runs, compared=len(cases), identical=sum(c["identical"] for c in cases),
                differing=[c["case"] for c in cases if not c["identical"]],
                base_only=sorted(set(base) - set(head)), head_only=sorted(set(head) - set(base)), cases=cases)
    (out / "sass.json").write_text(json.dumps(data, indent=1))
    (out / "sass.md").write_text(sass_markdown(data))
    print(sass_markdown(data, brief=True))
    print(f"wrote {out / 'sass.md'}, {out / 'sass.json'}")
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


def _short(case: str) -> str:
    return case.replace("tests_test_", "").replace(".py_test_", ": ")


def sass_markdown(data: dict, brief: bool = False) -> str:
    runs = data["runs"]
    lines = [f"# SASS A/B: {runs['base']['revision']} -> {runs['head']['revision']}", "",
             f"Made by `{data['record']['script']}` (plan sass) at commit {data['record']['commit']}"
             f"{' (uncommitted changes)' if data['record']['dirty'] else ''}.", "",
             "| side | revision | pytest | cases | seconds |", "|---|---|---|---|---|"]
    for side in ("base", "head"):
        r = runs[side]
        lines.append(f"| {side} | {r['revision']} | {r['pytest'] or 'rc ' + str(r['rc'])} | {r['cases']} | "
                     f"{r['seconds']} |")
    differing = [c for c in data["cases"] if not c["identical"]]
    lines += ["", f"**{data['identical']} of {data['compared']} cases identical, {len(differing)} differ**"
              f"; {len(data['base_only'])} only in base, {len(data['head_only'])} only in head.", ""]
    if differing:
        lines += ["| case | base instr | head instr | first difference (index: base / head) | opcode changes |",
                  "|---|---|---|---|---|"]
        for c in differing:
            f = c["first_difference"]
            ops = ", ".join(f"{op} {n:+d}" for op, n in c["opcode_changes"].items()) or "none (order or operands)"
            lines.append(f"| {_short(c['case'])} | {c['base_instructions']} | {c['head_instructions']} | "
                         f"{f['index']}: `{f['base']}` / `{f['head']}` | {ops} |")
    if not brief:
        same = [c for c in data["cases"] if c["identical"]]
        if same:
            lines += ["", "Identical:", ""] + [f"- {_short(c['case'])} ({c['base_instructions']} instructions)"
                                               for c in same]
    for side in ("base_only", "head_only"):
        if data[side]:
            lines += ["", f"Only in {side.split('_')[0]}:", ""] + [f"- {_short(c)}" for c in data[side]]
    return "\n".join(lines) + "\n"


# ---- command line --------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plans", nargs="*", help="plan names (--list)")
    parser.add_argument("--list", action="store_true", help="list the plans")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "ab-out")), help="output folder")
    parser.add_argument("--base", help="two revisions: the base revision (sass: required)")
    parser.add_argument("--head", help="the head revision (default: the working tree as it is)")
    parser.add_argument("--rounds", type=int, default=2, help="two revisions: rounds of alternating processes")
    parser.add_argument("--tokens", type=int, default=4096, help="fused-ceiling: tokens of the layer")
    parser.add_argument("--timeout", type=float, default=3600.0, help="sass: seconds for one revision's pytest")
    parser.add_argument("--keep-dumps", action="store_true", help="sass: keep both revisions' dumps and logs in --out")
    args = parser.parse_args(argv)
    names = plan_names()
    if args.list or not args.plans:
        width = max(map(len, names))
        for name, desc in names.items():
            print(f"{name:<{width}}  {desc}")
        return 0
    unknown = [p for p in args.plans if p not in names]
    if unknown:
        parser.error(f"unknown plan(s) {unknown}; --list shows them")
    if "sass" in args.plans:
        if args.plans != ["sass"] or not args.base:
            parser.error("sass runs alone and needs --base REV")
        return run_sass(args)
    if args.base:
        return run_revisions(args.plans, args)
    return run_timing(args.plans, args)


if __name__ == "__main__":
    sys.exit(main())
