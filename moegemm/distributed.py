"""Expert parallelism over torch.distributed: tokens go to the ranks that own their experts, and
each rank's partial sums come back.

    sent    = dispatch(x, topk_ids, topk_weights, fmt, num_experts=E, group=group)
    partial = moe.moe_forward_received(sent, w_gate_up, w_down, ...)  the rank's experts  [R, H] fp32
    y       = combine(partial, sent, out_dtype)                                      [T, H]

moegemm.moe_forward(..., ep_group=group) and moegemm.MoE(..., ep_group=group) compose these;
custom layers can call them directly. Placement: rank r of a group of W owns the experts
[r*E/W, (r+1)*E/W) (expert_range), E divisible by W.

Dispatch quantizes every token once into the format's A operand in the plain layout (e4m3 and
scales for fp8_block, mxfp8 and w4a8; e2m1 and scales for mxfp4 and nvfp4; bf16 rows for bf16
and the weight-only formats), the bytes the single-GPU layer would compute for the token, packs
them with the token's k global expert ids and weights into one row of int64 words, and exchanges
the rows with one all_to_all_single. The receiving rank keeps the ids of its own experts (made local) and
marks the others -1, which the layer's routing drops.

Two paths, which every rank of the group must take together:
    "prefill"  a token goes once to each rank that owns at least one of its choices. The counts
               are exchanged first (one all_to_all_single of W small rows) and read on the host
               to size the exchange.
    "decode"   no host read inside a CUDA-graph capture: a fixed number of rows for every pair
               of ranks (every token to every rank; a rank runs nothing for a token none of
               whose choices it owns). With a `capacity` C every rank sends C rows, its T <= C
               tokens and padding that no expert takes, so ranks may hold any count up to C (a
               serving batch of its own a rank); a rank whose T exceeds C still takes its part in
               the exchange (with no tokens, so that the other ranks' tokens are served and no
               rank waits forever) and then raises a ValueError naming the capacity. Without a
               capacity every rank must pass the same number of tokens T, as a CUDA-graph batch
               does.
    "auto"     "decode" while a CUDA graph is being captured, else "prefill".

Misuse raises on every rank instead of crashing or hanging in an exchange of mismatched sizes.
Every dispatch outside a CUDA-graph capture starts with the exchange of W small rows that the
prefill path sizes itself by: besides the counts, each rank sends a header (the path, the
format, the hidden size, k, the expert count, the capacity, whether an nvfp4 global scale is
given: what fixes the exchanges' sizes and a packed row's bytes) and its token count, and reads
every rank's on the host before any token moves. Ranks whose headers differ all raise a
ValueError naming the first field that differs and every rank's value; so do the ranks of a
decode path without a capacity whose token counts differ (the message says to pass a
capacity). A decode path being captured exchanges and checks nothing (a host read cannot be
captured): its shapes were checked at the eager call that precedes a capture, with the same
path, shapes and format. The header exchange also carries nvfp4's token amax, so that the
group's global scale costs no collective of its own.

Combine returns each rank's partial weighted sum of a token's choices once per token, in fp32
(bf16 partials add about 3e-3 relative error against the single-GPU layer, which sums all k
choices in fp32 before its one rounding), along the dispatch's splits reversed, and adds them
at the source in rank order: the result is the same from run to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import routing
from .formats import FORMATS, get_format
from .quantize import absolute_max, nvfp4_global_scale
from .quantized_tensor import QuantizedTensor
from .token_quantizers import gather_quantize

__all__ = ["EP_PATHS", "Dispatched", "check_agreement", "combine", "dispatch", "expert_range", "group_global_scale",
           "rank_and_size"]

EP_PATHS = ("auto", "prefill", "decode")


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
    amax = absolute_max(x).reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return nvfp4_global_scale(amax)  # (the quantizers' rule, on the group's amax)


def _differences(what: str, gathered: list[dict]) -> str | None:
    """The message naming each field on which the ranks' descriptors `gathered` differ (rank
    order), with every rank's value; None where they agree."""
    keys = list(dict.fromkeys([key for other in gathered for key in other]))  # (the descriptors' own order)
    differing = [key for key in keys if any(other.get(key) != gathered[0].get(key) for other in gathered)]
    if not differing:
        return None
    values = "; ".join(f"{key}: " + ", ".join(f"rank {r} {g.get(key)!r}" for r, g in enumerate(gathered))
                       for key in differing)
    return (f"{differing[0]}: expected the same on every rank of the expert-parallel group ({what}), "
            f"got {values.split(': ', 1)[1] if len(differing) == 1 else values}")


