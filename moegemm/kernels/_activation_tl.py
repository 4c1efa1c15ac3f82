"""Row quantizer with an optional gated activation in front, in portable Triton (tl).

One kernel serves three steps of an MoE layer:
    gather + quantize   rows of x picked by `src_rows` (the routing permutation), quantized
                        into the A operand of a format (the gate/up product's input)
    activation          SwiGLU of a gate/up product (gate and up interleaved: columns 2j and
                        2j+1, or concatenated: j and I+j), optionally plus an expert bias
    requantize          its output quantized into the A operand of the down product

Like _portable_tl.py this file is executed twice (compiled and interpreted), so it calls no
@triton.jit function of Triton's standard library (tl.max, tl.sigmoid, ...), only builtins
and the helpers below. Every encoder works on integer bits, so the interpreter and the GPU
produce the same bytes as moegemm.quantize (SPEC section 2), which the tests check bit for bit.

Program (i, j) takes rows [i*BLOCK_M, (i+1)*BLOCK_M) and output columns
[j*CHUNK, (j+1)*CHUNK), CHUNK = NB scale blocks of VEC columns.
"""

import triton
import triton.language as tl

ACT_NONE = tl.constexpr(0)
ACT_SWIGLU = tl.constexpr(1)  # silu(gate) * up
ACT_SWIGLU_OAI = tl.constexpr(2)  # gpt-oss: clamped, gate * sigmoid(alpha * gate) * (up + 1)

OUT_BF16 = tl.constexpr(0)
OUT_FP8_BLOCK = tl.constexpr(1)  # e4m3, fp32 scale amax / 448 per 1x128
OUT_E4M3_E8M0 = tl.constexpr(2)  # mxfp8 and w4a8 activations: e4m3, e8m0 per 32
OUT_E2M1_E8M0 = tl.constexpr(3)  # mxfp4: e2m1, e8m0 per 32
OUT_E2M1_E4M3 = tl.constexpr(4)  # nvfp4: e2m1, e4m3 per 16 times a global fp32


