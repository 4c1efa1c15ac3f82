"""The sm90 kernel of `bf16` and DeepSeek's `fp8_block`: wgmma straight from the TMA ring.

Tile arrangements (sm90_configs.DenseConfig), two consumer warpgroups on the pipeline of pipeline.py:
    normal   128 tokens x W_TILE weights: warpgroup w takes tokens [64w, 64w+64)
    split-n   64 tokens x W_TILE weights: warpgroup w takes weight rows [w, w+1) * W_TILE/2
             (small groups: a 64-row token tile wastes less on a group's ragged end)
    swapped  TOK_TILE tokens x 128 weights: weights are the wgmma M side, warpgroup w takes
             weight rows [64w, 64w+64), tokens the narrow N side (decode)
The two consumers are separate partitions, so one warpgroup's promotion (fp32 FMAs) overlaps
the other's wgmma. fp8_block promotes per 128x128 block, so a normal tile 256 weights wide runs
as two 128-wide halves, each with its own accumulator.

Steady state of one consumer, fp8_block (PROMOTE):
    load sa (1x128 scales of its tokens) and sb (128x128 block scales) of step k+1
    wait ready[s]; part = wgmma(A[s], B[s]^T) (fresh, 4 x k32); wait; arrive empty[s]
    acc += part * (sa * sb)[k]       # fp32 promotion per 128-wide K block (docs/contract.md)
With SCALE_RING (normal tiles) the producer copies each stage's sa and sb into the ring beside
its A and B boxes (stage_scales.StageScales) and the consumer reads them from shared memory after
the ready wait: the same sums, no global load in the K loop (_promote_staged).
bf16: acc = wgmma(A[s], B[s]^T, acc) chained, one wgmma in flight, stage released one step late.

bf16 weights may also be N-major (B [E, N, K] the transpose of a contiguous [E, K, N], as gpt-oss
stores its experts): their stages hold [BLOCK_K, W_TILE] boxes of that tensor, which wgmma reads
as they are (the transposed-operand bit: tnspB, or tnspA for the swapped tile's weights), in
every tile arrangement, with the same instruction shapes and order of sums.
"""


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from .free_rows import zero_free_rows
from .pipeline import (
    WG_ROWS,
    Output,
    Producer,
    Ring,
    Schedule,
    n_major,
    optional,
    produce,
    producer_registers,
    walk,
)
from .stage_scales import SCALE_COPY_LANES, StageScales
from .swiglu import Swiglu


@gluon.jit
def _wgmma_operands(m_op, n_op, stage, col: gl.constexpr, WG: gl.constexpr, SPLIT_N: gl.constexpr,
                    SUB_N: gl.constexpr, SWAP: gl.constexpr, N_MAJOR: gl.constexpr):
    """This warpgroup's wgmma operands in ring stage `stage`: A [64, K] and B^T [K, SUB_N]
    (weight columns [col, col + SUB_N) of its share). The weights' buffer (n_op, or m_op when
    SWAP) is [W_TILE, K], or [K, W_TILE] for N-major weights (N_MAJOR): wgmma reads a 16-bit
    operand from shared memory in either major order, so that one is only viewed, not moved."""
    B_START: gl.constexpr = WG * SUB_N + col if SPLIT_N else col
    if SPLIT_N:
        a = m_op.index(stage)
    elif SWAP and N_MAJOR:
        a = m_op.index(stage).slice(WG * WG_ROWS, WG_ROWS, dim=1).permute((1, 0))
    else:
        a = m_op.index(stage).slice(WG * WG_ROWS, WG_ROWS)
    if N_MAJOR and not SWAP:
        b = n_op.index(stage).slice(B_START, SUB_N, dim=1)
    else:
        b = n_op.index(stage).slice(B_START, SUB_N).permute((1, 0))
    return a, b


