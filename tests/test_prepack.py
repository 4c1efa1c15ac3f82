"""The prepacked weight order (moegemm.prepack, prepack_weights): the documented element mapping,
bit-for-bit round trips, the formats and shapes it takes, and every backend and the MoE layer
giving the same bits on prepacked weights as on the plain order. GPU: the decoding kernel reading
prepacked weights into its wgmma's registers, against the reference and bit for bit against the
same config on plain weights."""

import contextlib
import dataclasses
import re

import pytest
import torch
from cases import TOKEN_PATTERNS, TokenPattern, check_output, make_problem, poison_like, tolerance

import moegemm
from moegemm import codecs
from moegemm.config import override_config, sm90_mx_config
from moegemm.formats import FORMATS, PREPACK_FORMATS
from moegemm.kernels.tl_source import interpreter_usable
from moegemm.kernels.sm90.e2m1_words import e2m1_to_bf16_ptx
from moegemm.prepack import E2M1_WORD_TERMS, prepack_codes, unpack_codes
from moegemm.sm90_configs import DecodeConfig, deepest_ring

needs_interpreter = pytest.mark.skipif(not interpreter_usable(), reason="Triton's CPU interpreter needs numpy < 2.4")


def _bits(row: int, col: int) -> dict:
    names = {"r8": (row, 3), "r4": (row, 2), "r2": (row, 1), "r1": (row, 0), "k32": (col, 5), "k16": (col, 4),
             "k8": (col, 3), "k4": (col, 2), "k2": (col, 1), "k1": (col, 0)}
    out = {name: (value >> bit) & 1 for name, (value, bit) in names.items()}
    out["w"] = row >> 4
    return out


def test_prepacked_order_is_the_documented_mapping():
    codes = torch.randint(0, 256, (2, 128, 128), dtype=torch.uint8).view(torch.float8_e4m3fn)
    packed = prepack_codes(codes).view(torch.uint8)
    plain = codes.view(torch.uint8)
    for row in range(64):
        for col in range(64):
            b = _bits(row, col)
            packed_row = 16 * b["w"] + 8 * b["r4"] + 4 * b["r2"] + 2 * b["r1"] + b["k4"]
            packed_col = 32 * b["k2"] + 16 * b["r8"] + 8 * b["k32"] + 4 * b["k16"] + 2 * b["k8"] + b["k1"]
            for e, nb, kb in ((0, 0, 0), (1, 1, 1)):
                assert packed[e, 64 * nb + packed_row, 64 * kb + packed_col] == plain[e, 64 * nb + row, 64 * kb + col]


