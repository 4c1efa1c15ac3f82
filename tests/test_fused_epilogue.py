"""The fused SwiGLU epilogue (kernels/sm90/swiglu.py through ops.grouped_matmul_swiglu): against
the unfused chain it replaces (product, then swiglu_quantize) on GPU, the bf16 token form it
writes for the down product, and the op-level policy of where it runs (moegemm/fused.py)."""

import pytest
import torch

import moegemm
from moegemm.gate_up import reference_activation

FUSED_OUT = ("bf16", "mxfp8", "nvfp4", "mxfp4")


def _bytes(t):
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _gpu_problem(fmt, counts, ids, n, k, device="cuda"):
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    m = int(offsets[-1]) + 3  # rows past the last group: never written
    e = max(max(ids) + 1, 1)
    x = torch.randn(m, k, device=device)
    w = torch.randn(e, n, k, device=device) * 0.1
    layout = "swizzled" if moegemm.get_format(fmt).swizzle_capable else "plain"
    a = moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=offsets)
    b = moegemm.quantize_weights(w, fmt, scale_layout=layout)
    return offsets, torch.tensor(ids, dtype=torch.int32, device=device), a, b, layout, m, e


FUSED_CASES = [([65, 127, 3], [0, 1, 2]), ([128, 256, 512], [-1, 0, 2]), ([0, 3, 1, 2], [-1, 2, -1, 0]),
               ([300], [1]), ([1, 2, 5, 9], [0, 1, 2, 3]),
               # ~120 tokens a slot: mxfp8's 128-token tiles with tails of up to 32 (one tile of 159,
               # of 140, of 129 + a skipped slot, two of 161 = 128 + 33)
               ([159, 140, 129, 20, 161], [0, 1, -1, 2, 3])]


def _canonical_bf16_bits(t):
    """bf16 bits with every NaN one pattern and -0 as +0 (the decode's NaN payload and the sign
    of a zero are not part of the form's contract)."""
    bits = t.view(torch.int16)
    bits = torch.where(t.isnan(), torch.full_like(bits, 0x7FC0), bits)
    return torch.where((bits & 0x7FFF) == 0, torch.zeros_like(bits), bits)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("mxfp8", "mxfp4", "w4a8"))