@gluon.jit
def _promote(m_op, n_op, ring, zero, a_scale_rows, tok_mask, b_scale_row, NUM_KB, high_valid, it, k_steps,
             WG: gl.constexpr, SPLIT_N: gl.constexpr, N_SUB: gl.constexpr, tok_dim: gl.constexpr):
    """fp8_block main loop: acc_h = sum_k wgmma(block k, half h) * sa(k) * sb(k, h), one block at
    a time (issue, wait, promote) for N_SUB (1 or 2) 128-wide weight halves.

    The other consumer warpgroup's wgmma runs while this one promotes. Keeping this
    warpgroup's next wgmma in flight instead needs a third accumulator, and the loop-carried
    in-flight tile made ptxas serialize every wgmma (C7514/C7515), so it is not done. The
    scales of block k are loaded during block k-1: loaded in the same step, the compiler
    placed their product ahead of the wgmma, stalling its issue on the load latency (SASS).
    """
    SUB_N: gl.constexpr = zero.shape[1]
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
        stage = ring.wait_ready(it)
        a, b = _wgmma_operands(m_op, n_op, stage, 0, WG, SPLIT_N, SUB_N, False, False)
        part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
        scale0 = gl.expand_dims(sa * sb0, tok_dim)
        part = warpgroup_mma_wait(0, deps=(part, ))
        if N_SUB == 2:
            acc0 = acc0 + part * scale0
            a, b = _wgmma_operands(m_op, n_op, stage, SUB_N, WG, SPLIT_N, SUB_N, False, False)
            part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
            scale1 = gl.expand_dims(sa * sb1, tok_dim)
            part = warpgroup_mma_wait(0, deps=(part, ))
            ring.release(stage)
            acc1 = acc1 + part * scale1
            sb1 = sb1_next
        else:
            ring.release(stage)
            acc0 = acc0 + part * scale0
        sa = sa_next
        sb0 = sb0_next
        it += 1
    return acc0, acc1, it


@gluon.jit
def _stage_scale(buf, j: gl.constexpr):
    """Element j of a stage's weight-block scales as a scalar (one shared load, every thread)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.sum(buf.slice(j, 1).load(layout), axis=0)


@gluon.jit
def _promote_staged(m_op, n_op, ring, scales, zero, it, k_steps, WG: gl.constexpr, N_SUB: gl.constexpr):
    """fp8_block main loop of a normal tile whose scales the producer stages in the ring
    (stage_scales.StageScales): the sums of _promote, in the same order and with the same scale
    products, but each block's scales are read from shared memory after its ready wait (no
    global load, pointer or prefetched scale held through the loop), and the stage and its
    phase are counted rather than divided out of `it` each step.

    The second half's wgmma takes the first half's tile as its (ignored, use_acc=False)
    accumulator: that ties the two to the same registers, so ptxas promotes the first half
    before issuing the second. Given a fresh tile it kept both partial tiles live (three
    64x128 fp32 tiles plus the accumulators) and spilled in the loop (SASS)."""
    SUB_N: gl.constexpr = zero.shape[1]
    STAGES: gl.constexpr = ring.STAGES
    row_layout: gl.constexpr = gl.SliceLayout(1, zero.type.layout)
    acc0 = zero
    acc1 = zero
    stage = it % STAGES
    phase = (it // STAGES) & 1
    for kk in range(k_steps):
        mbarrier.wait(ring.ready.index(stage), phase)
        sa = scales.tok_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS).load(row_layout)
        w_scales = scales.w_bufs.index(stage)
        sb0 = _stage_scale(w_scales, 0)
        a, b = _wgmma_operands(m_op, n_op, stage, 0, WG, False, SUB_N, False, False)
        part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
        scale0 = gl.expand_dims(sa * sb0, 1)
        part = warpgroup_mma_wait(0, deps=(part, ))
        if N_SUB == 2:
            sb1 = _stage_scale(w_scales, 1)
            acc0 = acc0 + part * scale0
            a, b = _wgmma_operands(m_op, n_op, stage, SUB_N, WG, False, SUB_N, False, False)
            part = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
            scale1 = gl.expand_dims(sa * sb1, 1)
            part = warpgroup_mma_wait(0, deps=(part, ))
            ring.release(stage)
            acc1 = acc1 + part * scale1
        else:
            ring.release(stage)
            acc0 = acc0 + part * scale0
        stage += 1
        wrap = stage == STAGES
        stage = gl.where(wrap, 0, stage)
        phase = phase ^ wrap.to(gl.int32)
    return acc0, acc1, it + k_steps


@gluon.jit
def _chain(m_op, n_op, ring, zero, it, k_steps, WG: gl.constexpr, SPLIT_N: gl.constexpr, SWAP: gl.constexpr,
           N_MAJOR: gl.constexpr):
    """bf16 main loop: acc = sum_k wgmma(block k), chained with one wgmma in flight; a stage is
    released once the wgmma after it has been issued and the one reading it has retired.
    N_MAJOR: the weights' stages are [K, W_TILE] (_wgmma_operands)."""
    SUB_N: gl.constexpr = zero.shape[1]
    acc = zero
    prev = 0
    for kk in range(k_steps):
        stage = ring.wait_ready(it)
        a, b = _wgmma_operands(m_op, n_op, stage, 0, WG, SPLIT_N, SUB_N, SWAP, N_MAJOR)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))  # the wgmma of step kk-1 has retired
        ring.release(prev, pred=kk > 0)
        prev = stage
        it += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    ring.release(prev)
    return acc, it


