"""The portable kernel (and the op around it) against the fp64 reference.

Every format x scale layout x token pattern (tests/cases.py TOKEN_PATTERNS), on fresh random
inputs, with the output poisoned before the call; rows outside valid groups must come back
bit-identical.
CPU: the kernel under Triton's interpreter. GPU (marked gpu): the compiled kernel.
"""

import pytest
import torch

import moegemm
from moegemm.config import PortableConfig, override_config
from moegemm.kernels.tl_source import interpreter_usable
from moegemm.ops import resolve_backend

from cases import FORMAT_LAYOUTS, TOKEN_PATTERNS, check_output, make_problem, poison_like, tolerance

needs_interpreter = pytest.mark.skipif(
    not interpreter_usable(), reason="triton 3.6's interpreter needs numpy < 2.4 (the GPU tests cover the kernel)"
)

PATTERN_IDS = [p.name for p in TOKEN_PATTERNS]


def run_case(fmt, layout, pattern, n, k, device, out_dtype=torch.bfloat16, with_scales=True, backend="triton"):
    p = make_problem(fmt, layout, pattern, n, k, device, with_scales=with_scales)
    poisoned = poison_like(p.m, n, out_dtype, device)
    out = poisoned.clone()
    result = moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, out_dtype=out_dtype, backend=backend)
    assert result is out
    if backend == "auto":  # the tolerance of what auto picks (sm90 on Hopper: its fp8 accumulator for mxfp8)
        problem = p.problem(out_dtype)
        backend = resolve_backend("auto", problem, torch.device(device))
    check_output(p, out, poisoned, tolerance(fmt, backend))


# The weight-only formats' operands are the bf16 format's A and the block formats' B, each run on
# every pattern above: on the CPU they take the patterns that reach their own code paths (ragged
# ends, skips, repeated experts and an offset start); the GPU tests run them all.
WEIGHT_ONLY_PATTERNS = ("ragged", "skip_some", "repeated_unsorted", "offset_start")
CPU_CASES = [(fmt, layout, pattern) for fmt, layout in FORMAT_LAYOUTS for pattern in TOKEN_PATTERNS
             if not moegemm.get_format(fmt).weight_only or pattern.name in WEIGHT_ONLY_PATTERNS]


@needs_interpreter
@pytest.mark.parametrize("fmt,layout,pattern", CPU_CASES, ids=lambda v: getattr(v, "name", v))
def test_portable_cpu_matches_reference(fmt, layout, pattern):
    # N=96: one partial 128-wide N tile. K=192: one full and one partial 128-wide K step.
    run_case(fmt, layout, pattern, n=96, k=192, device="cpu")


@needs_interpreter
@pytest.mark.parametrize("fmt,layout", FORMAT_LAYOUTS)
def test_portable_cpu_fp32_output_no_scales(fmt, layout):
    run_case(fmt, layout, TOKEN_PATTERNS[1], n=80, k=256, device="cpu", out_dtype=torch.float32, with_scales=False)


@needs_interpreter
@pytest.mark.parametrize("fmt,layout", [
    ("mxfp4", "swizzled"), ("nvfp4", "plain"), ("w4a8", "swizzled"), ("bf16", "plain"),
    ("bf16_mxfp4", "swizzled"), ("bf16_nvfp4", "plain"), ("bf16_mxfp8", "swizzled"),
])
def test_portable_cpu_small_tiles(fmt, layout):
    # 16x32 tiles with 32-wide K steps: many M and N tiles per group, two K steps, five programs
    # striding over them.
    cfg = PortableConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, programs_per_sm=5)
    with override_config(cfg):
        run_case(fmt, layout, TOKEN_PATTERNS[-1], n=40, k=64, device="cpu")


