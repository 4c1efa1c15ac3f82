"""Expert parallelism over torch.distributed: tokens go to the ranks that own their experts, and
each rank's partial sums come back.

    sent    = dispatch(x, topk_ids, topk_weights, fmt, num_experts=E, group=group)
    partial = the rank's experts on (sent.tokens, sent.topk_ids, sent.topk_weights)   [R, H] fp32
    y       = combine(partial, sent)                                                 [T, H] fp32

moegemm.moe_forward(..., ep_group=group) and moegemm.MoE(..., ep_group=group) compose these;
custom layers can call them directly. Placement: rank r of a group of W owns the experts
[r*E/W, (r+1)*E/W) (expert_range), E divisible by W.

Dispatch quantizes every token once into the format's A operand in the plain layout (e4m3 and
scales for fp8_block, mxfp8 and w4a8; e2m1 and scales for mxfp4 and nvfp4; bf16 rows for bf16
and the weight-only formats), the bytes the single-GPU layer would compute for the token, packs
them with the token's k global expert ids and weights into one byte row, and exchanges the rows
with one all_to_all_single. The receiving rank keeps the ids of its own experts (made local) and
marks the others -1, which the layer's routing drops.

Two paths, which every rank of the group must take together:
    "prefill"  a token goes once to each rank that owns at least one of its choices. The counts
               are exchanged first (one all_to_all_single of W integers) and read on the host
               to size the exchange.
    "decode"   no host read, so it captures in a CUDA graph: fixed capacity, T rows for every
               pair of ranks (every token to every rank; a rank runs nothing for a token none
               of whose choices it owns). Every rank must pass the same number of tokens T,
               as a CUDA-graph batch does (checked with MOEGEMM_DEBUG=1, which synchronizes).
    "auto"     "decode" while a CUDA graph is being captured, else "prefill".

Combine returns each rank's partial weighted sum of a token's choices once per token, in fp32
(bf16 partials add about 3e-3 relative error against the single-GPU layer, which sums all k
choices in fp32 before its one rounding), along the dispatch's splits reversed, and adds them
at the source in rank order: the result is the same from run to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import activation as act
from .formats import get_format
from .quantize import QuantizedTensor
from .validation import debug_mode

__all__ = ["EP_PATHS", "Dispatched", "combine", "dispatch", "expert_range", "group_global_scale", "rank_and_size"]

EP_PATHS = ("auto", "prefill", "decode")
_ALIGN = 4  # bytes: every section of a packed row starts 4-byte aligned (its ids and weights are 32-bit)


def rank_and_size(group) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); TypeError unless a process group."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"ep_group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    return dist.get_rank(group), dist.get_world_size(group)


def expert_range(num_experts: int, group) -> tuple[int, int]:
    """[first, last) of the experts this rank owns: rank r of W owns [r*E/W, (r+1)*E/W)."""
    rank, world = rank_and_size(group)
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world:
        raise ValueError(f"num_experts: expected a positive multiple of the group's size {world}, got {num_experts!r}")
    per_rank = num_experts // world
    return rank * per_rank, (rank + 1) * per_rank


def group_global_scale(x: torch.Tensor, group) -> torch.Tensor:
    """nvfp4's token global scale over every rank's tokens, amax / (448 * 6) (1 where all are zero):
    the scale a single GPU running the whole batch takes. One all_reduce, no host read."""
    amax = x.float().abs().amax() if x.numel() else x.new_zeros((), dtype=torch.float32)
    amax = amax.reshape(1).clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return torch.where(amax > 0, amax / (448.0 * 6.0), torch.ones_like(amax)).reshape(())


@dataclass(frozen=True)
class _RowLayout:
    """Where a token's parts lie in a packed byte row: (start, end) in bytes, and their dtypes."""

    data: tuple[int, int]
    data_dtype: torch.dtype
    scales: tuple[int, int] | None
    scales_dtype: torch.dtype | None
    ids: tuple[int, int]
    weights: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.weights[1]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _row_layout(q: QuantizedTensor, top_k: int) -> _RowLayout:
    data_bytes = q.data.shape[1] * q.data.element_size()
    end = _aligned(data_bytes)
    scales = None
    if q.scales is not None:
        scale_bytes = q.scales.shape[1] * q.scales.element_size()
        scales = (end, end + scale_bytes)
        end = _aligned(end + scale_bytes)
    ids = (end, end + 4 * top_k)
    return _RowLayout((0, data_bytes), q.data.dtype, scales, None if q.scales is None else q.scales.dtype,
                      ids, (ids[1], ids[1] + 4 * top_k))


