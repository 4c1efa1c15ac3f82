"""Quantizers bit for bit against a naive per-block oracle (Python floats, brute-force
element encoding), plus the properties users rely on."""

import math
import struct
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

import moegemm
from moegemm import codecs, layouts
from moegemm.formats import FORMATS
from moegemm.quantize import nvfp4_global_scale
from moegemm.kernels.tl_source import interpreter_usable

from test_codecs import E2M1_MAGNITUDES, e4m3_value, nearest_even, smallest_power_at_least


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


E4M3_TABLE = [(c, e4m3_value(c)) for c in range(0x7F)]
E2M1_TABLE = list(enumerate(E2M1_MAGNITUDES))


def encode_naive(value: float, element: str) -> int:
    if math.isnan(value):
        return 0x7F if element == "e4m3" else 0
    table, maxf, sign = (E4M3_TABLE, 448.0, 0x80) if element == "e4m3" else (E2M1_TABLE, 6.0, 0x8)
    return nearest_even(value, table, maxf) | (sign if math.copysign(1, value) < 0 else 0)


def naive_block(values: list[float], fmt: str, global_scale: float | None):
    """(scale as stored: float or byte, element codes) of one block by the rules of docs/contract.md section 3."""
    amax = max(abs(v) for v in values)
    if fmt == "fp8_block":
        scale = f32(amax / 448.0)
        codes = [encode_naive(f32(v / scale) if scale > 0 else 0.0, "e4m3") for v in values]
        return scale, codes
    element = "e4m3" if fmt == "mxfp8" else "e2m1"
    if fmt == "nvfp4":
        scale_code = encode_naive(f32(amax / f32(global_scale * 6.0)), "e4m3")
        denom = f32(e4m3_value(scale_code) * global_scale)
        return scale_code, [encode_naive(f32(v / denom) if denom > 0 else 0.0, "e2m1") for v in values]
    maxf = 448.0 if element == "e4m3" else 6.0
    e = smallest_power_at_least(amax, maxf)
    return e + 127, [encode_naive(float(Fraction(v) / Fraction(2) ** e), element) for v in values]


def stored_codes(q: moegemm.QuantizedTensor, element: str) -> torch.Tensor:
    if element == "e2m1":
        return codecs.unpack_fp4(q.data)
    return q.data.view(torch.uint8)


def random_input(*shape):
    x = torch.randn(*shape) * torch.exp2(torch.randint(-20, 20, (*shape[:-1], 1)).float())
    x[..., :32][torch.rand(shape[:-1]) < 0.2] = 0  # some all-zero blocks
    return x


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8_block"])
def test_activation_quantizer_matches_naive_oracle(fmt):
    k = 320 if fmt == "fp8_block" else 96  # fp8_block: two full 128-blocks and a partial one
    x = random_input(7, k)
    q = moegemm.quantize(x, fmt)
    op = FORMATS[fmt].a
    element = op.element.name
    codes = stored_codes(q, element)
    g = float(q.global_scale) if q.global_scale is not None else None
    for m in range(x.shape[0]):
        for kb in range(math.ceil(k / op.block_k)):
            cols = slice(kb * op.block_k, min(k, (kb + 1) * op.block_k))
            scale, want = naive_block(x[m, cols].tolist(), fmt, g)
            got_scale = q.scales[m, kb]
            got_scale = float(got_scale) if fmt == "fp8_block" else int(got_scale.view(torch.uint8))
            assert got_scale == scale, f"scale of row {m} block {kb}"
            assert codes[m, cols].tolist() == want, f"elements of row {m} block {kb}"


