"""Public ops: validate -> pick a backend -> launch.

Backends:
    reference  the fp32 oracle (moegemm.reference), any device; reads offsets on the host
    triton     the portable tl kernel: compiled on CUDA, Triton's interpreter on the CPU
    sm90       the Hopper Gluon kernels: TMA, warp specialization, wgmma (kernels/sm90/, one
               kernel per format family)
    auto       sm90 where it applies on Hopper, else triton on CUDA; reference on the CPU
               (the interpreter is for testing, not speed)

An eager call's host work is kept to what its arguments' values need: the shape checks, the
problem and the backend choice are made once per shape (_plan).
"""

from __future__ import annotations

import torch

from . import fused as fused_epilogue
from . import reference
from .activation import check_activation, swiglu_quantize
from .config import MX_FORMATS
from .formats import get_format
from .kernels import portable, sm90
from .kernels.tl_source import interpreter_note, interpreter_usable
from .prepack import unpack_codes
from .quantize import QuantizedTensor, quantized_from_op
from .debug import values_checked
from .problem import GroupedProblem, Operands, operands_of
from .token_forms import KernelTokens, TokenForm
from .validation import check_no_grad, validate_grouped_matmul, validate_values

__all__ = ["grouped_matmul", "grouped_matmul_swiglu", "BACKENDS", "available_backends", "interpreter_usable",
           "resolve_backend"]

BACKENDS = ("auto", "reference", "triton", "sm90")


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The concrete backends that can run tensors on `device`."""
    device = torch.device(device)
    names = ["reference"]
    if (device.type == "cpu" and interpreter_usable()) or (device.type == "cuda" and torch.cuda.is_available()):
        names.append("triton")
    if _is_hopper(device):
        names.append("sm90")
    return names


def resolve_backend(backend: str, problem: GroupedProblem, device: torch.device) -> str:
    """The concrete backend a call with these arguments runs on (what `auto` picks)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        return "sm90" if _is_hopper(device) and sm90.supports(problem) else "triton"
    if backend not in available_backends(device):
        raise ValueError(f"backend: {backend!r} cannot run tensors on {device}; available: {available_backends(device)}"
                         + (interpreter_note(device) if backend == "triton" else ""))
    if backend == "sm90" and not sm90.supports(problem):
        raise ValueError(
            f"backend: 'sm90' needs 16-byte aligned rows of a, b and out (bf16, fp8_block; N % 8 == 0 for N-major "
            f"bf16 b) or K % 32 == 0 "
            f"({', '.join(MX_FORMATS)}) and runs no other format; got fmt="
            f"{problem.fmt.name}, K={problem.k}, N={problem.n}, out_dtype={problem.out_dtype}"
        )
    return backend


# The validated problem and resolved backend of a call, by everything they depend on: the
# arguments' shapes, dtypes, devices and contiguity, never their values. An eager call with
# the shapes of an earlier one repeats no shape check; the value checks still run wherever
# validation.values_checked says.
_PLANS: dict[tuple, tuple[GroupedProblem, str]] = {}
_PLANS_MAX = 4096


def _plan_key(operands: Operands, a_offsets, expert_ids, a_scale_offsets, row_scales, out, fmt, out_dtype,
              backend) -> tuple | None:
    """The key of a call's plan, or None where an argument is not a tensor (validation names it)."""
    if not (type(fmt) is str and type(backend) is str and type(operands.scale_layout) is str):
        return None
    tensors = (operands.a, operands.b, operands.a_scales, operands.b_scales, a_offsets, expert_ids, a_scale_offsets,
               operands.expert_scales, row_scales, out, operands.quantized_a_offsets)
    try:
        # (b's strides: its major order, which bf16 weights may have either way, decides the kernels)
        return (fmt, operands.scale_layout, operands.a_form, operands.b_prepacked, out_dtype, backend,
                operands.b.stride(),
                *[None if t is None else (t.shape, t.dtype, t.device, t.is_contiguous()) for t in tensors])
    except (AttributeError, TypeError):
        return None


