"""The Hopper Gluon kernels (backend="sm90") against the fp64 reference: every token pattern of
tests/cases.py TOKEN_PATTERNS, every format and scale layout, every tile arrangement (normal, split-n and
swapped for fp8_block/bf16; token tiles of 16..256 for the block formats; the mxfp8 promotion
kernel), partial K and N blocks, fp32 output, CUDA-graph capture. GPU only (marked gpu)."""

import contextlib
import dataclasses

import pytest
import torch
from cases import (EDGE_ROWS, ROWS_NO_GROUPS, TOKEN_PATTERNS, TokenPattern, check_output, dirty_cached_blocks,
                   make_problem, poison_like, run_sm90, tolerance)

import moegemm
from moegemm import config, sm90_configs
from moegemm.config import override_config
from moegemm.formats import FORMATS
from moegemm.sm90_configs import DecodeConfig, DenseConfig, E2m1Config, Mxfp8Config

pytestmark = pytest.mark.gpu

SM90_FORMATS = ("fp8_block", "bf16")
MX_FORMATS = ("mxfp8", "mxfp4", "nvfp4", "w4a8")
# the decoding kernel's formats: the block formats and the weight-only ones (bf16 activations)
DECODING_FORMATS = sm90_configs.MX_FORMATS


ARRANGEMENTS = ["normal128", "normal256", "split_n", "swapped"]


def forced_config(fmt: str, arrangement: str) -> DenseConfig:
    bk = 128 if fmt == "fp8_block" else 64
    return {
        "normal128": DenseConfig(block_n=128, block_k=bk, stages=4, group_m=4),
        "normal256": DenseConfig(block_n=256, block_k=bk, stages=3, group_m=2),
        "split_n": DenseConfig(block_n=128, block_k=bk, stages=3, group_m=4, split_n=True),
        "swapped": DenseConfig(block_n=32, block_k=bk, stages=6, group_m=1, swap=True),
    }[arrangement]


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS, ids=[p.name for p in TOKEN_PATTERNS])
@pytest.mark.parametrize("fmt", SM90_FORMATS)
def test_sm90_matches_reference(fmt, pattern, arrangement):
    # N=320: a partial last N tile (and a 256-wide tile whose upper half is past N); K=576: a
    # partial last K block (fp8_block: 4.5 x 128).
    run_sm90(fmt, pattern, n=320, k=576, config=forced_config(fmt, arrangement))


# fp8_block's 128 x 256 tiles with the scales staged in the ring (the prefill default), on a ring
# of 3 stages: the 5 K steps of K=576 start each tile at another stage and phase.
SCALE_RING_CONFIG = DenseConfig(block_n=256, block_k=128, stages=3, group_m=2, consumer_regs=216, scale_ring=True)


@pytest.mark.parametrize("pattern", TOKEN_PATTERNS, ids=[p.name for p in TOKEN_PATTERNS])
def test_sm90_fp8_block_scale_ring_matches_reference(pattern):
    # As test_sm90_matches_reference: tokens past M (their scales read as 0), a second weight
    # block past N, a partial last K block; with expert and row scales.
    run_sm90("fp8_block", pattern, n=320, k=576, config=SCALE_RING_CONFIG)


def test_sm90_fp8_block_scale_ring_fp32_output_without_scales():
    run_sm90("fp8_block", TOKEN_PATTERNS[3], n=256, k=1024, out_dtype=torch.float32, with_scales=False,
             config=dataclasses.replace(SCALE_RING_CONFIG, stages=2))


@pytest.mark.parametrize("with_scales", [False, True], ids=["unscaled", "scaled"])
def test_sm90_fp8_block_scale_ring_bits_equal_loaded_scales(with_scales):
    # The library's prefill config (scales staged in the ring) and the same tiles with the scales
    # loaded by the consumers (the previous K loop) sum the same products in the same order: the
    # same bits. ~2 tiles a program (N=1024: 4 weight tiles; 9 K steps on a ring of 4 stages:
    # tiles start at every stage), groups ending inside a tile and at M.
    pattern = TokenPattern("prefill", (3000, 2500, 77, 2700), start=5)
    p = make_problem("fp8_block", "plain", pattern, 1024, 1152, "cuda", with_scales=with_scales)
    ring = config.sm90_config(FORMATS["fp8_block"], 1024, 1152, p.m / 4)
    assert ring.scale_ring
    loaded = dataclasses.replace(ring, scale_ring=False, consumer_regs=232)
    valid = p.valid_rows().to("cuda")
    outs = []
    for cfg in (ring, loaded):
        poisoned = poison_like(p.m, 1024, torch.bfloat16, "cuda")
        out = poisoned.clone()
        with override_config(cfg):
            moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
        check_output(p, out, poisoned, tolerance("fp8_block", "sm90"))
        outs.append(out[valid].view(torch.int16))
    assert torch.equal(outs[0], outs[1]), "scales staged in the ring gave other bits than the loaded scales"


def mx_config(token_tile: int) -> DecodeConfig:
    # (256-token tiles need 240 registers a consumer: config._sm90_mx_config)
    return DecodeConfig(token_tile=token_tile, stages=4, group_m=1 if token_tile < 128 else 4,
                        consumer_regs=240 if token_tile == 256 else 192)