# The block format whose weights each format's weights are (w4a8 and the weight-only formats
# borrow theirs).
WEIGHTS_OF = {"w4a8": "mxfp4", "bf16_mxfp4": "mxfp4", "bf16_nvfp4": "nvfp4", "bf16_mxfp8": "mxfp8"}
WEIGHT_ONLY = ("bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "w4a8", *WEIGHT_ONLY])
def test_weight_quantizer_matches_naive_oracle(fmt):
    w = random_input(3, 5, 64)
    q = moegemm.quantize_weights(w, fmt)
    op = FORMATS[fmt].b
    codes = stored_codes(q, op.element.name)
    oracle_fmt = WEIGHTS_OF.get(fmt, fmt)
    for e in range(3):
        g = float(q.global_scale[e]) if q.global_scale is not None else None
        for n in range(5):
            for kb in range(64 // op.block_k):
                cols = slice(kb * op.block_k, (kb + 1) * op.block_k)
                scale, want = naive_block(w[e, n, cols].tolist(), oracle_fmt, g)
                assert int(q.scales[e, n, kb].view(torch.uint8)) == scale
                assert codes[e, n, cols].tolist() == want


def test_fp8_block_weights_128x128_with_partial_edges():
    w = random_input(2, 192, 160)  # N = 192 and K = 160: partial last block on both axes
    q = moegemm.quantize_weights(w, "fp8_block")
    assert q.scales.shape == (2, 2, 2) and q.scales.dtype == torch.float32
    for e in range(2):
        for nb in range(2):
            for kb in range(2):
                block = w[e, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128]
                scale, codes = naive_block(block.flatten().tolist(), "fp8_block", None)
                assert float(q.scales[e, nb, kb]) == scale
                got = q.data[e, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128].contiguous().view(torch.uint8)
                assert got.flatten().tolist() == codes


def test_nvfp4_global_scales():
    x = torch.randn(4, 32)
    qa = moegemm.quantize(x, "nvfp4")
    assert float(qa.global_scale) == f32(float(x.abs().max()) / 2688.0)
    w = torch.randn(3, 4, 32) * torch.tensor([1.0, 10.0, 0.0]).reshape(3, 1, 1)
    qw = moegemm.quantize_weights(w, "nvfp4")
    want = [f32(float(w[e].abs().max()) / 2688.0) or 1.0 for e in range(3)]
    assert qw.global_scale.tolist() == want  # an all-zero expert gets 1
    given = moegemm.quantize_weights(w, "nvfp4", global_scale=torch.tensor([1.0, 2.0, 3.0]))
    assert given.global_scale.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="global_scale"):
        moegemm.quantize_weights(w, "nvfp4", global_scale=torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_global_scale_of_every_float_dtype_and_edge(dtype):
    """nvfp4's global scale, amax / 2688 correctly rounded, from rows of any float dtype (read in
    their dtype: the amax of bf16 rows is exact), the largest magnitude negative or positive; 1 for
    all zeros, for a NaN and for no rows."""
    x = torch.randn(64, 96).to(dtype)
    for peak in (-1000.0, 776.0):  # (both exact in bf16)
        x[7, 3] = peak
        assert float(nvfp4_global_scale(x)) == f32(abs(peak) / 2688.0)
    for x_edge in (torch.zeros(4, 32, dtype=dtype), torch.full((2, 16), float("nan"), dtype=dtype),
                   torch.empty(0, 32, dtype=dtype)):
        assert float(nvfp4_global_scale(x_edge)) == 1.0


@pytest.mark.gpu
def test_nvfp4_global_scale_on_cuda_is_the_cpus():
    """torch's CUDA division by a Python number multiplies by its reciprocal (1 ulp off): the
    global scale (and so every nvfp4 code) divides by a tensor, the same on both devices."""
    x = torch.randn(4133, 7168, dtype=torch.bfloat16) * torch.logspace(-3, 3, 4133)[:, None].to(torch.bfloat16)
    got = [nvfp4_global_scale(rows).item() for rows in (x[:k] for k in range(1, 4133, 97))]
    cuda = [nvfp4_global_scale(rows).item() for rows in (x.cuda()[:k] for k in range(1, 4133, 97))]
    assert got == cuda


# ||dequantize(quantize(x)) - x|| / ||x|| on Gaussian data: measured 0.0017 (bf16), 0.026 (e4m3
# formats), 0.095 (nvfp4), 0.116 (mxfp4) at 64x512; the bounds leave ~25% headroom.
QUANTIZATION_ERROR = {"bf16": 0.0021, "fp8_block": 0.033, "mxfp8": 0.033, "mxfp4": 0.145, "nvfp4": 0.12}


@pytest.mark.parametrize("fmt", sorted(QUANTIZATION_ERROR))
def test_dequantize_round_trip_error(fmt):
    x = torch.randn(64, 512)
    w = torch.randn(2, 64, 512)
    for q, ref in ((moegemm.quantize(x, fmt), x), (moegemm.quantize_weights(w, fmt), w)):
        dq = moegemm.dequantize(q)
        assert float((dq - ref).norm() / ref.norm()) < QUANTIZATION_ERROR[fmt]


@pytest.mark.parametrize("fmt", WEIGHT_ONLY)
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_weight_only_formats_are_bf16_tokens_and_block_weights(fmt, layout):
    """A weight-only format's weights are its block format's bytes (scales, global scale and
    layout included); its activations are the bf16 rounding of x, without scales or global."""
    x = torch.randn(40, 64) * 10
    w = torch.randn(3, 130, 64)
    a_offsets = torch.tensor([0, 10, 30], dtype=torch.int32)
    qw, rw = moegemm.quantize_weights(w, fmt, scale_layout=layout), moegemm.quantize_weights(w, WEIGHTS_OF[fmt],
                                                                                              scale_layout=layout)
    assert (qw.fmt, qw.operand, qw.scale_layout) == (fmt, "b", layout)
    assert torch.equal(qw.data.view(torch.uint8), rw.data.view(torch.uint8))
    assert torch.equal(qw.scales.view(torch.uint8), rw.scales.view(torch.uint8))
    assert (qw.global_scale is None) == (rw.global_scale is None)
    if rw.global_scale is not None:
        assert torch.equal(qw.global_scale, rw.global_scale)
    assert torch.equal(moegemm.dequantize(qw), moegemm.dequantize(rw))
    qa = moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets)
    assert qa.data.dtype == torch.bfloat16 and qa.scales is None and qa.global_scale is None
    assert torch.equal(qa.data, x.to(torch.bfloat16))
    assert torch.equal(moegemm.dequantize(qa), x.to(torch.bfloat16).float())


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4", "w4a8", "bf16_mxfp4", "bf16_mxfp8"])
def test_power_of_two_formats_are_idempotent(fmt):
    # With power-of-two (or no) scales, decoded values re-quantize to themselves exactly.
    x = torch.randn(8, 128) * 100
    dq = moegemm.dequantize(moegemm.quantize(x, fmt))
    assert torch.equal(moegemm.dequantize(moegemm.quantize(dq, fmt)), dq)
    w = torch.randn(2, 8, 128)
    dw = moegemm.dequantize(moegemm.quantize_weights(w, fmt))
    assert torch.equal(moegemm.dequantize(moegemm.quantize_weights(dw, fmt)), dw)


def test_zero_and_nan_blocks():
    x = torch.zeros(2, 64)
    x[1, 40] = float("nan")
    q = moegemm.quantize(x, "mxfp8")
    assert q.scales.view(torch.uint8).tolist() == [[0, 0], [0, 255]]
    dq = moegemm.dequantize(q)
    assert bool((dq[0] == 0).all()) and bool(dq[1, 32:].isnan().all()) and bool((dq[1, :32] == 0).all())
    q8 = moegemm.quantize(torch.zeros(1, 128), "fp8_block")
    assert q8.scales.tolist() == [[0.0]] and bool((q8.data.float() == 0).all())


def test_fp8_block_saturates_instead_of_nan():
    x = torch.full((1, 128), 1.0)
    x[0, 0] = 3.0e5
    q = moegemm.quantize(x, "fp8_block")
    assert not bool(q.data.float().isnan().any()) and float(q.data.float().abs().max()) == 448.0


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "w4a8"])
def test_swizzled_quantization_is_the_plain_one_relaid(fmt):
    a_offsets = torch.tensor([5, 70, 70, 300], dtype=torch.int32)
    x = torch.randn(310, 64)
    w = torch.randn(2, 130, 64)
    plain_a, swz_a = moegemm.quantize(x, fmt), moegemm.quantize(x, fmt, scale_layout="swizzled", a_offsets=a_offsets)
    assert torch.equal(plain_a.data.view(torch.uint8), swz_a.data.view(torch.uint8))
    assert torch.equal(layouts.swizzle_a_scales(plain_a.scales, a_offsets).view(torch.uint8),
                       swz_a.scales.view(torch.uint8))
    plain_w, swz_w = moegemm.quantize_weights(w, fmt), moegemm.quantize_weights(w, fmt, scale_layout="swizzled")
    assert torch.equal(layouts.swizzle_b_scales(plain_w.scales).view(torch.uint8), swz_w.scales.view(torch.uint8))
    # dequantize reads either layout to the same values (rows inside the slots)
    rows = slice(5, 300)
    assert torch.equal(moegemm.dequantize(plain_a)[rows], moegemm.dequantize(swz_a)[rows])
    assert torch.equal(moegemm.dequantize(plain_w), moegemm.dequantize(swz_w))


