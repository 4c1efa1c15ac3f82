"""The sm90 kernel of e2m1 weights (`mxfp4`, `w4a8`) at decode, in the plain order: the weights decoded to e4m3 in
shared memory, fp8 wgmma per 32-wide K block and fp32 promotion (promotion.py), split-K over four
consumer warpgroups.

Every e2m1 value times 2^-6 is an e4m3 value, so the weights come through the ring packed (128
bytes of a row = 256 K a stage, with two token boxes) and each consumer warpgroup decodes its
rows to e4m3 (_E2M1_TO_E4M3_PTX: 8 instructions for 8 elements, which land in the order
0 2 4 6 1 3 5 7 within each group of 8) into shared-memory operand buffers, then runs k32
wgmmas and promotion. The tokens meet them in that order: mxfp4 tokens are re-encoded as e4m3
times 2^6 by a pre-pass (tokens.token_prepass) or by the layer's kernels (token_forms.py), so the products are the true ones; w4a8's e4m3
tokens are reordered (tokens.even_odd_k) and its accumulator is multiplied by 2^6 before the
epilogue. The producer also copies each stage's scales into the ring (tokens always, weights
when swizzled), so the loop issues no global load before its fence. mxfp4's k32 sums stay exact
in the fp8 accumulator (products are multiples of 1/4 below 36); w4a8's (e4m3 x e2m1) do not,
like mxfp8's.

Tiles are swapped, 128 weight rows x 8 or 16 tokens (sm90_configs.E2m1Config). Split-K (SPLIT_K):
four consumer warpgroups, WG % 2 picks the 64 weight rows, WG // 2 the K half of every stage;
the two halves' partial sums meet through shared memory (_reduce_split_k) and the K halves take
turns at running the epilogue. A last stage that stops within its first half (gpt-oss K = 2880)
runs that half only. Without split-K, two warpgroups each decode both halves of a stage
(_promote_chain_fp4).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from ...token_forms import E2M1_TOKEN_EXP
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
from .promotion import SCALE_BLOCK, _block_operands, _clear_padding, _promote_rows, _weight_scale_words, _word_scale
from .swiglu import Swiglu

# e2m1 -> e4m3 scaled by 2^-6 (E2M1_WEIGHT_EXP) for eight packed elements (one 32-bit word,
# element i in nibble i), exact, 8 instructions (a PRMT table of the true values in K order took
# 14, its two table constants re-materialized at every use). A nibble s|e1 e0 m moved to bits
# 7|4 3 2 of a byte is the e4m3 code of the e2m1 value times 2^-6: e1 e0 are the low exponent
# bits (bias 7 vs 1) and m the top mantissa bit, and 0.5 lands on the subnormal 2^-7 as it
# should. The magnitude moves by 2 bits and the sign by 4: with x = the nibble << 2 (sign then
# at bit 5), the byte is x + 3 * (x & 0x20), no carry leaving the byte. $0 = elements 0, 2, 4, 6
# (the low nibbles), $1 = 1, 3, 5, 7: the K order within each group of 8 is 0 2 4 6 1 3 5 7, and
# the tokens come in the same order (tokens.token_prepass even_odd, tokens.even_odd_k), so
# every dot product over a group, and over a 32-wide scale block, is unchanged.
_E2M1_TO_E4M3_PTX = gl.constexpr("""{
.reg .b32 a, b, xl, xh, sl, sh;
shl.b32 a, $2, 2;
shr.u32 b, $2, 2;
and.b32 xl, a, 0x3C3C3C3C;
and.b32 xh, b, 0x3C3C3C3C;
and.b32 sl, a, 0x20202020;
and.b32 sh, b, 0x20202020;
mad.lo.u32 $0, sl, 3, xl;
mad.lo.u32 $1, sh, 3, xh;
}""")
# The weights' factor: the kernel's mxfp4 tokens are re-encoded times 2^+6 (tokens.token_prepass),
# so their products are exact; w4a8's given e4m3 tokens have no room, so its accumulator is
# multiplied by 2^6 before the epilogue (exact; the promoted terms are 2^-6 smaller meanwhile).
E2M1_WEIGHT_EXP = E2M1_TOKEN_EXP  # (token_forms.py: the layer's kernels write them so)


@gluon.jit
def _e2m1_to_e4m3_pairs(raw):
    """uint8 bytes of packed e2m1 (element 2i in the low nibble) -> uint16 pairs of e4m3 bytes
    (times 2^-6), four bytes' eight elements in the order 0 2 4 6 1 3 5 7 (_E2M1_TO_E4M3_PTX)."""
    return gl.inline_asm_elementwise(_E2M1_TO_E4M3_PTX, "=r,=r,r", [raw], dtype=gl.uint16, is_pure=True, pack=4)


