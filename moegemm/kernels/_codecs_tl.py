"""Element and scale codecs of the portable Triton (tl) kernels: e2m1, e4m3 and e8m0 from and to
fp32, and fp32 -> bf16, on integer bits.

_portable_tl.py and _activation_tl.py call these. A @triton.jit function calls only functions
built for its own mode (compiled or interpreted), so they load this file with
tl_source.load_beside, which builds it for the mode they are being built for; and like them it
calls no @triton.jit function of Triton's standard library, only builtins. Integer bits give the
interpreter and the GPU the same results, the bytes of moegemm.codecs (docs/contract.md section 3).
encode_e4m3 and decode_e4m3_nan are sm_90's conversions in the compiled build (the same results,
one instruction for two values) and the integer codecs in the interpreted one, whose fp8 casts
round differently.
"""

import triton
import triton.language as tl

from moegemm.kernels import tl_source


@triton.jit
def f32_from_bits(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2(e):
    """2^e as fp32 for integer e in [-127, 127] (2^-127 is a subnormal)."""
    return f32_from_bits(tl.where(e >= -126, (e + 127) << 23, 0x00400000))


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, in integer arithmetic.

    The interpreter's fp32->bf16 cast truncates; doing it by hand gives one rounding on both
    the GPU and the CPU. NaN stays a quiet NaN; overflow rounds to inf as the hardware does.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _decode_magnitude(mag, MAN_BITS: tl.constexpr, EXP_OFFSET: tl.constexpr, SUBNORMAL_UNIT: tl.constexpr,
                      NAN_CODE: tl.constexpr):
    """The fp32 value of a float magnitude code (int32): exponent field exp = mag >> MAN_BITS,
    mantissa man; normal numbers 2^(exp + EXP_OFFSET - 127) * (1 + man / 2^MAN_BITS) built as fp32
    bits, subnormals (exp = 0) man * SUBNORMAL_UNIT; mag == NAN_CODE is NaN (0: no NaN code)."""
    exp = mag >> MAN_BITS
    man = mag & ((1 << MAN_BITS) - 1)
    normal = f32_from_bits(((exp + EXP_OFFSET) << 23) | (man << (23 - MAN_BITS)))
    val = tl.where(exp == 0, man.to(tl.float32) * SUBNORMAL_UNIT, normal)
    if NAN_CODE:
        val = tl.where(mag == NAN_CODE, f32_from_bits(tl.full(val.shape, 0x7FC00000, tl.int32)), val)
    return val


# The two decoders test the sign bit in different forms, equal on their codes: the other form
# in either changes the sm_90 code of the kernels that call it.


@triton.jit
def decode_e2m1(code):
    """e2m1 code (int32, 0..15) -> fp32."""
    val = _decode_magnitude(code & 7, 1, 126, 0.5, 0)
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def decode_e4m3(code, NAN: tl.constexpr):
    """e4m3fn bits (int32, 0..255) -> fp32; subnormals are man * 2^-9. NAN: 0x7F and 0xFF are
    NaN, as in e4m3fn; without, they read as +-480 (their bits as a normal number)."""
    val = _decode_magnitude(code & 0x7F, 3, 120, 0.001953125, 0x7F if NAN else 0)
    return tl.where(code >= 0x80, -val, val)


@triton.jit
def decode_e8m0(byte):
    """uint8 e8m0 -> fp32 2^(b-127); 0 -> 2^-127 (an fp32 subnormal), 0xFF -> NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return f32_from_bits(bits)


@triton.jit
def _encode_e4m3_bits(x):
    """encode_e4m3 in integer and fp32 arithmetic (the interpreter's: its fp8 cast rounds ties away)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = tl.abs(x)
    # Normal range: keep 3 mantissa bits of the fp32 pattern, rounding the 20 dropped bits.
    mbits = bits & 0x7FFFFFFF
    normal = ((mbits + 0x7FFFF + ((mbits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals (|x| < 2^-6): man * 2^-9, man rounded to nearest even by the 2^23 trick.
    # (from the subnormal lanes only: an inf or NaN would not convert to int32)
    sub = ((tl.where(mag < 0.015625, mag, 0.0) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < 0.015625, sub, normal)
    code = tl.minimum(code, 0x7E)
    code = tl.where(x != x, 0x7F, code)
    return code | sign


@triton.jit
def _encode_e4m3_cvt(x):
    """encode_e4m3 by the hardware: sm_90's cvt.rn.satfinite.e4m3x2.f32 (Triton's fp32 -> fp8e4nv
    cast, two values an instruction), the same rounding and saturation (+-inf -> +-448); NaN ->
    0x7F or 0xFF."""
    return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


# fp32 -> e4m3fn bits (int32): round to nearest even, saturating to +-448 (infinities too), NaN ->
# 0x7F with the sign bit of the NaN's (either, compiled). One instruction a pair compiled; ~13 an
# element in software.
encode_e4m3 = _encode_e4m3_bits if tl_source.interpreted() else _encode_e4m3_cvt


@triton.jit
def _decode_e4m3_cvt(code):
    """decode_e4m3(code, True) by the hardware (sm_90's e4m3x2 -> f16x2 conversion, exact)."""
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _decode_e4m3_bits(code):
    return decode_e4m3(code, True)


# e4m3fn bits (int32, 0..255) -> fp32, 0x7F and 0xFF NaN: two values an instruction compiled.
decode_e4m3_nan = _decode_e4m3_bits if tl_source.interpreted() else _decode_e4m3_cvt


@triton.jit
def e2m1_magnitude(mag):
    """fp32 magnitude (>= 0) -> e2m1 code (int32 0..7): nearest, ties to the even code, saturating
    at 6 (inf too; NaN gives 7). On the bits: from 1 up (codes 2..7, 2^E * (1 + m/2) is code
    2E + 2 + m) the fp32 pattern rounded to one mantissa bit, nearest even, less 1.0's; below 1
    (codes 0..2, multiples of 0.5) mag + 2^22, whose ulp is 0.5, rounds it to nearest even."""
    bits = mag.to(tl.int32, bitcast=True)
    # (bits + 0x1FFFFF + mantissa bit 22) >> 22 is the rounded pattern; 1.0 (0x3F800000) -> 2
    normal = (bits + (0x1FFFFF - 0x3F000000) + ((bits >> 22) & 1)) >> 22
    small = (mag + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
    return tl.where(bits < 0x3F800000, small, tl.minimum(normal, 7))


@triton.jit
def encode_e2m1(x):
    """fp32 -> e2m1 code (int32 0..15): nearest, ties to the even code, saturating at 6 (infinities
    too; NaN gives 7 or 15), the sign from the sign bit."""
    return e2m1_magnitude(tl.abs(x)) | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e2m1_code_to_e4m3(code, EXP: tl.constexpr):
    """The e4m3 byte of an e2m1 value times 2^EXP (0 <= EXP <= 6: exact, below 448): magnitude
    codes 0..7 -> 0, then 0.5 * 2^EXP (0x30 + 8 * EXP), then 4 more a code."""
    mag = code & 7
    base = 0x30 + 8 * EXP
    byte = tl.where(mag == 0, 0, tl.where(mag == 1, base, base + 4 * mag))
    return byte | ((code & 8) << 4)


@triton.jit
def e8m0_exponent(amax, MAX_FINITE: tl.constexpr):
    """The smallest e with 2^e * MAX_FINITE >= amax, clamped to [-127, 127], from amax's bits.

    MAX_FINITE = mf * 2^F with mf = 1.75, F = 8 (448) or mf = 1.5, F = 2 (6). For amax = m * 2^E
    (m in [1, 2)), m / mf is in (1/2, 2/mf): e = E - F, plus one where m > mf (mantissa bits
    above mf's). Subnormal and zero amax land below -127 (clamped); inf and NaN give 127 (the
    callers store the NaN scale 255 for both). Integer operations only: a quotient's division
    and two corrections cost ~30 instructions a value in the fused epilogue (its Gluon twin).
    """
    bits = amax.to(tl.int32, bitcast=True)
    field = (bits >> 23) & 0xFF
    if MAX_FINITE == 448.0:
        e = field - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    else:
        tl.static_assert(MAX_FINITE == 6.0, "e8m0 exponents for e4m3 (448) or e2m1 (6)")
        e = field - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    return tl.where(field == 255, 127, tl.maximum(tl.minimum(e, 127), -127))
