"""Exhaustive bitwise tests of every element and scale codec against independent oracles
(Python floats and fractions, brute-force nearest-even search over the code tables)."""

import bisect
import math
import struct
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from moegemm import codecs
from moegemm.kernels import portable, quantize_kernels, tl_source


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def next_up(x: float) -> float:
    return math.nextafter(f32(x), math.inf)


def next_down(x: float) -> float:
    return math.nextafter(f32(x), -math.inf)


def nearest_even(value: float, table: list[tuple[int, float]], max_finite: float) -> int:
    """The code of the nearest table value (exact rational distances); ties go to the even
    code; saturate. `table` is (code, magnitude) in increasing order."""
    v = Fraction(min(abs(value), max_finite))
    upper = bisect.bisect_left([m for _, m in table], v)
    candidates = table[max(0, upper - 1):upper + 1]
    best = min(candidates, key=lambda cv: (abs(Fraction(cv[1]) - v), cv[0] & 1))
    return best[0]


# ---- e2m1 ------------------------------------------------------------------------------

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_decode_table():
    codes = torch.arange(16, dtype=torch.uint8)
    got = codecs.decode_e2m1(codes)
    want = torch.tensor([(-1.0 if c & 8 else 1.0) * E2M1_MAGNITUDES[c & 7] for c in range(16)])
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.tensor([bool(c & 8) for c in range(16)]))


def e2m1_probe_values() -> list[float]:
    points = set(E2M1_MAGNITUDES)
    for lo, hi in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]):
        mid = (lo + hi) / 2
        points |= {mid, next_up(mid), next_down(mid), next_up(lo), next_down(hi)}
    points |= {6.0, next_up(6.0), 7.0, 1e30, float("inf"), 1e-45, 0.1}
    return sorted(points)


def test_e2m1_encode_matches_nearest_even_exhaustively():
    table = list(enumerate(E2M1_MAGNITUDES))
    values = e2m1_probe_values()
    xs = torch.tensor(values + [-v for v in values], dtype=torch.float32)
    got = codecs.encode_e2m1(xs)
    for x, code in zip(xs.tolist(), got.tolist()):
        magnitude = nearest_even(x, table, 6.0)
        assert code == magnitude | (8 if math.copysign(1, x) < 0 else 0), f"x={x!r}: code {code}"


def test_e2m1_ties_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert codecs.decode_e2m1(codecs.encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_e2m1_round_trip_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(codecs.encode_e2m1(codecs.decode_e2m1(codes)), codes)


def test_fp4_packing_low_nibble_first_and_round_trip():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = codecs.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(codecs.pack_fp4(codecs.unpack_fp4(every_byte)), every_byte)
    with pytest.raises(ValueError, match="codes"):
        codecs.pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ---- e4m3 ------------------------------------------------------------------------------


def e4m3_value(code: int) -> float:
    """Independent decode of an e4m3fn code (bias 7, no inf, S.1111.111 is NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 7
    if exp == 0xF and man == 7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def test_e4m3_decode_every_code():
    got = codecs.decode_e4m3(torch.arange(256, dtype=torch.uint8))
    for code, value in enumerate(got.tolist()):
        want = e4m3_value(code)
        assert (math.isnan(want) and math.isnan(value)) or value == want, f"code {code:#x}"


def test_e4m3_encode_matches_nearest_even_exhaustively():
    finite = [(c, e4m3_value(c)) for c in range(0x7F)]  # non-negative finite codes 0..0x7E
    probes = set()
    for (_, lo), (_, hi) in zip(finite, finite[1:]):
        mid = (lo + hi) / 2
        probes |= {lo, mid, next_up(mid), next_down(mid)}
    probes |= {448.0, 464.0, next_down(464.0), 480.0, 1e6, float("inf"), 2.0**-10, next_up(2.0**-10), 1e-40}
    values = sorted(probes)
    xs = torch.tensor(values + [-v for v in values], dtype=torch.float32)
    got = codecs.encode_e4m3(xs).view(torch.uint8).tolist()
    for x, code in zip(xs.tolist(), got):
        want = nearest_even(x, finite, 448.0) | (0x80 if math.copysign(1, x) < 0 else 0)
        assert code == want, f"x={x!r}: {code:#x} != {want:#x}"


def test_e4m3_nan_stays_nan():
    assert math.isnan(codecs.decode_e4m3(codecs.encode_e4m3(torch.tensor([float("nan")]))).item())


# ---- e8m0 ------------------------------------------------------------------------------


def test_e8m0_decode_every_code():
    got = codecs.decode_e8m0(torch.arange(256, dtype=torch.uint8)).tolist()
    for b, value in enumerate(got):
        if b == 255:
            assert math.isnan(value)
        else:
            assert value == math.ldexp(1.0, b - 127), f"byte {b}"
    # torch's own float8_e8m0fnu agrees, and both dtypes are accepted
    as_e8m0 = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(codecs.decode_e8m0(as_e8m0), as_e8m0.float())


def smallest_power_at_least(amax: float, max_finite: float) -> int:
    """Exact rational oracle of the round-up rule, clamped to e8m0's exponent range."""
    ratio = Fraction(amax) / Fraction(max_finite)
    if ratio == 0:
        return -127
    e = math.floor(math.log2(ratio)) - 2
    while Fraction(2) ** e < ratio:
        e += 1
    return max(-127, min(127, e))


@pytest.mark.parametrize("max_finite", [448.0, 6.0])
def test_e8m0_round_up_rule(max_finite):
    probes = [0.0, 1e-45, 1e-39, 1.0, 3.0, 6.0, 448.0, 3e38]
    for e in range(-130, 128, 7):
        edge = f32(max_finite * 2.0**e) if max_finite * 2.0**e < 3.4e38 else 0.0
        if edge:
            probes += [edge, next_up(edge), next_down(edge)]
    probes += torch.rand(200).mul(torch.exp2(torch.randint(-40, 40, (200,)).float())).tolist()
    amax = torch.tensor(probes, dtype=torch.float32)
    got = codecs.encode_e8m0(amax, max_finite).tolist()
    for a, byte in zip(amax.tolist(), got):
        assert byte - 127 == smallest_power_at_least(a, max_finite), f"amax={a!r}"
        if byte not in (0, 254):
            assert a <= math.ldexp(max_finite, byte - 127), "scaled block would overflow"


def test_e8m0_non_finite_amax_is_nan_scale():
    got = codecs.encode_e8m0(torch.tensor([float("nan"), float("inf")]), 448.0)
    assert got.tolist() == [255, 255]


# ---- the kernels' codecs (kernels/_codecs_tl.py), run by Triton's CPU interpreter ----------

TL_CODECS = Path(tl_source.__file__).with_name("_codecs_tl.py")
needs_interpreter = pytest.mark.skipif(not tl_source.interpreter_usable(),
                                       reason="Triton's CPU interpreter needs numpy < 2.4")
_tl_codecs = None  # (a module global: the interpreter resolves names in globals only)

with triton.knobs.runtime.scope():
    triton.knobs.runtime.interpret = True

    @triton.jit
    def _tl_codec_kernel(x_ptr, out_ptr, CODEC: tl.constexpr, N: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, N))
        if CODEC == "decode_e2m1":
            y = _tl_codecs.decode_e2m1(x)
        elif CODEC == "decode_e4m3":
            y = _tl_codecs.decode_e4m3(x, True)
        elif CODEC == "decode_e4m3_no_nan":
            y = _tl_codecs.decode_e4m3(x, False)
        elif CODEC == "decode_e8m0":
            y = _tl_codecs.decode_e8m0(x)
        elif CODEC == "encode_e4m3":
            y = _tl_codecs.encode_e4m3(x)
        elif CODEC == "encode_e2m1":
            y = _tl_codecs.encode_e2m1(x)
        else:
            y = _tl_codecs.to_bf16_rne(x)
        tl.store(out_ptr + tl.arange(0, N), y)


