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


def _sm90_on_the_cpu(monkeypatch, prepasses: bool = True) -> list:
    """The sm90 path on CPU tensors: Hopper faked, the token pre-passes run by Triton's
    interpreter (where `prepasses`, else stubbed too), the Gluon products stubbed (they write
    nothing). Returns the (name, arguments) of the kernels launched from here on."""
    import sys

    from moegemm.kernels import compiled_launch

    real, launched = compiled_launch.LaunchSite.launch, []

    def launch(site, grid, args, kwargs):  # (every launch goes through its key's site)
        launched.append((site.fn.__name__, args))
        if prepasses and site.fn.__name__ in PREPASS_KERNELS:
            real(site, grid, args, kwargs)

    monkeypatch.setattr(compiled_launch.LaunchSite, "launch", launch)
    for name, module in list(sys.modules.items()):
        if name.startswith("moegemm") and module is not None:
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
    calls = _sm90_on_the_cpu(monkeypatch)
    p = make_problem(fmt, "plain", pattern, 48, 64, "cpu")
    dirty_allocations(monkeypatch)
    results = []
    fills = _fills_of(lambda: results.append(moegemm.grouped_matmul(*p.args(), **p.kwargs(), out_dtype=out_dtype,
                                                                    backend="sm90")),
                      (p.m, p.n), out_dtype)
    out, launched = results[0], [name for name, _ in calls]
    free = out[~p.valid_rows()].view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)
    assert torch.equal(free, torch.zeros_like(free)), "a fresh output's row outside valid slots is not +0"
    if pattern.tokens:
        assert set(launched) & PREPASS_KERNELS, f"no token pre-pass launched: {launched}"
        assert not fills, f"the fresh output was filled by torch ({fills}) besides the pre-pass"
    else:
        assert not launched and fills, "G = 0: nothing launches, the output is allocated zeroed"


def _fill_variants_launched(monkeypatch) -> list:
    """The sm90 path on the CPU (_sm90_on_the_cpu, every launch stubbed): the (kernel name, FILL)
    of each launch from here on."""
    from moegemm.kernels import compiled_launch

    _sm90_on_the_cpu(monkeypatch, prepasses=False)
    stubbed, variants = compiled_launch.LaunchSite.launch, []

    def launch(site, grid, args, kwargs):
        variants.append((site.fn.__name__, kwargs.get("FILL", False)))
        stubbed(site, grid, args, kwargs)

    monkeypatch.setattr(compiled_launch.LaunchSite, "launch", launch)
    return variants


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8"])
def test_sm90_fresh_output_of_a_format_with_no_prepass_is_zeroed_by_its_kernel(fmt, monkeypatch):
    """A call without out on the sm90 path of a format with no token pre-pass: the output is
    allocated uninitialized, with no torch fill, and the one launch is the kernel's FILL variant,
    which zeroes the rows no valid slot owns after its tiles (kernels/sm90/free_rows.py; the bits
    on a GPU: test_sm90.py). A call into a given out launches the plain variant."""
    variants = _fill_variants_launched(monkeypatch)
    p = make_problem(fmt, "swizzled" if fmt.startswith("bf16_") else "plain", EDGE_ROWS, 48, 64, "cpu")
    kernel = "dense_kernel" if fmt in ("bf16", "fp8_block") else "decode_kernel"
    fills = _fills_of(lambda: moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="sm90"), (p.m, p.n),
                      torch.bfloat16)
    assert not fills, f"the fresh output was filled by torch ({fills}) besides the kernel"
    assert variants == [(kernel, True)]
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=torch.zeros(p.m, p.n, dtype=torch.bfloat16), backend="sm90")
    assert variants[1:] == [(kernel, False)]


def test_sm90_fresh_output_of_a_token_form_is_zeroed_by_the_decoding_kernel(monkeypatch):
    """mxfp4 tokens in the decoding kernel's bf16 form (the layer's kernels write them; no
    pre-pass runs), called without out: no torch fill, the FILL variant of the decoding kernel."""
    from moegemm.token_forms import TokenForm

    variants = _fill_variants_launched(monkeypatch)
    offsets, ids = torch.tensor([1, 21, 41], dtype=torch.int32), torch.tensor([0, -1], dtype=torch.int32)
    w = moegemm.quantize_weights(torch.randn(2, 64, 64), "mxfp4")
    tokens = moegemm.QuantizedTensor(torch.randn(44, 64).bfloat16(), None, "mxfp4", "a", TokenForm("bf16"), None,
                                     offsets)
    fills = _fills_of(lambda: moegemm.grouped_matmul(tokens, w, None, None, offsets, ids, fmt="mxfp4",
                                                     backend="sm90"), (44, 64), torch.bfloat16)
    assert not fills, f"the fresh output was filled by torch ({fills}) besides the kernel"
    assert variants == [("decode_kernel", True)]


@pytest.fixture
def faked_sm90(monkeypatch):
    """The sm90 path planned on the CPU (_sm90_on_the_cpu, every launch stubbed): the (name,
    arguments) of its launches, and its plan builds counted."""
    record = {"plans": 0, "launches": _sm90_on_the_cpu(monkeypatch, prepasses=False)}
    build = plan_module.build_plan

    def counting_build(*args, **kwargs):
        record["plans"] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(plan_module, "build_plan", counting_build)
    return record