def check_agreement(what: str, descriptor: dict, group) -> None:
    """ValueError on every rank unless every rank of `group` passes the same `descriptor` (plain
    values: sizes, format, path, ...): one small collective (all_gather_object), so ranks that
    would disagree later, inside a collective of mismatched sizes, fail here together instead
    of hanging there. The message names `what` and each field that differs, with every rank's
    value. Reads on the host: for load time, not for a forward."""
    _, world = rank_and_size(group)
    gathered = [None] * world
    dist.all_gather_object(gathered, descriptor, group=group)
    message = _differences(what, gathered)
    if message is not None:
        raise ValueError(message)


# What every rank of a dispatch must agree on (module docstring), as int64 words.
_HEADER = ("path", "fmt", "hidden_size", "top_k", "num_experts", "capacity", "global_scale")
_FORMAT_NAMES = tuple(FORMATS)


def _header_words(path: str, fmt: str, hidden: int, top_k: int, num_experts: int, capacity: int | None,
                  global_scale_given: bool) -> list[int]:
    return [EP_PATHS.index(path), _FORMAT_NAMES.index(fmt), hidden, top_k, num_experts,
            -1 if capacity is None else capacity, int(global_scale_given)]


def _header_of(words: list[int]) -> dict:
    path, fmt, hidden, top_k, num_experts, capacity, given = words
    return dict(path=EP_PATHS[path], fmt=_FORMAT_NAMES[fmt], hidden_size=hidden, top_k=top_k,
                num_experts=num_experts, capacity=None if capacity < 0 else capacity,
                global_scale="given" if given else None)


def _check_headers(rows: list[list[int]]):
    """ValueError, the same on every rank, unless the ranks' headers (each rank's row of the
    first exchange: rows for this rank, its T, its header) agree, and, on the decode path
    without a capacity, their token counts too."""
    headers = [_header_of(row[2:2 + len(_HEADER)]) for row in rows]
    message = _differences("distributed.dispatch", headers)
    if message is not None:
        raise ValueError(message)
    tokens = [row[1] for row in rows]
    if headers[0]["path"] == "decode" and headers[0]["capacity"] is None and len(set(tokens)) > 1:
        counts = ", ".join(f"rank {r} {t}" for r, t in enumerate(tokens))
        raise ValueError(f"x: the decode path without a capacity needs the same number of tokens on every rank, "
                         f"got {counts}; pass ep_capacity (dispatch's capacity) of at least {max(tokens)} so that "
                         f"the ranks may hold different counts")


_WORD = 8  # bytes: packed rows are moved as int64 words


@dataclass(frozen=True)
class _RowLayout:
    """Where a token's parts lie in a packed row, (start, end) in bytes: its data first (whole
    words for every format: K is a multiple of 16, and 16 e2m1 values take 8 bytes), then its k
    weights (fp32) and ids (int32), then its scales, the row padded to whole words; every part
    starts aligned to its dtype, so that each is read in place."""

    data: tuple[int, int]
    data_dtype: torch.dtype
    weights: tuple[int, int]
    ids: tuple[int, int]
    scales: tuple[int, int] | None
    scales_dtype: torch.dtype | None
    nbytes: int