@triton.jit
def _f32_from_bits(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in [-127, 127] (2^-127 is a subnormal)."""
    return _f32_from_bits(tl.where(e >= -126, (e + 127) << 23, 0x00400000))


@triton.jit
def _max_abs(a, b):
    return tl.maximum(a, b)


@triton.jit
def _to_bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _encode_e4m3(x):
    """fp32 -> e4m3fn bits (int32): round to nearest even, saturating to +-448, NaN -> 0x7F."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = tl.abs(x)
    # Normal range: keep 3 mantissa bits of the fp32 pattern, rounding the 20 dropped bits.
    mbits = bits & 0x7FFFFFFF
    normal = ((mbits + 0x7FFFF + ((mbits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals (|x| < 2^-6): man * 2^-9, man rounded to nearest even by the 2^23 trick.
    sub = ((mag * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < 0.015625, sub, normal)
    code = tl.minimum(code, 0x7E)
    code = tl.where(x != x, 0x7F, code)
    return code | sign


@triton.jit
def _decode_e4m3(code):
    mag = code & 0x7F
    exp = mag >> 3
    man = mag & 7
    normal = _f32_from_bits(((exp + 120) << 23) | (man << 20))
    val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
    return tl.where(code >= 0x80, -val, val)


@triton.jit
def _encode_e2m1(x):
    """fp32 -> e2m1 code (int32 0..15): nearest, ties to the even code, saturating at 6."""
    mag = tl.abs(x)
    code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32))
    return code | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e8m0_exponent(amax, MAX_FINITE: tl.constexpr):
    """The smallest e with 2^e * MAX_FINITE >= amax, clamped to [-127, 127].

    A first guess from the rounded quotient, then corrected by exact comparisons:
    2^e * MAX_FINITE is exact in fp32 (448 and 6 have 3 and 2 significant bits).
    """
    ratio = tl.math.div_rn(amax, MAX_FINITE)
    bits = ratio.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.maximum(tl.minimum(e, 127), -127)
    e = tl.where((e > -127) & (_pow2(tl.maximum(e - 1, -127)) * MAX_FINITE >= amax), e - 1, e)
    e = tl.where((e < 127) & (_pow2(e) * MAX_FINITE < amax), e + 1, e)
    return e


@triton.jit
def _group_of_rows(rows, a_offsets_ptr, G, LOG_G: tl.constexpr):
    """Slot g with a_offsets[g] <= row < a_offsets[g+1] (binary search), and whether one exists."""
    lo = rows * 0
    hi = lo + G
    for _ in tl.static_range(LOG_G):
        mid = (lo + hi + 1) // 2
        start = tl.load(a_offsets_ptr + mid)
        go_up = start <= rows
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    end = tl.load(a_offsets_ptr + lo + 1, mask=lo < G, other=0)
    inside = (tl.load(a_offsets_ptr + lo) <= rows) & (rows < end) & (lo < G)
    return lo, inside


@triton.jit
def _load_activated(x_ptr, src_rows, row_mask, cols, col_mask, X_STRIDE, K_OUT, bias_ptr, row_expert, bias_rows,
                    alpha, limit, ACT: tl.constexpr, CONCAT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[r, c] for rows src_rows and output columns cols (3-D tiles that broadcast), in fp32;
    the bias of expert row_expert is added where bias_rows holds."""
    mask = row_mask & col_mask
    bias_mask = mask & bias_rows
    base = x_ptr + src_rows * X_STRIDE
    if ACT == ACT_NONE:
        y = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + row_expert * K_OUT + cols, mask=bias_mask, other=0.0).to(tl.float32)
    else:
        bias_row = bias_ptr + row_expert * (2 * K_OUT)
        if CONCAT:
            gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(base + cols + K_OUT, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                gate += tl.load(bias_row + cols, mask=bias_mask, other=0.0).to(tl.float32)
                up += tl.load(bias_row + cols + K_OUT, mask=bias_mask, other=0.0).to(tl.float32)
        else:
            # Interleaved: load each (gate_j, up_j) pair as one contiguous [.., 2] piece and
            # split it in registers; two stride-2 loads would not vectorize (measured ~5x slower).
            pair = 2 * cols[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
            both = tl.load(base[:, :, :, None] + pair, mask=mask[:, :, :, None], other=0.0).to(tl.float32)
            if HAS_BIAS:
                both += tl.load(bias_row[:, :, :, None] + pair, mask=bias_mask[:, :, :, None],
                                other=0.0).to(tl.float32)
            gate, up = tl.split(both)
        if ACT == ACT_SWIGLU:
            y = gate / (1.0 + tl.exp(-gate)) * up
        else:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            y = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
        y = tl.where(mask, y, 0.0)
    return y


@triton.jit
def activation_quantize_kernel(
    x_ptr, src_rows_ptr, bias_ptr, expert_ids_ptr, a_offsets_ptr, a_scale_offsets_ptr, global_ptr,
    out_ptr, out_scale_ptr,
    M, X_ROWS, X_STRIDE, K_OUT, G, NUM_KB, KB4, NUM_SCALE_ROWS, alpha, limit,
    ACT: tl.constexpr, CONCAT: tl.constexpr, OUT: tl.constexpr, SWIZZLED: tl.constexpr,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, LOG_G: tl.constexpr,
    BLOCK_M: tl.constexpr, NB: tl.constexpr, VEC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    if GATHER:
        src = tl.load(src_rows_ptr + rows, mask=row_mask, other=0)
        row_mask = row_mask & (src >= 0) & (src < X_ROWS)
    else:
        src = rows
    src = src.to(tl.int64)
    if HAS_BIAS or SWIZZLED:
        slot, in_slot = _group_of_rows(rows, a_offsets_ptr, G, LOG_G)
    if HAS_BIAS:
        row_expert = tl.load(expert_ids_ptr + slot, mask=row_mask & in_slot, other=-1)
        bias_rows = in_slot & (row_expert >= 0)
        row_expert = tl.maximum(row_expert, 0).to(tl.int64)
    else:
        row_expert = rows * 0
        bias_rows = row_mask

    blk = tl.arange(0, NB)
    vec = tl.arange(0, VEC)
    cols3 = pid_c * (NB * VEC) + blk[None, :, None] * VEC + vec[None, None, :]  # [1, NB, VEC]
    col_mask3 = cols3 < K_OUT
    rows3 = rows[:, None, None]
    y = _load_activated(x_ptr, src[:, None, None], row_mask[:, None, None], cols3, col_mask3, X_STRIDE, K_OUT,
                        bias_ptr, row_expert[:, None, None], bias_rows[:, None, None], alpha, limit, ACT, CONCAT,
                        HAS_BIAS)
    out_mask3 = (rows3 < M) & col_mask3
    out_rows3 = rows3.to(tl.int64) * K_OUT
    if OUT == OUT_BF16:
        tl.store(out_ptr + out_rows3 + cols3, _to_bf16_rne(y), mask=out_mask3)
    else:
        amax = tl.reduce(tl.abs(y), 2, _max_abs)  # [BLOCK_M, NB]
        if OUT == OUT_FP8_BLOCK:
            scale = tl.math.div_rn(amax, 448.0)
            denom = scale[:, :, None]
            scaled = tl.where(denom > 0, tl.math.div_rn(y, denom), 0.0)
            stored = scale
        elif OUT == OUT_E2M1_E4M3:
            g = tl.load(global_ptr)
            stored = _encode_e4m3(tl.math.div_rn(amax, g * 6.0))
            denom = (_decode_e4m3(stored) * g)[:, :, None]
            scaled = tl.where(denom > 0, tl.math.div_rn(y, denom), 0.0)
        else:
            e = _e8m0_exponent(amax, 448.0 if OUT == OUT_E4M3_E8M0 else 6.0)
            scaled = y * _pow2(-e)[:, :, None]
            stored = tl.where(amax == amax, e + 127, 255)  # NaN amax -> the NaN scale
        if OUT == OUT_FP8_BLOCK or OUT == OUT_E4M3_E8M0:
            tl.store(out_ptr + out_rows3 + cols3, _encode_e4m3(scaled).to(tl.uint8), mask=out_mask3)
        else:
            codes = tl.reshape(_encode_e2m1(scaled), [BLOCK_M, NB, VEC // 2, 2])
            low, high = tl.split(codes)
            packed = (low | (high << 4)).to(tl.uint8)
            half = pid_c * (NB * VEC // 2) + blk[None, :, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, None, :]
            tl.store(out_ptr + rows3.to(tl.int64) * (K_OUT // 2) + half, packed,
                     mask=(rows3 < M) & (half < K_OUT // 2))
        kb = pid_c * NB + blk[None, :]  # [1, NB]
        kb_mask = (rows[:, None] < M) & (kb < NUM_KB)
        if SWIZZLED:
            start = tl.load(a_offsets_ptr + slot, mask=in_slot, other=0)
            block0 = tl.load(a_scale_offsets_ptr + slot, mask=in_slot, other=0) + start // 128
            srow = (128 * block0 + rows - start).to(tl.int64)[:, None]
            offset = ((srow // 128) * KB4 + kb // 4) * 512 + (srow % 32) * 16 + ((srow % 128) // 32) * 4 + kb % 4
            kb_mask = kb_mask & in_slot[:, None] & (srow >= 0) & (srow < NUM_SCALE_ROWS)
        else:
            offset = rows.to(tl.int64)[:, None] * NUM_KB + kb
        if OUT == OUT_FP8_BLOCK:
            tl.store(out_scale_ptr + offset, stored, mask=kb_mask)
        else:
            tl.store(out_scale_ptr + offset, stored.to(tl.uint8), mask=kb_mask)
