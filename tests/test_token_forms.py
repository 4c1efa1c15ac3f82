"""Tokens written in the sm90 kernels' own forms (moegemm/token_forms.py) by the layer's gather and
activation kernels (their scale_layout a TokenForm): bit-identical to the format's operand followed
by the pre-pass each kernel would otherwise run (tokens.token_prepass / decode_row_scales /
dequantize_rows / even_odd_k), on every row of a slot, under the interpreter on the CPU and
compiled on a GPU."""

import pytest
import torch

import moegemm
from cases import dirty_cached_blocks
from moegemm.formats import get_format
from moegemm.kernels import tokens as token_passes
from moegemm.kernels.tl_source import interpreter_usable
from moegemm.problem import GroupedProblem
from moegemm.token_forms import TokenForm, kb_major_column, kb_major_columns, token_form
from moegemm.token_quantizers import gather_quantize, scatter_quantize, swiglu_quantize

FORMS = [
    ("mxfp8", TokenForm("e4m3")),
    ("mxfp8", TokenForm("e4m3", column_block=16)),
    ("mxfp8", TokenForm("bf16")),
    ("mxfp4", TokenForm("e4m3", exponent=6, even_odd=True)),
    ("mxfp4", TokenForm("bf16")),
    ("w4a8", TokenForm("e4m3", even_odd=True)),
    ("w4a8", TokenForm("bf16")),
]
FORM_IDS = [f"{f}-{form.kind}-{form.column_block}" for f, form in FORMS]


def _routing(t, k, e, device, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    ids[torch.rand(t, k, generator=gen) < 0.15] = -1  # dropped choices: rows in no slot
    ids[:, 0][ids[:, 0] == 1] = 2  # expert 1 gets fewer tokens, slot starts off multiples of 4
    return moegemm.route(ids.to(device), e)


def _special_rows(x):
    """Blocks that exercise the encoders' edges: zeros, tiny values (e8m0 scale near 2^-127),
    huge ones, a NaN (its block's scale is the NaN code), and a lone large value per block."""
    x[0] = 0
    x[1] = 1e-38
    x[2, :40] = 3e38
    x[3, 5] = float("nan")
    x[4, ::32] = 1000.0
    return x


def _expected(fmt, form, q, a_offsets, expert_ids, rows, k, num_experts):
    """The operand q in `form`, as the sm90 kernels' pre-passes build it."""
    p = GroupedProblem(get_format(fmt), rows, 64, k, num_experts, a_offsets.numel() - 1, "plain", torch.bfloat16)
    if form.kind == "bf16":
        return token_passes.dequantize_rows(p, q.data, q.scales, a_offsets, expert_ids, None), None
    if get_format(fmt).a.element.packed:
        scales, data = token_passes.token_prepass(p, q.data, q.scales, a_offsets, expert_ids, None, kb_major=True,
                                              exponent=form.exponent, even_odd=form.even_odd,
                                              column_block=form.column_block)
        return data, scales
    scales = token_passes.decode_row_scales(p, q.scales, a_offsets, expert_ids, None, kb_major=True,
                                        column_block=form.column_block)
    data = token_passes.even_odd_k(q.data) if form.even_odd else q.data
    return data, scales


def _zero_as_plus(bf16_bits):
    return torch.where((bf16_bits & 0x7FFF) == 0, torch.zeros_like(bf16_bits), bf16_bits)


def _assert_same(got, fmt, form, q, a_offsets, expert_ids, num_experts):
    rows, k = got.data.shape
    want_data, want_scales = _expected(fmt, form, q, a_offsets, expert_ids, rows, k, num_experts)
    offsets = a_offsets.tolist()
    slot_rows = torch.zeros(rows, dtype=torch.bool)
    checked = 0
    for g, e in enumerate(expert_ids.tolist()):
        s, t = offsets[g], offsets[g + 1]
        if e < 0 or t <= s:
            continue
        slot_rows[s:t] = True
        if form.kind == "e4m3":
            columns = [kb_major_column(r, s, g, form.column_block) for r in range(t - s)]
            assert torch.equal(got.scales[:, columns].view(torch.int32).cpu(),
                               want_scales[:, columns].view(torch.int32).cpu()), f"scales of slot {g}"
            checked += t - s
    if form.kind == "bf16":  # bit for bit, but the sign of a zero: the pre-pass's decode gives e4m3's -0
        # as -0 compiled (hardware conversion) and +0 interpreted (a negation of +0); no product sees it
        got_bits, want_bits = (_zero_as_plus(t[slot_rows].view(torch.int16).cpu()) for t in (got.data, want_data))
    else:
        got_bits, want_bits = (t[slot_rows].view(torch.uint8).cpu() for t in (got.data, want_data))
    assert torch.equal(got_bits, want_bits)
    assert int(slot_rows.sum()) > 0 and (form.kind == "bf16" or checked == int(slot_rows.sum()))


def check_gather(fmt, form, device):
    t, k, e, hidden = 23, 3, 5, 320
    plan = _routing(t, k, e, device, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = _special_rows(torch.randn(t, hidden, generator=gen) * 4).bfloat16().to(device)
    got = gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, scale_layout=form)
    assert got.scale_layout == form and got.data.shape == (t * k, hidden) and got.k == hidden
    if form.kind == "e4m3":
        assert got.data.dtype == torch.float8_e4m3fn
        assert got.scales.shape == (hidden // 32, kb_major_columns(t * k, e, form.column_block))
    q = gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets)
    _assert_same(got, fmt, form, q, plan.a_offsets, plan.expert_ids, e)


def check_scatter(fmt, form, device):
    """The gather in scatter form: every row of a slot as from the gather (dropped choices in
    the routing are stored nowhere)."""
    t, k, e, hidden = 23, 3, 5, 320
    plan = _routing(t, k, e, device, seed=4)
    assert not bool(plan.valid.all())
    gen = torch.Generator().manual_seed(5)
    x = _special_rows(torch.randn(t, hidden, generator=gen) * 4).bfloat16().to(device)
    got = scatter_quantize(x, fmt, plan.grouped_row, moegemm.routing.row_experts(plan), a_offsets=plan.a_offsets,
                           scale_layout=form)
    assert got.scale_layout == form and got.data.shape == (t * k, hidden)
    q = gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets)
    _assert_same(got, fmt, form, q, plan.a_offsets, plan.expert_ids, e)


