"""Public ops: validate -> pick a backend -> launch.

Backends:
    reference  the fp32 oracle (moegemm.reference), any device; reads offsets on the host
    triton     the portable tl kernel: compiled on CUDA, Triton's interpreter on the CPU
    auto       triton on CUDA, reference on the CPU (the interpreter is for testing, not speed)
"""

from __future__ import annotations

import numpy
import torch

from . import reference
from .kernels import portable
from .validation import validate_grouped_matmul

__all__ = ["grouped_matmul", "BACKENDS", "available_backends", "interpreter_usable"]

BACKENDS = ("auto", "reference", "triton")


def interpreter_usable() -> bool:
    """Triton 3.6's CPU interpreter converts 1-element arrays with int(), which numpy >= 2.4 refuses."""
    major, minor = (int(part) for part in numpy.__version__.split(".")[:2])
    return (major, minor) < (2, 4)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The concrete backends that can run tensors on `device`."""
    device = torch.device(device)
    names = ["reference"]
    if (device.type == "cpu" and interpreter_usable()) or (device.type == "cuda" and torch.cuda.is_available()):
        names.append("triton")
    return names


def _resolve_backend(backend: str, device: torch.device) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend not in available_backends(device):
        raise ValueError(f"backend: {backend!r} cannot run tensors on {device}; available: {available_backends(device)}")
    return backend


def grouped_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scales: torch.Tensor | None,
    b_scales: torch.Tensor | None,
    a_offsets: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    fmt: str,
    a_scale_offsets: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    row_scales: torch.Tensor | None = None,
    scale_layout: str = "plain",
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Grouped block-scaled matmul over concatenated ("1D") token groups.

    For every group slot g:
        s, t = a_offsets[g], a_offsets[g + 1];  e = expert_ids[g]
        if e < 0 or t <= s: skip (nothing read, nothing written)
        C[m, n] = bf16_rne( sum_kb (sum_{k in kb} dec(A[m,k]) dec(B[e,n,k])) * sfa(m,kb) * sfb(e,n,kb)
                            * expert_scales[e] * row_scales[m] )      for m in [s, t), n in [0, N)

    a [M, K] (packed fp4: [M, K/2] uint8), b [E, N, K] (packed: [E, N, K/2]), a_offsets int32
    [G+1], expert_ids int32 [G]. Scales in `scale_layout` ("plain" or "swizzled"; see
    moegemm.layouts). Rows of `out` outside valid groups are left untouched; a fresh output
    starts as zeros. Returns `out` ([M, N], out_dtype).
    """
    problem = validate_grouped_matmul(
        a, b, a_scales, b_scales, a_offsets, expert_ids, fmt=fmt, a_scale_offsets=a_scale_offsets,
        expert_scales=expert_scales, row_scales=row_scales, scale_layout=scale_layout, out=out,
        out_dtype=out_dtype,
    )
    chosen = _resolve_backend(backend, a.device)
    if out is None:
        out = torch.zeros(problem.m, problem.n, dtype=out_dtype, device=a.device)
    if chosen == "reference":
        return reference.grouped_matmul(
            a, b, a_scales, b_scales, a_offsets, expert_ids, fmt=problem.fmt.name,
            a_scale_offsets=a_scale_offsets, expert_scales=expert_scales, row_scales=row_scales,
            scale_layout=scale_layout, out=out,
        )
    return portable.grouped_matmul(problem, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets,
                                   expert_scales, row_scales, out)