def test_output_dtypes_are_what_the_op_consumes():
    x, w = torch.randn(4, 64), torch.randn(2, 8, 64)
    expect = {
        "bf16": (torch.bfloat16, None), "fp8_block": (torch.float8_e4m3fn, torch.float32),
        "mxfp8": (torch.float8_e4m3fn, torch.float8_e8m0fnu), "mxfp4": (torch.uint8, torch.float8_e8m0fnu),
        "nvfp4": (torch.uint8, torch.float8_e4m3fn), "w4a8": (torch.float8_e4m3fn, torch.float8_e8m0fnu),
        **{fmt: (torch.bfloat16, None) for fmt in WEIGHT_ONLY},
    }
    for fmt, (data_dtype, scale_dtype) in expect.items():
        qa = moegemm.quantize(x, fmt)
        assert qa.data.dtype == data_dtype and (qa.scales is None or qa.scales.dtype == scale_dtype), fmt
        assert qa.k == 64
    assert moegemm.quantize_weights(w, "w4a8").data.shape == (2, 8, 32)
    assert moegemm.quantize_weights(w, "w4a8").scales.dtype == torch.float8_e8m0fnu
    for fmt, weights_of in ((f, WEIGHTS_OF[f]) for f in WEIGHT_ONLY):
        got, want = moegemm.quantize_weights(w, fmt), moegemm.quantize_weights(w, weights_of)
        assert (got.data.dtype, got.data.shape, got.scales.dtype) == (want.data.dtype, want.data.shape,
                                                                      want.scales.dtype), fmt


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_quantizer_bad_input(backend):
    # (the same checks and messages on every backend: they run before any launch)
    with pytest.raises(TypeError, match="^x:"):
        moegemm.quantize(torch.ones(4, 64, dtype=torch.int32), "mxfp8", backend=backend)
    with pytest.raises(ValueError, match="^x: K must be a multiple of 32"):
        moegemm.quantize(torch.ones(4, 48), "mxfp8", backend=backend)
    with pytest.raises(ValueError, match="^x: expected 2 dimensions"):
        moegemm.quantize(torch.ones(4), "mxfp8", backend=backend)
    with pytest.raises(ValueError, match="^w: expected 3 dimensions"):
        moegemm.quantize_weights(torch.ones(4, 64), "mxfp8")
    with pytest.raises(ValueError, match="^a_offsets: required"):
        moegemm.quantize(torch.ones(4, 64), "mxfp8", scale_layout="swizzled", backend=backend)
    with pytest.raises(ValueError, match="^scale_layout:"):
        moegemm.quantize(torch.ones(4, 128), "fp8_block", scale_layout="swizzled", backend=backend)
    with pytest.raises(ValueError, match="^fmt:"):
        moegemm.quantize(torch.ones(4, 64), "fp6", backend=backend)
    with pytest.raises(ValueError, match="^global_scale: expected 1 value"):
        moegemm.quantize(torch.ones(4, 64), "nvfp4", global_scale=torch.ones(2), backend=backend)


@pytest.mark.parametrize("fmt", sorted(moegemm.FORMATS))
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_a_share_of_the_experts_keeps_every_field(fmt, layout):
    """QuantizedTensor.experts(first, last): the weights of those experts as quantize_weights makes
    them for w[first:last] (codes, scales in their layout, nvfp4's global scales), prepacked codes
    still prepacked, and the product over them that of the whole tensor with the ids shifted."""
    f = moegemm.get_format(fmt)
    if layout == "swizzled" and not f.swizzle_capable:
        pytest.skip("plain scales only")
    w = torch.randn(6, 64, 128) / 8
    whole = moegemm.quantize_weights(w, fmt, scale_layout=layout)
    share = whole.experts(2, 5)
    alone = moegemm.quantize_weights(w[2:5], fmt, scale_layout=layout)
    assert torch.equal(share.data.view(torch.uint8), alone.data.view(torch.uint8))
    if alone.scales is not None:
        assert torch.equal(share.scales.view(torch.uint8), alone.scales.view(torch.uint8))
    if alone.global_scale is not None:
        assert torch.equal(share.global_scale, alone.global_scale)
    assert (share.fmt, share.operand, share.scale_layout) == (fmt, "b", layout)
    if fmt in moegemm.formats.PREPACK_FORMATS:
        packed = moegemm.prepack_weights(whole).experts(2, 5)
        assert packed.prepacked and torch.equal(packed.data, moegemm.prepack_weights(alone).data)
    x = torch.randn(7, 128)
    a = x.bfloat16() if not f.a_scaled else moegemm.quantize(x, fmt, scale_layout=layout,
                                                                a_offsets=torch.tensor([0, 3, 7], dtype=torch.int32))
    offsets = torch.tensor([0, 3, 7], dtype=torch.int32)
    got = moegemm.grouped_matmul(a, share, None, None, offsets, torch.tensor([0, 2], dtype=torch.int32), fmt=fmt,
                                 backend="reference")
    want = moegemm.grouped_matmul(a, whole, None, None, offsets, torch.tensor([2, 4], dtype=torch.int32), fmt=fmt,
                                  backend="reference")
    assert torch.equal(got, want)


def test_a_share_of_the_experts_refuses_what_has_none():
    w = moegemm.quantize_weights(torch.randn(4, 32, 64), "mxfp8")
    with pytest.raises(ValueError, match="first, last"):
        w.experts(3, 5)
    with pytest.raises(ValueError, match="only weights"):
        moegemm.quantize(torch.randn(4, 64), "mxfp8").experts(0, 1)