@gluon.jit
def _decode_half(w_stage, h: gl.constexpr, operand, raw_layout: gl.constexpr):
    """Half h of this warpgroup's weight rows in the stage (64 bytes = 128 e2m1 of each row) to
    e4m3 in its shared-memory operand buffer (viewed as uint16 pairs)."""
    raw = w_stage.slice(h * 64, 64, dim=1).load(raw_layout)
    operand.store(_e2m1_to_e4m3_pairs(raw))


@gluon.jit
def _issue_half(operand, t_half, zero):
    """The four k32 wgmmas of a 128-wide half stage, left in flight: operand the decoded weights
    [64, 128] e4m3, t_half the tokens [TOK_TILE, 128]."""
    w, t = _block_operands(operand, t_half, 0)
    p0 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
    w, t = _block_operands(operand, t_half, 1)
    p1 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
    w, t = _block_operands(operand, t_half, 2)
    p2 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
    w, t = _block_operands(operand, t_half, 3)
    p3 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
    return p0, p1, p2, p3


@gluon.jit
def _staged_scale_words(ws_stage, h: gl.constexpr, kk, NUM_KB, WG: gl.constexpr, row_layout: gl.constexpr):
    """_weight_scale_words of K blocks 4kk..4kk+3 from the stage's copy of the swizzled scales
    (atom h of its [64, 4] words box): row n's word is at [n % 32, n // 32] of the atom, so a
    warpgroup's 64 rows are two of its columns. Bytes past NUM_KB (padding, or the next row
    block's atom after an odd KB4) are cleared."""
    # The atom's [32, 4] words, loaded whole, in the distribution of the accumulator's rows (warp
    # w: rows 16w..16w+15 of a warpgroup, lane // 4 and a register +8; a column is 32 rows); the
    # warpgroup's two columns are then picked and flattened in registers (a relabeling).
    words_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [0, 2]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [0, 1]], block_bases=[], shape=[32, 4])
    words = ws_stage.slice(32 * h, 32).load(words_layout)
    halves = gl.permute(gl.reshape(words, [32, 2, 2]), (0, 2, 1))  # [row % 32, column % 2, column // 2]
    first, second = gl.split(halves)
    mine = first if WG == 0 else second  # [row % 32, row // 32 - 2 WG]
    word = gl.convert_layout(gl.reshape(gl.permute(mine, (1, 0)), [WG_ROWS]), row_layout)
    return _clear_padding(word, kk, NUM_KB)


@gluon.jit
def _staged_token_scales(ts_stage, h: gl.constexpr, acc_layout: gl.constexpr):
    """The four [1, TOK_TILE] token-scale rows of half h of the stage's [8, TOK_TILE] box."""
    return (ts_stage.slice(4 * h, 1).load(acc_layout), ts_stage.slice(4 * h + 1, 1).load(acc_layout),
            ts_stage.slice(4 * h + 2, 1).load(acc_layout), ts_stage.slice(4 * h + 3, 1).load(acc_layout))


