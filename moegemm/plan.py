"""A grouped matmul call, planned: one Plan per key, built once and cached here, the one place.

A call's key is everything its checks and its kernels' choices depend on, never a tensor's
value: the arguments' shapes, dtypes, devices and strides, the formats and layouts, the backend,
the SwiGLU output of grouped_matmul_swiglu, and the context of the config choice
(config.choice_context: the planned tokens a slot; a forced config is never cached). `plan_for`
returns the call's Plan: the cached one for a key seen before, else `build_plan`'s, which
validates the arguments' shapes (validation.py), resolves the backend and plans its launch (the
portable kernel's, or the sm90 family's with its config, grid and token pre-pass). `Plan.run`
does a call's own work: the value checks wherever debug.values_checked says, the output, the
launches (`Plan.run_swiglu`: grouped_matmul_swiglu's, the fused epilogue or the unfused chain).

Backends:
    reference  the fp32 oracle (moegemm.reference), any device; reads offsets on the host
    triton     the portable tl kernel: compiled on CUDA, Triton's interpreter on the CPU
    sm90       the Hopper Gluon kernels: TMA, warp specialization, wgmma (kernels/sm90/, one
               kernel per format family)
    auto       sm90 where it applies on Hopper, else triton on CUDA; reference on the CPU
               (the interpreter is for testing, not speed)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import reference
from .config import choice_context
from .debug import values_checked
from .formats import get_format
from .fused import fused_supports, launch_fused
from .kernels import portable, sm90
from .kernels.tl_source import interpreter_note, interpreter_usable
from .prepack import unpack_codes
from .problem import GroupedProblem, Operands
from .quantized_tensor import QuantizedTensor
from .sm90_configs import MX_FORMATS
from .token_forms import KernelTokens, TokenForm
from .token_quantizers import swiglu_quantize
from .validation import check_no_grad, validate_grouped_matmul, validate_values

__all__ = ["BACKENDS", "Plan", "SwigluOutput", "available_backends", "build_plan", "plan_for", "resolve_backend"]

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


class SwigluOutput(NamedTuple):
    """What of grouped_matmul_swiglu's output its plan depends on: whether the product runs with
    the fused SwiGLU epilogue (sm90), and that epilogue's kernel config. (A NamedTuple: made and
    hashed in the plan key on every call.)"""

    out_fmt: str
    out_form: TokenForm | None  # the output in this token form (out_scale_layout a TokenForm)
    gate_up_layout: str
    fused: bool  # the caller allows the fused epilogue


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything a call of one key needs that depends only on the key: the validated problem,
    the concrete backend, and its launch planned (kernel: sm90.KernelPlan, portable.PortablePlan
    or ReferencePlan; None for an sm90 problem with nothing to launch)."""

    problem: GroupedProblem
    backend: str
    kernel: object | None
    fused: bool = False  # (grouped_matmul_swiglu) its product runs with the fused SwiGLU epilogue
    zeroes_out: bool = False  # its launch zeroes a fresh output's rows outside valid slots (sm90.zeroes_fresh_out)

    def run(self, operands: Operands, a_offsets, expert_ids, row_scales, out) -> torch.Tensor:
        """grouped_matmul of these operands into `out` (where None a fresh one, reading zero
        outside valid slots: zeroed by the launch where it can, else allocated so): the no-grad
        check, the values checked (where debug.values_checked says: on the CPU, and on the GPU
        under MOEGEMM_DEBUG=1), then the launch."""
        if self.backend != "reference" and _requires_grad(operands, row_scales):  # (the reference: autograd runs)
            check_no_grad(f"backend {self.backend!r} (use backend='reference' for gradients)", a=operands.a,
                          b=operands.b, a_scales=operands.a_scales, b_scales=operands.b_scales,
                          expert_scales=operands.expert_scales, row_scales=row_scales)
        self._check_values(operands, a_offsets, expert_ids)
        if out is None:
            fresh = torch.empty if self.zeroes_out else torch.zeros
            out = fresh(self.problem.m, self.problem.n, dtype=self.problem.out_dtype, device=operands.a.device)
            return self.launch(operands, a_offsets, expert_ids, row_scales, out, fresh_out=self.zeroes_out)
        return self.launch(operands, a_offsets, expert_ids, row_scales, out)

    def run_swiglu(self, operands: Operands, a_offsets, expert_ids, bias, *, out_fmt, activation, gate_up_layout,
                   out_scale_layout, num_scale_blocks, out_global_scale, alpha, limit) -> QuantizedTensor:
        """grouped_matmul_swiglu of these operands (a plan of swiglu output out_fmt in
        out_scale_layout): the checks as run's, then the fused epilogue's launch, or the product
        and token_quantizers.swiglu_quantize."""
        if _requires_grad(operands, bias):
            check_no_grad("grouped_matmul_swiglu", a=operands.a, b=operands.b, a_scales=operands.a_scales,
                          b_scales=operands.b_scales, expert_scales=operands.expert_scales, bias=bias)
        self._check_values(operands, a_offsets, expert_ids)
        if self.fused:
            tokens = None if operands.a_form is None else KernelTokens(operands.a_form, operands.a, operands.a_scales)
            return launch_fused(
                self.kernel, self.problem, None if tokens else operands.a, operands.b,
                None if tokens else operands.a_scales, operands.b_scales, a_offsets, expert_ids,
                operands.a_scale_offsets, operands.expert_scales, bias, out_fmt=out_fmt, activation=activation,
                out_scale_layout=out_scale_layout, num_scale_blocks=num_scale_blocks,
                out_global_scale=out_global_scale, alpha=alpha, limit=limit, tokens=tokens,
                out_form=out_scale_layout.form)
        h = self.launch(operands, a_offsets, expert_ids, None, _product_buffer(self.problem, operands.a.device))
        return swiglu_quantize(h, out_fmt, activation=activation, gate_up_layout=gate_up_layout, bias=bias,
                               a_offsets=a_offsets, expert_ids=expert_ids, a_scale_offsets=operands.a_scale_offsets,
                               scale_layout=out_scale_layout, num_scale_blocks=num_scale_blocks,
                               global_scale=out_global_scale, alpha=alpha, limit=limit)

    def _check_values(self, operands: Operands, a_offsets, expert_ids) -> None:
        """The call's values against the problem, where debug.values_checked says."""
        if values_checked(a_offsets.device):
            validate_values(self.problem, a_offsets, expert_ids, operands.expert_scales, operands.a_scales,
                            operands.a_scale_offsets, operands.quantized_a_offsets, operands.a_form)

    def launch(self, operands: Operands, a_offsets, expert_ids, row_scales, out, fresh_out: bool = False) -> torch.Tensor:
        """Run the product into `out` (allocated; fresh_out: uninitialized, for a plan that
        zeroes_out). Prepacked weights are read as they are by the sm90 kernels only; the other
        backends take them unpacked (a copy)."""
        a, b, a_scales, b_scales = operands.a, operands.b, operands.a_scales, operands.b_scales
        if self.backend == "sm90":
            if operands.a_form is None:
                return sm90.launch(self.kernel, sm90.LaunchArgs(
                    a, b, a_scales, b_scales, a_offsets, expert_ids, out, operands.a_scale_offsets,
                    operands.expert_scales, row_scales, None, None, fresh_out))
            return sm90.launch(self.kernel, sm90.LaunchArgs(
                None, b, None, b_scales, a_offsets, expert_ids, out, operands.a_scale_offsets, operands.expert_scales,
                row_scales, None, KernelTokens(operands.a_form, a, a_scales), fresh_out))
        if self.problem.prepacked:
            b = unpack_codes(b)
        return self.kernel.run(a, b, a_scales, b_scales, a_offsets, expert_ids, operands.a_scale_offsets,
                               operands.expert_scales, row_scales, out)


