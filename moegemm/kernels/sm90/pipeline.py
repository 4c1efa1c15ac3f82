"""The device-side pipeline layer every sm90 kernel is built on: the ring, the tile schedule, the
TMA producer, the plain epilogue stores and the weight-scale addressing.

A kernel of the family is a persistent, warp-specialized Gluon kernel, one CTA per SM:

    role         warps  registers          does
    producer     1      24 .. 120          walks the tiles, TMA-loads each K stage into the ring
                                           (Producer.tile); with claimed tiles, also claims the
                                           next tile and publishes it (Schedule.publish)
    consumer w   4      CONSUMER_REGS      one warpgroup: waits a stage, runs its wgmmas on it,
    (w = 0, 1;                             releases it, then the tile's epilogue; the default
     split-K 0..3)                         partition is consumer 0, the others are workers

Barriers (shared-memory mbarriers):

    barrier        count            arrives                               bytes (tx)          phase of use n
    ready[s]       1 (+32 with      producer: expect(stage bytes), then   the stage's TMA     consumers wait
                   StageScales)     TMA completion; StageScales: each     boxes               (n // STAGES) & 1
                                    producer lane once its cp.async
                                    copies of the stage have landed
    empty[s]       consumer         each consumer warpgroup once its      -                   producer waits
                   warpgroups       wgmmas reading stage s retired                            ((n // STAGES) & 1) ^ 1
    id_ready[i]    1                producer, after storing tile id i%2   -                   (i // 2) & 1
    id_free[i]     consumer wgs     each consumer after reading it        -                   ((i // 2) & 1) ^ 1
    red_ready[r]   1                split-K: the sending warpgroup of     -                   tiles_done & 1
                                    rows r, after storing its partial
    red_free[r]    1                split-K: the receiver, after adding   -                   (tiles_done & 1) ^ 1

K step `it` (counted over all the program's tiles) uses stage it % STAGES. A fresh barrier
counts as phase 1 complete, so the producer's first lap over `empty` passes.

Schedule (Schedule, walk): every partition walks the group slots in order (scalar loads of
a_offsets and expert_ids, or chunks of SLOT_CHUNK slots held in a warp's lanes; no host read,
no pre-pass) and counts the tiles of earlier slots. Tile t goes to program t % nprog,
round-robin, except the last claim_rounds * nprog tiles of the call (DYNAMIC, with a zeroed
int32 counter): the producer, having counted the call's tiles, claims each of those with an
atomic add once it has issued its current tile's loads and hands every next tile to the
consumers through shared memory (publish, receive). Tile indices rise either way, so the slot
walk only goes forward. Round-robin keeps the programs that share an operand in step, so one
HBM read serves them through L2; the claimed last rounds even out the tail of the call
(docs/perf-notes.md). Within a slot, tiles go in bands of GROUP_M token blocks, token blocks
fastest. Offsets are clamped to [0, M]; a slot whose expert id is outside [0, E) has no tiles.

Epilogue (Output.store_tile, Output.store_swapped_tile): C = acc * expert_scales[e] * row_scales[m] in fp32, rounded to the
output dtype; a warpgroup's 64 token rows that lie inside the group go out by TMA store
(clipped at M and N), other rows and every swapped tile with masks: no row outside the group's
[s, t) is written.

The parts are Gluon aggregates (triton.language.core._aggregate, as in Triton's Gluon tutorials):
a kernel allocates its buffers, builds a Ring, a Schedule, a Producer and one consumer role per
warpgroup, and hands each partition (role, schedule). Aggregates have no inheritance and their
constructor must assign every field, so the consumer roles' field lists and constructors repeat
by shape across the kernel files; the logic they carry is written once, here.
"""


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.language.core import _aggregate as aggregate

from .stage_scales import StageScales

# Field types of optional aggregate members: absent ones are constexpr None (optional).
OPTIONAL_DESC = (tma.tensor_descriptor, gl.constexpr)
OPTIONAL_SMEM = (gl.shared_memory_descriptor, gl.constexpr)

WG_ROWS = gl.constexpr(64)  # rows of one consumer warpgroup's wgmma
SLOT_CHUNK = gl.constexpr(31)  # slots a chunked slot walk loads at once (Schedule.slot_chunk)


@gluon.constexpr_function
def optional(value):
    """An aggregate member that may be absent: None becomes constexpr None (a constexpr function
    receives it unwrapped)."""
    return gl.constexpr(None) if value is None else value