@gluon.jit
def _promote_half(acc, p0, p1, p2, p3, w_word, ts_stage, h: gl.constexpr, LATER: gl.constexpr,
                         acc_layout: gl.constexpr):
    """acc += the four partials of a half stage, each promoted as soon as it retired (weight
    scales: the half's _weight_scale_words word; token scales: half h of the stage's box);
    LATER wgmmas were issued after them and may stay in flight."""
    st0, st1, st2, st3 = _staged_token_scales(ts_stage, h, acc_layout)
    p0 = warpgroup_mma_wait(LATER + 3, deps=(p0, ))
    acc = _promote_rows(acc, p0, _word_scale(w_word, 0), st0)
    p1 = warpgroup_mma_wait(LATER + 2, deps=(p1, ))
    acc = _promote_rows(acc, p1, _word_scale(w_word, 1), st1)
    p2 = warpgroup_mma_wait(LATER + 1, deps=(p2, ))
    acc = _promote_rows(acc, p2, _word_scale(w_word, 2), st2)
    p3 = warpgroup_mma_wait(LATER, deps=(p3, ))
    return _promote_rows(acc, p3, _word_scale(w_word, 3), st3)


@gluon.jit
def _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, a_bufs, w_lo, w_hi, w_scale_rows, w_ok,
               NUM_KB, KB4, it, kk, HALVES: gl.constexpr, WG: gl.constexpr,
               SWIZZLED: gl.constexpr, acc_layout: gl.constexpr):
    """One ring stage of _promote_chain_fp4: decode HALVES (2, or 1 when the rest of the stage
    lies past K) 128-wide halves of this warpgroup's weight rows into its e4m3 operand
    buffers, one fence, issue their k32 wgmmas (all in flight), promote them in order, release
    the stage. w_lo, w_hi: plain weight-scale words of this stage (loaded a stage ahead, the
    next stage's are returned); swizzled ones come with the stage."""
    raw_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    f8_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    stage = ring.wait_ready(it)
    w_stage = w_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS)
    ts_stage = ts_bufs.index(stage)
    if SWIZZLED:
        w_lo = _staged_scale_words(ws_bufs.index(stage), 0, 2 * kk, NUM_KB, WG, row_layout)
        if HALVES == 2:
            w_hi = _staged_scale_words(ws_bufs.index(stage), 1, 2 * kk + 1, NUM_KB, WG, row_layout)
    _decode_half(w_stage, 0, a_bufs.index(2 * WG), raw_layout)
    if HALVES == 2:
        _decode_half(w_stage, 1, a_bufs.index(2 * WG + 1), raw_layout)
    fence_async_shared()
    if not SWIZZLED:
        n_w_lo = _weight_scale_words(w_scale_rows, w_ok, 2 * kk + 2, NUM_KB, KB4, SWIZZLED)
        n_w_hi = _weight_scale_words(w_scale_rows, w_ok, 2 * kk + 3, NUM_KB, KB4, SWIZZLED)
    op0 = a_bufs.index(2 * WG)._reinterpret(gl.float8e4nv, [WG_ROWS, 128], f8_layout)
    p0, p1, p2, p3 = _issue_half(op0, t_bufs.index(stage * 2), zero)
    if HALVES == 2:
        op1 = a_bufs.index(2 * WG + 1)._reinterpret(gl.float8e4nv, [WG_ROWS, 128], f8_layout)
        q0, q1, q2, q3 = _issue_half(op1, t_bufs.index(stage * 2 + 1), zero)
        acc = _promote_half(acc, p0, p1, p2, p3, w_lo, ts_stage, 0, 4, acc_layout)
        acc = _promote_half(acc, q0, q1, q2, q3, w_hi, ts_stage, 1, 0, acc_layout)
    else:
        acc = _promote_half(acc, p0, p1, p2, p3, w_lo, ts_stage, 0, 0, acc_layout)
    ring.release(stage)
    if not SWIZZLED:
        w_lo, w_hi = n_w_lo, n_w_hi
    return acc, w_lo, w_hi


