"""The MoE layer: activation quantizers, the fused SwiGLU epilogue, moe_forward, the module,
its loaders, torch.compile and CUDA graphs."""

import pytest
import torch

import moegemm
from moegemm.gate_up import ACTIVATIONS, GATE_UP_LAYOUTS, deinterleave_gate_up, swiglu
from moegemm.kernels import quantize_kernels
from moegemm.kernels.tl_source import interpreter_usable
from moegemm.token_quantizers import gather_quantize, scatter_quantize, swiglu_quantize, token_of_row

from cases import dequantized_experts

needs_interpreter = pytest.mark.skipif(not interpreter_usable(), reason="Triton's CPU interpreter needs numpy < 2.4")
A_FORMATS = ("bf16", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "w4a8")
# bf16 activations against block-scaled weights: their tokens are bf16, as the bf16 format's.
WEIGHT_ONLY = ("bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")
LAYER_FORMATS = A_FORMATS + WEIGHT_ONLY
# The inputs hold inf, NaN and values near fp32's limit on purpose: the interpreter's numpy
# reports the IEEE results they give (inf / inf, 3e38 * 2).
IEEE_EDGES = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")

def _bytes(t):
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_quantized(q, r):
    assert torch.equal(_bytes(q.data), _bytes(r.data))
    if r.scales is None:
        assert q.scales is None
    else:
        assert torch.equal(_bytes(q.scales), _bytes(r.scales))


def test_interleave_gate_up_round_trip():
    gate, up = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    both = moegemm.interleave_gate_up(gate, up)
    assert both.shape == (3, 10, 8)
    assert torch.equal(both[:, 0::2], gate) and torch.equal(both[:, 1::2], up)
    g, u = deinterleave_gate_up(both)
    assert torch.equal(g, gate) and torch.equal(u, up)
    with pytest.raises(ValueError, match="up"):
        moegemm.interleave_gate_up(gate, up[:, :4])


def _rows(m, k, device="cpu"):
    """Rows spanning 6 decades, a zero block and a negative zero (the scale rules' edge cases)."""
    x = torch.randn(m, k, device=device) * torch.logspace(-3, 3, m, device=device)[:, None]
    x[min(2, m - 1), :40] = 0
    x[0, 1] = -0.0
    return x


@needs_interpreter
@pytest.mark.parametrize("fmt", LAYER_FORMATS)
def test_gather_quantize_is_bitwise_quantize(fmt):
    x = _rows(29, 160)
    q = gather_quantize(x, fmt)
    assert_same_quantized(q, moegemm.reference.quantize(x, fmt, global_scale=q.global_scale))
    src = torch.randint(0, 29, (41,))
    q = gather_quantize(x, fmt, src)
    assert_same_quantized(q, moegemm.reference.quantize(x[src], fmt, global_scale=q.global_scale))


@needs_interpreter
@pytest.mark.parametrize("fmt", ("mxfp8", "mxfp4", "nvfp4", "w4a8"))
def test_gather_quantize_swizzled_places_each_group(fmt):
    x = _rows(37, 96)
    offsets = torch.tensor([0, 5, 5, 30, 37], dtype=torch.int32)  # an empty group, rows past 30 in one
    src = torch.randint(0, 37, (37,))
    q = gather_quantize(x, fmt, src, a_offsets=offsets, scale_layout="swizzled", num_scale_blocks=7)
    r = moegemm.reference.quantize(x[src], fmt, a_offsets=offsets, scale_layout="swizzled", num_scale_blocks=7,
                                   global_scale=q.global_scale)
    assert_same_quantized(q, r)


@needs_interpreter
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", GATE_UP_LAYOUTS)
def test_swiglu_quantize_bf16_matches_torch(activation, layout):
    h = torch.randn(23, 96) * 4
    q = swiglu_quantize(h, "bf16", activation=activation, gate_up_layout=layout)
    ref = swiglu(h, activation, gate_up_layout=layout)
    torch.testing.assert_close(q.data.float(), ref.to(torch.bfloat16).float(), rtol=2e-2, atol=1e-5)


def check_pair_words_match_pairs(fmt, device):
    """Contiguous bf16 gate/up pairs are read as one int32 word each; a strided view of the same
    values takes the [.., 2] pair loads: the same bytes and scales, with and without a bias."""
    gen = torch.Generator().manual_seed(7)
    wide = (torch.randn(40, 200, generator=gen) * 3).bfloat16()
    wide[3, 10] = float("nan")
    wide[4, :8] = 0.0
    h = wide[:, :128].contiguous().to(device)
    strided = wide.to(device)[:, :128]
    offsets = torch.tensor([0, 10, 25, 33], dtype=torch.int32, device=device)
    ids = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    for bias in (None, torch.randn(3, 128, generator=gen).to(device)):
        kwargs = dict(activation="swiglu_oai", bias=bias, a_offsets=offsets, expert_ids=ids, scale_layout="swizzled",
                      gate_up_layout="interleaved")
        q, r = (swiglu_quantize(x, fmt, **kwargs) for x in (h, strided))
        assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8))  # (bits: NaN is kept)
        assert (q.scales is None) == (r.scales is None)
        if q.scales is not None:
            assert torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))


@needs_interpreter
@pytest.mark.parametrize("fmt", ("mxfp8", "bf16"))
def test_swiglu_pair_words_match_pairs_interpreted(fmt):
    check_pair_words_match_pairs(fmt, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("mxfp8", "bf16", "mxfp4"))
