"""fp8_block's scales staged in the ring beside the operands (dense.py, DenseConfig.scale_ring):
the producer's lanes copy each stage's token and weight-block scales by cp.async from their
layouts as they are, and the consumers read them from shared memory after the ready wait. The
Producer (pipeline.py) calls tile_pointers once a tile and copy once a stage."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.language.core import _aggregate as aggregate

SCALE_COPY_LANES = gl.constexpr(32)  # lanes of the producer's warp, each an arrival on ready[s] (pipeline.Ring)


@aggregate
class StageScales:
    """fp8_block's scales copied into each ring stage by the producer (cp.async from their
    layouts as they are): tok_bufs[stage] holds the TOK_TILE tokens' scales of the stage's K
    block (tokens past M read 0), w_bufs[stage] the W_TILE / 128 weight blocks' (blocks past N
    read 0). a_scale_ptr: [M, NUM_KB], b_scale_ptr: [E, ceil(N / 128), NUM_KB], fp32."""

    tok_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    a_scale_ptr: gl.tensor
    b_scale_ptr: gl.tensor
    NUM_KB: gl.tensor

    @gluon.constexpr_function
    def __init__(self, tok_bufs, w_bufs, a_scale_ptr, b_scale_ptr, NUM_KB):
        self.tok_bufs = tok_bufs
        self.w_bufs = w_bufs
        self.a_scale_ptr = a_scale_ptr
        self.b_scale_ptr = b_scale_ptr
        self.NUM_KB = NUM_KB

    @gluon.jit
    def create(a_scale_ptr, b_scale_ptr, NUM_KB, STAGES: gl.constexpr, TOK_TILE: gl.constexpr):
        """The stage buffers: [STAGES, TOK_TILE] and [STAGES, 2] fp32."""
        layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        tok_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, TOK_TILE], layout)
        w_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 2], layout)
        return StageScales(tok_bufs, w_bufs, a_scale_ptr, b_scale_ptr, gl.to_tensor(NUM_KB))

    @gluon.jit
    def tile_pointers(self, sched, slot, tok_block, w_block):
        """The producer's pointers to K block 0 of a tile's token and weight-block scales, and
        which exist."""
        TOK_TILE: gl.constexpr = sched.TOK_TILE
        W_BLOCKS: gl.constexpr = sched.W_TILE // 128
        tok_layout: gl.constexpr = gl.BlockedLayout([TOK_TILE // 32], [32], [gl.num_warps()], [0])
        w_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        toks = slot.s + tok_block * TOK_TILE + gl.arange(0, TOK_TILE, layout=tok_layout)
        n_blocks = gl.cdiv(sched.N, 128)
        j = gl.arange(0, 2, layout=w_layout)
        blocks = w_block * W_BLOCKS + j
        return (self.a_scale_ptr + toks.to(gl.int64) * self.NUM_KB, toks < sched.M,
                self.b_scale_ptr + (slot.e * n_blocks + blocks).to(gl.int64) * self.NUM_KB,
                (blocks < n_blocks) & (j < W_BLOCKS))

    @gluon.jit
    def copy(self, stage, ready, pointers, kk):
        """Copy K block kk's scales into the stage: every lane arrives on `ready` once its copies
        have landed (ready counts SCALE_COPY_LANES such arrivals beside the producer's expect:
        Ring.create)."""
        gl.static_assert(gl.num_warps() * 32 == SCALE_COPY_LANES, "the producer's one warp copies the scales")
        tok_ptrs, tok_ok, w_ptrs, w_ok = pointers
        async_copy.async_copy_global_to_shared(self.tok_bufs.index(stage), tok_ptrs + kk, mask=tok_ok)
        async_copy.async_copy_global_to_shared(self.w_bufs.index(stage), w_ptrs + kk, mask=w_ok)
        async_copy.mbarrier_arrive(ready, increment_count=False)