@pytest.mark.parametrize("token_tile", [16, 128, 256])
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS, ids=[p.name for p in TOKEN_PATTERNS])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("fmt", DECODING_FORMATS)
def test_sm90_block_formats_match_reference(fmt, layout, pattern, token_tile):
    # N=320: a partial last weight tile; K=608: a partial last K step (9.5 x 64), an even number
    # of one-step stages (128/256-token tiles take them in pairs); K=544 below: an odd number.
    run_sm90(fmt, pattern, n=320, k=608, config=mx_config(token_tile), layout=layout)


def check_twice(p, fmt: str, n: int):
    """Two sm90 calls of problem p into poisoned outputs: the first against the reference (rows
    outside the slots untouched), the second bit-identical to it."""
    valid = p.valid_rows().to("cuda")
    outs = []
    for _ in range(2):
        poisoned = poison_like(p.m, n, torch.bfloat16, "cuda")
        out = poisoned.clone()
        moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
        if not outs:
            check_output(p, out, poisoned, tolerance(fmt, "sm90"))
        outs.append(out)
    assert torch.equal(outs[0][valid].view(torch.int16), outs[1][valid].view(torch.int16)), "two identical calls differ"
    assert torch.equal(outs[1][~valid].view(torch.int16), poisoned[~valid].view(torch.int16)), "rows outside written"


WIDE_TILE_TOKENS = TokenPattern("wide_tiles", (1000, 130, 300, 257, 129, 2000, 5, 700, 384, 256),
                                (3, 0, 5, 1, 2, 4, 0, -1, 7, 3), experts=8,
                                why="a slot's last 256-token tile: empty, partial or full second half; a skipped slot")


@pytest.mark.parametrize("n,k", [(2880, 2880), (7168, 2048), (320, 544)], ids=["gptoss-down", "dsv3-down", "odd-steps"])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("fmt", DECODING_FORMATS)
def test_sm90_decoding_wide_tiles_at_model_shapes(fmt, layout, n, k):
    # The default config at ~500 tokens a slot: 256-token tiles (two 128-token halves, two ring
    # stages an iteration; K = 2880 and 544 take an odd number of stages), more tiles than SMs.
    # Against the reference, rows outside the slots untouched, and two calls bit-identical.
    from moegemm.config import sm90_mx_config

    p = make_problem(fmt, layout, WIDE_TILE_TOKENS, n, k, "cuda")
    assert sm90_mx_config(FORMATS[fmt], n, k, p.m / len(WIDE_TILE_TOKENS.tokens)).token_tile == 256
    check_twice(p, fmt, n)


@pytest.mark.parametrize("token_tile", [16, 128])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_sm90_mxfp8_decoding_every_e4m3_code(layout, token_tile):
    """The decoding kernel (exact: bf16 wgmma on decoded weights) on every finite weight byte,
    zeros of both signs, the subnormals and 448 included, with weight scale bytes from 0
    (2^-127) to 140. (The promotion kernel's fp8 accumulator is not checked on these: on
    uniformly drawn codes its error reached 3.8-4.3e-4 of sum |a*b|, past the 2e-4 its tolerance
    allows, which was measured on Gaussian data; docs/perf-notes.md.)"""
    p = make_problem("mxfp8", layout, TOKEN_PATTERNS[3], 256, 512, "cuda")
    codes = p.w.data.view(torch.uint8)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    codes.copy_(finite[torch.randint(0, finite.numel(), codes.shape, device="cuda")])
    scale_bytes = torch.tensor([0, 100, 120, 125, 127, 130, 134, 135, 137, 140], dtype=torch.uint8, device="cuda")
    scales = p.w.scales.view(torch.uint8)
    scales.copy_(scale_bytes[torch.randint(0, scale_bytes.numel(), scales.shape, device="cuda")])
    poisoned = poison_like(p.m, 256, torch.bfloat16, "cuda")
    out = poisoned.clone()
    with override_config(mx_config(token_tile)):
        moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
    check_output(p, out, poisoned, tolerance("mxfp8", "sm90"))


@pytest.mark.parametrize("kernel,token_tile", [("decoding", 16), ("decoding", 128), ("promotion", 16),
                                               ("promotion", 128)])
def test_sm90_mxfp8_nan_weights(kernel, token_tile):
    """The e4m3 NaN codes 0x7F and 0xFF in two weight rows make exactly those rows' outputs NaN,
    for every token of their expert, in both mxfp8 kernels."""
    p = make_problem("mxfp8", "swizzled", TOKEN_PATTERNS[3], 256, 512, "cuda")
    expert = int(p.expert_ids[0])
    codes = p.w.data.view(torch.uint8)
    codes[expert, 17, 100] = 0x7F
    codes[expert, 200, 511] = 0xFF
    config = mx_config(token_tile) if kernel == "decoding" else mxfp8_promotion_config(token_tile)
    out = poison_like(p.m, 256, torch.bfloat16, "cuda")
    with override_config(config):
        moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
    rows = torch.zeros(p.m, dtype=torch.bool)
    offsets = p.a_offsets.tolist()
    for g, e in enumerate(p.expert_ids.tolist()):
        if e == expert:
            rows[offsets[g]:offsets[g + 1]] = True
    assert bool(rows.any())
    nan = out.isnan().cpu()
    assert bool(nan[rows][:, [17, 200]].all())
    assert int(nan[p.valid_rows()].sum()) == 2 * int(rows.sum())


