"""Hopper (sm_90) grouped matmul for `fp8_block` and `bf16`: a persistent, warp-specialized
Gluon kernel fed by TMA.

Warp roles (one CTA per SM, persistent over the tiles of all valid groups):
    producer  (worker, 1 warp)    TMA loads of the token tile [TOK_TILE, BLOCK_K] of A and the
                                  weight tile [W_TILE, BLOCK_K] of B for every K step into a
                                  STAGES-deep ring
    consumer0 (default, 4 warps)  wgmma on its part of the tile, promotion, epilogue
    consumer1 (worker, 4 warps)   the same on the other part
The two consumers are separate partitions, so one warpgroup's promotion (fp32 FMAs) overlaps
the other's wgmma. How the tile is shared (config.Sm90Config):
    normal   128 tokens x W_TILE weights: warpgroup w takes tokens [64w, 64w+64)
    split-n   64 tokens x W_TILE weights: warpgroup w takes weight rows [w, w+1) * W_TILE/2
             (small groups: a 64-row token tile wastes less on a group's ragged end)
    swapped  TOK_TILE tokens x 128 weights: weights are the wgmma M side, warpgroup w takes
             weight rows [64w, 64w+64), tokens the narrow N side (decode)
fp8_block promotes per 128x128 block, so a normal tile 256 weights wide runs as two 128-wide
halves, each with its own accumulator.

Barriers (STAGES each):
    ready[s]  count 1   producer: expect(A + B bytes), TMA completes it; consumers wait
    empty[s]  count 2   each consumer arrives once its wgmma reading stage s has retired;
                        the producer waits before reusing stage s
Phases: k-step `it` uses stage it % STAGES with phase (it // STAGES) & 1; the producer waits
`empty` with the inverted phase, so its first lap passes.

Steady state of one consumer, fp8_block (PROMOTE):
    load sa (1x128 scales of its tokens) and sb (128x128 block scales) of step k+1
    wait ready[s]; part = wgmma(A[s], B[s]^T) (fresh, 4 x k32); wait; arrive empty[s]
    acc += part * (sa * sb)[k]       # fp32 promotion per 128-wide K block, SPEC section 1
bf16: acc = wgmma(A[s], B[s]^T, acc) chained, one wgmma in flight, stage released one step late.

Schedule: every partition walks the group slots in order (scalar loads of a_offsets and
expert_ids; no host read, no pre-pass) and counts the tiles of earlier slots. Tile t goes to
program t % nprog, round-robin, except the last claim_rounds * nprog tiles of the call (DYNAMIC,
with the launcher's zeroed int32 tile counter): the producer, having counted the call's tiles
(_total_tiles), claims each of those with an atomic add once it has issued its current tile's
loads, and hands every next tile to the consumers through shared memory (_publish_tile,
_receive_tile). Tile indices rise either way, so the slot walk only goes forward.
Why both: round-robin keeps the programs that share an operand in step (neighbouring tiles are
an expert's weight tiles, which read its token tile, or a weight tile's token tiles), so one
HBM read serves them through L2; tiles claimed from the start lost that (DeepSeek-V3 mxfp8 gate/up
product 1.08x slower, H100). But a program's round-robin share of slow tiles (tails) decides
when the call ends, 2-3% after the average program; claimed at the end, the tiles even out.
Within a slot, tiles go in bands of GROUP_M token blocks, token blocks fastest, so a wave of CTAs
shares few A and B tiles in L2. Offsets are clamped to [0, M]; a slot whose expert id is outside
[0, E) has no tiles.

Epilogue: C = acc * expert_scales[e] * row_scales[m] in fp32, rounded to the output dtype.
A warpgroup's 64 token rows that lie inside the group go out by TMA store (clipped at M and
N); rows that cross the group's end, and every swapped tile, are stored with masks, so no row
outside [s, t) is written.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..config import sm90_config
from ..validation import GroupedProblem
from .sm90_epilogue import epilogue_args, fused_epilogue

WG_ROWS = gl.constexpr(64)  # rows of one consumer warpgroup's wgmma


@gluon.jit
def _slot(a_offsets_ptr, expert_ids_ptr, g, M, E, TOK_TILE: gl.constexpr, TAIL: gl.constexpr = 0):
    """Rows [s, t), expert e and token-tile count of slot g (0 when e is outside [0, E)).
    TAIL > 0: the slot's last tile also takes up to TAIL more tokens (_tail_of)."""
    return _slot_tiles(gl.load(a_offsets_ptr + g), gl.load(a_offsets_ptr + g + 1), gl.load(expert_ids_ptr + g), M, E,
                       TOK_TILE, TAIL)


