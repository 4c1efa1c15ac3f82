"""The custom ops of moegemm/library.py: schemas and fake implementations agree with the real
ops (torch.library.opcheck), and torch.compile(fullgraph=True) traces the public functions."""

import pytest
import torch

import moegemm
from moegemm.kernels.tl_source import interpreter_usable

pytestmark = pytest.mark.skipif(not interpreter_usable(), reason="Triton's CPU interpreter needs numpy < 2.4")
CHECKS = ("test_schema", "test_faketensor")


def _routed(fmt, t=9, h=64, e=4, k=2):
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    ids[0, 1] = -1
    plan = moegemm.route(ids, e)
    return x, ids, plan


@pytest.mark.parametrize("fmt", ("bf16", "fp8_block", "mxfp8", "nvfp4", "bf16_nvfp4"))
def test_quantizer_ops(fmt):
    x, _, plan = _routed(fmt)
    layout = "swizzled" if moegemm.get_format(fmt).swizzle_capable else "plain"
    torch.library.opcheck(torch.ops.moegemm.gather_quantize,
                          (x, fmt, plan.token_index, plan.a_offsets, None, layout, plan.scale_blocks_bound, None),
                          test_utils=CHECKS)
    h = torch.randn(plan.num_grouped_rows, 128)
    torch.library.opcheck(torch.ops.moegemm.swiglu_quantize,
                          (h, fmt, "swiglu_oai", "interleaved", torch.randn(4, 128), plan.a_offsets, plan.expert_ids,
                           None, layout, plan.scale_blocks_bound, torch.tensor(1.0) if fmt == "nvfp4" else None,
                           1.702, 7.0), test_utils=CHECKS)


@pytest.mark.parametrize("fmt,prepacked", (("bf16", False), ("mxfp8", False), ("bf16_mxfp4", False),
                                           ("bf16_mxfp4", True)))
def test_matmul_ops(fmt, prepacked):
    x, _, plan = _routed(fmt)
    layout = "swizzled" if moegemm.get_format(fmt).swizzle_capable else "plain"
    a = moegemm.gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, scale_layout=layout)
    b = moegemm.quantize_weights(torch.randn(4, 128, 64), fmt, scale_layout=layout)
    if prepacked:
        b = moegemm.prepack_weights(b)
    # torch's schema checker compares input values with CPU ops that have no fp8 kernels.
    checks = CHECKS if fmt == "bf16" else ("test_faketensor",)
    torch.library.opcheck(torch.ops.moegemm.grouped_matmul,
                          (a.data, b.data, a.scales, b.scales, plan.a_offsets, plan.expert_ids, fmt, None, None, None,
                           layout, torch.bfloat16, "triton", prepacked), test_utils=checks)
    torch.library.opcheck(torch.ops.moegemm.grouped_matmul_swiglu,
                          (a.data, b.data, a.scales, b.scales, plan.a_offsets, plan.expert_ids, fmt, fmt, "swiglu",
                           None, None, None, layout, layout, None, None, 1.702, 7.0, True, "triton", "interleaved",
                           prepacked), test_utils=checks)


def test_routing_ops():
    _, ids, plan = _routed("bf16")
    torch.library.opcheck(torch.ops.moegemm.route, (ids, 4, "auto"), test_utils=CHECKS)
    y = torch.randn(plan.num_grouped_rows, 16)
    torch.library.opcheck(torch.ops.moegemm.unpermute_tokens,
                          (y, plan.token_index, plan.grouped_row, plan.valid, plan.a_offsets, plan.expert_ids,
                           plan.a_scale_offsets, plan.expert_of_row, torch.rand(9, 2), torch.randn(4, 16),
                           torch.float32, "auto"), test_utils=CHECKS)


