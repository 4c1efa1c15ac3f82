"""Routing helpers: router logits -> top-k choices -> grouped ("1D") token layout, and back.

    ids, w = select_experts(logits, top_k, router)          # [T, E] logits -> [T, k] ids and weights
    plan = route(topk_ids, num_experts, topk_weights)        # [T, k] expert ids (and weights)
    a    = permute_tokens(x, plan)                          # [T*k, K]: rows grouped by expert
    c    = grouped_matmul(a, w, ..., plan.a_offsets, plan.expert_ids, ...)
    y    = unpermute_tokens(c, plan)                        # [T, N]: sum_j w[t, j] * c[row of (t, j)]
    a    = scatter_tokens(x, plan)                          # permute_tokens' valid rows only, each token read once
    y    = sum_rows(c, rows, valid)                         # [T, N]: sum_j c[rows[t, j]] over valid j

One slot per expert (slot e holds expert e; empty experts are empty groups). A choice whose
id lies outside [0, num_experts) is dropped: it gets no group row and adds nothing to the
combine (expert parallelism marks experts owned by other ranks this way). No Python loop
over tokens, no host synchronization: every size is T*k or E.

Backends (keyword `backend` of route and unpermute_tokens):
    "auto"    the Triton kernels for CUDA tensors, PyTorch for CPU tensors
    "triton"  the Triton kernels (kernels/_routing_tl.py; Triton's interpreter on the CPU)
    "torch"   the pure-PyTorch reference (route_reference, unpermute_tokens_reference)
Both give the same plan bit for bit (a stable sort by expert id); the combine accumulates in
fp32 in choice order on both.

Routers (select_experts, plain torch), the three the supported checkpoints use:
    softmax_topk     Qwen3-MoE: softmax over all experts in fp32, top-k, optional renormalize
    topk_softmax     gpt-oss: top-k of the logits (router bias included), softmax over the k
    sigmoid_grouped  DeepSeek-V3: sigmoid scores, top-k by score + correction bias within the
                     best topk_group of n_group groups, weights renormalized and scaled
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import layouts
from .compile_boundary import traced_as
from .kernels import routing_kernels as kernels
from .kernels import tl_source

__all__ = [
    "ROUTERS",
    "ROUTING_BACKENDS",
    "RoutingPlan",
    "permute_tokens",
    "route",
    "route_reference",
    "scatter_tokens",
    "select_experts",
    "sum_rows",
    "unpermute_tokens",
    "unpermute_tokens_reference",
]

ROUTING_BACKENDS = ("auto", "triton", "torch")


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
    expert_of_row:     int32 [T*k] or None; the expert of grouped row p (E for dropped rows);
                       route fills it, unpermute_tokens derives it from a_offsets when None
    """

    token_index: torch.Tensor
    grouped_row: torch.Tensor
    valid: torch.Tensor
    a_offsets: torch.Tensor
    expert_ids: torch.Tensor
    a_scale_offsets: torch.Tensor
    topk_weights: torch.Tensor | None
    expert_of_row: torch.Tensor | None = None

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


def _check_route_args(topk_ids, num_experts, topk_weights) -> None:
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


