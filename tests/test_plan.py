"""moegemm/plan.py: one plan per call key, built once (validation, backend, the kernel's config,
grid and token pre-pass), and a new one for a new key: another shape, another config context."""

import functools

import pytest
import torch

import moegemm
from moegemm import config
from moegemm import plan as plan_module
from moegemm.kernels import portable
from moegemm.kernels.sm90 import launcher
from moegemm.kernels.tl_source import interpreter_usable

from cases import (EDGE_ROWS, FORMAT_LAYOUTS, ROWS_NO_GROUPS, TOKEN_PATTERNS, TokenPattern, check_output,
                   dirty_allocations, make_problem, poison_like, tolerance)


def _bf16_call(m: int, backend: str):
    """A small bf16 grouped matmul: two slots of m // 2 rows, experts 1 and 0."""
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(m, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(2, 16, 32, generator=gen).to(torch.bfloat16)
    offsets = torch.tensor([0, m // 2, m], dtype=torch.int32)
    ids = torch.tensor([1, 0], dtype=torch.int32)
    return lambda **kw: moegemm.grouped_matmul(a, b, None, None, offsets, ids, fmt="bf16", backend=backend, **kw)


@pytest.fixture
def counted(monkeypatch):
    """Counts of plan builds and of portable kernel config choices from here on."""
    counts = {"plans": 0, "configs": 0}
    build, choose = plan_module.build_plan, portable.portable_config

    def counting_build(*args, **kwargs):
        counts["plans"] += 1
        return build(*args, **kwargs)

    def counting_choice(*args, **kwargs):
        counts["configs"] += 1
        return choose(*args, **kwargs)

    monkeypatch.setattr(plan_module, "build_plan", counting_build)
    monkeypatch.setattr(portable, "portable_config", counting_choice)
    monkeypatch.setattr(plan_module, "_PLANS", {})
    return counts


def test_a_seen_key_builds_no_plan_and_a_new_shape_or_context_does(counted):
    call = _bf16_call(8, "reference")
    first = call()
    assert counted["plans"] == 1
    assert torch.equal(call(), first)
    assert counted["plans"] == 1, "a second call with the same key built a new plan"
    _bf16_call(12, "reference")()
    assert counted["plans"] == 2, "another shape must get its own plan"
    with config.planned_tokens_per_slot(64):
        call()
        assert counted["plans"] == 3, "another config context must get its own plan"
        call()
        assert counted["plans"] == 3
    call(out_dtype=torch.float32)
    assert counted["plans"] == 4, "another output dtype must get its own plan"


def test_a_forced_config_is_never_cached(counted):
    call = _bf16_call(8, "reference")
    with config.override_config(config.PortableConfig(16, 16, 32, 4, 1, 1)):
        call()
        call()
    assert counted["plans"] == 2


@pytest.mark.skipif(not interpreter_usable(), reason="triton 3.6's interpreter needs numpy < 2.4")
def test_the_kernel_config_is_chosen_once_per_key(counted):
    """The portable kernel's launch (config, grid, launch key) is planned with the call's plan,
    not again on every call."""
    call = _bf16_call(8, "triton")
    first = call()
    assert torch.equal(call(), first)
    assert counted["configs"] == 1, f"the config was chosen {counted['configs']} times for one key"


DECODE = TokenPattern("decode", (1,) * 8, why="8 slots of one token: the host-time shape")


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", [DECODE, TOKEN_PATTERNS[1]], ids=["decode", "ragged"])
@pytest.mark.parametrize(("fmt", "layout"), FORMAT_LAYOUTS, ids=[f"{f}-{lay}" for f, lay in FORMAT_LAYOUTS])
def test_sm90_second_call_plans_nothing_and_gives_the_same_bits(fmt, layout, pattern, monkeypatch):
    """On sm90 the config, grid and token pre-pass are planned with the call's plan: a second call
    of the key builds neither, and its product is the first's, bit for bit, and correct."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backend needs a Hopper GPU")
    builds = {"plans": 0, "token passes": 0}
    build, plan_tokens = plan_module.build_plan, launcher.plan_tokens

    def counting_build(*args, **kwargs):
        builds["plans"] += 1
        return build(*args, **kwargs)

    def counting_tokens(*args, **kwargs):
        builds["token passes"] += 1
        return plan_tokens(*args, **kwargs)

    monkeypatch.setattr(plan_module, "build_plan", counting_build)
    monkeypatch.setattr(launcher, "plan_tokens", counting_tokens)
    monkeypatch.setattr(plan_module, "_PLANS", {})
    p = make_problem(fmt, layout, pattern, 512, 1024, "cuda")
    first = moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="sm90")
    assert builds["plans"] == 1
    poisoned = poison_like(p.m, p.n, torch.bfloat16, "cuda")
    out = poisoned.clone()
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")  # (a key of its own: out given)
    assert builds["plans"] == 2
    seen = dict(builds)
    second = moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="sm90")
    assert builds == seen, f"a seen key planned again: {seen} then {builds}"
    assert torch.equal(first.view(torch.int16), second.view(torch.int16))
    check_output(p, out, poisoned, tolerance(fmt, "sm90"))
    valid = p.valid_rows().cuda()
    assert torch.equal(out[valid].view(torch.int16), first[valid].view(torch.int16))


def test_a_layout_name_and_its_object_share_one_plan_and_one_result(counted):
    """scale_layout="swizzled" and layouts.SWIZZLED are one layout: one plan key, the same product."""
    from moegemm import layouts

    gen = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    ids = torch.tensor([1, 0, 1], dtype=torch.int32)
    qa = moegemm.quantize(torch.randn(12, 64, generator=gen), "mxfp8", scale_layout="swizzled", a_offsets=offsets)
    qw = moegemm.quantize_weights(torch.randn(2, 16, 64, generator=gen), "mxfp8", scale_layout="swizzled")
    results = [moegemm.grouped_matmul(qa.data, qw.data, qa.scales, qw.scales, offsets, ids, fmt="mxfp8",
                                      scale_layout=layout, backend="reference")
               for layout in ("swizzled", layouts.SWIZZLED)]
    assert counted["plans"] == 1, "the name and its object must give one plan key"
    assert torch.equal(results[0], results[1])


PREPASS_FORMATS = ("mxfp8", "mxfp4", "nvfp4", "w4a8")  # (a token pre-pass before their sm90 product)
PREPASS_KERNELS = {"dequantize_rows_kernel", "decode_row_scales_kernel", "token_prepass_kernel"}
FILLS = {"zeros", "zero_", "fill_", "full", "zeros_like", "full_like", "new_zeros"}


def _sm90_on_the_cpu(monkeypatch) -> list:
    """The sm90 path on CPU tensors: Hopper faked, the token pre-passes run by Triton's
    interpreter, the Gluon products stubbed (they write nothing). Returns the names of the kernels
    launched from here on."""
    import sys

    from moegemm.kernels import compiled_launch

    real, launched = compiled_launch.launch, []

    def launch(fn, key, grid, args, kwargs):
        launched.append(fn.__name__)
        if fn.__name__ in PREPASS_KERNELS:
            real(fn, key, grid, args, kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("moegemm") and module is not None:
            for attr in [a for a, v in vars(module).items() if v is real]:
                monkeypatch.setattr(module, attr, launch)
            if hasattr(module, "_is_hopper"):
                monkeypatch.setattr(module, "_is_hopper", lambda device: True)
            counted = getattr(module, "_sm_count", None)
            if hasattr(counted, "cache_clear"):  # (a cache of this test's own: the CPU has no SM count after it)
                monkeypatch.setattr(module, "_sm_count", functools.cache(counted.__wrapped__))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("Props", (), {"multi_processor_count": 132})())
    monkeypatch.setattr(plan_module, "_PLANS", {})  # (this test's plans: sm90 on CPU tensors)
    return launched


def _fills_of(call, shape, dtype) -> list[str]:
    """The torch fills (zeros, fill_, ...) of a [shape] tensor of dtype that call() dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if (func.overloadpacket.__name__ in FILLS and isinstance(result, torch.Tensor)
                    and tuple(result.shape) == shape and result.dtype == dtype):
                seen.append(func.overloadpacket.__name__)
            return result

    with Recording():
        call()
    return seen


@pytest.mark.skipif(not interpreter_usable(), reason="triton 3.6's interpreter needs numpy < 2.4")
@pytest.mark.parametrize("pattern", [EDGE_ROWS, ROWS_NO_GROUPS], ids=lambda p: p.name)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", PREPASS_FORMATS)
def test_sm90_fresh_output_is_zeroed_by_the_token_prepass(fmt, out_dtype, pattern, monkeypatch):
    """A call without out on the sm90 path of a format with a token pre-pass: the output is
    allocated uninitialized (here dirty) and the pre-pass zeroes its rows outside valid slots in
    its own launch (no torch fill: a launch less on the host); with no slot, nothing launches and
    the output is allocated zeroed. Either way those rows read +0 (docs/contract.md section 2)."""
    launched = _sm90_on_the_cpu(monkeypatch)
    p = make_problem(fmt, "plain", pattern, 48, 64, "cpu")
    dirty_allocations(monkeypatch)
    results = []
    fills = _fills_of(lambda: results.append(moegemm.grouped_matmul(*p.args(), **p.kwargs(), out_dtype=out_dtype,
                                                                    backend="sm90")),
                      (p.m, p.n), out_dtype)
    out = results[0]
    free = out[~p.valid_rows()].view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)
    assert torch.equal(free, torch.zeros_like(free)), "a fresh output's row outside valid slots is not +0"
    if pattern.tokens:
        assert set(launched) & PREPASS_KERNELS, f"no token pre-pass launched: {launched}"
        assert not fills, f"the fresh output was filled by torch ({fills}) besides the pre-pass"
    else:
        assert not launched and fills, "G = 0: nothing launches, the output is allocated zeroed"