def test_public_functions_compile_fullgraph():
    """route -> gather_quantize -> grouped_matmul_swiglu -> grouped_matmul -> unpermute, traced whole."""
    fmt = "mxfp8"
    w1 = moegemm.quantize_weights(torch.randn(4, 128, 64) * 0.1, fmt, scale_layout="swizzled")
    w2 = moegemm.quantize_weights(torch.randn(4, 64, 64) * 0.1, fmt, scale_layout="swizzled")

    def layer(x, ids, weights):
        plan = moegemm.route(ids, 4, weights)
        a = moegemm.gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, scale_layout="swizzled",
                                    num_scale_blocks=plan.scale_blocks_bound)
        mid = moegemm.grouped_matmul_swiglu(a.data, w1.data, a.scales, w1.scales, plan.a_offsets, plan.expert_ids,
                                            fmt=fmt, gate_up_layout="interleaved", out_fmt=fmt,
                                            scale_layout="swizzled",
                                            num_scale_blocks=plan.scale_blocks_bound, backend="triton")
        c = moegemm.grouped_matmul(mid.data, w2.data, mid.scales, w2.scales, plan.a_offsets, plan.expert_ids,
                                   fmt=fmt, scale_layout="swizzled", backend="triton")
        return moegemm.unpermute_tokens(c, plan, out_dtype=torch.float32)

    x, ids, _ = _routed(fmt)
    weights = torch.rand(9, 2)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, ids, weights), layer(x, ids, weights))


@pytest.mark.parametrize("fmt,layout", (("nvfp4", "swizzled"), ("bf16_mxfp4", "swizzled")))
def test_quantize_kernel_compiles_fullgraph(fmt, layout):
    """moegemm.quantize's kernel path (backend "triton": the default on CUDA) traced whole, as the
    gather_quantize op: the eager call's every field (swizzled scales with their slots' tile
    offsets, nvfp4's device-computed global scale; unscaled tokens keep the layout asked for)."""
    x = torch.randn(37, 64)
    a_offsets = torch.tensor([3, 10, 10, 30], dtype=torch.int32)

    def call(x, a_offsets):
        return moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets, backend="triton")

    got = torch.compile(call, fullgraph=True, backend="aot_eager")(x, a_offsets)
    want = call(x, a_offsets)
    assert (got.fmt, got.scale_layout) == (want.fmt, want.scale_layout)
    for name in ("data", "scales", "global_scale", "a_offsets", "a_scale_offsets"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if b is not None:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                      b.view(torch.uint8) if b.element_size() == 1 else b), name


def test_traced_public_ops_run_their_op_once(monkeypatch):
    """While torch.compile traces, route, unpermute_tokens, gather_quantize and swiglu_quantize
    each call their op (compile_boundary.traced_as), whose body runs the implementation and not
    the public function again: one op a call, and the eager call's every field."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "moegemm":
                self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    fmt = "mxfp8"
    x, ids, _ = _routed(fmt)
    weights, bias = torch.rand(9, 2), torch.randn(4, 128)
    y, h = torch.randn(18, 16), torch.randn(18, 128)

    def calls():
        plan = moegemm.route(ids, 4, weights)
        a = moegemm.gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, scale_layout="swizzled")
        mid = moegemm.swiglu_quantize(h, fmt, gate_up_layout="interleaved", activation="swiglu_oai", bias=bias,
                                      a_offsets=plan.a_offsets, expert_ids=plan.expert_ids, scale_layout="swizzled",
                                      num_scale_blocks=plan.scale_blocks_bound)
        return plan, a, mid, moegemm.unpermute_tokens(y, plan, out_dtype=torch.float32)

    want = calls()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with OpNames() as ops:
        got = calls()
    assert ops.names == ["route", "gather_quantize", "swiglu_quantize", "unpermute_tokens"]
    for name in ("token_index", "grouped_row", "valid", "a_offsets", "expert_ids", "a_scale_offsets", "topk_weights",
                 "expert_of_row"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), name
    for g, w in zip(got[1:3], want[1:3]):
        assert (g.fmt, g.scale_layout) == (w.fmt, w.scale_layout)
        for name in ("data", "scales", "a_offsets", "a_scale_offsets"):
            assert torch.equal(getattr(g, name).view(torch.uint8) if name != "a_offsets" else getattr(g, name),
                               getattr(w, name).view(torch.uint8) if name != "a_offsets" else getattr(w, name)), name
    assert torch.equal(got[3], want[3])