def wide_stage_cases():
    for fmt in MX_FORMATS:
        for sub_steps in (2, 4) if FORMATS[fmt].b.element.packed else (2, ):
            for token_tile in (16, 64):  # (128-token tiles take one step: config.check says why)
                yield fmt, sub_steps, token_tile


@pytest.mark.parametrize("k", [608, 7168])
@pytest.mark.parametrize("pattern", [TOKEN_PATTERNS[i] for i in (1, 5, 8, 13)], ids=lambda p: p.name)
@pytest.mark.parametrize("fmt,sub_steps,token_tile", list(wide_stage_cases()))
def test_sm90_block_formats_wide_stages(fmt, sub_steps, token_tile, pattern, k):
    # A stage carrying 2 or 4 K steps (128 bytes of each weight row): K=608 ends inside the
    # first (4 steps: 256) or fifth stage; K=7168 runs 28-56 stages a tile.
    config = dataclasses.replace(mx_config(token_tile), sub_steps=sub_steps, stages=3)
    run_sm90(fmt, pattern, n=320, k=k, config=config, layout="swizzled")


def mxfp8_promotion_config(token_tile: int, stages: int = 4) -> Mxfp8Config:
    return Mxfp8Config(token_tile=token_tile, stages=stages, group_m=1 if token_tile <= 32 else 4,
                       consumer_regs=192 if token_tile <= 32 else 232)


@pytest.mark.parametrize("k", [608, 7168])
@pytest.mark.parametrize("token_tile", [16, 32, 64, 128])
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS, ids=[p.name for p in TOKEN_PATTERNS])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_sm90_mxfp8_promotion_matches_reference(layout, pattern, token_tile, k):
    # kernels/sm90/mxfp8.py: K=608 has 19 scale blocks (the last stage holds three, and its
    # swizzled word one padding byte); K=7168 runs 56 stages a tile. N=320: a partial weight tile.
    # 64 and 128 tokens: the wide tiles, token scales through the ring.
    run_sm90("mxfp8", pattern, n=320, k=k, config=mxfp8_promotion_config(token_tile), layout=layout)


# Slot sizes at the edges of a tail (128-token tiles, tails of 16 or 32): none, exactly full,
# one over; two tiles with and without a tail; starting at an unaligned row.
TAIL_EDGES = TokenPattern("tail_edges", (159, 160, 161, 288, 289, 32, 33, 144, 145, 417), (3, 0, 5, 1, 2, 4, 0, 6, 7, 3),
                          start=5, tail=40, why="last tiles of 128 + 0..33 tokens")


def mxfp8_tail_config(tail: int = 32, short_tails: bool = False) -> Mxfp8Config:
    return dataclasses.replace(mxfp8_promotion_config(128, stages=3), tail_tokens=tail, consumer_regs=240,
                               short_tails=short_tails)


@pytest.mark.parametrize("tail", [16, 32, "32-short"])
@pytest.mark.parametrize("k", [608, 7168])
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS + [TAIL_EDGES], ids=lambda p: p.name)
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_sm90_mxfp8_tails_match_reference(layout, pattern, k, tail):
    # A slot's last 128-token tile takes up to `tail` more tokens on a second accumulator
    # (kernels/sm90/mxfp8.py); the tail's tokens and scales come through the ring with it.
    # 32-short: tails of up to 16 tokens on a 16-wide accumulator (TAIL_EDGES: 144 and 145).
    config = mxfp8_tail_config(32, True) if tail == "32-short" else mxfp8_tail_config(tail)
    run_sm90("mxfp8", pattern, n=320, k=k, config=config, layout=layout)


