"""Hopper (sm_90) grouped matmul for `mxfp8`, and for `mxfp4`/`w4a8` at decode: fp8 wgmma per
32-wide K block, the block scales applied by fp32 promotion.

Both operands of mxfp8 are e4m3 with an e8m0 scale per 32 elements of K, one per weight row
and one per token. One k32 wgmma covers exactly one scale block, so

    C[n, m] = sum_kb  sw[n, kb] * st[m, kb] * (W[n, kb-block] . T[m, kb-block])

is computed as it reads: a fresh wgmma per K block, then acc += part * (sw outer st) in fp32
(two FP32 operations per accumulator element and K block). The operands go from the TMA ring
straight into the wgmma: no decoding (the token pre-pass only turns the token scales into fp32,
portable.decode_row_scales), no shared-memory stores or fences in
the main loop. kernels/sm90_mx.py decodes the weights to bf16 instead; Nsight Compute put its
decode-regime run at ~670 instructions per consumer warp and stage, its warps stalled on the
fence before each wgmma (which drains the scale loads), and the ring full
(docs/perf-notes.md); at prefill its e4m3 -> bf16 conversions (F2F) bound it. This kernel
runs mxfp8 in every regime (config.sm90_mx_config): 1.24-1.37x the decoding kernel at decode,
1.10-1.17x at 40 to 1024 tokens an expert.

Narrow tiles (16 or 32 tokens): the token scales are loaded from global memory a stage
ahead, four vectors of TOK_TILE / 4 a thread, and two partial tiles are in flight (below).
Wide tiles (64 or 128 tokens): that would be 8 x TOK_TILE / 4 registers (64 tokens spilled),
so the producer also loads each stage's token scales, a [4, TOK_TILE] fp32 box of their
K-block-major copy, into the ring; a warpgroup reads one block's vector at a time, stored in
the accumulator's column order so that a thread's four of 16 tokens are one 128-bit load
(_token_scale_row). A NaN weight scale (code 255) decodes to +inf there, and its rows are made
NaN after the K loop (_word_scale_nan_later), and the main tile's bf16 output leaves with
16-byte stores (sm90._store_swapped). It sums
the tile's tokens in two halves, whose wgmmas alternate: one half's wgmma runs while the other
half's partial is promoted (_promote_stage_halves; a whole-tile partial in flight beside the
one promoted spilled). Up to 192 tokens a slot, a slot's last 128-token tile also takes up to
32 more tokens (a tail): the same warpgroups run them on a third [64, 32] accumulator over the
same weight stream, its wgmma in turn with the halves' (_promote_chain_wide), instead of
a nearly empty tile that streams the weight block again. A tail of up to 16 tokens runs on a
[64, 16] accumulator over the tail buffers' first rows (config.Sm90Config.short_tails): a
third K loop of 803 instructions a stage against the 32-wide tail's 873, and the same sums.
The weight scales of the next stage are loaded a stage ahead and decoded only in the next
iteration (_weight_scale_loads): decoded right after the load, every stage waited for DRAM.

e2m1 weights (mxfp4, w4a8; 8-token tiles up to 4 tokens a slot, then 16: config.sm90_mx_config's
regimes 8 and 16): every e2m1 value times 2^-6 is an e4m3 value, so the weights come through
the ring packed (128 bytes of a row = 256 K a stage, with two token boxes) and each consumer
warpgroup decodes its rows to e4m3 (_E2M1_TO_E4M3_PTX: 8 instructions for 8 elements, which
land in the order 0 2 4 6 1 3 5 7 within each group of 8) into two shared-memory operand
buffers, then runs the same k32 wgmmas and promotion (_promote_chain_fp4). The tokens meet
them in that order: mxfp4 tokens are re-encoded as e4m3 times 2^6 by a pre-pass
(portable.e2m1_to_e4m3), so the products are the true ones; w4a8's e4m3 tokens are reordered
(portable.even_odd_k) and its accumulator is multiplied by 2^6 before the epilogue. The
producer also copies each stage's scales into the ring (tokens always, weights when swizzled),
so the loop issues no global load before its fence. 1.31-1.39x the decoding kernel at 2 tokens an expert with the scales loaded by the
consumers (bench/results/e2m1-promotion-*.json), then 1.17-1.28x from the ring
(e2m1-staged-scales-*.json, H100); the 8-instruction decode and 8-token tiles 1.23-1.28x more
(e2m1-decode8-*.json, outputs bit-identical); a last stage that stops within its first half
(gpt-oss K = 2880) runs that half only: 1.03-1.04x (e2m1-last-half-*.json). mxfp4's k32 sums
stay exact in the fp8 accumulator (products are multiples of 1/4 below 36); w4a8's (e4m3 x
e2m1) do not, like mxfp8.

Tiles are swapped as in sm90_mx.py: 128 weight rows (two warpgroups of 64) x TOK_TILE tokens,
the producer, schedule and epilogues are those of kernels/sm90.py and sm90_epilogue.py.

Steady state of one consumer, narrow tiles (stage s holds 128 K = four scale blocks):
    load the scales of stage s+1 (weights: 2 rows a thread, tokens: its columns)
    wait ready[s]
    p0 = wgmma(k32 block 0); p1 = wgmma(block 1)
    wait until p0 retired; acc += p0 * scale(0); p2 = wgmma(block 2)
    wait p1; acc += p1 * scale(1); p3 = wgmma(block 3)
    wait p2; acc += ...; wait p3; arrive empty[s]; acc += p3 * scale(3)
The partials never cross a loop iteration: a loop-carried wgmma in flight made ptxas
serialize every wgmma in the fp8_block kernel (sm90._promote).
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..token_forms import ACC_ORDER_BLOCK, E2M1_TOKEN_EXP
from ..validation import GroupedProblem
from . import portable
from .sm90 import (SLOT_CHUNK, WG_ROWS, _band_coords, _chunk_slot, _epilogue, _layout, _load_partition,
                   _receive_tile, _slot, _slot_chunk, _sm_count, _tail_of, _tile_id_buffers, tile_counter)
from .sm90_epilogue import epilogue_args, fused_epilogue
from .sm90_mx import _scale_row_offsets

SCALE_BLOCK = gl.constexpr(32)  # K elements per e8m0 scale, and the K of one fp8 wgmma
ACC_ORDER_COLUMNS = gl.constexpr(ACC_ORDER_BLOCK)  # the wide tiles' token-scale column block


@gluon.jit
def _e8m0_f32(bits):
    """An e8m0 byte b already shifted to fp32's exponent field (b << 23) -> 2^(b-127) in fp32:
    0 -> 2^-127 (an fp32 subnormal), 255 -> NaN (+inf | quiet bit); two integer operations."""
    bits = gl.maximum(bits, 0x00400000)
    bits = bits | (((bits + 0x00800000) >> 9) & 0x00400000)  # only 0x7F800000 carries into the sign
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _weight_scale_words(w_scale_rows, w_ok, kk, NUM_KB, KB4, SWIZZLED: gl.constexpr):
    """The e8m0 bytes of four K blocks 4kk..4kk+3 of this warpgroup's rows, one int32 word a
    row (block 4kk + j in byte j; bytes past NUM_KB cleared, as are the swizzled atom's padding
    bytes; _word_scale decodes byte j). Swizzled scales: the four of a row sit in one 32-bit
    word (word (row, kk) of the 128x4 atoms), one load a row; plain: four byte loads."""
    return _scale_words_of(_weight_scale_loads(w_scale_rows, w_ok, kk, NUM_KB, KB4, SWIZZLED), kk, NUM_KB, SWIZZLED)


@gluon.jit
def _weight_scale_loads(w_scale_rows, w_ok, kk, NUM_KB, KB4, SWIZZLED: gl.constexpr):
    """The loads of _weight_scale_words, nothing computed from them: a loop that fetches the
    next stage's scales uses them (_scale_words_of) one iteration later, so no warp waits for
    the load (weight scales come from DRAM: a stage's are new lines). Swizzled: the raw word
    (four times); plain: the four bytes."""
    if SWIZZLED:
        raw = gl.load(w_scale_rows + kk * 128, mask=w_ok & (kk < KB4), other=0)
        return raw, raw, raw, raw
    else:
        kb = 4 * kk
        return (gl.load(w_scale_rows + kb, mask=w_ok & (kb < NUM_KB), other=0),
                gl.load(w_scale_rows + kb + 1, mask=w_ok & (kb + 1 < NUM_KB), other=0),
                gl.load(w_scale_rows + kb + 2, mask=w_ok & (kb + 2 < NUM_KB), other=0),
                gl.load(w_scale_rows + kb + 3, mask=w_ok & (kb + 3 < NUM_KB), other=0))


@gluon.jit
def _scale_words_of(loads, kk, NUM_KB, SWIZZLED: gl.constexpr):
    """_weight_scale_words from _weight_scale_loads' values of stage kk."""
    if SWIZZLED:
        return _clear_padding(loads[0], kk, NUM_KB)
    else:
        return (loads[0].to(gl.int32) | (loads[1].to(gl.int32) << 8) | (loads[2].to(gl.int32) << 16) |
                (loads[3].to(gl.int32) << 24))


@gluon.jit
def _clear_padding(word, kk, NUM_KB):
    """A swizzled scale word of K blocks 4kk..4kk+3 with the bytes of blocks >= NUM_KB cleared."""
    pad_bytes = gl.minimum(gl.maximum(4 * kk + 4 - NUM_KB, 0), 4)
    keep = ((pad_bytes * 0 + 1).to(gl.int64) << (32 - 8 * pad_bytes)) - 1  # the low 4 - pad bytes
    return word & keep.to(gl.int32)


@gluon.jit
def _word_byte_bits(word, j: gl.constexpr):
    """Byte j of a _weight_scale_words word moved to fp32's exponent field (b << 23)."""
    if j == 3:
        return (word >> 1) & 0x7F800000
    else:
        return (word << (23 - 8 * j)) & 0x7F800000


@gluon.jit
def _word_scale(word, j: gl.constexpr):
    """fp32 scale of byte j of a _weight_scale_words word."""
    return _e8m0_f32(_word_byte_bits(word, j))


@gluon.jit
def _word_scale_nan_later(word, j: gl.constexpr):
    """_word_scale but for the NaN code 255, which gives +inf: the wide loop marks the rows of a
    NaN scale (_nan_code_bits) and makes them NaN after the K loop, three integer operations
    fewer a scale (eight scales a thread and stage) for two a word."""
    # 0 -> 2^-127, an fp32 subnormal, as in _e8m0_f32
    return gl.maximum(_word_byte_bits(word, j), 0x00400000).to(gl.float32, bitcast=True)


@gluon.jit
def _nan_code_bits(word):
    """Bit 7 of each byte of a scale word set where the byte is 255 (the low seven bits plus one
    carry into bit 7 only from 0x7F; no carry leaves a byte), other bits junk: or them over the
    K loop and test with _has_nan_code."""
    return ((word & 0x7F7F7F7F) + 0x01010101) & word


@gluon.jit
def _has_nan_code(bits):
    """Whether _nan_code_bits (or-ed) saw a 255 byte (bit 31 comes down by an arithmetic shift)."""
    return ((bits >> 7) & 0x01010101) != 0


@gluon.jit
def _token_scales(t_scale_rows, t_ok, kk):
    """fp32 scales of stage kk's four K blocks, one [TOK_TILE] vector each, from the decoded
    copy (portable.decode_row_scales: rows padded past the last stage, so only the tokens
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
def _promote_rows(acc, part, sw, st_row):
    """_promote with the token scales as a [1, TOK_TILE] row of the accumulator's layout."""
    return acc + part * (gl.expand_dims(sw, 1) * st_row)


@gluon.jit
def _block_operands(w_stage, t_stage, j: gl.constexpr):
    """k32 block j of a stage: the weight rows [64, 32] and the tokens^T [32, TOK_TILE]."""
    return (w_stage.slice(j * SCALE_BLOCK, SCALE_BLOCK, dim=1),
            t_stage.slice(j * SCALE_BLOCK, SCALE_BLOCK, dim=1).permute((1, 0)))


@gluon.jit
def _promote_chain(w_bufs, t_bufs, ready, empty, zero, w_scale_rows, w_ok, t_scale_rows, t_ok, NUM_KB, KB4, it,
                   k_steps, WG: gl.constexpr, STAGES: gl.constexpr, SWIZZLED: gl.constexpr):
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
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
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
        mbarrier.arrive(empty.index(stage), count=1)
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
def _promote_chain_wide(w_bufs, t_bufs, s_bufs, ready, empty, zero, w_scale_rows, w_ok, NUM_KB, KB4, it, k_steps,
                        WG: gl.constexpr, STAGES: gl.constexpr, SWIZZLED: gl.constexpr, acc_layout: gl.constexpr,
                        tail_bufs=None, tail_s_bufs=None, tail_zero=None, tail_layout: gl.constexpr = None):
    """The wide tiles' main loop (64 or 128 tokens): the token scales of a stage come with it
    through the ring (s_bufs, [4, TOK_TILE] fp32), one k32 block's vector loaded at a time, so
    a thread holds TOK_TILE / 4 of them instead of 8 * TOK_TILE / 4 (two stages of four
    blocks, which spilled at 64 tokens). The tile's tokens are summed in two halves, one half's
    wgmma in flight while the other half is promoted (_promote_stage_halves: 1.03-1.05x the
    whole-tile chain of wgmma, wait, promote), and joined into acc [64, TOK_TILE] at the end
    (a register renaming: the halves' columns sit in the same threads). Returns (acc, it), or
    (acc, tail_acc, it) with tail buffers.

    With tail_bufs (a slot's last tile holding more than TOK_TILE tokens, sm90._tail_of), the
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
        # iteration: decoded right after their load (as before), the loop waited for it every
        # stage (Nsight: long-scoreboard stalls).
        word = _scale_words_of(loads, kk, NUM_KB, SWIZZLED)
        nan_bits = nan_bits | _nan_code_bits(word)
        loads = _weight_scale_loads(w_scale_rows, w_ok, kk + 1, NUM_KB, KB4, SWIZZLED)
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        w_stage = w_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS)
        # (The compiler puts a warpgroup barrier before the stage's release: every warp has read
        # the stage's scales and passed its wgmma wait.)
        if TAIL:
            acc_lo, acc_hi, tail_acc = _promote_stage_halves(acc_lo, acc_hi, tail_acc, w_stage, t_bufs.index(stage),
                                                             s_bufs.index(stage),
                                                             tail_bufs.index(stage).slice(0, TAIL_W),
                                                             tail_s_bufs.index(stage).slice(0, TAIL_W, dim=1),
                                                             empty.index(stage), half_zero,
                                                             tail_zero, word, half_layout, tail_layout)
        else:
            acc_lo, acc_hi = _promote_stage_halves(acc_lo, acc_hi, None, w_stage, t_bufs.index(stage),
                                                   s_bufs.index(stage), None, None, empty.index(stage), half_zero,
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


# e2m1 -> e4m3 scaled by 2^-6 (E2M1_WEIGHT_EXP) for eight packed elements (one 32-bit word,
# element i in nibble i), exact, 8 instructions (a PRMT table of the true values in K order took
# 14, its two table constants re-materialized at every use). A nibble s|e1 e0 m moved to bits
# 7|4 3 2 of a byte is the e4m3 code of the e2m1 value times 2^-6: e1 e0 are the low exponent
# bits (bias 7 vs 1) and m the top mantissa bit, and 0.5 lands on the subnormal 2^-7 as it
# should. The magnitude moves by 2 bits and the sign by 4: with x = the nibble << 2 (sign then
# at bit 5), the byte is x + 3 * (x & 0x20), no carry leaving the byte. $0 = elements 0, 2, 4, 6
# (the low nibbles), $1 = 1, 3, 5, 7: the K order within each group of 8 is 0 2 4 6 1 3 5 7, and
# the tokens come in the same order (portable.e2m1_to_e4m3 even_odd, portable.even_odd_k), so
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
# The weights' factor: the kernel's mxfp4 tokens are re-encoded times 2^+6 (portable.e2m1_to_e4m3),
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
def _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, a_bufs, w_lo, w_hi, w_scale_rows, w_ok,
               NUM_KB, KB4, it, kk, HALVES: gl.constexpr, WG: gl.constexpr, STAGES: gl.constexpr,
               SWIZZLED: gl.constexpr, acc_layout: gl.constexpr):
    """One ring stage of _promote_chain_fp4: decode HALVES (2, or 1 when the rest of the stage
    lies past K) 128-wide halves of this warpgroup's weight rows into its e4m3 operand
    buffers, one fence, issue their k32 wgmmas (all in flight), promote them in order, release
    the stage. w_lo, w_hi: plain weight-scale words of this stage (loaded a stage ahead, the
    next stage's are returned); swizzled ones come with the stage."""
    raw_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    f8_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    stage = it % STAGES
    mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
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
    mbarrier.arrive(empty.index(stage), count=1)
    if not SWIZZLED:
        w_lo, w_hi = n_w_lo, n_w_hi
    return acc, w_lo, w_hi


@gluon.jit
def _promote_chain_fp4(w_bufs, t_bufs, a_bufs, ts_bufs, ws_bufs, ready, empty, zero, w_scale_rows, w_ok, K, NUM_KB,
                       KB4, it, k_steps, WG: gl.constexpr, STAGES: gl.constexpr, SWIZZLED: gl.constexpr,
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
    flight, global loads included. Plain weight scales are still loaded from global memory, a
    stage ahead and after the fence (loaded before it, the kernel ran 1.7x slower than with no
    scale loads at all: gpt-oss up, 2 tokens an expert, H100). (K > 0: sm90_mx.supports.)"""
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
        acc, w_lo, w_hi = _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, a_bufs, w_lo, w_hi,
                                     w_scale_rows, w_ok, NUM_KB, KB4, it, kk, 2, WG, STAGES, SWIZZLED, acc_layout)
        it += 1
    last = k_steps - 1
    if K - last * 256 > 128:  # (256 K a stage, 128 a half)
        acc, w_lo, w_hi = _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, a_bufs, w_lo, w_hi,
                                     w_scale_rows, w_ok, NUM_KB, KB4, it, last, 2, WG, STAGES, SWIZZLED, acc_layout)
    else:
        acc, w_lo, w_hi = _fp4_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, a_bufs, w_lo, w_hi,
                                     w_scale_rows, w_ok, NUM_KB, KB4, it, last, 1, WG, STAGES, SWIZZLED, acc_layout)
    it += 1
    if ACC_FACTOR != 1.0:  # w4a8: the weights' 2^-6 (E2M1_WEIGHT_EXP), exact
        acc = acc * ACC_FACTOR
    return acc, it


@gluon.jit
def _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, operand, w_word, w_scale_rows, w_ok,
                    NUM_KB, KB4, it, kk, H: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
                    SWIZZLED: gl.constexpr, acc_layout: gl.constexpr):
    """Split-K (four consumer warpgroups): half H of ring stage kk for this warpgroup's weight
    rows ROWS: decode it into the warpgroup's one e4m3 operand buffer, one fence, four k32
    wgmmas in flight, promote them in order, release the stage (four arrivals free it).
    w_word: plain weight-scale word of this half (loaded a stage ahead, the next one is
    returned); swizzled ones come with the stage."""
    raw_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    f8_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    stage = it % STAGES
    mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
    if SWIZZLED:
        w_word = _staged_scale_words(ws_bufs.index(stage), H, 2 * kk + H, NUM_KB, ROWS, row_layout)
    _decode_half(w_bufs.index(stage).slice(ROWS * WG_ROWS, WG_ROWS), H, operand, raw_layout)
    fence_async_shared()
    if not SWIZZLED:  # (after the fence, which would wait for it)
        next_word = _weight_scale_words(w_scale_rows, w_ok, 2 * kk + 2 + H, NUM_KB, KB4, SWIZZLED)
    op = operand._reinterpret(gl.float8e4nv, [WG_ROWS, 128], f8_layout)
    p0, p1, p2, p3 = _issue_half(op, t_bufs.index(stage * 2 + H), zero)
    acc = _promote_half(acc, p0, p1, p2, p3, w_word, ts_bufs.index(stage), H, 0, acc_layout)
    mbarrier.arrive(empty.index(stage), count=1)
    if not SWIZZLED:
        w_word = next_word
    return acc, w_word


@gluon.jit
def _release_stages(ready, empty, it, k_steps, STAGES: gl.constexpr):
    """Split-K: wait for each of k_steps stages and release it, reading nothing (weight rows all
    past N, half of an expert's last tile the producer loaded alone; or a last half stage past K)."""
    for kk in range(k_steps):
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        mbarrier.arrive(empty.index(stage), count=1)
        it += 1
    return it


@gluon.jit
def _promote_chain_fp4_split(w_bufs, t_bufs, operand, ts_bufs, ws_bufs, ready, empty, zero, w_scale_rows, w_ok, K,
                             NUM_KB, KB4, it, k_steps, KH: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
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
        acc, w_word = _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, operand, w_word,
                                      w_scale_rows, w_ok, NUM_KB, KB4, it, kk, KH, ROWS, STAGES, SWIZZLED, acc_layout)
        it += 1
    last = k_steps - 1
    if KH == 0:
        acc, w_word = _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, operand, w_word,
                                      w_scale_rows, w_ok, NUM_KB, KB4, it, last, KH, ROWS, STAGES, SWIZZLED, acc_layout)
    else:
        if K - last * 256 > 128:  # (256 K a stage, 128 a half)
            acc, w_word = _fp4_half_stage(acc, w_bufs, t_bufs, ts_bufs, ws_bufs, ready, empty, zero, operand, w_word,
                                          w_scale_rows, w_ok, NUM_KB, KB4, it, last, KH, ROWS, STAGES, SWIZZLED,
                                          acc_layout)
        else:
            _release_stages(ready, empty, it, 1, STAGES)
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


@gluon.jit
def _tail_epilogue(tail_acc, out_ptr, expert_scales_ptr, row_scales_ptr, epi, g, s, e, tail_start, t, n0, N,
                   HAS_EXPERT_SCALES: gl.constexpr, HAS_ROW_SCALES: gl.constexpr, EPI: gl.constexpr):
    """The epilogue of a tail's accumulator [64, tail width]: tokens [tail_start, t) (at most
    the width), weight rows n0 + [0, 64). Fused: the SwiGLU epilogue, after the tile's own."""
    tail_layout: gl.constexpr = tail_acc.type.layout
    if EPI[0] != 0:
        fused_epilogue(tail_acc, out_ptr, expert_scales_ptr, g, s, e, tail_start, t, n0, N, epi, True,
                       HAS_EXPERT_SCALES, EPI, SHUFFLE_PAIRS=True)
    else:
        # (offsets made here, not held through the K loops beside the accumulators)
        tail_toks = tail_start + gl.arange(0, tail_acc.shape[1], layout=gl.SliceLayout(0, tail_layout))
        tail_ns = n0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, tail_layout))
        # (2-byte stores: the tail's 16 values a thread; the 16-byte stores' conversion here
        # spilled tile-setup values with plain weight scales)
        _epilogue(tail_acc, None, None, out_ptr, expert_scales_ptr, row_scales_ptr, e, tail_toks, tail_toks < t,
                  tail_ns, N, 0, 0, t, True, HAS_EXPERT_SCALES, HAS_ROW_SCALES, 0, 1)


@gluon.jit
def _mxfp8_consumer_partition(t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, ready, empty, red_ready, red_free,
                              out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
                              row_scales_ptr, M, N, K, E, G, NUM_KB, KB4, T_SCALE_STRIDE, epi, WG: gl.constexpr,
                              TOK_TILE: gl.constexpr, W_TILE: gl.constexpr, STAGE_K: gl.constexpr,
                              STAGES: gl.constexpr, GROUP_M: gl.constexpr, SWIZZLED: gl.constexpr,
                              HAS_EXPERT_SCALES: gl.constexpr, HAS_ROW_SCALES: gl.constexpr, EPI: gl.constexpr,
                              WIDE: gl.constexpr, FP4W: gl.constexpr, SPLIT_K: gl.constexpr,
                              HALF_TILES: gl.constexpr, ACC_FACTOR: gl.constexpr, tail_bufs, tail_s_bufs,
                              TAIL: gl.constexpr, tile_ids, id_ready, id_free,
                              DYNAMIC: gl.constexpr, CHUNK_WALK: gl.constexpr, SHORT_TAILS: gl.constexpr):
    # acc [64, TOK_TILE]: rows are this warpgroup's weight rows, columns the tile's tokens.
    # Split-K (four warpgroups): WG % 2 picks the rows, WG // 2 the K half of every stage.
    ROWS: gl.constexpr = WG % 2
    KH: gl.constexpr = WG // 2
    # Wide tiles with 2-byte outputs store them 16 bytes at a time (sm90._store_swapped; the
    # config leaves shared memory for that, config.Sm90Config.swap_store_scratch).
    VECTOR_STORE: gl.constexpr = WIDE and out_ptr.dtype.element_ty.primitive_bitwidth == 16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, TOK_TILE, SCALE_BLOCK])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    w_tiles = gl.cdiv(N, W_TILE)
    k_steps = gl.cdiv(K, STAGE_K)
    zero = gl.zeros([WG_ROWS, TOK_TILE], gl.float32, acc_layout)
    w_offsets = ROWS * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
    if TAIL > 0:  # a slot's last tile may hold up to TAIL more tokens (sm90._slot), a second accumulator
        gl.static_assert(WIDE, "tails: wide mxfp8 tiles")
        tail_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, TAIL, SCALE_BLOCK])
        tail_zero = gl.zeros([WG_ROWS, TAIL], gl.float32, tail_layout)
        if SHORT_TAILS:  # tails of up to TAIL // 2 tokens on a half-width accumulator
            short_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                   instr_shape=[16, TAIL // 2, SCALE_BLOCK])
            short_zero = gl.zeros([WG_ROWS, TAIL // 2], gl.float32, short_layout)
    it = 0
    tile_base = 0
    tiles_done = 0
    next_tile = pid  # this program's next tile: the first index >= tile_base it owns
    # CHUNK_WALK (narrow tiles, config.Sm90Config.chunk_walk): the slot walk takes the slots'
    # offsets and expert ids from chunks of SLOT_CHUNK slots (sm90._slot_chunk) from slot
    # chunk_base on, reloaded from the current slot after each tile, so the vectors are not held
    # through its K loop and epilogue (on wide tiles they spilled there). Else three loads a slot.
    if CHUNK_WALK:
        chunk_base = 0
        offsets, experts = _slot_chunk(a_offsets_ptr, expert_ids_ptr, 0, G, 4)
    for g in range(G):
        if CHUNK_WALK:
            if g - chunk_base >= SLOT_CHUNK:
                chunk_base = g
                offsets, experts = _slot_chunk(a_offsets_ptr, expert_ids_ptr, g, G, 4)
            s, t, e, tok_tiles = _chunk_slot(offsets, experts, g - chunk_base, M, E, TOK_TILE, TAIL)
        else:
            s, t, e, tok_tiles = _slot(a_offsets_ptr, expert_ids_ptr, g, M, E, TOK_TILE, TAIL)
        group_tiles = tok_tiles * w_tiles
        while next_tile < tile_base + group_tiles:  # (sm90._load_partition says why not a for)
            tile = next_tile
            if not DYNAMIC:  # else the producer's choice (sm90's schedule), received after the tile
                next_tile += nprog
            tok_block, w_block = _band_coords(tile - tile_base, tok_tiles, w_tiles, GROUP_M)
            ns = w_block * W_TILE + w_offsets
            w_ok = ns < N
            if SWIZZLED:  # 32-bit words: one a row per stage (_weight_scale_words)
                w_scale_rows = b_scale_ptr + _scale_row_offsets(e, ns, N, NUM_KB, KB4, SWIZZLED) // 4
            else:
                w_scale_rows = b_scale_ptr + _scale_row_offsets(e, ns, N, NUM_KB, KB4, SWIZZLED)
            if TAIL > 0:
                if not _tail_of(tok_block, tok_tiles, s, t, TOK_TILE):
                    acc, it = _promote_chain_wide(w_bufs, t_bufs, s_bufs, ready, empty, zero, w_scale_rows, w_ok,
                                                  NUM_KB, KB4, it, k_steps, ROWS, STAGES, SWIZZLED, acc_layout)
                elif SHORT_TAILS and t - s - (tok_block + 1) * TOK_TILE <= TAIL // 2:
                    # (its own name: a tensor's type is fixed across the branches)
                    acc, short_acc, it = _promote_chain_wide(w_bufs, t_bufs, s_bufs, ready, empty, zero,
                                                             w_scale_rows, w_ok, NUM_KB, KB4, it, k_steps, ROWS, STAGES,
                                                             SWIZZLED, acc_layout, tail_bufs, tail_s_bufs, short_zero,
                                                             short_layout)
                    _tail_epilogue(short_acc, out_ptr, expert_scales_ptr, row_scales_ptr, epi, g, s, e,
                                   s + (tok_block + 1) * TOK_TILE, t, w_block * W_TILE + ROWS * WG_ROWS, N,
                                   HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI)
                else:
                    acc, tail_acc, it = _promote_chain_wide(w_bufs, t_bufs, s_bufs, ready, empty, zero, w_scale_rows,
                                                            w_ok, NUM_KB, KB4, it, k_steps, ROWS, STAGES, SWIZZLED,
                                                            acc_layout, tail_bufs, tail_s_bufs, tail_zero, tail_layout)
                    _tail_epilogue(tail_acc, out_ptr, expert_scales_ptr, row_scales_ptr, epi, g, s, e,
                                   s + (tok_block + 1) * TOK_TILE, t, w_block * W_TILE + ROWS * WG_ROWS, N,
                                   HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI)
            elif WIDE:
                acc, it = _promote_chain_wide(w_bufs, t_bufs, s_bufs, ready, empty, zero, w_scale_rows, w_ok,
                                          NUM_KB, KB4, it, k_steps, ROWS, STAGES, SWIZZLED, acc_layout)
            elif SPLIT_K:
                if ROWS == 1 and HALF_TILES:  # an expert's last tile may hold these rows past N
                    if w_block * W_TILE + WG_ROWS < N:
                        acc, it = _promote_chain_fp4_split(w_bufs, t_bufs, a_bufs.index(WG), s_bufs, ws_bufs, ready,
                                                           empty, zero, w_scale_rows, w_ok, K, NUM_KB, KB4, it,
                                                           k_steps, KH, ROWS, STAGES, SWIZZLED, acc_layout)
                    else:
                        acc = zero
                        it = _release_stages(ready, empty, it, k_steps, STAGES)
                else:
                    acc, it = _promote_chain_fp4_split(w_bufs, t_bufs, a_bufs.index(WG), s_bufs, ws_bufs, ready,
                                                       empty, zero, w_scale_rows, w_ok, K, NUM_KB, KB4, it, k_steps,
                                                       KH, ROWS, STAGES, SWIZZLED, acc_layout)
                # The two K halves take turns at receiving the other's sum and running the epilogue,
                # which would otherwise hold one pair back (the ring waits for all four).
                owner = (tiles_done + KH) % 2 == 0
                acc = _reduce_split_k(acc, red_bufs, red_ready, red_free, tiles_done, owner, ROWS, acc_layout)
                if ACC_FACTOR != 1.0:  # w4a8: the weights' 2^-6 (E2M1_WEIGHT_EXP), exact
                    acc = acc * ACC_FACTOR
            elif FP4W:
                acc, it = _promote_chain_fp4(w_bufs, t_bufs, a_bufs, s_bufs, ws_bufs, ready, empty, zero, w_scale_rows,
                                             w_ok, K, NUM_KB, KB4, it, k_steps, ROWS, STAGES, SWIZZLED, acc_layout,
                                             ACC_FACTOR)
            else:
                toks = s + tok_block * TOK_TILE + gl.arange(0, TOK_TILE, layout=gl.SliceLayout(0, acc_layout))
                t_scale_rows = t_scale_ptr + toks.to(gl.int64) * T_SCALE_STRIDE
                acc, it = _promote_chain(w_bufs, t_bufs, ready, empty, zero, w_scale_rows, w_ok, t_scale_rows,
                                         toks < t, NUM_KB, KB4, it, k_steps, ROWS, STAGES, SWIZZLED)
            if not SPLIT_K:
                owner = True
            if owner:  # (split-K: the warpgroup that received the other K half's sum)
                if EPI[0] != 0:  # the fused SwiGLU epilogue
                    fused_epilogue(acc, out_ptr, expert_scales_ptr, g, s, e, s + tok_block * TOK_TILE, t,
                                   w_block * W_TILE + ROWS * WG_ROWS, N, epi, True, HAS_EXPERT_SCALES, EPI,
                                   SHUFFLE_PAIRS=WIDE)
                else:
                    # (the tile's token offsets made here, not held through the K loop: they spilled)
                    toks = s + tok_block * TOK_TILE + gl.arange(0, TOK_TILE, layout=gl.SliceLayout(0, acc_layout))
                    _epilogue(acc, None, None, out_ptr, expert_scales_ptr, row_scales_ptr, e, toks, toks < t, ns, N,
                              s + tok_block * TOK_TILE, w_block * W_TILE + ROWS * WG_ROWS, t, True,
                              HAS_EXPERT_SCALES, HAS_ROW_SCALES, 0, 1, VECTOR_STORE)
            if CHUNK_WALK:
                chunk_base = g  # (the walk's next slots, see above)
                offsets, experts = _slot_chunk(a_offsets_ptr, expert_ids_ptr, g, G, 4)
            if DYNAMIC:
                next_tile = _receive_tile(tile_ids, id_ready, id_free, tiles_done)
            tiles_done += 1
        tile_base += group_tiles


@gluon.jit
def grouped_matmul_sm90_mxfp8_kernel(t_desc, w_desc, s_desc, ws_desc, w_half_desc, tail_desc, tail_s_desc, out_ptr,
                                     t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
                                     row_scales_ptr, tile_counter_ptr, claim_rounds, M, N, K, E, G, NUM_KB, KB4,
                                     T_SCALE_STRIDE, epi, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                                     SWIZZLED: gl.constexpr,
                                     HAS_EXPERT_SCALES: gl.constexpr, HAS_ROW_SCALES: gl.constexpr,
                                     CONSUMER_REGS: gl.constexpr, EPI: gl.constexpr, ACC_FACTOR: gl.constexpr,
                                     SPLIT_K: gl.constexpr = False, DYNAMIC: gl.constexpr = False,
                                     CHUNK_WALK: gl.constexpr = False, SHORT_TAILS: gl.constexpr = False):
    """See the module docstring. t_desc: e4m3 token tiles [TOK_TILE, 128] of A; w_desc: e4m3
    weight tiles [128, 128] of B viewed as [E*N, K] (one of each fills a ring stage), or packed
    e2m1 weight tiles [128, 128 bytes] of B viewed as [E*N, K/2] bytes (FP4W: a stage holds 256
    K, one weight tile and two token tiles). s_desc (wide tiles, TOK_TILE >= 64, and e2m1
    weights; else None): fp32 token-scale boxes [K blocks a stage, TOK_TILE] of the
    K-block-major copy, a third part of each stage (t_scale_ptr is then unused; else its rows
    are T_SCALE_STRIDE floats apart). ws_desc (e2m1 weights with swizzled scales; else None):
    the weight scales as [atoms * 32, 4] int32 (a 128x4 atom of e8m0 bytes is 32 x 4 words), a
    [64, 4] box (two atoms) a stage. SPLIT_K (e2m1 weights): four consumer warpgroups, two
    for each K half of a stage (module docstring); w_half_desc (split-K with N % 128 <= 64, else
    None): [64, 128 bytes] weight boxes, with which an expert's last tile loads only the rows it
    has and the warpgroups of the other 64 rows skip it. tail_desc, tail_s_desc (wide mxfp8
    tiles with tails, else None): [TAIL, 128] e4m3 token boxes and [4, TAIL] fp32 token-scale
    boxes: a slot's last tile takes up to TAIL tokens more (sm90._slot), computed by the same
    warpgroups on a third accumulator (_promote_chain_wide); SHORT_TAILS: tails of up to TAIL // 2
    tokens on one of half the width (config.Sm90Config.short_tails). DYNAMIC (not with SPLIT_K): the
    last claim_rounds * nprog tiles are claimed from tile_counter_ptr, an int32 that is zero at
    launch (sm90's schedule)."""
    HALF_TILES: gl.constexpr = w_half_desc is not None
    TOK_TILE: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = t_desc.block_type.shape[1]
    W_TILE: gl.constexpr = w_desc.block_type.shape[0]
    FP4W: gl.constexpr = w_desc.dtype == gl.uint8
    WIDE: gl.constexpr = s_desc is not None and not FP4W
    SUB: gl.constexpr = 2 if FP4W else 1  # token tiles a stage
    # Wide tiles read their token scales in accumulator order (_token_scale_row), e2m1 tiles as they are.
    S_COLUMN_BLOCK: gl.constexpr = ACC_ORDER_COLUMNS if WIDE else 4
    gl.static_assert(W_TILE == 2 * WG_ROWS, "two warpgroups of 64 weight rows")
    gl.static_assert(BLOCK_K == 4 * SCALE_BLOCK, "a token tile holds four scale blocks (_promote_chain)")
    gl.static_assert(not FP4W or (s_desc is not None and TOK_TILE <= 16),
                     "e2m1 weights: 8- or 16-token tiles, token scales in the ring")
    gl.static_assert(FP4W or not SPLIT_K, "split-K is the e2m1 weights' arrangement")
    gl.static_assert(SPLIT_K or not HALF_TILES, "half tiles are skipped by split-K's consumers")
    gl.static_assert(w_desc.block_type.shape[1] == BLOCK_K, "a weight row's 128 bytes a stage")
    t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES * SUB] + t_desc.block_type.shape, t_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    if s_desc is not None:
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    else:
        s_bufs = t_bufs  # unused (the producer loads no scales without s_desc)
    if ws_desc is not None:
        ws_bufs = gl.allocate_shared_memory(ws_desc.dtype, [STAGES] + ws_desc.block_type.shape, ws_desc.layout)
    else:
        ws_bufs = t_bufs  # unused
    if tail_desc is not None:
        TAIL: gl.constexpr = tail_desc.block_type.shape[0]
        tail_bufs = gl.allocate_shared_memory(tail_desc.dtype, [STAGES] + tail_desc.block_type.shape, tail_desc.layout)
        tail_s_bufs = gl.allocate_shared_memory(tail_s_desc.dtype, [STAGES] + tail_s_desc.block_type.shape,
                                                tail_s_desc.layout)
    else:
        TAIL: gl.constexpr = 0
        tail_bufs = t_bufs  # unused
        tail_s_bufs = t_bufs
    # Decoded e4m3 [64, 128] operand buffers, stored as uint16 pairs: two a consumer warpgroup
    # (both K halves of a stage), or with split-K one for each of the four.
    if FP4W:
        a_bufs = gl.allocate_shared_memory(gl.uint16, [4, WG_ROWS, 64],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    else:
        a_bufs = t_bufs  # unused
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=4 if SPLIT_K else 2)
    if SPLIT_K:  # the K-half-1 warpgroups' partial sums, one [64, TOK_TILE] fp32 buffer per row block
        red_bufs = gl.allocate_shared_memory(gl.float32, [2, WG_ROWS, TOK_TILE],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        red_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        red_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(red_ready.index(i), count=1)
            mbarrier.init(red_free.index(i), count=1)
    else:
        red_bufs = t_bufs  # unused
        red_ready = ready
        red_free = ready
    gl.static_assert(not (DYNAMIC and SPLIT_K), "split-K tiles are dealt round-robin")
    tile_ids, id_ready, id_free = _tile_id_buffers(2)  # (40 bytes; used when DYNAMIC)
    if SPLIT_K:
        # Four consumer warpgroups and the producer: 4 * CONSUMER_REGS + producer <= 512 (64K
        # registers over five warpgroups); ptxas keeps the wgmmas in flight only if the smallest
        # setmaxnreg leaves the loop its registers (sm90_mx.py), so the producer gets the rest.
        gl.warp_specialize([
            (_mxfp8_consumer_partition, (t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, ready, empty, red_ready,
                                         red_free, out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                         expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4,
                                         T_SCALE_STRIDE, epi, 0, TOK_TILE, W_TILE, SUB * BLOCK_K, STAGES, GROUP_M,
                                         SWIZZLED, HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI, WIDE, FP4W, SPLIT_K,
                                         HALF_TILES, ACC_FACTOR, tail_bufs, tail_s_bufs, TAIL, tile_ids, id_ready,
                                         id_free, DYNAMIC, CHUNK_WALK, SHORT_TAILS)),
            (_mxfp8_consumer_partition, (t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, ready, empty, red_ready,
                                         red_free, out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                         expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4,
                                         T_SCALE_STRIDE, epi, 1, TOK_TILE, W_TILE, SUB * BLOCK_K, STAGES, GROUP_M,
                                         SWIZZLED, HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI, WIDE, FP4W, SPLIT_K,
                                         HALF_TILES, ACC_FACTOR, tail_bufs, tail_s_bufs, TAIL, tile_ids, id_ready,
                                         id_free, DYNAMIC, CHUNK_WALK, SHORT_TAILS)),
            (_mxfp8_consumer_partition, (t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, ready, empty, red_ready,
                                         red_free, out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                         expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4,
                                         T_SCALE_STRIDE, epi, 2, TOK_TILE, W_TILE, SUB * BLOCK_K, STAGES, GROUP_M,
                                         SWIZZLED, HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI, WIDE, FP4W, SPLIT_K,
                                         HALF_TILES, ACC_FACTOR, tail_bufs, tail_s_bufs, TAIL, tile_ids, id_ready,
                                         id_free, DYNAMIC, CHUNK_WALK, SHORT_TAILS)),
            (_mxfp8_consumer_partition, (t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, ready, empty, red_ready,
                                         red_free, out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                         expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4,
                                         T_SCALE_STRIDE, epi, 3, TOK_TILE, W_TILE, SUB * BLOCK_K, STAGES, GROUP_M,
                                         SWIZZLED, HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI, WIDE, FP4W, SPLIT_K,
                                         HALF_TILES, ACC_FACTOR, tail_bufs, tail_s_bufs, TAIL, tile_ids, id_ready,
                                         id_free, DYNAMIC, CHUNK_WALK, SHORT_TAILS)),
            (_load_partition, (t_desc, w_desc, t_bufs, w_bufs, ready, empty, a_offsets_ptr, expert_ids_ptr,
                               M, N, K, E, G, TOK_TILE, W_TILE, BLOCK_K, STAGES, GROUP_M, SUB, s_desc, s_bufs, ws_desc,
                               ws_bufs, KB4, w_half_desc)),
        ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, 512 - 4 * CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_mxfp8_consumer_partition, (t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, ready, empty, red_ready,
                                         red_free, out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                         expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4,
                                         T_SCALE_STRIDE, epi, 0, TOK_TILE, W_TILE, SUB * BLOCK_K, STAGES, GROUP_M,
                                         SWIZZLED, HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI, WIDE, FP4W, SPLIT_K,
                                         HALF_TILES, ACC_FACTOR, tail_bufs, tail_s_bufs, TAIL, tile_ids, id_ready,
                                         id_free, DYNAMIC, CHUNK_WALK, SHORT_TAILS)),
            (_mxfp8_consumer_partition, (t_bufs, w_bufs, s_bufs, a_bufs, ws_bufs, red_bufs, ready, empty, red_ready,
                                         red_free, out_ptr, t_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                         expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4,
                                         T_SCALE_STRIDE, epi, 1, TOK_TILE, W_TILE, SUB * BLOCK_K, STAGES, GROUP_M,
                                         SWIZZLED, HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI, WIDE, FP4W, SPLIT_K,
                                         HALF_TILES, ACC_FACTOR, tail_bufs, tail_s_bufs, TAIL, tile_ids, id_ready,
                                         id_free, DYNAMIC, CHUNK_WALK, SHORT_TAILS)),
            (_load_partition, (t_desc, w_desc, t_bufs, w_bufs, ready, empty, a_offsets_ptr, expert_ids_ptr,
                               M, N, K, E, G, TOK_TILE, W_TILE, BLOCK_K, STAGES, GROUP_M, SUB, s_desc, s_bufs, ws_desc,
                               ws_bufs, KB4, None, tail_desc, tail_bufs, tail_s_desc, tail_s_bufs, S_COLUMN_BLOCK,
                               tile_counter_ptr, claim_rounds, tile_ids, id_ready, id_free, DYNAMIC)),
        # Producer registers: what the consumers leave of 504 a thread (64K registers; 120 with
        # 192 a consumer keeps the narrow tiles' two wgmmas in flight, sm90_mx.py says why); the
        # wide tiles need 232 a consumer thread (192 spilled), 240 with a tail (232 spilled a
        # few values in its K loop), leaving the producer 40 or 24.
        ], [4, 1], [CONSUMER_REGS, 504 - 2 * CONSUMER_REGS])


@functools.lru_cache(maxsize=None)
def _unswizzled_32bit_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def launch(p: GroupedProblem, cfg, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets, expert_scales,
           row_scales, out, epilogue: dict | None = None, tokens=None):
    """Decode the token scales to fp32 (pre-pass; e2m1 tokens are also re-encoded as e4m3), then
    launch into `out` with the config sm90_mx.launch chose (cfg.fp8_mma); no device value is
    read. `tokens` (token_forms.KernelTokens, checked by sm90_mx.launch): the pre-pass's
    output, written by the kernel that made the tokens."""
    swizzled = p.scale_layout == "swizzled"
    wide = cfg.wide_promotion
    fp4_weights = p.fmt.b.element.packed
    staged = wide or fp4_weights  # token scales through the ring
    acc_factor = 1.0
    if fp4_weights and not p.fmt.a.element.packed:  # w4a8 (see E2M1_WEIGHT_EXP)
        acc_factor = float(2**E2M1_WEIGHT_EXP)
    if tokens is not None:
        token_scales, a = tokens.scales, tokens.data
    elif p.fmt.a.element.packed:  # mxfp4 tokens: every e2m1 value times 2^6 is an e4m3 value (one launch)
        token_scales, a = portable.token_prepass(p, a, a_scales, a_offsets, expert_ids, a_scale_offsets,
                                                 pad_stages=not staged, kb_major=staged,
                                                 stage_blocks=cfg.stage_k // 32, exponent=E2M1_WEIGHT_EXP,
                                                 even_odd=True)
    else:
        token_scales = portable.decode_row_scales(p, a_scales, a_offsets, expert_ids, a_scale_offsets,
                                                  pad_stages=not staged, kb_major=staged,
                                                  stage_blocks=cfg.stage_k // 32,
                                                  column_block=ACC_ORDER_BLOCK if wide and not fp4_weights else 4)
    if fp4_weights and not p.fmt.a.element.packed and tokens is None:  # w4a8's tokens meet the decoded weights
        a = portable.even_odd_k(a)
    s_desc = ws_desc = None
    if staged:  # a [K blocks, TOK_TILE] box of the K-block-major scales per stage; unswizzled rows
        s_block = [cfg.stage_k // 32, cfg.token_tile]
        s_desc = TensorDescriptor.from_tensor(token_scales, s_block, _unswizzled_32bit_layout())
    upper_tiles = (math.ceil(p.m / cfg.token_tile) + p.num_groups) * math.ceil(p.n / cfg.weight_tile)
    num_programs = min(_sm_count(out.device), upper_tiles)
    counter = tile_counter(cfg, upper_tiles, num_programs, out.device)
    t_block = (cfg.token_tile, cfg.block_k)
    t_desc = TensorDescriptor.from_tensor(a, list(t_block), _layout(t_block, a.dtype))
    # 128 bytes of each weight row a stage: 128 e4m3, or 256 packed e2m1 (two token tiles).
    weights = b.view(torch.uint8) if fp4_weights else b
    w_block = (cfg.weight_tile, cfg.block_k)
    w_desc = TensorDescriptor.from_tensor(weights.reshape(p.num_experts * p.n, weights.shape[-1]), list(w_block),
                                          _layout(w_block, weights.dtype))
    # Swizzled weight scales are read a 32-bit word (a row's four K blocks) at a time.
    weight_scales = b_scales.view(torch.uint8)
    if swizzled:
        weight_scales = weight_scales.view(torch.int32)
        if fp4_weights:  # the stage's two atoms of the tile's 128 rows, [32, 4] words each
            ws_desc = TensorDescriptor.from_tensor(weight_scales.reshape(-1, 4), [cfg.stage_k // 128 * 32, 4],
                                                   _unswizzled_32bit_layout())
    w_half_desc = None
    if cfg.split_k and 0 < p.n % cfg.weight_tile <= cfg.weight_tile // 2:  # (gpt-oss down: 2880 = 22.5 x 128)
        half = (cfg.weight_tile // 2, cfg.block_k)
        w_half_desc = TensorDescriptor.from_tensor(weights.reshape(p.num_experts * p.n, weights.shape[-1]),
                                                   list(half), _layout(half, weights.dtype))
    tail_desc = tail_s_desc = None
    if cfg.tail_tokens:  # a slot's last tile: up to tail_tokens more tokens and their scales a stage
        tail_block = (cfg.tail_tokens, cfg.block_k)
        tail_desc = TensorDescriptor.from_tensor(a, list(tail_block), _layout(tail_block, a.dtype))
        tail_s_desc = TensorDescriptor.from_tensor(token_scales, [cfg.stage_k // 32, cfg.tail_tokens],
                                                   _unswizzled_32bit_layout())
    num_kb = p.num_k_scales
    dummy = a_offsets
    epi, epi_consts = epilogue_args(epilogue, dummy)
    grouped_matmul_sm90_mxfp8_kernel[(num_programs, )](
        t_desc, w_desc, s_desc, ws_desc, w_half_desc, tail_desc, tail_s_desc, out, token_scales, weight_scales,
        a_offsets, expert_ids, expert_scales if expert_scales is not None else dummy,
        row_scales if row_scales is not None else dummy, counter if counter is not None else dummy, cfg.claim_rounds,
        p.m, p.n, p.k, p.num_experts, p.num_groups, num_kb, math.ceil(num_kb / 4),
        0 if staged else token_scales.shape[1], epi,
        EPI=epi_consts, STAGES=cfg.stages, GROUP_M=cfg.group_m, SWIZZLED=swizzled,
        HAS_EXPERT_SCALES=expert_scales is not None, HAS_ROW_SCALES=row_scales is not None,
        CONSUMER_REGS=cfg.consumer_regs, ACC_FACTOR=acc_factor, SPLIT_K=cfg.split_k,
        DYNAMIC=counter is not None, CHUNK_WALK=cfg.chunk_walk,
        SHORT_TAILS=cfg.short_tails, num_warps=4,
    )
    return out