def test_a_share_of_the_experts_takes_the_integers_torch_indexing_takes():
    # numpy integers and 0-d integer tensors, as w[first:last] takes them (an expert-parallel
    # rank's bounds often come from either); bools, floats and 1-D tensors stay refused.
    w = moegemm.quantize_weights(torch.randn(4, 32, 64), "mxfp8")
    want = w.experts(1, 3)
    for first, last in ((np.int64(1), np.int32(3)), (torch.tensor(1), torch.tensor(3, dtype=torch.int32)),
                        (np.array(1), 3)):
        got = w.experts(first, last)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    for first, last, name in ((True, 3, "first"), (np.bool_(True), 3, "first"), (torch.tensor(True), 3, "first"),
                              (1, 3.0, "last"), (1, torch.tensor(3.0), "last"), (1, torch.tensor([3]), "last")):
        with pytest.raises(TypeError, match=f"^{name}: expected an integer"):
            w.experts(first, last)


# ---- moegemm.quantize's kernel path (backend "triton"; the default on CUDA tensors) ---------

needs_interpreter = pytest.mark.skipif(not interpreter_usable(), reason="Triton's CPU interpreter needs numpy < 2.4")
# Inputs near fp32's limit on purpose: the interpreter's numpy reports the IEEE results they give.
IEEE_EDGES = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


def accepted_layouts(fmt: str) -> tuple[str, ...]:
    """The scale layouts quantize takes for fmt (unscaled activations take both, and ignore it)."""
    f = FORMATS[fmt]
    return ("plain", "swizzled") if f.swizzle_capable or not f.a_scaled else ("plain",)