def test_swiglu_pair_words_match_pairs_compiled(fmt):
    check_pair_words_match_pairs(fmt, "cuda")


@needs_interpreter
@pytest.mark.parametrize("fmt", ("fp8_block", "mxfp8", "nvfp4", "mxfp4"))
def test_swiglu_quantize_with_bias_requantizes(fmt):
    """Rows of a skipped slot and rows past the last group get no bias; values match the torch
    chain within one quantization step, and most bytes are identical (exp may differ by an ulp)."""
    h = torch.randn(40, 128) * 3
    offsets = torch.tensor([0, 10, 25, 33], dtype=torch.int32)
    ids = torch.tensor([2, -1, 0], dtype=torch.int32)
    bias = torch.randn(3, 128)
    layout = "plain" if fmt == "fp8_block" else "swizzled"
    q = swiglu_quantize(h, fmt, gate_up_layout="interleaved", activation="swiglu_oai", bias=bias,
                        a_offsets=offsets, expert_ids=ids,
                        scale_layout=layout, global_scale=1.0 if fmt == "nvfp4" else None)
    hb = h.clone()
    hb[0:10] += bias[2]
    hb[25:33] += bias[0]
    ref = moegemm.reference.quantize(swiglu(hb, "swiglu_oai"), fmt, scale_layout=layout, a_offsets=offsets,
                                     num_scale_blocks=q.scales.shape[0] if layout == "swizzled" else None,
                                     global_scale=1.0 if fmt == "nvfp4" else None)
    same = (_bytes(q.data) == _bytes(ref.data)).float().mean().item()
    assert same > 0.97
    got, want = moegemm.dequantize(q), moegemm.dequantize(ref)
    rows = torch.arange(40) < 33
    assert (got[rows] - want[rows]).abs().max() <= 0.35 * want[rows].abs().amax(dim=1).max()


def _fills(call) -> list[str]:
    """The torch fills one call dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("zeros", "zero_", "fill_", "full"):
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Recording():
        call()
    return seen


def check_plain_scales_written_whole(device, monkeypatch):
    """The row quantizer writes every plain scale of a SwiGLU or a gather (each row, each K block,
    an index past x's rows included): they are allocated without a zero fill (a torch launch less
    a call on a GPU) and come out the same from memory left dirty. The scatter form, which
    leaves the rows of dropped choices unwritten, keeps its fill."""
    from cases import dirty_allocations

    gen = torch.Generator().manual_seed(5)
    h, x = (torch.randn(24, 256, generator=gen) * 3).to(device), torch.randn(24, 128, generator=gen).to(device)
    rows = torch.tensor([3, 0, 7, 99], device=device)
    calls = {"swiglu fp8_block": lambda: swiglu_quantize(h, "fp8_block", gate_up_layout="concat"),
             "swiglu mxfp8": lambda: swiglu_quantize(h, "mxfp8", gate_up_layout="interleaved"),
             "gather mxfp4": lambda: gather_quantize(x, "mxfp4", rows)}
    clean = {name: call() for name, call in calls.items()}
    for name, call in calls.items():
        assert _fills(call) == [], name
    plan = moegemm.route(torch.tensor([[0, -1], [1, 0]], dtype=torch.int32, device=device), 2)
    assert _fills(lambda: scatter_quantize(x[:2], "fp8_block", plan.grouped_row, plan.expert_of_row,
                                           a_offsets=plan.a_offsets)) != []
    dirty_allocations(monkeypatch)
    for name, call in calls.items():
        assert_same_quantized(call(), clean[name]), name


@needs_interpreter
def test_plain_scales_are_written_whole_without_a_fill_interpreted(monkeypatch):
    check_plain_scales_written_whole("cpu", monkeypatch)


@pytest.mark.gpu
def test_plain_scales_are_written_whole_without_a_fill_compiled(monkeypatch):
    check_plain_scales_written_whole("cuda", monkeypatch)


_interpreted_activation_kernels = None  # (a module global: the interpreter resolves names in globals only)


def _interpreted_e8m0_exponents(amax: torch.Tensor, max_finite: float) -> torch.Tensor:
    """The quantizer kernels' e8m0 exponent (kernels/_codecs_tl.py, whose Gluon twin in
    kernels/sm90/swiglu.py is the same code) of each amax, run by Triton's CPU interpreter."""
    import triton
    import triton.language as tl

    global _interpreted_activation_kernels
    _interpreted_activation_kernels = quantize_kernels.kernel_module(True)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True

        @triton.jit
        def exponent_kernel(amax_ptr, out_ptr, MAX_FINITE: tl.constexpr, N: tl.constexpr):
            offsets = tl.arange(0, N)
            tl.store(out_ptr + offsets,
                     _interpreted_activation_kernels.codecs.e8m0_exponent(tl.load(amax_ptr + offsets), MAX_FINITE))

    n = 1 << (amax.numel() - 1).bit_length()
    padded = torch.zeros(n, dtype=torch.float32)
    padded[:amax.numel()] = amax
    out = torch.empty(n, dtype=torch.int32)
    exponent_kernel[(1, )](padded, out, max_finite, n)
    return out[:amax.numel()]