@gluon.jit
def _promote_chain_fp4(w_bufs, t_bufs, a_bufs, ts_bufs, ws_bufs, ring, zero, w_scale_rows, w_ok, K, NUM_KB,
                       KB4, it, k_steps, WG: gl.constexpr, SWIZZLED: gl.constexpr,
                       acc_layout: gl.constexpr, ACC_FACTOR: gl.constexpr):
    """The main loop with e2m1 weights (mxfp4, w4a8): a stage holds 256 K, each weight row's 128
    bytes and two [TOK_TILE, 128] token boxes. Per stage (_fp4_stage): decode both halves into
    this warpgroup's two e4m3 operand buffers, one fence, issue the eight k32 wgmmas (all in
    flight, 8 registers each on 16-token tiles; 32-token tiles spilled), promote them in order.
    A last stage whose second half lies past K (gpt-oss: K = 2880 = 11 stages + 64) does the
    first half only: the consumers' time per stage hardly depends on how much of it TMA filled.

    The scales come through the ring: the producer copies each stage's token scales ([8,
    TOK_TILE] fp32 of the K-block-major copy) and, with swizzled weight scales, the weight
    tile's two 128x4 atoms, so the loop issues no global load. That matters because the fence
    (fence.proxy.async, a MEMBAR.ALL.CTA in SASS) waits for every memory access still in
    flight, global loads included. Plain weight scales are loaded from global memory instead, a
    stage ahead and after the fence (loaded before it, the kernel ran 1.7x slower than with no
    scale loads at all: gpt-oss up, 2 tokens an expert, H100). (K > 0: launcher.supports.)"""
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    gl.static_assert(zero.shape[1] <= 16, "e2m1 weights run 8- or 16-token tiles")
    acc = zero
    if SWIZZLED:  # (unused: the stage brings its words)
        w_lo = gl.zeros([WG_ROWS], gl.int32, row_layout)
        w_hi = w_lo
    else:
        w_lo = _weight_scale_words(w_scale_rows, w_ok, 0, NUM_KB, KB4, SWIZZLED)
        w_hi = _weight_scale_words(w_scale_rows, w_ok, 1, NUM_KB, KB4, SWIZZLED)
    for kk in range(k_steps - 1):
        acc, w_lo, w_hi = _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, a_bufs, w_lo, w_hi,
                                     w_scale_rows, w_ok, NUM_KB, KB4, it, kk, 2, WG, SWIZZLED, acc_layout)
        it += 1
    last = k_steps - 1
    if K - last * 256 > 128:  # (256 K a stage, 128 a half)
        acc, w_lo, w_hi = _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, a_bufs, w_lo, w_hi,
                                     w_scale_rows, w_ok, NUM_KB, KB4, it, last, 2, WG, SWIZZLED, acc_layout)
    else:
        acc, w_lo, w_hi = _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, a_bufs, w_lo, w_hi,
                                     w_scale_rows, w_ok, NUM_KB, KB4, it, last, 1, WG, SWIZZLED, acc_layout)
    it += 1
    if ACC_FACTOR != 1.0:  # w4a8: the weights' 2^-6 (E2M1_WEIGHT_EXP), exact
        acc = acc * ACC_FACTOR
    return acc, it


@gluon.jit
def _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, operand, w_word, w_scale_rows, w_ok,
                    NUM_KB, KB4, it, kk, H: gl.constexpr, ROWS: gl.constexpr,
                    SWIZZLED: gl.constexpr, acc_layout: gl.constexpr):
    """Split-K (four consumer warpgroups): half H of ring stage kk for this warpgroup's weight
    rows ROWS: decode it into the warpgroup's one e4m3 operand buffer, one fence, four k32
    wgmmas in flight, promote them in order, release the stage (four arrivals free it).
    w_word: plain weight-scale word of this half (loaded a stage ahead, the next one is
    returned); swizzled ones come with the stage."""
    raw_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    f8_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    stage = ring.wait_ready(it)
    if SWIZZLED:
        w_word = _staged_scale_words(ws_bufs.index(stage), H, 2 * kk + H, NUM_KB, ROWS, row_layout)
    _decode_half(w_bufs.index(stage).slice(ROWS * WG_ROWS, WG_ROWS), H, operand, raw_layout)
    fence_async_shared()
    if not SWIZZLED:  # (after the fence, which would wait for it)
        next_word = _weight_scale_words(w_scale_rows, w_ok, 2 * kk + 2 + H, NUM_KB, KB4, SWIZZLED)
    op = operand._reinterpret(gl.float8e4nv, [WG_ROWS, 128], f8_layout)
    p0, p1, p2, p3 = _issue_half(op, t_bufs.index(stage * 2 + H), zero)
    acc = _promote_half(acc, p0, p1, p2, p3, w_word, ts_bufs.index(stage), H, 0, acc_layout)
    ring.release(stage)
    if not SWIZZLED:
        w_word = next_word
    return acc, w_word