@gluon.jit
def _slot_tiles(s, t, e, M, E, TOK_TILE: gl.constexpr, TAIL: gl.constexpr):
    """_slot from the slot's loaded offsets and expert id (scalars, or vectors of slots)."""
    s = gl.minimum(gl.maximum(s, 0), M)
    t = gl.minimum(gl.maximum(t, s), M)
    if TAIL > 0:
        tiles = gl.where(t > s, gl.maximum((t - s - TAIL + TOK_TILE - 1) // TOK_TILE, 1), 0)
    else:
        tiles = (t - s + TOK_TILE - 1) // TOK_TILE
    tok_tiles = gl.where((e >= 0) & (e < E), tiles, 0)
    return s, t, e, tok_tiles


SLOT_CHUNK = gl.constexpr(31)  # slots a consumer's slot walk loads at once (_slot_chunk)


@gluon.jit
def _slot_chunk(a_offsets_ptr, expert_ids_ptr, g0, G, WARPS: gl.constexpr):
    """Offsets and expert ids of slots [g0, g0 + SLOT_CHUNK), one a lane of a warp: lane j holds
    a_offsets[g0 + j] (j <= SLOT_CHUNK: the chunk's slots start and end there) and
    expert_ids[g0 + j], the indices clamped to the tensors (G >= 1; the walk never picks a slot
    past G). A consumer's slot walk then takes them from registers (_chunk_slot, REDUX in SASS):
    one load latency a chunk instead of a slot (kernels/sm90_mxfp8.py, config.Sm90Config.chunk_walk,
    where this measured faster). Two vectors, not three, and clamped indices, not masks: a third
    vector's register, or the masks' predicates, spilled on the wide tiles."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    g = g0 + gl.arange(0, SLOT_CHUNK + 1, layout=layout)
    return gl.load(a_offsets_ptr + gl.minimum(g, G)), gl.load(expert_ids_ptr + gl.minimum(g, G - 1))


@gluon.jit
def _chunk_slot(offsets, experts, j, M, E, TOK_TILE: gl.constexpr, TAIL: gl.constexpr = 0):
    """_slot of the chunk's slot j (< SLOT_CHUNK) from _slot_chunk's vectors. (The max over a lane
    and -1 turns a negative offset or expert id into -1, which _slot_tiles' clamps and its e < 0
    test take as they take the value itself.)"""
    lane = gl.arange(0, SLOT_CHUNK + 1, layout=offsets.type.layout)
    s = gl.max(gl.where(lane == j, offsets, -1), axis=0)
    t = gl.max(gl.where(lane == j + 1, offsets, -1), axis=0)
    e = gl.max(gl.where(lane == j, experts, -1), axis=0)
    return _slot_tiles(s, t, e, M, E, TOK_TILE, TAIL)


@gluon.jit
def _total_tiles(a_offsets_ptr, expert_ids_ptr, M, E, G, w_tiles, TOK_TILE: gl.constexpr, TAIL: gl.constexpr):
    """The call's tile count: the slot walk's, 64 slots at a time (the producer's one warp)."""
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    total = 0
    for g0 in range(0, G, 64):
        g = g0 + gl.arange(0, 64, layout=layout)
        ok = g < G
        s, t, e, tok_tiles = _slot_tiles(gl.load(a_offsets_ptr + g, mask=ok, other=0),
                                         gl.load(a_offsets_ptr + g + 1, mask=ok, other=0),
                                         gl.load(expert_ids_ptr + g, mask=ok, other=-1), M, E, TOK_TILE, TAIL)
        total += gl.sum(tok_tiles, axis=0)
    return total * w_tiles


@gluon.jit
def _tail_of(tok_block, tok_tiles, s, t, TOK_TILE: gl.constexpr):
    """Whether token tile tok_block of slot rows [s, t) has a tail: it is the slot's last tile
    and holds more than TOK_TILE tokens (at most TOK_TILE + TAIL, _slot), the rest from row
    s + (tok_block + 1) * TOK_TILE on. One CTA computes both over one stream of the weight
    tile: the same weight block read by a second CTA for a few tokens costs a second read of it
    (kernels/sm90_mxfp8.py)."""
    return (tok_block == tok_tiles - 1) & (t - s - tok_block * TOK_TILE > TOK_TILE)


@gluon.jit
def _next_tile(tile, nprog, first_claimed, tile_counter_ptr):
    """The producer's choice of its program's next tile (module docstring, schedule): round-robin
    below first_claimed, from there on in the order programs ask. An index past the last tile
    ends the program's walk. Relaxed: only the count is shared (acq_rel put a GPU-wide MEMBAR
    and an L1 invalidation around it)."""
    next_tile = tile + nprog
    if next_tile >= first_claimed:
        next_tile = first_claimed + gl.atomic_add(tile_counter_ptr, 1, sem="relaxed")
    return next_tile


@gluon.jit
def _publish_tile(tile_ids, id_ready, id_free, n, tile):
    """Producer: hand its n-th next tile `tile` to the consumer warpgroups through one of two
    shared-memory words (id_ready: count 1; id_free: one arrival a consumer warpgroup). It is
    published after the current tile's loads are issued, and read after that tile's K loop, so
    neither side waits for the other's progress on the ring."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # the producer's one warp
    slot = n % 2
    mbarrier.wait(id_free.index(slot), ((n // 2) & 1) ^ 1)
    tile_ids.index(slot).store(gl.full([1], tile, gl.int32, layout))
    mbarrier.arrive(id_ready.index(slot), count=1)


@gluon.jit
def _receive_tile(tile_ids, id_ready, id_free, n):
    """Consumer warpgroup: the producer's n-th next tile (_publish_tile)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # a consumer warpgroup
    slot = n % 2
    mbarrier.wait(id_ready.index(slot), (n // 2) & 1)
    tile = gl.max(tile_ids.index(slot).load(layout), axis=0)
    mbarrier.arrive(id_free.index(slot), count=1)
    return tile


@gluon.jit
def _tile_id_buffers(CONSUMERS: gl.constexpr):
    """The two shared-memory words and their barriers of _publish_tile / _receive_tile."""
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    id_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(id_ready.index(i), count=1)
        mbarrier.init(id_free.index(i), count=CONSUMERS)
    return tile_ids, id_ready, id_free


@gluon.jit
def _band_coords(local, tok_tiles, w_tiles, GROUP_M: gl.constexpr):
    """Local tile index of a slot -> (token block, weight block): bands of GROUP_M token
    blocks, token blocks fastest, so neighbouring CTAs share weight tiles in L2."""
    per_band = GROUP_M * w_tiles
    band = local // per_band
    first = band * GROUP_M
    band_tok = gl.minimum(tok_tiles - first, GROUP_M)
    within = local - band * per_band
    return first + within % band_tok, within // band_tok


@gluon.jit
def _masked_store(out_ptr, result, toks, tok_mask, ns, N, tok_dim: gl.constexpr, w_dim: gl.constexpr):
    """C[tok, n] = result, only for tokens of the group (tok_mask) and n < N."""
    ptrs = out_ptr + gl.expand_dims(toks.to(gl.int64) * N, tok_dim) + gl.expand_dims(ns, w_dim)
    mask = gl.expand_dims(tok_mask, tok_dim) & gl.expand_dims(ns < N, w_dim)
    gl.store(ptrs, result, mask=mask)


@gluon.jit
def _store_swapped(out_ptr, result, tok0, t, n0, N):
    """C[tok0 + j, n0 + i] = result[i, j] of a swapped tile (rows: weight rows from n0, columns:
    tokens from tok0) for tokens < t and n < N. The accumulator's layout holds pairs of
    consecutive tokens, N apart in C: 2-byte stores, ~15 instructions an element with their
    64-bit addresses and masks. Converted (through shared memory) to 8 consecutive weight
    rows a thread, a warp stores four tokens' 128-byte row pieces with 16-byte stores."""
    ROWS: gl.constexpr = result.shape[0]
    TOKS: gl.constexpr = result.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    value = gl.convert_layout(result, layout)
    ns = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    toks = tok0 + gl.arange(0, TOKS, layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + gl.expand_dims(ns, 1) + gl.expand_dims(toks.to(gl.int64) * N, 0)
    gl.store(ptrs, value, mask=gl.expand_dims(ns < N, 1) & gl.expand_dims(toks < t, 0))


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty,
                    a_offsets_ptr, expert_ids_ptr, M, N, K, E, G,
                    TOK_TILE: gl.constexpr, W_TILE: gl.constexpr, BLOCK_K: gl.constexpr,
                    STAGES: gl.constexpr, GROUP_M: gl.constexpr, SUB: gl.constexpr = 1, s_desc=None, s_bufs=None,
                    ws_desc=None, ws_bufs=None, KB4=0, b_half_desc=None, tail_desc=None, tail_bufs=None,
                    tail_s_desc=None, tail_s_bufs=None, S_COLUMN_BLOCK: gl.constexpr = 4, tile_counter_ptr=None,
                    claim_rounds=0, tile_ids=None, id_ready=None, id_free=None, DYNAMIC: gl.constexpr = False):
    """The producer warp. A stage holds one B tile and SUB consecutive A tiles of BLOCK_K
    (a_bufs[stage * SUB + j]): the MX kernel loads 128 bytes of each weight row per stage,
    i.e. several 64-wide K steps of its bf16 tokens (kernels/sm90_mx.py). With s_desc, a stage
    also holds the tokens' fp32 scales of its K blocks, a [K blocks, TOK_TILE] box of their
    K-block-major copy (kernels/sm90_mxfp8.py; slots start at multiples of S_COLUMN_BLOCK,
    token_forms.kb_major_column). With ws_desc, also the weight tile's e8m0
    scales in the swizzled layout, seen as [atoms * 32, 4] int32 (a 128x4 atom is 32 x 4 words,
    KB4 atoms per 128 weight rows): an [atoms * 32, 4] box (kernels/sm90_mxfp8.py, e2m1 weights).
    With b_half_desc (a [W_TILE / 2, ...] box of B), a weight tile whose rows past N are at least
    half of it (an expert's last tile, N % W_TILE <= W_TILE / 2) loads only its first half: the
    consumers of the other half skip it (kernels/sm90_mxfp8.py, split-K). With tail_desc (a
    [TAIL, BLOCK_K] box of A) and tail_s_desc (a [K blocks, TAIL] box of the token scales), a
    slot's last tile takes up to TAIL more tokens (_slot, _tail_of): when it has them, each
    stage also holds their tokens and scales (kernels/sm90_mxfp8.py, wide tiles). DYNAMIC: the
    last claim_rounds * nprog tiles are claimed from tile_counter_ptr, and every next tile is handed
    to the consumers through tile_ids (module docstring, schedule)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    w_tiles = gl.cdiv(N, W_TILE)
    k_steps = gl.cdiv(K, BLOCK_K * SUB)
    if s_desc is None:
        stage_bytes: gl.constexpr = SUB * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    else:
        stage_bytes: gl.constexpr = (SUB * a_desc.block_type.nbytes + b_desc.block_type.nbytes +
                                     s_desc.block_type.nbytes + (0 if ws_desc is None else ws_desc.block_type.nbytes))
        S_STEP: gl.constexpr = s_desc.block_type.shape[0]
    if ws_desc is not None:
        gl.static_assert(s_desc is not None and W_TILE == 128, "weight scales come with token scales, 128-row tiles")
        WS_ATOMS: gl.constexpr = ws_desc.block_type.shape[0] // 32
    # K step of B's tile in its stored columns (packed fp4 weights hold two elements a byte).
    B_STEP: gl.constexpr = b_desc.block_type.shape[1]
    if b_half_desc is not None:
        gl.static_assert(2 * b_half_desc.block_type.shape[0] == W_TILE, "half a weight tile")
        half_bytes: gl.constexpr = stage_bytes - b_desc.block_type.nbytes + b_half_desc.block_type.nbytes
    if tail_desc is not None:
        gl.static_assert(s_desc is not None and SUB == 1 and b_half_desc is None, "tails: wide tiles of one token box")
        TAIL: gl.constexpr = tail_desc.block_type.shape[0]
        tail_stage_bytes: gl.constexpr = stage_bytes + tail_desc.block_type.nbytes + tail_s_desc.block_type.nbytes
    else:
        TAIL: gl.constexpr = 0
    it = 0
    tile_base = 0
    claims = 0
    first_claimed = 0  # (DYNAMIC: set after the first tile's loads)
    next_tile = pid  # this program's next tile: the first index >= tile_base it owns
    for g in range(G):
        s, t, e, tok_tiles = _slot(a_offsets_ptr, expert_ids_ptr, g, M, E, TOK_TILE, TAIL)
        group_tiles = tok_tiles * w_tiles
        # The program's tiles of this slot. next_tile replaces two runtime modulos a slot: every
        # program walks every slot, and at 1 token over 128 slots (4 with tokens) they cost ~12 us
        # a call (gpt-oss shapes, H100; no change when most slots have tiles). A while, not `for
        # tile in range(next_tile, ...)` assigning next_tile in its body: triton 3.6 does not
        # carry a variable the body only writes, so every slot restarted at pid (illegal address).
        while next_tile < tile_base + group_tiles:
            tile = next_tile
            if not DYNAMIC:
                next_tile += nprog
            tok_block, w_block = _band_coords(tile - tile_base, tok_tiles, w_tiles, GROUP_M)
            a_row = s + tok_block * TOK_TILE
            b_row = e * N + w_block * W_TILE
            if b_half_desc is not None:
                half_tile = N - w_block * W_TILE <= W_TILE // 2
            if s_desc is not None:  # the slot's columns start 16-byte aligned (token_forms.kb_major_column)
                s_col = S_COLUMN_BLOCK * ((s + S_COLUMN_BLOCK - 1) // S_COLUMN_BLOCK + g) + tok_block * TOK_TILE
            if TAIL > 0:
                has_tail = _tail_of(tok_block, tok_tiles, s, t, TOK_TILE)
            for kk in range(k_steps):
                stage = it % STAGES
                mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
                if TAIL > 0:
                    if has_tail:
                        mbarrier.expect(ready.index(stage), tail_stage_bytes)
                        tma.async_copy_global_to_shared(tail_desc, [a_row + TOK_TILE, kk * BLOCK_K],
                                                        ready.index(stage), tail_bufs.index(stage))
                        tma.async_copy_global_to_shared(tail_s_desc, [kk * S_STEP, s_col + TOK_TILE],
                                                        ready.index(stage), tail_s_bufs.index(stage))
                    else:
                        mbarrier.expect(ready.index(stage), stage_bytes)
                elif b_half_desc is None:
                    mbarrier.expect(ready.index(stage), stage_bytes)
                elif half_tile:
                    mbarrier.expect(ready.index(stage), half_bytes)
                else:
                    mbarrier.expect(ready.index(stage), stage_bytes)
                for j in gl.static_range(SUB):
                    tma.async_copy_global_to_shared(a_desc, [a_row, (kk * SUB + j) * BLOCK_K], ready.index(stage),
                                                    a_bufs.index(stage * SUB + j))
                if b_half_desc is None:
                    tma.async_copy_global_to_shared(b_desc, [b_row, kk * B_STEP], ready.index(stage),
                                                    b_bufs.index(stage))
                elif half_tile:
                    tma.async_copy_global_to_shared(b_half_desc, [b_row, kk * B_STEP], ready.index(stage),
                                                    b_bufs.index(stage).slice(0, W_TILE // 2))
                else:
                    tma.async_copy_global_to_shared(b_desc, [b_row, kk * B_STEP], ready.index(stage),
                                                    b_bufs.index(stage))
                if s_desc is not None:
                    tma.async_copy_global_to_shared(s_desc, [kk * S_STEP, s_col], ready.index(stage), s_bufs.index(stage))
                if ws_desc is not None:  # (an atom row past the block's KB4 is cleared by the consumer)
                    ws_row = ((e * w_tiles + w_block) * KB4 + kk * WS_ATOMS) * 32
                    tma.async_copy_global_to_shared(ws_desc, [ws_row, 0], ready.index(stage), ws_bufs.index(stage))
                it += 1
            if DYNAMIC:
                # (claimed with the ring full of this tile's stages, which cover the atomic's round
                # trip: claimed before the tile's loads, it held them back)
                if claims == 0:  # (counted here, the slot loads' latency is under the ring's)
                    first_claimed = gl.maximum(_total_tiles(a_offsets_ptr, expert_ids_ptr, M, E, G, w_tiles, TOK_TILE,
                                                            TAIL) - claim_rounds * nprog, nprog)
                next_tile = _next_tile(tile, nprog, first_claimed, tile_counter_ptr)
                _publish_tile(tile_ids, id_ready, id_free, claims, next_tile)
                claims += 1
        tile_base += group_tiles


@gluon.jit
def _wgmma_operands(m_op, n_op, stage, col, WG: gl.constexpr, SPLIT_N: gl.constexpr, SUB_N: gl.constexpr):
    """This warpgroup's wgmma operands in ring stage `stage`: A [64, K] and B^T [K, SUB_N]
    (weight columns [col, col + SUB_N) of its share)."""
    if SPLIT_N:
        a = m_op.index(stage)
        b = n_op.index(stage).slice(WG * SUB_N + col, SUB_N)
    else:
        a = m_op.index(stage).slice(WG * WG_ROWS, WG_ROWS)
        b = n_op.index(stage).slice(col, SUB_N)
    return a, b.permute((1, 0))


@gluon.jit
def _promote(m_op, n_op, ready, empty, zero, a_scale_rows, tok_mask, b_scale_row, NUM_KB, high_valid, it, k_steps,
             WG: gl.constexpr, STAGES: gl.constexpr, SPLIT_N: gl.constexpr, SUB_N: gl.constexpr,
             N_SUB: gl.constexpr, tok_dim: gl.constexpr):
    """fp8_block main loop: acc_h = sum_k wgmma(block k, half h) * sa(k) * sb(k, h), one block at
    a time (issue, wait, promote) for N_SUB (1 or 2) 128-wide weight halves.

    The other consumer warpgroup's wgmma runs while this one promotes. Keeping this
    warpgroup's next wgmma in flight instead needs a third accumulator, and the loop-carried
    in-flight tile made ptxas serialize every wgmma (C7514/C7515), so it is not done. The
    scales of block k are loaded during block k-1: loaded in the same step, the compiler
    placed their product ahead of the wgmma, stalling its issue on the load latency (SASS).
    """
    acc0 = zero
    acc1 = zero
    sa = gl.load(a_scale_rows, mask=tok_mask, other=0.0)
    sb0 = gl.load(b_scale_row)
    sb1 = gl.load(b_scale_row + NUM_KB, mask=high_valid, other=0.0)
    for kk in range(k_steps):
        more = kk + 1 < k_steps
        sa_next = gl.load(a_scale_rows + kk + 1, mask=tok_mask & more, other=0.0)
        sb0_next = gl.load(b_scale_row + kk + 1, mask=more, other=0.0)
        if N_SUB == 2:
            sb1_next = gl.load(b_scale_row + NUM_KB + kk + 1, mask=more & high_valid, other=0.0)
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        a, b = _wgmma_operands(m_op, n_op, stage, 0, WG, SPLIT_N, SUB_N)
        part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
        scale0 = gl.expand_dims(sa * sb0, tok_dim)
        part = warpgroup_mma_wait(0, deps=(part, ))
        if N_SUB == 2:
            acc0 = acc0 + part * scale0
            a, b = _wgmma_operands(m_op, n_op, stage, SUB_N, WG, SPLIT_N, SUB_N)
            part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
            scale1 = gl.expand_dims(sa * sb1, tok_dim)
            part = warpgroup_mma_wait(0, deps=(part, ))
            mbarrier.arrive(empty.index(stage), count=1)
            acc1 = acc1 + part * scale1
            sb1 = sb1_next
        else:
            mbarrier.arrive(empty.index(stage), count=1)
            acc0 = acc0 + part * scale0
        sa = sa_next
        sb0 = sb0_next
        it += 1
    return acc0, acc1, it


@gluon.jit
def _chain(m_op, n_op, ready, empty, zero, it, k_steps, WG: gl.constexpr, STAGES: gl.constexpr,
           SPLIT_N: gl.constexpr, SUB_N: gl.constexpr):
    """bf16 main loop: acc = sum_k wgmma(block k), chained with one wgmma in flight; a stage is
    released once the wgmma after it has been issued and the one reading it has retired."""
    acc = zero
    prev = 0
    for kk in range(k_steps):
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        a, b = _wgmma_operands(m_op, n_op, stage, 0, WG, SPLIT_N, SUB_N)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))  # the wgmma of step kk-1 has retired
        mbarrier.arrive(empty.index(prev), count=1, pred=kk > 0)
        prev = stage
        it += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index(prev), count=1)
    return acc, it


@gluon.jit
def _epilogue(acc, c_desc, c_smem, out_ptr, expert_scales_ptr, row_scales_ptr, e, toks, tok_mask, ns, N,
              row0, col0, t, SWAP: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
              HAS_ROW_SCALES: gl.constexpr, tok_dim: gl.constexpr, w_dim: gl.constexpr,
              VECTOR_SWAP: gl.constexpr = False):
    """C = acc * expert_scales[e] * row_scales[tok], rounded; TMA store when this warpgroup's
    64 token rows (from row0) all lie inside the group (the store is clipped at M and N), else
    masked stores. VECTOR_SWAP (swapped tiles whose kernel leaves shared memory for it,
    config.Sm90Config.smem_bytes): 16-byte stores (_store_swapped), row0 the tile's first token
    and col0 its first weight row."""
    if HAS_EXPERT_SCALES:
        acc = acc * gl.load(expert_scales_ptr + e)
    if HAS_ROW_SCALES:
        rs = gl.load(row_scales_ptr + toks, mask=tok_mask, other=0.0).to(gl.float32)
        acc = acc * gl.expand_dims(rs, tok_dim)
    result = acc.to(out_ptr.dtype.element_ty)
    if VECTOR_SWAP:
        _store_swapped(out_ptr, result, row0, t, col0, N)
    elif SWAP:
        _masked_store(out_ptr, result, toks, tok_mask, ns, N, tok_dim, w_dim)
    else:
        if row0 + WG_ROWS <= t:
            tma.store_wait(pendings=0)  # the previous TMA store has finished reading c_smem
            c_smem.store(result)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row0, col0], c_smem)
        else:
            _masked_store(out_ptr, result, toks, tok_mask, ns, N, tok_dim, w_dim)


@gluon.jit
def _consumer_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, out_ptr,
                        a_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr, row_scales_ptr,
                        M, N, K, E, G, NUM_KB, epi,
                        WG: gl.constexpr, TOK_TILE: gl.constexpr, W_TILE: gl.constexpr, SUB_N: gl.constexpr,
                        BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SWAP: gl.constexpr,
                        SPLIT_N: gl.constexpr, PROMOTE: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
                        HAS_ROW_SCALES: gl.constexpr, INSTR_K: gl.constexpr, EPI: gl.constexpr, tile_ids, id_ready,
                        id_free, DYNAMIC: gl.constexpr):
    # An accumulator is [64, SUB_N]: rows are this warpgroup's tokens (weight rows when
    # SWAP), columns its weight rows (tokens when SWAP).
    N_SUB: gl.constexpr = 2 if (PROMOTE and not SWAP and not SPLIT_N and W_TILE > 128) else 1
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, SUB_N, INSTR_K])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    tok_dim: gl.constexpr = 0 if SWAP else 1  # expand_dims axis that broadcasts a per-token vector
    w_dim: gl.constexpr = 1 if SWAP else 0
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    w_tiles = gl.cdiv(N, W_TILE)
    k_steps = gl.cdiv(K, BLOCK_K)
    n_blocks128 = gl.cdiv(N, 128)
    zero = gl.zeros([WG_ROWS, SUB_N], gl.float32, acc_layout)
    if SWAP:
        m_op = b_bufs  # weights are the wgmma M operand, tokens the narrow N
        n_op = a_bufs
        tok_offsets = gl.arange(0, SUB_N, layout=col_layout)
        w_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=row_layout)
    else:
        m_op = a_bufs
        n_op = b_bufs
        if SPLIT_N:
            tok_offsets = gl.arange(0, WG_ROWS, layout=row_layout)
            w_offsets = WG * SUB_N + gl.arange(0, SUB_N, layout=col_layout)
        else:
            tok_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=row_layout)
            w_offsets = gl.arange(0, SUB_N, layout=col_layout)
    it = 0
    tile_base = 0
    claims = 0
    next_tile = pid  # this program's next tile: the first index >= tile_base it owns
    for g in range(G):
        s, t, e, tok_tiles = _slot(a_offsets_ptr, expert_ids_ptr, g, M, E, TOK_TILE)
        group_tiles = tok_tiles * w_tiles
        while next_tile < tile_base + group_tiles:  # (sm90._load_partition says why not a for)
            tile = next_tile
            if not DYNAMIC:  # else the producer's choice, received after the tile
                next_tile += nprog
            tok_block, w_block = _band_coords(tile - tile_base, tok_tiles, w_tiles, GROUP_M)
            toks = s + tok_block * TOK_TILE + tok_offsets
            tok_mask = toks < t
            ns = w_block * W_TILE + w_offsets  # this warpgroup's first (or only) weight columns
            row0 = s + tok_block * TOK_TILE + (0 if SPLIT_N else WG * WG_ROWS)
            col0 = w_block * W_TILE + (WG * SUB_N if SPLIT_N else 0)
            if PROMOTE:
                first_block = col0 // 128 if not SWAP else (w_block * W_TILE) // 128
                b_scale_row = b_scale_ptr + (e * n_blocks128 + first_block) * NUM_KB
                a_scale_rows = a_scale_ptr + toks.to(gl.int64) * NUM_KB
                acc0, acc1, it = _promote(m_op, n_op, ready, empty, zero, a_scale_rows, tok_mask, b_scale_row,
                                          NUM_KB, first_block + 1 < n_blocks128, it, k_steps, WG, STAGES,
                                          SPLIT_N, SUB_N, N_SUB, tok_dim)
                if N_SUB == 2:
                    _epilogue(acc1, c_desc, c_smem, out_ptr, expert_scales_ptr, row_scales_ptr, e, toks, tok_mask,
                              ns + SUB_N, N, row0, col0 + SUB_N, t, SWAP, HAS_EXPERT_SCALES, HAS_ROW_SCALES,
                              tok_dim, w_dim)
            else:
                acc0, it = _chain(m_op, n_op, ready, empty, zero, it, k_steps, WG, STAGES, SPLIT_N, SUB_N)
            if EPI[0] != 0:  # the fused SwiGLU epilogue (bf16 only: PROMOTE is never fused)
                tok0 = s + tok_block * TOK_TILE if SWAP else row0
                w0 = w_block * W_TILE + WG * WG_ROWS if SWAP else col0
                fused_epilogue(acc0, out_ptr, expert_scales_ptr, g, s, e, tok0, t, w0, N, epi, SWAP,
                               HAS_EXPERT_SCALES, EPI)
            else:
                _epilogue(acc0, c_desc, c_smem, out_ptr, expert_scales_ptr, row_scales_ptr, e, toks, tok_mask, ns, N,
                          row0, col0, t, SWAP, HAS_EXPERT_SCALES, HAS_ROW_SCALES, tok_dim, w_dim)
            if DYNAMIC:
                next_tile = _receive_tile(tile_ids, id_ready, id_free, claims)
                claims += 1
        tile_base += group_tiles
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_matmul_sm90_kernel(a_desc, b_desc, c_desc, out_ptr,
                               a_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                               expert_scales_ptr, row_scales_ptr,
                               tile_counter_ptr, claim_rounds, M, N, K, E, G, NUM_KB, epi,
                               STAGES: gl.constexpr, GROUP_M: gl.constexpr, SWAP: gl.constexpr,
                               PROMOTE: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
                               HAS_ROW_SCALES: gl.constexpr, CONSUMER_REGS: gl.constexpr, EPI: gl.constexpr,
                               DYNAMIC: gl.constexpr = False):
    """See the module docstring. a_desc: token tiles [TOK_TILE, BLOCK_K] of A; b_desc: weight
    tiles [W_TILE, BLOCK_K] of B viewed as [E*N, K]; c_desc: [64, SUB_N] tiles of C (unused when
    SWAP). The tile arrangement follows from the descriptor shapes: TOK_TILE = 64 is split-n.
    DYNAMIC: the last claim_rounds * nprog tiles are claimed from tile_counter_ptr (an int32 that
    is zero at launch), else all are dealt round-robin (module docstring, schedule)."""
    TOK_TILE: gl.constexpr = a_desc.block_type.shape[0]
    W_TILE: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    SPLIT_N: gl.constexpr = (not SWAP) and TOK_TILE == WG_ROWS
    SUB_N: gl.constexpr = c_desc.block_type.shape[1]
    INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
    gl.static_assert((W_TILE if SWAP else TOK_TILE) == 2 * WG_ROWS or SPLIT_N, "two warpgroups of 64 rows")
    gl.static_assert((not SPLIT_N) or W_TILE == 2 * SUB_N, "split-n: each warpgroup takes half the weights")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    # Swapped tiles store with masks: their epilogue buffer is a token one, leaving the shared
    # memory to the ring.
    c_rows: gl.constexpr = 1 if SWAP else WG_ROWS
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, c_rows, SUB_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    tile_ids, id_ready, id_free = _tile_id_buffers(2)  # (40 bytes; used when DYNAMIC)
    gl.warp_specialize([
        (_consumer_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_smem.index(0), out_ptr,
                               a_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
                               row_scales_ptr, M, N, K, E, G, NUM_KB, epi, 0, TOK_TILE, W_TILE, SUB_N, BLOCK_K,
                               STAGES, GROUP_M, SWAP, SPLIT_N, PROMOTE, HAS_EXPERT_SCALES, HAS_ROW_SCALES,
                               INSTR_K, EPI, tile_ids, id_ready, id_free, DYNAMIC)),
        (_consumer_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_smem.index(1), out_ptr,
                               a_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
                               row_scales_ptr, M, N, K, E, G, NUM_KB, epi, 1, TOK_TILE, W_TILE, SUB_N, BLOCK_K,
                               STAGES, GROUP_M, SWAP, SPLIT_N, PROMOTE, HAS_EXPERT_SCALES, HAS_ROW_SCALES,
                               INSTR_K, EPI, tile_ids, id_ready, id_free, DYNAMIC)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, a_offsets_ptr, expert_ids_ptr,
                           M, N, K, E, G, TOK_TILE, W_TILE, BLOCK_K, STAGES, GROUP_M, 1, None, None, None, None, 0,
                           None, None, None, None, None, 4, tile_counter_ptr, claim_rounds, tile_ids, id_ready, id_free,
                           DYNAMIC)),
    ], [4, 1], [CONSUMER_REGS, 40])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32,
               torch.uint8: gl.uint8}


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, dtype):
    """Shared layout of a TMA block (cached: building it costs ~15 us of host time per call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_counter(cfg, upper_tiles: int, num_programs: int, device: torch.device) -> torch.Tensor | None:
    """The tile counter of a launch whose programs may get more than one tile, when its config
    claims the last rounds (a zeroed int32 of this call, a fill in its stream; no host read;
    module docstring, schedule). None: round-robin throughout (always for split-K)."""
    if upper_tiles <= num_programs or cfg.claim_rounds <= 0 or cfg.split_k:
        return None
    return torch.zeros(1, dtype=torch.int32, device=device)


def supports(p: GroupedProblem) -> bool:
    """Shapes the TMA descriptors can describe: 16-byte aligned rows of A, B and C."""
    if p.fmt.name not in ("bf16", "fp8_block"):
        return False
    elem = 2 if p.fmt.name == "bf16" else 1
    out_elem = 2 if p.out_dtype == torch.bfloat16 else 4
    return (p.k * elem) % 16 == 0 and (p.n * out_elem) % 16 == 0


def launch(p: GroupedProblem, a, b, a_scales, b_scales, a_offsets, expert_ids, expert_scales, row_scales, out,
           epilogue: dict | None = None):
    """Choose the config and grid, launch into `out` ([M, N]); the caller checked `supports(p)`.

    Nothing here reads a device value: the grid is min(SMs, an upper bound of the tiles).
    `epilogue` (sm90_epilogue.launch_fused) switches on the fused SwiGLU epilogue: `out` is then
    its [M, N/2] (or packed) output.
    """
    if p.num_groups == 0 or p.m == 0 or p.n == 0:
        return out
    cfg = sm90_config(p.fmt, p.n, p.k, p.m / p.num_groups, out.element_size(), fused=epilogue is not None)
    upper_tiles = (math.ceil(p.m / cfg.token_tile) + p.num_groups) * math.ceil(p.n / cfg.weight_tile)
    num_programs = min(_sm_count(out.device), upper_tiles)
    counter = tile_counter(cfg, upper_tiles, num_programs, out.device)
    promote = p.fmt.name == "fp8_block"
    bk = cfg.block_k
    a_block = (cfg.token_tile, bk)
    a_desc = TensorDescriptor.from_tensor(a, list(a_block), _layout(a_block, a.dtype))
    b_block = (cfg.weight_tile, bk)
    b_desc = TensorDescriptor.from_tensor(b.reshape(p.num_experts * p.n, p.k), list(b_block), _layout(b_block, b.dtype))
    c_block = (WG_ROWS.value, cfg.epilogue_n(promote))
    # The fused epilogue stores with masks: its TMA descriptor only has to exist.
    c_target = out if epilogue is None else torch.empty(1, p.n, dtype=torch.bfloat16, device=out.device)
    c_desc = TensorDescriptor.from_tensor(c_target, list(c_block), _layout(c_block, c_target.dtype))
    dummy = a_offsets
    epi, epi_consts = epilogue_args(epilogue, dummy)
    grouped_matmul_sm90_kernel[(num_programs, )](
        a_desc, b_desc, c_desc, out,
        a_scales if promote else dummy, b_scales if promote else dummy, a_offsets, expert_ids,
        expert_scales if expert_scales is not None else dummy, row_scales if row_scales is not None else dummy,
        counter if counter is not None else dummy, cfg.claim_rounds, p.m, p.n, p.k, p.num_experts, p.num_groups,
        p.num_k_scales if promote else 0, epi,
        EPI=epi_consts, STAGES=cfg.stages, GROUP_M=cfg.group_m, SWAP=cfg.swap, PROMOTE=promote,
        HAS_EXPERT_SCALES=expert_scales is not None, HAS_ROW_SCALES=row_scales is not None,
        CONSUMER_REGS=cfg.consumer_regs, DYNAMIC=counter is not None, num_warps=4,
    )
    return out
