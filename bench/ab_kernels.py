"""bench/ab.py's kernel plans: variants of a grouped_matmul (or its gate/up step) timed in one
process. A plan is a list of cases (format, shape, group sizes, variants[, step]); a variant is a
kernel config forced through moegemm.config.override_config, or None for the library's own
choice. ab.py's docstring says how a case is timed and checked."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, replace

from ab_common import gpu_env, library_config, library_only

SHAPES = {"gptoss-up": (5760, 2880), "gptoss-down": (2880, 2880), "dsv3-up": (4096, 7168),
          "dsv3-down": (7168, 2048),
          # time against tiles and stages: where a call's fixed cost goes
          "n5760-k5760": (5760, 5760), "n11520-k2880": (11520, 2880), "n5760-k1408": (5760, 1408),
          "n2816-k2880": (2816, 2880), "n128-k256": (128, 256), "n128-k2880": (128, 2880),
          # fp8_block prefill against DeepGEMM (moegemm.benchmark_rows.TARGET_SHAPES)
          "n6144-k7168": (6144, 7168), "n7168-k3072": (7168, 3072), "n4096-k4096": (4096, 4096),
          "n4096-k2048": (4096, 2048)}


def poisson_sizes(groups: int, mean: float, seed: int) -> list[int]:
    """Tokens an expert of a layer with random routing (Poisson around `mean`)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [int(v) for v in torch.poisson(torch.full((groups, ), float(mean)), generator=gen)]


def default_config(fmt: str, n: int, k: int, sizes: list[int]):
    from moegemm.formats import FORMATS

    c = library_config()
    mean = sum(sizes) / len(sizes)
    if fmt in ("bf16", "fp8_block"):
        return c.sm90_config(FORMATS[fmt], n, k, mean)
    return c.sm90_mx_config(FORMATS[fmt], n, k, mean)


def _deepest(cfg, fmt):
    """The ring as deep as shared memory allows (up to 12 stages), as the config functions do."""
    from moegemm.formats import FORMATS

    return library_config().deepest_ring(replace(cfg, stages=2), FORMATS[fmt])


def library_variant(fmt, n, k, sizes):
    """No override: every step (the fused one included) gets the library's own config."""
    return {"library": None}


def default_variant(fmt, n, k, sizes):
    return {"default": default_config(fmt, n, k, sizes)}


def bf16_tile_variants(fmt, n, k, sizes):
    """The bf16 kernel's tile arrangements at ~128 tokens a slot (gpt-oss-120b at 4096 tokens)."""
    from moegemm.formats import FORMATS

    c = library_config()
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

    c = library_config()
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

    c = library_config()
    base = default_config(fmt, n, k, sizes)
    tokens = base.token_tile
    decoding = c.DecodeConfig(token_tile=tokens, stages=2, group_m=base.group_m, consumer_regs=192,
                              sub_steps=2 if tokens < 128 else 1)
    return {"promotion": base, "decoding": c.deepest_ring(decoding, FORMATS[fmt])}


def stage_step_variants(fmt, n, k, sizes):
    """The decoding kernel's ring stage carrying 1, 2 or 4 block_k-wide K steps (the default: 2
    below 128-token tiles, 1 on them), the ring as deep as shared memory allows."""
    from moegemm.formats import FORMATS

    c = library_config()
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

    base = library_config().sm90_config(FORMATS[fmt], n, k, sum(sizes) / len(sizes), fused=True)
    return {f"claim-{r}": replace(base, claim_rounds=r) for r in CLAIM_ROUNDS}


def walk_variants(fmt, n, k, sizes):
    """The narrow mxfp8 tiles' slot walk from chunks of slots, against three loads a slot (the
    other kernels have no choice: Mxfp8Config alone has chunk_walk)."""
    base = default_config(fmt, n, k, sizes)
    return {"walk-chunks": replace(base, chunk_walk=True), "walk-slots": replace(base, chunk_walk=False)}


