"""Hopper (sm_90) grouped matmul for the block formats `mxfp8`, `mxfp4`, `nvfp4` and `w4a8`.

Hopper has no block-scaled tensor-core instruction. Every 32- (nvfp4: 16-) wide K block
carries a scale per weight row AND one per token, so the exact math is either fp8 wgmma per
k32 followed by an fp32 promotion with the outer product of the two scale vectors (2 FP32
ops per output element per k32: the FP32 pipe then caps the run at the dense bf16 rate),
or bf16 wgmma on operands decoded with their scales folded in, which is exact: e4m3 or e2m1
times a power of two, and e2m1 times an e4m3 scale, have at most 5 significant bits. This
kernel does the latter (docs/design.md records the measurements):

    tokens   decoded once per call by a tl pre-pass (portable.dequantize_rows) into a bf16
             [M, K] buffer, TMA-loaded as the wgmma B operand (the narrow N side)
    weights  TMA-loaded COMPRESSED (1 byte or half a byte per element) into the ring, 128
             bytes of each weight row per stage at decode (SUB = 2 steps of 64 K; 128-token tiles one step,
             config._sm90_mx_config says why: one step, 32 or 64
             bytes a row, took the same ~0.7 us per stage whatever its bytes, H100); each
             consumer warpgroup decodes its 64 weight rows times the block scales (gathered
             from global memory, plain or swizzled layout, one step ahead) into a bf16
             shared-memory operand, two buffers a warpgroup

so the weights cross HBM once, compressed: what decode (few tokens per expert) is bound by.
Tiles are always "swapped": 128 weight rows (two warpgroups of 64) x TOK_TILE tokens
(config.sm90_mx_config: one group's tokens at decode, 128 in prefill). Producer, barriers,
schedule and the masked epilogue are those of kernels/sm90.py.

Steady state of one consumer (stage s = it % STAGES, steps j < SUB of it):
    wait ready[s]
    per step: load the scales of the next step; w = decode(weights[s] rows, step j) * scales
              store w to operand buffer j; acc = wgmma(buffer, tokens[s, j]^T, acc)
              wait until one wgmma is left in flight (the stage's next decode overlaps it),
              or, after the stage's last step, until none is (_upcast_chain says why)
    arrive empty[s]
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import layouts
from ..config import MX_FORMATS, sm90_mx_config, weight_bytes, with_epilogue_scratch
from ..token_forms import KernelTokens, kb_major_columns, token_form
from ..validation import GroupedProblem
from . import portable
from .sm90_epilogue import epilogue_args, fused_epilogue
from .sm90 import WG_ROWS, _band_coords, _epilogue, _layout, _load_partition, _slot, _sm_count


@gluon.jit
def _scale_row_offsets(e, ns, N, NUM_KB, KB4, SWIZZLED: gl.constexpr):
    """Offset of the scale (e, n, kb=0) of weight rows ns; plain [E, N, NUM_KB], swizzled
    [E, ceil(N/128), KB4, 32, 4, 4] (layouts.py)."""
    if SWIZZLED:
        n_blocks = (N + 127) // 128
        return (e * n_blocks + ns // 128).to(gl.int64) * (KB4 * 512) + (ns % 32) * 16 + ((ns % 128) // 32) * 4
    else:
        return (e * N + ns).to(gl.int64) * NUM_KB


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
def _upcast_chain(w_bufs, t_bufs, a_bufs, ready, empty, zero, scale_rows, row_ok, NUM_KB, it, k_steps,
                  WG: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, NKB: gl.constexpr,
                  BYTES: gl.constexpr, FP4: gl.constexpr, NV_SCALE: gl.constexpr, SWIZZLED: gl.constexpr,
                  raw_layout: gl.constexpr, dec_layout: gl.constexpr):
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
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
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
        mbarrier.arrive(empty.index(stage), count=1)
        it += 1
    return acc, it


@gluon.jit
def _mx_consumer_partition(t_bufs, w_bufs, a_bufs, ready, empty, out_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                           expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4, epi,
                           WG: gl.constexpr, TOK_TILE: gl.constexpr, W_TILE: gl.constexpr, BLOCK_K: gl.constexpr,
                           SUB: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, VEC: gl.constexpr, FP4: gl.constexpr,
                           NV_SCALE: gl.constexpr, SWIZZLED: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
                           HAS_ROW_SCALES: gl.constexpr, EPI: gl.constexpr):
    # acc [64, TOK_TILE]: rows are this warpgroup's weight rows, columns the tile's tokens.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, TOK_TILE, 16])
    # Decoding: two threads a weight row, each taking half of the step's NKB scale blocks.
    NKB: gl.constexpr = BLOCK_K // VEC
    BYTES: gl.constexpr = BLOCK_K // 2 if FP4 else BLOCK_K  # of a weight row per 64-wide step
    raw_layout: gl.constexpr = gl.BlockedLayout([1, BYTES // 2], [16, 2], [4, 1], [1, 0])
    dec_layout: gl.constexpr = gl.BlockedLayout([1, NKB // 2, VEC], [16, 2, 1], [4, 1, 1], [2, 1, 0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    w_tiles = gl.cdiv(N, W_TILE)
    k_steps = gl.cdiv(K, BLOCK_K * SUB)
    zero = gl.zeros([WG_ROWS, TOK_TILE], gl.float32, acc_layout)
    tok_offsets = gl.arange(0, TOK_TILE, layout=gl.SliceLayout(0, acc_layout))
    w_offsets = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
    w_offsets_op = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, dec_layout)))
    it = 0
    tile_base = 0
    next_tile = pid  # this program's next tile: the first index >= tile_base it owns
    for g in range(G):
        s, t, e, tok_tiles = _slot(a_offsets_ptr, expert_ids_ptr, g, M, E, TOK_TILE)
        group_tiles = tok_tiles * w_tiles
        while next_tile < tile_base + group_tiles:  # (sm90._load_partition says why not a for)
            tile = next_tile
            next_tile += nprog
            tok_block, w_block = _band_coords(tile - tile_base, tok_tiles, w_tiles, GROUP_M)
            toks = s + tok_block * TOK_TILE + tok_offsets
            tok_mask = toks < t
            ns_op = w_block * W_TILE + w_offsets_op
            scale_rows = b_scale_ptr + _scale_row_offsets(e, ns_op, N, NUM_KB, KB4, SWIZZLED)
            acc, it = _upcast_chain(w_bufs, t_bufs, a_bufs, ready, empty, zero, scale_rows, ns_op < N, NUM_KB, it,
                                    k_steps, WG, STAGES, SUB, NKB, BYTES, FP4, NV_SCALE, SWIZZLED, raw_layout,
                                    dec_layout)
            if EPI[0] != 0:  # the fused SwiGLU epilogue
                fused_epilogue(acc, out_ptr, expert_scales_ptr, g, s, e, s + tok_block * TOK_TILE, t,
                               w_block * W_TILE + WG * WG_ROWS, N, epi, True, HAS_EXPERT_SCALES, EPI)
            else:
                # Swapped tiles are stored with masks (the TMA-store arguments are unused).
                _epilogue(acc, None, None, out_ptr, expert_scales_ptr, row_scales_ptr, e, toks, tok_mask,
                          w_block * W_TILE + w_offsets, N, 0, 0, t, True, HAS_EXPERT_SCALES, HAS_ROW_SCALES, 0, 1)
        tile_base += group_tiles


@gluon.jit
def grouped_matmul_sm90_mx_kernel(t_desc, w_desc, out_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                  expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4, epi,
                                  STAGES: gl.constexpr, GROUP_M: gl.constexpr, VEC: gl.constexpr,
                                  NV_SCALE: gl.constexpr, SWIZZLED: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr,
                                  HAS_ROW_SCALES: gl.constexpr, CONSUMER_REGS: gl.constexpr, EPI: gl.constexpr):
    """See the module docstring. t_desc: bf16 token tiles [TOK_TILE, BLOCK_K] of the decoded A;
    w_desc: raw weight tiles [128, SUB * BLOCK_K bytes (fp8) or SUB * BLOCK_K / 2 (packed fp4)]
    of B viewed as [E*N, K or K/2]: SUB token tiles and one weight tile fill a ring stage."""
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
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_mx_consumer_partition, (t_bufs, w_bufs, a_bufs, ready, empty, out_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                  expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4, epi, 0, TOK_TILE,
                                  W_TILE, BLOCK_K, SUB, STAGES, GROUP_M, VEC, FP4, NV_SCALE, SWIZZLED,
                                  HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI)),
        (_mx_consumer_partition, (t_bufs, w_bufs, a_bufs, ready, empty, out_ptr, b_scale_ptr, a_offsets_ptr, expert_ids_ptr,
                                  expert_scales_ptr, row_scales_ptr, M, N, K, E, G, NUM_KB, KB4, epi, 1, TOK_TILE,
                                  W_TILE, BLOCK_K, SUB, STAGES, GROUP_M, VEC, FP4, NV_SCALE, SWIZZLED,
                                  HAS_EXPERT_SCALES, HAS_ROW_SCALES, EPI)),
        (_load_partition, (t_desc, w_desc, t_bufs, w_bufs, ready, empty, a_offsets_ptr, expert_ids_ptr,
                           M, N, K, E, G, TOK_TILE, W_TILE, BLOCK_K, STAGES, GROUP_M, SUB)),
    # ptxas pipelines the wgmmas only if the SMALLEST setmaxnreg in the kernel leaves room for
    # the loop (about accumulator + 64 registers); with the producer at 40 it serialized every
    # HGMMA (C7512). Producer 120, consumers 192 each (the default partition gets the rest).
    ], [4, 1], [CONSUMER_REGS, 120])


def check_kernel_tokens(p: GroupedProblem, tokens: KernelTokens):
    """ValueError unless `tokens` are in the form this problem's kernel reads, with its shapes."""
    form = token_form(p.fmt.name, p.n, p.k, p.m, p.num_groups)
    if tokens.form != form:
        raise ValueError(f"tokens: the kernel of this problem reads the form {form}, got {tokens.form}")
    dtype = torch.bfloat16 if form.kind == "bf16" else torch.float8_e4m3fn
    if tokens.data.dtype != dtype or tuple(tokens.data.shape) != (p.m, p.k) or not tokens.data.is_contiguous():
        raise ValueError(f"tokens: expected contiguous {dtype} data [{p.m}, {p.k}], got {tokens.data.dtype} "
                         f"{tuple(tokens.data.shape)}")
    if form.kind == "e4m3":
        columns = kb_major_columns(p.m, p.num_groups, form.column_block)
        scales = tokens.scales
        if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != (p.num_k_scales, columns):
            raise ValueError(f"tokens: expected fp32 scales [{p.num_k_scales}, {columns}], got "
                             f"{None if scales is None else (scales.dtype, tuple(scales.shape))}")