def n_major(w: torch.Tensor) -> torch.Tensor:
    """Weights [E, N, K] with unit stride along N: the transpose(1, 2) of a contiguous [E, K, N]
    copy (gpt-oss stores its experts [E, in, out])."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("backend,device", [("reference", "cpu"),
                                            pytest.param("triton", "cpu", marks=needs_interpreter),
                                            pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("pattern", [p for p in TOKEN_PATTERNS if p.name in ("ragged", "skip_some", "offset_start")],
                         ids=lambda p: p.name)
def test_bf16_weights_are_read_in_either_major_order(backend, device, pattern):
    """bf16 weights N-major, read in place: the bits their contiguous copy gives, against the
    reference with rows outside the slots untouched. N=48 and K=80: partial N and K tiles (the
    portable kernel's N-major loads are masked along both)."""
    p = make_problem("bf16", "plain", pattern, 48, 80, device)
    weights = n_major(p.w.data)
    assert not weights.is_contiguous() and weights.stride(1) == 1
    poisoned = poison_like(p.m, 48, torch.bfloat16, device)
    outs = []
    for b in (p.w.data, weights):
        out = poisoned.clone()
        moegemm.grouped_matmul(p.a.data, b, None, None, p.a_offsets, p.expert_ids, **p.kwargs(), out=out,
                               backend=backend)
        outs.append(out)
    check_output(p, outs[1], poisoned, tolerance("bf16", backend))
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16))


def test_auto_on_cpu_is_the_reference():
    pattern = TOKEN_PATTERNS[1]
    p = make_problem("mxfp8", "plain", pattern, 48, 64, "cpu")
    poisoned = poison_like(p.m, 48, torch.bfloat16, "cpu")
    out = poisoned.clone()
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out)
    check_output(p, out, poisoned)


def test_fresh_output_is_zero_outside_valid_rows():
    pattern = TOKEN_PATTERNS[-1]  # rows before a_offsets[0] and after a_offsets[G]
    p = make_problem("bf16", "plain", pattern, 32, 64, "cpu")
    out = moegemm.grouped_matmul(*p.args(), **p.kwargs(), backend="reference")
    assert out.shape == (p.m, 32) and out.dtype == torch.bfloat16
    assert bool((out[~p.valid_rows()] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS, ids=PATTERN_IDS)
@pytest.mark.parametrize("fmt,layout", FORMAT_LAYOUTS)
def test_portable_gpu_matches_reference(fmt, layout, pattern):
    # N=320: 2.5 tiles of 128. K=576: 4.5 K-steps of 128 for fp8_block, 9 of 64 otherwise.
    run_case(fmt, layout, pattern, n=320, k=576, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,layout", FORMAT_LAYOUTS)
def test_portable_gpu_fp32_output_no_scales(fmt, layout):
    run_case(fmt, layout, TOKEN_PATTERNS[0], n=192, k=2880 if fmt == "fp8_block" else 1024, device="cuda",
             out_dtype=torch.float32, with_scales=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,layout", FORMAT_LAYOUTS)
def test_auto_on_gpu_matches_reference(fmt, layout):
    run_case(fmt, layout, TOKEN_PATTERNS[3], n=256, k=512, device="cuda", backend="auto")


@pytest.mark.gpu
def test_gpu_bad_values_never_write_outside_allowed_rows(monkeypatch):
    # Without debug mode the GPU path reads no device values: offsets past M are clamped and an
    # expert id >= E skips its slot. Rows of the bad slot stay untouched; nothing crashes.
    monkeypatch.delenv("MOEGEMM_DEBUG", raising=False)
    p = make_problem("mxfp8", "plain", TOKEN_PATTERNS[5], 64, 64, "cuda")  # slots [0,31) [31,128) [128,191)
    p.a_offsets[-1] = p.m + 1000
    p.expert_ids[1] = 99  # E is 4
    out = torch.full((p.m, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="triton")
    torch.cuda.synchronize()
    assert bool(out[31:128].isnan().all())
    assert not bool(out[:31].isnan().any()) and not bool(out[128:].isnan().any())


@pytest.mark.gpu
def test_gpu_debug_mode_checks_device_values(monkeypatch):
    monkeypatch.setenv("MOEGEMM_DEBUG", "1")
    p = make_problem("mxfp8", "plain", TOKEN_PATTERNS[5], 64, 64, "cuda")
    p.a_offsets[-1] = p.m + 1
    with pytest.raises(ValueError, match="^a_offsets:"):
        moegemm.grouped_matmul(*p.args(), **p.kwargs())
    p = make_problem("mxfp8", "plain", TOKEN_PATTERNS[5], 64, 64, "cuda")
    p.expert_scales[0] = float("inf")
    with pytest.raises(ValueError, match="^expert_scales:"):
        moegemm.grouped_matmul(*p.args(), **p.kwargs())
