"""Row quantizer with an optional gated activation in front, in portable Triton (tl).

One kernel serves three steps of an MoE layer:
    gather + quantize   rows of x picked by `src_rows` (the routing permutation), quantized
                        into the A operand of a format (the gate/up product's input)
    activation          SwiGLU of a gate/up product (gate and up interleaved: columns 2j and
                        2j+1, or concatenated: j and I+j), optionally plus an expert bias
    requantize          its output quantized into the A operand of the down product

Like _portable_tl.py this file is executed twice (compiled and interpreted), so it calls no
@triton.jit function of Triton's standard library (tl.max, tl.sigmoid, ...), only builtins,
the helpers below and those of the files it loads beside it for the same mode: the quotients of
_quotients_tl.py, the codecs of _codecs_tl.py, which produce the bytes of moegemm.quantize in
either mode (docs/contract.md section 3; the tests check them bit for bit), and _portable_tl.py's
kb_major_column. Where the hardware gives the same result in fewer instructions the compiled
build takes it and the interpreter keeps the arithmetic that defines it (tl_source.interpreted):
e4m3 conversions, and the divisions of fp8_block and nvfp4 with nvfp4's |y| and bf16 halves
(_quotients_tl.py; the kernels are instruction-bound, bench/quantize_sass.py counts them).

Program (i, j) takes rows [i*BLOCK_M, (i+1)*BLOCK_M) and output columns
[j*CHUNK, (j+1)*CHUNK), CHUNK = NB scale blocks of VEC columns.
"""

import triton
import triton.language as tl

from moegemm.kernels import tl_source

codecs = tl_source.load_beside(__file__, "_codecs_tl.py")
_portable = tl_source.load_beside(__file__, "_portable_tl.py")  # (kb_major_column)
quotients = tl_source.load_beside(__file__, "_quotients_tl.py")

ACT_NONE = tl.constexpr(0)
ACT_SWIGLU = tl.constexpr(1)  # silu(gate) * up
ACT_SWIGLU_OAI = tl.constexpr(2)  # gpt-oss: clamped, gate * sigmoid(alpha * gate) * (up + 1)

OUT_BF16 = tl.constexpr(0)
OUT_FP8_BLOCK = tl.constexpr(1)  # e4m3, fp32 scale amax / 448 per 1x128
OUT_E4M3_E8M0 = tl.constexpr(2)  # mxfp8 and w4a8 activations: e4m3, e8m0 per 32
OUT_E2M1_E8M0 = tl.constexpr(3)  # mxfp4: e2m1, e8m0 per 32
OUT_E2M1_E4M3 = tl.constexpr(4)  # nvfp4: e2m1, e4m3 per 16 times a global fp32

# What is written for the e8m0 formats (OUT_E4M3_E8M0, OUT_E2M1_E8M0): the format's A operand, or
# the tokens in the form the sm90 kernel of the next product reads (kernels/sm90/decode.py,
# KernelTokens), so that it runs no pre-pass of its own.
FORM_OPERAND = tl.constexpr(0)
FORM_E4M3 = tl.constexpr(1)  # e4m3 bytes (e2m1 values times 2^EXP), fp32 scales K-block-major
FORM_BF16 = tl.constexpr(2)  # the dequantized values in bf16, no scales


@triton.jit
def _max_abs(a, b):
    # NaN kept, as torch's amax keeps it: a block holding a NaN gets the NaN scale (max.NaN.f32,
    # one instruction as the plain max, which would drop it).
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _silu(gate, alpha):
    """gate * sigmoid(alpha * gate) as gate / (1 + exp(-alpha * gate)), with no exp overflowing
    (88.72 < ln(fp32 max)): past it the result is gate / inf's, -0 for a finite gate and NaN
    for -inf."""
    t = -alpha * gate
    overflowed = tl.where(t < float("inf"), -0.0, float("nan"))
    return tl.where(t > 88.72, overflowed, gate / (1.0 + tl.exp(tl.minimum(t, 88.72))))