KERNEL_CASES = [(fmt, layout) for fmt in FORMATS for layout in accepted_layouts(fmt)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers of its element size (NaN == NaN, -0 != 0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_fields(q: moegemm.QuantizedTensor, r: moegemm.QuantizedTensor):
    """Every field of two QuantizedTensors equal, their tensors in dtype, shape and bits."""
    assert (q.fmt, q.operand, q.scale_layout, q.prepacked) == (r.fmt, r.operand, r.scale_layout, r.prepacked)
    for name in ("data", "scales", "global_scale", "a_offsets", "a_scale_offsets"):
        got, want = getattr(q, name), getattr(r, name)
        assert (got is None) == (want is None), name
        if want is not None:
            assert (got.dtype, got.shape, got.device) == (want.dtype, want.shape, want.device), name
            assert torch.equal(bits(got), bits(want)), name


def edge_rows(m: int, k: int, fmt: str, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Rows spanning twelve decades, with an all-zero block, a negative zero, an fp32 subnormal, a
    row of subnormals (scales from a subnormal amax) and, but where it would be the tensor-wide
    amax of nvfp4's global scale (and zero every other block's scale), a value near fp32's
    largest: the edges of the scale rules, all finite (a block holding inf or NaN gets the same
    scale, but its element bits are unspecified: docs/contract.md section 3)."""
    x = torch.randn(m, k, device=device) * torch.logspace(-6, 6, m, device=device)[:, None]
    x[2, :32] = 0
    x[0, 1] = -0.0
    x[3, 5] = 1e-40
    x[5] = torch.randn(k, device=device) * 1e-39
    if not FORMATS[fmt].a.global_scale:
        x[4, 7] = 3e38
    return x.to(dtype)


def scale_blocks_bound(rows: int, a_offsets: torch.Tensor) -> int:
    """ceil(M / 128) + G: the first dimension of swizzled scales the kernel takes by default."""
    return math.ceil(rows / layouts.ROWS_PER_BLOCK) + a_offsets.numel() - 1


def rounding_edge_rows(fmt: str, exponent: int) -> torch.Tensor:
    """Rows of K = 256 whose block-scaled values are every code of the element type, every
    midpoint between two codes (a tie, rounding to the even code) and the fp32 numbers either side
    of it, of both signs, and -0; then random values spanning 2^+-40 around the scale, which the
    divisions (fp8_block, nvfp4) round at arbitrary places. Each block leads with max_finite *
    2^exponent, so its scale is 2^exponent exactly (nvfp4's: with the global scale 2^exponent
    given). The fast paths of the compiled quantizer (hardware e4m3 rounding, one reciprocal a
    block, e2m1 on the bits) must round all of them as the reference does; an exponent far below
    0 makes fp8_block's and nvfp4's divisions rescale (scale < 2^-64) and elements subnormal."""
    op = FORMATS[fmt].a
    e4m3 = op.element.name == "e4m3"
    if e4m3:
        codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        codes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    ties = (codes[:-1] + codes[1:]) / 2
    values = torch.cat([codes, ties, torch.nextafter(ties, torch.zeros_like(ties)),
                        torch.nextafter(ties, torch.full_like(ties, 1e30))])
    values = torch.cat([values, -values, torch.tensor([-0.0])])
    values = torch.cat([values, torch.randn(1024) * torch.exp2(torch.randint(-40, 3, (1024, )).float())])
    maxf = 448.0 if e4m3 else 6.0
    block = op.block_k
    per_block = block - 1
    blocks = -(-values.numel() // per_block)
    padded = torch.zeros(blocks * per_block)
    padded[:values.numel()] = values.clamp(-maxf, maxf)
    rows = torch.cat([torch.full((blocks, 1), maxf), padded.reshape(blocks, per_block)], dim=1)
    rows = rows.reshape(-1, 256) if rows.numel() % 256 == 0 else torch.cat(
        [rows.reshape(-1), torch.zeros(256 - rows.numel() % 256)]).reshape(-1, 256)
    return rows * 2.0 ** exponent



# nvfp4 global scales whose block denominators (e4m3 scale times the global) are no powers of two,
# from the largest (denominators near 2^125) through the least the kernel takes as it is (2^-90) to
# those below, for which it rescales elements and denominators by 2^64, subnormal ones included.
NVFP4_EDGE_GLOBALS = (1.0, 0.7853981852531433, 3.0517578125e-05 * 1.3, 2.0 ** 100 * 1.3, 2.0 ** 117 * 1.37,
                      2.0 ** -89 * 1.1, 2.0 ** -90, 2.0 ** -90 * 0.999, 2.0 ** -100 * 1.3, 1e-40)
# nvfp4 global scales no caller should give, which the kernel still takes as the reference does:
# zeros, negative ones (rescaled below 2^-90 too), fp32's least, one whose 6 g is past 2^126
# (the scale division rescaled by 2^-64), one whose 6 g overflows, infinities and NaN.
NVFP4_ODD_GLOBALS = (0.0, -0.0, -1.3, -(2.0 ** -100) * 1.3, 1e-45, 2.0 ** 124 * 1.3, 3e38, math.inf, -math.inf,
                     math.nan)


def nvfp4_odd_global_rows(device="cpu") -> torch.Tensor:
    """edge_rows for nvfp4 and a row of extremes (fp32's near-largest, huge, tiny and subnormal
    values, zeros of both signs), for NVFP4_ODD_GLOBALS."""
    extremes = torch.tensor([3e38, -2.0 ** 100, 2.0 ** 60, 1.0, -0.75, 2.0 ** -100, 1e-40, -0.0] * 8, device=device)
    return torch.cat([edge_rows(7, 64, "nvfp4", device), extremes.reshape(1, 64)])


def nvfp4_tie_rows(global_scale: float) -> torch.Tensor:
    """fp32 rows of K = 256 in nvfp4 blocks of 16 whose quotients by their denominator d = s * g
    (s an e4m3 scale, g = global_scale) are every e2m1 code and midpoint (tie) and the quotients
    of the fp32 numbers either side of tie * d, of both signs, then random values over 2^+-20
    around d: each block leads with 6 d, so its scale is s (where 6 d and 6 g are normal). The
    scales run from e4m3's least to 448, those whose 6 d would overflow left out. Then rows of
    huge and tiny elements under the same global (saturated scales, quotients that overflow)."""
    g = torch.tensor(global_scale, dtype=torch.float32)
    e2m1 = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    ties = (e2m1[:-1] + e2m1[1:]) / 2
    generator = torch.Generator().manual_seed(49)
    blocks = []
    for code in (0x01, 0x03, 0x09, 0x2B, 0x38, 0x3B, 0x4D, 0x52, 0x63, 0x6F, 0x7A, 0x7E):
        s = torch.tensor(code, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        d = s * g
        if not bool(torch.isfinite(6 * d)) or float(6 * d) > 3e38:
            continue
        at_ties = ties * d
        values = torch.cat([e2m1 * d, at_ties, torch.nextafter(at_ties, torch.zeros_like(at_ties)),
                            torch.nextafter(at_ties, torch.full_like(at_ties, math.inf))])
        values = torch.cat([values, -values, d * torch.randn(45, generator=generator)
                            * torch.exp2(torch.randint(-20, 3, (45, ), generator=generator).float())])
        values = values.clamp(-6 * d, 6 * d)
        for i in range(0, values.numel(), 15):
            chunk = values[i:i + 15]
            blocks.append(torch.cat([(6 * d).reshape(1), chunk, torch.zeros(15 - chunk.numel())]))
    extremes = torch.tensor([3e38, -2.0 ** 100, 2.0 ** 60, 1.0, -0.75, 2.0 ** -100, 1e-40, 0.0] * 2)
    rows = torch.cat(blocks + [extremes, extremes.flip(0)])
    rows = torch.cat([rows, torch.zeros(-rows.numel() % 256)])
    return rows.reshape(-1, 256)

@needs_interpreter
@IEEE_EDGES
@pytest.mark.parametrize("fmt,layout", KERNEL_CASES)
def test_quantize_kernel_is_the_reference_bit_for_bit(fmt, layout):
    """The kernel path (Triton's interpreter here; compiled on CUDA) against the PyTorch quantizer:
    every field, bit for bit. 37 rows (a partial program of rows), K = 96 (a partial fp8_block
    block, mxfp8's 3 scale blocks padded to the swizzle atom's 4), slots leaving rows 0-2 and 30-36
    outside every slot and one slot empty. Left out, num_scale_blocks is the bound ceil(M/128) + G:
    the reference given that bound writes the same buffer, padding zero."""
    x = edge_rows(37, 96, fmt)
    a_offsets = torch.tensor([3, 10, 10, 30], dtype=torch.int32)
    got = moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets, backend="triton")
    blocks = scale_blocks_bound(37, a_offsets) if layout == "swizzled" else None
    want = moegemm.reference.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets, num_scale_blocks=blocks)
    assert_same_fields(got, want)


def assert_nan_blocks_as_the_reference(x: torch.Tensor, fmt: str, backend: str):
    """x with NaN in two blocks: the kernel path gives the reference's scales bit for bit (a block holding a NaN
    the NaN scale, not one from its finite elements) and elements that decode to the same values,
    NaN where the reference's do (docs/contract.md section 3: their bits are unspecified)."""
    x = x.clone()
    x[1, 3] = float("nan")
    x[5, -1] = float("nan")
    given = 0.5 if FORMATS[fmt].a.global_scale else None
    got = moegemm.quantize(x, fmt, global_scale=given, backend=backend)
    want = moegemm.reference.quantize(x, fmt, global_scale=given)
    assert torch.equal(bits(got.scales), bits(want.scales))
    got_values, want_values = moegemm.dequantize(got), moegemm.dequantize(want)
    nan = want_values.isnan()
    assert bool(nan[1].any()) and bool(nan[5].any()) and not bool(nan[0].any())
    assert torch.equal(got_values.isnan(), nan)
    assert torch.equal(got_values[~nan], want_values[~nan])


@needs_interpreter
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "mxfp4", "nvfp4", "w4a8"])
def test_quantize_kernel_gives_nan_blocks_the_nan_scale(fmt):
    assert_nan_blocks_as_the_reference(torch.randn(8, 256), fmt, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "mxfp4", "nvfp4", "w4a8"])
def test_quantize_on_cuda_gives_nan_blocks_the_nan_scale(fmt):
    """The compiled block amax keeps a NaN (a float maximum that drops it would give the block a
    finite scale and finite codes: a NaN input read back as a number)."""
    assert_nan_blocks_as_the_reference(torch.randn(4096 + 8, 1024, device="cuda").bfloat16(), fmt, "auto")