def check_swiglu(fmt, form, device):
    rows, inner, e = 37, 96, 4
    gen = torch.Generator().manual_seed(3)
    h = _special_rows(torch.randn(rows, 2 * inner, generator=gen) * 3).bfloat16().to(device)
    a_offsets = torch.tensor([0, 9, 10, 21, 33], dtype=torch.int32, device=device)  # rows 33.. in no slot
    expert_ids = torch.tensor([2, -1, 0, 3], dtype=torch.int32, device=device)  # slot 1 skipped
    bias = (torch.randn(e, 2 * inner, generator=gen)).to(device)
    kwargs = dict(activation="swiglu_oai", bias=bias, a_offsets=a_offsets, expert_ids=expert_ids, alpha=1.702,
                  limit=7.0)
    got = swiglu_quantize(h, fmt, gate_up_layout="interleaved", scale_layout=form, **kwargs)
    q = swiglu_quantize(h, fmt, gate_up_layout="interleaved", **kwargs)
    _assert_same(got, fmt, form, q, a_offsets, expert_ids, e)


@pytest.mark.skipif(not interpreter_usable(), reason="triton 3.6's interpreter needs numpy < 2.4")
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")  # (_special_rows' 3e38)
@pytest.mark.parametrize("fmt,form", FORMS, ids=FORM_IDS)
def test_kernel_tokens_interpreted(fmt, form):
    check_gather(fmt, form, "cpu")
    check_scatter(fmt, form, "cpu")
    check_swiglu(fmt, form, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,form", FORMS, ids=FORM_IDS)
def test_kernel_tokens_compiled(fmt, form):
    check_gather(fmt, form, "cuda")
    check_scatter(fmt, form, "cuda")
    check_swiglu(fmt, form, "cuda")


def test_token_form_follows_the_kernel_config():
    """mxfp4 at decode: the split-K promotion kernel (e4m3 times 2^6, even/odd); at prefill the
    decoding kernel (bf16). mxfp8: e4m3 on wide tiles (scales in accumulator order), None on
    narrow ones (row-major scales)."""
    assert token_form(get_format("mxfp4"), 5760, 2880, 256, 128) == TokenForm("e4m3", exponent=6, even_odd=True)
    assert token_form(get_format("w4a8"), 5760, 2880, 256, 128) == TokenForm("e4m3", exponent=0, even_odd=True)
    assert token_form(get_format("mxfp4"), 5760, 2880, 16384, 128) == TokenForm("bf16")
    assert token_form(get_format("mxfp8"), 4096, 7168, 32768, 256) == TokenForm("e4m3", column_block=16)
    assert token_form(get_format("mxfp8"), 4096, 7168, 512, 256) is None
    assert token_form(get_format("nvfp4"), 4096, 7168, 32768, 256) is None
    assert token_form(get_format("mxfp4"), 5760, 2880, 0, 128) is None
    for fmt in ("bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8"):  # their A operand is the bf16 tokens already
        assert token_form(get_format(fmt), 5760, 2880, 16384, 128) is None
        assert token_form(get_format(fmt), 5760, 2880, 256, 128) is None


def test_scatter_into_a_token_form_rejects_bad_rows():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 8], dtype=torch.int32)
    form = dict(a_offsets=offsets, scale_layout=TokenForm("e4m3"))
    with pytest.raises(TypeError, match="^grouped_row"):
        scatter_quantize(x, "mxfp8", torch.zeros(4, 2), torch.zeros(8, dtype=torch.int32), **form)
    with pytest.raises(ValueError, match="^grouped_row"):
        scatter_quantize(x, "mxfp8", torch.zeros(3, 2, dtype=torch.int64),
                         torch.zeros(6, dtype=torch.int32), **form)
    with pytest.raises(ValueError, match="^row_slot"):
        scatter_quantize(x, "mxfp8", torch.zeros(4, 2, dtype=torch.int64),
                         torch.zeros(7, dtype=torch.int32), **form)