def _plan(operands: Operands, a_offsets, expert_ids, a_scale_offsets, row_scales, out, *, fmt, out_dtype,
          backend) -> tuple[GroupedProblem, str]:
    """(problem, concrete backend) of a call: validated and resolved once per key, the values
    checked on every call that checks them."""
    key = _plan_key(operands, a_offsets, expert_ids, a_scale_offsets, row_scales, out, fmt, out_dtype, backend)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        if values_checked(operands.a.device):
            validate_values(plan[0], a_offsets, expert_ids, operands.expert_scales, operands.a_scales,
                            a_scale_offsets, operands.quantized_a_offsets, operands.a_form)
        return plan
    problem = validate_grouped_matmul(
        operands.a, operands.b, operands.a_scales, operands.b_scales, a_offsets, expert_ids, fmt=fmt,
        a_scale_offsets=a_scale_offsets, expert_scales=operands.expert_scales, row_scales=row_scales,
        scale_layout=operands.scale_layout, out=out, out_dtype=out_dtype,
        quantized_a_offsets=operands.quantized_a_offsets, a_form=operands.a_form, b_prepacked=operands.b_prepacked,
    )
    chosen = resolve_backend(backend, problem, operands.a.device)
    if operands.a_form is not None and chosen != "sm90":
        raise ValueError(f"a: tokens in {operands.a_form} are read by the sm90 kernels only; this call runs on "
                         f"backend {chosen!r}")
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = problem, chosen
    return problem, chosen


def _scale_offsets(a_scale_offsets, operands: Operands, a_offsets):
    """The call's a_scale_offsets, else those a QuantizedTensor made with its swizzled scales (for
    as many slots as the call has: other offsets are named by validation, as placed elsewhere)."""
    if a_scale_offsets is not None or operands.a_scale_offsets is None:
        return a_scale_offsets
    if isinstance(a_offsets, torch.Tensor) and a_offsets.shape == (operands.a_scale_offsets.shape[0] + 1,):
        return operands.a_scale_offsets
    return None


def _not_traced(operands: Operands):
    if operands.a_form is not None:
        raise ValueError("a: tokens in a token form are not traced by torch.compile (the MoE layer, one op there, "
                         "passes them)")


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
    operands = operands_of(a, b, a_scales, b_scales, fmt=fmt, scale_layout=scale_layout, expert_scales=expert_scales)
    a_scale_offsets = _scale_offsets(a_scale_offsets, operands, a_offsets)
    if torch.compiler.is_compiling() and out is None:  # traced as one opaque op (moegemm/library.py)
        _not_traced(operands)
        return torch.ops.moegemm.grouped_matmul(operands.a, operands.b, operands.a_scales, operands.b_scales,
                                                a_offsets, expert_ids, fmt, a_scale_offsets, operands.expert_scales,
                                                row_scales, operands.scale_layout, out_dtype, backend,
                                                operands.b_prepacked)
    problem, chosen = _plan(operands, a_offsets, expert_ids, a_scale_offsets, row_scales, out, fmt=fmt,
                            out_dtype=out_dtype, backend=backend)
    if chosen != "reference":  # (the reference is torch: autograd runs through it)
        check_no_grad(f"backend {chosen!r} (use backend='reference' for gradients)", a=operands.a, b=operands.b,
                      a_scales=operands.a_scales, b_scales=operands.b_scales, expert_scales=operands.expert_scales,
                      row_scales=row_scales)
    if out is None:
        out = torch.zeros(problem.m, problem.n, dtype=out_dtype, device=operands.a.device)
    return _run(problem, chosen, operands, a_offsets, expert_ids, a_scale_offsets, row_scales, out)


def _run(problem: GroupedProblem, chosen: str, operands: Operands, a_offsets, expert_ids, a_scale_offsets, row_scales,
         out):
    """Launch a validated problem on the resolved backend into `out`. Prepacked weights are read
    as they are by the sm90 kernels only; the other backends take them unpacked (a copy)."""
    a, b, a_scales, b_scales = operands.a, operands.b, operands.a_scales, operands.b_scales
    if problem.prepacked and chosen != "sm90":
        b = unpack_codes(b)
    if chosen == "reference":
        return reference.grouped_matmul(
            a, b, a_scales, b_scales, a_offsets, expert_ids, fmt=problem.fmt.name,
            a_scale_offsets=a_scale_offsets, expert_scales=operands.expert_scales, row_scales=row_scales,
            scale_layout=problem.scale_layout, out=out,
        )
    if chosen == "sm90":
        if operands.a_form is not None:
            return sm90.launch(sm90.LaunchArgs(problem, None, b, None, b_scales, a_offsets, expert_ids, out,
                                               expert_scales=operands.expert_scales, row_scales=row_scales,
                                               tokens=KernelTokens(operands.a_form, a, a_scales)))
        return sm90.launch(sm90.LaunchArgs(problem, a, b, a_scales, b_scales, a_offsets, expert_ids, out,
                                           a_scale_offsets=a_scale_offsets, expert_scales=operands.expert_scales,
                                           row_scales=row_scales))
    return portable.grouped_matmul(problem, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets,
                                   operands.expert_scales, row_scales, out)