@needs_interpreter
@pytest.mark.parametrize("max_finite", (448.0, 6.0))
def test_quantizer_e8m0_exponent_on_every_exponent_field(max_finite):
    """The exponent from amax's bits (no division) equals codecs' exact rule for every fp32
    exponent field with the mantissas at and beside 448's and 6's (zero and subnormals in field
    0); inf and NaN give 127, which the kernels store as the NaN scale."""
    mantissas = torch.tensor([0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF],
                             dtype=torch.int32)
    fields = torch.arange(0, 255, dtype=torch.int32)
    bits = (fields[:, None] << 23 | mantissas[None, :]).flatten()
    amax = bits.view(torch.float32)
    want = moegemm.codecs.e8m0_exponent_for(amax, max_finite)
    assert torch.equal(_interpreted_e8m0_exponents(amax, max_finite), want)
    special = torch.tensor([float("inf"), float("nan")])
    assert _interpreted_e8m0_exponents(special, max_finite).tolist() == [127, 127]


@needs_interpreter
@pytest.mark.parametrize("fmt", ("mxfp8", "mxfp4"))
def test_gather_quantize_non_finite_block_gets_the_nan_scale(fmt):
    """A block holding inf, -inf or NaN gets scale 0xFF (as moegemm.quantize), so it dequantizes
    to NaN; the kernels once stored 2^127 for an infinite amax, i.e. finite values."""
    x = torch.randn(8, 64)
    x[1, 3], x[2, 40], x[3, 5] = float("inf"), float("-inf"), float("nan")
    q = gather_quantize(x, fmt, torch.arange(8))
    r = moegemm.reference.quantize(x, fmt)
    assert torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))
    assert q.scales.view(torch.uint8)[1, 0] == 255 and q.scales.view(torch.uint8)[2, 1] == 255
    got = moegemm.dequantize(q)
    assert got[1, :32].isnan().all() and got[2, 32:].isnan().all() and got[3, :32].isnan().all()
    finite = torch.ones_like(got, dtype=torch.bool)
    finite[1, :32] = finite[2, 32:] = finite[3, :32] = False
    assert torch.equal(got[finite], moegemm.dequantize(r)[finite])


def _bits(t):
    """The bits of a tensor (NaN == NaN), as integers of its element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_scatter_quantize(fmt, layout, device):
    """The gather in scatter form (each token quantized once, stored to its k rows) against the
    gather: the same bytes and scales on every row inside a slot, the same swizzled buffer
    (padding and rows of no slot zero in both), the same nvfp4 global scale. The routing drops
    choices (ids -1: rows in no slot, left unwritten) and leaves an expert empty."""
    t, k, e, hidden = 37, 3, 6, 320
    gen = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    ids[ids == 4] = 5  # expert 4 gets no tokens
    ids[torch.rand(t, k, generator=gen) < 0.15] = -1
    plan = moegemm.route(ids.to(device), e)
    assert not bool(plan.valid.all())
    x = _rows(t, hidden).to(device)
    x[5, 7] = float("nan")
    x[6, 100] = float("inf")
    kwargs = dict(a_offsets=plan.a_offsets, scale_layout=layout, num_scale_blocks=plan.scale_blocks_bound)
    got = scatter_quantize(x, fmt, plan.grouped_row, moegemm.routing.row_experts(plan), **kwargs)
    want = gather_quantize(x, fmt, plan.token_index, **kwargs)
    offsets, experts = plan.a_offsets.tolist(), plan.expert_ids.tolist()
    slot_rows = torch.zeros(t * k, dtype=torch.bool)
    for g, expert in enumerate(experts):
        if expert >= 0:
            slot_rows[offsets[g]:offsets[g + 1]] = True
    assert 0 < int(slot_rows.sum()) < t * k
    assert got.data.shape == want.data.shape and got.data.dtype == want.data.dtype
    assert torch.equal(_bits(got.data).cpu()[slot_rows], _bits(want.data).cpu()[slot_rows])
    if want.scales is None:
        assert got.scales is None
    elif layout == "swizzled":
        assert torch.equal(_bits(got.scales).cpu(), _bits(want.scales).cpu())
    else:
        assert torch.equal(_bits(got.scales).cpu()[slot_rows], _bits(want.scales).cpu()[slot_rows])
    if want.global_scale is not None:
        assert torch.equal(got.global_scale, want.global_scale)


SCATTER_CASES = ([(f, "plain") for f in A_FORMATS] + [(f, "swizzled") for f in ("mxfp8", "mxfp4", "nvfp4", "w4a8")]
                 + [("bf16_mxfp4", "swizzled"), ("bf16_nvfp4", "plain")])


@IEEE_EDGES
@needs_interpreter
@pytest.mark.parametrize("fmt,layout", SCATTER_CASES)
def test_scatter_quantize_matches_the_gather_interpreted(fmt, layout):
    check_scatter_quantize(fmt, layout, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,layout", SCATTER_CASES)
def test_scatter_quantize_matches_the_gather_compiled(fmt, layout):
    check_scatter_quantize(fmt, layout, "cuda")


@needs_interpreter
@pytest.mark.parametrize("fmt", ("bf16", "fp8_block", "mxfp4"))
def test_the_quantizer_plans_a_launch_per_host_value(fmt):
    """The activation kernel's launch is planned once per host values (quantize_kernels.rows_launch):
    the same 16 x 96 rows as contiguous bf16 (read as word pairs), bf16 at an odd element offset
    (no pairs), fp32 and fp32 of another row stride, each quantized after the others, get the
    reference's bytes; the swizzled layout without a_offsets raises at every call."""
    x = _rows(16, 96)
    odd = torch.zeros(16 * 96 + 1, dtype=torch.bfloat16)
    odd[1:] = x.bfloat16().flatten()
    wide = torch.zeros(16, 97)
    wide[:, :96] = x
    rows = {"bf16": x.bfloat16(), "bf16 at an odd offset": odd[1:].view(16, 96), "fp32": x,
            "fp32 of row stride 97": wide[:, :96]}
    for name, tokens in rows.items():
        assert_same_quantized(gather_quantize(tokens, fmt), moegemm.reference.quantize(tokens.float(), fmt)), name
    if fmt == "mxfp4":
        for _ in range(2):
            with pytest.raises(ValueError, match="^a_offsets: required"):
                gather_quantize(x, fmt, scale_layout="swizzled")