# Instructions an element moegemm.quantize's kernel may issue on its fast path (sm_90 SASS): an
# H100 issues ~25e12 a second at best, so 28 keep 0.9e12 elements a second, the e2m1 formats'
# 70% of the copy bandwidth (2.5 bytes an element); the kernels were 25-57 before it was set.
# nvfp4 (its e4m3 scale times the global is no power of two: div.rn's fast path, the reciprocal
# once a block) reaches 20.0 plain, 21.9 swizzled (30.1 dividing each element): 23.
QUANTIZE_SASS_BUDGET = 28
NVFP4_SASS_BUDGET = 23
# Registers a thread of those kernels may hold: streaming kernels need bytes in flight, and 56
# (x 128 threads) keep 9 programs of 4 warps on an SM, mxfp4's 40 twelve; nvfp4 held 94 (5), a
# division's slow-path CALL and the bf16 words kept live beside their values.
QUANTIZE_REGISTER_BUDGET = 56


def test_quantize_kernels_fit_their_instruction_budget():
    """The heaviest cases of moegemm.quantize's kernel, as launched on CUDA tokens (4096 x 7168
    bf16, 8 slots) and compiled for sm_90 offline (bench/quantize_sass.py): no register spills, at
    most QUANTIZE_REGISTER_BUDGET registers and QUANTIZE_SASS_BUDGET instructions an element
    (nvfp4's amax pass too)."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import quantize_sass

    heaviest = {("nvfp4", "swizzled"), ("mxfp4", "swizzled"), ("mxfp8", "swizzled"), ("fp8_block", "plain")}
    rows = quantize_sass.table(4096, 7168, 8, only=heaviest)
    assert {(r["fmt"], r["layout"].split(" (")[0]) for r in rows} == heaviest and len(rows) == 5
    for r in rows:
        budget = NVFP4_SASS_BUDGET if r["fmt"] == "nvfp4" else QUANTIZE_SASS_BUDGET
        assert r["spills"] == 0 and r["per_element"] <= budget, r
        assert r["registers"] <= QUANTIZE_REGISTER_BUDGET, r



def test_quantize_sass_counts_the_fast_path_only():
    """bench/quantize_sass.py's fast path: past a division's slow path (a conditional branch over
    a CALL) and past the other side of a branch of the kernel (an unconditional branch), whichever
    side holds the CALLs; past a branch over work with no CALL (a rare launch's: nvfp4's rescaling);
    the subroutine after EXIT not at all."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import quantize_sass

    divisions_jump = """
        /*0000*/ FMUL R1, R2, R3 ;
        /*0010*/ @!P0 BRA 0x40 ;
        /*0020*/ MOV R10, 0x40 ;
        /*0030*/ CALL.REL.NOINC 0xa0 ;
        /*0040*/ @!P1 BRA 0x70 ;
        /*0050*/ FFMA R1, R2, R3, R4 ;
        /*0060*/ BRA 0x90 ;
        /*0070*/ FADD R1, R2, R3 ;
        /*0080*/ CALL.REL.NOINC 0xa0 ;
        /*0090*/ EXIT ;
        /*00a0*/ FADD R5, R5, R5 ;
        /*00b0*/ RET.REL.NODEC R2 0x0 ;
    """
    fast = {"FMUL": 1, "BRA": 3, "FFMA": 1, "EXIT": 1}
    assert dict(quantize_sass.fast_path_counts(divisions_jump)) == fast
    divisions_fall_through = divisions_jump.replace("@!P1 BRA 0x70", "@P1 BRA 0x70").replace(
        "FFMA R1, R2, R3, R4 ;\n        /*0060*/ BRA 0x90", "FADD R1, R2, R3 ;\n        /*0060*/ CALL.REL.NOINC 0xa0").replace(
        "FADD R1, R2, R3 ;\n        /*0080*/ CALL.REL.NOINC 0xa0", "FFMA R1, R2, R3, R4 ;\n        /*0080*/ NOP")
    assert dict(quantize_sass.fast_path_counts(divisions_fall_through)) == {"FMUL": 1, "BRA": 2, "FFMA": 1, "EXIT": 1}
    rescaling = """
        /*0000*/ FSETP.GEU.AND P1, PT, |R3|, 8.0779356694631608874e-28, PT ;
        /*0010*/ @P1 BRA 0x40 ;
        /*0020*/ FMUL R2, R2, 1.84467440737095516160e+19 ;
        /*0030*/ FMUL R4, R4, 1.84467440737095516160e+19 ;
        /*0040*/ FFMA R1, R2, R3, R4 ;
        /*0050*/ EXIT ;
    """
    assert dict(quantize_sass.fast_path_counts(rescaling)) == {"FSETP": 1, "BRA": 1, "FFMA": 1, "EXIT": 1}

@needs_interpreter
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "mxfp4", "nvfp4"])
def test_quantize_kernel_rounds_ties_as_the_reference(fmt):
    """rounding_edge_rows through the kernel (Triton's interpreter here; the GPU test below runs
    the compiled fast paths) against the PyTorch quantizer, bit for bit."""
    for exponent in (0, -100):
        x = rounding_edge_rows(fmt, exponent)
        given = 2.0 ** exponent if FORMATS[fmt].a.global_scale else None
        got = moegemm.quantize(x, fmt, global_scale=given, backend="triton")
        assert_same_fields(got, moegemm.reference.quantize(x, fmt, global_scale=given))


@needs_interpreter
@IEEE_EDGES
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_quantize_kernel_takes_any_nvfp4_global_scale():
    """NVFP4_ODD_GLOBALS through the kernel (Triton's interpreter here: its rescaling by 2^64 below
    2^-90; the GPU test below runs the compiled divisions) against the PyTorch quantizer, bit for
    bit, in fp32 and as bf16 tokens (no subnormals: the interpreter converts those wrongly)."""
    x = nvfp4_odd_global_rows()
    normal = torch.where(x.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(x), x)
    for global_scale in NVFP4_ODD_GLOBALS:
        for rows in (x, normal.bfloat16()):
            got = moegemm.quantize(rows, "nvfp4", global_scale=global_scale, backend="triton")
            assert_same_fields(got, moegemm.reference.quantize(rows, "nvfp4", global_scale=global_scale))