def _product_buffer(problem: GroupedProblem, device: torch.device) -> torch.Tensor:
    """The unfused chain's bf16 product [M, N]. Its rows outside valid groups are unspecified in
    the result, so on a GPU it gets no zero fill (84 us of DeepSeek-V3's layer at 4096 tokens,
    H100); elsewhere zeros, so that Triton's interpreter computes on no uninitialized memory."""
    if device.type == "cuda":
        return torch.empty(problem.m, problem.n, dtype=torch.bfloat16, device=device)
    return torch.zeros(problem.m, problem.n, dtype=torch.bfloat16, device=device)


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
    operands = operands_of(a, b, a_scales, b_scales, fmt=fmt, scale_layout=scale_layout, expert_scales=expert_scales)
    a_scale_offsets = _scale_offsets(a_scale_offsets, operands, a_offsets)
    out_format = get_format(out_fmt)
    if out_scale_layout is None:
        out_scale_layout = "swizzled" if out_format.swizzle_capable else "plain"
    if torch.compiler.is_compiling():
        _not_traced(operands)
        if isinstance(out_scale_layout, TokenForm):
            raise ValueError("out_scale_layout: token forms are not traced by torch.compile (the MoE layer, one op "
                             "there, writes them)")
        outputs = torch.ops.moegemm.grouped_matmul_swiglu(
            operands.a, operands.b, operands.a_scales, operands.b_scales, a_offsets, expert_ids, fmt, out_fmt,
            activation, a_scale_offsets, operands.expert_scales, bias, operands.scale_layout, out_scale_layout,
            num_scale_blocks, out_global_scale, alpha, limit, fused, backend, gate_up_layout, operands.b_prepacked)
        return quantized_from_op(outputs, out_fmt, out_scale_layout == "swizzled", a_offsets)
    problem, chosen = _plan(operands, a_offsets, expert_ids, a_scale_offsets, None, None, fmt=fmt,
                            out_dtype=torch.bfloat16, backend=backend)
    check_no_grad("grouped_matmul_swiglu", a=operands.a, b=operands.b, a_scales=operands.a_scales,
                  b_scales=operands.b_scales, expert_scales=operands.expert_scales, bias=bias)
    out_form = out_scale_layout if isinstance(out_scale_layout, TokenForm) else None
    if (chosen == "sm90" and fused and gate_up_layout == "interleaved" and (out_form is None or out_form.kind == "bf16")
            and fused_epilogue.fused_supports(problem, out_fmt)):
        tokens = None if operands.a_form is None else KernelTokens(operands.a_form, operands.a, operands.a_scales)
        return fused_epilogue.launch_fused(
            problem, None if tokens else operands.a, operands.b, None if tokens else operands.a_scales,
            operands.b_scales, a_offsets, expert_ids, a_scale_offsets, operands.expert_scales, bias, out_fmt=out_fmt,
            activation=activation, out_scale_layout=out_scale_layout, num_scale_blocks=num_scale_blocks,
            out_global_scale=out_global_scale, alpha=alpha, limit=limit, tokens=tokens, out_form=out_form)
    h = _product_buffer(problem, operands.a.device)
    _run(problem, chosen, operands, a_offsets, expert_ids, a_scale_offsets, None, h)
    return swiglu_quantize(h, out_fmt, activation=activation, gate_up_layout=gate_up_layout, bias=bias,
                           a_offsets=a_offsets, expert_ids=expert_ids, a_scale_offsets=a_scale_offsets,
                           scale_layout=out_scale_layout, num_scale_blocks=num_scale_blocks,
                           global_scale=out_global_scale, alpha=alpha, limit=limit)