@gluon.jit
def _release_stages(ring, it, k_steps):
    """Split-K: wait for each of k_steps stages and release it, reading nothing (weight rows all
    past N, half of an expert's last tile the producer loaded alone; or a last half stage past K)."""
    for kk in range(k_steps):
        stage = ring.wait_ready(it)
        ring.release(stage)
        it += 1
    return it


@gluon.jit
def _promote_chain_fp4_split(w_bufs, t_bufs, operand, ts_bufs, ws_bufs, ring, zero, w_scale_rows, w_ok, K,
                             NUM_KB, KB4, it, k_steps, KH: gl.constexpr, ROWS: gl.constexpr,
                             SWIZZLED: gl.constexpr, acc_layout: gl.constexpr):
    """_promote_chain_fp4 over one K half of every stage (KH: the first or the last 128 K of
    each 256-K stage): this warpgroup's partial sum, which the caller adds to the other half's.
    A last stage whose second half lies past K is only waited for and released by KH = 1 (it
    must not arrive before the stage was filled: the arrival would count for the lap before)."""
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    gl.static_assert(zero.shape[1] <= 16, "e2m1 weights run 8- or 16-token tiles")
    acc = zero
    if SWIZZLED:  # (unused: the stage brings its word)
        w_word = gl.zeros([WG_ROWS], gl.int32, row_layout)
    else:
        w_word = _weight_scale_words(w_scale_rows, w_ok, KH, NUM_KB, KB4, SWIZZLED)
    for kk in range(k_steps - 1):
        acc, w_word = _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, operand, w_word,
                                      w_scale_rows, w_ok, NUM_KB, KB4, it, kk, KH, ROWS, SWIZZLED, acc_layout)
        it += 1
    last = k_steps - 1
    if KH == 0:
        acc, w_word = _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, operand, w_word,
                                      w_scale_rows, w_ok, NUM_KB, KB4, it, last, KH, ROWS, SWIZZLED, acc_layout)
    else:
        if K - last * 256 > 128:  # (256 K a stage, 128 a half)
            acc, w_word = _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ring, zero, operand, w_word,
                                          w_scale_rows, w_ok, NUM_KB, KB4, it, last, KH, ROWS, SWIZZLED,
                                          acc_layout)
        else:
            _release_stages(ring, it, 1)
    it += 1
    return acc, it


@gluon.jit
def _reduce_split_k(acc, red_bufs, red_ready, red_free, tiles_done, receiver, ROWS: gl.constexpr,
                    acc_layout: gl.constexpr):
    """Split-K: one warpgroup of the rows ROWS hands its partial sum of the tile to the other
    (the receiver, which then runs the epilogue) through shared memory (red_ready: written;
    red_free: read, the buffer may be reused); returns the whole sum on the receiver.
    tiles_done: the tiles both have finished (hand-off number)."""
    buf = red_bufs.index(ROWS)
    if receiver:
        mbarrier.wait(red_ready.index(ROWS), tiles_done & 1)
        acc = acc + buf.load(acc_layout)
        mbarrier.arrive(red_free.index(ROWS), count=1)
    else:
        mbarrier.wait(red_free.index(ROWS), (tiles_done & 1) ^ 1)
        buf.store(acc)
        mbarrier.arrive(red_ready.index(ROWS), count=1)
    return acc