@needs_interpreter
@IEEE_EDGES
def test_tokens_global_scale_is_nvfp4_global_scale():
    """nvfp4's default global scale from the amax kernel (Triton's interpreter here) is
    quantize.nvfp4_global_scale's, bit for bit: rows of a strided view, fp16 and fp32 tokens,
    a NaN (global 1), an infinity (global inf), all zeros (global 1), fp32's largest value."""
    from moegemm import token_quantizers

    base = edge_rows(37, 96, "mxfp8")  # (with fp32's near-largest value 3e38)
    wide = torch.randn(37, 200)
    nan, inf = base.clone(), base.clone()
    nan[7, 9] = float("nan")
    inf[30, 90] = -float("inf")
    for x in (base, wide[:, 50:146], base.half().clamp(-6e4, 6e4), nan, inf, torch.zeros(5, 32), base[:, :0]):
        got = token_quantizers.tokens_global_scale(x)
        want = nvfp4_global_scale(x)
        assert got.shape == want.shape and torch.equal(bits(got), bits(want)), x.dtype


@needs_interpreter
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_quantize_kernel_takes_any_float_rows(fmt):
    """bf16, fp16 and fp64 tokens (fp64 rounded to fp32 first, as the reference reads it), rows
    of a column-strided view, a given nvfp4 global scale: the reference's bytes. (bf16 without
    subnormals: Triton 3.6's interpreter converts those to fp32 wrongly; the GPU test has them.)"""
    x = edge_rows(20, 64, fmt)
    normal = torch.where(x.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(x), x)
    strided = torch.randn(64, 20).t()
    assert strided.stride(-1) != 1
    for rows, global_scale in ((normal.bfloat16(), None), (x.half().clamp(-6e4, 6e4), None), (x.double() / 3, 0.25),
                               (strided, torch.tensor(1e-3))):
        got = moegemm.quantize(rows, fmt, global_scale=global_scale, backend="triton")
        assert_same_fields(got, moegemm.reference.quantize(rows, fmt, global_scale=global_scale))


@pytest.mark.parametrize("fmt,layout", [("nvfp4", "swizzled"), ("fp8_block", "plain"), ("bf16", "plain")])
def test_quantize_kernel_of_no_rows(fmt, layout):
    """Zero rows: no launch, the reference's empty operand (nvfp4's global scale 1)."""
    x = torch.zeros(0, 64)
    a_offsets = torch.zeros(3, dtype=torch.int32)
    got = moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets, backend="triton")
    blocks = scale_blocks_bound(0, a_offsets) if layout == "swizzled" else None
    assert_same_fields(got, moegemm.reference.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets,
                                                       num_scale_blocks=blocks))


@needs_interpreter
def test_quantize_kernel_checks_a_tight_num_scale_blocks():
    """A num_scale_blocks below the bound ceil(M/128) + G is checked against the groups' blocks
    (the one case that reads a_offsets); one that holds them (any integer type) gives the
    reference's buffer."""
    x = edge_rows(37, 64, "mxfp4")
    a_offsets = torch.tensor([3, 10, 10, 30], dtype=torch.int32)  # 2 blocks needed, bound 4
    got = moegemm.quantize(x, "mxfp4", scale_layout="swizzled", a_offsets=a_offsets, num_scale_blocks=np.int64(2),
                           backend="triton")
    assert_same_fields(got, moegemm.reference.quantize(x, "mxfp4", scale_layout="swizzled", a_offsets=a_offsets,
                                                       num_scale_blocks=2))
    with pytest.raises(ValueError, match="^num_scale_blocks: the groups need 2 128-row scale blocks, got 1"):
        moegemm.quantize(x, "mxfp4", scale_layout="swizzled", a_offsets=a_offsets, num_scale_blocks=1,
                         backend="triton")
    for wrong in (2.0, True):
        with pytest.raises(TypeError, match="^num_scale_blocks: expected an int"):
            moegemm.quantize(x, "mxfp4", scale_layout="swizzled", a_offsets=a_offsets, num_scale_blocks=wrong,
                             backend="triton")
    with pytest.raises(TypeError, match="^a_offsets:"):
        moegemm.quantize(x, "mxfp4", scale_layout="swizzled", a_offsets=a_offsets.float(), backend="triton")
    with pytest.raises(ValueError, match=r"^a_offsets: expected a 1-D tensor \[G\+1\]"):
        moegemm.quantize(x, "mxfp4", scale_layout="swizzled", a_offsets=a_offsets[:0], backend="triton")


@needs_interpreter
def test_quantize_kernel_reads_strided_offsets():
    """a_offsets of any strides (the kernel reads a contiguous copy): the reference's bytes."""
    x = edge_rows(37, 64, "mxfp8")
    a_offsets = torch.tensor([[3, 0], [10, 0], [10, 0], [30, 0]], dtype=torch.int32)[:, 0]
    assert not a_offsets.is_contiguous()
    got = moegemm.quantize(x, "mxfp8", scale_layout="swizzled", a_offsets=a_offsets, num_scale_blocks=4,
                           backend="triton")
    want = moegemm.reference.quantize(x, "mxfp8", scale_layout="swizzled", a_offsets=a_offsets, num_scale_blocks=4)
    assert torch.equal(bits(got.scales), bits(want.scales)) and torch.equal(bits(got.data), bits(want.data))


def test_quantize_backends(monkeypatch):
    """The CPU's default is the reference (no launch); backend="triton" launches the kernel (Triton's
    interpreter); another backend is named."""
    from moegemm.kernels import quantize_kernels

    launched = []
    real_launch = quantize_kernels.launch
    monkeypatch.setattr(quantize_kernels, "launch",
                        lambda fn, *args: launched.append(fn.__name__) or real_launch(fn, *args))
    x = torch.randn(4, 64)
    want = moegemm.reference.quantize(x, "bf16")
    for backend in ("auto", "reference"):
        assert_same_fields(moegemm.quantize(x, "bf16", backend=backend), want)
    assert launched == []
    if interpreter_usable():
        assert_same_fields(moegemm.quantize(x, "bf16", backend="triton"), want)
        assert launched == ["activation_quantize_kernel"]
    with pytest.raises(ValueError, match=r"^backend: expected one of \['auto', 'reference', 'triton'\], got 'sm90'"):
        moegemm.quantize(x, "bf16", backend="sm90")