def _pack(q: QuantizedTensor, layout: _RowLayout, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """[T, layout.nbytes] uint8: each token's data, scales (q's plain [T, ...] tensors), ids
    (int32) and weights (fp32)."""
    rows = q.data.shape[0]
    packed = torch.zeros(rows, layout.nbytes, dtype=torch.uint8, device=q.data.device)
    packed[:, slice(*layout.data)] = q.data.view(torch.uint8)
    if layout.scales is not None:
        packed[:, slice(*layout.scales)] = q.scales.view(torch.uint8)
    packed[:, slice(*layout.ids)] = topk_ids.to(torch.int32).view(torch.uint8)
    packed[:, slice(*layout.weights)] = topk_weights.to(torch.float32).view(torch.uint8)
    return packed


def _section(rows: torch.Tensor, span: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Columns `span` of packed rows viewed as `dtype` (rows keep the packed stride; no copy)."""
    return rows[:, span[0]:span[1]].view(dtype)


@dataclass(frozen=True)
class Dispatched:
    """What a rank received, and how to send the partial sums back.

    tokens:       the received tokens [R, ...], the format's A operand in the plain layout (the
                  nvfp4 global scale the sender used)
    topk_ids:     int32 [R, k]: this rank's experts as local ids (expert - first), others -1
    topk_weights: fp32 [R, k]
    send_token:   int64 [S]: the source token of each row this rank sent, grouped by destination
    send_splits, recv_splits: rows sent to and received from each rank
    num_tokens:   T, this rank's tokens
    row_bytes:    bytes of one packed token row
    path:         "prefill" or "decode", the path taken
    """

    tokens: QuantizedTensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    send_token: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    row_bytes: int
    path: str
    group: object

    def bytes_to_others(self) -> tuple[int, int]:
        """(dispatch bytes, combine bytes per hidden column) this rank sends to other ranks."""
        rank, _ = rank_and_size(self.group)
        dispatched = sum(n for r, n in enumerate(self.send_splits) if r != rank) * self.row_bytes
        combined = sum(n for r, n in enumerate(self.recv_splits) if r != rank) * 4
        return dispatched, combined


def _check_dispatch_args(x, topk_ids, topk_weights, path):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point [T, H] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids: expected [{x.shape[0]}, k], got {getattr(topk_ids, 'shape', None)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor)
                                     or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}, got "
                         f"{getattr(topk_weights, 'shape', None)}")
    if path not in EP_PATHS:
        raise ValueError(f"path: expected one of {list(EP_PATHS)}, got {path!r}")


def _chosen_path(path: str, device: torch.device) -> str:
    if path != "auto":
        return path
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return "decode" if capturing else "prefill"


def _check_same_tokens(num_tokens: int, group, device):
    """The decode path's premise, read on the host (MOEGEMM_DEBUG=1 only: it synchronizes)."""
    _, world = rank_and_size(group)
    mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(every, mine.repeat(world), group=group)
    if len(set(every.tolist())) > 1:
        raise ValueError(f"x: the decode path needs the same number of tokens on every rank, got {every.tolist()}")


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, fmt: str, *,
             num_experts: int, group, path: str = "auto", global_scale: torch.Tensor | None = None) -> Dispatched:
    """Send this rank's tokens x [T, H] with their router choices (global expert ids [T, k], ids
    outside [0, E) dropped; weights [T, k], ones when None) to the ranks that own the experts,
    quantized into `fmt`'s A operand. nvfp4: global_scale of the tokens, group_global_scale(x)
    when None (the same on every rank, so that the received tokens share one)."""
    _check_dispatch_args(x, topk_ids, topk_weights, path)
    f = get_format(fmt)
    rank, world = rank_and_size(group)
    first, last = expert_range(num_experts, group)
    per_rank = last - first
    num_tokens, top_k = topk_ids.shape
    device = x.device
    path = _chosen_path(path, device)
    if f.a.global_scale and global_scale is None:
        global_scale = group_global_scale(x, group)
    tokens = act.gather_quantize(x, f.name, global_scale=global_scale)  # plain layout, one pass over x
    weights = topk_weights if topk_weights is not None else torch.ones(topk_ids.shape, device=device)
    layout = _row_layout(tokens, top_k)
    packed = _pack(tokens, layout, topk_ids, weights)
    if path == "decode":
        if debug_mode():
            _check_same_tokens(num_tokens, group, device)
        send_token = torch.arange(num_tokens, device=device).repeat(world)
        send_splits = recv_splits = [num_tokens] * world
    else:
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        dest = torch.where(valid, ids.div(max(per_rank, 1), rounding_mode="floor"), world)
        needs = torch.zeros(num_tokens, world + 1, dtype=torch.bool, device=device)
        needs.scatter_(1, dest, True)
        needs = needs[:, :world]
        counts = needs.sum(dim=0)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()
        send_token = needs.t().nonzero()[:, 1]  # destination-major, token order within a destination
    send = packed.index_select(0, send_token)
    recv = packed.new_empty(sum(recv_splits), layout.nbytes)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    data = _section(recv, layout.data, layout.data_dtype)
    scales = None if layout.scales is None else _section(recv, layout.scales, layout.scales_dtype)
    received = QuantizedTensor(data, scales, f.name, "a", "plain", tokens.global_scale)
    local = _section(recv, layout.ids, torch.int32).long() - first
    local_ids = torch.where((local >= 0) & (local < per_rank), local, -1).to(torch.int32)
    local_weights = _section(recv, layout.weights, torch.float32).contiguous()
    return Dispatched(received, local_ids, local_weights, send_token, send_splits, recv_splits, num_tokens,
                      layout.nbytes, path, group)


def combine(partial: torch.Tensor, sent: Dispatched) -> torch.Tensor:
    """The partial sums [R, H] of the received tokens back to their ranks, added at the source in
    rank order: [T, H] fp32."""
    rows = sum(sent.recv_splits)
    if not isinstance(partial, torch.Tensor) or partial.dim() != 2 or partial.shape[0] != rows:
        raise ValueError(f"partial: expected [{rows}, H] (the received tokens), got {getattr(partial, 'shape', None)}")
    partial = partial.to(torch.float32).contiguous()
    back = partial.new_empty(sent.send_token.numel(), partial.shape[1])
    dist.all_to_all_single(back, partial, sent.send_splits, sent.recv_splits, group=sent.group)
    out = torch.zeros(sent.num_tokens, partial.shape[1], dtype=torch.float32, device=partial.device)
    start = 0
    for count in sent.send_splits:  # within one rank's rows every token appears at most once
        out.index_add_(0, sent.send_token[start:start + count], back[start:start + count])
        start += count
    return out