@aggregate
class E2m1Consumer:
    """Consumer warpgroup WG: acc [64, TOK_TILE], rows its weight rows, columns the tile's tokens
    (module docstring). ACC_FACTOR: w4a8's 2^6 (E2M1_WEIGHT_EXP), else 1."""

    ring: Ring
    t_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    s_bufs: gl.shared_memory_descriptor
    a_bufs: gl.shared_memory_descriptor
    ws_bufs: OPTIONAL_SMEM
    red_bufs: OPTIONAL_SMEM
    red_ready: OPTIONAL_SMEM
    red_free: OPTIONAL_SMEM
    out: Output
    swiglu: Swiglu
    b_scale_ptr: gl.tensor
    K: gl.tensor
    NUM_KB: gl.tensor
    KB4: gl.tensor
    WG: gl.constexpr
    SWIZZLED: gl.constexpr
    HALF_TILES: gl.constexpr
    ACC_FACTOR: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ring, t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, red_ready, red_free, out, swiglu,
                 b_scale_ptr, K, NUM_KB, KB4, WG, SWIZZLED, HALF_TILES, ACC_FACTOR):
        self.ring = ring
        self.t_bufs = t_bufs
        self.w_bufs = w_bufs
        self.s_bufs = s_bufs
        self.a_bufs = a_bufs
        self.ws_bufs = optional(ws_bufs)
        self.red_bufs = optional(red_bufs)
        self.red_ready = optional(red_ready)
        self.red_free = optional(red_free)
        self.out = out
        self.swiglu = swiglu
        self.b_scale_ptr = b_scale_ptr
        self.K = K
        self.NUM_KB = NUM_KB
        self.KB4 = KB4
        self.WG = gl.constexpr(WG)
        self.SWIZZLED = gl.constexpr(SWIZZLED)
        self.HALF_TILES = gl.constexpr(HALF_TILES)
        self.ACC_FACTOR = gl.constexpr(ACC_FACTOR)

    @gluon.jit
    def tile(self, sched, slot, tok_block, w_block, it, done):
        WG: gl.constexpr = self.WG
        SPLIT_K: gl.constexpr = self.red_bufs is not None
        ROWS: gl.constexpr = WG % 2
        KH: gl.constexpr = WG // 2
        TOK_TILE: gl.constexpr = sched.TOK_TILE
        W_TILE: gl.constexpr = sched.W_TILE
        SWIZZLED: gl.constexpr = self.SWIZZLED
        STAGE_K: gl.constexpr = 2 * self.t_bufs.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TOK_TILE, SCALE_BLOCK])
        N = sched.N
        K = self.K
        k_steps = gl.cdiv(K, STAGE_K)
        zero = gl.zeros([WG_ROWS, TOK_TILE], gl.float32, acc_layout)
        w_offsets = ROWS * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
        ns = w_block * W_TILE + w_offsets
        w_ok = ns < N
        if SWIZZLED:  # 32-bit words: one a row per stage (_weight_scale_words)
            w_scale_rows = self.b_scale_ptr + scale_row_offsets(slot.e, ns, N, self.NUM_KB, self.KB4, SWIZZLED) // 4
        else:
            w_scale_rows = self.b_scale_ptr + scale_row_offsets(slot.e, ns, N, self.NUM_KB, self.KB4, SWIZZLED)
        if SPLIT_K:
            if ROWS == 1 and self.HALF_TILES:  # an expert's last tile may hold these rows past N
                if w_block * W_TILE + WG_ROWS < N:
                    acc, it = _promote_chain_fp4_split(self.w_bufs, self.t_bufs, self.a_bufs.index(WG), self.s_bufs,
                                                       self.ws_bufs, self.ring, zero, w_scale_rows, w_ok, K,
                                                       self.NUM_KB, self.KB4, it, k_steps, KH, ROWS, SWIZZLED,
                                                       acc_layout)
                else:
                    acc = zero
                    it = _release_stages(self.ring, it, k_steps)
            else:
                acc, it = _promote_chain_fp4_split(self.w_bufs, self.t_bufs, self.a_bufs.index(WG), self.s_bufs,
                                                   self.ws_bufs, self.ring, zero, w_scale_rows, w_ok, K, self.NUM_KB,
                                                   self.KB4, it, k_steps, KH, ROWS, SWIZZLED, acc_layout)
            # The two K halves take turns at receiving the other's sum and running the epilogue,
            # which would otherwise hold one pair back (the ring waits for all four).
            owner = (done + KH) % 2 == 0
            acc = _reduce_split_k(acc, self.red_bufs, self.red_ready, self.red_free, done, owner, ROWS, acc_layout)
            if self.ACC_FACTOR != 1.0:  # w4a8: the weights' 2^-6 (E2M1_WEIGHT_EXP), exact
                acc = acc * self.ACC_FACTOR
        else:
            owner = True
            acc, it = _promote_chain_fp4(self.w_bufs, self.t_bufs, self.a_bufs, self.s_bufs, self.ws_bufs, self.ring,
                                         zero, w_scale_rows, w_ok, K, self.NUM_KB, self.KB4, it, k_steps, ROWS,
                                         SWIZZLED, acc_layout, self.ACC_FACTOR)
        if owner:  # (split-K: the warpgroup that received the other K half's sum)
            if self.swiglu.ACT != 0:
                self.swiglu.store(acc, self.out, slot, slot.s + tok_block * TOK_TILE,
                                  w_block * W_TILE + ROWS * WG_ROWS, N, True)
            else:
                # (the tile's token offsets made here, not held through the K loop: they spilled)
                toks = slot.s + tok_block * TOK_TILE + gl.arange(0, TOK_TILE, layout=gl.SliceLayout(0, acc_layout))
                self.out.store_swapped_tile(acc, slot.e, toks, toks < slot.t, ns, N, slot.s + tok_block * TOK_TILE,
                                            w_block * W_TILE + ROWS * WG_ROWS, slot.t)
        return it