@pytest.mark.parametrize("out_fmt", [None, "mxfp8"])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_sm90_mxfp8_short_tails_are_bit_identical(layout, out_fmt):
    # A token's sums do not depend on the accumulator's width: the short tails' outputs are the
    # 32-wide tails' bytes, for the plain and the fused SwiGLU epilogue (mxfp8 output).
    p = make_problem("mxfp8", layout, TAIL_EDGES, 320, 608, "cuda")
    valid = p.valid_rows().to("cuda")
    outs = []
    for short in (False, True):
        with override_config(mxfp8_tail_config(32, short)):
            if out_fmt is None:
                out = poison_like(p.m, 320, torch.bfloat16, "cuda")
                moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
                outs.append([out[valid].view(torch.int16)])
            else:
                y = moegemm.grouped_matmul_swiglu(*p.args(), fmt="mxfp8", gate_up_layout="interleaved", out_fmt=out_fmt,
                                                  activation="swiglu",
                                                  expert_scales=p.expert_scales, scale_layout=p.layout, fused=True,
                                                  backend="sm90")
                outs.append([y.data[valid].view(torch.uint8), y.scales.view(torch.uint8)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


E2M1_WEIGHT_FORMATS = ("mxfp4", "w4a8")


def e2m1_promotion_config(stages: int = 4, token_tile: int = 16, split_k: bool = False) -> E2m1Config:
    return E2m1Config(token_tile=token_tile, stages=stages, group_m=1, consumer_regs=112 if split_k else 192,
                      split_k=split_k)


@pytest.mark.parametrize("split_k", [False, True], ids=["two-wg", "split-k"])
@pytest.mark.parametrize("k", [608, 7168])
@pytest.mark.parametrize("token_tile", [8, 16])
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS, ids=[p.name for p in TOKEN_PATTERNS])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("fmt", E2M1_WEIGHT_FORMATS)
def test_sm90_e2m1_weights_promotion_matches_reference(fmt, layout, pattern, token_tile, k, split_k):
    # kernels/sm90/e2m1.py with e2m1 weights decoded to e4m3 (256 K a stage): K=608 ends in the
    # third stage, its last half holding three scale blocks; K=7168 runs 28 stages a tile.
    # 8-token tiles: the patterns' larger groups take several. Split-K: four consumer
    # warpgroups, one K half of every stage to each pair, the sums added at the tile's end.
    config = e2m1_promotion_config(token_tile=token_tile, split_k=split_k)
    run_sm90(fmt, pattern, n=320, k=k, config=config, layout=layout)


@pytest.mark.parametrize("split_k", [False, True], ids=["two-wg", "split-k"])
@pytest.mark.parametrize("k", [288, 416, 480])
@pytest.mark.parametrize("pattern", [TOKEN_PATTERNS[3], TOKEN_PATTERNS[6]], ids=lambda p: p.name)
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("fmt", E2M1_WEIGHT_FORMATS)
def test_sm90_e2m1_weights_last_stage(fmt, layout, pattern, k, split_k):
    # The last 256-K stage decodes only its first half when the rest lies past K (_promote_chain_fp4;
    # split-K: the second half's warpgroups wait for the stage and release it): K = 288 leaves one
    # scale block in it, 480 a full first half and nothing else; 416 takes both halves, the
    # second one partial.
    config = e2m1_promotion_config(token_tile=8, split_k=split_k)
    run_sm90(fmt, pattern, n=320, k=k, config=config, layout=layout)


LAYER_TOKENS = [(75, 80, 70, 77, 73, 76, 74, 75), (160, 0, 130, 97, 135, 128)]


@pytest.mark.parametrize("tokens", LAYER_TOKENS, ids=["75-a-group", "ragged-128"])
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_sm90_block_formats_layer_shapes(fmt, tokens):
    # The MoE layer's gate/up shapes (tests/test_moe.py: N = 2 x 256, K = 256, ~75 tokens an
    # expert), where 128-token tiles with two K steps a stage gave wrong rows that the kernel
    # tests above do not catch (docs/perf-notes.md, "The wgmma-in-flight hazard"); the default
    # config, run three times.
    from cases import TokenPattern
    for _ in range(3):
        run_sm90(fmt, TokenPattern("layer", tokens), n=512, k=256, layout="swizzled")


def many_slots_pattern():
    """100 slots (the other patterns have at most 4): tiny, empty and skipped slots, a run of 32
    slots with no tile, a large group, a repeated expert, a_offsets[0] > 0 and rows after the
    end. (A 32-slot-chunk schedule was tried against it: docs/perf-notes.md.)"""
    from cases import TokenPattern
    tokens = [3, 0, 1, 7, 2, 0, 4, 1] * 3 + [0, 2, 0, 5, 1, 0, 9, 40]  # slots 0..31
    tokens += [0] * 16 + [6] * 16  # slots 32..63: empty, then skipped
    tokens += [1, 300, 0, 17, 2, 0, 33, 5] * 4  # slots 64..95
    tokens += [4, 0, 129, 2]  # slots 96..99
    ids = [g if g % 11 != 5 else -1 for g in range(len(tokens))]
    ids[48:64] = [-1] * 16
    ids[31] = 7  # (a repeated expert)
    return TokenPattern("many_slots", tuple(tokens), tuple(ids), start=5, tail=3)


@pytest.mark.parametrize("fmt,config", [
    ("fp8_block", forced_config("fp8_block", "normal128")), ("fp8_block", forced_config("fp8_block", "swapped")),
    ("bf16", forced_config("bf16", "split_n")), ("mxfp8", mxfp8_promotion_config(16)),
    ("mxfp8", mxfp8_promotion_config(128)), ("mxfp8", dataclasses.replace(mxfp8_promotion_config(32), chunk_walk=True)),
    ("mxfp4", e2m1_promotion_config(token_tile=8)),
    ("w4a8", e2m1_promotion_config(token_tile=16)), ("mxfp4", e2m1_promotion_config(token_tile=8, split_k=True)),
    ("w4a8", e2m1_promotion_config(token_tile=16, split_k=True)), ("nvfp4", mx_config(16)),
    ("mxfp4", mx_config(128))],
    ids=lambda v: v if isinstance(v, str) else
    f"{type(v).__name__}-{v.token_tile}{'-splitk' if getattr(v, 'split_k', False) else ''}"
    f"{'-chunks' if getattr(v, 'chunk_walk', False) else ''}")
def test_sm90_many_slots(fmt, config):
    # Every partition of every kernel walks all the slots; each group's tiles must run, once.
    layout = "swizzled" if FORMATS[fmt].swizzle_capable else "plain"
    run_sm90(fmt, many_slots_pattern(), n=256, k=512, config=config, layout=layout)


@pytest.mark.parametrize("token_tile", [32, 64])
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_sm90_block_formats_other_token_tiles(fmt, token_tile):
    run_sm90(fmt, TOKEN_PATTERNS[3], n=256, k=512, config=mx_config(token_tile), layout="swizzled")


@pytest.mark.parametrize("fmt", MX_FORMATS)
@pytest.mark.parametrize("tokens", [(16,) * 24, (3000, 500)], ids=["decode", "prefill"])
def test_sm90_block_formats_default_config(fmt, tokens):
    # K = 2880 and N = 192 (gpt-oss, Qwen3 at TP8) with the config the op picks for itself.
    from cases import TokenPattern
    run_sm90(fmt, TokenPattern("model", tokens), n=192, k=2880, layout="swizzled")


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_sm90_block_formats_fp32_output_without_scales(fmt):
    run_sm90(fmt, TOKEN_PATTERNS[3], n=256, k=1024, out_dtype=torch.float32, with_scales=False)


@pytest.mark.parametrize("fmt", SM90_FORMATS)
@pytest.mark.parametrize("pattern", [TOKEN_PATTERNS[0], TOKEN_PATTERNS[13], TOKEN_PATTERNS[12]],
                         ids=["large", "offset_start", "repeated_unsorted"])
def test_sm90_default_config_partial_blocks(fmt, pattern):
    # K = 2880 and N = 192 are real shapes (gpt-oss, Qwen3 at TP8): partial 128-blocks on both axes.
    run_sm90(fmt, pattern, n=192, k=2880)


@pytest.mark.parametrize("fmt", SM90_FORMATS)
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_sm90_fp32_output_without_scales(fmt, arrangement):
    config = forced_config(fmt, arrangement)
    if config.smem_bytes(FORMATS[fmt], 4) > 232448:
        config = dataclasses.replace(config, stages=config.stages - 1)
    run_sm90(fmt, TOKEN_PATTERNS[3], n=256, k=1024, out_dtype=torch.float32, with_scales=False, config=config)


def n_major(w: torch.Tensor) -> torch.Tensor:
    """Weights [E, N, K] with unit stride along N: the transpose(1, 2) of a contiguous [E, K, N]
    copy (gpt-oss stores its experts [E, in, out])."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def check_n_major(p, n: int, config=None):
    """The bf16 kernel on p's weights N-major (read in place) into a poisoned output: against the
    fp64 reference with rows outside the slots untouched, and bit for bit what the same weights
    K-major give (the same wgmmas in the same order: only the operand's major order differs)."""
    weights = n_major(p.w.data)
    assert weights.stride(1) == 1 and not weights.is_contiguous()
    poisoned = poison_like(p.m, n, torch.bfloat16, "cuda")
    outs = []
    for b in (p.w.data, weights):
        out = poisoned.clone()
        with override_config(config) if config is not None else contextlib.nullcontext():
            moegemm.grouped_matmul(p.a.data, b, None, None, p.a_offsets, p.expert_ids, **p.kwargs(), out=out,
                                   backend="sm90")
        outs.append(out)
    check_output(p, outs[1], poisoned, tolerance("bf16", "sm90"))
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16)), "N-major weights gave other bits"


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("pattern", [TOKEN_PATTERNS[i] for i in (1, 7, 8, 12, 13)], ids=lambda p: p.name)
def test_sm90_n_major_bf16_weights(pattern, arrangement):
    # N=320: a partial last weight tile (TMA zero-fills the N-major box past N); K=560: a partial
    # last K step (8.75 x 64), zero-filled at each expert's end by the 3-D box.
    p = make_problem("bf16", "plain", pattern, 320, 560, "cuda")
    check_n_major(p, 320, forced_config("bf16", arrangement))


