"""The token pre-pass of the sm90 block-format kernel (kernels/tokens.py, dequantize_rows): bit-identical
to moegemm.dequantize on every row of a valid group, for every block format and scale layout,
under the interpreter on the CPU and compiled on a GPU; and the zeros each pre-pass writes into
a fresh product output outside valid slots."""

import pytest
import torch

import moegemm
from moegemm import layouts
from moegemm.formats import FORMATS
from moegemm.kernels import tokens as token_passes
from moegemm.kernels.tl_source import interpreter_usable
from moegemm.token_forms import kb_major_column

from cases import EDGE_ROWS, ROWS_NO_GROUPS, TOKEN_PATTERNS, TokenPattern, dirty_allocations, make_problem, poison_like

BLOCK_FORMATS = ("mxfp8", "mxfp4", "nvfp4", "w4a8")
PATTERNS = [TOKEN_PATTERNS[i] for i in (1, 6, 8, 12, 13)]

# Every check runs under the interpreter on the CPU and compiled on a GPU.
on_devices = pytest.mark.parametrize("device", [
    pytest.param("cpu", id="interpreted",
                 marks=pytest.mark.skipif(not interpreter_usable(), reason="triton 3.6's interpreter needs numpy < 2.4")),
    pytest.param("cuda", id="compiled", marks=pytest.mark.gpu),
])
on_patterns = pytest.mark.parametrize("pattern", PATTERNS, ids=[p.name for p in PATTERNS])
on_layouts = pytest.mark.parametrize("layout", ["plain", "swizzled"])


def check_dequantize_rows(fmt, layout, pattern, device):
    p = make_problem(fmt, layout, pattern, 64, 96, device)
    problem = p.problem()
    tokens = token_passes.dequantize_rows(problem, p.a.data, p.a.scales, p.a_offsets, p.expert_ids, None)
    # Without nvfp4's global scale: the kernel leaves it to expert_scales.
    expected = moegemm.dequantize_operand(p.a.data, p.a.scales, p.a.fmt, "a", scale_layout=layout,
                                          a_offsets=p.a.a_offsets, dtype=torch.float32)
    valid = p.valid_rows().to(device)
    assert torch.equal(tokens[valid].float(), expected[valid]), "decoded tokens differ from moegemm.dequantize"
    assert bool(valid.any()) or not FORMATS[fmt].scaled


@on_patterns
@on_layouts
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@on_devices
def test_dequantize_rows(device, fmt, layout, pattern):
    check_dequantize_rows(fmt, layout, pattern, device)


