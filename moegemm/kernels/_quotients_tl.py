"""Quotients of the row quantizer (_activation_tl.py), in portable Triton (tl): an element or a
block amax divided by its block's denominator as the reference quantizer divides (IEEE
round-to-nearest, moegemm/quantize.py), in fewer instructions where the hardware allows.

The compiled build runs div.rn's own fast path (a reciprocal, two FMAs) with the reciprocal once
a block, and with no slow-path subroutine (a CALL across which ptxas keeps every live value); each
function's docstring says on which operands that is exactly RN(a / d) and why the others cannot
reach it. The interpreter has neither the hardware reciprocal nor fused multiply-adds: it
divides. nvfp4's |y| and bf16 halves go through inline PTX in the compiled build, which holds
fewer registers (LLVM otherwise keeps the loaded words live beside the values).

Executed twice like the files that load it (kernels/tl_source.py: load_beside).
"""

import triton
import triton.language as tl

from moegemm.kernels import tl_source

codecs = tl_source.load_beside(__file__, "_codecs_tl.py")  # (f32_from_bits)


@triton.jit
def _magnitudes_divided(y, denom):
    """RN(|y| / denom) of y [BM, NB, VEC] by its block's denom [BM, NB] where denom > 0, else +0
    (the reference quantizer's torch.where(denom > 0, blocks / denom, 0), less the sign): a
    division an element."""
    d = denom[:, :, None]
    return tl.where(d > 0, tl.math.div_rn(tl.abs(y), tl.where(d > 0, d, 1.0)), 0.0)


