"""One test per bad-input rule of docs/contract.md section 8: the error type, and a message that starts
with the argument's name."""

import pytest
import torch

import moegemm


def good(fmt="mxfp8", layout="plain", m=40, n=16, k=64, e=3):
    a_offsets = torch.tensor([0, 10, 30], dtype=torch.int32)
    qa = moegemm.quantize(torch.randn(m, k), fmt, scale_layout=layout, a_offsets=a_offsets)
    qw = moegemm.quantize_weights(torch.randn(e, n, k), fmt, scale_layout=layout)
    args = dict(a=qa.data, b=qw.data, a_scales=qa.scales, b_scales=qw.scales, a_offsets=a_offsets,
                expert_ids=torch.tensor([0, 2], dtype=torch.int32))
    return args, dict(fmt=fmt, scale_layout=layout)


def call(args, kwargs):
    return moegemm.grouped_matmul(args["a"], args["b"], args["a_scales"], args["b_scales"], args["a_offsets"],
                                  args["expert_ids"], **kwargs)


def expect(error, name, args, kwargs, **changes):
    for key, value in changes.items():
        (args if key in args else kwargs)[key] = value
    with pytest.raises(error, match=f"^{name}:"):
        call(args, kwargs)


def test_the_good_call_passes():
    args, kwargs = good()
    assert call(args, kwargs).shape == (40, 16)