@pytest.mark.parametrize("form,fmt,name", [(TokenForm("bf16"), "nvfp4", "scale_layout"),
                                           (TokenForm("bf16"), "fp8_block", "scale_layout"),
                                           (TokenForm("bf16"), "bf16_mxfp4", "scale_layout"),
                                           (TokenForm("fp8"), "mxfp8", "scale_layout"),
                                           (TokenForm("e4m3", column_block=8), "mxfp8", "column_block")])
def test_token_forms_reject_what_no_kernel_reads(form, fmt, name):
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"^{name}:"):
        gather_quantize(x, fmt, torch.arange(4), a_offsets=offsets, scale_layout=form)
    with pytest.raises(ValueError, match=f"^{name}:"):
        swiglu_quantize(torch.cat((x, x), 1), fmt, gate_up_layout="interleaved", a_offsets=offsets,
                        scale_layout=form)


def test_token_form_needs_a_offsets():
    with pytest.raises(ValueError, match="^a_offsets:"):
        gather_quantize(torch.zeros(4, 64), "mxfp8", scale_layout=TokenForm("bf16"))


@pytest.mark.skipif(not interpreter_usable(), reason="triton 3.6's interpreter needs numpy < 2.4")
@pytest.mark.parametrize("fmt,form", FORMS, ids=FORM_IDS)
def test_token_forms_dequantize_to_the_operands_values(fmt, form):
    """moegemm.dequantize reads a QuantizedTensor in a token form: every row of a slot has the
    values of the format's operand (the bf16 form rounds them to bf16, which holds them)."""
    t, k, e, hidden = 23, 3, 5, 320
    plan = _routing(t, k, e, "cpu", seed=6)
    x = (torch.randn(t, hidden, generator=torch.Generator().manual_seed(7)) * 4).bfloat16()
    got = gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, scale_layout=form)
    want = moegemm.dequantize(gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets))
    rows = int(plan.a_offsets[-1])
    assert rows > 0 and torch.equal(moegemm.dequantize(got)[:rows], want[:rows])
    assert not moegemm.dequantize(got)[rows:].any()


