"""Public ops: the problem of a call -> its plan -> the launch.

A call's operands are unwrapped (problem.operands_of), its plan is looked up or built once per
key (plan.plan_for: the checks, the backend, the kernel's config, grid and token pre-pass), and
the plan runs on the call's tensors. The backends are plan.py's. Under torch.compile each op is
one opaque custom op (compile_boundary.py, library.py).
"""

from __future__ import annotations

import torch

from .compile_boundary import traced_as
from .formats import get_format
from .gate_up import check_activation
from .kernels.tl_source import interpreter_usable
from .layouts import PLAIN, SWIZZLED, scale_layout_of
from .plan import BACKENDS, SwigluOutput, available_backends, plan_for, resolve_backend
from .problem import operands_of
from .quantized_tensor import QuantizedTensor
from .token_forms import TokenForm

__all__ = ["grouped_matmul", "grouped_matmul_swiglu", "BACKENDS", "available_backends", "interpreter_usable",
           "resolve_backend"]


@traced_as("grouped_matmul")
def grouped_matmul(
    a: torch.Tensor | QuantizedTensor,
    b: torch.Tensor | QuantizedTensor,
    a_scales: torch.Tensor | None,
    b_scales: torch.Tensor | None,
    a_offsets: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    fmt: str,
    a_scale_offsets: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    row_scales: torch.Tensor | None = None,
    scale_layout: str | None = None,
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

    a, b: the QuantizedTensors of moegemm.quantize / quantize_weights (then a_scales and
    b_scales are None: theirs are used; nvfp4's global scales are folded into expert_scales; the
    a_offsets that a's swizzled scales were placed by must be the call's, checked where values
    are checked: always on the CPU, on the GPU under MOEGEMM_DEBUG=1), or raw tensors: a [M, K]
    (packed fp4: [M, K/2] uint8; the weight-only formats bf16_mxfp4, bf16_nvfp4 and bf16_mxfp8: bf16
    without scales, a_scales None), b [E, N, K] (packed: [E, N, K/2]) with their scales, and then
    the caller answers for what cannot be checked: nvfp4's global scales go in expert_scales,
    and swizzled a_scales must have been made for this call's a_offsets. a_offsets int32
    [G+1], expert_ids int32 [G]. Scales in `scale_layout` ("plain" or "swizzled", see
    moegemm.layouts; None: the QuantizedTensor operands', else "plain"). Rows of `out` outside
    valid groups are left untouched; a fresh output starts as zeros. Returns `out` ([M, N],
    out_dtype). Inference only: backends other than "reference" refuse inputs that require
    grad outside torch.no_grad().

    `a` may also be a QuantizedTensor in a token form (gather_quantize / scatter_quantize /
    swiglu_quantize with a TokenForm as scale_layout, token_forms.py), for the sm90 kernel that
    reads that form: it runs no pre-pass over A. scale_layout is then b's.
    """
    operands = operands_of(a, b, a_scales, b_scales, a_offsets, fmt=fmt, scale_layout=scale_layout,
                           expert_scales=expert_scales, a_scale_offsets=a_scale_offsets)
    plan = plan_for(operands, a_offsets, expert_ids, row_scales, out, fmt=fmt, out_dtype=out_dtype, backend=backend)
    return plan.run(operands, a_offsets, expert_ids, row_scales, out)


@traced_as("grouped_matmul_swiglu")
def grouped_matmul_swiglu(
    a: torch.Tensor | QuantizedTensor,
    b: torch.Tensor | QuantizedTensor,
    a_scales: torch.Tensor | None,
    b_scales: torch.Tensor | None,
    a_offsets: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    fmt: str,
    gate_up_layout: str,
    out_fmt: str = "bf16",
    activation: str = "swiglu",
    a_scale_offsets: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale_layout: str | None = None,
    out_scale_layout: str | TokenForm | None = None,
    num_scale_blocks: int | None = None,
    out_global_scale: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    fused: bool = True,
    backend: str = "auto",
) -> QuantizedTensor:
    """The gate/up product followed by SwiGLU and the quantization of its output:

        h = grouped_matmul(a, b, ...)          [M, 2I]: gate_up_layout="interleaved": columns
                                               2j, 2j+1 = gate_j, up_j (interleave_gate_up);
                                               "concat": [gate; up] (stated, never guessed)
        h = h * expert_scales[e] + bias[e]     the expert scale before the activation
        y = swiglu(h) or swiglu_oai(h)         [M, I]
        return quantize(y, out_fmt)            a QuantizedTensor, the down product's A operand

    out_fmt is any format's A operand ("bf16", "mxfp8", "nvfp4", ...; a weight-only format's is
    bf16, as for "bf16"). Its scales go in
    `out_scale_layout` (default: swizzled for the block formats, else plain); the swizzled
    layout pads every group to 128 scale rows, padding zero, and `num_scale_blocks` bounds
    its first dimension (default ceil(M/128) + G). nvfp4 output needs `out_global_scale`
    (fp32, one value) when fused. out_scale_layout a TokenForm (mxfp8, mxfp4, w4a8): the
    output in the token form the down product's sm90 kernel reads (token_forms.py).

    On sm90 with fused=True, bf16/mxfp8/w4a8/nvfp4/mxfp4 outputs come straight out of the
    matmul's epilogue (the [M, 2I] product never reaches memory), as does the bf16 token form.
    Elsewhere, for fp8_block outputs, for the e4m3 token form, and for
    gate_up_layout="concat" (columns [gate; up], DeepSeek's FP8 order), it runs the unfused
    chain: the product to bf16, then activation.swiglu_quantize. Rows outside valid groups hold
    unspecified data (and no scales in the swizzled layout). a, b, a_scales, b_scales,
    expert_scales and scale_layout as in grouped_matmul (QuantizedTensor operands, a token form
    included, or raw tensors).
    """
    check_activation(activation, gate_up_layout)
    operands = operands_of(a, b, a_scales, b_scales, a_offsets, fmt=fmt, scale_layout=scale_layout,
                           expert_scales=expert_scales, a_scale_offsets=a_scale_offsets)
    out_format = get_format(out_fmt)
    if out_scale_layout is None:
        out_layout = SWIZZLED if out_format.swizzle_capable else PLAIN
    else:
        out_layout = scale_layout_of(out_scale_layout, "out_scale_layout")
    out_form = out_layout.form
    plan = plan_for(operands, a_offsets, expert_ids, None, None, fmt=fmt, out_dtype=torch.bfloat16, backend=backend,
                    swiglu=SwigluOutput(out_format.name, out_form, gate_up_layout, bool(fused)))
    return plan.run_swiglu(operands, a_offsets, expert_ids, bias, out_fmt=out_fmt, activation=activation,
                           gate_up_layout=gate_up_layout, out_scale_layout=out_layout,
                           num_scale_blocks=num_scale_blocks, out_global_scale=out_global_scale, alpha=alpha,
                           limit=limit)