def _use_triton(backend: str, device: torch.device) -> bool:
    """Whether a call with this backend runs the Triton kernels for tensors on `device`."""
    if not isinstance(backend, str) or backend not in ROUTING_BACKENDS:
        raise ValueError(f"backend: expected one of {list(ROUTING_BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda"
    if device.type == "cuda" or (device.type == "cpu" and tl_source.interpreter_usable()):
        return True
    raise ValueError(f"backend: 'triton' cannot run tensors on {device}"
                     + tl_source.interpreter_note(device))


@traced_as("route")
def route(
    topk_ids: torch.Tensor,
    num_experts: int,
    topk_weights: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> RoutingPlan:
    """Sort the T*k router choices by expert (stable: token order within an expert)."""
    _check_route_args(topk_ids, num_experts, topk_weights)
    if _use_triton(backend, topk_ids.device):
        return RoutingPlan(topk_weights=topk_weights, **kernels.route(topk_ids, num_experts))
    return _route_torch(topk_ids, num_experts, topk_weights)


def route_reference(topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None) -> RoutingPlan:
    """route in pure PyTorch (a stable torch.sort of the expert keys)."""
    _check_route_args(topk_ids, num_experts, topk_weights)
    return _route_torch(topk_ids, num_experts, topk_weights)


def _route_torch(topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None) -> RoutingPlan:
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
        expert_of_row=key[order].to(torch.int32),
    )


def permute_tokens(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """[T, K] tokens -> [T*k, K] rows grouped by expert (a copy per choice)."""
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"x: expected {plan.num_tokens} rows (the routed tokens), got shape {tuple(x.shape)}")
    return x.index_select(0, plan.token_index)


def scatter_tokens(x: torch.Tensor, plan: RoutingPlan, *, backend: str = "auto") -> torch.Tensor:
    """[T, C] token rows of any dtype (unit column stride) -> [T*k, C]: each token's row stored to
    the grouped rows of its valid choices, read once. Unlike permute_tokens, the rows of dropped
    choices (past a_offsets[E]) are left unwritten."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise ValueError(f"x: expected [{plan.num_tokens}, C] (the routed tokens), got {getattr(x, 'shape', None)}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"x: expected unit stride along columns, got strides {x.stride()}")
    if not _use_triton(backend, x.device):
        src = x.view(torch.uint8)  # (byte moves: index_put has no float8 kernels)
        out = src.new_empty(plan.num_grouped_rows, src.shape[1])
        tokens = torch.arange(plan.num_tokens, device=x.device).unsqueeze(1).expand(plan.grouped_row.shape)
        out[plan.grouped_row[plan.valid]] = src[tokens[plan.valid]]
        return out.view(x.dtype)
    rows = x.view(torch.uint8)
    for wide in (torch.int64, torch.int32, torch.int16):  # the widest word the rows allow: fewer, wider moves
        size = wide.itemsize
        if rows.shape[1] % size == 0 and rows.stride(0) % size == 0 and rows.data_ptr() % size == 0:
            rows = rows.view(wide)
            break
    out = kernels.scatter_rows(rows, plan.grouped_row, plan.valid, plan.num_grouped_rows)
    return out.view(torch.uint8).view(x.dtype)


def sum_rows(y: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, out_dtype: torch.dtype | None = None, *,
             backend: str = "auto") -> torch.Tensor:
    """[T, N]: out[t] = sum_j y[rows[t, j]] over the j with valid[t, j], accumulated in fp32 in j
    order (unpermute_tokens without weights, on any table of rows; rows of invalid j are never
    read)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape != getattr(valid, "shape", None):
        raise ValueError(f"rows, valid: expected two [T, J] tensors, got {getattr(rows, 'shape', None)} and "
                         f"{getattr(valid, 'shape', None)}")
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"y: expected [M, N], got {getattr(y, 'shape', None)}")
    out_dtype = out_dtype or y.dtype
    if not _use_triton(backend, y.device):
        picked = y.index_select(0, torch.where(valid, rows, 0).reshape(-1)).float().reshape(*rows.shape, y.shape[1])
        return torch.where(valid.unsqueeze(-1), picked, 0.0).sum(dim=1).to(out_dtype)
    return kernels.unpermute(y, rows.long(), valid, None, None, None, out_dtype)


def _choice_experts(plan: RoutingPlan) -> torch.Tensor:
    """int64 [T, k]: the expert of each choice (E for dropped ones)."""
    rows = plan.grouped_row.reshape(-1)
    if plan.expert_of_row is not None:
        experts = plan.expert_of_row.index_select(0, rows)
    else:  # rows in [a_offsets[e], a_offsets[e+1]) belong to e; rows past a_offsets[E] to E
        experts = torch.searchsorted(plan.a_offsets[1:].long(), rows.long(), right=True)
    return experts.long().reshape(plan.grouped_row.shape)


def row_experts(plan: RoutingPlan) -> torch.Tensor:
    """int32 [T*k]: the expert of each grouped row (E for dropped rows)."""
    if plan.expert_of_row is not None:
        return plan.expert_of_row
    rows = torch.arange(plan.num_grouped_rows, device=plan.a_offsets.device, dtype=plan.a_offsets.dtype)
    return torch.searchsorted(plan.a_offsets[1:].contiguous(), rows, right=True).to(torch.int32)


