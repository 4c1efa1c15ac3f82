"""Prepacked e2m1 words decoded in registers (the decoding kernel's register path, decode.py):
a 32-bit word of 8 elements, interleaved by moegemm.prepack, to four bf16 pairs by rotations
and masks in inline PTX, and bf16 pairs times their block scales."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...prepack import E2M1_WORD_TERMS


def e2m1_to_bf16_ptx(unbiased: bool) -> str:
    """PTX of one prepacked e2m1 word ($4, bits interleaved by moegemm.prepack) to the bf16 pairs
    of its four bytes ($0..$3, the low nibble in the low half): per pair the OR of its
    E2M1_WORD_TERMS (a rotation, a mask), whose bf16 value is the elements times 2^-126, then,
    `unbiased`, one bf16x2 multiply by 2^126 (exact; 0.5 comes through the subnormal 2^-127)."""
    lines = ["{", ".reg .b32 t, u, bias;", "mov.b32 bias, 0x7E807E80;"]  # 2^126 in both halves
    for pair, terms in enumerate(E2M1_WORD_TERMS):
        for i, (rotation, mask) in enumerate(terms):
            reg = "t" if i == 0 else "u"
            source = "$4"
            if rotation:
                lines.append(f"shf.l.wrap.b32 {reg}, $4, $4, {rotation};")
                source = reg
            lines.append(f"and.b32 {reg}, {source}, {mask:#010x};")
            if i:
                lines.append("or.b32 t, t, u;")
        lines.append(f"mul.rn.bf16x2 ${pair}, t, bias;" if unbiased else f"mov.b32 ${pair}, t;")
    return "\n".join(lines + ["}"])


_E2M1_TO_BF16_PTX = gl.constexpr(e2m1_to_bf16_ptx(True))
_E2M1_TO_BF16_BIASED_PTX = gl.constexpr(e2m1_to_bf16_ptx(False))


@gluon.jit
def e2m1_words_to_pairs(raw, BIASED: gl.constexpr):
    """Prepacked e2m1 bytes [R, C] (uint8, whole 32-bit words a thread) to int32 [R, C]: byte
    j's two elements as a bf16 pair (the low nibble in the low half), 9 integer instructions
    and 4 multiplies a word of 8 elements (gl.fp4_to_fp's table lookups took ~40); BIASED: times
    2^-126, without the multiplies (the caller's scales hold the 2^126)."""
    if BIASED:
        return gl.inline_asm_elementwise(_E2M1_TO_BF16_BIASED_PTX, "=r,=r,=r,=r,r", [raw], dtype=gl.int32,
                                         is_pure=True, pack=4)
    return gl.inline_asm_elementwise(_E2M1_TO_BF16_PTX, "=r,=r,=r,=r,r", [raw], dtype=gl.int32, is_pure=True,
                                     pack=4)


@gluon.jit
def scaled_pairs(pairs, scales):
    """bf16 pairs (int32) times their block scales (bf16, one for both halves): one bf16x2
    multiply a pair on the scale's register half (scalar bf16 multiplies were paired by ptxas
    with a swap of the halves before and after each)."""
    scales, pairs = gl.broadcast(scales, pairs)
    return gl.inline_asm_elementwise("{.reg .b32 s; mov.b32 s, {$2, $2}; mul.rn.bf16x2 $0, $1, s;}", "=r,r,h",
                                     [pairs, scales], dtype=gl.int32, is_pure=True, pack=1)