def _requires_grad(operands: Operands, other) -> bool:
    """Whether grad is enabled and an input requires it: an operand or `other` (row_scales, bias;
    then check_no_grad names it)."""
    if not torch.is_grad_enabled():
        return False
    a_scales, b_scales, expert_scales = operands.a_scales, operands.b_scales, operands.expert_scales
    return (operands.a.requires_grad or operands.b.requires_grad or (a_scales is not None and a_scales.requires_grad)
            or (b_scales is not None and b_scales.requires_grad)
            or (expert_scales is not None and expert_scales.requires_grad)
            or (isinstance(other, torch.Tensor) and other.requires_grad))


@dataclass(frozen=True)
class ReferencePlan:
    """The reference backend's launch of a problem: moegemm.reference.grouped_matmul (PortablePlan's
    arguments)."""

    problem: GroupedProblem

    def run(self, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets, expert_scales, row_scales, out):
        return reference.grouped_matmul(
            a, b, a_scales, b_scales, a_offsets, expert_ids, fmt=self.problem.fmt.name, a_scale_offsets=a_scale_offsets,
            expert_scales=expert_scales, row_scales=row_scales, scale_layout=self.problem.scale_layout, out=out)


def _product_buffer(problem: GroupedProblem, device: torch.device) -> torch.Tensor:
    """The unfused chain's bf16 product [M, N]. Its rows outside valid groups are unspecified in
    the result, so on a GPU it gets no zero fill (84 us of DeepSeek-V3's layer at 4096 tokens,
    H100); elsewhere zeros, so that Triton's interpreter computes on no uninitialized memory."""
    if device.type == "cuda":
        return torch.empty(problem.m, problem.n, dtype=torch.bfloat16, device=device)
    return torch.zeros(problem.m, problem.n, dtype=torch.bfloat16, device=device)


# The plans by key (module docstring); cleared when full (a process sees few keys).
_PLANS: dict[tuple, Plan] = {}
_PLANS_MAX = 4096


def _facts(t: torch.Tensor) -> tuple:
    """What of a tensor argument a plan depends on."""
    return t.shape, t.dtype, t.device, t.is_contiguous()