def check_decode_row_scales(layout, pattern, device):
    """The mxfp8 promotion kernel's token-scale pre-pass: fp32 values of A's e8m0 scales in the
    plain layout, columns padded to whole stages plus one with 2^-127 (kernels/sm90/mxfp8.py reads them)."""
    p = make_problem("mxfp8", layout, pattern, 64, 608, device)
    problem = p.problem()
    got = token_passes.decode_row_scales(problem, p.a.scales, p.a_offsets, p.expert_ids, None, pad_stages=True)
    plain = p.a.scales if layout == "plain" else layouts.unswizzle_a_scales(p.a.scales, p.a_offsets, problem.m,
                                                                                   problem.num_k_scales)
    expected = plain.view(torch.float8_e8m0fnu).float()  # 0 -> 2^-127, 255 -> NaN
    num_kb = problem.num_k_scales
    assert got.shape == (problem.m, 4 * (-(-num_kb // 4) + 1))
    valid = p.valid_rows().to(device)
    assert bool(valid.any())
    assert torch.equal(got[valid, :num_kb].view(torch.int32), expected[valid].view(torch.int32))
    assert bool((got[valid, num_kb:] == 2.0 ** -127).all()), "padding columns must hold 2^-127"
    # Stages of eight K blocks (e2m1 weights): whole stages plus one, which the kernel prefetches.
    wide_stages = token_passes.decode_row_scales(problem, p.a.scales, p.a_offsets, p.expert_ids, None, pad_stages=True,
                                             stage_blocks=8)
    assert wide_stages.shape == (problem.m, 8 * (-(-num_kb // 8) + 1))
    assert torch.equal(wide_stages[valid, :got.shape[1]].view(torch.int32), got[valid].view(torch.int32))
    assert bool((wide_stages[valid, num_kb:] == 2.0 ** -127).all())
    # The transposed copy of the wide promotion tiles: [num_kb, columns], slot g's rows from
    # column B * ceil(s / B) + B * g (16-byte aligned for TMA), no padding blocks; with B = 16
    # each 16 rows in the accumulator's order (token_forms.kb_major_column).
    for block in (4, 16):
        transposed = token_passes.decode_row_scales(problem, p.a.scales, p.a_offsets, p.expert_ids, None, kb_major=True,
                                                column_block=block)
        assert transposed.shape == (num_kb, -(-problem.m // block) * block + block * problem.num_groups)
        offsets = p.a_offsets.tolist()
        checked = 0
        for g, e in enumerate(p.expert_ids.tolist()):
            s, t = min(max(offsets[g], 0), problem.m), min(max(offsets[g + 1], offsets[g], 0), problem.m)
            if not 0 <= e < problem.num_experts or t <= s:
                continue
            columns = [kb_major_column(r, s, g, block) for r in range(t - s)]
            assert columns[0] % block == 0 and max(columns) < transposed.shape[1]
            got_rows = transposed[:, columns].t().contiguous().view(torch.int32)
            assert torch.equal(got_rows, expected[s:t].contiguous().view(torch.int32))
            checked += t - s
        assert checked == int(valid.sum())


def test_kb_major_column_orders_16s_as_the_accumulator():
    """Column block 16: the columns 2c, 2c + 1, 2c + 8, 2c + 9 of each 16 (those a wgmma accumulator
    thread with lane % 4 = c holds) are stored together at 4c .. 4c + 3; block 4 keeps the order."""
    stored = [None] * 32
    for r in range(32):
        stored[kb_major_column(r, 0, 0, 16)] = r
    assert stored[:16] == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    assert stored[16:] == [16 + r for r in stored[:16]]
    assert [kb_major_column(r, 5, 2, 16) for r in (0, 2, 8)] == [48, 52, 50]  # 16 * ceil(5 / 16) + 16 * 2
    assert [kb_major_column(r, 5, 2) for r in range(3)] == [16, 17, 18]  # 4 * ceil(5 / 4) + 4 * 2


@on_patterns
@on_layouts
@on_devices
def test_decode_row_scales(device, layout, pattern):
    check_decode_row_scales(layout, pattern, device)


def check_e2m1_to_e4m3(device):
    """mxfp4 tokens re-encoded for the fp8 tensor cores: every byte value (both nibbles, both
    signs), bit-identical to torch's e4m3 of the decoded values times 2^exponent (0, and the 6
    the sm90 kernel uses), element 2i from the low nibble."""
    codes = torch.arange(256, dtype=torch.uint8, device=device).reshape(4, 64)
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], device=device)
    expected = torch.stack([values[(codes & 15).long()], values[(codes >> 4).long()]], dim=-1).reshape(4, 128)
    for exponent in (0, 6):
        got = token_passes.e2m1_to_e4m3(codes, exponent)
        assert got.dtype == torch.float8_e4m3fn and got.shape == (4, 128)
        want = (expected * 2.0**exponent).to(torch.float8_e4m3fn)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"exponent {exponent}"
        # The order the sm90 kernel decodes e2m1 weights into: 0 2 4 6 1 3 5 7 in each group of 8.
        got = token_passes.e2m1_to_e4m3(codes, exponent, even_odd=True)
        order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7], device=device)
        want_even_odd = want.view(torch.uint8).reshape(4, 16, 8)[:, :, order].reshape(4, 128)
        assert torch.equal(got.view(torch.uint8), want_even_odd), f"even_odd, exponent {exponent}"
        assert torch.equal(token_passes.even_odd_k(want).view(torch.uint8), want_even_odd)
    assert token_passes.e2m1_to_e4m3(codes[:0]).shape == (0, 128)
    with pytest.raises(ValueError, match="exponent"):
        token_passes.e2m1_to_e4m3(codes, 7)
    with pytest.raises(ValueError, match="8-element groups"):
        token_passes.even_odd_k(want[:, :12])


@on_devices
def test_e2m1_to_e4m3(device):
    check_e2m1_to_e4m3(device)


def check_token_prepass(layout, pattern, device):
    """The merged pre-pass of mxfp4 tokens (one launch): the same scales as decode_row_scales
    (K-block-major, 8 blocks a stage) and the same bytes as e2m1_to_e4m3(times 2^6, even_odd),
    on every row the two write (the scales of valid rows; every token row)."""
    p = make_problem("mxfp4", layout, pattern, 64, 608, device)
    problem = p.problem()
    kw = dict(pad_stages=False, kb_major=True, stage_blocks=8)
    scales, tokens = token_passes.token_prepass(problem, p.a.data, p.a.scales, p.a_offsets, p.expert_ids, None,
                                            exponent=6, even_odd=True, **kw)
    want_scales = token_passes.decode_row_scales(problem, p.a.scales, p.a_offsets, p.expert_ids, None, **kw)
    assert torch.equal(tokens.view(torch.uint8),
                       token_passes.e2m1_to_e4m3(p.a.data, 6, even_odd=True).view(torch.uint8))
    written = _written_kb_major_columns(p, problem, want_scales.shape[1], device)
    assert torch.equal(scales[:, written].nan_to_num(7.0), want_scales[:, written].nan_to_num(7.0))


def _written_kb_major_columns(p, problem, columns: int, device) -> torch.Tensor:
    """The columns decode_row_scales writes K-block-major: slot g's rows from 4 * ceil(s / 4) + 4 * g."""
    bounds = p.a_offsets.tolist()
    written = torch.zeros(columns, dtype=torch.bool, device=device)
    for g, e in enumerate(p.expert_ids.tolist()):
        s, t = max(0, min(bounds[g], problem.m)), max(0, min(bounds[g + 1], problem.m))
        if 0 <= e < problem.num_experts and t > s:
            start = 4 * -(-s // 4) + 4 * g
            written[start:start + t - s] = True
    return written


@on_patterns
@on_layouts
@on_devices
def test_token_prepass(device, layout, pattern):
    check_token_prepass(layout, pattern, device)


def check_w4a8_row_scales_pass(layout, pattern, device):
    """w4a8's pre-pass (one launch of token_prepass_kernel on e4m3 byte pairs): the same scales as
    decode_row_scales alone and the same bytes as even_odd_k of the tokens, every token row."""
    p = make_problem("w4a8", layout, pattern, 64, 608, device)
    problem = p.problem()
    kw = dict(pad_stages=False, kb_major=True, stage_blocks=8)
    tokens_pass = token_passes.plan_tokens(problem, "row scales", p.a.data.device, p.a.scales.shape[0],
                                           even_odd=True, **kw)
    with pytest.MonkeyPatch.context() as patch:  # (the reorder is the kernel's: no torch copy of the tokens)
        patch.setattr(token_passes, "even_odd_k", None)
        scales, tokens = tokens_pass.run(p.a.data, p.a.scales, p.a_offsets, p.expert_ids, None)
    want_scales = token_passes.decode_row_scales(problem, p.a.scales, p.a_offsets, p.expert_ids, None, **kw)
    assert tokens.dtype == p.a.data.dtype
    assert torch.equal(tokens.view(torch.uint8), token_passes.even_odd_k(p.a.data).view(torch.uint8))
    written = _written_kb_major_columns(p, problem, want_scales.shape[1], device)
    assert torch.equal(scales[:, written].nan_to_num(7.0), want_scales[:, written].nan_to_num(7.0))


@on_patterns
@on_layouts
@on_devices
def test_w4a8_row_scales_pass(device, layout, pattern):
    check_w4a8_row_scales_pass(layout, pattern, device)


# Each pre-pass the sm90 launcher plans (kernels/sm90/launcher._token_pass): (format, kind, options).
PREPASSES = [
    ("nvfp4", "dequantize", {}),
    ("w4a8", "dequantize", {}),
    ("mxfp8", "row scales", {"pad_stages": True}),
    ("mxfp8", "row scales", {"kb_major": True, "column_block": 16}),
    ("mxfp4", "e2m1", {"kb_major": True, "stage_blocks": 8, "exponent": 6, "even_odd": True}),
    ("w4a8", "row scales", {"kb_major": True, "stage_blocks": 8, "even_odd": True}),
]
FILL_CASES = [
    ("plain", EDGE_ROWS, torch.bfloat16),
    ("swizzled", EDGE_ROWS, torch.float32),
    ("plain", TOKEN_PATTERNS[10], torch.bfloat16),  # all_skipped
    ("plain", ROWS_NO_GROUPS, torch.bfloat16),
    ("plain", TokenPattern("many_slots", (1,) * 70, tuple(-1 if g % 3 == 0 else g for g in range(70)), tail=3,
                           why="more slots than a fill program compares at once"), torch.bfloat16),
]


def check_prepass_zero_fill(fmt, kind, options, layout, pattern, out_dtype, device, monkeypatch):
    """A pre-pass given the product's fresh output (allocated with dirty memory) zeroes exactly
    the rows no valid slot owns, leaves the valid rows to the product, and writes its own outputs
    as without it, bit for bit."""
    p = make_problem(fmt, layout, pattern, 136, 64, device)  # (N = 136: a partial second column block)
    problem = p.problem(out_dtype)
    plan = token_passes.plan_tokens(problem, kind, torch.device(device), p.a.scales.shape[0], **options)
    args = (p.a.data, p.a.scales, p.a_offsets, p.expert_ids, None)
    dirty_allocations(monkeypatch)  # (what the pre-pass does not write reads the same in both runs)
    alone = plan.run(*args)
    out = poison_like(p.m, p.n, out_dtype, device)
    before = out.clone()
    filled = plan.run(*args, fresh_out=out)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    valid = p.valid_rows().to(device)
    free = out[~valid].view(bits)
    assert torch.equal(free, torch.zeros_like(free)), "a row outside valid slots is not +0"
    assert torch.equal(out[valid].view(bits), before[valid].view(bits)), "the fill wrote a valid slot's row"
    for mine, theirs in zip(filled, alone, strict=True):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), "the pre-pass's output changed"


@pytest.mark.parametrize("layout,pattern,out_dtype", FILL_CASES,
                         ids=[f"{layout}-{pattern.name}-{str(dtype)[6:]}" for layout, pattern, dtype in FILL_CASES])
@pytest.mark.parametrize("fmt,kind,options", PREPASSES, ids=[f"{fmt}-{kind.replace(' ', '_')}-{i}"
                                                            for i, (fmt, kind, _) in enumerate(PREPASSES)])
@on_devices
def test_prepass_zeroes_a_fresh_output_outside_valid_slots(device, fmt, kind, options, layout, pattern, out_dtype,
                                                           monkeypatch):
    check_prepass_zero_fill(fmt, kind, options, layout, pattern, out_dtype, device, monkeypatch)


def test_a_prepass_that_cannot_fill_says_so():
    """The weight-only formats' pre-pass launches nothing (bf16 tokens as given): given a fresh
    output it raises rather than leave the output's rows unwritten."""
    p = make_problem("bf16_mxfp4", "plain", EDGE_ROWS, 16, 64, "cpu")
    plan = token_passes.plan_tokens(p.problem(), "dequantize", torch.device("cpu"), 0)
    assert plan.fill is None
    with pytest.raises(ValueError, match="fresh_out"):
        plan.run(p.a.data, p.a.scales, p.a_offsets, p.expert_ids, None, fresh_out=torch.empty(p.m, p.n))