@aggregate
class DenseConsumer:
    """Consumer warpgroup WG of the dense kernel (module docstring): its K loop and epilogue per
    tile. An accumulator is [64, SUB_N]: rows are this warpgroup's tokens (weight rows when
    SWAP), columns its weight rows (tokens when SWAP)."""

    ring: Ring
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    c_desc: tma.tensor_descriptor
    c_smem: gl.shared_memory_descriptor
    out: Output
    swiglu: Swiglu
    a_scale_ptr: gl.tensor
    b_scale_ptr: gl.tensor
    scales: (StageScales, gl.constexpr)
    K: gl.tensor
    NUM_KB: gl.tensor
    WG: gl.constexpr
    SUB_N: gl.constexpr
    SWAP: gl.constexpr
    SPLIT_N: gl.constexpr
    PROMOTE: gl.constexpr
    N_MAJOR: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ring, a_bufs, b_bufs, c_desc, c_smem, out, swiglu, a_scale_ptr, b_scale_ptr, scales, K, NUM_KB,
                 WG, SUB_N, SWAP, SPLIT_N, PROMOTE, N_MAJOR):
        self.ring = ring
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.c_desc = c_desc
        self.c_smem = c_smem
        self.out = out
        self.swiglu = swiglu
        self.a_scale_ptr = a_scale_ptr
        self.b_scale_ptr = b_scale_ptr
        self.scales = optional(scales)
        self.K = K
        self.NUM_KB = NUM_KB
        self.WG = gl.constexpr(WG)
        self.SUB_N = gl.constexpr(SUB_N)
        self.SWAP = gl.constexpr(SWAP)
        self.SPLIT_N = gl.constexpr(SPLIT_N)
        self.PROMOTE = gl.constexpr(PROMOTE)
        self.N_MAJOR = gl.constexpr(N_MAJOR)

    @gluon.jit
    def tile(self, sched, slot, tok_block, w_block, it, done):
        WG: gl.constexpr = self.WG
        SUB_N: gl.constexpr = self.SUB_N
        SWAP: gl.constexpr = self.SWAP
        SPLIT_N: gl.constexpr = self.SPLIT_N
        TOK_TILE: gl.constexpr = sched.TOK_TILE
        W_TILE: gl.constexpr = sched.W_TILE
        BLOCK_K: gl.constexpr = self.a_bufs.shape[2]
        INSTR_K: gl.constexpr = 256 // self.a_bufs.dtype.primitive_bitwidth
        N_SUB: gl.constexpr = 2 if (self.PROMOTE and not SWAP and not SPLIT_N and W_TILE > 128) else 1
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, SUB_N, INSTR_K])
        row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        tok_dim: gl.constexpr = 0 if SWAP else 1  # expand_dims axis that broadcasts a per-token vector
        N = sched.N
        k_steps = gl.cdiv(self.K, BLOCK_K)
        zero = gl.zeros([WG_ROWS, SUB_N], gl.float32, acc_layout)
        if SWAP:
            m_op = self.b_bufs  # weights are the wgmma M operand, tokens the narrow N
            n_op = self.a_bufs
            tok_offsets = gl.arange(0, SUB_N, layout=col_layout)
            w_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=row_layout)
        else:
            m_op = self.a_bufs
            n_op = self.b_bufs
            if SPLIT_N:
                tok_offsets = gl.arange(0, WG_ROWS, layout=row_layout)
                w_offsets = WG * SUB_N + gl.arange(0, SUB_N, layout=col_layout)
            else:
                tok_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=row_layout)
                w_offsets = gl.arange(0, SUB_N, layout=col_layout)
        s = slot.s
        t = slot.t
        e = slot.e
        if self.scales is not None:  # (the K loop first: none of the epilogue's values is held through it)
            acc0, acc1, it = _promote_staged(m_op, n_op, self.ring, self.scales, zero, it, k_steps, WG, N_SUB)
        toks = s + tok_block * TOK_TILE + tok_offsets
        tok_mask = toks < t
        ns = w_block * W_TILE + w_offsets  # this warpgroup's first (or only) weight columns
        row0 = s + tok_block * TOK_TILE + (0 if SPLIT_N else WG * WG_ROWS)
        col0 = w_block * W_TILE + (WG * SUB_N if SPLIT_N else 0)
        if self.scales is not None:
            if N_SUB == 2:
                self.epilogue(acc1, e, toks, tok_mask, ns + SUB_N, N, row0, col0 + SUB_N, t)
        elif self.PROMOTE:
            n_blocks128 = gl.cdiv(N, 128)
            first_block = col0 // 128 if not SWAP else (w_block * W_TILE) // 128
            b_scale_row = self.b_scale_ptr + (e * n_blocks128 + first_block) * self.NUM_KB
            a_scale_rows = self.a_scale_ptr + toks.to(gl.int64) * self.NUM_KB
            acc0, acc1, it = _promote(m_op, n_op, self.ring, zero, a_scale_rows, tok_mask, b_scale_row, self.NUM_KB,
                                      first_block + 1 < n_blocks128, it, k_steps, WG, SPLIT_N, N_SUB, tok_dim)
            if N_SUB == 2:
                self.epilogue(acc1, e, toks, tok_mask, ns + SUB_N, N, row0, col0 + SUB_N, t)
        else:
            acc0, it = _chain(m_op, n_op, self.ring, zero, it, k_steps, WG, SPLIT_N, SWAP, self.N_MAJOR)
        if self.swiglu.ACT != 0:  # the fused SwiGLU epilogue (bf16 only: PROMOTE is never fused)
            tok0 = s + tok_block * TOK_TILE if SWAP else row0
            w0 = w_block * W_TILE + WG * WG_ROWS if SWAP else col0
            self.swiglu.store(acc0, self.out, slot, tok0, w0, N, SWAP)
        else:
            self.epilogue(acc0, e, toks, tok_mask, ns, N, row0, col0, t)
        return it

    @gluon.jit
    def epilogue(self, acc, e, toks, tok_mask, ns, N, row0, col0, t):
        if self.SWAP:
            self.out.store_swapped_tile(acc, e, toks, tok_mask, ns, N, row0, col0, t)
        else:
            self.out.store_tile(acc, self.c_desc, self.c_smem, e, toks, tok_mask, ns, N, row0, col0, t)