def test_token_of_row_is_the_plans_token_index():
    """The scatter form's fallback (no kernel) gathers through token_of_row(grouped_row)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 7, (29, 4), generator=gen, dtype=torch.int32)  # some dropped
    plan = moegemm.route(ids, 6)
    assert torch.equal(token_of_row(plan.grouped_row), plan.token_index)


def test_scatter_quantize_rejects_bad_rows():
    x = torch.randn(4, 64)
    offsets = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="grouped_row"):
        scatter_quantize(x, "fp8_block", torch.zeros(4, 2), torch.zeros(8, dtype=torch.int32), a_offsets=offsets)
    with pytest.raises(ValueError, match="grouped_row"):
        scatter_quantize(x, "fp8_block", torch.zeros(3, 2, dtype=torch.int64), torch.zeros(6, dtype=torch.int32),
                         a_offsets=offsets)
    with pytest.raises(ValueError, match="row_slot"):
        scatter_quantize(x, "fp8_block", torch.zeros(4, 2, dtype=torch.int64), torch.zeros(7, dtype=torch.int32),
                         a_offsets=offsets)
    with pytest.raises(ValueError, match="scale_layout"):
        scatter_quantize(x, "fp8_block", torch.zeros(4, 2, dtype=torch.int64), torch.zeros(8, dtype=torch.int32),
                         a_offsets=offsets, scale_layout="swizzled")


@needs_interpreter
@IEEE_EDGES
def test_swiglu_quantize_nvfp4_default_global_ignores_rows_outside_slots():
    """The default nvfp4 global scale is amax over the rows of valid slots only: the layer's h is
    unfilled (torch.empty) outside them, and inf or NaN there once made every expert scale inf."""
    h = torch.randn(40, 128) * 3
    offsets = torch.tensor([0, 10, 25, 33], dtype=torch.int32)
    ids = torch.tensor([2, -1, 0], dtype=torch.int32)
    clean = h.clone()
    clean[10:25] = 0
    clean[33:] = 0
    h[12], h[30 + 5] = float("inf"), float("nan")  # a skipped slot's row, a row past the last group
    h[37, :64] = 1e30
    q = swiglu_quantize(h, "nvfp4", gate_up_layout="interleaved", a_offsets=offsets, expert_ids=ids)
    want = swiglu_quantize(clean, "nvfp4", gate_up_layout="interleaved", a_offsets=offsets, expert_ids=ids)
    assert torch.isfinite(q.global_scale) and bool(q.global_scale > 0)
    assert torch.equal(q.global_scale, want.global_scale)
    valid = torch.zeros(40, dtype=torch.bool)
    valid[0:10] = valid[25:33] = True
    assert torch.equal(_bytes(q.data)[valid], _bytes(want.data)[valid])


def test_select_experts_routers():
    logits = torch.randn(6, 8)
    ids, w = moegemm.select_experts(logits, 2, "softmax_topk")
    probs = logits.softmax(-1)
    assert torch.equal(ids.long(), probs.topk(2).indices)
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    ids, w = moegemm.select_experts(logits, 3, "topk_softmax")
    torch.testing.assert_close(w, logits.topk(3).values.softmax(-1))
    bias = torch.randn(8)
    ids, w = moegemm.select_experts(logits, 2, "sigmoid_grouped", correction_bias=bias, n_group=4, topk_group=2,
                                    routed_scaling_factor=2.5)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), 2.5))
    with pytest.raises(ValueError, match="router"):
        moegemm.select_experts(logits, 2, "nope")


def reference_layer(x, ids, weights, gate, up, down, activation="swiglu", gate_up_bias=None, down_bias=None):
    """Per-token loop in fp64: sum_j w_j * (down_e @ act(gate_e x, up_e x) + down_bias_e)."""
    t = x.shape[0]
    out = torch.zeros(t, down.shape[1], dtype=torch.float64)
    for ti in range(t):
        xt = x[ti].double()
        for j in range(ids.shape[1]):
            e = int(ids[ti, j])
            if not 0 <= e < gate.shape[0]:
                continue
            g, u = gate[e].double() @ xt, up[e].double() @ xt
            if gate_up_bias is not None:
                g, u = g + gate_up_bias[e, 0::2].double(), u + gate_up_bias[e, 1::2].double()
            hid = swiglu(torch.stack((g, u), -1).reshape(1, -1), activation).double()[0]
            y = down[e].double() @ hid
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[ti] += float(weights[ti, j]) * y
    return out


# Relative error of the layer against reference_layer on the DEQUANTIZED weights: what is left is
# the quantization of the tokens and of the intermediate. Weighed against the unquantized weights,
# one token's error was a coin toss near bounds of 0.4 (mxfp4) and 0.3 (nvfp4) (sm90, 120 draws of one token: mxfp4 median
# 0.30, max 0.54 against 0.4; nvfp4 0.23, 0.34 against 0.3). On the dequantized weights (sm90, one
# H100, bench/results/layer-error-distribution-*.json; the CPU's reference backend agrees): median
# and max of one token's 120 draws mxfp4 0.224 / 0.342 (a long tail: the CPU's 300 draws had sd
# 0.025, max 0.294), nvfp4 0.166 / 0.231, w4a8 0.047 / 0.065, mxfp8 0.047 / 0.063,
# fp8_block 0.044 / 0.059, bf16 0.003 / 0.0034; 5 and 300 tokens lower.
# The weight-only formats quantize neither the tokens nor the intermediate (bf16 roundings only):
# the bf16 bound. Their median and max over 300 draws of this test on the CPU (reference backend):
# bf16_mxfp4 0.0039 / 0.0050, bf16_nvfp4 0.0038 / 0.0052, bf16_mxfp8 0.0038 / 0.0049 (bf16 0.0038 /
# 0.0052), against the dequantized weights. Against the float weights they lose what their weights
# do, one draw e.g. 0.21 (bf16_mxfp4), 0.17 (bf16_nvfp4), 0.048 (bf16_mxfp8) where mxfp4 lost 0.32.
MOE_TOL = {"bf16": 1e-2, "fp8_block": 0.1, "mxfp8": 0.1, "w4a8": 0.12, "mxfp4": 0.5, "nvfp4": 0.35,
           "bf16_mxfp4": 1e-2, "bf16_nvfp4": 1e-2, "bf16_mxfp8": 1e-2}


def _layer_weights(e, i, h, device="cpu"):
    return (torch.randn(e, i, h, device=device) * 0.1, torch.randn(e, i, h, device=device) * 0.1,
            torch.randn(e, h, i, device=device) * 0.1)


def _rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@needs_interpreter
@pytest.mark.parametrize("fmt", LAYER_FORMATS)
def test_moe_forward_matches_reference_cpu(fmt):
    t, h, i, e, k = 7, 64, 128, 5, 2
    gate, up, down = _layer_weights(e, i, h)
    layer = moegemm.MoE(h, i, e, k, fmt=fmt).load_experts(gate=gate, up=up, down=down)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    ids[1, 0] = -1  # a dropped choice
    weights = torch.rand(t, k)
    w_gate_up, w_down = layer.weights()
    y = moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout=layer.gate_up_layout,
                            backend="reference")
    assert y.shape == (t, h) and y.dtype == torch.bfloat16
    assert _rel_err(y, reference_layer(x, ids, weights, *dequantized_experts(layer))) < MOE_TOL[fmt]


@needs_interpreter
def test_moe_module_gpt_oss_variant_with_biases():
    h, i, e, k = 64, 64, 4, 2
    gate, up, down = _layer_weights(e, i, h)
    gate_up_bias, down_bias = torch.randn(e, 2 * i) * 0.1, torch.randn(e, h) * 0.1
    layer = moegemm.MoE(h, i, e, k, fmt="bf16", activation="swiglu_oai", router="topk_softmax", router_bias=True,
                        expert_bias=True, backend="reference")
    layer.load_router(torch.randn(e, h, dtype=torch.bfloat16), torch.randn(e, dtype=torch.bfloat16))
    gate_up = moegemm.interleave_gate_up(gate, up)
    layer.load_experts(gate_up=gate_up, gate_up_order="interleaved", down=down, gate_up_bias=gate_up_bias,
                       down_bias=down_bias)
    x = torch.randn(2, 3, h, dtype=torch.bfloat16)
    y = layer(x)
    ids, weights = layer.route_tokens(x.reshape(-1, h))
    want = reference_layer(x.reshape(-1, h), ids, weights, gate, up, down, "swiglu_oai", gate_up_bias, down_bias)
    assert y.shape == x.shape
    assert _rel_err(y.reshape(-1, h), want) < 2e-2


@pytest.mark.parametrize("fmt,prepack", [("fp8_block", None), ("nvfp4", None), ("mxfp8", None),
                                         ("bf16_mxfp4", True), ("bf16", None)])
def test_load_experts_quantizes_a_chunk_of_experts_at_a_time(fmt, prepack, monkeypatch):
    """load_experts gives its quantizer at most QUANTIZE_CHUNK weights at a time (its temporaries
    are fp32 copies of what it is given: GBs for a whole layer of a large model), and stores
    what quantizing the layer at once gives, every field bit for bit (codes, scales in their
    layout, nvfp4's per-expert global scales, the prepacked order). Here chunks of 3 of 8 experts
    (the last one short) for gate/up, 6 for down."""
    e, i, h = 8, 64, 64
    gate, up, down = _layer_weights(e, i, h)
    whole = moegemm.MoE(h, i, e, 2, fmt=fmt, prepack=prepack).load_experts(gate=gate, up=up, down=down)
    calls = []
    quantize = moegemm.moe.weights.quantize_weights
    monkeypatch.setattr(moegemm.moe.weights, "quantize_weights", lambda w, *args, **kw: calls.append(w.shape[0]) or
                        quantize(w, *args, **kw))
    monkeypatch.setattr(moegemm.moe.weights, "QUANTIZE_CHUNK", 3 * 2 * i * h)
    chunked = moegemm.MoE(h, i, e, 2, fmt=fmt, prepack=prepack).load_experts(gate=gate, up=up, down=down)
    assert calls == [3, 3, 2, 6, 2]
    for q, r in zip(chunked.weights(), whole.weights()):
        assert q.prepacked == r.prepacked == bool(prepack) and q.scale_layout == r.scale_layout
        assert_same_quantized(q, r)
        assert (q.global_scale is None) == (r.global_scale is None)
        assert q.global_scale is None or torch.equal(q.global_scale, r.global_scale)


def test_a_loader_that_raises_leaves_the_layer_as_it_was():
    """Biases the layer was not built for (or none where it was), or weights of the wrong shape,
    raise before anything is stored: the layer keeps the weights it had, and their format,
    whichever loader raised."""
    e, i, h = 2, 128, 64
    gate, up, down = _layer_weights(e, i, h)
    plain = moegemm.MoE(h, i, e, 2, fmt="mxfp8").load_experts(gate=gate, up=up, down=down)
    biased = moegemm.MoE(h, i, e, 2, fmt="mxfp8", expert_bias=True)
    held = [w.data.clone() for w in plain.weights()]
    fp8 = {name: w.to(torch.float8_e4m3fn) for name, w in (("gate", gate), ("up", up), ("down", down))}
    scales = {f"{name}_scale_inv": torch.ones(e, -(-w.shape[1] // 128), -(-w.shape[2] // 128))
              for name, w in fp8.items()}
    with pytest.raises(ValueError, match="expert_bias=False"):
        plain.load_experts(gate=gate * 2, up=up, down=down, down_bias=torch.zeros(e, h))
    with pytest.raises(ValueError, match="expert_bias=True"):
        biased.load_fp8_block(**fp8, **scales)  # (mxfp8: requantized, as load_experts would)
    assert biased.gate_up_data is None and biased.down_data is None
    assert all(torch.equal(t.view(torch.uint8), w.data.view(torch.uint8)) for t, w in zip(held, plain.weights()))
    # A layer built with fmt=None keeps its loaded bf16 weights, and their format, when load_mxfp4 raises.
    layer = moegemm.MoE(h, i, e, 2).load_experts(gate=gate, up=up, down=down)
    x = torch.randn(3, h, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x)
    with pytest.raises(ValueError, match="gate_up_blocks"):
        layer.load_mxfp4(gate_up_blocks=torch.zeros(e, 2 * i, h // 32, 8, dtype=torch.uint8),
                         gate_up_scales=torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8),
                         down_blocks=torch.zeros(e, h, i // 32, 16, dtype=torch.uint8),
                         down_scales=torch.zeros(e, h, i // 32, dtype=torch.uint8))
    assert (layer.fmt, layer.gate_up_layout, layer.scale_layout) == ("bf16", "interleaved", "plain")
    with torch.no_grad():
        assert torch.equal(layer(x), want)


def test_load_fp8_block_keeps_the_checkpoint_bytes():
    e, i, h = 2, 128, 256
    gate, up, down = _layer_weights(e, i, h)
    qg, qu, qd = (moegemm.quantize_weights(w, "fp8_block") for w in (gate, up, down))
    layer = moegemm.MoE(h, i, e, 2, fmt="fp8_block")
    layer.load_fp8_block(gate=qg.data, up=qu.data, down=qd.data, gate_scale_inv=qg.scales, up_scale_inv=qu.scales,
                         down_scale_inv=qd.scales)
    assert torch.equal(_bytes(layer.gate_up_data[:, :i]), _bytes(qg.data))
    assert torch.equal(_bytes(layer.gate_up_data[:, i:]), _bytes(qu.data))
    assert torch.equal(layer.gate_up_scales, torch.cat((qg.scales, qu.scales), 1))
    with pytest.raises(TypeError, match="gate"):
        layer.load_fp8_block(gate=gate, up=qu.data, down=qd.data, gate_scale_inv=qg.scales,
                             up_scale_inv=qu.scales, down_scale_inv=qd.scales)
    # The checkpoint's bytes kept or not, a layer built with expert biases gets none from it: raises.
    biased = moegemm.MoE(h, i, e, 2, fmt="fp8_block", expert_bias=True)
    with pytest.raises(ValueError, match="expert_bias=True"):
        biased.load_fp8_block(gate=qg.data, up=qu.data, down=qd.data, gate_scale_inv=qg.scales,
                              up_scale_inv=qu.scales, down_scale_inv=qd.scales)
    assert biased.gate_up_data is None and biased.down_data is None


@pytest.mark.parametrize("fmt", (None, "bf16_mxfp4", "mxfp4", "w4a8", "bf16"))
def test_load_mxfp4_gpt_oss_blocks(fmt):
    """Without a format the layer keeps gpt-oss's MXFP4 bytes with bf16 activations (bf16_mxfp4);
    mxfp4 and w4a8 keep them too, other formats dequantize."""
    e, i, h = 2, 64, 64
    gate_up = torch.randn(e, 2 * i, h)
    down = torch.randn(e, h, i)
    q_gu = moegemm.quantize_weights(gate_up, "mxfp4")
    q_dn = moegemm.quantize_weights(down, "mxfp4")
    blocks = lambda q: q.data.reshape(*q.data.shape[:2], -1, 16)  # noqa: E731  gpt-oss [E, out, in/32, 16]
    layer = moegemm.MoE(h, i, e, 2, fmt=fmt)
    layer.load_mxfp4(gate_up_blocks=blocks(q_gu), gate_up_scales=q_gu.scales.view(torch.uint8),
                     down_blocks=blocks(q_dn), down_scales=q_dn.scales.view(torch.uint8))
    w_gate_up, w_down = layer.weights()
    assert layer.fmt == (fmt or "bf16_mxfp4") and w_gate_up.fmt == layer.fmt
    if fmt in (None, "bf16_mxfp4"):
        assert (layer.gate_up_layout, layer.scale_layout) == ("interleaved", "swizzled")
        # the bytes kept (prepacked where the sm90 kernels read them: not on the CPU)
        assert not w_down.prepacked and torch.equal(w_down.data, q_dn.data)
        x = torch.randn(5, h, dtype=torch.bfloat16)  # the layer runs, its tokens in bf16
        ids = torch.tensor([[0, 1], [1, 0], [1, -1], [0, 1], [0, 0]], dtype=torch.int32)
        weights = torch.rand(5, 2)
        got = moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout="interleaved")
        want = reference_layer(x, ids, weights, *dequantized_experts(layer))
        assert _rel_err(got, want) < MOE_TOL["bf16_mxfp4"]
    if fmt == "bf16":
        torch.testing.assert_close(w_gate_up.data.float(), moegemm.dequantize(q_gu))
    else:
        assert torch.equal(w_gate_up.data, q_gu.data)
        plain = moegemm.layouts.unswizzle_b_scales(w_gate_up.scales, 2 * i, h // 32)
        assert torch.equal(plain.view(torch.uint8), q_gu.scales.view(torch.uint8))


def test_load_mxfp4_default_format_needs_its_sizes():
    """The default format of load_mxfp4 (bf16_mxfp4) takes K in blocks of 32: a layer of another
    width is named before anything is loaded."""
    e, i, h = 2, 48, 64
    layer = moegemm.MoE(h, i, e, 2)
    with pytest.raises(ValueError, match="^intermediate_size:"):
        layer.load_mxfp4(gate_up_blocks=torch.zeros(e, 2 * i, h // 32, 16, dtype=torch.uint8),
                         gate_up_scales=torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8),
                         down_blocks=torch.zeros(e, h, i // 32, 16, dtype=torch.uint8),
                         down_scales=torch.zeros(e, h, i // 32, dtype=torch.uint8))


@needs_interpreter
def test_moe_forward_plans_its_products_once(monkeypatch):
    """The layer's products run through the plans its layer plan keeps: a repeated call builds no
    plan and derives no product key; other expert scales (other call facts) build and validate
    their own plans."""
    from moegemm import plan as product_plans
    from moegemm.moe import plan as layer_plans

    t, h, i, e, k = 5, 64, 64, 4, 2
    gate, up, down = _layer_weights(e, i, h)
    layer = moegemm.MoE(h, i, e, k, fmt="mxfp8").load_experts(gate=gate, up=up, down=down)
    w_gate_up, w_down = layer.weights()
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)

    def call(**scales):
        return moegemm.moe_forward(x, ids, None, w_gate_up, w_down, gate_up_layout=layer.gate_up_layout,
                                   backend="reference", **scales)

    first = call()
    built, keyed = [], []
    real_build, real_key = layer_plans.build_plan, product_plans._key
    monkeypatch.setattr(layer_plans, "build_plan", lambda *a, **kw: built.append(1) or real_build(*a, **kw))
    monkeypatch.setattr(product_plans, "_key", lambda *a, **kw: keyed.append(1) or real_key(*a, **kw))
    assert torch.equal(call(), first)
    assert built == [] and keyed == []
    scaled = call(gate_up_scales=torch.ones(e), down_scales=torch.ones(e))  # (exact: scales of 1)
    assert len(built) == 2 and keyed == []
    assert torch.equal(scaled, first)
    with pytest.raises(ValueError, match="expert_scales"):
        call(gate_up_scales=torch.ones(e + 1))


@needs_interpreter
def test_moe_forward_plans_each_token_count():
    """The layer plan is kept per shape (moe/plan.py, plan_layer): 5, then 300 tokens (another
    bound of the swizzled token scales' blocks, which the plan carries), then 5 again give the
    reference layer's result, the last call the first's bits."""
    h, i, e, k = 64, 64, 4, 2
    gate, up, down = _layer_weights(e, i, h)
    layer = moegemm.MoE(h, i, e, k, fmt="mxfp8").load_experts(gate=gate, up=up, down=down)
    w_gate_up, w_down = layer.weights()
    assert w_gate_up.scale_layout == "swizzled"
    results = []
    for t in (5, 300, 5):
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(t, h, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
        weights = torch.rand(t, k, generator=gen)
        y = moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout=layer.gate_up_layout,
                                backend="reference")
        assert _rel_err(y, reference_layer(x, ids, weights, *dequantized_experts(layer))) < MOE_TOL["mxfp8"]
        results.append(y)
    assert torch.equal(results[0], results[2])


def test_moe_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="router"):
        moegemm.MoE(64, 64, 4, 2, router="nope")
    with pytest.raises(ValueError, match="top_k"):
        moegemm.MoE(64, 64, 4, 5)
    with pytest.raises(ValueError, match="intermediate_size"):
        moegemm.MoE(64, 40, 4, 2, fmt="mxfp8")
    layer = moegemm.MoE(64, 64, 4, 2)
    with pytest.raises(ValueError, match="no expert weights"):
        layer(torch.randn(3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="down"):
        layer.load_experts(gate=torch.randn(4, 64, 64), up=torch.randn(4, 64, 64), down=torch.randn(4, 64, 32))
    layer.load_experts(gate=torch.randn(4, 64, 64), up=torch.randn(4, 64, 64), down=torch.randn(4, 64, 64))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(3, 32))
    w_gate_up, w_down = layer.weights()
    with pytest.raises(ValueError, match="topk_ids"):
        moegemm.moe_forward(torch.randn(3, 64), torch.zeros(2, 2, dtype=torch.int32), None, w_gate_up, w_down,
                            gate_up_layout="interleaved")
    with pytest.raises(TypeError, match="w_down"):
        moegemm.moe_forward(torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int32), None, w_gate_up, w_down.data,
                            gate_up_layout="interleaved")
    with pytest.raises(ValueError, match="activation"):
        moegemm.moe_forward(torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int32), None, w_gate_up, w_down,
                            gate_up_layout="interleaved", activation="gelu")


def test_moe_forward_fake_gives_the_output_shape():
    """The custom op's fake implementation: what torch.compile traces through."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = moegemm.MoE(64, 64, 4, 2).load_experts(gate=torch.randn(4, 64, 64), up=torch.randn(4, 64, 64),
                                                    down=torch.randn(4, 64, 64))
    w_gate_up, w_down = layer.weights()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        ids = torch.empty(5, 2, dtype=torch.int32)
        y = torch.ops.moegemm.moe_forward(x, ids, None, w_gate_up.data, None, None, w_down.data, None, None, "bf16",
                                          "plain", "swiglu", "interleaved", None, None, None, None, None, None,
                                          1.702, 7.0, True, "auto", False, False)
    assert y.shape == (5, 64) and y.dtype == torch.bfloat16


@needs_interpreter
def test_torch_compile_fullgraph_cpu():
    """torch.compile traces the routed experts as the one moegemm::moe_forward op (the local
    path's traced call, compile_boundary.py), and the compiled layer computes the eager one."""
    layer = moegemm.MoE(64, 64, 4, 2, backend="reference").load_experts(
        gate=torch.randn(4, 64, 64) * 0.1, up=torch.randn(4, 64, 64) * 0.1, down=torch.randn(4, 64, 64) * 0.1)
    layer.load_router(torch.randn(4, 64, dtype=torch.bfloat16))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    traced = []

    def recording(gm, inputs):
        traced.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm

    compiled = torch.compile(layer, fullgraph=True, backend=recording)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x))
    assert traced.count(torch.ops.moegemm.moe_forward.default) == 1