@pytest.mark.parametrize("case", (0, 2, 5))
def test_fused_epilogue_writes_the_bf16_token_form(fmt, case):
    """The fused epilogue's bf16 token form (the down product's input where its kernel decodes,
    e.g. gpt-oss MXFP4 at prefill) is the fused operand decoded, bf16(value * 2^e), on every
    row of a valid slot: what dequantize_rows built from the operand before."""
    from moegemm import fused
    from moegemm.kernels import sm90
    from moegemm.problem import GroupedProblem
    from moegemm.token_forms import TokenForm

    counts, ids = FUSED_CASES[case]
    n, k = 256, 256
    offsets, expert_ids, a, b, layout, m, e = _gpu_problem(fmt, counts, ids, n, k)
    p = GroupedProblem(moegemm.formats.get_format(fmt), m, n, k, e, len(ids), layout, torch.bfloat16)
    bias = torch.randn(e, n, device="cuda") * 0.1
    bias[0, :8] = float("nan")  # NaN in a block of expert 0's outputs
    kw = dict(out_fmt=fmt, activation="swiglu_oai" if case % 2 else "swiglu", out_scale_layout=layout,
              num_scale_blocks=None, out_global_scale=None, alpha=1.702, limit=7.0)
    args = (p, a.data, b.data, a.scales, b.scales, offsets, expert_ids, None, torch.rand(e, device="cuda") + 0.5,
            bias)

    def kernel(out_bytes):  # (the launch ops.grouped_matmul_swiglu plans for this output)
        return sm90.plan(p, torch.device("cuda"), fused=True, out_bytes=out_bytes, expert_scales=True,
                         row_scales=False, tokens=False, scale_blocks=0 if a.scales is None else a.scales.shape[0])

    operand = fused.launch_fused(kernel(p.fmt.a.element.storage_dtype.itemsize), *args, **kw)
    form = fused.launch_fused(kernel(2), *args, out_form=TokenForm("bf16"), **kw)
    assert form.scale_layout == TokenForm("bf16") and form.scales is None and form.data.shape == (m, n // 2)
    assert form.data.dtype == torch.bfloat16
    valid = torch.zeros(m, dtype=torch.bool, device="cuda")
    for g, x in enumerate(ids):
        if x >= 0:
            valid[int(offsets[g]):int(offsets[g + 1])] = True
    if not valid.any():
        return
    want = moegemm.dequantize(operand).bfloat16()[valid]
    assert torch.equal(_canonical_bf16_bits(form.data[valid]), _canonical_bf16_bits(want))
    with pytest.raises(ValueError, match="out_form"):
        fused.launch_fused(kernel(2), *args, out_form=TokenForm("e4m3"), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("bf16", "mxfp8", "nvfp4", "w4a8", "mxfp4", "bf16_mxfp4", "bf16_nvfp4"))
@pytest.mark.parametrize("out_fmt", FUSED_OUT)
@pytest.mark.parametrize("case", range(len(FUSED_CASES)))
def test_fused_swiglu_epilogue_matches_unfused(fmt, out_fmt, case):
    counts, ids = FUSED_CASES[case]
    n, k = 256, 256
    offsets, expert_ids, a, b, layout, m, e = _gpu_problem(fmt, counts, ids, n, k)
    bias = torch.randn(e, n, device="cuda") * 0.1
    scales = torch.rand(e, device="cuda") + 0.5
    activation = "swiglu_oai" if case % 2 else "swiglu"
    nvfp4_global = torch.tensor([0.01], device="cuda") if out_fmt == "nvfp4" else None
    kw = dict(fmt=fmt, out_fmt=out_fmt, gate_up_layout="interleaved", activation=activation, expert_scales=scales,
              bias=bias, scale_layout=layout,
              a_scale_offsets=None, out_global_scale=nvfp4_global)
    if b.global_scale is not None:  # (bf16_nvfp4: the weights' global scale only)
        kw["expert_scales"] = scales * b.global_scale * (a.global_scale if a.global_scale is not None else 1.0)
    fused = moegemm.grouped_matmul_swiglu(a.data, b.data, a.scales, b.scales, offsets, expert_ids, fused=True,
                                          backend="sm90", **kw)
    unfused = moegemm.grouped_matmul_swiglu(a.data, b.data, a.scales, b.scales, offsets, expert_ids, fused=False,
                                            backend="sm90", **kw)
    # The fp32 truth: the product in fp32, then the activation (the unfused chain rounds the
    # product to bf16 first, so it is the less accurate of the two).
    h32 = moegemm.grouped_matmul(a.data, b.data, a.scales, b.scales, offsets, expert_ids, fmt=fmt,
                                 expert_scales=kw["expert_scales"], scale_layout=layout, out_dtype=torch.float32,
                                 backend="sm90")
    y32 = reference_activation(h32, activation, "interleaved", bias, offsets, expert_ids, 1.702, 7.0)
    valid = torch.zeros(m, dtype=torch.bool, device="cuda")
    for g, x in enumerate(ids):
        if x >= 0:
            valid[int(offsets[g]):int(offsets[g + 1])] = True
    if valid.any():
        got = moegemm.dequantize(fused)[valid]
        scale = y32[valid].abs().max()
        if out_fmt == "bf16":
            torch.testing.assert_close(got, y32[valid], rtol=1e-2, atol=1e-3 * float(scale))
            torch.testing.assert_close(moegemm.dequantize(unfused)[valid], y32[valid], rtol=2e-2,
                                       atol=5e-3 * float(scale))
        else:
            truth = moegemm.reference.quantize(y32, out_fmt, global_scale=kw["out_global_scale"])
            same = (_bytes(fused.data)[valid] == _bytes(truth.data)[valid]).float().mean().item()
            assert same > 0.97, same
            step = 0.35 if out_fmt in ("nvfp4", "mxfp4") else 0.13
            want = moegemm.dequantize(truth)[valid]
            assert (got - want).abs().max() <= step * want.abs().max() + 1e-6
    if fused.scales is not None and layout == "swizzled":
        # Every scale row but those of valid tokens (padding rows of each group's 128-row
        # block, skipped slots, blocks past the groups) stays zero.
        rows, scale_rows, _ = moegemm.layouts.a_scale_rows(offsets)
        padded = moegemm.layouts._padded_from_atoms(fused.scales.view(torch.uint8))
        mask = torch.ones(padded.shape[0], dtype=torch.bool, device="cuda")
        mask[scale_rows[valid[rows]]] = False
        assert int(padded[mask].count_nonzero()) == 0


def test_fused_epilogue_choice_follows_the_measurements():
    # The layer skips the fused epilogue only where it measured slower: mxfp8 weights on the
    # 128-token promotion tiles (~128 tokens a slot), e2m1 weights on the split-K promotion
    # kernel (decode); the other tiles and formats keep it (mxfp8 with many tokens a slot runs
    # the decoding kernel).
    from moegemm.fused import fused_pays

    assert not fused_pays("mxfp8", 4096, 7168, 128.0)
    assert fused_pays("mxfp8", 4096, 7168, 3000.0)  # the decoding kernel's 256-token tiles
    assert fused_pays("mxfp8", 4096, 7168, 2.0)
    assert not fused_pays("mxfp4", 5760, 1440, 2.0)  # e2m1 weights at decode: the split-K kernel,
    assert fused_pays("mxfp4", 5760, 1440, 4 / 128)  # but for a few tiles an SM
    assert fused_pays("mxfp4", 5760, 1440, 128.0)
    assert fused_pays("mxfp8", 4096, 7168, 40.0)  # 64-token promotion tiles
    for fmt in ("bf16", "mxfp4", "nvfp4", "w4a8", "fp8_block"):
        assert fused_pays(fmt, 4096, 7168, 128.0)


@pytest.mark.gpu
@pytest.mark.parametrize("out_fmt", ("mxfp8", "nvfp4", "mxfp4"))
def test_fused_swiglu_epilogue_gives_nan_blocks_the_nan_scale(out_fmt):
    """One NaN weight makes one output column NaN in its expert's rows, a NaN among finite
    values in each of their blocks: the fused requantization gives those blocks the NaN scale
    (their values NaN), as the reference quantizer does with the fp32 truth, and every other
    block a finite one (a block amax that dropped the NaN would read it back as a number)."""
    counts, ids = [65, 127, 3], [0, 1, 2]
    offsets, expert_ids, a, b, layout, m, _ = _gpu_problem("bf16", counts, ids, 256, 256)
    b.data[1, 6, 5] = float("nan")  # (interleaved gate/up: the gate of output column 3, expert 1)
    kw = dict(fmt="bf16", out_fmt=out_fmt, gate_up_layout="interleaved", activation="swiglu", scale_layout=layout,
              out_global_scale=torch.tensor([0.01], device="cuda") if out_fmt == "nvfp4" else None)
    fused = moegemm.grouped_matmul_swiglu(a.data, b.data, a.scales, b.scales, offsets, expert_ids, fused=True,
                                          backend="sm90", **kw)
    h32 = moegemm.grouped_matmul(a.data, b.data, a.scales, b.scales, offsets, expert_ids, fmt="bf16",
                                 out_dtype=torch.float32, backend="sm90")
    y32 = reference_activation(h32, "swiglu", "interleaved", None, offsets, expert_ids, 1.702, 7.0)
    truth = moegemm.reference.quantize(y32, out_fmt, global_scale=kw["out_global_scale"])
    valid = torch.zeros(m, dtype=torch.bool, device="cuda")
    valid[:int(offsets[-1])] = True
    nan = moegemm.dequantize(truth)[valid].isnan()
    assert bool(nan[65:192].any()) and not bool(nan[:65].any())
    assert torch.equal(moegemm.dequantize(fused)[valid].isnan(), nan)