@triton.jit
def _abs_modifier(x):
    """|x| as PTX's abs.f32, which ptxas folds into the instructions that read it (FMNMX, FMUL,
    FFMA take |R| operands); Triton's |x| is an AND of the bits, an instruction and a register
    an element."""
    return tl.inline_asm_elementwise("abs.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _abs_plain(x):
    return tl.abs(x)


@triton.jit
def _bf16_halves_opaque(words):
    """The bf16 values in the low and high halves of int32 words, in fp32 (shifts and masks of
    the bits), out of the compiler's sight: LLVM would take a value's sign bit and magnitude
    from the word instead, keeping the words live beside the values (16 registers more)."""
    low = tl.inline_asm_elementwise("{ .reg .b32 t; shl.b32 t, $1, 16; mov.b32 $0, t; }", "=f,r", [words],
                                    dtype=tl.float32, is_pure=True, pack=1)
    high = tl.inline_asm_elementwise("{ .reg .b32 t; and.b32 t, $1, 0xFFFF0000; mov.b32 $0, t; }", "=f,r",
                                     [words], dtype=tl.float32, is_pure=True, pack=1)
    return low, high


@triton.jit
def bf16_halves_plain(words):
    return codecs.f32_from_bits(words << 16), codecs.f32_from_bits(words & -65536)


@triton.jit
def _reciprocal_approx(d):
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _reciprocal(d):
    """div.rn.f32's reciprocal of d: ptxas compiles div.rn.f32 a / d (sm_90) to r0 = MUFU.RCP(d),
    r = fma(r0, fma(-d, r0, 1), r0), then _quotient_steps, taken where FCHK(a, d) passes; else
    a subroutine that runs the same steps on a and d brought to [1, 2) and puts the exponents
    back (bench/quantize_sass.py counts the kernels without it)."""
    r0 = _reciprocal_approx(d)
    return tl.fma(r0, tl.fma(-d, r0, 1.0), r0)


@triton.jit
def _quotient_steps(a, d, r):
    """div.rn.f32's fast path of a / d given r = _reciprocal(d): q0 = a * r, then one correction
    q0 + r * (a - d * q0) (two FMAs). Bit for bit RN(a / d) where d, r and every step's result
    are normal numbers (or exact zeros) and a >= 2^-102 or a = 0: each step rounds as the same
    step on a * 2^-ea and d * 2^-ed in [1, 2) does, its result scaled by a power of two
    (MUFU.RCP takes its exponent off d's, as a table on the significand does), and such
    operands take div.rn's fast path; a >= 2^-102 keeps the remainder a - d * q0 (a multiple of
    2^(ea - 47), q0 within an ulp of a / d) exact below 2^-126 too."""
    q0 = a * r
    return tl.fma(r, tl.fma(-d, q0, a), q0)


@triton.jit
def _magnitudes_fast(y, denom):
    """_magnitudes_divided with the reciprocal once a block, for fp8_block's denom = amax / 448:
    _quotient_steps on (|y| * f, denom * f), f = 2^64 where denom < 2^-64, else 1, which leaves
    the quotients as they are. denom <= 2^128 / 448 keeps r normal, and f brings a tiny denom (a
    subnormal's reciprocal overflows) to >= 2^-85, its elements (<= 448 * denom) staying
    finite. A quotient the e4m3 encoder can tell from zero (>= 2^-11: its smallest nonzero is
    2^-9) then has a >= 2^-96 and normal steps, so it is RN(|y| / denom); smaller ones stay
    below 2^-10 (each step within a few ulps or 2^-149 of exact)."""
    f = tl.where(denom < 5.421010862427522e-20, 18446744073709551616.0, 1.0)  # (2^-64, 2^64)
    # A denom that is not > 0 (an all-zero block's) quotients +0 as the reference's where does:
    # d = 1 and r = 0 there, so that no NaN reaches the steps.
    d = tl.where(denom > 0, denom * f, 1.0)
    r = tl.where(denom > 0, _reciprocal(d), 0.0)
    return _quotient_steps(tl.abs(y) * f[:, :, None], d[:, :, None], r[:, :, None])


# The least nonzero |global| nvfp4 quantizes as it is (below it e2m1_rescale's 2^64): 2^-90, whose
# denominators, a nonzero e4m3 scale (>= 2^-9) times it, are >= 2^-99 (_magnitudes_e2m1).
E2M1_STEPS_MIN_GLOBAL = tl.constexpr(8.077935669463161e-28)


@triton.jit
def _magnitudes_e2m1(y, denom):
    """_magnitudes_divided as e2m1_magnitude sees it, with the reciprocal once a block, for
    nvfp4's denom = s * g (s its e4m3 scale decoded, s g >= 0) with |g| >= 2^-90, or s g 2^64 and
    y 2^64 below (e2m1_rescale): _quotient_steps on (|y|, denom), which differ only where both
    are code 7 (NaN for a quotient that overflows). e2m1 gives code 0 to every quotient up to
    0.25; from 2^-3 up |y| >= 2^-3 denom >= 2^-102 (a nonzero s is >= 2^-9, so denom >= 2^-99;
    rescaled >= 2^-85) and below an overflow every step is normal, so the steps are exact there;
    smaller quotients stay below 0.25 (each step within a few ulps or 2^-149 of exact). r is
    normal: rescaled denom < 2^-17; else for a finite block amax denom < 2^126, as |s| is at most
    amax / (6 |g|) rounded up by e4m3 (1 + 2^-4, or 2x for a subnormal s, which needs |g| > amax
    * 2^6 / 6: amax < 2^125 there), or 448 < amax / (6 |g|) where it saturates. A block of
    infinite amax has unspecified elements (docs/contract.md section 3); denom = 0 or NaN
    quotients +0 (finite elements) as the reference's where."""
    ok = denom > 0
    d = tl.where(ok, denom, 1.0)
    r = tl.where(ok, _reciprocal(d), 0.0)
    return _quotient_steps(_abs_modifier(y), d[:, :, None], r[:, :, None])


@triton.jit
def _scale_quotient_divided(amax, d):
    return tl.math.div_rn(amax, d)


@triton.jit
def _scale_quotient_steps(amax, d):
    """RN(amax / d) as e4m3 sees it (nvfp4's block scale before its rounding, d = g * 6, or both
    times 2^64 where 0 < |g| < 2^-90: |d| >= 6 * 2^-90 but for 0) with no division's slow path, a
    subroutine CALL across which ptxas keeps every live value (+25 registers): _quotient_steps
    on (amax f, d f), f = 2^-64 where |d| > 2^64 (r normal), else 1. Quotients from 2^-11 up
    (e4m3's least nonzero is 2^-9) are exact, amax f then exact and >= 2^-99; smaller ones stay
    below 2^-10. A q0 = a r from 2^100 up (an infinite amax, d = 0, a quotient past fp32's range)
    is taken as it is, which e4m3 saturates as the exact quotient (the steps would make NaN of
    inf). d = +-0: r = +-inf (q0 +-inf, NaN for amax 0); d = +-inf: r = +-0 and d taken as 0 in
    the steps (+-0, NaN for an infinite amax): the exact quotients with their signs."""
    f = tl.where(tl.abs(d) > 18446744073709551616.0, 5.421010862427522e-20, 1.0)  # (2^64, 2^-64)
    d = d * f
    infinite = tl.abs(d) == float("inf")
    r = tl.where((d == 0) | infinite, _reciprocal_approx(d), _reciprocal(d))
    d = tl.where(infinite, 0.0, d)
    a = amax * f
    q0 = a * r
    return tl.where(tl.abs(q0) < 1.2676506002282294e30, _quotient_steps(a, d, r), q0)  # (2^100)


@triton.jit
def e2m1_rescale(g):
    """nvfp4's factor for the elements and denominators under global g: 2^64 where 0 < |g| < 2^-90
    (E2M1_STEPS_MIN_GLOBAL; subnormals included), whose scales times g can be subnormal (their
    reciprocals overflow) and elements tiny, else 1 (NaN too). Exact: a denominator s g times
    2^64 is >= 2^-85 (but for 0) and < 2^-17; an element that overflows has a quotient e2m1
    saturates anyway. g = +-0 keeps 1: every denominator is then 0 (or NaN), whose quotients are
    +0 only for finite elements, and a finite element times 2^64 could overflow."""
    rescaled = (tl.abs(g) < E2M1_STEPS_MIN_GLOBAL) & (g != 0)
    return tl.where(rescaled, 18446744073709551616.0, 1.0)  # (2^64)


# The interpreter has neither the hardware reciprocal nor fused multiply-adds: it divides.
magnitudes = _magnitudes_divided if tl_source.interpreted() else _magnitudes_fast
magnitudes_e2m1 = _magnitudes_divided if tl_source.interpreted() else _magnitudes_e2m1
scale_quotient = _scale_quotient_divided if tl_source.interpreted() else _scale_quotient_steps
# (inline PTX the interpreter cannot run)
abs_modifier = _abs_plain if tl_source.interpreted() else _abs_modifier
bf16_halves = bf16_halves_plain if tl_source.interpreted() else _bf16_halves_opaque
