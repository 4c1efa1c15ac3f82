"""fp8 wgmma with fp32 promotion per 32-wide K block: the parts mxfp8.py and e2m1.py share.

A k32 fp8 wgmma covers exactly one e8m0 scale block, so a tile's sum is built as
acc += part * (weight scale outer token scale) per block. The weight scales are read as one
32-bit word per row and stage (four K blocks, byte j = block 4kk + j): swizzled scales hold a
row's four in one word of a 128x4 atom, plain ones are four byte loads.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SCALE_BLOCK = gl.constexpr(32)  # K elements per e8m0 scale, and the K of one fp8 wgmma


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
def _promote_rows(acc, part, sw, st_row):
    """_promote with the token scales as a [1, TOK_TILE] row of the accumulator's layout."""
    return acc + part * (gl.expand_dims(sw, 1) * st_row)


@gluon.jit
def _block_operands(w_stage, t_stage, j: gl.constexpr):
    """k32 block j of a stage: the weight rows [64, 32] and the tokens^T [32, TOK_TILE]."""
    return (w_stage.slice(j * SCALE_BLOCK, SCALE_BLOCK, dim=1),
            t_stage.slice(j * SCALE_BLOCK, SCALE_BLOCK, dim=1).permute((1, 0)))