@gluon.constexpr_function
def n_major(b_desc):
    """Whether a weight descriptor holds N-major weights: bf16 B [E, N, K] that is the transpose
    of a contiguous [E, K, N], loaded in 3-D boxes [1, BLOCK_K, W_TILE] of that tensor (zero past
    an expert's K, where a 2-D box would read the next expert's rows) and staged [BLOCK_K, W_TILE];
    K-major weights come in 2-D boxes [W_TILE, K step]."""
    return len(b_desc.block_type.shape) == 3


@gluon.constexpr_function
def producer_registers(CONSUMERS, CONSUMER_REGS):
    """The producer warp's setmaxnreg budget beside CONSUMERS consumer warpgroups of CONSUMER_REGS
    registers a thread. The default partition (consumer 0) gets what the workers leave of the
    pool, so the producer takes the pool less every consumer's share: 504 a thread slot over the
    three warpgroups of two consumers, 480 over the five of four (65536 registers, steps of 8).
    With 512 - 4 x CONSUMER_REGS, consumer 0 of four got 32 fewer than the others and spilled in
    the fused epilogue; ptxas keeps the wgmmas in flight only if each K loop has its registers."""
    return {2: 504, 4: 480}[CONSUMERS] - CONSUMERS * CONSUMER_REGS