def _tmas_of(args, tensor) -> list:
    """The TMA operands among a launch's arguments that read `tensor`'s memory."""
    from moegemm.kernels.compiled_launch import Tma

    return [t for t in args if type(t) is Tma and t.base.data_ptr() == tensor.data_ptr()]


def test_a_changed_argument_gets_its_own_sm90_plan_or_its_error(faked_sm90):
    """A call whose plan key matches an earlier call's runs that plan; a call that differs in any
    fact the plan depends on (b's order and expert count here, a's dtype and layout, the ids'
    dtype) plans anew: its own kernel arguments, or the error a first call gets."""
    e, n, k = 2, 16, 32
    a = torch.randn(6, k).to(torch.bfloat16)
    offsets, ids = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    by_k = torch.randn(e, k, n).to(torch.bfloat16)

    def weights_read(b, **kw):
        faked_sm90["launches"].clear()
        moegemm.grouped_matmul(kw.get("a", a), b, None, None, offsets, kw.get("ids", ids), fmt="bf16",
                               backend="sm90")
        (name, args), = faked_sm90["launches"]
        assert name == "dense_kernel"
        (tma, ) = _tmas_of(args, b)
        return tuple(tma.shape), tuple(tma.strides), args

    contiguous = by_k.transpose(1, 2).contiguous()
    assert weights_read(contiguous)[:2] == ((e * n, k), (k, 1))
    assert weights_read(contiguous)[:2] == ((e * n, k), (k, 1)) and faked_sm90["plans"] == 1
    # the same shape and dtype, N-major: read in place as [E, K, N]
    assert weights_read(by_k.transpose(1, 2))[:2] == ((e, k, n), (k * n, n, 1)) and faked_sm90["plans"] == 2
    more = torch.randn(e + 1, n, k).to(torch.bfloat16)
    shape, _, args = weights_read(more)
    sizes = [x for x in args if type(x) is int][1:6]  # (after claim_rounds: M, N, K, E, G)
    assert shape == ((e + 1) * n, k) and sizes == [6, n, k, e + 1, 2] and faked_sm90["plans"] == 3
    with pytest.raises(TypeError, match="a: expected dtype torch.bfloat16"):
        weights_read(contiguous, a=a.float())
    with pytest.raises(ValueError, match="a: expected a contiguous tensor"):
        weights_read(contiguous, a=a.t().contiguous().t())
    with pytest.raises(TypeError, match="expert_ids: expected dtype torch.int32"):
        weights_read(contiguous, ids=ids.long())


@pytest.mark.parametrize(("fmt", "prepacked"), [("mxfp8", False), ("mxfp4", False), ("w4a8", False),
                                               ("bf16_mxfp4", False), ("nvfp4", False), ("bf16_mxfp4", True),
                                               ("nvfp4", True)])
def test_sm90_weights_are_read_in_place_as_their_reshape(faked_sm90, fmt, prepacked):
    """The sm90 launches read the weights and their scales through views made once per plan: the
    shape and strides that reshaping them (as [E*N, K] rows, the swizzled scales as 32-bit words
    [rows, 4]) gives, at their own address; Triton's path gets a descriptor of that view."""
    e, n, k = 2, 128, 128
    offsets, ids = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32), torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    layout = "swizzled"
    x = torch.randn(4, k)
    a = x.to(torch.bfloat16) if fmt.startswith("bf16_") else moegemm.quantize(x, fmt, scale_layout=layout,
                                                                             a_offsets=offsets)
    b = moegemm.quantize_weights(torch.randn(e, n, k) / 8, fmt, scale_layout=layout)
    b = moegemm.prepack_weights(b) if prepacked else b
    moegemm.grouped_matmul(a, b, None, None, offsets, ids, fmt=fmt, backend="sm90")
    kernel, args = faked_sm90["launches"][-1]
    rows = b.data.reshape(e * n, -1)
    weights = _tmas_of(args, b.data)
    assert weights and all(tuple(t.shape) == rows.shape and tuple(t.strides) == rows.stride() for t in weights)
    # the scales staged through the ring (e2m1's; the decoding kernel's where staged_scales)
    words = _tmas_of(args, b.scales)
    assert len(words) == (kernel == "e2m1_kernel" or prepacked)
    viewed = b.scales.view(torch.uint8).view(torch.int32).reshape(-1, 4)
    for tma in words:
        assert (tuple(tma.shape), tuple(tma.strides)) == (viewed.shape, viewed.stride())
        descriptor = tma.descriptor()
        assert descriptor.base.dtype == torch.int32 and descriptor.base.data_ptr() == viewed.data_ptr()
    for tma in weights:
        assert tma.descriptor().base.dtype == rows.dtype


def test_a_tma_box_takes_the_layout_of_each_dtype():
    """A plan's TMA box keeps the shared layout of the dtype it last read (built once: ~15 us), and
    takes another dtype's layout for another dtype."""
    box = launcher._Box(64, 128)
    bf16, e4m3 = torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    for t in (bf16, e4m3, e4m3, bf16):
        tma = box.of(t)
        assert tma.layout == launcher._layout((64, 128), t.dtype) and tma.block_shape == [64, 128]
    assert box.of(bf16).layout != box.of(e4m3).layout