@gluon.jit
def _consume(consumer, sched, FILL: gl.constexpr):
    walk(sched, consumer)
    if FILL and consumer.WG == 0:
        zero_free_rows(sched, consumer.out.out_ptr)
    tma.store_wait(pendings=0)


@gluon.jit
def dense_kernel(a_desc, b_desc, c_desc, out_ptr, a_scale_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                 expert_scales_ptr, row_scales_ptr, tile_counter_ptr, claim_rounds, M, N, K, E, G, NUM_KB, epi,
                 STAGES: gl.constexpr, GROUP_M: gl.constexpr, SWAP: gl.constexpr, PROMOTE: gl.constexpr,
                 HAS_EXPERT_SCALES: gl.constexpr, HAS_ROW_SCALES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 EPI: gl.constexpr, DYNAMIC: gl.constexpr, SCALE_RING: gl.constexpr, FILL: gl.constexpr = False):
    """a_desc: token tiles [TOK_TILE, BLOCK_K] of A; b_desc: weight tiles [W_TILE, BLOCK_K] of B
    viewed as [E*N, K], or for N-major bf16 weights [1, BLOCK_K, W_TILE] boxes of B's [E, K, N]
    storage (pipeline.n_major); c_desc: [64, SUB_N] tiles of C (unused when SWAP). The tile
    arrangement follows from the descriptor shapes: TOK_TILE = 64 is split-n. a_scale_ptr, b_scale_ptr: the
    fp8_block scales (PROMOTE), NUM_KB K blocks a row; SCALE_RING: staged by the producer into the
    ring (normal tiles). epi, EPI: the fused epilogue (Swiglu.create).
    DYNAMIC: the last claim_rounds * nprog tiles are claimed from tile_counter_ptr (an int32 that
    is zero at launch), else all are dealt round-robin (pipeline.py, schedule). FILL: out is fresh,
    and its rows no valid slot owns are zeroed after the tiles (free_rows.py)."""
    TOK_TILE: gl.constexpr = a_desc.block_type.shape[0]
    N_MAJOR: gl.constexpr = n_major(b_desc)
    W_TILE: gl.constexpr = b_desc.block_type.shape[2] if N_MAJOR else b_desc.block_type.shape[0]
    SPLIT_N: gl.constexpr = (not SWAP) and TOK_TILE == WG_ROWS
    SUB_N: gl.constexpr = c_desc.block_type.shape[1]
    gl.static_assert((W_TILE if SWAP else TOK_TILE) == 2 * WG_ROWS or SPLIT_N, "two warpgroups of 64 rows")
    gl.static_assert((not SPLIT_N) or W_TILE == 2 * SUB_N, "split-n: each warpgroup takes half the weights")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    if N_MAJOR:
        gl.static_assert(not PROMOTE, "N-major weights are bf16")
        BLOCK_K: gl.constexpr = b_desc.block_type.shape[1]
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, W_TILE],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_K, W_TILE], b_desc.dtype))
    else:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    # Swapped tiles store with masks: their epilogue buffer is a token one, leaving the shared
    # memory to the ring.
    c_rows: gl.constexpr = 1 if SWAP else WG_ROWS
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, c_rows, SUB_N], c_desc.layout)
    if SCALE_RING:
        gl.static_assert(PROMOTE and not SWAP and not SPLIT_N, "scales in the ring: fp8_block, normal tiles")
        scales = StageScales.create(a_scale_ptr, b_scale_ptr, NUM_KB, STAGES, TOK_TILE)
    else:
        scales = None
    ring = Ring.create(STAGES, 2, SCALE_COPY_LANES if SCALE_RING else 0)
    sched = Schedule.create(a_offsets_ptr, expert_ids_ptr, M, N, E, G, tile_counter_ptr, claim_rounds, TOK_TILE,
                            W_TILE, GROUP_M, 2, DYNAMIC=DYNAMIC)
    out = Output(out_ptr, expert_scales_ptr, row_scales_ptr, HAS_EXPERT_SCALES, HAS_ROW_SCALES)
    swiglu = Swiglu.create(epi, EPI)
    K = gl.to_tensor(K)
    NUM_KB = gl.to_tensor(NUM_KB)
    consumer0 = DenseConsumer(ring, a_bufs, b_bufs, c_desc, c_smem.index(0), out, swiglu, a_scale_ptr, b_scale_ptr,
                              scales, K, NUM_KB, 0, SUB_N, SWAP, SPLIT_N, PROMOTE, N_MAJOR)
    consumer1 = DenseConsumer(ring, a_bufs, b_bufs, c_desc, c_smem.index(1), out, swiglu, a_scale_ptr, b_scale_ptr,
                              scales, K, NUM_KB, 1, SUB_N, SWAP, SPLIT_N, PROMOTE, N_MAJOR)
    producer = Producer.create(ring, a_desc, b_desc, a_bufs, b_bufs, K, scales=scales)
    gl.warp_specialize([(_consume, (consumer0, sched, FILL)), (_consume, (consumer1, sched, FILL)),
                        (produce, (producer, sched))],
                       [4, 1], [CONSUMER_REGS, producer_registers(2, CONSUMER_REGS)])