# The GPU: the same kernel compiled, at a real size.

@pytest.mark.gpu
def test_quantize_on_cuda_launches_the_kernel(monkeypatch):
    """Every format's quantize of CUDA tokens is one launch of the activation kernel (nvfp4's
    default global scale: one pass of the amax kernel before it)."""
    from moegemm.kernels import quantize_kernels

    launched = []
    real_launch = quantize_kernels.launch
    monkeypatch.setattr(quantize_kernels, "launch",
                        lambda fn, *args: launched.append(fn.__name__) or real_launch(fn, *args))
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    a_offsets = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    for fmt, layout in KERNEL_CASES:
        launched.clear()
        moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets)
        amax = ["absolute_max_bits_kernel"] if FORMATS[fmt].a.global_scale else []
        assert launched == amax + ["activation_quantize_kernel"], (fmt, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,layout", KERNEL_CASES)
def test_quantize_on_cuda_is_the_reference_bit_for_bit(fmt, layout):
    """4096 + 37 bf16 rows x 7168 (DeepSeek-V3's hidden size), slots leaving rows outside and one
    empty: the compiled kernel's every field against the PyTorch quantizer on the same GPU."""
    m, k = 4096 + 37, 7168
    x = edge_rows(m, k, fmt, "cuda", torch.bfloat16)
    a_offsets = torch.tensor([5, 1000, 1000, 3001, 4100], dtype=torch.int32, device="cuda")
    got = moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets)
    blocks = scale_blocks_bound(m, a_offsets) if layout == "swizzled" else None
    want = moegemm.reference.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets, num_scale_blocks=blocks)
    assert_same_fields(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "mxfp4", "nvfp4", "w4a8"])
def test_quantize_on_cuda_rounds_ties_as_the_reference(fmt):
    """The compiled kernel's fast paths (sm_90's e4m3 conversion, fp8_block's and nvfp4's one
    reciprocal a block, e2m1 on the bits) on rounding_edge_rows at block scales 2^0, 2^-100 (the
    divisions rescale) and 2^100, in fp32 and as bf16 tokens (which round the midpoints'
    neighbours away: a second set of values), against the PyTorch quantizer on the same GPU; nvfp4
    under global scales 2^exponent times 1, 2^-3 (block scales 8), 2^-10 (they saturate at 448)
    and 2^20 (they vanish: zero blocks)."""
    for exponent in (0, -100, 100):
        x = rounding_edge_rows(fmt, exponent).cuda()
        globals_ = (tuple(2.0 ** (exponent + shift) for shift in (0, -3, -10, 20)) if FORMATS[fmt].a.global_scale
                    else (None, ))
        for rows in (x, x.bfloat16()):
            for given in globals_:
                got = moegemm.quantize(rows, fmt, global_scale=given)
                assert_same_fields(got, moegemm.reference.quantize(rows, fmt, global_scale=given))



@pytest.mark.gpu
@pytest.mark.parametrize("global_scale", NVFP4_EDGE_GLOBALS, ids=lambda g: f"{g:.3g}")
def test_quantize_on_cuda_rounds_nvfp4_ties_under_any_global_scale(global_scale):
    """nvfp4 under a given global scale whose block denominators are no powers of two
    (nvfp4_tie_rows): quotients on and either side of every e2m1 tie, denominators from 2^-99
    to 2^125, saturated scales and overflowing quotients, in fp32 and as bf16 tokens; the
    compiled kernel (its reciprocal a block; elements and denominators times 2^64 for globals
    below 2^-90) against the PyTorch quantizer on the same GPU, bit for bit."""
    x = nvfp4_tie_rows(global_scale).cuda()
    for rows in (x, x.bfloat16()):
        got = moegemm.quantize(rows, "nvfp4", global_scale=global_scale)
        assert_same_fields(got, moegemm.reference.quantize(rows, "nvfp4", global_scale=global_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("global_scale", NVFP4_ODD_GLOBALS, ids=lambda g: f"{g:.3g}")
def test_quantize_on_cuda_takes_any_nvfp4_global_scale(global_scale):
    """nvfp4 under NVFP4_ODD_GLOBALS (nvfp4_odd_global_rows, in fp32 and as bf16 tokens): the
    compiled scale division with no slow path (rescaled by 2^-64 past 2^64, its zero and infinite
    divisors) and the rescaling below 2^-90, against the PyTorch quantizer on the same GPU."""
    x = nvfp4_odd_global_rows("cuda")
    for rows in (x, x.bfloat16()):
        got = moegemm.quantize(rows, "nvfp4", global_scale=global_scale)
        assert_same_fields(got, moegemm.reference.quantize(rows, "nvfp4", global_scale=global_scale))

@pytest.mark.gpu
def test_tokens_global_scale_on_cuda_is_nvfp4_global_scale():
    """The amax kernel on CUDA tokens (bf16 with subnormals, fp32 with a NaN, a row-strided view,
    DeepSeek-V3's width) gives quantize.nvfp4_global_scale's bits."""
    from moegemm import token_quantizers

    x = edge_rows(4096 + 37, 7168, "mxfp8", "cuda")
    with_nan = x.clone()
    with_nan[4000, 7000] = float("nan")
    for rows in (x.bfloat16(), x, with_nan, x[:, 1000:5000], -x.abs()):
        got, want = token_quantizers.tokens_global_scale(rows), nvfp4_global_scale(rows)
        assert torch.equal(bits(got), bits(want)), rows.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,layout", [("nvfp4", "swizzled"), ("mxfp8", "swizzled"), ("fp8_block", "plain"),
                                        ("bf16", "plain")])
def test_quantize_on_cuda_reads_no_device_value(fmt, layout):
    """No synchronizing call (torch's sync debug mode raises on one), so that the call is captured
    in a CUDA graph, whose replays quantize new values in place; torch.compile traces it whole."""
    x = torch.randn(500, 512, device="cuda", dtype=torch.bfloat16)
    a_offsets = torch.tensor([0, 200, 200, 450], dtype=torch.int32, device="cuda")

    def call():
        return moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets)

    call()  # (compiles outside the checks)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x.copy_(torch.randn_like(x) * 3)
    graph.replay()
    assert_same_fields(captured, call())
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    assert_same_fields(compiled(), call())