def _gpt_oss_pattern(name: str, tokens: tuple, why: str) -> TokenPattern:
    """32 slots of gpt-oss's 32 experts, slots 3, 10 and 21 skipped (id -1: non-empty slots that
    must not be written), rows before the first slot and after the last."""
    ids = tuple(-1 if g in (3, 10, 21) else (g * 7) % 32 for g in range(len(tokens)))
    return TokenPattern(name, tokens, ids, start=5, tail=7, experts=32, why=why)


GPT_OSS_PATTERNS = [
    _gpt_oss_pattern("prefill", (700, 0, 129, 512, 65, 1, 250, 384, 0, 77, 128, 1200, 3, 256, 90, 140, 1000, 7, 64,
                                 33, 0, 130, 45, 257, 12, 99, 5, 150, 600, 31, 2, 1088),
                     "normal 128 x 256 tiles: ragged ends, empty and one-row slots"),
    _gpt_oss_pattern("small_groups", tuple(100 + (g * 37) % 61 - 30 for g in range(32)),
                     "split-n tiles: ~100 tokens a slot"),
    _gpt_oss_pattern("decode", tuple((g * 5) % 4 for g in range(32)), "swapped tiles: 0-3 tokens a slot"),
]


@pytest.mark.parametrize("n,k", [(5760, 2880), (2880, 2880)], ids=["gate_up", "down"])
@pytest.mark.parametrize("pattern", GPT_OSS_PATTERNS, ids=lambda p: p.name)
def test_sm90_n_major_bf16_weights_at_gpt_oss_sizes(pattern, n, k):
    """gpt-oss-20b's experts in bf16 as it stores them ([E, in, out], read N-major in place) with
    the default config of each regime (normal, split-n, swapped tiles), more tiles than SMs."""
    p = make_problem("bf16", "plain", pattern, n, k, "cuda")
    cfg = config.sm90_config(FORMATS["bf16"], n, k, p.m / len(pattern.tokens))
    arrangement = "swap" if cfg.swap else "split_n" if cfg.split_n else "normal"
    assert arrangement == {"prefill": "normal", "small_groups": "split_n", "decode": "swap"}[pattern.name]
    tiles = sum(-(-t // cfg.token_tile) for t, e in zip(pattern.tokens, pattern.expert_ids) if e >= 0)
    assert tiles * -(-n // cfg.weight_tile) > torch.cuda.get_device_properties(0).multi_processor_count
    check_n_major(p, n)


@pytest.mark.parametrize("pattern", [GPT_OSS_PATTERNS[0], GPT_OSS_PATTERNS[2]], ids=lambda p: p.name)
def test_sm90_fused_swiglu_reads_n_major_weights(pattern, monkeypatch):
    """gpt-oss's gate/up step as the MoE layer runs it (fused clamped SwiGLU with biases, gate and
    up interleaved) on its N-major weights: the fused epilogue runs, and writes the bits the
    K-major weights give, at prefill and at decode."""
    p = make_problem("bf16", "plain", pattern, 5760, 2880, "cuda", with_scales=False)
    bias = torch.randn(32, 5760, device="cuda")
    fused = []
    launch = moegemm.plan.launch_fused
    monkeypatch.setattr(moegemm.plan, "launch_fused", lambda *args, **kw: fused.append(1) or launch(*args, **kw))
    outs = [moegemm.grouped_matmul_swiglu(p.a.data, b, None, None, p.a_offsets, p.expert_ids, fmt="bf16",
                                          gate_up_layout="interleaved", activation="swiglu_oai", bias=bias,
                                          backend="sm90").data for b in (p.w.data, n_major(p.w.data))]
    assert len(fused) == 2
    valid = p.valid_rows().to("cuda")
    assert outs[0].shape == (p.m, 2880) and not bool(outs[1][valid].isnan().any())
    assert torch.equal(outs[1][valid].view(torch.int16), outs[0][valid].view(torch.int16))


@pytest.mark.parametrize("fmt", SM90_FORMATS + MX_FORMATS)
def test_auto_picks_sm90_on_hopper(fmt):
    assert "sm90" in moegemm.available_backends("cuda")
    p = make_problem(fmt, "plain", TOKEN_PATTERNS[1], 256, 512, "cuda")
    poisoned = poison_like(p.m, 256, torch.bfloat16, "cuda")
    out = poisoned.clone()
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out)
    check_output(p, out, poisoned, tolerance(fmt, "sm90"))


def test_sm90_rejects_what_it_cannot_run():
    p = make_problem("nvfp4", "plain", TOKEN_PATTERNS[5], 64, 48, "cuda")  # packed rows of 24 bytes
    with pytest.raises(ValueError, match="^backend:"):
        moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="sm90")
    p = make_problem("bf16", "plain", TOKEN_PATTERNS[5], 36, 64, "cuda")  # N*2 bytes not 16-aligned
    with pytest.raises(ValueError, match="^backend:"):
        moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="sm90")
    out = torch.zeros(p.m, 36, dtype=torch.bfloat16, device="cuda")
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out)  # auto falls back to the portable kernel
    assert not bool(out[p.valid_rows().cuda()].isnan().any())


