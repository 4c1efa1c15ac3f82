"""The oracles: the fp32 (or fp64) grouped matmul of docs/contract.md sections 1 and 4, written
plainly, and the PyTorch quantizer of activations.

Tests and benchmarks compare every backend against grouped_matmul. It decodes both
operands with the bit-exact codecs (dequantize_operand; the weights one expert at a time, so
an fp64 oracle of a large layer fits in memory), then runs one matmul per valid group. It
reads offsets on the host and loops over groups in Python: it is an oracle, not a fast path.

quantize is moegemm.quantize in PyTorch on any device (quantize.reference_quantize): the bytes
its kernel must write, and what moegemm.quantize runs on the CPU.
"""

from __future__ import annotations

import torch

from .quantize import dequantize_operand
from .quantize import reference_quantize as quantize

__all__ = ["grouped_matmul", "expert_weights", "quantize"]


def expert_weights(b: torch.Tensor, b_scales: torch.Tensor | None, fmt: str, e: int, *, scale_layout: str = "plain",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert e's decoded weights [N, K] (block scales applied; a global scale is the caller's)."""
    return dequantize_operand(b[e:e + 1], None if b_scales is None else b_scales[e:e + 1], fmt, "b",
                              scale_layout=scale_layout, dtype=dtype)[0]


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
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """For every slot g with e = expert_ids[g] >= 0 and rows [s, t) = a_offsets[g:g+2]:

        C[s:t] = round(decode(A[s:t]) @ decode(B[e]).T * expert_scales[e] * row_scales[s:t])

    decode() applies the block scales; rows outside valid groups of `out` are not touched
    (a fresh `out` starts as zeros). compute_dtype=torch.float64 gives the exact-product
    oracle used by the tests.
    """
    m = a.shape[0]
    a_values = dequantize_operand(
        a, a_scales, fmt, "a", scale_layout=scale_layout, a_offsets=a_offsets,
        a_scale_offsets=a_scale_offsets, dtype=compute_dtype,
    )
    n = b.shape[1]
    if out is None:
        out = torch.zeros(m, n, dtype=out_dtype, device=a.device)
    offsets, ids = a_offsets.tolist(), expert_ids.tolist()
    slots = [(e, g) for g, e in enumerate(ids) if e >= 0 and offsets[g + 1] > offsets[g]]
    decoded_expert, w = None, None
    for e, g in sorted(slots):  # (one expert decoded at a time)
        s, t = offsets[g], offsets[g + 1]
        if e != decoded_expert:
            decoded_expert, w = e, expert_weights(b, b_scales, fmt, e, scale_layout=scale_layout, dtype=compute_dtype)
        acc = a_values[s:t] @ w.T
        if expert_scales is not None:
            acc = acc * expert_scales[e].to(compute_dtype)
        if row_scales is not None:
            acc = acc * row_scales[s:t, None].to(compute_dtype)
        out[s:t] = acc.to(out.dtype)
    return out