@gluon.jit
def _consume(consumer, sched):
    walk(sched, consumer)


@gluon.jit
def e2m1_kernel(t_desc, w_desc, s_desc, ws_desc, w_half_desc, out_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                expert_scales_ptr, row_scales_ptr, tile_counter_ptr, claim_rounds, M, N, K, E, G, NUM_KB, KB4, epi,
                STAGES: gl.constexpr, GROUP_M: gl.constexpr, SWIZZLED: gl.constexpr,
                HAS_EXPERT_SCALES: gl.constexpr, HAS_ROW_SCALES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                EPI: gl.constexpr, ACC_FACTOR: gl.constexpr, SPLIT_K: gl.constexpr, DYNAMIC: gl.constexpr):
    """t_desc: e4m3 token tiles [TOK_TILE, 128] of A (two a stage); w_desc: packed e2m1 weight
    tiles [128, 128 bytes] of B viewed as [E*N, K/2] bytes (a stage holds 256 K). s_desc: fp32
    token-scale boxes [8, TOK_TILE] of the K-block-major copy, a part of each stage. ws_desc
    (swizzled weight scales, else None): the weight scales as [atoms * 32, 4] int32 (a 128x4 atom
    of e8m0 bytes is 32 x 4 words), a [64, 4] box (two atoms) a stage; plain ones are read from
    b_scale_ptr. SPLIT_K: four consumer warpgroups, two for each K half of a stage (module
    docstring); w_half_desc (split-K with N % 128 <= 64, else None): [64, 128 bytes] weight
    boxes, with which an expert's last tile loads only the rows it has and the warpgroups of the
    other 64 rows skip it. DYNAMIC (not with SPLIT_K): pipeline.Schedule's. epi, EPI: the fused
    epilogue (Swiglu.create)."""
    HALF_TILES: gl.constexpr = w_half_desc is not None
    TOK_TILE: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = t_desc.block_type.shape[1]
    W_TILE: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(W_TILE == 2 * WG_ROWS, "two warpgroups of 64 weight rows")
    gl.static_assert(BLOCK_K == 4 * SCALE_BLOCK, "a token tile holds four scale blocks")
    gl.static_assert(TOK_TILE <= 16, "e2m1 weights: 8- or 16-token tiles")
    gl.static_assert(SPLIT_K or not HALF_TILES, "half tiles are skipped by split-K's consumers")
    gl.static_assert(w_desc.block_type.shape[1] == BLOCK_K, "a weight row's 128 bytes a stage")
    gl.static_assert(not (DYNAMIC and SPLIT_K), "split-K tiles are dealt round-robin")
    t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES * 2] + t_desc.block_type.shape, t_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    if ws_desc is not None:
        ws_bufs = gl.allocate_shared_memory(ws_desc.dtype, [STAGES] + ws_desc.block_type.shape, ws_desc.layout)
    else:
        ws_bufs = None
    # Decoded e4m3 [64, 128] operand buffers, stored as uint16 pairs: two a consumer warpgroup
    # (both K halves of a stage), or with split-K one for each of the four.
    a_bufs = gl.allocate_shared_memory(gl.uint16, [4, WG_ROWS, 64],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    ring = Ring.create(STAGES, 4 if SPLIT_K else 2)
    if SPLIT_K:  # the K-half-1 warpgroups' partial sums, one [64, TOK_TILE] fp32 buffer per row block
        red_bufs = gl.allocate_shared_memory(gl.float32, [2, WG_ROWS, TOK_TILE],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        red_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        red_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(red_ready.index(i), count=1)
            mbarrier.init(red_free.index(i), count=1)
    else:
        red_bufs = None
        red_ready = None
        red_free = None
    sched = Schedule.create(a_offsets_ptr, expert_ids_ptr, M, N, E, G, tile_counter_ptr, claim_rounds, TOK_TILE,
                            W_TILE, GROUP_M, 4 if SPLIT_K else 2, DYNAMIC=DYNAMIC)
    out = Output(out_ptr, expert_scales_ptr, row_scales_ptr, HAS_EXPERT_SCALES, HAS_ROW_SCALES)
    swiglu = Swiglu.create(epi, EPI)
    K = gl.to_tensor(K)
    NUM_KB = gl.to_tensor(NUM_KB)
    KB4 = gl.to_tensor(KB4)
    consumer0 = E2m1Consumer(ring, t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, red_ready, red_free, out, swiglu,
                             b_scale_ptr, K, NUM_KB, KB4, 0, SWIZZLED, HALF_TILES, ACC_FACTOR)
    consumer1 = E2m1Consumer(ring, t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, red_ready, red_free, out, swiglu,
                             b_scale_ptr, K, NUM_KB, KB4, 1, SWIZZLED, HALF_TILES, ACC_FACTOR)
    producer = Producer.create(ring, t_desc, w_desc, t_bufs, w_bufs, K, 2, s_desc, s_bufs, ws_desc, ws_bufs, KB4,
                               w_half_desc)
    if SPLIT_K:
        consumer2 = E2m1Consumer(ring, t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, red_ready, red_free, out,
                                 swiglu, b_scale_ptr, K, NUM_KB, KB4, 2, SWIZZLED, HALF_TILES, ACC_FACTOR)
        consumer3 = E2m1Consumer(ring, t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, red_ready, red_free, out,
                                 swiglu, b_scale_ptr, K, NUM_KB, KB4, 3, SWIZZLED, HALF_TILES, ACC_FACTOR)
        gl.warp_specialize([(_consume, (consumer0, sched)), (_consume, (consumer1, sched)),
                            (_consume, (consumer2, sched)), (_consume, (consumer3, sched)),
                            (produce, (producer, sched))],
                           [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS,
                                          producer_registers(4, CONSUMER_REGS)])
    else:
        gl.warp_specialize([(_consume, (consumer0, sched)), (_consume, (consumer1, sched)),
                            (produce, (producer, sched))], [4, 1], [CONSUMER_REGS, producer_registers(2, CONSUMER_REGS)])