def supports(p: GroupedProblem) -> bool:
    """Rows of the (packed) weights must be 16-byte aligned for TMA: K % 32 == 0. K = 0 streams
    nothing (the e2m1 chain runs its last stage outside its loop): the portable kernel writes
    the zeros."""
    return p.fmt.name in MX_FORMATS and p.k % 32 == 0 and p.k > 0


def launch(p: GroupedProblem, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets, expert_scales,
           row_scales, out, epilogue: dict | None = None, tokens: KernelTokens | None = None):
    """Decode the tokens (pre-pass), then launch the kernel into `out`; no device value is read.
    `epilogue` (sm90_epilogue.launch_fused) switches on the fused SwiGLU epilogue. Configs with
    fp8_mma go to kernels/sm90_mxfp8.py instead (config.sm90_mx_config picks it for mxfp8 in
    every regime, for mxfp4 and w4a8 at up to 12 tokens a slot; a forced decoding config still
    runs here). `tokens`: A already in the form the kernel reads (token_forms.py, written by
    the layer's gather or activation kernel): no pre-pass, and a / a_scales are not read."""
    if p.num_groups == 0 or p.m == 0 or p.n == 0:
        return out
    if tokens is not None:
        check_kernel_tokens(p, tokens)
    swizzled = p.scale_layout == "swizzled"
    if swizzled and a_scale_offsets is None and tokens is None:  # (only the token pre-passes read them)
        a_scale_offsets = layouts.a_scale_offsets(a_offsets)
    cfg = sm90_mx_config(p.fmt, p.n, p.k, p.m / p.num_groups)
    if cfg.fp8_mma:  # fp8 wgmma and promotion (kernels/sm90_mxfp8.py): mxfp8, and e2m1 weights at decode
        from . import sm90_mxfp8  # (it imports this module's scale addressing)

        if epilogue is not None:
            cfg = with_epilogue_scratch(cfg, 1, 2, weight_bytes(p.fmt))
        return sm90_mxfp8.launch(p, cfg, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets,
                                 expert_scales, row_scales, out, epilogue, tokens)
    if epilogue is not None:
        cfg = with_epilogue_scratch(cfg, 2, 2, weight_bytes(p.fmt))
    if tokens is not None:
        decoded = tokens.data
    else:
        decoded = portable.dequantize_rows(p, a, a_scales, a_offsets, expert_ids, a_scale_offsets)
    upper_tiles = (math.ceil(p.m / cfg.token_tile) + p.num_groups) * math.ceil(p.n / cfg.weight_tile)
    num_programs = min(_sm_count(out.device), upper_tiles)
    t_block = (cfg.token_tile, cfg.block_k)
    t_desc = TensorDescriptor.from_tensor(decoded, list(t_block), _layout(t_block, torch.bfloat16))
    fp4 = p.fmt.b.element.packed
    weights = b.view(torch.uint8) if fp4 else b
    stored_k = weights.shape[-1]
    w_block = (cfg.weight_tile, int(cfg.stage_k * weight_bytes(p.fmt)))
    w_desc = TensorDescriptor.from_tensor(weights.reshape(p.num_experts * p.n, stored_k), list(w_block),
                                          _layout(w_block, weights.dtype))
    num_kb = p.num_k_scales
    dummy = a_offsets
    epi, epi_consts = epilogue_args(epilogue, dummy)
    grouped_matmul_sm90_mx_kernel[(num_programs, )](
        t_desc, w_desc, out, b_scales.view(torch.uint8), a_offsets, expert_ids,
        expert_scales if expert_scales is not None else dummy, row_scales if row_scales is not None else dummy,
        p.m, p.n, p.k, p.num_experts, p.num_groups, num_kb, math.ceil(num_kb / 4), epi,
        EPI=epi_consts, STAGES=cfg.stages, GROUP_M=cfg.group_m, VEC=p.fmt.scale_vec, NV_SCALE=p.fmt.b.scale == "e4m3",
        SWIZZLED=swizzled, HAS_EXPERT_SCALES=expert_scales is not None, HAS_ROW_SCALES=row_scales is not None,
        CONSUMER_REGS=cfg.consumer_regs, num_warps=4,
    )
    return out