def test_a_token_form_runs_on_sm90_only():
    """A token form is what one sm90 kernel reads: the call names `a` where the problem's kernel
    reads another form, and where the call runs on another backend."""
    offsets, ids = torch.tensor([0, 8], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    w = moegemm.quantize_weights(torch.randn(1, 32, 64), "mxfp4")
    form = token_form(get_format("mxfp4"), 32, 64, 8, 1)
    assert form.kind == "e4m3"
    scales = torch.ones(2, kb_major_columns(8, 1, form.column_block))
    tokens = moegemm.QuantizedTensor(torch.zeros(8, 64, dtype=torch.float8_e4m3fn), scales, "mxfp4", "a", form, None,
                                     offsets)
    with pytest.raises(ValueError, match="^a: tokens in .* are read by the sm90 kernels only"):
        moegemm.grouped_matmul(tokens, w, None, None, offsets, ids, fmt="mxfp4")
    bf16_tokens = moegemm.QuantizedTensor(torch.zeros(8, 64).bfloat16(), None, "mxfp4", "a", TokenForm("bf16"), None,
                                          offsets)
    with pytest.raises(ValueError, match="^a: tokens in .* but the sm90 kernel of this problem reads"):
        moegemm.grouped_matmul(bf16_tokens, w, None, None, offsets, ids, fmt="mxfp4")


def test_prepacked_e2m1_weights_take_the_decoding_kernels_form(monkeypatch):
    """mxfp4 and w4a8 at ~2 tokens a slot: the plain order's e2m1 promotion kernel reads e4m3
    tokens (unfused gate/up), prepacked weights the decoding kernel's bf16 ones (fused), and the
    layer's steps follow each product's weight order."""
    from moegemm.moe import plan
    from moegemm.fused import fused_pays
    from moegemm.token_forms import TokenForm, token_form

    for fmt in ("mxfp4", "w4a8"):
        plain = token_form(get_format(fmt), 5760, 2880, 256, 128)
        assert plain.kind == "e4m3" and plain.even_odd
        assert token_form(get_format(fmt), 5760, 2880, 256, 128, prepacked=True) == TokenForm("bf16")
        assert not fused_pays(fmt, 5760, 2880, 2.0) and fused_pays(fmt, 5760, 2880, 2.0, prepacked=True)
        monkeypatch.setattr(plan, "resolve_backend", lambda backend, p, device: "sm90")
        shapes = (fmt, "swizzled", 256, 128, 2880, 5760, 128, "interleaved", "auto", torch.device("cpu"), True,
                  False, False, 2.0)
        layer = plan.plan_layer.__wrapped__(*shapes, True, True)
        assert layer.up_form == layer.down_form == TokenForm("bf16") and layer.fused
        layer = plan.plan_layer.__wrapped__(*shapes, False, True)
        assert layer.up_form == plain and layer.down_form == TokenForm("bf16") and not layer.fused


@pytest.mark.gpu
def test_a_fresh_output_of_bf16_form_tokens_reads_zero_outside_valid_slots():
    """mxfp4 tokens in the decoding kernel's bf16 form, called without out (its memory dirty): the
    kernel's FILL variant zeroes the rows no valid slot owns (dropped choices, rows past the last
    slot), and the other rows are the bits of a call into a zeroed out."""
    t, k, e, n, hidden = 300, 4, 8, 512, 1024
    plan = _routing(t, k, e, "cuda", seed=11)
    x = torch.randn(t, hidden, device="cuda").bfloat16()
    w = moegemm.quantize_weights(torch.randn(e, n, hidden, device="cuda") / 32, "mxfp4")
    tokens = gather_quantize(x, "mxfp4", plan.token_index, a_offsets=plan.a_offsets,
                             scale_layout=token_form(get_format("mxfp4"), n, hidden, t * k, e))
    assert tokens.scale_layout == TokenForm("bf16")
    rows = tokens.data.shape[0]
    args = (tokens, w, None, None, plan.a_offsets, plan.expert_ids)
    want = torch.zeros(rows, n, dtype=torch.bfloat16, device="cuda")
    moegemm.grouped_matmul(*args, fmt="mxfp4", out=want, backend="sm90")
    dirty_cached_blocks(rows * n * 2)
    got = moegemm.grouped_matmul(*args, fmt="mxfp4", backend="sm90")
    free = got[int(plan.a_offsets[-1]):].view(torch.int16)
    assert free.numel() and torch.equal(free, torch.zeros_like(free)), "a row past the last slot is not +0"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