@aggregate
class Ring:
    """The ready/empty barriers of a STAGES-deep ring (module docstring); the stage buffers are
    the kernel's, indexed by the stage these methods return."""

    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, empty, STAGES):
        self.ready = ready
        self.empty = empty
        self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def create(STAGES: gl.constexpr, CONSUMERS: gl.constexpr, COPY_LANES: gl.constexpr = 0):
        """Allocate and initialize the barriers (after the stage buffers: the allocation order
        fixes the shared-memory offsets). COPY_LANES: producer lanes that also arrive on ready[s]
        once their cp.async copies of the stage have landed (stage_scales.StageScales)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1 + COPY_LANES)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        return Ring(ready, empty, STAGES)

    @gluon.jit
    def wait_ready(self, it):
        """Consumer: wait until K step `it`'s stage is loaded; returns the stage."""
        stage = it % self.STAGES
        mbarrier.wait(self.ready.index(stage), (it // self.STAGES) & 1)
        return stage

    @gluon.jit
    def wait_empty(self, it):
        """Producer: wait until K step `it`'s stage is free; returns the stage."""
        stage = it % self.STAGES
        mbarrier.wait(self.empty.index(stage), ((it // self.STAGES) & 1) ^ 1)
        return stage

    @gluon.jit
    def release(self, stage, pred=True):
        """Consumer: this warpgroup is done reading `stage`."""
        mbarrier.arrive(self.empty.index(stage), count=1, pred=pred)


@aggregate
class Slot:
    """Group slot g: rows [s, t) of expert e, tok_tiles token tiles (0 when e is outside [0, E))."""

    g: gl.tensor
    s: gl.tensor
    t: gl.tensor
    e: gl.tensor
    tok_tiles: gl.tensor

    @gluon.constexpr_function
    def __init__(self, g, s, t, e, tok_tiles):
        self.g = g
        self.s = s
        self.t = t
        self.e = e
        self.tok_tiles = tok_tiles


@gluon.jit
def _slot_tiles(s, t, e, M, E, TOK_TILE: gl.constexpr, TAIL: gl.constexpr):
    """Clamped rows and token-tile count of slots (scalars, or vectors of slots). TAIL > 0: a
    slot's last tile also takes up to TAIL more tokens (Schedule.tail_of)."""
    s = gl.minimum(gl.maximum(s, 0), M)
    t = gl.minimum(gl.maximum(t, s), M)
    if TAIL > 0:
        tiles = gl.where(t > s, gl.maximum((t - s - TAIL + TOK_TILE - 1) // TOK_TILE, 1), 0)
    else:
        tiles = (t - s + TOK_TILE - 1) // TOK_TILE
    tok_tiles = gl.where((e >= 0) & (e < E), tiles, 0)
    return s, t, e, tok_tiles


@aggregate
class Schedule:
    """The call's groups and the tile schedule over them (module docstring). A tile is TOK_TILE
    tokens x W_TILE weight rows; DYNAMIC: the last claim_rounds * nprog tiles are claimed from
    tile_counter_ptr (zero at launch) and handed to the consumers through tile_ids; CHUNK_WALK:
    the walk takes slots from chunks held in registers (slot_chunk)."""

    a_offsets_ptr: gl.tensor
    expert_ids_ptr: gl.tensor
    M: gl.tensor
    N: gl.tensor
    E: gl.tensor
    G: gl.tensor
    tile_counter_ptr: gl.tensor
    claim_rounds: gl.tensor
    tile_ids: OPTIONAL_SMEM
    id_ready: OPTIONAL_SMEM
    id_free: OPTIONAL_SMEM
    TOK_TILE: gl.constexpr
    W_TILE: gl.constexpr
    GROUP_M: gl.constexpr
    TAIL: gl.constexpr
    DYNAMIC: gl.constexpr
    CHUNK_WALK: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_offsets_ptr, expert_ids_ptr, M, N, E, G, tile_counter_ptr, claim_rounds, tile_ids, id_ready,
                 id_free, TOK_TILE, W_TILE, GROUP_M, TAIL, DYNAMIC, CHUNK_WALK):
        self.a_offsets_ptr = a_offsets_ptr
        self.expert_ids_ptr = expert_ids_ptr
        self.M = M
        self.N = N
        self.E = E
        self.G = G
        self.tile_counter_ptr = tile_counter_ptr
        self.claim_rounds = claim_rounds
        self.tile_ids = optional(tile_ids)
        self.id_ready = optional(id_ready)
        self.id_free = optional(id_free)
        self.TOK_TILE = gl.constexpr(TOK_TILE)
        self.W_TILE = gl.constexpr(W_TILE)
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.TAIL = gl.constexpr(TAIL)
        self.DYNAMIC = gl.constexpr(DYNAMIC)
        self.CHUNK_WALK = gl.constexpr(CHUNK_WALK)

    @gluon.jit
    def create(a_offsets_ptr, expert_ids_ptr, M, N, E, G, tile_counter_ptr, claim_rounds, TOK_TILE: gl.constexpr,
               W_TILE: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, TAIL: gl.constexpr = 0,
               DYNAMIC: gl.constexpr = False, CHUNK_WALK: gl.constexpr = False):
        """The schedule; DYNAMIC: with the two tile-id words and their barriers (40 bytes of
        shared memory)."""
        if DYNAMIC:
            tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            id_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            id_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(id_ready.index(i), count=1)
                mbarrier.init(id_free.index(i), count=CONSUMERS)
        else:
            tile_ids = None
            id_ready = None
            id_free = None
        # (integer arguments equal to 1 arrive as constants: made tensors for the fields)
        return Schedule(a_offsets_ptr, expert_ids_ptr, gl.to_tensor(M), gl.to_tensor(N), gl.to_tensor(E),
                        gl.to_tensor(G), tile_counter_ptr, gl.to_tensor(claim_rounds), tile_ids, id_ready, id_free,
                        TOK_TILE, W_TILE, GROUP_M, TAIL, DYNAMIC, CHUNK_WALK)

    @gluon.jit
    def slot(self, g):
        """Slot g from its two offsets and expert id (three scalar loads)."""
        s, t, e, tok_tiles = _slot_tiles(gl.load(self.a_offsets_ptr + g), gl.load(self.a_offsets_ptr + g + 1),
                                         gl.load(self.expert_ids_ptr + g), self.M, self.E, self.TOK_TILE, self.TAIL)
        return Slot(g, s, t, e, tok_tiles)

    @gluon.jit
    def slot_chunk(self, g0):
        """Offsets and expert ids of slots [g0, g0 + SLOT_CHUNK), one a lane of a consumer warp:
        lane j holds a_offsets[g0 + j] (j <= SLOT_CHUNK: the chunk's slots start and end there) and
        expert_ids[g0 + j], the indices clamped to the tensors (G >= 1; the walk never picks a slot
        past G). The walk then takes slots from registers (chunk_slot, REDUX in SASS): one load
        latency a chunk instead of a slot. Two vectors, not three, and clamped indices, not masks:
        a third vector's register, or the masks' predicates, spilled on the wide tiles."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        g = g0 + gl.arange(0, SLOT_CHUNK + 1, layout=layout)
        return (gl.load(self.a_offsets_ptr + gl.minimum(g, self.G)),
                gl.load(self.expert_ids_ptr + gl.minimum(g, self.G - 1)))

    @gluon.jit
    def chunk_slot(self, offsets, experts, g, j):
        """Slot g, the chunk's slot j (< SLOT_CHUNK), from slot_chunk's vectors. (The max over a
        lane and -1 turns a negative offset or expert id into -1, which the clamps and the e < 0
        test take as they take the value itself.)"""
        lane = gl.arange(0, SLOT_CHUNK + 1, layout=offsets.type.layout)
        s = gl.max(gl.where(lane == j, offsets, -1), axis=0)
        t = gl.max(gl.where(lane == j + 1, offsets, -1), axis=0)
        e = gl.max(gl.where(lane == j, experts, -1), axis=0)
        s, t, e, tok_tiles = _slot_tiles(s, t, e, self.M, self.E, self.TOK_TILE, self.TAIL)
        return Slot(g, s, t, e, tok_tiles)

    @gluon.jit
    def total_tiles(self, w_tiles):
        """The call's tile count: the slot walk's, 64 slots at a time (the producer's one warp)."""
        layout: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        total = 0
        for g0 in range(0, self.G, 64):
            g = g0 + gl.arange(0, 64, layout=layout)
            ok = g < self.G
            _, _, _, tok_tiles = _slot_tiles(gl.load(self.a_offsets_ptr + g, mask=ok, other=0),
                                             gl.load(self.a_offsets_ptr + g + 1, mask=ok, other=0),
                                             gl.load(self.expert_ids_ptr + g, mask=ok, other=-1), self.M, self.E,
                                             self.TOK_TILE, self.TAIL)
            total += gl.sum(tok_tiles, axis=0)
        return total * w_tiles

    @gluon.jit
    def tail_of(self, slot, tok_block):
        """Whether token tile tok_block of the slot has a tail: it is the slot's last tile and
        holds more than TOK_TILE tokens (at most TOK_TILE + TAIL), the rest from row
        s + (tok_block + 1) * TOK_TILE on. One CTA computes both over one stream of the weight
        tile: the same weight block read by a second CTA for a few tokens costs a second read."""
        return (tok_block == slot.tok_tiles - 1) & (slot.t - slot.s - tok_block * self.TOK_TILE > self.TOK_TILE)

    @gluon.jit
    def band_coords(self, local, tok_tiles, w_tiles):
        """Local tile index of a slot -> (token block, weight block): bands of GROUP_M token
        blocks, token blocks fastest, so neighbouring CTAs share weight tiles in L2."""
        per_band = self.GROUP_M * w_tiles
        band = local // per_band
        first = band * self.GROUP_M
        band_tok = gl.minimum(tok_tiles - first, self.GROUP_M)
        within = local - band * per_band
        return first + within % band_tok, within // band_tok

    @gluon.jit
    def claim_next(self, tile, nprog, first_claimed):
        """The producer's choice of its program's next tile: round-robin below first_claimed,
        from there on in the order programs ask. An index past the last tile ends the walk.
        Relaxed: only the count is shared (acq_rel put a GPU-wide MEMBAR and an L1 invalidation
        around it)."""
        next_tile = tile + nprog
        if next_tile >= first_claimed:
            next_tile = first_claimed + gl.atomic_add(self.tile_counter_ptr, 1, sem="relaxed")
        return next_tile

    @gluon.jit
    def publish(self, n, tile):
        """Producer: hand its n-th next tile to the consumer warpgroups through one of the two
        shared-memory words. It is published after the current tile's loads are issued and read
        after that tile's K loop, so neither side waits for the other's progress on the ring."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # the producer's one warp
        slot = n % 2
        mbarrier.wait(self.id_free.index(slot), ((n // 2) & 1) ^ 1)
        self.tile_ids.index(slot).store(gl.full([1], tile, gl.int32, layout))
        mbarrier.arrive(self.id_ready.index(slot), count=1)

    @gluon.jit
    def receive(self, n):
        """Consumer warpgroup: the producer's n-th next tile (publish)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # a consumer warpgroup
        slot = n % 2
        mbarrier.wait(self.id_ready.index(slot), (n // 2) & 1)
        tile = gl.max(self.tile_ids.index(slot).load(layout), axis=0)
        mbarrier.arrive(self.id_free.index(slot), count=1)
        return tile


@gluon.jit
def walk(sched, role, PRODUCER: gl.constexpr = False):
    """Run role.tile(sched, slot, tok_block, w_block, it, done) -> it over this program's tiles,
    in the schedule's order (module docstring); `it` counts the ring's K steps, `done` the tiles
    this program has finished. The producer (PRODUCER) claims and publishes the next tile after
    each tile's loads, the consumers receive it after the tile's epilogue. Returns `it`.

    The tiles of a slot are taken by a while over next_tile, not `for tile in range(...)`
    assigning next_tile in its body: triton 3.6 does not carry a variable the body only writes
    (every slot restarted at pid: an illegal address). next_tile also replaces two runtime
    modulos a slot, which every program paid for every slot (~12 us a call at 1 token over
    128 slots, H100)."""
    CHUNKED: gl.constexpr = sched.CHUNK_WALK and not PRODUCER  # (a consumer warpgroup's lanes hold the chunk)
    nprog = gl.num_programs(0)
    w_tiles = gl.cdiv(sched.N, sched.W_TILE)
    it = 0
    tile_base = 0
    done = 0
    first_claimed = 0  # (PRODUCER and DYNAMIC: set after the first tile's loads)
    next_tile = gl.program_id(0)  # this program's next tile: the first index >= tile_base it owns
    if CHUNKED:
        # The chunk is reloaded from the current slot after each tile, so its vectors are not
        # held through the tile's K loop and epilogue (on wide tiles they spilled there).
        chunk_base = 0
        offsets, experts = sched.slot_chunk(0)
    for g in range(sched.G):
        if CHUNKED:
            if g - chunk_base >= SLOT_CHUNK:
                chunk_base = g
                offsets, experts = sched.slot_chunk(g)
            slot = sched.chunk_slot(offsets, experts, g, g - chunk_base)
        else:
            slot = sched.slot(g)
        group_tiles = slot.tok_tiles * w_tiles
        while next_tile < tile_base + group_tiles:
            tile = next_tile
            if not sched.DYNAMIC:  # else claimed by the producer, received after the tile
                next_tile += nprog
            tok_block, w_block = sched.band_coords(tile - tile_base, slot.tok_tiles, w_tiles)
            it = role.tile(sched, slot, tok_block, w_block, it, done)
            if CHUNKED:
                chunk_base = g
                offsets, experts = sched.slot_chunk(g)
            if sched.DYNAMIC:
                if PRODUCER:
                    # (claimed with the ring full of this tile's stages, which cover the atomic's
                    # round trip; the call's tiles are counted here, under the ring's latency)
                    if done == 0:
                        first_claimed = gl.maximum(sched.total_tiles(w_tiles) - sched.claim_rounds * nprog, nprog)
                    next_tile = sched.claim_next(tile, nprog, first_claimed)
                    sched.publish(done, next_tile)
                else:
                    next_tile = sched.receive(done)
            done += 1
        tile_base += group_tiles
    return it


@aggregate
class Producer:
    """The producer warp's loads (Producer.tile). A stage holds one weight box of b_desc (N-major
    bf16 weights: a 3-D box staged [BLOCK_K, W_TILE], n_major) and SUB consecutive token boxes of
    a_desc (a_bufs[stage * SUB + j]), and optionally:
    - s_desc: the tokens' fp32 scales of the stage's K blocks, a [K blocks, TOK_TILE] box of their
      K-block-major copy (slots start at multiples of S_COLUMN_BLOCK columns, token_forms.py);
    - ws_desc: the weight tile's swizzled scales seen as [atoms * 32, 4] int32, KB4 atoms per 128
      weight rows, a box of a stage's atoms for each 128-row block of the tile (e2m1 weights);
    - b_half_desc: a [W_TILE / 2, ...] weight box, which an expert's last tile loads alone when its
      rows past N are at least half of it (split-K: the consumers of the other half skip it);
    - tail_desc, tail_s_desc: a [TAIL, BLOCK_K] token box and its scales, loaded by a slot's last
      tile when it has a tail (Schedule.tail_of);
    - scales: fp8_block's token and weight-block scales of the stage (stage_scales.StageScales).
    Absent parts are None."""

    ring: Ring
    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    K: gl.tensor
    KB4: gl.tensor
    s_desc: OPTIONAL_DESC
    s_bufs: OPTIONAL_SMEM
    ws_desc: OPTIONAL_DESC
    ws_bufs: OPTIONAL_SMEM
    b_half_desc: OPTIONAL_DESC
    tail_desc: OPTIONAL_DESC
    tail_bufs: OPTIONAL_SMEM
    tail_s_desc: OPTIONAL_DESC
    tail_s_bufs: OPTIONAL_SMEM
    scales: (StageScales, gl.constexpr)
    SUB: gl.constexpr
    S_COLUMN_BLOCK: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ring, a_desc, b_desc, a_bufs, b_bufs, K, KB4, s_desc, s_bufs, ws_desc, ws_bufs, b_half_desc,
                 tail_desc, tail_bufs, tail_s_desc, tail_s_bufs, scales, SUB, S_COLUMN_BLOCK):
        self.ring = ring
        self.a_desc = a_desc
        self.b_desc = b_desc
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.K = K
        self.KB4 = KB4
        self.s_desc = optional(s_desc)
        self.s_bufs = optional(s_bufs)
        self.ws_desc = optional(ws_desc)
        self.ws_bufs = optional(ws_bufs)
        self.b_half_desc = optional(b_half_desc)
        self.tail_desc = optional(tail_desc)
        self.tail_bufs = optional(tail_bufs)
        self.tail_s_desc = optional(tail_s_desc)
        self.tail_s_bufs = optional(tail_s_bufs)
        self.scales = optional(scales)
        self.SUB = gl.constexpr(SUB)
        self.S_COLUMN_BLOCK = gl.constexpr(S_COLUMN_BLOCK)

    @gluon.jit
    def create(ring, a_desc, b_desc, a_bufs, b_bufs, K, SUB: gl.constexpr = 1, s_desc=None, s_bufs=None,
               ws_desc=None, ws_bufs=None, KB4=0, b_half_desc=None, tail_desc=None, tail_bufs=None,
               tail_s_desc=None, tail_s_bufs=None, S_COLUMN_BLOCK: gl.constexpr = 4, scales=None):
        return Producer(ring, a_desc, b_desc, a_bufs, b_bufs, gl.to_tensor(K), gl.to_tensor(KB4), s_desc, s_bufs,
                        ws_desc, ws_bufs, b_half_desc, tail_desc, tail_bufs, tail_s_desc, tail_s_bufs, scales, SUB,
                        S_COLUMN_BLOCK)

    @gluon.jit
    def tile(self, sched, slot, tok_block, w_block, it, done):
        """Issue the loads of every K stage of one tile."""
        TOK_TILE: gl.constexpr = sched.TOK_TILE
        W_TILE: gl.constexpr = sched.W_TILE
        BLOCK_K: gl.constexpr = self.a_desc.block_type.shape[1]
        SUB: gl.constexpr = self.SUB
        ring = self.ring
        k_steps = gl.cdiv(self.K, BLOCK_K * SUB)
        # (the weight scales: one box of atoms for each 128-row block of the tile)
        WS_BLOCKS: gl.constexpr = W_TILE // 128
        if self.s_desc is None:
            stage_bytes: gl.constexpr = (SUB * self.a_desc.block_type.nbytes + self.b_desc.block_type.nbytes +
                                         (0 if self.ws_desc is None else WS_BLOCKS * self.ws_desc.block_type.nbytes))
        else:
            stage_bytes: gl.constexpr = (SUB * self.a_desc.block_type.nbytes + self.b_desc.block_type.nbytes +
                                         self.s_desc.block_type.nbytes +
                                         (0 if self.ws_desc is None else WS_BLOCKS * self.ws_desc.block_type.nbytes))
            S_STEP: gl.constexpr = self.s_desc.block_type.shape[0]
        if self.ws_desc is not None:
            gl.static_assert(W_TILE % 128 == 0, "weight scales: whole 128-row blocks")
            WS_ATOMS: gl.constexpr = self.ws_desc.block_type.shape[0] // 32
        # K step of B's tile in its stored columns (packed fp4 weights hold two elements a byte).
        B_STEP: gl.constexpr = self.b_desc.block_type.shape[1]
        if self.b_half_desc is not None:
            gl.static_assert(2 * self.b_half_desc.block_type.shape[0] == W_TILE, "half a weight tile")
            half_bytes: gl.constexpr = stage_bytes - self.b_desc.block_type.nbytes + self.b_half_desc.block_type.nbytes
        if self.tail_desc is not None:
            gl.static_assert(self.s_desc is not None and SUB == 1 and self.b_half_desc is None,
                             "tails: wide tiles of one token box")
            tail_stage_bytes: gl.constexpr = (stage_bytes + self.tail_desc.block_type.nbytes +
                                              self.tail_s_desc.block_type.nbytes)
        a_row = slot.s + tok_block * TOK_TILE
        b_row = slot.e * sched.N + w_block * W_TILE
        B_N_MAJOR: gl.constexpr = n_major(self.b_desc)
        if B_N_MAJOR:
            gl.static_assert(self.b_half_desc is None and B_STEP == BLOCK_K * SUB, "N-major weights: whole boxes")
        if self.b_half_desc is not None:
            half_tile = sched.N - w_block * W_TILE <= W_TILE // 2
        if self.s_desc is not None:  # the slot's columns start 16-byte aligned (token_forms.kb_major_column)
            s_col = (self.S_COLUMN_BLOCK * ((slot.s + self.S_COLUMN_BLOCK - 1) // self.S_COLUMN_BLOCK + slot.g) +
                     tok_block * TOK_TILE)
        if self.tail_desc is not None:
            has_tail = sched.tail_of(slot, tok_block)
        if self.scales is not None:
            gl.static_assert(SUB == 1 and self.tail_desc is None and self.b_half_desc is None, "one K block a stage")
            scale_pointers = self.scales.tile_pointers(sched, slot, tok_block, w_block)
        for kk in range(k_steps):
            stage = ring.wait_empty(it)
            ready = ring.ready.index(stage)
            if self.scales is not None:
                self.scales.copy(stage, ready, scale_pointers, kk)
            if self.tail_desc is not None:
                if has_tail:
                    mbarrier.expect(ready, tail_stage_bytes)
                    tma.async_copy_global_to_shared(self.tail_desc, [a_row + TOK_TILE, kk * BLOCK_K], ready,
                                                    self.tail_bufs.index(stage))
                    tma.async_copy_global_to_shared(self.tail_s_desc, [kk * S_STEP, s_col + TOK_TILE], ready,
                                                    self.tail_s_bufs.index(stage))
                else:
                    mbarrier.expect(ready, stage_bytes)
            elif self.b_half_desc is None:
                mbarrier.expect(ready, stage_bytes)
            elif half_tile:
                mbarrier.expect(ready, half_bytes)
            else:
                mbarrier.expect(ready, stage_bytes)
            for j in gl.static_range(SUB):
                tma.async_copy_global_to_shared(self.a_desc, [a_row, (kk * SUB + j) * BLOCK_K], ready,
                                                self.a_bufs.index(stage * SUB + j))
            if B_N_MAJOR:
                tma.async_copy_global_to_shared(self.b_desc, [slot.e, kk * B_STEP, w_block * W_TILE], ready,
                                                self.b_bufs.index(stage).reshape(self.b_desc.block_type.shape))
            elif self.b_half_desc is None:
                tma.async_copy_global_to_shared(self.b_desc, [b_row, kk * B_STEP], ready, self.b_bufs.index(stage))
            elif half_tile:
                tma.async_copy_global_to_shared(self.b_half_desc, [b_row, kk * B_STEP], ready,
                                                self.b_bufs.index(stage).slice(0, W_TILE // 2))
            else:
                tma.async_copy_global_to_shared(self.b_desc, [b_row, kk * B_STEP], ready, self.b_bufs.index(stage))
            if self.s_desc is not None:
                tma.async_copy_global_to_shared(self.s_desc, [kk * S_STEP, s_col], ready, self.s_bufs.index(stage))
            if self.ws_desc is not None:  # (an atom row past the block's KB4 is cleared, or not read, by the consumer)
                for h in gl.static_range(WS_BLOCKS):
                    ws_row = (((slot.e * gl.cdiv(sched.N, 128) + w_block * WS_BLOCKS + h) * self.KB4 + kk * WS_ATOMS) *
                              32)
                    tma.async_copy_global_to_shared(self.ws_desc, [ws_row, 0], ready,
                                                    self.ws_bufs.index(stage).slice(h * WS_ATOMS * 32, WS_ATOMS * 32))
            it += 1
        return it


@gluon.jit
def produce(producer, sched):
    """The producer partition."""
    walk(sched, producer, PRODUCER=True)


@aggregate
class Output:
    """Where a tile's result goes: C (out_ptr, [M, N]) scaled by expert_scales[e] and
    row_scales[m] when given (HAS_EXPERT_SCALES, HAS_ROW_SCALES; else the pointers are unused)."""

    out_ptr: gl.tensor
    expert_scales_ptr: gl.tensor
    row_scales_ptr: gl.tensor
    HAS_EXPERT_SCALES: gl.constexpr
    HAS_ROW_SCALES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, out_ptr, expert_scales_ptr, row_scales_ptr, HAS_EXPERT_SCALES, HAS_ROW_SCALES):
        self.out_ptr = out_ptr
        self.expert_scales_ptr = expert_scales_ptr
        self.row_scales_ptr = row_scales_ptr
        self.HAS_EXPERT_SCALES = gl.constexpr(HAS_EXPERT_SCALES)
        self.HAS_ROW_SCALES = gl.constexpr(HAS_ROW_SCALES)

    @gluon.jit
    def scaled(self, acc, e, toks, tok_mask, tok_dim: gl.constexpr):
        """acc * expert_scales[e] * row_scales[toks], rounded to C's dtype."""
        if self.HAS_EXPERT_SCALES:
            acc = acc * gl.load(self.expert_scales_ptr + e)
        if self.HAS_ROW_SCALES:
            rs = gl.load(self.row_scales_ptr + toks, mask=tok_mask, other=0.0).to(gl.float32)
            acc = acc * gl.expand_dims(rs, tok_dim)
        return acc.to(self.out_ptr.dtype.element_ty)

    @gluon.jit
    def store_masked(self, result, toks, tok_mask, ns, N, tok_dim: gl.constexpr, w_dim: gl.constexpr):
        """C[tok, n] = result, only for tokens of the group (tok_mask) and n < N."""
        ptrs = self.out_ptr + gl.expand_dims(toks.to(gl.int64) * N, tok_dim) + gl.expand_dims(ns, w_dim)
        mask = gl.expand_dims(tok_mask, tok_dim) & gl.expand_dims(ns < N, w_dim)
        gl.store(ptrs, result, mask=mask)

    @gluon.jit
    def store_swapped(self, result, tok0, t, n0, N):
        """C[tok0 + j, n0 + i] = result[i, j] of a swapped tile (rows: weight rows from n0,
        columns: tokens from tok0) for tokens < t and n < N. The accumulator's layout holds pairs
        of consecutive tokens, N apart in C: 2-byte stores, ~15 instructions an element with their
        64-bit addresses and masks. Converted (through shared memory) to 8 consecutive weight rows
        a thread, a warp stores four tokens' 128-byte row pieces with 16-byte stores."""
        ROWS: gl.constexpr = result.shape[0]
        TOKS: gl.constexpr = result.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        value = gl.convert_layout(result, layout)
        ns = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        toks = tok0 + gl.arange(0, TOKS, layout=gl.SliceLayout(0, layout))
        ptrs = self.out_ptr + gl.expand_dims(ns, 1) + gl.expand_dims(toks.to(gl.int64) * N, 0)
        gl.store(ptrs, value, mask=gl.expand_dims(ns < N, 1) & gl.expand_dims(toks < t, 0))

    @gluon.jit
    def store_swapped_tile(self, acc, e, toks, tok_mask, ns, N, row0, col0, t, VECTOR: gl.constexpr = False):
        """The epilogue of a swapped tile (acc: [weight rows, tokens]): masked stores, or with
        VECTOR 16-byte stores (store_swapped; row0 the tile's first token, col0 its first weight
        row), which need shared memory the kernel's config leaves for them."""
        result = self.scaled(acc, e, toks, tok_mask, 0)
        if VECTOR:
            self.store_swapped(result, row0, t, col0, N)
        else:
            self.store_masked(result, toks, tok_mask, ns, N, 0, 1)

    @gluon.jit
    def store_tile(self, acc, c_desc, c_smem, e, toks, tok_mask, ns, N, row0, col0, t):
        """The epilogue of a normal tile (acc: [64 tokens, weights]): TMA store when this
        warpgroup's 64 token rows (from row0) all lie inside the group (the store is clipped at
        M and N), else masked stores."""
        result = self.scaled(acc, e, toks, tok_mask, 1)
        if row0 + WG_ROWS <= t:
            tma.store_wait(pendings=0)  # the previous TMA store has finished reading c_smem
            c_smem.store(result)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row0, col0], c_smem)
        else:
            self.store_masked(result, toks, tok_mask, ns, N, 1, 0)


@gluon.jit
def scale_row_offsets(e, ns, N, NUM_KB, KB4, SWIZZLED: gl.constexpr):
    """Offset of the e8m0/e4m3 weight scale (e, n, kb=0) of weight rows ns; plain [E, N, NUM_KB],
    swizzled [E, ceil(N/128), KB4, 32, 4, 4] (layouts.py)."""
    if SWIZZLED:
        n_blocks = (N + 127) // 128
        return (e * n_blocks + ns // 128).to(gl.int64) * (KB4 * 512) + (ns % 32) * 16 + ((ns % 128) // 32) * 4
    else:
        return (e * N + ns).to(gl.int64) * NUM_KB
