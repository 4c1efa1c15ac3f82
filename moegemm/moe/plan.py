"""The layer's plan: how moe_forward runs its two products for one shape class, decided once from
host values alone (the weights' shapes and formats, the routing's row and slot bounds, the
options) and cached, then passed down to the steps (forward.py).

    plan = plan_layer(fmt, layout, rows, groups, hidden, 2I, E, gate_up_layout, backend, device, ...)
    plan.up_form      the gate/up product's A, written by the gather in this token form (or None)
    plan.down_form    the down product's A, written by the gate/up step in this token form (or None)
    plan.fused        whether the gate/up step asks for the fused SwiGLU epilogue
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..formats import get_format
from ..fused import fused_pays, fused_supports
from ..ops import resolve_backend
from ..problem import GroupedProblem
from ..token_forms import TokenForm, token_form

__all__ = ["LayerPlan", "plan_layer"]


class LayerPlan(NamedTuple):
    up_form: TokenForm | None  # the gate/up product's A, written by the gather in this form
    down_form: TokenForm | None  # the down product's A, written by the gate/up step in this form
    fused: bool  # the gate/up step asks for the fused SwiGLU epilogue


@functools.lru_cache(maxsize=1024)
def plan_layer(fmt: str, layout: str, rows: int, groups: int, hidden: int, two_i: int, num_experts: int,
               gate_up_layout: str, backend: str, device: torch.device, fused: bool, static_intermediate: bool,
               tokens_given: bool, tokens_per_expert: float, up_prepacked: bool = False,
               down_prepacked: bool = False) -> LayerPlan:
    """How the layer runs its products for these shapes (host values only: the weight shapes and
    the routing's row and slot bounds), decided once per shape.

    fused: where the fused SwiGLU epilogue measured faster (fused.fused_pays at tokens_per_expert),
    and for nvfp4 only with a static intermediate global scale. Token forms: only where both products run on the
    sm90 block-format kernels, gate/up interleaved; the fused epilogue writes the down product's
    form only where it is the bf16 one, the format's operand otherwise. The weight-only formats
    have none: their tokens are bf16 as they are, as the bf16 format's. tokens_given: the tokens
    arrive as the format's operand (expert parallelism), placed as they are: no form of their own.
    up_prepacked, down_prepacked: the weights' order (mxfp4 and w4a8 run another kernel at decode
    on prepacked weights, with another token form)."""
    f = get_format(fmt)
    fused = fused and fused_pays(fmt, two_i, hidden, tokens_per_expert, up_prepacked) and (
        static_intermediate or not f.a.global_scale)
    up = GroupedProblem(f, rows, two_i, hidden, num_experts, groups, layout, torch.bfloat16, up_prepacked)
    down = GroupedProblem(f, rows, hidden, two_i // 2, num_experts, groups, layout, torch.bfloat16, down_prepacked)
    if gate_up_layout != "interleaved" or rows == 0 or groups == 0:
        return LayerPlan(None, None, fused)
    if resolve_backend(backend, up, device) != "sm90" or resolve_backend(backend, down, device) != "sm90":
        return LayerPlan(None, None, fused)
    up_form = None if tokens_given else token_form(fmt, up.n, up.k, rows, groups, up_prepacked)
    if up_form is None and not tokens_given:
        return LayerPlan(None, None, fused)
    down_form = token_form(fmt, down.n, down.k, rows, groups, down_prepacked)
    if down_form is not None and down_form.kind != "bf16" and fused and fused_supports(up, fmt):
        down_form = None
    return LayerPlan(up_form, down_form, fused)
