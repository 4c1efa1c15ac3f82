"""The layer's plan: how moe_forward runs its two products for one shape class, decided once from
host values alone (the weights' shapes and formats, the routing's row and slot bounds, the
options) and cached, then passed down to the steps (forward.py).

    plan = plan_layer(fmt, layout, rows, groups, hidden, 2I, E, gate_up_layout, backend, device, ...)
    plan.up_form      the gate/up product's A, written by the gather in this token form (or None)
    plan.down_form    the down product's A, written by the gate/up step in this token form (or None)
    plan.fused        whether the gate/up step asks for the fused SwiGLU epilogue
    plan.run_products(a, ...)  the two products through their plans (plan.Plan), built once for
                      the call's own tensors (call_facts) by plan.build_plan, which validates them
    plan.fmt, .scale_layout, .backend, .gate_up_layout, .scale_blocks, .token_scale_offsets: the
                      key's values every call passes down
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from ..config import choice_context
from ..formats import get_format
from ..layouts import PLAIN, ROWS_PER_BLOCK, ScaleLayout
from ..fused import fused_pays, fused_supports
from ..plan import Plan, SwigluOutput, build_plan, resolve_backend
from ..problem import GroupedProblem, operands_of
from ..token_forms import TokenForm, token_form

__all__ = ["LayerPlan", "call_facts", "plan_layer"]

# The product plans a layer plan keeps (distinct weights and expert scales of its shapes: few).
_PRODUCTS_MAX = 64


@dataclass(frozen=True, eq=False)
class LayerPlan:
    up_form: TokenForm | None  # the gate/up product's A, written by the gather in this form
    down_form: TokenForm | None  # the down product's A, written by the gate/up step in this form
    fused: bool  # the gate/up step asks for the fused SwiGLU epilogue
    # What every call of the key passes down (host values of the key, made once):
    fmt: str = ""
    scale_layout: ScaleLayout = PLAIN  # of the weights' scales, and of the tokens' where they have them
    backend: str = "auto"
    gate_up_layout: str = "interleaved"
    scale_blocks: int = 0  # swizzled token scales' 128-row blocks: the routing's bound ceil(rows / 128) + E
    token_scale_offsets: bool = False  # the tokens' scales are swizzled: the routing's a_scale_offsets place them
    # call_facts -> the plan.Plans of the two products (plan.build_plan on a call's operands, which
    # validates them), built at the first call of those facts, run directly after
    products: dict = field(default_factory=dict, repr=False)

    def run_products(self, a, w_gate_up, w_down, a_offsets, expert_ids, a_scale_offsets, out, *, facts, activation,
                     gate_up_bias, gate_up_scales, down_scales, intermediate_global_scale, alpha,
                     limit) -> torch.Tensor:
        """The layer's two products on its grouped tokens a (in up_form where given): gate/up and
        SwiGLU into the down product's A (down_form where given), then the down product into
        `out`, each through its plan: kept from an earlier call of the same facts, else built (and
        kept where the facts are known, for up to _PRODUCTS_MAX facts). Returns out."""
        fmt, scale_layout, backend = self.fmt, self.scale_layout, self.backend
        kept = None if facts is None else self.products.get(facts)
        up_operands = operands_of(a, w_gate_up, None, None, a_offsets, fmt=fmt, scale_layout=scale_layout,
                                  expert_scales=gate_up_scales, a_scale_offsets=a_scale_offsets)
        up = kept[0] if kept is not None else build_plan(
            up_operands, a_offsets, expert_ids, None, None, fmt=fmt, out_dtype=torch.bfloat16, backend=backend,
            swiglu=SwigluOutput(fmt, self.down_form, self.gate_up_layout, self.fused))
        mid = up.run_swiglu(up_operands, a_offsets, expert_ids, gate_up_bias, out_fmt=fmt, activation=activation,
                            gate_up_layout=self.gate_up_layout, out_scale_layout=self.down_form or scale_layout,
                            num_scale_blocks=self.scale_blocks, out_global_scale=intermediate_global_scale,
                            alpha=alpha, limit=limit)
        down_operands = operands_of(mid, w_down, None, None, a_offsets, fmt=fmt, scale_layout=scale_layout,
                                    expert_scales=down_scales, a_scale_offsets=a_scale_offsets)
        if kept is not None:
            down = kept[1]
        else:
            down = build_plan(down_operands, a_offsets, expert_ids, None, out, fmt=fmt, out_dtype=torch.bfloat16,
                              backend=backend)
            if facts is not None and len(self.products) < _PRODUCTS_MAX:
                self.products[facts] = (up, down)
        return down.run(down_operands, a_offsets, expert_ids, None, out)


def call_facts(*tensors) -> tuple | None:
    """What the products' plans depend on beyond the layer plan's key: the shapes, dtypes,
    devices and strides of the tensors the caller gives (weights, their scales and global scales,
    expert scales, received tokens; None where absent) and the config choice's context. None
    where nothing may be kept: a forced config (config.choice_context), or an argument that is
    not a tensor (build_plan's validation names it)."""
    context = choice_context()
    if context is None:
        return None
    facts = [context]
    for t in tensors:
        if t is not None and not isinstance(t, torch.Tensor):
            return None
        facts.append(None if t is None else (t.shape, t.dtype, t.device, t.stride()))
    return tuple(facts)


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
    fused = fused and fused_pays(fmt, two_i, hidden, tokens_per_expert, up_prepacked)
    f = get_format(fmt)
    fused = fused and (static_intermediate or not f.a.global_scale)
    up = GroupedProblem(f, rows, two_i, hidden, num_experts, groups, layout, torch.bfloat16, up_prepacked)
    down = GroupedProblem(f, rows, hidden, two_i // 2, num_experts, groups, layout, torch.bfloat16, down_prepacked)
    layout = up.scale_layout
    passed = dict(fmt=f.name, scale_layout=layout, backend=backend, gate_up_layout=gate_up_layout,
                  scale_blocks=math.ceil(rows / ROWS_PER_BLOCK) + groups,
                  token_scale_offsets=layout.swizzled and f.a_scaled)
    if gate_up_layout != "interleaved" or rows == 0 or groups == 0:
        return LayerPlan(None, None, fused, **passed)
    if resolve_backend(backend, up, device) != "sm90" or resolve_backend(backend, down, device) != "sm90":
        return LayerPlan(None, None, fused, **passed)
    up_form = None if tokens_given else token_form(f, up.n, up.k, rows, groups, up_prepacked)
    if up_form is None and not tokens_given:
        return LayerPlan(None, None, fused, **passed)
    down_form = token_form(f, down.n, down.k, rows, groups, down_prepacked)
    if down_form is not None and down_form.kind != "bf16" and fused and fused_supports(up, fmt):
        down_form = None
    return LayerPlan(up_form, down_form, fused, **passed)
