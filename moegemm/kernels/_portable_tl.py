"""Portable Triton (tl) grouped block-scaled matmul: runs compiled on a GPU and under the
Triton interpreter on the CPU.

This file is executed twice by kernels/portable.py, once with the interpreter knob off and
once with it on, so CPU tensors never need TRITON_INTERPRET=1 set by the user. For that to
work it must not call Triton's standard library (tl.zeros, tl.cdiv, tl.interleave, tl.sum ...):
those are @triton.jit functions bound to whichever mode Triton was imported in. Its element and
scale codecs are _codecs_tl.py's, loaded for the same mode (tl_source.load_beside).

Schedule (persistent): every program walks the group slots in order, keeps a running count of
the tiles before the current slot, and takes the tiles t of each slot with t % nprog == pid.
Inside a slot the M-tiles are fastest, so neighbouring programs share a B tile in L2. Slots
with expert_id outside [0, E) or no rows have no tiles. Offsets are clamped into [0, M] so no
input can make a program write outside `out`; stores are masked to the slot's rows [s, t).

Numerics: every element is decoded from its bits to fp32 (exact), MX/NV block scales (powers
of two, or e4m3 times e2m1) are folded into the operands, which stay exact in bf16, and the
dot accumulates in fp32. fp8_block multiplies each K step's partial product by its fp32
scales (promotion; a step never straddles a 128-wide scale block), as docs/contract.md section 4 writes it.
bf16 operands (the bf16 format's, and the activations of the weight-only formats, which have
no scales: A_SCALE is SCALE_NONE while B_SCALE is the weights') go to the dot as they are loaded.
"""

import triton
import triton.language as tl

from moegemm.kernels import tl_source

codecs = tl_source.load_beside(__file__, "_codecs_tl.py")

# Element kinds (formats.ElementFormat) and scale kinds, as kernel constexprs.
ELEM_BF16 = tl.constexpr(0)
ELEM_E4M3 = tl.constexpr(1)
ELEM_E2M1 = tl.constexpr(2)
SCALE_NONE = tl.constexpr(0)
SCALE_FP32_BLOCK = tl.constexpr(1)  # fp8_block: one fp32 per 1x128 (A) / 128x128 (B)
SCALE_E8M0 = tl.constexpr(2)
SCALE_E4M3 = tl.constexpr(3)


@triton.jit
def _decode_e4m3(byte, BY_BITS: tl.constexpr):
    """uint8 e4m3fn bits -> fp32 (0x7F/0xFF are NaN; subnormals are man * 2^-9).

    BY_BITS decodes with integer ops: the interpreter's fp8 cast turns NaN into 480. On the
    GPU the hardware conversion is exact and needs fewer registers.
    """
    if not BY_BITS:
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return codecs.decode_e4m3(byte.to(tl.int32), True)


@triton.jit
def _load_operand(ptr, rows, row_mask, k0, K, STRIDE, ELEM: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, K_MAJOR: tl.constexpr):
    """Rows `rows` (int64) x columns [k0, k0 + BLOCK_K) of an operand, decoded to fp32 (bf16
    elements: as loaded, bf16). K_MAJOR: element (r, k) at r * STRIDE + k (packed e2m1: byte k/2);
    else (N-major bf16 weights) at r + k * STRIDE.

    Out-of-range rows and columns read as zero.
    """
    if ELEM == ELEM_E2M1:
        half_k = K // 2
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = row_mask[:, None] & (cols[None, :] < half_k)
        packed = tl.load(ptr + rows[:, None] * STRIDE + cols[None, :], mask=mask, other=0).to(tl.int32)
        low = codecs.decode_e2m1(packed & 15)  # element 2i
        high = codecs.decode_e2m1(packed >> 4)  # element 2i + 1
        return tl.join(low, high).reshape(BLOCK_R, BLOCK_K)
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols[None, :] < K)
        if K_MAJOR:
            offsets = rows[:, None] * STRIDE + cols[None, :]
        else:
            offsets = rows[:, None] + cols[None, :].to(tl.int64) * STRIDE
        x = tl.load(ptr + offsets, mask=mask, other=0)
        if ELEM == ELEM_E4M3:
            return _decode_e4m3(x, INTERPRETED)
        else:
            return x