@pytest.mark.parametrize("k", (64, 192))
def test_prepacked_round_trips_and_keeps_e2m1_pairs(k):
    fp4 = torch.randint(0, 256, (3, 128, k // 2), dtype=torch.uint8)
    packed = prepack_codes(fp4)
    assert packed.shape == fp4.shape and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed), fp4)
    # packed e2m1 moves as its elements would, one byte a pair of K neighbours, and the kernel's
    # rotations and masks of each word give those pairs as bf16 times 2^-126
    elements = codecs.unpack_fp4(fp4).to(torch.uint8).view(torch.float8_e4m3fn)
    moved = prepack_codes(elements).view(torch.uint8)
    expected = codecs.decode_e2m1(moved.reshape(-1)).reshape(-1, 8)
    assert torch.equal(_decoded_words(packed).view(torch.int32), expected.view(torch.int32))  # (-0 too)
    fp8 = torch.randint(0, 256, (3, 128, k), dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(unpack_codes(prepack_codes(fp8)).view(torch.uint8), fp8.view(torch.uint8))


def _decoded_words(packed: torch.Tensor) -> torch.Tensor:
    """What kernels/sm90/decode.py's PTX makes of each prepacked e2m1 word (E2M1_WORD_TERMS): for
    pair t, the OR over its terms of (word rotated left by r) & mask, as two bf16 times 2^126;
    [words, 8] float32 in the order pair 0 low, pair 0 high, pair 1 low, ..."""
    words = packed.reshape(-1, 4).to(torch.int64)
    words = words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24
    values = []
    for terms in E2M1_WORD_TERMS:
        pair = torch.zeros_like(words)
        for r, mask in terms:
            pair |= ((words << r | words >> (32 - r)) & 0xFFFFFFFF if r else words) & mask
        for half in (pair & 0xFFFF, pair >> 16):
            values.append(half.to(torch.int16).view(torch.bfloat16).float() * 2.0**126)
    return torch.stack(values, dim=1)


def test_interleaved_e2m1_words_give_every_code():
    # every code in every nibble of a word (row r holds codes r, r + 1, ...): each decodes to its value
    nibbles = (torch.arange(64).reshape(1, 64, 1) + torch.arange(64).reshape(1, 1, 64)) % 16
    nibbles = nibbles.to(torch.uint8)
    fp4 = nibbles[..., 0::2] | nibbles[..., 1::2] << 4
    expected = codecs.decode_e2m1(prepack_codes(nibbles.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1))
    words = prepack_codes(fp4)
    assert torch.equal(_decoded_words(words).view(torch.int32), expected.reshape(-1, 8).view(torch.int32))
    assert torch.equal(unpack_codes(words), fp4)
    # and the kernel's own PTX, interpreted, gives the same bits (times 2^-126 without its multiplies)
    for unbiased in (True, False):
        got = _run_ptx(e2m1_to_bf16_ptx(unbiased), words)
        want = expected.reshape(-1, 8) * (1.0 if unbiased else 2.0**-126)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _run_ptx(ptx: str, packed: torch.Tensor) -> torch.Tensor:
    """Interpret the decode's PTX ($4 the word; mov, and, or, shf.l.wrap, mul.rn.bf16x2) on every
    prepacked word; [words, 8] float32 in _decoded_words' order."""
    words = packed.reshape(-1, 4).to(torch.int64)
    regs = {"$4": words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24}
    value = lambda x: regs[x] if x in regs else torch.full_like(regs["$4"], int(x, 0))  # noqa: E731
    halves = lambda x: [(x & 0xFFFF).to(torch.int16).view(torch.bfloat16).float(),  # noqa: E731
                        (x >> 16).to(torch.int16).view(torch.bfloat16).float()]
    for line in ptx.splitlines():
        match = re.match(r"([\w.]+) (.*);$", line.strip())
        if not match or match.group(1).startswith("."):
            continue
        op, args = match.group(1), [a.strip() for a in match.group(2).split(",")]
        if op == "mov.b32":
            regs[args[0]] = value(args[1])
        elif op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        elif op == "or.b32":
            regs[args[0]] = value(args[1]) | value(args[2])
        elif op == "shf.l.wrap.b32":
            assert args[1] == args[2], "a rotation: both words the same"
            r, x = int(args[3]), value(args[1])
            regs[args[0]] = ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            products = [(a * b).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
                        for a, b in zip(halves(value(args[1])), halves(value(args[2])))]
            regs[args[0]] = products[0] | products[1] << 16
        else:
            raise AssertionError(f"an instruction the interpreter does not know: {line}")
    return torch.stack([h for t in range(4) for h in halves(regs[f"${t}"])], dim=1)


@pytest.mark.parametrize("layout", ("plain", "swizzled"))
@pytest.mark.parametrize("fmt", PREPACK_FORMATS)
def test_prepack_weights_round_trip(fmt, layout):
    w = moegemm.quantize_weights(torch.randn(2, 128, 192), fmt, scale_layout=layout)
    p = moegemm.prepack_weights(w)
    assert p.prepacked and p.scales is w.scales and p.data.shape == w.data.shape and p.data.dtype == w.data.dtype
    assert not torch.equal(p.data.view(torch.uint8), w.data.view(torch.uint8))
    back = moegemm.unpack_weights(p)
    assert not back.prepacked and torch.equal(back.data.view(torch.uint8), w.data.view(torch.uint8))
    torch.testing.assert_close(moegemm.dequantize(p), moegemm.dequantize(w), rtol=0, atol=0)


def test_prepack_weights_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="bf16_mxfp8.*not mxfp8"):
        moegemm.prepack_weights(moegemm.quantize_weights(torch.randn(2, 128, 64), "mxfp8"))
    with pytest.raises(ValueError, match="multiples of 64.*N=96"):
        moegemm.prepack_weights(moegemm.quantize_weights(torch.randn(2, 96, 64), "bf16_mxfp4"))
    with pytest.raises(ValueError, match="multiples of 64.*K=96"):
        moegemm.prepack_weights(moegemm.quantize_weights(torch.randn(2, 128, 96), "bf16_mxfp8"))
    with pytest.raises(TypeError, match="w:"):
        moegemm.prepack_weights(moegemm.quantize(torch.randn(4, 64), "nvfp4"))
    p = moegemm.prepack_weights(moegemm.quantize_weights(torch.randn(2, 128, 64), "nvfp4"))
    with pytest.raises(ValueError, match="already prepacked"):
        moegemm.prepack_weights(p)
    # a QuantizedTensor that claims the order for another format is named by the op
    plain = moegemm.quantize_weights(torch.randn(2, 128, 64), "mxfp8")
    bad = moegemm.QuantizedTensor(plain.data, plain.scales, "mxfp8", "b", prepacked=True)
    a = moegemm.quantize(torch.randn(4, 64), "mxfp8")
    with pytest.raises(ValueError, match="b: prepacked weights are for"):
        moegemm.grouped_matmul(a, bad, None, None, torch.tensor([0, 4], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), fmt="mxfp8", backend="reference")