@pytest.mark.parametrize("fmt,layout,forced", [
    ("fp8_block", "plain", None), ("fp8_block", "plain", "scale-ring"), ("bf16", "plain", None), ("mxfp8", "plain", None), ("mxfp8", "swizzled", "narrow"),
    ("mxfp8", "swizzled", "tail"), ("mxfp4", "swizzled", None), ("nvfp4", "swizzled", None), ("w4a8", "plain", None)])
def test_sm90_cuda_graph_replays_with_new_routing(fmt, layout, forced):
    # The launch reads no device value: capture once, change offsets and ids, replay. (Swizzled
    # A scales: a_scale_offsets is derived on the device inside the captured call; the new
    # groups need 17 scale blocks of the 18 the tensor has.) forced: the mxfp8 promotion
    # kernel on 32-token tiles and its token-scale pre-pass (its regime is decode), or on
    # 128-token tiles with tails (the replay's 800-token group ends in a tile of 160); fp8_block's
    # 128 x 256 tiles with the scales in the ring (the library takes them from N = 1024).
    pattern = TOKEN_PATTERNS[3]
    p = make_problem(fmt, layout, pattern, 256, 512, "cuda")
    out = torch.zeros(p.m, 256, dtype=torch.bfloat16, device="cuda")
    config = {None: None, "narrow": mxfp8_promotion_config(32), "tail": mxfp8_tail_config(32),
              "scale-ring": SCALE_RING_CONFIG}[forced]

    def call():
        if config is None:
            moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
        else:
            with override_config(config):
                moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    new_offsets = torch.tensor([0, 700, 700, 1500, p.m], dtype=torch.int32, device="cuda")
    p.a_offsets.copy_(new_offsets)
    p.expert_ids.copy_(torch.tensor([2, 0, 3, -1], dtype=torch.int32, device="cuda"))
    poisoned = poison_like(p.m, 256, torch.bfloat16, "cuda")
    out.copy_(poisoned)
    graph.replay()
    torch.cuda.synchronize()
    check_output(p, out, poisoned, tolerance(fmt, "sm90"))