def ring_variants(fmt, n, k, sizes):
    """The ring as deep as shared memory allows (the config functions' rule) against shallower ones."""
    base = default_config(fmt, n, k, sizes)
    return {f"stages-{s}": replace(base, stages=s) for s in sorted({base.stages, max(2, base.stages - 2),
                                                                    max(2, base.stages // 2)}, reverse=True)}


def group_m_variants(fmt, n, k, sizes):
    """Bands of 4 token blocks (the default) or more: a wave of programs then spans more token
    blocks and fewer weight blocks of an expert, so the weights it reads fit in L2."""
    base = default_config(fmt, n, k, sizes)
    return {f"group_m-{g}": replace(base, group_m=g) for g in (base.group_m, 8, 16, 32)}


def scale_ring_variants(fmt, n, k, sizes):
    """fp8_block's 128 x 256 prefill tiles with the scales staged in the ring by the producer (the
    default) or loaded by the consumers in the K loop (the previous loop, 232 registers a consumer,
    its ring as deep as shared memory allows): the same bits."""
    base = default_config(fmt, n, k, sizes)
    return {"scale-ring": base, "loaded-scales": _deepest(replace(base, scale_ring=False, consumer_regs=232), fmt)}


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
    "fp8-block-prefill": ("fp8_block prefill on the largest DeepGEMM target shape (for two revisions)", [
        ("fp8_block", "n6144-k7168", _poisson(4, 8192, 41), library_variant),
        ("fp8_block", "n6144-k7168", _poisson(8, 4096, 42), library_variant),
    ]),
    "fp8-block-kloop": ("fp8_block prefill's K loop: scales staged in the ring or loaded (the eight prefill shapes)", [
        ("fp8_block", "n6144-k7168", _poisson(4, 8192, 41), scale_ring_variants),
        ("fp8_block", "n6144-k7168", _poisson(8, 4096, 42), scale_ring_variants),
        ("fp8_block", "n7168-k3072", _poisson(4, 8192, 51), scale_ring_variants),
        ("fp8_block", "n7168-k3072", _poisson(8, 4096, 52), scale_ring_variants),
        ("fp8_block", "n4096-k4096", _poisson(4, 8192, 53), scale_ring_variants),
        ("fp8_block", "n4096-k4096", _poisson(8, 4096, 54), scale_ring_variants),
        ("fp8_block", "n4096-k2048", _poisson(4, 8192, 55), scale_ring_variants),
        ("fp8_block", "n4096-k2048", _poisson(8, 4096, 56), scale_ring_variants),
    ]),
    "tile-order": ("prefill tiles in bands of 4 to 32 token blocks (L2 reuse of the weights)", [
        ("fp8_block", "n6144-k7168", _poisson(4, 8192, 41), group_m_variants),
        ("fp8_block", "n6144-k7168", _poisson(8, 4096, 42), group_m_variants),
        ("fp8_block", "dsv3-down", _poisson(8, 4096, 43), group_m_variants),
        ("bf16", "gptoss-up", _fixed([4096] * 8), group_m_variants),
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
    "walk": ("the slot walk from chunks of 31 slots or three loads a slot, narrow mxfp8 tiles", [
        ("mxfp8", "dsv3-down", _poisson(256, 16, 13), walk_variants),
        ("mxfp8", "dsv3-up", _poisson(256, 16, 15), walk_variants),
        ("mxfp8", "dsv3-down", _poisson(256, 2, 14), walk_variants),
        ("mxfp8", "dsv3-up", _fixed([1] * 8 + [0] * 248), walk_variants),
        ("mxfp8", "dsv3-down", _fixed([0] * 100 + [1] * 8 + [0] * 148), walk_variants),
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
    from timing import kernel_times

    # benchmark.Inputs rather than benchmark_inputs.Inputs: every revision's benchmark module holds
    # that name (a two-revision run imports each revision's library)
    from moegemm import benchmark, layouts

    n, k = SHAPES[shape]
    device = torch.device("cuda")
    inp = benchmark.Inputs(fmt, n, k, sizes, device)
    scale_offsets = layouts.a_scale_offsets(inp.a_offsets) if inp.scale_layout == "swizzled" else None
    m = sum(sizes)
    bias = torch.randn(len(sizes), n, device=device)  # one for every variant
    chosen = library_variant(fmt, n, k, sizes) if library_only() else variants(fmt, n, k, sizes)
    override = library_config().override_config if any(cfg is not None for cfg in chosen.values()) else None
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
        kernels = kernel_times(timed[variant].graph.replay, reps=20, per_launch=False)
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
    import torch
    from timing import Timer

    timer = Timer(torch.device("cuda"))
    env = gpu_env(timer)
    print(env, flush=True)
    rows = []
    for fmt, shape, sizes, variants, *step in KERNEL_PLANS[plan][1]:
        rows += run_case(fmt, shape, sizes(), variants, timer, env["copy_tbps"], *step)
    bad = [r["key"] for r in rows if not r["ok"]]
    return dict(env=env, rows=rows, mismatched=bad)
