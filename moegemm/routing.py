"""Routing helpers: router top-k choices -> grouped ("1D") token layout, and back.

    plan = route(topk_ids, num_experts, topk_weights)        # [T, k] expert ids (and weights)
    a    = permute_tokens(x, plan)                          # [T*k, K]: rows grouped by expert
    c    = grouped_matmul(a, w, ..., plan.a_offsets, plan.expert_ids, ...)
    y    = unpermute_tokens(c, plan)                        # [T, N]: sum_j w[t, j] * c[row of (t, j)]

One slot per expert (slot e holds expert e; empty experts are empty groups). A choice whose
id lies outside [0, num_experts) is dropped: it gets no group row and adds nothing to the
combine (expert parallelism marks experts owned by other ranks this way). Pure PyTorch,
no Python loop over tokens, no host synchronization: every size is T*k or E.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import layouts

__all__ = ["RoutingPlan", "route", "permute_tokens", "unpermute_tokens"]


@dataclass(frozen=True)
class RoutingPlan:
    """Where every (token, choice) of the router went.

    token_index:       int64 [T*k]; grouped row p holds token token_index[p] (rows past
                       a_offsets[E] hold dropped choices and belong to no group)
    grouped_row:       int64 [T, k]; the grouped row of choice j of token t
    valid:             bool [T, k]; False for dropped choices
    a_offsets:         int32 [E+1]; expert e owns grouped rows [a_offsets[e], a_offsets[e+1])
    expert_ids:        int32 [E]; arange(E)
    a_scale_offsets:   int32 [E]; for activation scales in the swizzled layout
    topk_weights:      [T, k] or None
    """

    token_index: torch.Tensor
    grouped_row: torch.Tensor
    valid: torch.Tensor
    a_offsets: torch.Tensor
    expert_ids: torch.Tensor
    a_scale_offsets: torch.Tensor
    topk_weights: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.grouped_row.shape[0]

    @property
    def num_grouped_rows(self) -> int:
        return self.token_index.shape[0]

    @property
    def scale_blocks_bound(self) -> int:
        """A host-known upper bound on the swizzled A scale blocks: ceil(T*k / 128) + E."""
        return math.ceil(self.num_grouped_rows / layouts.ROWS_PER_BLOCK) + self.expert_ids.numel()


def route(topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None) -> RoutingPlan:
    """Sort the T*k router choices by expert (stable: token order within an expert)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected shape [T, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    if not isinstance(num_experts, int) or num_experts < 0:
        raise ValueError(f"num_experts: expected an int >= 0, got {num_experts!r}")
    if topk_weights is not None:
        if not isinstance(topk_weights, torch.Tensor):
            raise TypeError(f"topk_weights: expected a torch.Tensor, got {type(topk_weights).__name__}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
        if topk_weights.device != topk_ids.device:
            raise ValueError(f"topk_weights: expected device {topk_ids.device}, got {topk_weights.device}")

    device = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, torch.full_like(ids, num_experts))  # dropped choices sort last
    order = torch.sort(key, stable=True).indices
    grouped_row = torch.empty_like(order)
    grouped_row[order] = torch.arange(order.numel(), device=device)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    a_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    a_offsets[1:] = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    k = topk_ids.shape[1]
    return RoutingPlan(
        token_index=order // max(k, 1),
        grouped_row=grouped_row.reshape(topk_ids.shape),
        valid=valid.reshape(topk_ids.shape),
        a_offsets=a_offsets,
        expert_ids=torch.arange(num_experts, dtype=torch.int32, device=device),
        a_scale_offsets=layouts.a_scale_offsets(a_offsets),
        topk_weights=topk_weights,
    )


def permute_tokens(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """[T, K] tokens -> [T*k, K] rows grouped by expert (a copy per choice)."""
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"x: expected {plan.num_tokens} rows (the routed tokens), got shape {tuple(x.shape)}")
    return x.index_select(0, plan.token_index)


def unpermute_tokens(
    y: torch.Tensor,
    plan: RoutingPlan,
    topk_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[T*k, N] grouped rows -> [T, N]: out[t] = sum_j w[t, j] * y[grouped_row[t, j]], in fp32.

    Weights default to the plan's (all ones when it has none). Dropped choices add nothing,
    even when their rows of y hold garbage.
    """
    if y.dim() != 2 or y.shape[0] != plan.num_grouped_rows:
        raise ValueError(f"y: expected shape [{plan.num_grouped_rows}, N], got {tuple(y.shape)}")
    weights = topk_weights if topk_weights is not None else plan.topk_weights
    rows = y.index_select(0, plan.grouped_row.reshape(-1)).float().reshape(*plan.grouped_row.shape, y.shape[1])
    if weights is not None:
        if weights.shape != plan.grouped_row.shape:
            raise ValueError(f"topk_weights: expected shape {tuple(plan.grouped_row.shape)}, got {tuple(weights.shape)}")
        rows = rows * weights.float().unsqueeze(-1)
    rows = torch.where(plan.valid.unsqueeze(-1), rows, torch.zeros_like(rows))
    return rows.sum(dim=1).to(out_dtype or y.dtype)