# A fresh output (no out given) of the formats with a token pre-pass: the pre-pass zeroes its rows
# outside valid slots in an uninitialized tensor (kernels/tokens.py).
DECODE_SKIPS = TokenPattern("decode_skips", (1,) * 8, (0, 1, -1, 3, 4, -1, 6, 7), start=1, tail=2,
                            why="the host-time shape (8 slots of one token) with skips and edge rows")
FRESH_PATTERNS = [DECODE_SKIPS, EDGE_ROWS, TOKEN_PATTERNS[13], TOKEN_PATTERNS[10], ROWS_NO_GROUPS]


def fresh_output_matches_a_zeroed_one(p, out_dtype=torch.bfloat16):
    """A call without out, its memory dirty, gives the bits of a call into a zeroed out: +0 in every
    row outside valid slots, the same product in the others."""
    want = torch.zeros(p.m, p.n, dtype=out_dtype, device="cuda")
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=want, out_dtype=out_dtype, backend="sm90")
    dirty_cached_blocks(p.m * p.n * out_dtype.itemsize)
    got = moegemm.grouped_matmul(*p.args(), **p.kwargs(), out_dtype=out_dtype, backend="sm90")
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    valid = p.valid_rows().cuda()
    free = got[~valid].view(bits)
    assert torch.equal(free, torch.zeros_like(free)), "a row outside valid slots is not +0"
    assert torch.equal(got.view(bits), want.view(bits)), "a valid row differs from the call into a zeroed out"


@pytest.mark.parametrize("pattern", FRESH_PATTERNS, ids=lambda p: p.name)
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_sm90_fresh_output_reads_zero_outside_valid_slots(fmt, layout, pattern):
    # N 512, K 1024: the host-time size; mxfp4 and w4a8 take the e2m1 promotion kernel at decode
    # (plain) and the decoding kernel otherwise: every kind of pre-pass.
    fresh_output_matches_a_zeroed_one(make_problem(fmt, layout, pattern, 512, 1024, "cuda"))


# The formats with no token pre-pass: their kernel's FILL variant zeroes those rows after its
# tiles (kernels/sm90/free_rows.py). N 512, K 1024 at decode (swapped and decoding tiles), and at
# ~800 tokens a slot (normal dense tiles; at N 512 fp8_block loads its scales, the staged-scale
# variant is compiled offline: test_compile_sm90.py).
NO_PREPASS_FORMATS = ("bf16", "fp8_block", "bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")
PREFILL_SKIPS = TokenPattern("prefill_skips", (1000, 24, 1100, 900), (0, -1, 2, 3), start=70, tail=130,
                             why="normal tiles, a skipped slot between, rows before the first and after the last")


@pytest.mark.parametrize("pattern", [*FRESH_PATTERNS, PREFILL_SKIPS], ids=lambda p: p.name)
@pytest.mark.parametrize("fmt", NO_PREPASS_FORMATS)
def test_sm90_fresh_output_of_the_filling_kernels_reads_zero_outside_valid_slots(fmt, pattern):
    layout = "swizzled" if fmt.startswith("bf16_") else "plain"
    fresh_output_matches_a_zeroed_one(make_problem(fmt, layout, pattern, 512, 1024, "cuda"))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "bf16_mxfp4"])
def test_sm90_fresh_fp32_output_of_the_filling_kernels_reads_zero_outside_valid_slots(fmt):
    layout = "swizzled" if fmt.startswith("bf16_") else "plain"
    fresh_output_matches_a_zeroed_one(make_problem(fmt, layout, EDGE_ROWS, 512, 1024, "cuda"), torch.float32)


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_sm90_fresh_fp32_output_reads_zero_outside_valid_slots(fmt):
    fresh_output_matches_a_zeroed_one(make_problem(fmt, "plain", EDGE_ROWS, 512, 1024, "cuda"), torch.float32)


@pytest.mark.parametrize("fmt", [*MX_FORMATS, *NO_PREPASS_FORMATS])
def test_sm90_cuda_graph_zeroes_its_fresh_output_at_every_replay(fmt):
    """A captured call without out: each replay zeroes the output's rows outside the replay's
    valid slots, in the token pre-pass or the kernel's FILL variant (new routing, the output
    poisoned between)."""
    p = make_problem(fmt, "plain", EDGE_ROWS, 512, 1024, "cuda")
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="sm90")  # (compiled before the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="sm90")
    p.a_offsets.copy_(torch.tensor([2, 10, 10, 30, 31, 60], dtype=torch.int32))
    p.expert_ids.copy_(torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32))
    out.copy_(poison_like(p.m, p.n, torch.bfloat16, "cuda"))
    graph.replay()
    want = torch.zeros(p.m, p.n, dtype=torch.bfloat16, device="cuda")
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=want, backend="sm90")
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    free = out[~p.valid_rows().cuda()].view(torch.int16)
    assert free.numel() and torch.equal(free, torch.zeros_like(free))