def _row_layout(q: QuantizedTensor, top_k: int) -> _RowLayout:
    data = (0, q.data.shape[1] * q.data.element_size())
    weights = (data[1], data[1] + 4 * top_k)
    ids = (weights[1], weights[1] + 4 * top_k)
    end, scales = ids[1], None
    if q.scales is not None:
        scales = (end, end + q.scales.shape[1] * q.scales.element_size())
        end = scales[1]
    return _RowLayout(data, q.data.dtype, weights, ids, scales, None if q.scales is None else q.scales.dtype,
                      -(-end // _WORD) * _WORD)


def _pack(q: QuantizedTensor, layout: _RowLayout, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """[T, row words] int64 in _row_layout's order: the data moved as words, the rest as bytes."""
    rows = q.data.shape[0]
    packed = torch.empty(rows, layout.nbytes // _WORD, dtype=torch.int64, device=q.data.device)
    raw = packed.view(torch.uint8)
    packed[:, :layout.data[1] // _WORD] = q.data.view(torch.uint8).view(torch.int64)
    raw[:, slice(*layout.weights)] = topk_weights.to(torch.float32).view(torch.uint8)
    raw[:, slice(*layout.ids)] = topk_ids.to(torch.int32).view(torch.uint8)
    end = layout.ids[1]
    if layout.scales is not None:
        raw[:, slice(*layout.scales)] = q.scales.view(torch.uint8)
        end = layout.scales[1]
    raw[:, end:] = 0
    return packed


def _section(rows: torch.Tensor, span: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Bytes `span` of packed rows (int64 words) viewed as `dtype`, in place."""
    return rows.view(torch.uint8)[:, span[0]:span[1]].view(dtype)


@dataclass(frozen=True)
class Dispatched:
    """What a rank received, and how its partial sums go back.

    tokens:       the received tokens [R, ...], the format's A operand in the plain layout (the
                  nvfp4 global scale the senders used)
    topk_ids:     int32 [R, k]: this rank's experts as local ids (expert - first), others -1
    topk_weights: fp32 [R, k]
    sent_to:      bool [T, W]: which ranks this rank's tokens went to
    source_rows:  int64 [T, W]: where token t's row for rank r lies in what this rank sent (and
                  where its partial sum from r lies in what comes back): destination-major,
                  token order within a destination
    send_splits, recv_splits: rows sent to and received from each rank
    group_tokens: the tokens of every rank together (the batch a single GPU would run; the
                  decode path with a capacity: W * capacity, the batch it is planned for)
    row_bytes:    bytes of one packed token row
    path:         "prefill" or "decode", the path taken
    overflow:     the decode path's capacity this rank's tokens exceeded (combine raises), or None
    """

    tokens: QuantizedTensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    sent_to: torch.Tensor
    source_rows: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    group_tokens: int
    row_bytes: int
    path: str
    group: object
    overflow: int | None = None

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
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t is not None and getattr(t, "device", x.device) != x.device:
            raise ValueError(f"{name}: expected device {x.device} (x's), got {t.device}")
    if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor)
                                     or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}, got "
                         f"{getattr(topk_weights, 'shape', None)}")
    if path not in EP_PATHS:
        raise ValueError(f"path: expected one of {list(EP_PATHS)}, got {path!r}")


def _chosen_path(path: str, capturing: bool) -> str:
    if path != "auto":
        return path
    return "decode" if capturing else "prefill"


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, fmt: str, *,
             num_experts: int, group, path: str = "auto", global_scale: torch.Tensor | None = None,
             capacity: int | None = None) -> Dispatched:
    """Send this rank's tokens x [T, H] with their router choices (global expert ids [T, k], ids
    outside [0, E) dropped; weights [T, k], ones when None) to the ranks that own the experts,
    quantized into `fmt`'s A operand. nvfp4: global_scale of the tokens, group_global_scale(x)
    when None (the same on every rank, so that the received tokens share one). capacity: the
    decode path's rows a rank (module docstring), the same on every rank; None: T, the same T on
    every rank. Outside a CUDA-graph capture the ranks' calls are compared first (module
    docstring): where they disagree, every rank raises a ValueError before any token moves."""
    _check_dispatch_args(x, topk_ids, topk_weights, path)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity: expected an int >= 0 (tokens a rank on the decode path) or None, got "
                         f"{capacity!r}")
    f = get_format(fmt)
    _, world = rank_and_size(group)
    first, last = expert_range(num_experts, group)
    per_rank = last - first
    num_tokens, top_k = topk_ids.shape
    device = x.device
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    path = _chosen_path(path, capturing)
    overflow = capacity if path == "decode" and capacity is not None and num_tokens > capacity else None
    if path == "decode":
        # (a rank over its capacity sends padding alone: none of its tokens is served)
        sent_to = torch.full((num_tokens, world), overflow is None, dtype=torch.bool, device=device)
    else:
        ids = topk_ids.long()
        dest = torch.where((ids >= 0) & (ids < num_experts), ids.div(per_rank, rounding_mode="floor"), world)
        sent_to = torch.zeros(num_tokens, world + 1, dtype=torch.bool, device=device).scatter_(1, dest, True)
        sent_to = sent_to[:, :world]
    counts = sent_to.sum(dim=0)
    group_amax = f.a.global_scale and global_scale is None
    checked = not (path == "decode" and capturing)  # (module docstring: a capture reads nothing on the host)
    if checked:  # to rank r: the rows it gets from this rank, this rank's T, its header, nvfp4's amax
        header = _header_words(path, f.name, x.shape[1], top_k, num_experts, capacity,
                               f.a.global_scale and global_scale is not None)
        amax = absolute_max(x).reshape(1).double() if group_amax else torch.zeros(1, dtype=torch.float64, device=device)
        exchanged = torch.cat((counts.unsqueeze(1), torch.full_like(counts, num_tokens).unsqueeze(1),
                               torch.tensor(header, dtype=torch.int64, device=device).expand(world, -1),
                               amax.view(torch.int64).reshape(1, 1).expand(world, 1)), dim=1)
        received = torch.empty_like(exchanged)
        dist.all_to_all_single(received, exchanged, group=group)
    # Row of token t's copy for rank r among the rows sent, destination-major. (The scan runs along
    # the tokens as the last dimension: along the first, torch scans [T, W] with W threads.)
    rows_each = num_tokens if capacity is None else capacity  # the decode path's rows for each rank
    if path == "decode":
        source_rows = (torch.arange(num_tokens, device=device).unsqueeze(1)
                       + rows_each * torch.arange(world, device=device)).clamp(max=max(rows_each * world - 1, 0))
    else:
        before = sent_to.t().long().cumsum(dim=1) - 1
        source_rows = (before + (counts.cumsum(dim=0) - counts).unsqueeze(1)).t()
    if group_amax:  # (the rule of group_global_scale, on the amaxes already exchanged)
        global_scale = (nvfp4_global_scale(received[:, -1].contiguous().view(torch.float64).amax().float())
                        if checked else group_global_scale(x, group))
    tokens = gather_quantize(x, f.name, global_scale=global_scale)  # plain layout, one pass over x
    weights = topk_weights if topk_weights is not None else torch.ones(topk_ids.shape, device=device)
    layout = _row_layout(tokens, top_k)
    packed = _pack(tokens, layout, topk_ids, weights)
    if checked:  # the host read (after the work above is queued), before any token moves
        first_rows = received.tolist()
        _check_headers(first_rows)
    if path == "decode":
        send_splits = recv_splits = [rows_each] * world
        group_tokens = world * rows_each
        send = _padded(packed, layout, rows_each, overflow is not None).repeat(world, 1)
    else:
        send_splits = counts.tolist()
        recv_splits = [row[0] for row in first_rows]
        group_tokens = sum(row[1] for row in first_rows)
        total = sum(send_splits)
        spare = torch.where(sent_to, source_rows, total).reshape(-1)  # rows not sent go to a spare slot
        send_token = torch.empty(total + 1, dtype=torch.long, device=device)
        send_token.scatter_(0, spare, torch.arange(num_tokens, device=device).repeat_interleave(world))
        send = packed.index_select(0, send_token[:total])
    recv = packed.new_empty(sum(recv_splits), packed.shape[1])
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    data = _section(recv, layout.data, layout.data_dtype)
    scales = None if layout.scales is None else _section(recv, layout.scales, layout.scales_dtype)
    tokens_in = QuantizedTensor(data, scales, f.name, "a", "plain", tokens.global_scale)
    local = _section(recv, layout.ids, torch.int32).long() - first
    local_ids = torch.where((local >= 0) & (local < per_rank), local, -1).to(torch.int32)
    return Dispatched(tokens_in, local_ids, _section(recv, layout.weights, torch.float32).contiguous(), sent_to,
                      source_rows, send_splits, recv_splits, group_tokens, layout.nbytes, path, group, overflow)


def _padded(packed: torch.Tensor, layout: _RowLayout, rows: int, empty: bool) -> torch.Tensor:
    """The decode path's rows for one rank: the packed tokens (none where `empty`), then rows of
    padding up to `rows`, whose choices no rank takes (ids -1, weights 0, data and scales 0)."""
    kept = packed[:0] if empty else packed
    if kept.shape[0] == rows:
        return kept
    padding = packed.new_zeros(rows - kept.shape[0], packed.shape[1])
    _section(padding, layout.ids, torch.int32).fill_(-1)
    return torch.cat((kept, padding))


def combine(partial: torch.Tensor, sent: Dispatched, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The partial sums [R, H] of the received tokens back to their ranks, added at the source in
    rank order with fp32 accumulation: [T, H] in out_dtype."""
    rows = sum(sent.recv_splits)
    if not isinstance(partial, torch.Tensor) or partial.dim() != 2 or partial.shape[0] != rows:
        raise ValueError(f"partial: expected [{rows}, H] (the received tokens), got {getattr(partial, 'shape', None)}")
    partial = partial.to(torch.float32).contiguous()
    back = partial.new_empty(sum(sent.send_splits), partial.shape[1])
    dist.all_to_all_single(back, partial, sent.send_splits, sent.recv_splits, group=sent.group)
    if sent.overflow is not None:  # (after this rank's part of the exchange: no other rank waits for it)
        raise ValueError(f"x: {sent.sent_to.shape[0]} tokens on this rank, above the decode path's capacity "
                         f"{sent.overflow} (ep_capacity); none of them was run")
    return routing.sum_rows(back, sent.source_rows, sent.sent_to, out_dtype)