def _key(operands: Operands, a_offsets, expert_ids, row_scales, out, fmt, out_dtype, backend,
         swiglu: SwigluOutput | None) -> tuple | None:
    """The key of a call's plan, or None where it is not cached: an argument that is not a tensor
    (validation names it), or a forced config (config.choice_context)."""
    context = choice_context()
    if context is None or type(fmt) is not str or type(backend) is not str:
        return None
    _, a, b, a_scales, b_scales, scale_layout, expert_scales, placed_by, a_form, a_scale_offsets, b_prepacked = operands
    try:
        # (one expression, each fact read once: the key is built on every call)
        return (fmt, scale_layout, a_form, b_prepacked, out_dtype, backend, swiglu, context,
                a.shape, a.dtype, a.device, a.is_contiguous(),
                # (b's strides: its major order, which bf16 weights may have either way, decides the kernels)
                b.shape, b.dtype, b.device, b.stride(),
                a_offsets.shape, a_offsets.dtype, a_offsets.device, a_offsets.is_contiguous(),
                expert_ids.shape, expert_ids.dtype, expert_ids.device, expert_ids.is_contiguous(),
                None if a_scales is None else _facts(a_scales), None if b_scales is None else _facts(b_scales),
                None if a_scale_offsets is None else _facts(a_scale_offsets),
                None if expert_scales is None else _facts(expert_scales),
                None if row_scales is None else _facts(row_scales), None if out is None else _facts(out),
                # (the offsets a's scales were placed by: most often a_offsets itself, checked alike)
                "a_offsets" if placed_by is a_offsets else None if placed_by is None else _facts(placed_by))
    except (AttributeError, TypeError):
        return None


def plan_for(operands: Operands, a_offsets, expert_ids, row_scales, out, *, fmt, out_dtype, backend,
             swiglu: SwigluOutput | None = None) -> Plan:
    """The call's plan: built once per key (module docstring). Its tensors' values are checked by
    the plan's run (validation.validate_values)."""
    key = _key(operands, a_offsets, expert_ids, row_scales, out, fmt, out_dtype, backend, swiglu)
    try:
        plan = _PLANS.get(key) if key is not None else None
    except TypeError:  # (an argument that cannot be hashed: validation names it)
        key = plan = None
    if plan is None:
        plan = build_plan(operands, a_offsets, expert_ids, row_scales, out, fmt=fmt, out_dtype=out_dtype,
                          backend=backend, swiglu=swiglu)
        if key is not None:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def build_plan(operands: Operands, a_offsets, expert_ids, row_scales, out, *, fmt, out_dtype, backend,
               swiglu: SwigluOutput | None = None) -> Plan:
    """A call's plan from scratch: the arguments' shapes validated (their values are checked by
    every run), the backend resolved, the launch planned."""
    problem = validate_grouped_matmul(
        operands.a, operands.b, operands.a_scales, operands.b_scales, a_offsets, expert_ids, fmt=operands.fmt,
        a_scale_offsets=operands.a_scale_offsets, expert_scales=operands.expert_scales, row_scales=row_scales,
        scale_layout=operands.scale_layout, out=out, out_dtype=out_dtype,
        quantized_a_offsets=operands.quantized_a_offsets, a_form=operands.a_form, b_prepacked=operands.b_prepacked,
    )
    device = operands.a.device
    chosen = resolve_backend(backend, problem, device)
    if operands.a_form is not None and chosen != "sm90":
        raise ValueError(f"a: tokens in {operands.a_form} are read by the sm90 kernels only; this call runs on "
                         f"backend {chosen!r}")
    fused = (swiglu is not None and chosen == "sm90" and swiglu.fused and swiglu.gate_up_layout == "interleaved"
             and (swiglu.out_form is None or swiglu.out_form.kind == "bf16")
             and fused_supports(problem, swiglu.out_fmt))
    scale_blocks = operands.a_scales.shape[0] if operands.a_scales is not None else 0
    if chosen == "sm90":
        kernel = sm90.plan(problem, device, fused=fused, out_bytes=_out_bytes(problem, swiglu if fused else None),
                           expert_scales=operands.expert_scales is not None, row_scales=row_scales is not None,
                           tokens=operands.a_form is not None, scale_blocks=scale_blocks)
    elif chosen == "triton":
        kernel = portable.plan(problem, device, expert_scales=operands.expert_scales is not None,
                               row_scales=row_scales is not None, a_scale_offsets=operands.a_scale_offsets is not None,
                               scale_blocks=scale_blocks)
    else:
        kernel = ReferencePlan(problem)
    return Plan(problem, chosen, kernel, fused, zeroes_out=chosen == "sm90" and sm90.zeroes_fresh_out(kernel))


def _out_bytes(problem: GroupedProblem, swiglu: SwigluOutput | None) -> int:
    """Bytes an element of the kernel's output: the product's, or the fused epilogue's (its
    format's A operand; the bf16 token form)."""
    if swiglu is None:
        return problem.out_dtype.itemsize
    if swiglu.out_form is not None:
        return 2
    return get_format(swiglu.out_fmt).a.element.storage_dtype.itemsize