CASES = {
    # name: (error, argument named, changes applied to the good call, format, layout)
    "unknown format": (ValueError, "fmt", dict(fmt="fp6"), "mxfp8", "plain"),
    "format not a string": (TypeError, "fmt", dict(fmt=3), "mxfp8", "plain"),
    "a wrong dtype": (TypeError, "a", dict(a=torch.zeros(40, 64, dtype=torch.bfloat16)), "mxfp8", "plain"),
    "a not a tensor": (TypeError, "a", dict(a=[[1.0]]), "mxfp8", "plain"),
    "a 3-D": (ValueError, "a", dict(a=torch.zeros(1, 40, 64, dtype=torch.float8_e4m3fn)), "mxfp8", "plain"),
    "a non-contiguous": (ValueError, "a", dict(a=torch.zeros(64, 40, dtype=torch.float8_e4m3fn).t()), "mxfp8", "plain"),
    "b wrong dtype": (TypeError, "b", dict(b=torch.zeros(3, 16, 64)), "mxfp8", "plain"),
    "b 2-D": (ValueError, "b", dict(b=torch.zeros(16, 64, dtype=torch.float8_e4m3fn)), "mxfp8", "plain"),
    "b K differs from a": (ValueError, "b", dict(b=torch.zeros(3, 16, 96, dtype=torch.float8_e4m3fn)), "mxfp8", "plain"),
    "b on another device": (ValueError, "b", dict(b=torch.zeros(3, 16, 64, dtype=torch.float8_e4m3fn, device="meta")),
                            "mxfp8", "plain"),
    "b N-major, not bf16": (ValueError, "b", dict(b=torch.zeros(3, 64, 16, dtype=torch.float8_e4m3fn).transpose(1, 2)),
                            "mxfp8", "plain"),
    "b packed K differs": (ValueError, "b", dict(b=torch.zeros(3, 16, 16, dtype=torch.uint8)), "mxfp4", "plain"),
    "K not a multiple of the block": (ValueError, "a", dict(a=torch.zeros(40, 48, dtype=torch.float8_e4m3fn),
                                                            b=torch.zeros(3, 16, 48, dtype=torch.float8_e4m3fn)),
                                      "mxfp8", "plain"),
    "a_offsets int64": (TypeError, "a_offsets", dict(a_offsets=torch.tensor([0, 10, 30])), "mxfp8", "plain"),
    "a_offsets 2-D": (ValueError, "a_offsets", dict(a_offsets=torch.zeros(1, 3, dtype=torch.int32)), "mxfp8", "plain"),
    "a_offsets decreasing": (ValueError, "a_offsets", dict(a_offsets=torch.tensor([0, 30, 10], dtype=torch.int32)),
                             "mxfp8", "plain"),
    "a_offsets past M": (ValueError, "a_offsets", dict(a_offsets=torch.tensor([0, 10, 41], dtype=torch.int32)),
                         "mxfp8", "plain"),
    "a_offsets negative": (ValueError, "a_offsets", dict(a_offsets=torch.tensor([-1, 10, 30], dtype=torch.int32)),
                           "mxfp8", "plain"),
    "expert_ids wrong length": (ValueError, "expert_ids", dict(expert_ids=torch.tensor([0], dtype=torch.int32)),
                                "mxfp8", "plain"),
    "expert_ids int64": (TypeError, "expert_ids", dict(expert_ids=torch.tensor([0, 1])), "mxfp8", "plain"),
    "expert id >= E": (ValueError, "expert_ids", dict(expert_ids=torch.tensor([0, 3], dtype=torch.int32)),
                       "mxfp8", "plain"),
    "a_scales wrong shape": (ValueError, "a_scales", dict(a_scales=torch.zeros(40, 3, dtype=torch.float8_e8m0fnu)),
                             "mxfp8", "plain"),
    "a_scales wrong dtype": (TypeError, "a_scales", dict(a_scales=torch.zeros(40, 2)), "mxfp8", "plain"),
    "a_scales missing": (TypeError, "a_scales", dict(a_scales=None), "mxfp8", "plain"),
    "b_scales wrong shape": (ValueError, "b_scales", dict(b_scales=torch.zeros(3, 16, 1, dtype=torch.float8_e8m0fnu)),
                             "mxfp8", "plain"),
    "nvfp4 scales must be e4m3": (TypeError, "b_scales", dict(b_scales=torch.zeros(3, 16, 4, dtype=torch.uint8)),
                                  "nvfp4", "plain"),
    "fp8_block weight scales per 128x128": (ValueError, "b_scales", dict(b_scales=torch.zeros(3, 16, 1)),
                                            "fp8_block", "plain"),
    "bf16 takes no scales": (ValueError, "a_scales", dict(a_scales=torch.zeros(40, 2)), "bf16", "plain"),
    "swizzled A scales wrong atom": (ValueError, "a_scales", dict(a_scales=torch.zeros(1, 2, 32, 4, 4,
                                                                                       dtype=torch.float8_e8m0fnu)),
                                     "mxfp8", "swizzled"),
    "swizzled A scales too few blocks": (ValueError, "a_scales", dict(a_scales=torch.zeros(0, 1, 32, 4, 4,
                                                                                           dtype=torch.float8_e8m0fnu)),
                                         "mxfp8", "swizzled"),
    "swizzled B scales in the plain shape": (ValueError, "b_scales",
                                             dict(b_scales=torch.zeros(3, 16, 2, dtype=torch.float8_e8m0fnu)),
                                             "mxfp8", "swizzled"),
    "a_scale_offsets wrong length": (ValueError, "a_scale_offsets",
                                     dict(a_scale_offsets=torch.zeros(3, dtype=torch.int32)), "mxfp8", "swizzled"),
    "a_scale_offsets with plain": (ValueError, "a_scale_offsets",
                                   dict(a_scale_offsets=torch.zeros(2, dtype=torch.int32)), "mxfp8", "plain"),
    "unknown scale layout": (ValueError, "scale_layout", dict(scale_layout="tiled"), "mxfp8", "plain"),
    "swizzled fp8_block": (ValueError, "scale_layout", dict(scale_layout="swizzled"), "fp8_block", "plain"),
    "expert_scales NaN": (ValueError, "expert_scales", dict(expert_scales=torch.tensor([1.0, float("nan"), 1.0])),
                          "mxfp8", "plain"),
    "expert_scales inf": (ValueError, "expert_scales", dict(expert_scales=torch.tensor([1.0, 1.0, float("inf")])),
                          "mxfp8", "plain"),
    "expert_scales per slot instead of per expert": (ValueError, "expert_scales", dict(expert_scales=torch.ones(2)),
                                                     "mxfp8", "plain"),
    "expert_scales fp64": (TypeError, "expert_scales", dict(expert_scales=torch.ones(3, dtype=torch.float64)),
                           "mxfp8", "plain"),
    "row_scales wrong length": (ValueError, "row_scales", dict(row_scales=torch.ones(39)), "mxfp8", "plain"),
    "row_scales int": (TypeError, "row_scales", dict(row_scales=torch.ones(40, dtype=torch.int32)), "mxfp8", "plain"),
    "out wrong shape": (ValueError, "out", dict(out=torch.zeros(40, 15, dtype=torch.bfloat16)), "mxfp8", "plain"),
    "out wrong dtype": (TypeError, "out", dict(out=torch.zeros(40, 16)), "mxfp8", "plain"),
    "out non-contiguous": (ValueError, "out", dict(out=torch.zeros(16, 40, dtype=torch.bfloat16).t()), "mxfp8", "plain"),
    "out_dtype fp16": (TypeError, "out_dtype", dict(out_dtype=torch.float16), "mxfp8", "plain"),
    "unknown backend": (ValueError, "backend", dict(backend="cutlass"), "mxfp8", "plain"),
    # Weight-only formats: bf16 activations without scales, the block format's weights.
    "weight-only takes no a_scales": (ValueError, "a_scales",
                                      dict(a_scales=torch.zeros(40, 2, dtype=torch.float8_e8m0fnu)), "bf16_mxfp4",
                                      "plain"),
    "weight-only swizzled takes no a_scales": (ValueError, "a_scales",
                                               dict(a_scales=torch.zeros(1, 1, 32, 4, 4, dtype=torch.float8_e8m0fnu)),
                                               "bf16_mxfp8", "swizzled"),
    "weight-only takes no a_scale_offsets": (ValueError, "a_scale_offsets",
                                             dict(a_scale_offsets=torch.zeros(2, dtype=torch.int32)), "bf16_nvfp4",
                                             "swizzled"),
    "weight-only a is bf16": (TypeError, "a", dict(a=torch.zeros(40, 32, dtype=torch.uint8)), "bf16_mxfp4", "plain"),
    "weight-only a of fp8": (TypeError, "a", dict(a=torch.zeros(40, 64, dtype=torch.float8_e4m3fn)), "bf16_mxfp8",
                             "plain"),
    "weight-only b_scales missing": (TypeError, "b_scales", dict(b_scales=None), "bf16_mxfp4", "plain"),
    "bf16_nvfp4 scales must be e4m3": (TypeError, "b_scales", dict(b_scales=torch.zeros(3, 16, 4, dtype=torch.uint8)),
                                       "bf16_nvfp4", "plain"),
    "weight-only swizzled B scales in the plain shape": (ValueError, "b_scales",
                                                         dict(b_scales=torch.zeros(3, 16, 2,
                                                                                   dtype=torch.float8_e8m0fnu)),
                                                         "bf16_mxfp4", "swizzled"),
    "weight-only K not a multiple of the block": (ValueError, "a", dict(a=torch.zeros(40, 48, dtype=torch.bfloat16),
                                                                        b=torch.zeros(3, 16, 24, dtype=torch.uint8)),
                                                  "bf16_mxfp4", "plain"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_is_named(case):
    error, name, changes, fmt, layout = CASES[case]
    args, kwargs = good(fmt, layout)
    expect(error, name, args, kwargs, **changes)


def test_messages_say_expected_and_given():
    args, kwargs = good()
    args["a_offsets"] = torch.tensor([0, 10, 41], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^a_offsets: expected a_offsets\[G\] <= M=40, got 41"):
        call(args, kwargs)


@pytest.mark.parametrize("fmt", ["bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8"])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_weight_only_good_call_passes(fmt, layout):
    args, kwargs = good(fmt, layout)
    assert args["a"].dtype == torch.bfloat16 and args["a_scales"] is None
    assert call(args, kwargs).shape == (40, 16)
    # a QuantizedTensor of another format's activations is named
    with pytest.raises(ValueError, match="^fmt:"):
        moegemm.grouped_matmul(moegemm.quantize(torch.randn(40, 64), "mxfp8"), args["b"], None, args["b_scales"],
                               args["a_offsets"], args["expert_ids"], **kwargs)


def test_uint8_e8m0_scales_are_accepted():
    args, kwargs = good()
    ref = call(args, kwargs)
    args["a_scales"], args["b_scales"] = args["a_scales"].view(torch.uint8), args["b_scales"].view(torch.uint8)
    assert torch.equal(call(args, kwargs), ref)


def test_zero_groups_is_a_no_op():
    args, kwargs = good()
    args["a_offsets"] = torch.tensor([7], dtype=torch.int32)
    args["expert_ids"] = torch.zeros(0, dtype=torch.int32)
    out = torch.full((40, 16), 3.0, dtype=torch.bfloat16)
    call(args, dict(kwargs, out=out))
    assert bool((out == 3.0).all())


def test_a_repeated_shape_still_checks_what_changed():
    """A call with the shapes of an earlier one reuses its plan (plan.plan_for) but still
    checks the values, and any change of dtype, device or layout in memory is a new problem."""
    args, kwargs = good()
    call(args, kwargs)
    call(args, kwargs)
    expect(ValueError, "a_offsets", dict(args), kwargs, a_offsets=torch.tensor([0, 30, 10], dtype=torch.int32))
    expect(ValueError, "expert_ids", dict(args), kwargs, expert_ids=torch.tensor([0, 3], dtype=torch.int32))
    expect(ValueError, "a", dict(args), kwargs, a=torch.zeros(64, 40, dtype=torch.float8_e4m3fn).t())
    expect(TypeError, "a_scales", dict(args), kwargs, a_scales=args["a_scales"].float())


def test_bf16_weights_take_either_major_order_and_no_other_strides():
    """bf16 weights: contiguous, or N-major (the transpose(1, 2) of a contiguous [E, K, N]), the
    same products; other strides raise, also after an N-major call of the same shapes (a call's
    plan is kept by b's strides, not only by whether b is contiguous)."""
    args, kwargs = good("bf16")
    ref = call(args, kwargs)
    args["b"] = args["b"].transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(call(args, kwargs), ref)
    strided = torch.zeros(3, 16, 128, dtype=torch.bfloat16)[:, :, ::2]
    with pytest.raises(ValueError, match=r"^b: expected a contiguous tensor or the transpose\(1, 2\) of a contiguous"):
        call(dict(args, b=strided), kwargs)