def tl_codec(codec: str, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """_codecs_tl.<codec> of each element of x (1-D, a power of two long), interpreted."""
    global _tl_codecs
    _tl_codecs = tl_source.load(TL_CODECS, True)
    out = torch.empty(x.numel(), dtype=out_dtype)
    _tl_codec_kernel[(1, )](x, out, codec, x.numel())
    return out


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs anywhere equal to NaNs."""
    nan = torch.isnan(want)
    as_int = {2: torch.int16, 4: torch.int32}[got.element_size()]
    return torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(as_int), want[~nan].view(as_int))


@needs_interpreter
def test_kernel_decoders_match_on_every_code():
    """Bit for bit but the negative-zero codes, which decode to +0: Triton's -x is 0 - x."""
    nibbles, every_byte = torch.arange(16, dtype=torch.int32), torch.arange(256, dtype=torch.int32)
    want = codecs.decode_e2m1(nibbles.to(torch.uint8))
    assert same_bits(tl_codec("decode_e2m1", nibbles, torch.float32), torch.where(want == 0, 0.0, want))
    want = codecs.decode_e4m3(every_byte.to(torch.uint8))
    want = torch.where(want == 0, 0.0, want)
    assert same_bits(tl_codec("decode_e4m3", every_byte, torch.float32), want)
    without_nan = want.clone()
    without_nan[[0x7F, 0xFF]] = torch.tensor([480.0, -480.0])
    assert same_bits(tl_codec("decode_e4m3_no_nan", every_byte, torch.float32), without_nan)
    assert same_bits(tl_codec("decode_e8m0", every_byte.to(torch.uint8), torch.float32),
                     codecs.decode_e8m0(every_byte.to(torch.uint8)))


@needs_interpreter
def test_kernel_encoders_match():
    values = sorted(set(e2m1_probe_values()) | {e4m3_value(c) for c in range(0x7F)} | {448.0, 464.0, 480.0, 1e-40})
    xs = torch.tensor(values + [-v for v in values] + [0.0, float("nan"), -float("inf")], dtype=torch.float32)
    xs = torch.cat([xs, torch.randn(1024 - xs.numel()) * torch.exp2(torch.randint(-20, 20, (1024 - xs.numel(), )))])
    finite = ~torch.isnan(xs)
    got = tl_codec("encode_e4m3", xs, torch.int32)
    assert torch.equal(got[finite], codecs.encode_e4m3(xs[finite]).view(torch.uint8).int())
    assert bool((got[~finite] & 0x7F == 0x7F).all())
    got = tl_codec("encode_e2m1", xs, torch.int32)
    assert torch.equal(got[finite], codecs.encode_e2m1(xs[finite]).int())
    assert same_bits(tl_codec("to_bf16_rne", xs, torch.bfloat16), xs.to(torch.bfloat16))


def test_each_kernel_file_calls_the_codecs_of_its_mode():
    compiled, interpreted = (tl_source.load(TL_CODECS, mode) for mode in (False, True))
    assert compiled is not interpreted
    assert portable.kernel_module(False).codecs is compiled and portable.kernel_module(True).codecs is interpreted
    assert quantize_kernels.kernel_module(False).codecs is compiled
    assert quantize_kernels.kernel_module(True).codecs is interpreted
    assert quantize_kernels.kernel_module(True)._portable is portable.kernel_module(True)
    with pytest.raises(RuntimeError, match="tl_source.load"):
        tl_source.interpreted()  # (a mode belongs to a file being loaded)
