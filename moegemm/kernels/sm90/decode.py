"""The sm90 kernel of the block formats by decoding the weights to bf16 in the consumers: nvfp4
and the weight-only formats (bf16_mxfp4, bf16_nvfp4, bf16_mxfp8: bf16 tokens as they come)
everywhere, mxfp4 and w4a8 above 12 tokens a slot or on prepacked weights, mxfp8 at many tokens
a slot.

Hopper has no block-scaled tensor-core instruction. Every 32- (nvfp4: 16-) wide K block
carries a scale per weight row AND one per token, so the exact math is either fp8 wgmma per
k32 followed by an fp32 promotion with the outer product of the two scale vectors (2 FP32
ops per output element per k32: the FP32 pipe then caps the run at the dense bf16 rate),
or bf16 wgmma on operands decoded with their scales folded in, which is exact: e4m3 or e2m1
times a power of two, and e2m1 times an e4m3 scale, have at most 5 significant bits. This
kernel does the latter (docs/design.md records the measurements):

    tokens   decoded once per call by a tl pre-pass (tokens.dequantize_rows), or written in
             that form by the layer's kernels (token_forms.py), into a bf16 [M, K] buffer (the
             weight-only formats' tokens are that buffer), TMA-loaded as the wgmma B operand
    weights  TMA-loaded COMPRESSED (1 byte or half a byte per element) into the ring, 128
             bytes of each weight row per stage at decode (SUB = 2 steps of 64 K; 128- and
             256-token tiles one step, config._sm90_mx_config says why: one step, 32 or 64
             bytes a row, took the same ~0.7 us per stage whatever its bytes, H100); each
             consumer warpgroup decodes its 64 weight rows times the block scales (gathered
             from global memory, plain or swizzled layout, one step ahead) into a bf16
             shared-memory operand, two buffers a warpgroup; prepacked weights (moegemm.prepack,
             formats.PREPACK_FORMATS) into the wgmma's register operand instead, e2m1 by
             rotations and masks of bit-interleaved words (e2m1_words.py)

so the weights cross HBM once, compressed: what decode (few tokens per expert) is bound by.
Tiles are always "swapped": 128 weight rows (two warpgroups of 64) x TOK_TILE tokens
(sm90_configs.DecodeConfig: one group's tokens at decode, 128 for small groups, 256 for many: two
128-token halves, one accumulator each, on one decoded operand); prepacked weights at up to 64
tokens take 256 rows, four consumer warpgroups on each token stage (the bf16 tokens of a
128-row tile were half its fp4 weight bytes). Producer, barriers, schedule and the masked
epilogue are pipeline.py's.

Steady state of one consumer (an iteration: one stage of SUB steps, or two stages of one step):
    wait ready[s]
    per step: load the scales of the next step; w = decode(weights[s] rows, step) * scales
              store w to operand buffer step % 2; acc_h = wgmma(buffer, tokens[s, step, h]^T, acc_h)
              wait until the step's wgmmas are left in flight (the next decode overlaps them),
              or, after the iteration's last step, until none is (_upcast_chain says why)
    arrive empty[s] for the iteration's stages

Prepacked e2m1 with swizzled scales may take them through the ring instead (DecodeConfig.staged_scales,
_staged_chain): the producer copies the tile's scale atoms with each stage, the consumers read
their rows' words from it (no global load in the loop) and fold e8m0's 2^126 into the scales;
consumer_rows 128 runs two warpgroups of two 64-row accumulators each on a 256-row tile.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from .e2m1_words import e2m1_words_to_pairs, scaled_pairs
from .free_rows import zero_free_rows
from .pipeline import (
    OPTIONAL_SMEM,
    WG_ROWS,
    Output,
    Producer,
    Ring,
    Schedule,
    optional,
    produce,
    producer_registers,
    scale_row_offsets,
    walk,
)
from .swiglu import Swiglu


# nvfp4's e4m3 block scales times 2^117 are bf16 still (448 * 2^117 < 2^126), so the decoding
# multiplies the biased elements by them once: the weights come out 2^-9 small, which the
# accumulator's one multiply by 2^9 before the epilogue undoes (powers of two: the same bits).
NV_SCALE_BIAS = gl.constexpr(2.0**117)
# e8m0 codes b0, b1 (bytes 2h and 2h + 1 of a swizzled scale word) to the bf16 pair 2^(b0-1),
# 2^(b1-1): the bytes to the halves' low bits (PRMT), then b * 2^7 + (126 << 7), bf16's exponent
# field b + 126 (exact for b <= 128; _staged_chain takes larger codes another way).
_FOLDED_E8M0_PTX = gl.constexpr(tuple(
    f"{{.reg .b32 t; prmt.b32 t, $1, 0, {0x4040 | 2 * h | (2 * h + 1) << 8:#06x}; mad.lo.u32 $0, t, 128, 0x3F003F00;}}"
    for h in range(2)))
NV_ACC_FACTOR = gl.constexpr(2.0**9)


@gluon.jit
def _load_scales(scale_rows, row_ok, kk, NUM_KB, layout: gl.constexpr, NKB: gl.constexpr, SWIZZLED: gl.constexpr,
                 NV_SCALE: gl.constexpr, BIASED: gl.constexpr = False):
    """The NKB block scales of K step kk of each weight row, a bf16 [64, NKB] tensor.
    e8m0 b -> 2^(b-127) (0 -> 2^-127, a bf16 subnormal; 255 -> NaN); nvfp4: e4m3, BIASED: times
    NV_SCALE_BIAS (prepacked e2m1 decoded without its 2^126)."""
    kb = kk * NKB + gl.arange(0, NKB, layout=gl.SliceLayout(0, layout))
    if SWIZZLED:
        k_offsets = (kb // 4) * 512 + kb % 4
    else:
        k_offsets = kb
    mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(kb < NUM_KB, 0)
    raw = gl.load(gl.expand_dims(scale_rows, 1) + gl.expand_dims(k_offsets, 0), mask=mask, other=0)
    if NV_SCALE:
        if BIASED:
            scales = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * NV_SCALE_BIAS).to(gl.bfloat16)
        else:
            scales = raw.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16)
    else:
        bits = raw.to(gl.int16) << 7
        bits = gl.where(raw == 0, 0x40, bits)
        bits = gl.where(raw == 255, 0x7FC0, bits)
        scales = bits.to(gl.bfloat16, bitcast=True)
    return scales


@gluon.jit
def _decode_weights(w_smem, scales, raw_layout: gl.constexpr, dec_layout: gl.constexpr, NKB: gl.constexpr,
                    FP4: gl.constexpr):
    """This warpgroup's [64, BLOCK_K] weight tile from the ring to bf16 registers, times its
    [64, NKB] block scales. Each thread takes whole scale blocks of one row (16 bytes: one
    shared load), viewed as [64, NKB, block] so that a scale multiplies its block."""
    raw = w_smem.load(raw_layout)
    raw = gl.reshape(raw, [raw.shape[0], NKB, raw.shape[1] // NKB])
    if FP4:
        w = gl.fp4_to_fp(raw, gl.bfloat16, 2)
    else:
        w = raw.to(gl.bfloat16)
    w = gl.convert_layout(w, dec_layout) * gl.expand_dims(scales, 2)
    return gl.reshape(w, [w.shape[0], w.shape[1] * w.shape[2]])


@gluon.jit
def _decode_into(operand, w_smem, scales, raw_layout: gl.constexpr, dec_layout: gl.constexpr, NKB: gl.constexpr,
                 FP4: gl.constexpr):
    """Decode this warpgroup's weight step into its bf16 operand buffer (one call, so that
    bench/decode_ceiling.py can take the decode out)."""
    operand.store(_decode_weights(w_smem, scales, raw_layout, dec_layout, NKB, FP4))


@gluon.constexpr_function
def fragment_layout(NKB, VEC):
    """The [64, NKB, VEC] layout of a warpgroup's decoded weight step held as the wgmma's
    register A operand (rows, K blocks, elements of a block), viewed with its K blocks apart so
    that a block scale multiplies its elements in registers. Lane l of warp w holds rows
    16w + l/4 and +8, K columns 2(l%4) + {0, 1} and +8, in each of the step's four k16 slices:
    the bf16 wgmma fragment (DotOperandLayout(0, acc, k_width=2))."""
    def col(c):  # a K column as (block, element)
        return [0, c // VEC, c % VEC]
    return gl.DistributedLinearLayout(
        reg_bases=[col(1), [8, 0, 0], col(8), col(16), col(32)],
        lane_bases=[col(2), col(4), [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, NKB, VEC])


@gluon.constexpr_function
def pair_fragment_layout(NKB, PAIRS):
    """fragment_layout of K-neighbour pairs (one 32-bit register each): [64, NKB, PAIRS]."""
    def col(c):  # a pair column as (block, pair)
        return [0, c // PAIRS, c % PAIRS]
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0, 0], col(4), col(8), col(16)],
        lane_bases=[col(1), col(2), [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, NKB, PAIRS])


@gluon.jit
def _decode_fragment(w_smem, scales, raw_layout: gl.constexpr, NKB: gl.constexpr, FP4: gl.constexpr,
                     BIASED: gl.constexpr):
    """This warpgroup's prepacked [64, 64] weight step (moegemm.prepack) from the ring to
    the bf16 wgmma A fragment in registers, times its [64, NKB] block scales. Each thread loads
    its own 32 elements, contiguous (16 or 32 bytes); the reshape and permute only rename which
    logical element each register holds (prepacked row 16w + 8 r4 + 4 r2 + 2 r1 + k4, column
    32 k2 + 16 r8 + 8 k32 + 4 k16 + 2 k8 + k1 is weight row 16w + 8 r8 + 4 r4 + 2 r2 + r1, K
    column 32 k32 + 16 k16 + 8 k8 + 4 k4 + 2 k2 + k1), so no value moves between threads."""
    if FP4:
        w = _pairs_fragment(_e2m1_fragment_pairs(w_smem, scales, raw_layout, NKB, BIASED))
    else:
        w = w_smem.load(raw_layout).to(gl.bfloat16)
        w = gl.reshape(w, [4, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        w = gl.reshape(gl.permute(w, (0, 6, 1, 2, 3, 7, 8, 9, 4, 5, 10)), [64, NKB, 64 // NKB])
        fragment: gl.constexpr = fragment_layout(NKB, 64 // NKB)
        scales = gl.convert_layout(scales, gl.SliceLayout(2, fragment))
        w = gl.reshape(gl.convert_layout(w, fragment) * gl.expand_dims(scales, 2), [64, 64])
    return w


@gluon.jit
def _e2m1_fragment_pairs(w_smem, scales, raw_layout: gl.constexpr, NKB: gl.constexpr, BIASED: gl.constexpr):
    """_decode_fragment of prepacked e2m1 as the fragment's K-neighbour bf16 pairs, int32 [64, NKB,
    32 / NKB] in pair_fragment_layout: the 32-bit registers the wgmma reads (k1 within a
    register: the same renaming as _decode_fragment's without it)."""
    raw = w_smem.load(raw_layout)
    pairs = gl.reshape(e2m1_words_to_pairs(raw, BIASED), [4, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    pairs = gl.reshape(gl.permute(pairs, (0, 6, 1, 2, 3, 7, 8, 9, 4, 5)), [64, NKB, 32 // NKB])
    pair_layout: gl.constexpr = pair_fragment_layout(NKB, 32 // NKB)
    scales = gl.expand_dims(gl.convert_layout(scales, gl.SliceLayout(2, pair_layout)), 2)
    return scaled_pairs(gl.convert_layout(pairs, pair_layout), scales)


@gluon.jit
def _pairs_fragment(pairs):
    """The bf16 [64, 64] fragment of _e2m1_fragment_pairs' pairs (a renaming: no instruction)."""
    lo = pairs.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.reshape(gl.join(lo, hi), [64, 64])


@gluon.jit
def _register_step(w_bufs, t_bufs, stage, j: gl.constexpr, scales, acc0, acc1, SUB: gl.constexpr, WG: gl.constexpr,
                   NKB: gl.constexpr, BYTES: gl.constexpr, FP4: gl.constexpr, HALVES: gl.constexpr,
                   raw_layout: gl.constexpr, BIASED: gl.constexpr):
    """Decode 64-wide K step j of ring stage `stage` into registers and issue its wgmmas on them
    (one a 128-token half), left in flight; returns the operand, which must stay untouched
    until a wait retires them."""
    TOK_HALF: gl.constexpr = t_bufs.shape[1] // HALVES
    acc_layout: gl.constexpr = acc0.type.layout
    raw = w_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS).slice(j * BYTES, BYTES, dim=1)
    operand = _decode_fragment(raw, scales, raw_layout, NKB, FP4, BIASED)
    operand = gl.convert_layout(operand, gl.DotOperandLayout(0, acc_layout, 2))
    tokens = t_bufs.index(stage * SUB + j)
    acc0 = warpgroup_mma(operand, tokens.slice(0, TOK_HALF).permute((1, 0)), acc0, is_async=True)
    if HALVES == 2:
        acc1 = warpgroup_mma(operand, tokens.slice(TOK_HALF, TOK_HALF).permute((1, 0)), acc1, is_async=True)
    return acc0, acc1, operand


@gluon.jit
def _decode_step(w_bufs, t_bufs, a_bufs, stage, j: gl.constexpr, step: gl.constexpr, scales, acc0, acc1, WG: gl.constexpr, SUB: gl.constexpr,
                 NKB: gl.constexpr, BYTES: gl.constexpr, FP4: gl.constexpr, HALVES: gl.constexpr,
                 raw_layout: gl.constexpr, dec_layout: gl.constexpr):
    """Decode 64-wide K step j of ring stage `stage` into operand buffer `step % 2` and issue its
    wgmmas (one a 128-token half of the tile), left in flight."""
    TOK_HALF: gl.constexpr = t_bufs.shape[1] // HALVES
    raw = w_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS).slice(j * BYTES, BYTES, dim=1)
    operand = a_bufs.index(WG * 2 + step % 2)
    _decode_into(operand, raw, scales, raw_layout, dec_layout, NKB, FP4)
    fence_async_shared()
    tokens = t_bufs.index(stage * SUB + j)
    acc0 = warpgroup_mma(operand, tokens.slice(0, TOK_HALF).permute((1, 0)), acc0, is_async=True)
    if HALVES == 2:
        acc1 = warpgroup_mma(operand, tokens.slice(TOK_HALF, TOK_HALF).permute((1, 0)), acc1, is_async=True)
    return acc0, acc1


@gluon.jit
def _upcast_chain(w_bufs, t_bufs, a_bufs, ring, zero, scale_rows, row_ok, NUM_KB, it, k_steps,
                  WG: gl.constexpr, SUB: gl.constexpr, NKB: gl.constexpr, BYTES: gl.constexpr, FP4: gl.constexpr,
                  NV_SCALE: gl.constexpr, SWIZZLED: gl.constexpr, HALVES: gl.constexpr, raw_layout: gl.constexpr,
                  dec_layout: gl.constexpr, PREPACKED: gl.constexpr, BIASED: gl.constexpr):
    """acc_h = sum_k decode(W_k) * scales_k @ T_k,h^T over k_steps stages of SUB 64-wide steps,
    for the tile's HALVES 128-token halves (one accumulator each, the same decoded operand).

    Plain weights: each step's decoded tile is stored to one of this warpgroup's two bf16
    operand buffers (alternating) and the wgmmas read it from there. PREPACKED weights
    (moegemm.prepack): each thread loads its own share of the step already in the wgmma's
    register order and decodes it into the register A operand (_decode_fragment): no store, no
    fence, no barrier. A register operand stays a dependency of the wait that retires its
    wgmmas (the next step's), so ptxas keeps its registers until then; without that, ptxas
    reused them while the wgmma still read them. Either way the next step is decoded while the
    previous step's wgmmas run. With one step a stage (SUB == 1), an iteration takes two
    stages, so that every other step overlaps.

    No wgmma is in flight across the loop's back edge: the last step of an iteration waits for
    all of them, then releases its stages. With one carried across it (a wait for all but
    one), ptxas moved the epilogue's reads of the accumulator above the wait after the loop
    (sm_90 SASS of the specialization without expert and row scales: F2FP of the accumulator
    registers before WARPGROUP.DEPBAR.LE gsb0, 0x0), so the tile's output missed 1 to 3 of
    the last step's four k16 wgmmas, differently each run (DeepSeek-V3 shapes at ~12 tokens an
    expert: 6-12% off; offline.wgmma_register_hazards finds such reads in SASS)."""
    scale_layout: gl.constexpr = gl.SliceLayout(2, dec_layout)
    PAIR: gl.constexpr = 2 if SUB == 1 else 1  # stages an iteration
    STEPS: gl.constexpr = PAIR * SUB  # 64-wide steps an iteration
    acc0 = zero
    acc1 = zero
    scales = _load_scales(scale_rows, row_ok, 0, NUM_KB, scale_layout, NKB, SWIZZLED, NV_SCALE, BIASED)
    for kk in range(k_steps // PAIR):
        first = ring.wait_ready(it)
        stage = first
        for p in gl.static_range(PAIR):
            if p > 0:
                stage = ring.wait_ready(it + p)
            for j in gl.static_range(SUB):
                # (p * SUB + j: the step's index in the iteration, static: a variable assigned in the
                # loop would be carried by it as a runtime value)
                next_scales = _load_scales(scale_rows, row_ok, kk * STEPS + p * SUB + j + 1, NUM_KB, scale_layout,
                                           NKB, SWIZZLED, NV_SCALE, BIASED)
                if PREPACKED:
                    # The operand's registers stay alive (a wait's dependency) until the wait
                    # that retires its wgmmas: the next step's.
                    acc0, acc1, operand = _register_step(w_bufs, t_bufs, stage, j, scales, acc0, acc1, SUB, WG, NKB,
                                                         BYTES, FP4, HALVES, raw_layout, BIASED)
                    # (`previous`: the operand of the step before, static: defined by the unrolled
                    # step before this one)
                    if p * SUB + j == 0:
                        acc0, acc1, operand = warpgroup_mma_wait(0 if p * SUB + j == STEPS - 1 else HALVES,
                                                                 deps=(acc0, acc1, operand))
                    else:
                        acc0, acc1, operand, previous = warpgroup_mma_wait(  # noqa: F821
                            0 if p * SUB + j == STEPS - 1 else HALVES, deps=(acc0, acc1, operand, previous))  # noqa: F821
                    previous = operand  # noqa: F841
                else:
                    # The buffer was last read by the wgmmas two steps back, retired by a wait since.
                    acc0, acc1 = _decode_step(w_bufs, t_bufs, a_bufs, stage, j, p * SUB + j, scales, acc0, acc1, WG,
                                              SUB, NKB, BYTES, FP4, HALVES, raw_layout, dec_layout)
                    acc0, acc1 = warpgroup_mma_wait(0 if p * SUB + j == STEPS - 1 else HALVES, deps=(acc0, acc1))
                scales = next_scales
        ring.release(first)
        if PAIR == 2:
            ring.release(stage)
        it += PAIR
    if PAIR == 2:  # noqa: SIM102 (a static test around a runtime one: they do not mix in one `and`)
        if k_steps % 2 == 1:  # an odd last stage, alone
            stage = ring.wait_ready(it)
            if PREPACKED:
                acc0, acc1, operand = _register_step(w_bufs, t_bufs, stage, 0, scales, acc0, acc1, SUB, WG, NKB,
                                                     BYTES, FP4, HALVES, raw_layout, BIASED)
                acc0, acc1, operand = warpgroup_mma_wait(0, deps=(acc0, acc1, operand))
            else:
                acc0, acc1 = _decode_step(w_bufs, t_bufs, a_bufs, stage, 0, 0, scales, acc0, acc1, WG, SUB, NKB,
                                          BYTES, FP4, HALVES, raw_layout, dec_layout)
                acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
            ring.release(stage)
            it += 1
    return acc0, acc1, it


@gluon.jit
def _staged_words(ws_stage, Q: gl.constexpr, ATOMS: gl.constexpr, atom: gl.constexpr, row_layout: gl.constexpr):
    """The swizzled scale words of the tile's 64-row block Q (weight rows 64Q..64Q+63) in atom
    `atom` of the stage's staged scales ([W_TILE / 128 * ATOMS * 32, 4] int32: the atoms of each
    128-row block, in K order): a [64] int32 vector, row n's word (its four K blocks' bytes) at
    [n % 32, (n % 128) // 32] of the atom, so a 64-row block is two of its columns. Each thread
    loads the words of its own two rows (16w + lane/4 and + 8: the wgmma fragment's), two LDS.32."""
    words_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [0, 1]], block_bases=[], shape=[32, 2])
    block = ws_stage.slice(((Q // 2) * ATOMS + atom) * 32, 32)
    words = block.slice(2 * (Q % 2), 2, dim=1).load(words_layout)
    return gl.convert_layout(gl.reshape(gl.permute(words, (1, 0)), [WG_ROWS]), row_layout)


@gluon.jit
def _has_large_codes(ws_stage, Q0: gl.constexpr, M_BLOCKS: gl.constexpr, ATOMS: gl.constexpr):
    """Whether any e8m0 code of the 64-row blocks Q0..Q0+M_BLOCKS-1 in the stage is >= 128 (a
    scale of 2 or more, where 2^126 times the scale leaves bf16's range): a scalar, the same in
    every warp. Every warp reads all the rows' words (replicated across the warps), so the
    reduction stays within a warp: no barrier."""
    COLUMNS: gl.constexpr = 2 * M_BLOCKS
    if COLUMNS == 2:
        all_layout: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1]], lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[32, 2])
    else:
        all_layout: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2]], lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[32, 4])
    high = gl.zeros([32, COLUMNS], gl.int32, all_layout)
    for atom in gl.static_range(ATOMS):
        block = ws_stage.slice(((Q0 // 2) * ATOMS + atom) * 32, 32)
        high = high | block.slice(2 * (Q0 % 2), COLUMNS, dim=1).load(all_layout)
    large = gl.where((high & -0x7F7F7F80) != 0, 1, 0)  # (bit 7 of a byte: 0x80808080)
    return gl.max(gl.max(large, axis=1), axis=0) != 0


@gluon.jit
def _staged_scales(words, byte0: gl.constexpr, NKB: gl.constexpr, scale_layout: gl.constexpr,
                   NV_SCALE: gl.constexpr, FOLDED: gl.constexpr):
    """The [64, NKB] bf16 block scales of a step from its rows' staged words (bytes byte0 ..
    byte0 + NKB - 1). nvfp4: e4m3 times NV_SCALE_BIAS (the decoding leaves 2^-126 in the
    elements). e8m0 b: FOLDED, 2^(b-1), i.e. 2^(b-127) times the 2^126 the biased decoding left
    out (exact for b <= 128: bf16's exponent field b + 126); else 2^(b-127) as _load_scales."""
    kb = gl.arange(0, NKB, layout=gl.SliceLayout(0, scale_layout))
    shifts = gl.expand_dims(8 * (byte0 + kb), 0)
    raw = (gl.expand_dims(gl.convert_layout(words, gl.SliceLayout(1, scale_layout)), 1) >> shifts) & 0xFF
    if NV_SCALE:
        return (raw.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32) * NV_SCALE_BIAS).to(gl.bfloat16)
    if FOLDED:
        gl.static_assert(NKB == 2, "folded e8m0 scales: two K blocks a step")
        # (one PRMT and one IMAD for the step's two scales, the halves of one register, which
        # the multiplies read as .H0_H0 and .H1_H1)
        pair = gl.inline_asm_elementwise(_FOLDED_E8M0_PTX[byte0 // 2], "=r,r", [words], dtype=gl.int32,
                                         is_pure=True, pack=1)
        lo = pair.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.convert_layout(gl.join(lo, hi), scale_layout)
    bits = gl.where(raw == 0, 0x40, raw << 7)
    bits = gl.where(raw == 255, 0x7FC0, bits)
    return bits.to(gl.int16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _staged_step(w_bufs, t_bufs, stage, j: gl.constexpr, Q: gl.constexpr, words, large, acc, NKB: gl.constexpr,
                 BYTES: gl.constexpr, raw_layout: gl.constexpr, scale_layout: gl.constexpr, NV_SCALE: gl.constexpr):
    """_register_step (SUB = 2, one token half) of the tile's 64-row block Q, its scales from
    the stage's staged words: nvfp4 as always biased; e8m0 decoded biased with 2^126 folded into
    its scales, or, where the stage has a code >= 128 (`large`, the same in the whole
    warpgroup), as the step-ahead loop does. Returns the accumulator and the operand."""
    acc_layout: gl.constexpr = acc.type.layout
    raw = w_bufs.index(stage).slice(Q * WG_ROWS, WG_ROWS).slice(j * BYTES, BYTES, dim=1)
    byte0: gl.constexpr = (j * NKB) % 4
    if NV_SCALE:
        scales = _staged_scales(words, byte0, NKB, scale_layout, True, False)
        pairs = _e2m1_fragment_pairs(raw, scales, raw_layout, NKB, True)
    elif large:
        scales = _staged_scales(words, byte0, NKB, scale_layout, False, False)
        pairs = _e2m1_fragment_pairs(raw, scales, raw_layout, NKB, False)
    else:
        scales = _staged_scales(words, byte0, NKB, scale_layout, False, True)
        pairs = _e2m1_fragment_pairs(raw, scales, raw_layout, NKB, True)
    operand = gl.convert_layout(_pairs_fragment(pairs), gl.DotOperandLayout(0, acc_layout, 2))
    acc = warpgroup_mma(operand, t_bufs.index(stage * 2 + j).permute((1, 0)), acc, is_async=True)
    return acc, operand


@gluon.jit
def _staged_stage(w_bufs, t_bufs, ws_bufs, stage, acc0, acc1, STEPS: gl.constexpr, Q0: gl.constexpr,
                  M_BLOCKS: gl.constexpr, NKB: gl.constexpr, BYTES: gl.constexpr, raw_layout: gl.constexpr,
                  scale_layout: gl.constexpr, NV_SCALE: gl.constexpr):
    """The first STEPS (2, or 1 for a last half stage) 64-wide steps of a ring stage for the
    warpgroup's M_BLOCKS 64-row blocks (acc0: block Q0, acc1: block Q0 + 1): a unit (a step of
    a block) is decoded while the unit before it runs, and none is left in flight at the end."""
    ATOMS: gl.constexpr = NKB // 2  # atoms (4 K blocks of 128 rows) a stage
    row_layout: gl.constexpr = gl.SliceLayout(1, scale_layout)
    ws_stage = ws_bufs.index(stage)
    if NV_SCALE:
        large = False
    else:
        large = _has_large_codes(ws_stage, Q0, M_BLOCKS, ATOMS)
    words0 = _staged_words(ws_stage, Q0, ATOMS, 0, row_layout)
    if M_BLOCKS == 2:
        words1 = _staged_words(ws_stage, Q0 + 1, ATOMS, 0, row_layout)
    for j in gl.static_range(STEPS):
        if ATOMS == 2 and j == 1:  # (nvfp4: an atom a step)
            words0 = _staged_words(ws_stage, Q0, ATOMS, 1, row_layout)
            if M_BLOCKS == 2:
                words1 = _staged_words(ws_stage, Q0 + 1, ATOMS, 1, row_layout)
        for m in gl.static_range(M_BLOCKS):
            if m == 0:
                acc0, operand = _staged_step(w_bufs, t_bufs, stage, j, Q0, words0, large, acc0, NKB, BYTES,
                                             raw_layout, scale_layout, NV_SCALE)
            else:
                acc1, operand = _staged_step(w_bufs, t_bufs, stage, j, Q0 + 1, words1, large, acc1, NKB,
                                             BYTES, raw_layout, scale_layout, NV_SCALE)
            # (the operand stays a dependency of the wait that retires its wgmmas, _upcast_chain)
            if j * M_BLOCKS + m == 0:
                acc0, acc1, operand = warpgroup_mma_wait(0 if STEPS * M_BLOCKS == 1 else 1,
                                                         deps=(acc0, acc1, operand))
            else:
                acc0, acc1, operand, previous = warpgroup_mma_wait(  # noqa: F821
                    0 if j * M_BLOCKS + m == STEPS * M_BLOCKS - 1 else 1,
                    deps=(acc0, acc1, operand, previous))  # noqa: F821
            previous = operand  # noqa: F841
    return acc0, acc1


@gluon.jit
def _staged_chain(w_bufs, t_bufs, ws_bufs, ring, zero, K, it, Q0: gl.constexpr, M_BLOCKS: gl.constexpr,
                  NKB: gl.constexpr, BYTES: gl.constexpr, raw_layout: gl.constexpr, scale_layout: gl.constexpr,
                  NV_SCALE: gl.constexpr):
    """_upcast_chain of prepacked e2m1 (SUB = 2: a stage is 128 K, two 64-wide steps; one token
    half) with the weight scales staged in the ring (the producer's TMA copy of the tile's
    swizzled atoms, ws_bufs): the loop issues no global load. The warpgroup's M_BLOCKS 64-row
    blocks from Q0 go to acc0 and acc1. A last stage that ends at its first step (K % 128 == 64)
    runs that step alone, so no scale past NUM_KB (padding, or the next row block's atom) is
    read. Waits as _upcast_chain: no wgmma is in flight across the back edge (with the last
    unit's left in flight, its register operand carried by the loop and its stage released a
    wait later, ptxas serialized every wgmma, C7512, at 232 and 240 registers a consumer; so
    in consumer 0 only, the others taking their stages in pairs, it ran 33-37% slower on an
    H100, docs/perf-notes.md)."""
    acc0 = zero
    acc1 = zero
    for kk in range(K // 128):
        stage = ring.wait_ready(it)
        acc0, acc1 = _staged_stage(w_bufs, t_bufs, ws_bufs, stage, acc0, acc1, 2, Q0, M_BLOCKS, NKB, BYTES,
                                   raw_layout, scale_layout, NV_SCALE)
        ring.release(stage)
        it += 1
    if K % 128 != 0:  # (K is a multiple of 64: a last half stage)
        stage = ring.wait_ready(it)
        acc0, acc1 = _staged_stage(w_bufs, t_bufs, ws_bufs, stage, acc0, acc1, 1, Q0, M_BLOCKS, NKB, BYTES,
                                   raw_layout, scale_layout, NV_SCALE)
        ring.release(stage)
        it += 1
    return acc0, acc1, it


@aggregate
class DecodeConsumer:
    """Consumer warpgroup WG: acc [64, TOK_TILE], rows its weight rows, columns the tile's
    tokens. Decoding: two threads a weight row, each taking half of the step's NKB scale blocks."""

    ring: Ring
    t_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    a_bufs: gl.shared_memory_descriptor
    ws_bufs: OPTIONAL_SMEM
    out: Output
    swiglu: Swiglu
    b_scale_ptr: gl.tensor
    K: gl.tensor
    NUM_KB: gl.tensor
    KB4: gl.tensor
    WG: gl.constexpr
    SUB: gl.constexpr
    VEC: gl.constexpr
    NV_SCALE: gl.constexpr
    SWIZZLED: gl.constexpr
    PREPACKED: gl.constexpr
    M_BLOCKS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ring, t_bufs, w_bufs, a_bufs, ws_bufs, out, swiglu, b_scale_ptr, K, NUM_KB, KB4, WG, SUB, VEC,
                 NV_SCALE, SWIZZLED, PREPACKED, M_BLOCKS=1):
        self.ring = ring
        self.t_bufs = t_bufs
        self.w_bufs = w_bufs
        self.a_bufs = a_bufs
        self.ws_bufs = optional(ws_bufs)
        self.out = out
        self.swiglu = swiglu
        self.b_scale_ptr = b_scale_ptr
        self.K = K
        self.NUM_KB = NUM_KB
        self.KB4 = KB4
        self.WG = gl.constexpr(WG)
        self.SUB = gl.constexpr(SUB)
        self.VEC = gl.constexpr(VEC)
        self.NV_SCALE = gl.constexpr(NV_SCALE)
        self.SWIZZLED = gl.constexpr(SWIZZLED)
        self.PREPACKED = gl.constexpr(PREPACKED)
        self.M_BLOCKS = gl.constexpr(M_BLOCKS)

    @gluon.jit
    def tile(self, sched, slot, tok_block, w_block, it, done):
        WG: gl.constexpr = self.WG
        TOK_TILE: gl.constexpr = sched.TOK_TILE
        W_TILE: gl.constexpr = sched.W_TILE
        BLOCK_K: gl.constexpr = self.t_bufs.shape[2]
        FP4: gl.constexpr = self.w_bufs.dtype == gl.uint8
        VEC: gl.constexpr = self.VEC
        # A 256-token tile runs as two 128-token halves on one decoded operand: the decode is
        # paid once for 256 tokens, and each half's epilogue is the 128-token tile's.
        HALVES: gl.constexpr = 2 if TOK_TILE == 256 else 1
        TOK_HALF: gl.constexpr = TOK_TILE // HALVES
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TOK_HALF, 16])
        NKB: gl.constexpr = BLOCK_K // VEC
        BYTES: gl.constexpr = BLOCK_K // 2 if FP4 else BLOCK_K  # of a weight row per 64-wide step
        raw_layout: gl.constexpr = gl.BlockedLayout([1, BYTES // 2], [16, 2], [4, 1], [1, 0])
        dec_layout: gl.constexpr = gl.BlockedLayout([1, NKB // 2, VEC], [16, 2, 1], [4, 1, 1], [2, 1, 0])
        N = sched.N
        k_steps = gl.cdiv(self.K, BLOCK_K * self.SUB)
        zero = gl.zeros([WG_ROWS, TOK_HALF], gl.float32, acc_layout)
        tok_offsets = gl.arange(0, TOK_HALF, layout=gl.SliceLayout(0, acc_layout))
        w_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
        w_offsets_op = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, dec_layout)))
        tok0 = slot.s + tok_block * TOK_TILE
        ns_op = w_block * W_TILE + w_offsets_op
        scale_rows = self.b_scale_ptr + scale_row_offsets(slot.e, ns_op, N, self.NUM_KB, self.KB4, self.SWIZZLED)
        # nvfp4's prepacked e2m1 is decoded with its 2^126 left in the scales (NV_SCALE_BIAS)
        BIASED: gl.constexpr = self.PREPACKED and FP4 and self.NV_SCALE
        M_BLOCKS: gl.constexpr = self.M_BLOCKS
        if self.ws_bufs is not None:  # (prepacked e2m1, SUB == 2: the scales staged in the ring)
            gl.static_assert(HALVES == 1, "staged scales: up to 64 tokens")
            scale_layout: gl.constexpr = gl.SliceLayout(2, pair_fragment_layout(NKB, 32 // NKB))
            acc0, acc1, it = _staged_chain(self.w_bufs, self.t_bufs, self.ws_bufs, self.ring, zero, self.K, it,
                                           WG * M_BLOCKS, M_BLOCKS, NKB, BYTES, raw_layout, scale_layout,
                                           self.NV_SCALE)
        else:
            acc0, acc1, it = _upcast_chain(self.w_bufs, self.t_bufs, self.a_bufs, self.ring, zero, scale_rows,
                                           ns_op < N, self.NUM_KB, it, k_steps, WG, self.SUB, NKB, BYTES, FP4,
                                           self.NV_SCALE, self.SWIZZLED, HALVES, raw_layout, dec_layout,
                                           self.PREPACKED, BIASED)
        if BIASED:  # (the weights came out 2^-9 small)
            acc0 = acc0 * NV_ACC_FACTOR
            acc1 = acc1 * NV_ACC_FACTOR
        w0 = w_block * W_TILE + WG * M_BLOCKS * WG_ROWS  # this warpgroup's first weight row
        ns = w_block * W_TILE + (M_BLOCKS - 1) * WG * WG_ROWS + w_offsets
        self.epilogue(acc0, slot, tok0, tok_offsets, w0, ns, N)
        if M_BLOCKS == 2:  # (its second 64-row block)
            self.epilogue(acc1, slot, tok0, tok_offsets, w0 + WG_ROWS, ns + WG_ROWS, N)
        if HALVES == 2:  # noqa: SIM102 (a static test around a runtime one)
            if tok0 + TOK_HALF < slot.t:
                self.epilogue(acc1, slot, tok0 + TOK_HALF, tok_offsets, w0, ns, N)
        return it

    @gluon.jit
    def epilogue(self, acc, slot, tok0, tok_offsets, w0, ns, N):
        """Store a 128-token (or narrower) half of the tile: tokens from tok0, this warpgroup's
        weight rows ns (from w0)."""
        if self.swiglu.ACT != 0:
            self.swiglu.store(acc, self.out, slot, tok0, w0, N, True)
        else:
            toks = tok0 + tok_offsets
            self.out.store_swapped_tile(acc, slot.e, toks, toks < slot.t, ns, N, 0, 0, slot.t)


@gluon.jit
def _consume(consumer, sched, FILL: gl.constexpr):
    walk(sched, consumer)
    if FILL and consumer.WG == 0:
        zero_free_rows(sched, consumer.out.out_ptr)


@gluon.jit
def decode_kernel(t_desc, w_desc, ws_desc, out_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
                  row_scales_ptr, M, N, K, E, G, NUM_KB, KB4, epi, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                  VEC: gl.constexpr, NV_SCALE: gl.constexpr, SWIZZLED: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
                  HAS_ROW_SCALES: gl.constexpr, CONSUMER_REGS: gl.constexpr, EPI: gl.constexpr,
                  PREPACKED: gl.constexpr, CONSUMER_ROWS: gl.constexpr, FILL: gl.constexpr = False):
    """t_desc: bf16 token tiles [TOK_TILE, BLOCK_K] of the decoded A; w_desc: raw weight tiles
    [W_TILE (128, or 256 prepacked), SUB * BLOCK_K bytes (fp8) or SUB * BLOCK_K / 2 (packed fp4)] of
    B viewed as [E*N, K or K/2]: SUB token tiles and one weight tile fill a ring stage. b_scale_ptr:
    the weight scales (e8m0, or e4m3 for nvfp4: NV_SCALE), plain or SWIZZLED, VEC K elements each.
    ws_desc (None: the consumers load the scales from b_scale_ptr a step ahead): swizzled scales of
    prepacked e2m1 seen as [atoms * 32, 4] int32 (a 128 x 4 atom is 32 x 4 words), a box of one
    128-row block's atoms of a stage, W_TILE / 128 boxes a stage, read from the ring (_staged_chain).
    CONSUMER_ROWS: weight rows of a consumer warpgroup, 64, or 128 (staged scales: two 64-row
    accumulators a warpgroup, two warpgroups on a 256-row tile). epi, EPI: the fused epilogue (Swiglu.create).
    FILL: out is fresh; its rows no valid slot owns are zeroed after the tiles (free_rows.py)."""
    TOK_TILE: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = t_desc.block_type.shape[1]
    W_TILE: gl.constexpr = w_desc.block_type.shape[0]
    FP4: gl.constexpr = w_desc.dtype == gl.uint8
    # 64-wide K steps per ring stage: a stage carries w_desc's bytes of each weight row.
    SUB: gl.constexpr = w_desc.block_type.shape[1] // (BLOCK_K // 2 if FP4 else BLOCK_K)
    # A consumer warpgroup for each 64 weight rows: two, or four (256-row tiles, prepacked weights:
    # the four share every token stage, half the token bytes a weight byte of two); or for each
    # 128 (staged scales: two on a 256-row tile, each with the fixed cost of an iteration spread
    # over twice the elements).
    CONSUMERS: gl.constexpr = W_TILE // CONSUMER_ROWS
    M_BLOCKS: gl.constexpr = CONSUMER_ROWS // WG_ROWS
    gl.static_assert(CONSUMERS == 2 or (CONSUMERS == 4 and PREPACKED), "128-row tiles, or 256 prepacked")
    gl.static_assert(M_BLOCKS == 1 or (M_BLOCKS == 2 and ws_desc is not None), "128 rows a consumer: staged scales")
    t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES * SUB] + t_desc.block_type.shape, t_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    # Two bf16 operand buffers per consumer warpgroup for its decoded weights (_upcast_chain).
    # (Prepacked weights are decoded into the wgmma's register operand: no buffers.)
    if PREPACKED:
        a_bufs = w_bufs
    else:
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [4, WG_ROWS, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([WG_ROWS, BLOCK_K], gl.bfloat16))
    if ws_desc is not None:
        gl.static_assert(PREPACKED and FP4 and SUB == 2 and SWIZZLED, "staged scales: prepacked e2m1, swizzled, SUB 2")
        ws_bufs = gl.allocate_shared_memory(ws_desc.dtype, [STAGES, W_TILE // 128 * ws_desc.block_type.shape[0], 4],
                                            ws_desc.layout)
    else:
        ws_bufs = None
    ring = Ring.create(STAGES, CONSUMERS)
    sched = Schedule.create(a_offsets_ptr, expert_ids_ptr, M, N, E, G, a_offsets_ptr, 0, TOK_TILE, W_TILE, GROUP_M,
                            CONSUMERS)
    out = Output(out_ptr, expert_scales_ptr, row_scales_ptr, HAS_EXPERT_SCALES, HAS_ROW_SCALES)
    swiglu = Swiglu.create(epi, EPI)
    K = gl.to_tensor(K)
    NUM_KB = gl.to_tensor(NUM_KB)
    KB4 = gl.to_tensor(KB4)
    consumer0 = DecodeConsumer(ring, t_bufs, w_bufs, a_bufs, ws_bufs, out, swiglu, b_scale_ptr, K, NUM_KB,
                               KB4, 0, SUB, VEC, NV_SCALE, SWIZZLED, PREPACKED, M_BLOCKS)
    consumer1 = DecodeConsumer(ring, t_bufs, w_bufs, a_bufs, ws_bufs, out, swiglu, b_scale_ptr, K, NUM_KB,
                               KB4, 1, SUB, VEC, NV_SCALE, SWIZZLED, PREPACKED, M_BLOCKS)
    producer = Producer.create(ring, t_desc, w_desc, t_bufs, w_bufs, K, SUB, ws_desc=ws_desc, ws_bufs=ws_bufs,
                               KB4=KB4)
    # Every consumer gets CONSUMER_REGS (pipeline.producer_registers). (A 256-token tile with the
    # producer at 120 left consumer 0 152: it spilled its accumulator in the K loop and ptxas
    # serialized every HGMMA, C7512.)
    if CONSUMERS == 4:
        consumer2 = DecodeConsumer(ring, t_bufs, w_bufs, a_bufs, ws_bufs, out, swiglu, b_scale_ptr, K, NUM_KB,
                                   KB4, 2, SUB, VEC, NV_SCALE, SWIZZLED, PREPACKED, M_BLOCKS)
        consumer3 = DecodeConsumer(ring, t_bufs, w_bufs, a_bufs, ws_bufs, out, swiglu, b_scale_ptr, K, NUM_KB,
                                   KB4, 3, SUB, VEC, NV_SCALE, SWIZZLED, PREPACKED, M_BLOCKS)
        gl.warp_specialize([(_consume, (consumer0, sched, FILL)), (_consume, (consumer1, sched, FILL)),
                            (_consume, (consumer2, sched, FILL)), (_consume, (consumer3, sched, FILL)),
                            (produce, (producer, sched))],
                           [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS,
                                          producer_registers(4, CONSUMER_REGS)])
    else:
        gl.warp_specialize([(_consume, (consumer0, sched, FILL)), (_consume, (consumer1, sched, FILL)),
                            (produce, (producer, sched))], [4, 1], [CONSUMER_REGS, producer_registers(2, CONSUMER_REGS)])