def _check_unpermute_args(y, plan, topk_weights, out_dtype, expert_bias):
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
    if y.dim() != 2 or y.shape[0] != plan.num_grouped_rows:
        raise ValueError(f"y: expected shape [{plan.num_grouped_rows}, N], got {tuple(y.shape)}")
    if y.device != plan.grouped_row.device:
        raise ValueError(f"y: expected device {plan.grouped_row.device} (the plan's), got {y.device}")
    weights = topk_weights if topk_weights is not None else plan.topk_weights
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"topk_weights: expected a torch.Tensor, got {type(weights).__name__}")
        if weights.shape != plan.grouped_row.shape:
            raise ValueError(f"topk_weights: expected shape {tuple(plan.grouped_row.shape)}, got {tuple(weights.shape)}")
        if weights.device != y.device:
            raise ValueError(f"topk_weights: expected device {y.device}, got {weights.device}")
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
        raise TypeError(f"out_dtype: expected a floating torch.dtype, got {out_dtype!r}")
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor):
            raise TypeError(f"expert_bias: expected a torch.Tensor, got {type(expert_bias).__name__}")
        want = (plan.expert_ids.numel(), y.shape[1])
        if tuple(expert_bias.shape) != want:
            raise ValueError(f"expert_bias: expected shape [E, N] = {list(want)}, got {tuple(expert_bias.shape)}")
        if not expert_bias.dtype.is_floating_point:
            raise TypeError(f"expert_bias: expected a floating dtype, got {expert_bias.dtype}")
        if expert_bias.device != y.device:
            raise ValueError(f"expert_bias: expected device {y.device}, got {expert_bias.device}")
    return weights


@traced_as("unpermute_tokens")
def unpermute_tokens(
    y: torch.Tensor,
    plan: RoutingPlan,
    topk_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    expert_bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """[T*k, N] grouped rows -> [T, N]: out[t] = sum_j w[t, j] * (y[grouped_row[t, j]] + bias[e_tj]), in fp32.

    Weights default to the plan's (all ones when it has none). expert_bias [E, N] (optional,
    e.g. gpt-oss's down_proj bias) is added to each choice's row before its weight. Dropped
    choices add nothing, even when their rows of y hold garbage.
    """
    weights = _check_unpermute_args(y, plan, topk_weights, out_dtype, expert_bias)
    if not _use_triton(backend, y.device):
        return _unpermute_torch(y, plan, weights, out_dtype, expert_bias)
    experts = row_experts(plan) if expert_bias is not None else None
    return kernels.unpermute(y, plan.grouped_row, plan.valid, weights, experts, expert_bias, out_dtype or y.dtype)


def unpermute_tokens_reference(
    y: torch.Tensor,
    plan: RoutingPlan,
    topk_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    expert_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """unpermute_tokens in pure PyTorch."""
    weights = _check_unpermute_args(y, plan, topk_weights, out_dtype, expert_bias)
    return _unpermute_torch(y, plan, weights, out_dtype, expert_bias)


def _unpermute_torch(y, plan, weights, out_dtype, expert_bias):
    rows = y.index_select(0, plan.grouped_row.reshape(-1)).float().reshape(*plan.grouped_row.shape, y.shape[1])
    if expert_bias is not None and expert_bias.shape[0] > 0:
        experts = torch.where(plan.valid, _choice_experts(plan), 0).reshape(-1)
        rows = rows + expert_bias.float().index_select(0, experts).reshape(rows.shape)
    if weights is not None:
        rows = rows * weights.float().unsqueeze(-1)
    rows = torch.where(plan.valid.unsqueeze(-1), rows, torch.zeros_like(rows))
    return rows.sum(dim=1).to(out_dtype or y.dtype)


ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")


def select_experts(logits: torch.Tensor, top_k: int, router: str, *, norm_topk_prob: bool = True,
                   correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_ids int32 [T, k], topk_weights fp32 [T, k]) by `router`."""
    if router not in ROUTERS:
        raise ValueError(f"router: expected one of {list(ROUTERS)}, got {router!r}")
    if router == "softmax_topk":
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif router == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        weights = F.softmax(values, dim=-1, dtype=values.dtype).float()
    else:
        scores = logits.float().sigmoid()
        choice = scores + correction_bias.float() if correction_bias is not None else scores
        t, e = choice.shape
        if n_group > 1:
            grouped = choice.view(t, n_group, e // n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = group_scores.topk(topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0)
            keep = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
            choice = choice.masked_fill(keep == 0, 0.0)
        ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * routed_scaling_factor
    return ids.to(torch.int32), weights.float()
