"""The layer's expert parallelism: what moegemm.MoE and moe_forward add around distributed.py's
exchange. Rank r of W keeps experts [r*E/W, (r+1)*E/W) (distributed.expert_range); its loaders
take the full checkpoint tensors or its slice; its tokens are dispatched to the ranks that own
their choices, each runs its experts as one GPU would run the group's batch, and the partial sums
come back (forward.py composes dispatch, the received path and distributed.combine).
"""

from __future__ import annotations

import torch

from .. import distributed
from ..quantized_tensor import QuantizedTensor

__all__ = ["dispatch", "group_tokens_per_expert", "own_experts", "shape_hint"]


def own_experts(tensors, expert_range: tuple[int, int], num_experts: int) -> list:
    """Per-expert checkpoint tensors as a rank keeps them: the full [E, ...] cut to its experts
    [first, last), anything else as given (the loaders check its shape next)."""
    first, last = expert_range
    return [w[first:last] if isinstance(w, torch.Tensor) and w.dim() and w.shape[0] == num_experts
            and last - first != num_experts else w for w in tensors]


def shape_hint(group, num_experts: int) -> str:
    """What a loader's shape error adds with expert parallelism: the rank's experts or all of them."""
    return "" if group is None else f" (this rank's experts; or all {num_experts})"


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, w_gate_up: QuantizedTensor,
             *, group, path: str, capacity: int | None, global_scale: torch.Tensor | None) -> distributed.Dispatched:
    """This rank's tokens sent, quantized once into the weights' format, to the ranks that own their
    choices among the group's experts (W times the rank's w_gate_up's)."""
    _, world = distributed.rank_and_size(group)
    return distributed.dispatch(x, topk_ids, topk_weights, w_gate_up.fmt, num_experts=w_gate_up.data.shape[0] * world,
                                group=group, path=path, global_scale=global_scale, capacity=capacity)


def group_tokens_per_expert(sent: distributed.Dispatched, num_local_experts: int) -> float:
    """The group's average choices an expert, which decides the layer's kernels on every rank as
    it would on one GPU running the group's whole batch (W ranks: sent.send_splits has one entry
    a rank)."""
    return sent.group_tokens * sent.topk_ids.shape[1] / (num_local_experts * len(sent.send_splits))