SCHEDULE_CONFIGS = {
    "fp8_block-normal128": ("fp8_block", forced_config("fp8_block", "normal128")),
    "fp8_block-swapped": ("fp8_block", forced_config("fp8_block", "swapped")),
    "fp8_block-scale-ring": ("fp8_block", SCALE_RING_CONFIG),
    "bf16-split_n": ("bf16", forced_config("bf16", "split_n")),
    "bf16-normal256": ("bf16", forced_config("bf16", "normal256")),
    "mxfp8-16": ("mxfp8", mxfp8_promotion_config(16)),
    "mxfp8-32-chunks": ("mxfp8", dataclasses.replace(mxfp8_promotion_config(32), chunk_walk=True)),
    "mxfp8-128-tail32": ("mxfp8", mxfp8_tail_config(32)),
    "mxfp8-128-short-tails": ("mxfp8", mxfp8_tail_config(32, True)),
    "mxfp4-8": ("mxfp4", e2m1_promotion_config(token_tile=8)),
}
# Tiles claimed after the first (1000 rounds), in the last round only, or dealt round-robin.
CLAIM_ROUNDS = (1000, 1, 0)


@pytest.mark.parametrize("name", list(SCHEDULE_CONFIGS))
def test_sm90_tile_claims_match_round_robin(name):
    # N = 2048 over the TAIL_EDGES slots: ~2-5 tiles a program, so the producer claims the last
    # rounds' tiles from the counter as programs free up (kernels/sm90/pipeline.py, schedule). Which
    # program computes a tile must not change it: each schedule against the reference, and all
    # bit-identical.
    fmt, config = SCHEDULE_CONFIGS[name]
    layout = "swizzled" if FORMATS[fmt].swizzle_capable else "plain"
    p = make_problem(fmt, layout, TAIL_EDGES, 2048, 512, "cuda")
    outs = []
    for claim_rounds in CLAIM_ROUNDS:
        poisoned = poison_like(p.m, 2048, torch.bfloat16, "cuda")
        out = poisoned.clone()
        with override_config(dataclasses.replace(config, claim_rounds=claim_rounds)):
            moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
        check_output(p, out, poisoned, tolerance(fmt, "sm90"))
        outs.append(out[p.valid_rows().to(out.device)].view(torch.int16))
    for rounds, out in zip(CLAIM_ROUNDS[1:], outs[1:]):
        assert torch.equal(outs[0], out), f"claim_rounds {rounds} gave other outputs than claiming all tiles"


@pytest.mark.parametrize("fmt,out_fmt", [("bf16", "bf16"), ("mxfp8", "mxfp8")])
def test_sm90_fused_tile_claims_match_round_robin(fmt, out_fmt):
    # The fused SwiGLU epilogue (bf16: 64 x 256 split tiles; mxfp8: 128-token tiles with tails,
    # quantized output) under each schedule: the same bytes. (Its accuracy is tests/test_moe.py's
    # test_fused_swiglu_epilogue_matches_unfused.)
    p = make_problem(fmt, "swizzled" if fmt == "mxfp8" else "plain", TAIL_EDGES, 2048, 512, "cuda")
    if fmt == "mxfp8":
        config = mxfp8_tail_config(32)
    else:
        config = DenseConfig(block_n=128, block_k=64, stages=5, group_m=4, split_n=True)
    valid = p.valid_rows().to("cuda")
    outs = []
    for claim_rounds in CLAIM_ROUNDS:
        with override_config(dataclasses.replace(config, claim_rounds=claim_rounds)):
            y = moegemm.grouped_matmul_swiglu(*p.args(), fmt=fmt, gate_up_layout="interleaved", out_fmt=out_fmt,
                                              activation="swiglu_oai",
                                              expert_scales=p.expert_scales, scale_layout=p.layout, fused=True,
                                              backend="sm90")
        assert bool(torch.isfinite(moegemm.dequantize(y)[valid].float()).all())
        outs.append([y.data[valid].view(torch.uint8)] + ([] if y.scales is None else [y.scales.view(torch.uint8)]))
    for rounds, out in zip(CLAIM_ROUNDS[1:], outs[1:]):
        assert all(torch.equal(a, b) for a, b in zip(outs[0], out)), \
            f"claim_rounds {rounds} gave other bytes than claiming all tiles"


def small_groups(num_groups: int, seed: int, experts: int = 16) -> TokenPattern:
    """num_groups slots of 1..30 tokens (seeded), experts repeating over `experts` ids."""
    tokens = torch.randint(1, 31, (num_groups,), generator=torch.Generator().manual_seed(seed)).tolist()
    return TokenPattern(f"small-{num_groups}", tuple(tokens), tuple(g % experts for g in range(num_groups)),
                        experts=experts)


@pytest.mark.parametrize("with_scales", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("n,k,num_groups", [(7168, 2048, 200), (4096, 7168, 64)], ids=["dsv3-down", "dsv3-up"])
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_sm90_block_formats_small_groups_at_model_shapes(fmt, n, k, num_groups, layout, with_scales):
    # DeepSeek-V3's products with 64-256 slots of 1-30 tokens (the decoding kernel's 32-token
    # tiles, the promotion kernel's 16/32-token ones, the e2m1 split-K tiles): thousands of tiles,
    # many a program. The decoding kernel once read its accumulator before the last wgmma retired,
    # in the call without expert and row scales (kernels/sm90/decode.py, _upcast_chain): outputs
    # 5-12% off and different each run. Against the reference, and two calls bit-identical.
    p = make_problem(fmt, layout, small_groups(num_groups, seed=n + k), n, k, "cuda", with_scales=with_scales)
    check_twice(p, fmt, n)