PATTERN = TokenPattern("ragged_skips", (37, 0, 70, 21), (2, 1, -1, 0), experts=3, why="partial tiles and a skip")


def _products(fmt, layout, backend, fused=None):
    p = make_problem(fmt, layout, PATTERN, 128, 192, "cpu")
    prepacked = moegemm.prepack_weights(p.w)
    outs = []
    for w in (p.w, prepacked):
        if fused is None:
            outs.append(moegemm.grouped_matmul(p.a, w, None, None, p.a_offsets, p.expert_ids, fmt=fmt,
                                               expert_scales=p.expert_scales, row_scales=p.row_scales,
                                               backend=backend))
        else:
            q = moegemm.grouped_matmul_swiglu(p.a, w, None, None, p.a_offsets, p.expert_ids, fmt=fmt,
                                              expert_scales=p.expert_scales, gate_up_layout="interleaved",
                                              out_fmt=fmt, backend=backend)
            outs.append(q.data.view(torch.uint8) if q.data.dtype != torch.bfloat16 else q.data)
    return outs


@pytest.mark.parametrize("layout", ("plain", "swizzled"))
@pytest.mark.parametrize("fmt", PREPACK_FORMATS)
def test_reference_reads_prepacked_weights(fmt, layout):
    plain, prepacked = _products(fmt, layout, "reference")
    assert torch.equal(plain.view(torch.int16), prepacked.view(torch.int16))


@needs_interpreter
@pytest.mark.parametrize("fmt", ("bf16_mxfp4", "nvfp4"))
def test_portable_kernel_reads_prepacked_weights(fmt):
    plain, prepacked = _products(fmt, "swizzled", "triton")
    assert torch.equal(plain.view(torch.int16), prepacked.view(torch.int16))
    plain, prepacked = _products(fmt, "plain", "reference", fused=True)
    assert torch.equal(plain.view(torch.uint8), prepacked.view(torch.uint8))