@triton.jit
def _sign_where(y, denom, SIGN: tl.constexpr):
    """y's sign bit moved to bit SIGN (31 or 3) where its block's denom > 0, else 0 (the
    reference's +0 for a block of zero denom), as int32 ([BM, NB, VEC] from y and [BM, NB])."""
    bits = y.to(tl.int32, bitcast=True)
    mask = tl.where(denom > 0, 1 << SIGN, 0)[:, :, None]
    if SIGN == 31:
        return bits & mask
    return (bits >> (31 - SIGN)) & mask


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
                    alpha, limit, ACT: tl.constexpr, CONCAT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    PAIR_WORDS: tl.constexpr):
    """y[r, c] for rows src_rows and output columns cols (3-D tiles that broadcast), in fp32;
    the bias of expert row_expert is added where bias_rows holds. PAIR_WORDS: interleaved bf16
    x viewed as int32, word j of a row holding (gate_j, up_j), gate in the low half."""
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
        elif PAIR_WORDS:
            # One 32-bit word a pair, so the loads vectorize as the concatenated layout's do (the
            # [.., 2] pieces below run 2.3x slower than concat); bf16 -> fp32 is a 16-bit shift.
            words = tl.load(base + cols, mask=mask, other=0)
            gate = codecs.f32_from_bits(words << 16)
            up = codecs.f32_from_bits(words & -65536)  # (0xFFFF0000)
            if HAS_BIAS:
                pair = 2 * cols[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
                bias_gate, bias_up = tl.split(tl.load(bias_row[:, :, :, None] + pair, mask=bias_mask[:, :, :, None],
                                                      other=0.0).to(tl.float32))
                gate += bias_gate
                up += bias_up
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
            y = _silu(gate, 1.0) * up
        else:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            y = _silu(gate, alpha) * (up + 1.0)
        y = tl.where(mask, y, 0.0)
    return y


@triton.jit
def activation_quantize_kernel(
    x_ptr, src_rows_ptr, bias_ptr, expert_ids_ptr, a_offsets_ptr, a_scale_offsets_ptr, global_ptr,
    out_ptr, out_scale_ptr, scale_bytes_ptr,
    M, X_ROWS, X_STRIDE, K_OUT, G, NUM_KB, KB4, NUM_SCALE_ROWS, M_PAD, alpha, limit,
    ACT: tl.constexpr, CONCAT: tl.constexpr, OUT: tl.constexpr, SWIZZLED: tl.constexpr,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, LOG_G: tl.constexpr,
    BLOCK_M: tl.constexpr, NB: tl.constexpr, VEC: tl.constexpr,
    FORM: tl.constexpr = 0, EXP: tl.constexpr = 0, EVEN_ODD: tl.constexpr = False, TOPK: tl.constexpr = 0,
    PAIR_WORDS: tl.constexpr = False, TOPK_P2: tl.constexpr = 1, COLUMN_BLOCK: tl.constexpr = 4,
):
    """Rows of x (gathered through src_rows), activated, quantized into out/out_scale.

    FORM (e8m0 formats only; module header): FORM_E4M3 writes e4m3 bytes, e2m1 values as
    their e4m3 code times 2^EXP, each group of 8 elements of K in the order 0 2 4 6 1 3 5 7
    with EVEN_ODD, and the scales as fp32 2^e at [kb, kb_major_column(m - s, s, g, COLUMN_BLOCK)]
    of a [NUM_KB, M_PAD] buffer (slot g starts at row s), which is tokens.decode_row_scales'
    kb_major layout; FORM_BF16 writes bf16(value * 2^e), which is tokens.dequantize_rows'.
    Rows outside slots get no scales in FORM_E4M3, as in the swizzled layout.

    TOPK > 0 (no activation): the gather in scatter form. Program rows are the X_ROWS tokens, each
    read and quantized once, and stored to the TOPK grouped rows src_rows[token * TOPK + j] (the
    routing plan's grouped_row; M grouped rows), row p in slot expert_ids[p] (the plan's
    expert_of_row): the same bytes as the gather through the inverse permutation, with 1/TOPK of
    its reads and encoding work. A row outside its slot (a dropped choice) is not stored. In a
    kernel form the scales go as e8m0 bytes to scale_bytes [M, NUM_KB] (row-major), and
    kb_major_scales_kernel then writes out_scale from them; the operand form stores its scales
    itself, in either layout."""
    # Column tiles on the grid's first axis, so that the programs that run together read whole
    # rows of x and write whole rows of the output and of its plain scales (a 32-byte sector of
    # scales spans 8 column tiles), not one column stripe down all the rows. Row tiles on the
    # second and third axes (65535 at most each).
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    if TOPK > 0:
        tl.static_assert(ACT == ACT_NONE, "scatter form: the gather only")
        row_mask = rows < X_ROWS
        src = rows
    elif GATHER:
        src = tl.load(src_rows_ptr + rows, mask=row_mask, other=0)
        row_mask = row_mask & (src >= 0) & (src < X_ROWS)
    else:
        src = rows
    src = src.to(tl.int64)
    slot = rows * 0  # (read only where SWIZZLED, HAS_BIAS or FORM_E4M3 computed them)
    in_slot = row_mask
    if (HAS_BIAS or SWIZZLED or FORM == FORM_E4M3) and TOPK == 0:
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
    if ACT == ACT_NONE and PAIR_WORDS:
        # bf16 x as int32 words, elements 2j and 2j+1 in the low and high half of word j: one shift
        # or mask an element to fp32 (the bf16 cast moves the high half down first)
        words3 = pid_c * (NB * VEC // 2) + blk[None, :, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, None, :]
        words = tl.load(x_ptr + src[:, None, None] * X_STRIDE + words3,
                        mask=row_mask[:, None, None] & (words3 < K_OUT // 2), other=0)
        if OUT == OUT_E2M1_E4M3:
            low, high = quotients.bf16_halves(words)
        else:
            low, high = quotients.bf16_halves_plain(words)
        y = tl.reshape(tl.join(low, high), [BLOCK_M, NB, VEC])
    else:
        y = _load_activated(x_ptr, src[:, None, None], row_mask[:, None, None], cols3, col_mask3, X_STRIDE, K_OUT,
                            bias_ptr, row_expert[:, None, None], bias_rows[:, None, None], alpha, limit, ACT, CONCAT,
                            HAS_BIAS, PAIR_WORDS)
    out_mask3 = (rows3 < M) & col_mask3
    if OUT == OUT_E2M1_E4M3:
        # nvfp4: the elements and below their denominators times e2m1_rescale(g), the same quotients
        g = tl.load(global_ptr)
        rescale = quotients.e2m1_rescale(g)
        if rescale != 1.0:  # (the launch's global: one branch for all programs, taken for 0 < |g| < 2^-90)
            y = y * rescale
    if OUT == OUT_BF16:
        codes = codecs.to_bf16_rne(y)
        stored = y  # (no scales)
    else:
        amax = tl.reduce(quotients.abs_modifier(y) if OUT == OUT_E2M1_E4M3 else tl.abs(y), 2, _max_abs)  # [BLOCK_M, NB]
        if OUT == OUT_FP8_BLOCK:
            stored = tl.math.div_rn(amax, 448.0)
            quotient = quotients.magnitudes(y, stored).to(tl.int32, bitcast=True) | _sign_where(y, stored, 31)
            codes = codecs.encode_e4m3(codecs.f32_from_bits(quotient))
        elif OUT == OUT_E2M1_E4M3:
            # (y, its amax and the denominators times `rescale`: the same quotients)
            stored = codecs.encode_e4m3(quotients.scale_quotient(amax, g * 6.0 * rescale))
            denom = codecs.decode_e4m3_nan(stored) * g * rescale  # (a NaN scale, 0x7F, only for a NaN amax)
            codes = codecs.e2m1_magnitude(quotients.magnitudes_e2m1(y, denom)) | _sign_where(y, denom, 3)
        else:
            e = codecs.e8m0_exponent(amax, 448.0 if OUT == OUT_E4M3_E8M0 else 6.0)
            scaled = y * codecs.pow2(-e)[:, :, None]
            stored = tl.where(amax < float("inf"), e + 127, 255)  # inf or NaN amax -> the NaN scale
            if FORM != FORM_OPERAND:
                values, scale = _kernel_token_values(scaled, stored, OUT, FORM, EXP)
            elif OUT == OUT_E4M3_E8M0:
                codes = codecs.encode_e4m3(scaled)
            else:
                codes = codecs.encode_e2m1(scaled)
    if TOPK > 0:
        # Every choice's row and slot first (a choice's slot is the expert of its row, one slot
        # an expert: routing.route), in three rounds of loads for all of them; rows of dropped
        # choices lie outside their slot. Then the stores, a choice at a time.
        choice = tl.arange(0, TOPK_P2)[None, :]
        dests = tl.load(src_rows_ptr + rows.to(tl.int64)[:, None] * TOPK + choice,
                        mask=row_mask[:, None] & (choice < TOPK), other=M)
        dests = tl.where((dests >= 0) & (dests < M), dests, M)
        slots = tl.load(expert_ids_ptr + dests, mask=dests < M, other=G)
        slots = tl.where((slots >= 0) & (slots < G), slots, G)
        starts = tl.load(a_offsets_ptr + slots, mask=slots < G, other=M)
        ends = tl.load(a_offsets_ptr + slots + 1, mask=slots < G, other=M)
        dests = tl.where((starts <= dests) & (dests < ends), dests, -1)
        for j in tl.static_range(TOPK):
            dest = tl.reduce(tl.where(choice == j, dests, 0), 1, _add)  # (column j: the rest are 0)
            dest_in_slot = dest >= 0
            dest = tl.maximum(dest, 0)
            if FORM == FORM_OPERAND:
                dest_slot = tl.reduce(tl.where(choice == j, slots, 0), 1, _add)
                _store_operand(out_ptr, out_scale_ptr, a_offsets_ptr, a_scale_offsets_ptr, codes, stored, dest,
                               dest_in_slot, dest_slot, dest_in_slot, pid_c, blk, cols3, col_mask3, K_OUT, NUM_KB,
                               KB4, NUM_SCALE_ROWS, OUT, SWIZZLED, NB, VEC)
            else:
                _store_kernel_values(out_ptr, values, dest, cols3, dest_in_slot[:, None, None] & col_mask3, K_OUT,
                                     FORM, EVEN_ODD)
                if FORM == FORM_E4M3:
                    # The scale bytes row-major (kb_major_scales_kernel moves them into the kernel's
                    # K-block-major fp32 form): a token's grouped rows lie in random slots, so
                    # K-block-major stores from here would be one 4-byte write a sector.
                    kb = pid_c * NB + blk[None, :]  # [1, NB]
                    tl.store(scale_bytes_ptr + dest.to(tl.int64)[:, None] * NUM_KB + kb, stored.to(tl.uint8),
                             mask=dest_in_slot[:, None] & (kb < NUM_KB))
    elif FORM != FORM_OPERAND:
        _store_kernel_tokens(out_ptr, out_scale_ptr, a_offsets_ptr, values, scale, rows, slot if FORM == FORM_E4M3
                             else rows, in_slot if FORM == FORM_E4M3 else row_mask, pid_c, blk, cols3, out_mask3,
                             M, K_OUT, NUM_KB, M_PAD, FORM, EVEN_ODD, NB, COLUMN_BLOCK)
    else:
        _store_operand(out_ptr, out_scale_ptr, a_offsets_ptr, a_scale_offsets_ptr, codes, stored, rows, rows < M,
                       slot, in_slot, pid_c, blk, cols3, col_mask3, K_OUT, NUM_KB, KB4, NUM_SCALE_ROWS, OUT, SWIZZLED,
                       NB, VEC)


@triton.jit
def _store_operand(out_ptr, out_scale_ptr, a_offsets_ptr, a_scale_offsets_ptr, codes, stored, rows, row_ok, slot,
                   in_slot, pid_c, blk, cols3, col_mask3, K_OUT, NUM_KB, KB4, NUM_SCALE_ROWS, OUT: tl.constexpr,
                   SWIZZLED: tl.constexpr, NB: tl.constexpr, VEC: tl.constexpr):
    """The format's A operand of `rows` where row_ok: the element codes `codes` (int32 e4m3 or
    e2m1 codes of the block-scaled values; bf16 values for bf16) and their scales `stored` (none
    for bf16) row-major, or in the swizzled layout by each row's slot (rows outside every slot,
    in_slot False, get no scales there)."""
    rows3 = rows[:, None, None]
    out_mask3 = row_ok[:, None, None] & col_mask3
    if OUT == OUT_BF16:
        tl.store(out_ptr + rows3.to(tl.int64) * K_OUT + cols3, codes, mask=out_mask3)
    else:
        if OUT == OUT_FP8_BLOCK or OUT == OUT_E4M3_E8M0:
            tl.store(out_ptr + rows3.to(tl.int64) * K_OUT + cols3, codes.to(tl.uint8), mask=out_mask3)
        else:
            low, high = tl.split(tl.reshape(codes, [codes.shape[0], NB, VEC // 2, 2]))
            packed = (low | (high << 4)).to(tl.uint8)
            half = pid_c * (NB * VEC // 2) + blk[None, :, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, None, :]
            tl.store(out_ptr + rows3.to(tl.int64) * (K_OUT // 2) + half, packed,
                     mask=row_ok[:, None, None] & (half < K_OUT // 2))
        kb = pid_c * NB + blk[None, :]  # [1, NB]
        kb_mask = row_ok[:, None] & (kb < NUM_KB)
        if SWIZZLED:
            start = tl.load(a_offsets_ptr + slot, mask=in_slot, other=0)
            block0 = tl.load(a_scale_offsets_ptr + slot, mask=in_slot, other=0) + (start >> 7)
            # (shifts and masks of the int32 row: the same as floor division and modulo where the
            # row is kept, srow >= 0, with fewer instructions than int64 division's signed rounding)
            srow = 128 * block0 + rows - start
            within = ((srow & 31) * 16 + ((srow >> 5) & 3) * 4)[:, None] + (kb & 3)
            offset = ((srow >> 7).to(tl.int64)[:, None] * KB4 + (kb >> 2)) * 512 + within
            kb_mask = kb_mask & (in_slot & (srow >= 0) & (srow < NUM_SCALE_ROWS))[:, None]
        else:
            offset = rows.to(tl.int64)[:, None] * NUM_KB + kb
        if OUT == OUT_FP8_BLOCK:
            tl.store(out_scale_ptr + offset, stored, mask=kb_mask)
        else:
            tl.store(out_scale_ptr + offset, stored.to(tl.uint8), mask=kb_mask)


@triton.jit
def _kernel_token_values(scaled, stored, OUT: tl.constexpr, FORM: tl.constexpr, EXP: tl.constexpr):
    """What activation_quantize_kernel's FORM_E4M3 and FORM_BF16 store (its docstring), from
    the [BLOCK_M, NB, VEC] block `scaled` of values divided by their block's 2^e and `stored`
    = e + 127 (255 for a NaN block): (the e4m3 bytes, or the bf16 values; the fp32 scales)."""
    scale = codecs.decode_e8m0(stored)  # [BLOCK_M, NB] fp32: 2^e, NaN for 255
    if OUT == OUT_E4M3_E8M0:
        codes = codecs.encode_e4m3(scaled)
    else:
        codes = codecs.encode_e2m1(scaled)
    if FORM == FORM_BF16:
        if OUT == OUT_E4M3_E8M0:
            # As the hardware decodes e4m3fn (tokens.dequantize_rows on the GPU): the sign set by
            # bits, so 0x80 is -0 (a compiled negation of +0 gives +0), and 0x7F / 0xFF are NaN (a
            # NaN element of a block whose amax ignored it: the GPU's maximum drops NaN).
            mag = codes & 0x7F
            magnitude = codecs.decode_e4m3(mag, False)
            values = codecs.f32_from_bits(magnitude.to(tl.int32, bitcast=True) | ((codes & 0x80) << 24))
            values = tl.where(mag == 0x7F, codecs.f32_from_bits(0x7FC00000 + 0 * codes), values)
        else:
            values = codecs.decode_e2m1(codes)
        return codecs.to_bf16_rne(values * scale[:, :, None]), scale
    else:
        if OUT == OUT_E2M1_E8M0:
            codes = codecs.e2m1_code_to_e4m3(codes, EXP)
        return codes.to(tl.uint8), scale


@triton.jit
def _store_kernel_values(out_ptr, values, rows, cols3, out_mask3, K_OUT, FORM: tl.constexpr,
                         EVEN_ODD: tl.constexpr):
    """_kernel_token_values' values stored to `rows`."""
    out_rows3 = rows[:, None, None].to(tl.int64) * K_OUT
    if FORM == FORM_E4M3 and EVEN_ODD:  # element i of a group of 8 -> position 4 * (i % 2) + i // 2
        dest = (cols3 & ~7) | ((cols3 & 1) << 2) | ((cols3 & 7) >> 1)
    else:
        dest = cols3
    tl.store(out_ptr + out_rows3 + dest, values, mask=out_mask3)


@triton.jit
def _store_kernel_tokens(out_ptr, out_scale_ptr, a_offsets_ptr, values, scale, rows, slot, in_slot, pid_c, blk,
                         cols3, out_mask3, M, K_OUT, NUM_KB, M_PAD, FORM: tl.constexpr, EVEN_ODD: tl.constexpr,
                         NB: tl.constexpr, COLUMN_BLOCK: tl.constexpr):
    """_kernel_token_values' values and scales stored to `rows` (of slots `slot` where in_slot)."""
    _store_kernel_values(out_ptr, values, rows, cols3, out_mask3, K_OUT, FORM, EVEN_ODD)
    if FORM == FORM_E4M3:
        start = tl.load(a_offsets_ptr + slot, mask=in_slot, other=0)
        column = _portable.kb_major_column(rows - start, start, slot, COLUMN_BLOCK)
        kb = pid_c * NB + blk[None, :]  # [1, NB]
        tl.store(out_scale_ptr + kb.to(tl.int64) * M_PAD + column[:, None], scale,
                 mask=in_slot[:, None] & (rows[:, None] < M) & (kb < NUM_KB))


@triton.jit
def kb_major_scales_kernel(scale_bytes_ptr, row_slot_ptr, a_offsets_ptr, out_scale_ptr, M, G, NUM_KB, M_PAD,
                           COLUMN_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr):
    """The scatter form's second step: e8m0 scale bytes [M, NUM_KB] (row-major, by grouped row)
    -> out_scale[kb, kb_major_column(p - s, s, g, COLUMN_BLOCK)] = 2^(byte - 127) in fp32 (NaN
    for 255) for every row p inside its slot g = row_slot[p] (first row s), as
    activation_quantize_kernel writes them in FORM_E4M3. Program (i, j): rows
    [i*BLOCK_R, (i+1)*BLOCK_R), scale blocks [j*BLOCK_KB, (j+1)*BLOCK_KB)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1) * BLOCK_KB + tl.arange(0, BLOCK_KB)
    row_mask = rows < M
    slot = tl.load(row_slot_ptr + rows, mask=row_mask, other=G)
    slot = tl.where(row_mask & (slot >= 0) & (slot < G), slot, G)
    start = tl.load(a_offsets_ptr + slot, mask=slot < G, other=M)
    end = tl.load(a_offsets_ptr + slot + 1, mask=slot < G, other=M)
    inside = (start <= rows) & (rows < end)
    column = _portable.kb_major_column(rows - start, start, slot, COLUMN_BLOCK)
    mask = inside[:, None] & (kb[None, :] < NUM_KB)
    scale = codecs.decode_e8m0(tl.load(scale_bytes_ptr + rows.to(tl.int64)[:, None] * NUM_KB + kb[None, :],
                                       mask=mask, other=0))
    tl.store(out_scale_ptr + kb.to(tl.int64)[None, :] * M_PAD + column[:, None], scale, mask=mask)