# ---- GPU: the layer through sm90 (the fused epilogue: tests/test_fused_epilogue.py) ---------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", LAYER_FORMATS)
@pytest.mark.parametrize("tokens", (1, 5, 300))
def test_moe_forward_sm90_matches_reference(fmt, tokens):
    h, i, e, k = 256, 256, 8, 2
    gate, up, down = _layer_weights(e, i, h, "cuda")
    layer = moegemm.MoE(h, i, e, k, fmt=fmt, device="cuda").load_experts(gate=gate, up=up, down=down)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)]).to(torch.int32).cuda()
    weights = torch.rand(tokens, k, device="cuda")
    w_gate_up, w_down = layer.weights()
    y = moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout=layer.gate_up_layout,
                            backend="sm90" if fmt != "fp8_block" else "auto")
    want = reference_layer(x.cpu(), ids.cpu(), weights.cpu(), *(w.cpu() for w in dequantized_experts(layer)))
    assert _rel_err(y.cpu(), want) < MOE_TOL[fmt]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("bf16", "mxfp8", "fp8_block"))
def test_cuda_graph_decode_step_replays_with_new_routing(fmt):
    h, i, e, k, t = 256, 256, 16, 4, 2
    gate, up, down = _layer_weights(e, i, h, "cuda")
    layer = moegemm.MoE(h, i, e, k, fmt=fmt, device="cuda").load_experts(gate=gate, up=up, down=down)
    w_gate_up, w_down = layer.weights()
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(t, k, dtype=torch.int32, device="cuda")
    weights = torch.rand(t, k, device="cuda")
    run = lambda: moegemm.moe_forward(x, ids, weights, w_gate_up, w_down,  # noqa: E731
                                      gate_up_layout=layer.gate_up_layout)
    for _ in range(2):
        run()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    for _ in range(3):
        ids.copy_(torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32))
        x.copy_(torch.randn(t, h, device="cuda"))
        graph.replay()
        torch.testing.assert_close(y, run(), rtol=0, atol=0)


@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu():
    h, i, e, k = 256, 256, 8, 2
    gate, up, down = _layer_weights(e, i, h, "cuda")
    layer = moegemm.MoE(h, i, e, k, fmt="mxfp8", router="softmax_topk", device="cuda")
    layer.load_experts(gate=gate, up=up, down=down).load_router(torch.randn(e, h, dtype=torch.bfloat16) * 0.1)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(7, h, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=2e-2, atol=2e-2)