def _gpt_oss_like(prepack: bool | None, device="cpu", backend="reference"):
    torch.manual_seed(3)
    e, i, h = 4, 128, 64
    layer = moegemm.MoE(h, i, e, 2, activation="swiglu_oai", router_bias=True, expert_bias=True, backend=backend,
                        prepack=prepack, device=device)
    blocks = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, device=device)  # noqa: E731
    scales = lambda *shape: torch.randint(118, 126, shape, dtype=torch.uint8, device=device)  # noqa: E731
    layer.load_mxfp4(gate_up_blocks=blocks(e, 2 * i, h // 32, 16), gate_up_scales=scales(e, 2 * i, h // 32),
                     down_blocks=blocks(e, h, i // 32, 16), down_scales=scales(e, h, i // 32),
                     gate_up_bias=torch.randn(e, 2 * i, device=device), down_bias=torch.randn(e, h, device=device))
    layer.load_router(torch.randn(e, h, device=device), torch.randn(e, device=device))
    return layer


def test_moe_loaders_prepack_and_answer_the_same(monkeypatch):
    prepacked, plain = _gpt_oss_like(True), _gpt_oss_like(False)
    assert prepacked.fmt == "bf16_mxfp4" and prepacked.gate_up_prepacked and prepacked.down_prepacked
    assert not plain.gate_up_prepacked
    # by default only where the sm90 kernels read them (elsewhere every call would unpack them)
    assert not _gpt_oss_like(None).gate_up_prepacked
    w_gate_up, w_down = prepacked.weights()
    assert w_gate_up.prepacked and w_down.prepacked
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(prepacked(x).view(torch.int16), plain(x).view(torch.int16))
    # mxfp4 and w4a8: prepacked when asked (the same answer), else plain even where the sm90
    # kernels run (their plain order's e2m1 promotion kernel is faster at ~2 tokens a slot)
    def mxfp4_layer(prepack):
        torch.manual_seed(3)
        return moegemm.MoE(64, 128, 4, 2, fmt="mxfp4", prepack=prepack).load_experts(
            gate=torch.randn(4, 128, 64), up=torch.randn(4, 128, 64), down=torch.randn(4, 64, 128))

    asked, kept = mxfp4_layer(True), mxfp4_layer(False)
    assert asked.gate_up_prepacked and asked.weights()[0].prepacked and not kept.gate_up_prepacked
    with torch.no_grad():
        assert torch.equal(asked(x).view(torch.int16), kept(x).view(torch.int16))
    monkeypatch.setattr(moegemm.moe.weights, "available_backends", lambda device: ("sm90", "triton", "reference"))
    assert not mxfp4_layer(None).gate_up_prepacked and _gpt_oss_like(None, backend="auto").gate_up_prepacked


gpu = pytest.mark.gpu


def _forced(token_tile: int, prepacked: bool, weight_tile: int = 128, sub_steps: int = 0) -> DecodeConfig:
    """A forced config: 256-row tiles (weight_tile) only for prepacked weights, the plain order
    keeps 128."""
    wide = weight_tile == 256 and prepacked
    return DecodeConfig(token_tile=token_tile, stages=4, group_m=1 if token_tile < 128 else 4,
                        consumer_regs=112 if wide else 240 if token_tile == 256 else 192,
                        sub_steps=sub_steps or (2 if token_tile < 128 else 1), prepacked=prepacked,
                        weight_tile=256 if wide else 128)


def _sm90_both(p, fmt: str, n: int, token_tile: int | None, weight_tile: int = 128, sub_steps: int = 0):
    """The sm90 products of problem p on plain and on prepacked weights (token_tile: the same
    forced tiles, else each order's default config), each into a poisoned output."""
    outs = []
    # (nvfp4's global scales are in p.expert_scales already)
    a, w = (dataclasses.replace(q, global_scale=None) for q in (p.a, p.w))
    for w in (w, moegemm.prepack_weights(w)):
        poisoned = poison_like(p.m, n, torch.bfloat16, "cuda")
        out = poisoned.clone()
        call = lambda: moegemm.grouped_matmul(a, w, None, None, p.a_offsets, p.expert_ids, fmt=fmt,  # noqa: E731
                                              expert_scales=p.expert_scales, row_scales=p.row_scales, out=out,
                                              backend="sm90")
        if token_tile is None:
            call()
        else:
            with override_config(_forced(token_tile, w.prepacked, weight_tile, sub_steps if w.prepacked else 0)):
                call()
        outs.append((out, poisoned))
    return outs


def _check_prepacked(p, fmt: str, n: int, *forced) -> tuple[torch.Tensor, torch.Tensor]:
    """_sm90_both's prepacked product against the reference (rows outside the slots untouched)
    and bit for bit against the plain order's; returns it and the valid rows."""
    (plain, _), (prepacked, poisoned) = _sm90_both(p, fmt, n, *forced)
    check_output(p, prepacked, poisoned, tolerance(fmt, "sm90"))
    valid = p.valid_rows().to("cuda")
    assert torch.equal(prepacked[valid].view(torch.int16), plain[valid].view(torch.int16))
    return prepacked, valid


def _fused_outputs(p, fmt: str, weights_and_configs) -> list[torch.Tensor]:
    """The fused SwiGLU product's valid output bytes for each (weights, forced config or None)."""
    outs = []
    global_scale = torch.ones((), device="cuda") if fmt == "nvfp4" else None  # (nvfp4 out: a static one)
    for w, cfg in weights_and_configs:
        with override_config(cfg) if cfg is not None else contextlib.nullcontext():
            q = moegemm.grouped_matmul_swiglu(p.a, w, None, None, p.a_offsets, p.expert_ids, fmt=fmt,
                                              expert_scales=p.expert_scales, gate_up_layout="interleaved",
                                              out_fmt=fmt, out_global_scale=global_scale, backend="sm90")
        outs.append(q.data[p.valid_rows().to("cuda")].view(torch.uint8))
    return outs


@gpu
@pytest.mark.parametrize("token_tile", [16, 64, 128, 256])
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS, ids=[p.name for p in TOKEN_PATTERNS])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("fmt", PREPACK_FORMATS)
def test_sm90_prepacked_matches_reference_and_plain(fmt, layout, pattern, token_tile):
    # N=320: a partial last weight tile (64 rows of a 128-row tile); K=576: an odd number of
    # one-step stages (128/256-token tiles take them in pairs), a partial two-step stage.
    p = make_problem(fmt, layout, pattern, 320, 576, "cuda")
    _check_prepacked(p, fmt, 320, token_tile)


WIDE_PATTERNS = [p for p in TOKEN_PATTERNS if p.name in ("large", "ragged", "tiny", "skip_some", "repeated_unsorted",
                                                          "offset_start", "all_skipped")]


@gpu
@pytest.mark.parametrize("token_tile,sub_steps", [(16, 2), (32, 2), (64, 2), (16, 4)])
@pytest.mark.parametrize("pattern", WIDE_PATTERNS, ids=[p.name for p in WIDE_PATTERNS])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("fmt", PREPACK_FORMATS)
def test_sm90_prepacked_wide_weight_tiles(fmt, layout, pattern, token_tile, sub_steps):
    # 256-row tiles, four consumer warpgroups on one token stage: N=320 is a whole tile and a
    # partial one (64 rows); K=576 a partial last stage. Same bits as 128-row tiles on the plain order.
    if sub_steps == 4 and fmt == "bf16_mxfp8":
        pytest.skip("a stage holds at most 128 bytes of a weight row")
    p = make_problem(fmt, layout, pattern, 320, 576, "cuda")
    _check_prepacked(p, fmt, 320, token_tile, 256, sub_steps)


@gpu
@pytest.mark.parametrize("fmt", PREPACK_FORMATS)
def test_sm90_prepacked_wide_weight_tiles_fused(fmt):
    p = make_problem(fmt, "swizzled", MODEL_SMALL_GROUPS_FEW, 2 * 640, 1024, "cuda")
    plain, wide = _fused_outputs(p, fmt, ((p.w, _forced(16, False)),
                                          (moegemm.prepack_weights(p.w), _forced(16, True, 256))))
    assert torch.equal(plain, wide)


MODEL_SMALL_GROUPS_FEW = TokenPattern("decode_24x12", tuple(4 + (5 * s) % 13 for s in range(24)),
                                      tuple(s % 8 for s in range(24)), experts=8,
                                      why="decode: 24 slots of 4-16 tokens")
MODEL_SMALL_GROUPS = TokenPattern("decode_256x16", tuple(8 + (7 * s) % 17 for s in range(256)),
                                  tuple(s % 16 for s in range(256)), experts=16,
                                  why="decode: 256 slots of 8-24 tokens (16 experts' weights), more tiles than SMs")
MODEL_WIDE = TokenPattern("prefill_wide", (1000, 130, 300, 257, 129, 2000, 5, 700, 384, 256),
                          (3, 0, 5, 1, 2, 4, 0, -1, 7, 3), experts=8, why="256-token tiles, a skipped slot")


@gpu
@pytest.mark.parametrize("pattern", (MODEL_SMALL_GROUPS, MODEL_WIDE), ids=lambda p: p.name)
@pytest.mark.parametrize("n,k", [(2880, 2880), (7168, 2048)], ids=["gptoss-down", "dsv3-down"])
@pytest.mark.parametrize("fmt", ("bf16_mxfp4", "nvfp4"))
def test_sm90_prepacked_at_model_shapes(fmt, n, k, pattern):
    # The default configs (16/32-token tiles at decode, 256-token tiles at prefill), more tiles
    # than SMs: against the reference, rows outside the slots untouched, the plain order's bits,
    # and two calls bit-identical.
    p = make_problem(fmt, "swizzled", pattern, n, k, "cuda")
    prepacked, valid = _check_prepacked(p, fmt, n, None)
    (_, _), (again, _) = _sm90_both(p, fmt, n, None)
    assert torch.equal(again[valid].view(torch.int16), prepacked[valid].view(torch.int16))


@gpu
@pytest.mark.parametrize("fmt", PREPACK_FORMATS)
def test_sm90_prepacked_fused_epilogue_and_layer(fmt):
    p = make_problem(fmt, "swizzled", MODEL_WIDE, 2 * 1024, 1024, "cuda")
    plain, prepacked = _fused_outputs(p, fmt, ((p.w, None), (moegemm.prepack_weights(p.w), None)))
    assert torch.equal(plain, prepacked)
    if fmt == "bf16_mxfp4":
        prepacked, plain = (_gpt_oss_like(flag, "cuda", "auto") for flag in (None, False))
        assert prepacked.gate_up_prepacked  # (the default on a Hopper GPU)
        x = torch.randn(300, 64, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            assert torch.equal(prepacked(x).view(torch.int16), plain(x).view(torch.int16))


@gpu
@pytest.mark.parametrize("n,k", [(2880, 2880), (7168, 2048)], ids=["gptoss-down", "dsv3-down"])
@pytest.mark.parametrize("fmt", ("mxfp4", "w4a8"))
def test_sm90_prepacked_e2m1_formats_at_decode(fmt, n, k):
    # mxfp4 and w4a8 at decode: prepacked weights run the decoding kernel's 256-row tiles, the
    # plain order the e2m1 promotion kernel (other arithmetic, so no common bits): the prepacked
    # product against the reference (rows outside the slots untouched), two calls bit-identical,
    # and the MoE layer with prepack=True close to the plain one's at ~2 tokens a slot.
    p = make_problem(fmt, "swizzled", MODEL_SMALL_GROUPS, n, k, "cuda")
    (_, _), (prepacked, poisoned) = _sm90_both(p, fmt, n, None)
    check_output(p, prepacked, poisoned, tolerance(fmt, "sm90"))
    (_, _), (again, _) = _sm90_both(p, fmt, n, None)
    valid = p.valid_rows().to("cuda")
    assert torch.equal(again[valid].view(torch.int16), prepacked[valid].view(torch.int16))
    torch.manual_seed(5)
    weights = dict(gate=torch.randn(16, 256, 128), up=torch.randn(16, 256, 128), down=torch.randn(16, 128, 256))
    layers = [moegemm.MoE(128, 256, 16, 4, fmt=fmt, prepack=flag, device="cuda").load_experts(
        **{name: w.cuda() for name, w in weights.items()}) for flag in (True, False)]
    assert layers[0].gate_up_prepacked and not layers[1].gate_up_prepacked
    router = torch.randn(16, 128, device="cuda")
    for layer in layers:
        layer.load_router(router)
    x = torch.randn(8, 128, dtype=torch.bfloat16, device="cuda")  # 32 rows over 16 experts
    with torch.no_grad():
        out_prepacked, out_plain = (layer(x).float() for layer in layers)
    scale = out_plain.abs().max()
    assert ((out_prepacked - out_plain).abs().max() / scale).item() < 0.05


E2M1_PREPACK_FORMATS = tuple(f for f in PREPACK_FORMATS if f != "bf16_mxfp8")


def _prepacked_runs(p, fmt: str, n: int, k: int, token_tile: int | None, variants) -> tuple[list, torch.Tensor]:
    """The prepacked product once per variant (changes to the config: the regime's default for
    token_tile None, else a forced 256-row one; a ring of 2 stages made as deep as it fits), each
    into a poisoned output: (outputs, poisoned)."""
    a, w = (dataclasses.replace(q, global_scale=None) for q in (p.a, p.w))
    w = moegemm.prepack_weights(w)
    if token_tile is None:
        base = sm90_mx_config(FORMATS[fmt], n, k, p.m / len(p.expert_ids), prepacked=True)
    else:
        base = _forced(token_tile, True, 256, 2)
    outs = []
    for changes in variants:
        poisoned = poison_like(p.m, n, torch.bfloat16, "cuda")
        out = poisoned.clone()
        with override_config(deepest_ring(dataclasses.replace(base, stages=2, **changes), FORMATS[fmt])):
            moegemm.grouped_matmul(a, w, None, None, p.a_offsets, p.expert_ids, fmt=fmt,
                                   expert_scales=p.expert_scales, row_scales=p.row_scales, out=out, backend="sm90")
        outs.append(out)
    return outs, poisoned


def _staged_pair(p, fmt: str, n: int, k: int, token_tile: int | None, consumer_rows: int = 64):
    """The prepacked product with the scales loaded a step ahead and with them staged in the ring
    (DecodeConfig.staged_scales; consumer_rows 128: two consumer warpgroups of 128 rows), each into a
    poisoned output: (step-ahead, staged, poisoned). token_tile None: the regime's default config."""
    wide = {"consumer_rows": 128, "consumer_regs": 232} if consumer_rows == 128 else {}
    (step_ahead, staged), poisoned = _prepacked_runs(p, fmt, n, k, token_tile, (
        {"staged_scales": False, "consumer_rows": 64}, {"staged_scales": True, **wide}))
    return step_ahead, staged, poisoned


STAGED_PATTERNS = [p for p in TOKEN_PATTERNS if p.name in ("ragged", "tiny")]


@gpu
@pytest.mark.parametrize("consumer_rows", [64, 128])
@pytest.mark.parametrize("k", [576, 640], ids=["half_last_stage", "whole_stages"])
@pytest.mark.parametrize("token_tile", [16, 64])  # (32: the model shapes' default tiles, below)
@pytest.mark.parametrize("pattern", STAGED_PATTERNS, ids=[p.name for p in STAGED_PATTERNS])
@pytest.mark.parametrize("fmt", E2M1_PREPACK_FORMATS)
def test_sm90_staged_scales_match_the_step_ahead_loop(fmt, pattern, token_tile, k, consumer_rows):
    # The weight scales through the ring (swizzled atoms by TMA, e8m0's 2^126 folded into them):
    # against the reference (rows outside the slots untouched) and bit for bit the loop that
    # loads them a step ahead. N=320: a whole 256-row tile and a partial one (its second 128-row
    # block is the next expert's, or past the scales); K=576: a last stage of one step.
    p = make_problem(fmt, "swizzled", pattern, 320, k, "cuda")
    step_ahead, staged, poisoned = _staged_pair(p, fmt, 320, k, token_tile, consumer_rows)
    check_output(p, staged, poisoned, tolerance(fmt, "sm90"))
    valid = p.valid_rows().to("cuda")
    assert torch.equal(staged[valid].view(torch.int16), step_ahead[valid].view(torch.int16))


@gpu
@pytest.mark.parametrize("consumer_rows", [64, 128])
@pytest.mark.parametrize("fmt", ("bf16_mxfp4", "mxfp4", "w4a8"))
def test_sm90_staged_scales_take_large_e8m0_codes(fmt, consumer_rows):
    # e8m0 codes >= 128 (scales >= 2, where 2^126 folded into the scale leaves bf16) in some
    # stages: those stages decode as the step-ahead loop does, so both agree bit for bit and with
    # the reference on the same (modified) weights.
    p = make_problem(fmt, "swizzled", MODEL_SMALL_GROUPS_FEW, 320, 576, "cuda")
    codes = p.w.scales.view(torch.uint8).clone()
    flat = codes.view(-1)
    flat[::37] = torch.randint(128, 140, flat[::37].shape, dtype=torch.uint8, device=flat.device)
    p = dataclasses.replace(p, w=dataclasses.replace(p.w, scales=codes.view(p.w.scales.dtype)))
    step_ahead, staged, poisoned = _staged_pair(p, fmt, 320, 576, 16, consumer_rows)
    check_output(p, staged, poisoned, tolerance(fmt, "sm90"))
    valid = p.valid_rows().to("cuda")
    assert torch.equal(staged[valid].view(torch.int16), step_ahead[valid].view(torch.int16))


@gpu
@pytest.mark.parametrize("consumer_rows", [64, 128])
@pytest.mark.parametrize("pattern", (MODEL_SMALL_GROUPS, MODEL_SMALL_GROUPS_FEW), ids=lambda p: p.name)
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048), (5760, 2880), (2880, 2880)],
                         ids=["dsv3-up", "dsv3-down", "gptoss-up", "gptoss-down"])
