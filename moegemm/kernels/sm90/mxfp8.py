"""The sm90 kernel of `mxfp8`: fp8 wgmma per 32-wide K block, the block scales applied by fp32
promotion.

Both operands of mxfp8 are e4m3 with an e8m0 scale per 32 elements of K, one per weight row
and one per token. One k32 wgmma covers exactly one scale block, so

    C[n, m] = sum_kb  sw[n, kb] * st[m, kb] * (W[n, kb-block] . T[m, kb-block])

is computed as it reads: a fresh wgmma per K block, then acc += part * (sw outer st) in fp32
(two FP32 operations per accumulator element and K block; promotion.py). The operands go from
the TMA ring straight into the wgmma: no decoding (the token pre-pass only turns the token
scales into fp32, tokens.decode_row_scales), no shared-memory stores or fences in the main
loop. Tiles are swapped: 128 weight rows (two warpgroups of 64) x TOK_TILE tokens.

Narrow tiles (16 or 32 tokens): the token scales are loaded from global memory a stage
ahead, four vectors of TOK_TILE / 4 a thread, and two partial tiles are in flight (below).
Wide tiles (64 or 128 tokens): that would be 8 x TOK_TILE / 4 registers (64 tokens spilled),
so the producer also loads each stage's token scales, a [4, TOK_TILE] fp32 box of their
K-block-major copy, into the ring; a warpgroup reads one block's vector at a time, stored in
the accumulator's column order so that a thread's four of 16 tokens are one 128-bit load
(_token_scale_row). A NaN weight scale (code 255) decodes to +inf there, and its rows are made
NaN after the K loop (_word_scale_nan_later), and the main tile's bf16 output leaves with
16-byte stores (Output.store_swapped). It sums the tile's tokens in two halves, whose wgmmas
alternate: one half's wgmma runs while the other half's partial is promoted
(_promote_stage_halves; a whole-tile partial in flight beside the one promoted spilled). Up to
192 tokens a slot, a slot's last 128-token tile also takes up to 32 more tokens (a tail): the
same warpgroups run them on a third [64, 32] accumulator over the same weight stream, its wgmma
in turn with the halves' (_promote_chain_wide), instead of a nearly empty tile that streams the
weight block again. A tail of up to 16 tokens runs on a [64, 16] accumulator over the tail
buffers' first rows (sm90_configs.Mxfp8Config.short_tails). The weight scales of the next stage are
loaded a stage ahead and decoded only in the next iteration (_weight_scale_loads): decoded right
after the load, every stage waited for DRAM.

Steady state of one consumer, narrow tiles (stage s holds 128 K = four scale blocks):
    load the scales of stage s+1 (weights: 2 rows a thread, tokens: its columns)
    wait ready[s]
    p0 = wgmma(k32 block 0); p1 = wgmma(block 1)
    wait until p0 retired; acc += p0 * scale(0); p2 = wgmma(block 2)
    wait p1; acc += p1 * scale(1); p3 = wgmma(block 3)
    wait p2; acc += ...; wait p3; arrive empty[s]; acc += p3 * scale(3)
The partials never cross a loop iteration: a loop-carried wgmma in flight made ptxas
serialize every wgmma in the fp8_block kernel (dense._promote).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from ...token_forms import ACC_ORDER_BLOCK
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
from .promotion import (
    SCALE_BLOCK,
    _block_operands,
    _has_nan_code,
    _nan_code_bits,
    _promote_rows,
    _scale_words_of,
    _weight_scale_loads,
    _word_scale,
    _word_scale_nan_later,
)
from .swiglu import Swiglu

ACC_ORDER_COLUMNS = gl.constexpr(ACC_ORDER_BLOCK)  # the wide tiles' token-scale column block


@gluon.jit
def _token_scales(t_scale_rows, t_ok, kk):
    """fp32 scales of stage kk's four K blocks, one [TOK_TILE] vector each, from the decoded
    copy (tokens.decode_row_scales: rows padded past the last stage, so only the tokens
    are masked)."""
    s0 = gl.load(t_scale_rows + 4 * kk, mask=t_ok, other=0.0)
    s1 = gl.load(t_scale_rows + 4 * kk + 1, mask=t_ok, other=0.0)
    s2 = gl.load(t_scale_rows + 4 * kk + 2, mask=t_ok, other=0.0)
    s3 = gl.load(t_scale_rows + 4 * kk + 3, mask=t_ok, other=0.0)
    return s0, s1, s2, s3


@gluon.constexpr_function
def _acc_order_load_layout(tokens):
    """[1, tokens] fp32 scales stored in accumulator order (token_forms.kb_major_column, column
    block 16): the thread of lane % 4 = c holds the stored columns 4c .. 4c + 3 of every 16, one
    128-bit shared load each (every warp and lane // 4 the same: the row is broadcast)."""
    regs = [[0, 1], [0, 2]] + [[0, 16 << i] for i in range((tokens // 16).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 4], [0, 8], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[1, tokens])


@gluon.jit
def _token_scale_row(row, acc_layout: gl.constexpr):
    """One K block's token scales, a [1, TOKENS] row in the accumulator's layout (a thread's
    columns 2c, 2c + 1, 2c + 8, 2c + 9 of every 16), from a row of the stage's box whose 16s are
    stored in that order (at 4c .. 4c + 3): one LDS.128 per 16 tokens instead of two LDS.64. The
    stored position 16b + 4c + 2h + l holds column 16b + 8h + 2c + l: the reshape and permute
    relabel the registers (no data moves)."""
    TOKENS: gl.constexpr = row.shape[1]
    stored = row.load(_acc_order_load_layout(TOKENS))
    columns = gl.permute(gl.reshape(stored, [1, TOKENS // 16, 4, 2, 2]), (0, 1, 3, 2, 4))
    return gl.convert_layout(gl.reshape(columns, [1, TOKENS]), acc_layout)


@gluon.jit
def _promote(acc, part, sw, st):
    return acc + part * (gl.expand_dims(sw, 1) * gl.expand_dims(st, 0))


@gluon.jit
def _promote_chain(w_bufs, t_bufs, ring, zero, w_scale_rows, w_ok, t_scale_rows, t_ok, NUM_KB, KB4, it,
                   k_steps, WG: gl.constexpr, SWIZZLED: gl.constexpr):
    """acc = sum over the k_steps stages of the four promoted k32 blocks (module docstring)."""
    acc = zero
    loads = _weight_scale_loads(w_scale_rows, w_ok, 0, NUM_KB, KB4, SWIZZLED)
    st0, st1, st2, st3 = _token_scales(t_scale_rows, t_ok, 0)
    for kk in range(k_steps):
        # The next stage's scales, loaded a stage ahead (masked past the last one); the weight
        # scales are decoded an iteration after their load (_weight_scale_loads).
        word = _scale_words_of(loads, kk, NUM_KB, SWIZZLED)
        sw0 = _word_scale(word, 0)
        sw1 = _word_scale(word, 1)
        sw2 = _word_scale(word, 2)
        sw3 = _word_scale(word, 3)
        loads = _weight_scale_loads(w_scale_rows, w_ok, kk + 1, NUM_KB, KB4, SWIZZLED)
        nst0, nst1, nst2, nst3 = _token_scales(t_scale_rows, t_ok, kk + 1)
        stage = ring.wait_ready(it)
        w_stage = w_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS)
        t_stage = t_bufs.index(stage)
        w, t = _block_operands(w_stage, t_stage, 0)
        p0 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
        w, t = _block_operands(w_stage, t_stage, 1)
        p1 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
        p0 = warpgroup_mma_wait(1, deps=(p0, ))
        acc = _promote(acc, p0, sw0, st0)
        w, t = _block_operands(w_stage, t_stage, 2)
        p2 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
        p1 = warpgroup_mma_wait(1, deps=(p1, ))
        acc = _promote(acc, p1, sw1, st1)
        w, t = _block_operands(w_stage, t_stage, 3)
        p3 = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
        p2 = warpgroup_mma_wait(1, deps=(p2, ))
        acc = _promote(acc, p2, sw2, st2)
        p3 = warpgroup_mma_wait(0, deps=(p3, ))
        ring.release(stage)
        acc = _promote(acc, p3, sw3, st3)
        st0, st1, st2, st3 = nst0, nst1, nst2, nst3
        it += 1
    return acc, it


@gluon.jit
def _promote_stage_halves(acc_lo, acc_hi, tail_acc, w_stage, t_stage, s_stage, tail_stage, tail_s_stage, empty_bar,
                          zero, tail_zero, word, half_layout: gl.constexpr, tail_layout: gl.constexpr):
    """The four k32 blocks of a stage on a wide tile, its tokens in two halves: the halves'
    wgmmas alternate, so while one half's partial is promoted the other's wgmma runs, and the
    stage is released after the last one retired. (A whole-tile partial in flight beside the one
    being promoted needs 64 more registers: it spilled ~100 values in the loop.) With a tail
    (tail_acc not None), the tail's wgmma takes its turn after the low half's: lo, tail, hi;
    returns (acc_lo, acc_hi[, tail_acc])."""
    TAIL: gl.constexpr = tail_acc is not None
    HALF: gl.constexpr = t_stage.shape[0] // 2
    t_lo = t_stage.slice(0, HALF)
    t_hi = t_stage.slice(HALF, HALF)
    s_lo = s_stage.slice(0, HALF, dim=1)
    s_hi = s_stage.slice(HALF, HALF, dim=1)
    w, t = _block_operands(w_stage, t_lo, 0)
    p_lo = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
    w, t = _block_operands(w_stage, t_hi, 0)
    p_hi = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
    for j in gl.static_range(4):
        sw_word = _word_scale_nan_later(word, j)
        sw = gl.convert_layout(sw_word, gl.SliceLayout(1, half_layout))  # (same rows a thread)
        st = _token_scale_row(s_lo.slice(j, 1), half_layout)
        p_lo = warpgroup_mma_wait(1, deps=(p_lo, ))
        acc_lo = _promote_rows(acc_lo, p_lo, sw, st)
        if TAIL:
            w, t = _block_operands(w_stage, tail_stage, j)
            p_tail = warpgroup_mma(w, t, tail_zero, use_acc=False, is_async=True)
        elif j < 3:
            w, t = _block_operands(w_stage, t_lo, j + 1)
            p_lo = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
        st = _token_scale_row(s_hi.slice(j, 1), half_layout)
        if TAIL or j < 3:
            p_hi = warpgroup_mma_wait(1, deps=(p_hi, ))
        else:
            p_hi = warpgroup_mma_wait(0, deps=(p_hi, ))
            mbarrier.arrive(empty_bar, count=1)
        acc_hi = _promote_rows(acc_hi, p_hi, sw, st)
        if TAIL:
            if j < 3:
                w, t = _block_operands(w_stage, t_lo, j + 1)
                p_lo = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
            st = _token_scale_row(tail_s_stage.slice(j, 1), tail_layout)
            if j < 3:
                p_tail = warpgroup_mma_wait(1, deps=(p_tail, ))
            else:
                p_tail = warpgroup_mma_wait(0, deps=(p_tail, ))
                mbarrier.arrive(empty_bar, count=1)
            tail_acc = _promote_rows(tail_acc, p_tail, gl.convert_layout(sw_word, gl.SliceLayout(1, tail_layout)),
                                     st)
        if j < 3:
            w, t = _block_operands(w_stage, t_hi, j + 1)
            p_hi = warpgroup_mma(w, t, zero, use_acc=False, is_async=True)
    if TAIL:
        return acc_lo, acc_hi, tail_acc
    else:
        return acc_lo, acc_hi


@gluon.jit
def _promote_chain_wide(w_bufs, t_bufs, s_bufs, ring, zero, w_scale_rows, w_ok, NUM_KB, KB4, it, k_steps,
                        WG: gl.constexpr, SWIZZLED: gl.constexpr, acc_layout: gl.constexpr,
                        tail_bufs=None, tail_s_bufs=None, tail_zero=None, tail_layout: gl.constexpr = None):
    """The wide tiles' main loop (64 or 128 tokens): the token scales of a stage come with it
    through the ring (s_bufs, [4, TOK_TILE] fp32), one k32 block's vector loaded at a time, so
    a thread holds TOK_TILE / 4 of them instead of 8 * TOK_TILE / 4 (two stages of four
    blocks, which spilled at 64 tokens). The tile's tokens are summed in two halves, one half's
    wgmma in flight while the other half is promoted (_promote_stage_halves: 1.03-1.05x the
    whole-tile chain of wgmma, wait, promote), and joined into acc [64, TOK_TILE] at the end
    (a register renaming: the halves' columns sit in the same threads). Returns (acc, it), or
    (acc, tail_acc, it) with tail buffers.

    With tail_bufs (a slot's last tile holding more than TOK_TILE tokens, Schedule.tail_of), the
    stage also brings the tail's tokens and scales, and a third, narrow accumulator (tail_zero's
    [64, TAIL], or [64, TAIL // 2] over the buffers' first rows for a short tail) sums them over
    the same weight stream. The consumer calls this loop without a tail and with each tail
    width from branches of their own, so each is a loop of its own: with the tail as a runtime
    branch in one loop, the 16 registers of its accumulator spilled 69-107 values there."""
    TAIL: gl.constexpr = tail_bufs is not None
    if TAIL:  # the tail's tokens: the first TAIL_W rows of its buffers (a short tail: half of them)
        TAIL_W: gl.constexpr = tail_zero.shape[1]
    HALF_TOK: gl.constexpr = zero.shape[1] // 2
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HALF_TOK, SCALE_BLOCK])
    half_zero = gl.zeros([zero.shape[0], HALF_TOK], gl.float32, half_layout)
    acc_lo = half_zero
    acc_hi = half_zero
    if TAIL:
        tail_acc = tail_zero
    loads = _weight_scale_loads(w_scale_rows, w_ok, 0, NUM_KB, KB4, SWIZZLED)
    nan_bits = gl.zeros_like(w_ok.to(gl.int32))  # rows with a NaN weight scale (_nan_code_bits)
    for kk in range(k_steps):
        # The next stage's weight scales, loaded a stage ahead and used only in the next
        # iteration: decoded right after their load, the loop would wait for DRAM every stage
        # (Nsight: long-scoreboard stalls; docs/perf-notes.md, "Scales staged through the ring").
        word = _scale_words_of(loads, kk, NUM_KB, SWIZZLED)
        nan_bits = nan_bits | _nan_code_bits(word)
        loads = _weight_scale_loads(w_scale_rows, w_ok, kk + 1, NUM_KB, KB4, SWIZZLED)
        stage = ring.wait_ready(it)
        w_stage = w_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS)
        # (The compiler puts a warpgroup barrier before the stage's release: every warp has read
        # the stage's scales and passed its wgmma wait.)
        if TAIL:
            acc_lo, acc_hi, tail_acc = _promote_stage_halves(acc_lo, acc_hi, tail_acc, w_stage, t_bufs.index(stage),
                                                             s_bufs.index(stage),
                                                             tail_bufs.index(stage).slice(0, TAIL_W),
                                                             tail_s_bufs.index(stage).slice(0, TAIL_W, dim=1),
                                                             ring.empty.index(stage), half_zero,
                                                             tail_zero, word, half_layout, tail_layout)
        else:
            acc_lo, acc_hi = _promote_stage_halves(acc_lo, acc_hi, None, w_stage, t_bufs.index(stage),
                                                   s_bufs.index(stage), None, None, ring.empty.index(stage), half_zero,
                                                   None, word, half_layout, None)
        it += 1
    acc = gl.convert_layout(gl.join(acc_lo, acc_hi).permute((0, 2, 1)).reshape([zero.shape[0], zero.shape[1]]),
                            acc_layout)
    # A NaN weight scale makes its row NaN (the promotion multiplied by +inf: _word_scale_nan_later).
    nan_rows = gl.expand_dims(_has_nan_code(nan_bits), 1)
    acc = gl.where(gl.convert_layout(nan_rows, acc_layout), float("nan"), acc)
    if TAIL:
        tail_acc = gl.where(gl.convert_layout(nan_rows, tail_layout), float("nan"), tail_acc)
        return acc, tail_acc, it
    else:
        return acc, it


@aggregate
class Mxfp8Consumer:
    """Consumer warpgroup WG: acc [64, TOK_TILE], rows its weight rows, columns the tile's tokens.
    WIDE (64 or 128 tokens): the token scales come through the ring (s_bufs), and with
    sched.TAIL a slot's last tile may take a tail (tail_bufs, tail_s_bufs); else they are read
    from t_scale_ptr, rows T_SCALE_STRIDE floats apart."""

    ring: Ring
    t_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    s_bufs: OPTIONAL_SMEM
    tail_bufs: OPTIONAL_SMEM
    tail_s_bufs: OPTIONAL_SMEM
    out: Output
    swiglu: Swiglu
    t_scale_ptr: gl.tensor
    b_scale_ptr: gl.tensor
    K: gl.tensor
    NUM_KB: gl.tensor
    KB4: gl.tensor
    T_SCALE_STRIDE: gl.tensor
    WG: gl.constexpr
    SWIZZLED: gl.constexpr
    SHORT_TAILS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ring, t_bufs, w_bufs, s_bufs, tail_bufs, tail_s_bufs, out, swiglu, t_scale_ptr, b_scale_ptr, K,
                 NUM_KB, KB4, T_SCALE_STRIDE, WG, SWIZZLED, SHORT_TAILS):
        self.ring = ring
        self.t_bufs = t_bufs
        self.w_bufs = w_bufs
        self.s_bufs = optional(s_bufs)
        self.tail_bufs = optional(tail_bufs)
        self.tail_s_bufs = optional(tail_s_bufs)
        self.out = out
        self.swiglu = swiglu
        self.t_scale_ptr = t_scale_ptr
        self.b_scale_ptr = b_scale_ptr
        self.K = K
        self.NUM_KB = NUM_KB
        self.KB4 = KB4
        self.T_SCALE_STRIDE = T_SCALE_STRIDE
        self.WG = gl.constexpr(WG)
        self.SWIZZLED = gl.constexpr(SWIZZLED)
        self.SHORT_TAILS = gl.constexpr(SHORT_TAILS)

    @gluon.jit
    def tile(self, sched, slot, tok_block, w_block, it, done):
        WG: gl.constexpr = self.WG
        TOK_TILE: gl.constexpr = sched.TOK_TILE
        W_TILE: gl.constexpr = sched.W_TILE
        TAIL: gl.constexpr = sched.TAIL
        SWIZZLED: gl.constexpr = self.SWIZZLED
        WIDE: gl.constexpr = self.s_bufs is not None
        STAGE_K: gl.constexpr = self.t_bufs.shape[2]
        # Wide tiles with 2-byte outputs store them 16 bytes at a time (Output.store_swapped; the
        # config leaves shared memory for that, sm90_configs.Mxfp8Config.swap_store_scratch).
        VECTOR_STORE: gl.constexpr = WIDE and self.out.out_ptr.dtype.element_ty.primitive_bitwidth == 16
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TOK_TILE, SCALE_BLOCK])
        N = sched.N
        s = slot.s
        t = slot.t
        e = slot.e
        k_steps = gl.cdiv(self.K, STAGE_K)
        zero = gl.zeros([WG_ROWS, TOK_TILE], gl.float32, acc_layout)
        w_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
        ns = w_block * W_TILE + w_offsets
        w_ok = ns < N
        if SWIZZLED:  # 32-bit words: one a row per stage (_weight_scale_loads)
            w_scale_rows = self.b_scale_ptr + scale_row_offsets(e, ns, N, self.NUM_KB, self.KB4, SWIZZLED) // 4
        else:
            w_scale_rows = self.b_scale_ptr + scale_row_offsets(e, ns, N, self.NUM_KB, self.KB4, SWIZZLED)
        if TAIL > 0:  # a slot's last tile may hold up to TAIL more tokens, a second accumulator
            gl.static_assert(WIDE, "tails: wide mxfp8 tiles")
            tail_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                  instr_shape=[16, TAIL, SCALE_BLOCK])
            tail_zero = gl.zeros([WG_ROWS, TAIL], gl.float32, tail_layout)
            # (the tail's first token and rows are made after the K loop, not held through it)
            if not sched.tail_of(slot, tok_block):
                acc, it = _promote_chain_wide(self.w_bufs, self.t_bufs, self.s_bufs, self.ring, zero, w_scale_rows,
                                              w_ok, self.NUM_KB, self.KB4, it, k_steps, WG, SWIZZLED, acc_layout)
            elif self.SHORT_TAILS and t - s - (tok_block + 1) * TOK_TILE <= TAIL // 2:
                # tails of up to TAIL // 2 tokens on a half-width accumulator (its own name: a
                # tensor's type is fixed across the branches)
                short_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                       instr_shape=[16, TAIL // 2, SCALE_BLOCK])
                short_zero = gl.zeros([WG_ROWS, TAIL // 2], gl.float32, short_layout)
                acc, short_acc, it = _promote_chain_wide(self.w_bufs, self.t_bufs, self.s_bufs, self.ring, zero,
                                                         w_scale_rows, w_ok, self.NUM_KB, self.KB4, it, k_steps, WG,
                                                         SWIZZLED, acc_layout, self.tail_bufs, self.tail_s_bufs,
                                                         short_zero, short_layout)
                self.tail_epilogue(short_acc, slot, s + (tok_block + 1) * TOK_TILE, w_block * W_TILE + WG * WG_ROWS,
                                   N)
            else:
                acc, tail_acc, it = _promote_chain_wide(self.w_bufs, self.t_bufs, self.s_bufs, self.ring, zero,
                                                        w_scale_rows, w_ok, self.NUM_KB, self.KB4, it, k_steps, WG,
                                                        SWIZZLED, acc_layout, self.tail_bufs, self.tail_s_bufs,
                                                        tail_zero, tail_layout)
                self.tail_epilogue(tail_acc, slot, s + (tok_block + 1) * TOK_TILE, w_block * W_TILE + WG * WG_ROWS,
                                   N)
        elif WIDE:
            acc, it = _promote_chain_wide(self.w_bufs, self.t_bufs, self.s_bufs, self.ring, zero, w_scale_rows, w_ok,
                                          self.NUM_KB, self.KB4, it, k_steps, WG, SWIZZLED, acc_layout)
        else:
            toks = s + tok_block * TOK_TILE + gl.arange(0, TOK_TILE, layout=gl.SliceLayout(0, acc_layout))
            t_scale_rows = self.t_scale_ptr + toks.to(gl.int64) * self.T_SCALE_STRIDE
            acc, it = _promote_chain(self.w_bufs, self.t_bufs, self.ring, zero, w_scale_rows, w_ok, t_scale_rows,
                                     toks < t, self.NUM_KB, self.KB4, it, k_steps, WG, SWIZZLED)
        if self.swiglu.ACT != 0:
            self.swiglu.store(acc, self.out, slot, s + tok_block * TOK_TILE, w_block * W_TILE + WG * WG_ROWS, N, True,
                              SHUFFLE_PAIRS=WIDE)
        else:
            # (the tile's token offsets made here, not held through the K loop: they spilled)
            toks = s + tok_block * TOK_TILE + gl.arange(0, TOK_TILE, layout=gl.SliceLayout(0, acc_layout))
            self.out.store_swapped_tile(acc, e, toks, toks < t, ns, N, s + tok_block * TOK_TILE,
                                        w_block * W_TILE + WG * WG_ROWS, t, VECTOR_STORE)
        return it

    @gluon.jit
    def tail_epilogue(self, tail_acc, slot, tail_start, n0, N):
        """The epilogue of a tail's accumulator [64, tail width]: tokens [tail_start, t) (at most
        the width), weight rows n0 + [0, 64). Fused: the SwiGLU epilogue, before the tile's own."""
        tail_layout: gl.constexpr = tail_acc.type.layout
        if self.swiglu.ACT != 0:
            self.swiglu.store(tail_acc, self.out, slot, tail_start, n0, N, True, SHUFFLE_PAIRS=True)
        else:
            # (offsets made here, not held through the K loops beside the accumulators; 2-byte
            # stores: the 16-byte stores' conversion here spilled tile-setup values with plain
            # weight scales)
            tail_toks = tail_start + gl.arange(0, tail_acc.shape[1], layout=gl.SliceLayout(0, tail_layout))
            tail_ns = n0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, tail_layout))
            self.out.store_swapped_tile(tail_acc, slot.e, tail_toks, tail_toks < slot.t, tail_ns, N, 0, 0, slot.t)


@gluon.jit
def _consume(consumer, sched):
    walk(sched, consumer)


@gluon.jit
def mxfp8_kernel(t_desc, w_desc, s_desc, tail_desc, tail_s_desc, out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr,
                 expert_ids_ptr, expert_scales_ptr, row_scales_ptr, tile_counter_ptr, claim_rounds, M, N, K, E, G,
                 NUM_KB, KB4, T_SCALE_STRIDE, epi, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                 SWIZZLED: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr, HAS_ROW_SCALES: gl.constexpr,
                 CONSUMER_REGS: gl.constexpr, EPI: gl.constexpr, DYNAMIC: gl.constexpr, CHUNK_WALK: gl.constexpr,
                 SHORT_TAILS: gl.constexpr):
    """t_desc: e4m3 token tiles [TOK_TILE, 128] of A; w_desc: e4m3 weight tiles [128, 128] of B
    viewed as [E*N, K] (one of each fills a ring stage). s_desc (wide tiles, TOK_TILE >= 64;
    else None): fp32 token-scale boxes [4, TOK_TILE] of the K-block-major copy, a third part of
    each stage (t_scale_ptr is then unused; else its rows are T_SCALE_STRIDE floats apart).
    tail_desc, tail_s_desc (wide tiles with tails, else None): [TAIL, 128] e4m3 token boxes and
    [4, TAIL] fp32 token-scale boxes: a slot's last tile takes up to TAIL tokens more, computed by
    the same warpgroups on a third accumulator (_promote_chain_wide); SHORT_TAILS: tails of up to
    TAIL // 2 tokens on one of half the width. b_scale_ptr: the e8m0 weight scales, plain or
    SWIZZLED. DYNAMIC, CHUNK_WALK: the schedule's (pipeline.Schedule). epi, EPI: the fused
    epilogue (Swiglu.create)."""
    TOK_TILE: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = t_desc.block_type.shape[1]
    W_TILE: gl.constexpr = w_desc.block_type.shape[0]
    WIDE: gl.constexpr = s_desc is not None
    # Wide tiles read their token scales in accumulator order (_token_scale_row).
    S_COLUMN_BLOCK: gl.constexpr = ACC_ORDER_COLUMNS if WIDE else 4
    gl.static_assert(W_TILE == 2 * WG_ROWS, "two warpgroups of 64 weight rows")
    gl.static_assert(BLOCK_K == 4 * SCALE_BLOCK, "a token tile holds four scale blocks (_promote_chain)")
    gl.static_assert(w_desc.block_type.shape[1] == BLOCK_K, "a weight row's 128 bytes a stage")
    t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES] + t_desc.block_type.shape, t_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    if WIDE:
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    else:
        s_bufs = None
    if tail_desc is not None:
        TAIL: gl.constexpr = tail_desc.block_type.shape[0]
        tail_bufs = gl.allocate_shared_memory(tail_desc.dtype, [STAGES] + tail_desc.block_type.shape, tail_desc.layout)
        tail_s_bufs = gl.allocate_shared_memory(tail_s_desc.dtype, [STAGES] + tail_s_desc.block_type.shape,
                                                tail_s_desc.layout)
    else:
        TAIL: gl.constexpr = 0
        tail_bufs = None
        tail_s_bufs = None
    ring = Ring.create(STAGES, 2)
    sched = Schedule.create(a_offsets_ptr, expert_ids_ptr, M, N, E, G, tile_counter_ptr, claim_rounds, TOK_TILE,
                            W_TILE, GROUP_M, 2, TAIL, DYNAMIC, CHUNK_WALK)
    out = Output(out_ptr, expert_scales_ptr, row_scales_ptr, HAS_EXPERT_SCALES, HAS_ROW_SCALES)
    swiglu = Swiglu.create(epi, EPI)
    K = gl.to_tensor(K)
    NUM_KB = gl.to_tensor(NUM_KB)
    KB4 = gl.to_tensor(KB4)
    T_SCALE_STRIDE = gl.to_tensor(T_SCALE_STRIDE)
    consumer0 = Mxfp8Consumer(ring, t_bufs, w_bufs, s_bufs, tail_bufs, tail_s_bufs, out, swiglu, t_scale_ptr,
                              b_scale_ptr, K, NUM_KB, KB4, T_SCALE_STRIDE, 0, SWIZZLED, SHORT_TAILS)
    consumer1 = Mxfp8Consumer(ring, t_bufs, w_bufs, s_bufs, tail_bufs, tail_s_bufs, out, swiglu, t_scale_ptr,
                              b_scale_ptr, K, NUM_KB, KB4, T_SCALE_STRIDE, 1, SWIZZLED, SHORT_TAILS)
    producer = Producer.create(ring, t_desc, w_desc, t_bufs, w_bufs, K, 1, s_desc, s_bufs, None, None, KB4, None,
                               tail_desc, tail_bufs, tail_s_desc, tail_s_bufs, S_COLUMN_BLOCK)
    # Producer registers: what the consumers leave of 504 a thread (64K registers; 120 with 192 a
    # consumer keeps the narrow tiles' two wgmmas in flight, decode.py says why); the wide tiles
    # need 232 a consumer thread (192 spilled), 240 with a tail (232 spilled a few values in its K
    # loop), leaving the producer 40 or 24.
    gl.warp_specialize([(_consume, (consumer0, sched)), (_consume, (consumer1, sched)), (produce, (producer, sched))],
                       [4, 1], [CONSUMER_REGS, producer_registers(2, CONSUMER_REGS)])
