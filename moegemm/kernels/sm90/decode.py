"""The sm90 kernel of the block formats by decoding the weights to bf16 in the consumers: nvfp4
everywhere, mxfp4 and w4a8 above 12 tokens a slot (mxfp8 only when a DecodeConfig is forced).

Hopper has no block-scaled tensor-core instruction. Every 32- (nvfp4: 16-) wide K block
carries a scale per weight row AND one per token, so the exact math is either fp8 wgmma per
k32 followed by an fp32 promotion with the outer product of the two scale vectors (2 FP32
ops per output element per k32: the FP32 pipe then caps the run at the dense bf16 rate),
or bf16 wgmma on operands decoded with their scales folded in, which is exact: e4m3 or e2m1
times a power of two, and e2m1 times an e4m3 scale, have at most 5 significant bits. This
kernel does the latter (docs/design.md records the measurements):

    tokens   decoded once per call by a tl pre-pass (portable.dequantize_rows), or written in
             that form by the layer's kernels (token_forms.py), into a bf16 [M, K] buffer, TMA-loaded as the wgmma B operand (the narrow N side)
    weights  TMA-loaded COMPRESSED (1 byte or half a byte per element) into the ring, 128
             bytes of each weight row per stage at decode (SUB = 2 steps of 64 K; 128-token tiles one step,
             config._sm90_mx_config says why: one step, 32 or 64
             bytes a row, took the same ~0.7 us per stage whatever its bytes, H100); each
             consumer warpgroup decodes its 64 weight rows times the block scales (gathered
             from global memory, plain or swizzled layout, one step ahead) into a bf16
             shared-memory operand, two buffers a warpgroup

so the weights cross HBM once, compressed: what decode (few tokens per expert) is bound by.
Tiles are always "swapped": 128 weight rows (two warpgroups of 64) x TOK_TILE tokens
(config.DecodeConfig: one group's tokens at decode, 128 in prefill). Producer, barriers,
schedule and the masked epilogue are pipeline.py's.

Steady state of one consumer (stage s = it % STAGES, steps j < SUB of it):
    wait ready[s]
    per step: load the scales of the next step; w = decode(weights[s] rows, step j) * scales
              store w to operand buffer j; acc = wgmma(buffer, tokens[s, j]^T, acc)
              wait until one wgmma is left in flight (the stage's next decode overlaps it),
              or, after the stage's last step, until none is (_upcast_chain says why)
    arrive empty[s]
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from .pipeline import WG_ROWS, Output, Producer, Ring, Schedule, produce, scale_row_offsets, walk
from .swiglu import Swiglu


@gluon.jit
def _load_scales(scale_rows, row_ok, kk, NUM_KB, layout: gl.constexpr, NKB: gl.constexpr, SWIZZLED: gl.constexpr,
                 NV_SCALE: gl.constexpr):
    """The NKB block scales of K step kk of each weight row, a bf16 [64, NKB] tensor.
    e8m0 b -> 2^(b-127) (0 -> 2^-127, a bf16 subnormal; 255 -> NaN); nvfp4: e4m3."""
    kb = kk * NKB + gl.arange(0, NKB, layout=gl.SliceLayout(0, layout))
    if SWIZZLED:
        k_offsets = (kb // 4) * 512 + kb % 4
    else:
        k_offsets = kb
    mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(kb < NUM_KB, 0)
    raw = gl.load(gl.expand_dims(scale_rows, 1) + gl.expand_dims(k_offsets, 0), mask=mask, other=0)
    if NV_SCALE:
        scales = raw.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16)
    else:
        bits = raw.to(gl.int16) << 7
        bits = gl.where(raw == 0, 0x40, bits)
        bits = gl.where(raw == 255, 0x7FC0, bits)
        scales = bits.to(gl.bfloat16, bitcast=True)
    return scales


@gluon.jit
def _decode_weights(w_smem, scales, raw_layout: gl.constexpr, dec_layout: gl.constexpr, NKB: gl.constexpr,
                    FP4: gl.constexpr):
    """This warpgroup's [64, BLOCK_K] weight tile from the ring to bf16 registers, times its
    [64, NKB] block scales. Each thread takes whole scale blocks of one row (16 bytes: one
    shared load), viewed as [64, NKB, block] so that a scale multiplies its block."""
    raw = w_smem.load(raw_layout)
    raw = gl.reshape(raw, [raw.shape[0], NKB, raw.shape[1] // NKB])
    if FP4:
        w = gl.fp4_to_fp(raw, gl.bfloat16, 2)
    else:
        w = raw.to(gl.bfloat16)
    w = gl.convert_layout(w, dec_layout) * gl.expand_dims(scales, 2)
    return gl.reshape(w, [w.shape[0], w.shape[1] * w.shape[2]])


@gluon.jit
def _upcast_chain(w_bufs, t_bufs, a_bufs, ring, zero, scale_rows, row_ok, NUM_KB, it, k_steps,
                  WG: gl.constexpr, SUB: gl.constexpr, NKB: gl.constexpr, BYTES: gl.constexpr, FP4: gl.constexpr,
                  NV_SCALE: gl.constexpr, SWIZZLED: gl.constexpr, raw_layout: gl.constexpr,
                  dec_layout: gl.constexpr):
    """acc = sum_k decode(W_k) * scales_k @ T_k^T over k_steps stages of SUB 64-wide steps.

    Each step's decoded tile is stored to one of this warpgroup's two bf16 operand buffers (step
    j of a stage: buffer j) and the wgmma reads it from there, so a stage's next step is decoded
    while the previous step's wgmma runs. (A register operand cannot stay in flight: ptxas
    reuses its registers once the wgmma is issued, though the wgmma reads them until its wait.)

    The last step of every stage waits for all its wgmmas, then releases the stage: no wgmma
    is in flight across the loop's back edge. With one carried across it (a wait for all but
    one), ptxas moved the epilogue's reads of the accumulator above the wait after the loop
    (sm_90 SASS of the specialization without expert and row scales: F2FP of the accumulator
    registers before WARPGROUP.DEPBAR.LE gsb0, 0x0), so the tile's output missed 1 to 3 of
    the last step's four k16 wgmmas, differently each run (DeepSeek-V3 shapes at ~12 tokens an
    expert: 6-12% off; offline.wgmma_register_hazards finds such reads in SASS)."""
    scale_layout: gl.constexpr = gl.SliceLayout(2, dec_layout)
    acc = zero
    scales = _load_scales(scale_rows, row_ok, 0, NUM_KB, scale_layout, NKB, SWIZZLED, NV_SCALE)
    for kk in range(k_steps):
        stage = ring.wait_ready(it)
        for j in gl.static_range(SUB):
            next_scales = _load_scales(scale_rows, row_ok, kk * SUB + j + 1, NUM_KB, scale_layout, NKB, SWIZZLED,
                                       NV_SCALE)
            raw = w_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS).slice(j * BYTES, BYTES, dim=1)
            w = _decode_weights(raw, scales, raw_layout, dec_layout, NKB, FP4)
            # The buffer was last read by the wgmma two steps back (in this stage or the one
            # before), retired by a wait since.
            operand = a_bufs.index(WG * 2 + j % 2)
            operand.store(w)
            fence_async_shared()
            acc = warpgroup_mma(operand, t_bufs.index(stage * SUB + j).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0 if j == SUB - 1 else 1, deps=(acc, ))
            scales = next_scales
        ring.release(stage)
        it += 1
    return acc, it


@aggregate
class DecodeConsumer:
    """Consumer warpgroup WG: acc [64, TOK_TILE], rows its weight rows, columns the tile's
    tokens. Decoding: two threads a weight row, each taking half of the step's NKB scale blocks."""

    ring: Ring
    t_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    a_bufs: gl.shared_memory_descriptor
    out: Output
    swiglu: Swiglu
    b_scale_ptr: gl.tensor
    K: gl.tensor
    NUM_KB: gl.tensor
    KB4: gl.tensor
    WG: gl.constexpr
    SUB: gl.constexpr
    VEC: gl.constexpr
    NV_SCALE: gl.constexpr
    SWIZZLED: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ring, t_bufs, w_bufs, a_bufs, out, swiglu, b_scale_ptr, K, NUM_KB, KB4, WG, SUB, VEC, NV_SCALE,
                 SWIZZLED):
        self.ring = ring
        self.t_bufs = t_bufs
        self.w_bufs = w_bufs
        self.a_bufs = a_bufs
        self.out = out
        self.swiglu = swiglu
        self.b_scale_ptr = b_scale_ptr
        self.K = K
        self.NUM_KB = NUM_KB
        self.KB4 = KB4
        self.WG = gl.constexpr(WG)
        self.SUB = gl.constexpr(SUB)
        self.VEC = gl.constexpr(VEC)
        self.NV_SCALE = gl.constexpr(NV_SCALE)
        self.SWIZZLED = gl.constexpr(SWIZZLED)

    @gluon.jit
    def tile(self, sched, slot, tok_block, w_block, it, done):
        WG: gl.constexpr = self.WG
        TOK_TILE: gl.constexpr = sched.TOK_TILE
        W_TILE: gl.constexpr = sched.W_TILE
        BLOCK_K: gl.constexpr = self.t_bufs.shape[2]
        FP4: gl.constexpr = self.w_bufs.dtype == gl.uint8
        VEC: gl.constexpr = self.VEC
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TOK_TILE, 16])
        NKB: gl.constexpr = BLOCK_K // VEC
        BYTES: gl.constexpr = BLOCK_K // 2 if FP4 else BLOCK_K  # of a weight row per 64-wide step
        raw_layout: gl.constexpr = gl.BlockedLayout([1, BYTES // 2], [16, 2], [4, 1], [1, 0])
        dec_layout: gl.constexpr = gl.BlockedLayout([1, NKB // 2, VEC], [16, 2, 1], [4, 1, 1], [2, 1, 0])
        N = sched.N
        k_steps = gl.cdiv(self.K, BLOCK_K * self.SUB)
        zero = gl.zeros([WG_ROWS, TOK_TILE], gl.float32, acc_layout)
        tok_offsets = gl.arange(0, TOK_TILE, layout=gl.SliceLayout(0, acc_layout))
        w_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
        w_offsets_op = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, dec_layout)))
        toks = slot.s + tok_block * TOK_TILE + tok_offsets
        tok_mask = toks < slot.t
        ns_op = w_block * W_TILE + w_offsets_op
        scale_rows = self.b_scale_ptr + scale_row_offsets(slot.e, ns_op, N, self.NUM_KB, self.KB4, self.SWIZZLED)
        acc, it = _upcast_chain(self.w_bufs, self.t_bufs, self.a_bufs, self.ring, zero, scale_rows, ns_op < N,
                                self.NUM_KB, it, k_steps, WG, self.SUB, NKB, BYTES, FP4, self.NV_SCALE, self.SWIZZLED,
                                raw_layout, dec_layout)
        if self.swiglu.ACT != 0:
            self.swiglu.store(acc, self.out, slot, slot.s + tok_block * TOK_TILE, w_block * W_TILE + WG * WG_ROWS, N,
                              True)
        else:
            self.out.store_swapped_tile(acc, slot.e, toks, tok_mask, w_block * W_TILE + w_offsets, N, 0, 0, slot.t)
        return it


@gluon.jit
def _consume(consumer, sched):
    walk(sched, consumer)


@gluon.jit
def decode_kernel(t_desc, w_desc, out_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr, expert_scales_ptr,
                  row_scales_ptr, M, N, K, E, G, NUM_KB, KB4, epi, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                  VEC: gl.constexpr, NV_SCALE: gl.constexpr, SWIZZLED: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
                  HAS_ROW_SCALES: gl.constexpr, CONSUMER_REGS: gl.constexpr, EPI: gl.constexpr):
    """t_desc: bf16 token tiles [TOK_TILE, BLOCK_K] of the decoded A; w_desc: raw weight tiles
    [128, SUB * BLOCK_K bytes (fp8) or SUB * BLOCK_K / 2 (packed fp4)] of B viewed as [E*N, K or
    K/2]: SUB token tiles and one weight tile fill a ring stage. b_scale_ptr: the weight scales
    (e8m0, or e4m3 for nvfp4: NV_SCALE), plain or SWIZZLED, VEC K elements each. epi, EPI: the
    fused epilogue (Swiglu.create)."""
    TOK_TILE: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = t_desc.block_type.shape[1]
    W_TILE: gl.constexpr = w_desc.block_type.shape[0]
    FP4: gl.constexpr = w_desc.dtype == gl.uint8
    # 64-wide K steps per ring stage: a stage carries w_desc's bytes of each weight row.
    SUB: gl.constexpr = w_desc.block_type.shape[1] // (BLOCK_K // 2 if FP4 else BLOCK_K)
    gl.static_assert(W_TILE == 2 * WG_ROWS, "two warpgroups of 64 weight rows")
    t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES * SUB] + t_desc.block_type.shape, t_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    # Two bf16 operand buffers per consumer warpgroup for its decoded weights (_upcast_chain).
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [4, WG_ROWS, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([WG_ROWS, BLOCK_K], gl.bfloat16))
    ring = Ring.create(STAGES, 2)
    sched = Schedule.create(a_offsets_ptr, expert_ids_ptr, M, N, E, G, a_offsets_ptr, 0, TOK_TILE, W_TILE, GROUP_M,
                            2)
    out = Output(out_ptr, expert_scales_ptr, row_scales_ptr, HAS_EXPERT_SCALES, HAS_ROW_SCALES)
    swiglu = Swiglu.create(epi, EPI)
    K = gl.to_tensor(K)
    NUM_KB = gl.to_tensor(NUM_KB)
    KB4 = gl.to_tensor(KB4)
    consumer0 = DecodeConsumer(ring, t_bufs, w_bufs, a_bufs, out, swiglu, b_scale_ptr, K, NUM_KB, KB4, 0, SUB, VEC,
                               NV_SCALE, SWIZZLED)
    consumer1 = DecodeConsumer(ring, t_bufs, w_bufs, a_bufs, out, swiglu, b_scale_ptr, K, NUM_KB, KB4, 1, SUB, VEC,
                               NV_SCALE, SWIZZLED)
    producer = Producer.create(ring, t_desc, w_desc, t_bufs, w_bufs, K, SUB)
    # ptxas pipelines the wgmmas only if the SMALLEST setmaxnreg in the kernel leaves room for
    # the loop (about accumulator + 64 registers); with the producer at 40 it serialized every
    # HGMMA (C7512). Producer 120, consumers 192 each (the default partition gets the rest).
    gl.warp_specialize([(_consume, (consumer0, sched)), (_consume, (consumer1, sched)), (produce, (producer, sched))],
                       [4, 1], [CONSUMER_REGS, 120])