@triton.jit
def _scale_offsets(r, kb, NUM_KB, KB4, SWIZZLED: tl.constexpr):
    """Offset of the scale (row r, K block kb): plain r * NUM_KB + kb; swizzled (128x4 atom)
    (r // 128) * KB4 * 512 + (kb // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + kb % 4."""
    if SWIZZLED:
        return (r // 128) * (KB4 * 512) + (kb // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + kb % 4
    else:
        return r * NUM_KB + kb


@triton.jit
def _apply_block_scales(x, scale_ptr, scale_rows, row_mask, k0, NUM_KB, KB4,
                        SCALE: tl.constexpr, SWIZZLED: tl.constexpr, VEC: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """Multiply x [BLOCK_R, BLOCK_K] by its per-(row, VEC-wide K block) scales (_scale_offsets)."""
    kb = k0 // VEC + tl.arange(0, BLOCK_K // VEC)
    mask = row_mask[:, None] & (kb[None, :] < NUM_KB)
    raw = tl.load(scale_ptr + _scale_offsets(scale_rows[:, None], kb[None, :], NUM_KB, KB4, SWIZZLED), mask=mask,
                  other=0)
    if SCALE == SCALE_E8M0:
        s = codecs.decode_e8m0(raw)
    else:
        s = _decode_e4m3(raw, INTERPRETED)
    x = x.reshape(BLOCK_R, BLOCK_K // VEC, VEC) * s[:, :, None]
    return x.reshape(BLOCK_R, BLOCK_K)


@triton.jit
def grouped_matmul_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr,
    a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr,
    expert_scales_ptr, row_scales_ptr, out_ptr,
    M, N, K, E, G,
    NUM_KB, KB4, NUM_SCALE_ROWS,
    A_ELEM: tl.constexpr, B_ELEM: tl.constexpr, A_SCALE: tl.constexpr, B_SCALE: tl.constexpr,
    VEC: tl.constexpr, SWIZZLED: tl.constexpr, HAS_EXPERT_SCALES: tl.constexpr, HAS_ROW_SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, B_N_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[s:t] = decode(A[s:t]) @ decode(B[e]).T * expert_scales[e] * row_scales[s:t] per valid slot.

    A_SCALE and B_SCALE are the scale kinds of A and B: equal, or A's SCALE_NONE (weight-only
    formats: bf16 activations); SWIZZLED applies to the scales that exist. B_N_MAJOR: B [E, N, K]
    is the transpose of a contiguous [E, K, N] (bf16 weights), else contiguous."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    a_row_elems = K // 2 if A_ELEM == ELEM_E2M1 else K
    b_row_elems = K // 2 if B_ELEM == ELEM_E2M1 else K
    b_stride = N if B_N_MAJOR else b_row_elems  # (between K elements N-major, else between weight rows)
    # Per-expert strides of the B scales: plain [E, N, NUM_KB] (fp8_block: [E, ceil(N/128), NUM_KB]),
    # swizzled [E, ceil(N/128), KB4, 512].
    if B_SCALE == SCALE_FP32_BLOCK:
        b_scale_expert_stride = ((N + 127) // 128) * NUM_KB
    elif SWIZZLED:
        b_scale_expert_stride = ((N + 127) // 128) * KB4 * 512
    else:
        b_scale_expert_stride = N * NUM_KB

    tile_base = pid * 0  # tiles in the slots before g (an int32 tensor, carried by the loop)
    for g in range(0, G):
        s = tl.load(a_offsets_ptr + g)
        t = tl.load(a_offsets_ptr + g + 1)
        e = tl.load(expert_ids_ptr + g)
        s = tl.minimum(tl.maximum(s, 0), M)
        t = tl.minimum(tl.maximum(t, s), M)
        m_tiles = tl.where((e >= 0) & (e < E), (t - s + BLOCK_M - 1) // BLOCK_M, 0)
        group_tiles = m_tiles * n_tiles
        first = tile_base + (pid - tile_base % nprog + nprog) % nprog
        if SWIZZLED and A_SCALE != SCALE_NONE:
            scale_row_base = 128 * (tl.load(a_scale_offsets_ptr + g) + s // 128) - s
        else:
            scale_row_base = s * 0
        for tile in range(first, tile_base + group_tiles, nprog):
            local = tile - tile_base
            m_block = local % m_tiles
            n_block = local // m_tiles
            rows = s + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < t
            rows = rows.to(tl.int64)
            cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            cols = cols.to(tl.int64)
            expert = e.to(tl.int64)
            b_base = b_ptr + expert * N * b_row_elems
            a_scale_rows = rows + scale_row_base
            a_scale_mask = row_mask & (a_scale_rows >= 0) & (a_scale_rows < NUM_SCALE_ROWS)

            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = _load_operand(a_ptr, rows, row_mask, k0, K, a_row_elems, A_ELEM, BLOCK_M, BLOCK_K, INTERPRETED,
                                  True)
                b = _load_operand(b_base, cols, col_mask, k0, K, b_stride, B_ELEM, BLOCK_N, BLOCK_K, INTERPRETED,
                                  not B_N_MAJOR)
                if A_SCALE == SCALE_E8M0 or A_SCALE == SCALE_E4M3:
                    a = _apply_block_scales(a, a_scale_ptr, a_scale_rows, a_scale_mask, k0, NUM_KB, KB4,
                                            A_SCALE, SWIZZLED, VEC, BLOCK_M, BLOCK_K, INTERPRETED)
                if B_SCALE == SCALE_E8M0 or B_SCALE == SCALE_E4M3:
                    b = _apply_block_scales(b, b_scale_ptr + expert * b_scale_expert_stride, cols, col_mask,
                                            k0, NUM_KB, KB4, B_SCALE, SWIZZLED, VEC, BLOCK_N, BLOCK_K, INTERPRETED)
                if B_SCALE == SCALE_FP32_BLOCK:
                    part = tl.dot(a.to(DOT_DTYPE), tl.trans(b.to(DOT_DTYPE)), input_precision=DOT_PRECISION,
                                  out_dtype=tl.float32)
                    kb = k0 // 128  # BLOCK_K divides 128: the step lies inside one scale block
                    sa = tl.load(a_scale_ptr + rows * NUM_KB + kb, mask=row_mask, other=0.0)
                    sb = tl.load(b_scale_ptr + expert * b_scale_expert_stride + (cols // 128) * NUM_KB + kb,
                                 mask=col_mask, other=0.0)
                    acc += part * sa[:, None] * sb[None, :]
                else:
                    acc = tl.dot(a.to(DOT_DTYPE), tl.trans(b.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION,
                                 out_dtype=tl.float32)

            if HAS_EXPERT_SCALES:
                acc = acc * tl.load(expert_scales_ptr + expert)
            if HAS_ROW_SCALES:
                acc = acc * tl.load(row_scales_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            out_ptrs = out_ptr + rows[:, None] * N + cols[None, :]
            out_mask = row_mask[:, None] & col_mask[None, :]
            if out_ptr.dtype.element_ty == tl.bfloat16:
                tl.store(out_ptrs, codecs.to_bf16_rne(acc), mask=out_mask)
            else:
                tl.store(out_ptrs, acc, mask=out_mask)
        tile_base += group_tiles


@triton.jit
def _slot_rows(a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, g, M, E, SWIZZLED: tl.constexpr):
    """Rows [s, end) of slot g (empty when its expert id is outside [0, E)) and the offset from a
    row to its A-scale row (swizzled: 128 * (a_scale_offsets[g] + s // 128) - s; plain: 0)."""
    s = tl.load(a_offsets_ptr + g)
    t = tl.load(a_offsets_ptr + g + 1)
    e = tl.load(expert_ids_ptr + g)
    s = tl.minimum(tl.maximum(s, 0), M)
    t = tl.minimum(tl.maximum(t, s), M)
    end = tl.where((e >= 0) & (e < E), t, s)
    if SWIZZLED:
        scale_row_base = 128 * (tl.load(a_scale_offsets_ptr + g) + s // 128) - s
    else:
        scale_row_base = s * 0
    return s, end, scale_row_base


@triton.jit
def _row_block(r0, end, scale_row_base, NUM_SCALE_ROWS, BLOCK_M: tl.constexpr):
    """Rows [r0, r0 + BLOCK_M) of a slot ending at `end`, as int64, and which exist; their A-scale
    rows (_slot_rows' offset added) and which of those exist."""
    rows = r0 + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    rows = rows.to(tl.int64)
    scale_rows = rows + scale_row_base
    scale_mask = row_mask & (scale_rows >= 0) & (scale_rows < NUM_SCALE_ROWS)
    return rows, row_mask, scale_rows, scale_mask


# The zero fill of a fresh product output by the token pre-passes (their FILL programs): columns a
# store, and slots whose bounds are compared with a block of rows at once.
FILL_BLOCK_N = tl.constexpr(128)
FILL_BLOCK_G = tl.constexpr(64)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _zero_free_rows(c_ptr, a_offsets_ptr, expert_ids_ptr, block, M, N, E, G, BLOCK_M: tl.constexpr):
    """Zeros into the rows [block * BLOCK_M, (block + 1) * BLOCK_M) of c ([M, N], contiguous)
    that no valid slot owns (its rows as _slot_rows clamps them): before a_offsets[0], from
    a_offsets[G], and those of skipped or empty slots. Rows a valid slot owns are left to the
    product, which runs after the pre-pass on the same stream. Any offsets: a row is tested
    against every slot, so unsorted ones leave no row unwritten."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    owned = (rows >= M).to(tl.int32)  # (rows past M: nothing to write)
    for g0 in range(0, G, FILL_BLOCK_G):
        # (slots past G repeat slot G - 1: the same rows again)
        g = tl.minimum(g0 + tl.arange(0, FILL_BLOCK_G), G - 1)
        s, end, _ = _slot_rows(a_offsets_ptr, expert_ids_ptr, a_offsets_ptr, g, M, E, False)
        inside = (rows[:, None] >= s[None, :]) & (rows[:, None] < end[None, :])
        owned = tl.maximum(owned, tl.reduce(inside.to(tl.int32), 1, _maximum))
    free = owned == 0
    columns = tl.where(tl.reduce(free.to(tl.int32), 0, _maximum) > 0, N, 0)  # (no free row: no store)
    rows = rows.to(tl.int64)
    for c0 in range(0, columns, FILL_BLOCK_N):
        cols = c0 + tl.arange(0, FILL_BLOCK_N)
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], tl.full((BLOCK_M, FILL_BLOCK_N), 0.0, tl.float32),
                 mask=free[:, None] & (cols[None, :] < N))


@triton.jit
def dequantize_rows_kernel(
    a_ptr, a_scale_ptr, a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, out_ptr, c_ptr,
    M, K, E, G, NUM_KB, KB4, NUM_SCALE_ROWS, N,
    A_ELEM: tl.constexpr, SCALE: tl.constexpr, VEC: tl.constexpr, SWIZZLED: tl.constexpr,
    INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FILL: tl.constexpr = False,
):
    """out[m] = bf16(decode(A[m]) * sfa(m)) for the rows m of every valid slot; other rows are
    not written. Exact: an e4m3 or e2m1 value times a power of two (or an e4m3 scale) has at
    most 5 significant bits, which bf16 holds unless it leaves fp32's exponent range.

    Program (g, part) takes the BLOCK_M-row blocks part, part + parts, ... of slot g. FILL:
    programs (G + i, part) zero the rows of the product's fresh output c ([M, N]) that no valid
    slot owns, block i * parts + part of BLOCK_M rows (_zero_free_rows).
    """
    g = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    if g < G:
        s, end, scale_row_base = _slot_rows(a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, g, M, E, SWIZZLED)
        for r0 in range(s + part * BLOCK_M, end, parts * BLOCK_M):
            rows, row_mask, scale_rows, scale_mask = _row_block(r0, end, scale_row_base, NUM_SCALE_ROWS, BLOCK_M)
            for k0 in range(0, K, BLOCK_K):
                x = _load_operand(a_ptr, rows, row_mask, k0, K, K // 2 if A_ELEM == ELEM_E2M1 else K, A_ELEM,
                                  BLOCK_M, BLOCK_K, INTERPRETED, True)
                x = _apply_block_scales(x, a_scale_ptr, scale_rows, scale_mask, k0, NUM_KB, KB4, SCALE, SWIZZLED,
                                        VEC, BLOCK_M, BLOCK_K, INTERPRETED)
                cols = k0 + tl.arange(0, BLOCK_K)
                tl.store(out_ptr + rows[:, None] * K + cols[None, :], codecs.to_bf16_rne(x),
                         mask=row_mask[:, None] & (cols[None, :] < K))
    elif FILL:
        _zero_free_rows(c_ptr, a_offsets_ptr, expert_ids_ptr, (g - G) * parts + part, M, N, E, G, BLOCK_M)


@triton.jit
def decode_row_scales_kernel(
    a_scale_ptr, a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, out_ptr, c_ptr,
    M, E, G, NUM_KB, KB4, NUM_SCALE_ROWS, COLUMNS, ROW_STRIDE, KB_STRIDE, N,
    SWIZZLED: tl.constexpr, ALIGN_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KB: tl.constexpr,
    FILL: tl.constexpr = False,
):
    """out[m' * ROW_STRIDE + kb * KB_STRIDE] = fp32 value of A's e8m0 scale (m, kb) for kb <
    COLUMNS (>= NUM_KB; those past NUM_KB get 2^-127, the value of a zero byte), for the rows m
    of every valid slot (the token scales of the mxfp8 promotion kernel, kernels/sm90/mxfp8.py);
    other rows are not written. m' = m, or with ALIGN_GROUPS (4 or 16, the column block)
    kb_major_column(m - s, s, g, ALIGN_GROUPS) (slot g starts at row s): every slot's first row
    at a multiple of the block. Slots, parts and FILL as in dequantize_rows_kernel."""
    g = tl.program_id(0)
    if g < G:
        _decode_row_scales(a_scale_ptr, a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, out_ptr, g,
                           tl.program_id(1), tl.num_programs(1), M, E, G, NUM_KB, KB4, NUM_SCALE_ROWS, COLUMNS,
                           ROW_STRIDE, KB_STRIDE, SWIZZLED, ALIGN_GROUPS, BLOCK_M, BLOCK_KB)
    elif FILL:
        _zero_free_rows(c_ptr, a_offsets_ptr, expert_ids_ptr, (g - G) * tl.num_programs(1) + tl.program_id(1), M, N,
                        E, G, BLOCK_M)


@triton.jit
def _decode_row_scales(a_scale_ptr, a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, out_ptr, g, part, parts,
                       M, E, G, NUM_KB, KB4, NUM_SCALE_ROWS, COLUMNS, ROW_STRIDE, KB_STRIDE,
                       SWIZZLED: tl.constexpr, ALIGN_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_KB: tl.constexpr):
    """decode_row_scales_kernel's work for slot g, part `part` of `parts`."""
    s, end, scale_row_base = _slot_rows(a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, g, M, E, SWIZZLED)
    for r0 in range(s + part * BLOCK_M, end, parts * BLOCK_M):
        rows, row_mask, scale_rows, scale_mask = _row_block(r0, end, scale_row_base, NUM_SCALE_ROWS, BLOCK_M)
        if ALIGN_GROUPS:
            out_rows = kb_major_column(rows - s, s, g, ALIGN_GROUPS)
        else:
            out_rows = rows
        for kb0 in range(0, COLUMNS, BLOCK_KB):
            kb = kb0 + tl.arange(0, BLOCK_KB)
            raw = tl.load(a_scale_ptr + _scale_offsets(scale_rows[:, None], kb[None, :], NUM_KB, KB4, SWIZZLED),
                          mask=scale_mask[:, None] & (kb[None, :] < NUM_KB), other=0)
            tl.store(out_ptr + out_rows[:, None] * ROW_STRIDE + kb[None, :] * KB_STRIDE, codecs.decode_e8m0(raw),
                     mask=row_mask[:, None] & (kb[None, :] < COLUMNS))


@triton.jit
def kb_major_column(r, s, g, BLOCK: tl.constexpr):
    """Column of row s + r of slot g (first row s) in the K-block-major token scales with column
    block BLOCK (4, or 16: each 16 in the accumulator's order); token_forms.kb_major_column."""
    base = BLOCK * ((s + BLOCK - 1) // BLOCK) + BLOCK * g
    if BLOCK == 16:
        r = (r & ~15) | ((r & 6) << 1) | ((r & 8) >> 2) | (r & 1)
    return base + r


@triton.jit
def e2m1_to_e4m3_kernel(src_ptr, out_ptr, NUM_BYTES, EXP: tl.constexpr, EVEN_ODD: tl.constexpr,
                        BLOCK: tl.constexpr):
    """out[2i], out[2i + 1] = the e4m3 bytes of the low and high e2m1 nibble of src[i] times
    2^EXP, exact: magnitude codes 0..7 -> 0x00, then 0.5 * 2^EXP (0x30 + 8 * EXP), then 4 more
    per code (1, 1.5, 2, 3, 4, 6 times 2^EXP); the sign bit moves from bit 3 to bit 7.
    EVEN_ODD: each group of 8 elements (4 bytes) is stored as elements 0, 2, 4, 6, 1, 3, 5, 7
    (the low nibbles, then the high ones): byte i's go to 2i - i % 4 and 4 past it."""
    _e2m1_to_e4m3_block(src_ptr, out_ptr, NUM_BYTES, tl.program_id(0), EXP, EVEN_ODD, BLOCK)


@triton.jit
def token_prepass_kernel(a_scale_ptr, a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, scales_out_ptr, c_ptr,
                         src_ptr, tokens_out_ptr, M, E, G, NUM_KB, KB4, NUM_SCALE_ROWS, COLUMNS, ROW_STRIDE,
                         KB_STRIDE, N, PARTS, NUM_BYTES,
                         SWIZZLED: tl.constexpr, ALIGN_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_KB: tl.constexpr, EXP: tl.constexpr, EVEN_ODD: tl.constexpr, BLOCK: tl.constexpr,
                         PACKED: tl.constexpr = True, FILL: tl.constexpr = False):
    """decode_row_scales_kernel and e2m1_to_e4m3_kernel in one launch (the mxfp4 tokens of the
    sm90 promotion kernels, kernels/sm90/mxfp8.py and e2m1.py: a launch less before each product): programs
    [0, G * PARTS) decode the scales of slot pid // PARTS, the next ceil(NUM_BYTES / BLOCK)
    convert BLOCK bytes each; FILL: the rest zero BLOCK_M rows each of the product's fresh
    output c ([M, N]) where no valid slot owns them (_zero_free_rows).
    PACKED False (w4a8's e4m3 tokens): src holds NUM_BYTES pairs of e4m3 bytes (elements 2i, 2i+1
    as one int16), moved as they are into the EVEN_ODD order (tokens.even_odd_k)."""
    pid = tl.program_id(0)
    if pid < G * PARTS:
        _decode_row_scales(a_scale_ptr, a_offsets_ptr, expert_ids_ptr, a_scale_offsets_ptr, scales_out_ptr,
                           pid // PARTS, pid % PARTS, PARTS, M, E, G, NUM_KB, KB4, NUM_SCALE_ROWS, COLUMNS,
                           ROW_STRIDE, KB_STRIDE, SWIZZLED, ALIGN_GROUPS, BLOCK_M, BLOCK_KB)
    else:
        block = pid - G * PARTS
        blocks = (NUM_BYTES + BLOCK - 1) // BLOCK
        if block < blocks:
            if PACKED:
                _e2m1_to_e4m3_block(src_ptr, tokens_out_ptr, NUM_BYTES, block, EXP, EVEN_ODD, BLOCK)
            else:
                _byte_pairs_even_odd_block(src_ptr, tokens_out_ptr, NUM_BYTES, block, BLOCK)
        elif FILL:
            _zero_free_rows(c_ptr, a_offsets_ptr, expert_ids_ptr, block - blocks, M, N, E, G, BLOCK_M)


@triton.jit
def _byte_pairs_even_odd_block(src_ptr, out_ptr, NUM_PAIRS, block, BLOCK: tl.constexpr):
    """Pairs [block * BLOCK, (block + 1) * BLOCK) of 1-byte elements (an int16 each: element 2i
    in the low byte) stored in the order 0 2 4 6 1 3 5 7 of each 8 elements (even_odd_k)."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < NUM_PAIRS
    pair = tl.load(src_ptr + offsets, mask=mask, other=0).to(tl.int32)
    low_offsets = 2 * offsets - offsets % 4
    tl.store(out_ptr + tl.join(low_offsets, low_offsets + 4), tl.join(pair & 255, (pair >> 8) & 255).to(tl.uint8),
             mask=tl.join(mask, mask))


@triton.jit
def _e2m1_to_e4m3_block(src_ptr, out_ptr, NUM_BYTES, block, EXP: tl.constexpr, EVEN_ODD: tl.constexpr,
                        BLOCK: tl.constexpr):
    """e2m1_to_e4m3_kernel's work for bytes [block * BLOCK, (block + 1) * BLOCK)."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < NUM_BYTES
    packed = tl.load(src_ptr + offsets, mask=mask, other=0).to(tl.int32)
    low = codecs.e2m1_code_to_e4m3(packed & 15, EXP)
    high = codecs.e2m1_code_to_e4m3(packed >> 4, EXP)
    if EVEN_ODD:
        low_offsets = 2 * offsets - offsets % 4
        high_offsets = low_offsets + 4
    else:
        low_offsets = 2 * offsets
        high_offsets = low_offsets + 1
    tl.store(out_ptr + tl.join(low_offsets, high_offsets), tl.join(low, high).to(tl.uint8),
             mask=tl.join(mask, mask))