@pytest.mark.parametrize("fmt", ("bf16_mxfp4", "nvfp4"))
def test_sm90_staged_scales_at_model_shapes(fmt, n, k, pattern, consumer_rows):
    # The four decode shapes at the default regime's tiles, staged or not; decode_256x16 has more
    # tiles than SMs (a program's next tiles continue the ring's phases).
    p = make_problem(fmt, "swizzled", pattern, n, k, "cuda")
    step_ahead, staged, poisoned = _staged_pair(p, fmt, n, k, None, consumer_rows)
    check_output(p, staged, poisoned, tolerance(fmt, "sm90"))
    valid = p.valid_rows().to("cuda")
    assert torch.equal(staged[valid].view(torch.int16), step_ahead[valid].view(torch.int16))


@gpu
@pytest.mark.parametrize("consumer_rows", [64, 128])
@pytest.mark.parametrize("fmt", E2M1_PREPACK_FORMATS)
def test_sm90_staged_scales_fused(fmt, consumer_rows):
    # The fused SwiGLU epilogue on staged-scale tiles: the step-ahead loop's bytes.
    p = make_problem(fmt, "swizzled", MODEL_SMALL_GROUPS_FEW, 2 * 640, 1024, "cuda")
    w = moegemm.prepack_weights(p.w)
    wide = {"consumer_rows": 128, "consumer_regs": 232} if consumer_rows == 128 else {}
    staged = deepest_ring(dataclasses.replace(_forced(16, True, 256, 2), staged_scales=True, stages=2, **wide),
                          FORMATS[fmt], fused=True)
    step_ahead, ours = _fused_outputs(p, fmt, ((w, _forced(16, True, 256)), (w, staged)))
    assert torch.equal(step_ahead, ours)


@gpu
def test_sm90_staged_config_on_plain_scales_steps_back():
    # A staged config given plain scales (which the producer cannot stage) runs the step-ahead loop.
    p = make_problem("bf16_mxfp4", "plain", MODEL_SMALL_GROUPS_FEW, 320, 576, "cuda")
    step_ahead, staged, poisoned = _staged_pair(p, "bf16_mxfp4", 320, 576, 16, 128)
    check_output(p, staged, poisoned, tolerance("bf16_mxfp4", "sm90"))
    valid = p.valid_rows().to("cuda")
    assert torch.equal(staged[valid].view(torch.int16), step_ahead[valid].view(torch.int16))

