"""Routing kernels in portable Triton (tl): top-k choices -> grouped layout, and the combine.

    histogram   program b counts the experts of flat choices [b*BLOCK, (b+1)*BLOCK)
    offsets     one program: per-expert totals -> a_offsets, a_scale_offsets, and the first
                grouped row of every (block, expert): base[b, e]
    scatter     program b places its choices, SUB at a time: row = base[b, e] + (earlier
                choices of e in b); also valid[i] (and offsets writes expert_ids = arange(E))
    combine     out[t] = sum_j w[t, j] * (y[grouped_row[t, j]] (+ bias[e_tj])), in fp32
    scatter_rows  out[grouped_row[t, j]] = src[t] for the valid choices: each row read once

Key of a choice: its expert id when in [0, E), else E (dropped: sorted after every group, in
flat order). Rows are therefore a stable sort of the keys, as moegemm.routing.route_reference
computes it. Everything is integer counting, so the result is deterministic.

Like _portable_tl.py this file is executed twice (compiled and interpreted, kernels/routing_kernels.py),
so it calls no @triton.jit function of Triton's standard library (tl.sum, tl.cumsum, ...),
only builtins (tl.reduce, tl.associative_scan, tl.histogram, tl.gather) and the helpers below.
"""

import triton
import triton.language as tl

from moegemm.kernels import tl_source


@triton.jit
def _add(a, b):
    return a + b


# The combine function of every sum and prefix sum. The interpreter runs a custom one element by
# element in Python; it recognizes the standard library's own and runs numpy instead (it never
# calls it, so the rule above holds).
_SUM = tl.standard._sum_combine if tl_source.interpreted() else _add


@triton.jit
def _keys(ids_ptr, offs, mask, n, E):
    """Expert id of each flat choice, E for a dropped one (id < 0 or >= E); 0 where masked."""
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    valid = (ids >= 0) & (ids < E)
    key = tl.where(valid, ids, E).to(tl.int32)
    return tl.where(mask, key, 0)


@triton.jit
def routing_histogram_kernel(ids_ptr, counts_ptr, n, E, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """counts[b, e] (int32 [num_blocks, E+1]) = choices of block b whose key is e."""
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = _keys(ids_ptr, offs, mask, n, E)
    hist = tl.histogram(key, NUM_BINS, mask=mask)
    bins = tl.arange(0, NUM_BINS)
    tl.store(counts_ptr + b * (E + 1) + bins, hist, mask=bins <= E)


@triton.jit
def routing_offsets_kernel(counts_ptr, base_ptr, a_offsets_ptr, a_scale_offsets_ptr, expert_ids_ptr, num_blocks, E,
                           NUM_BINS: tl.constexpr, CHUNK: tl.constexpr):
    """One program. a_offsets[e] (e <= E) = choices with key < e; base[b, e] = a_offsets[e] plus
    the choices of key e in blocks before b; a_scale_offsets[g] = blocks(g) - a_offsets[g] // 128
    with blocks(g) = sum_{j<g} ceil(tokens_j / 128) (moegemm.layouts.a_scale_offsets);
    expert_ids = arange(E)."""
    bins = tl.arange(0, NUM_BINS)
    tl.store(expert_ids_ptr + bins, bins, mask=bins < E)
    col_ok = bins <= E
    width = E + 1
    totals = tl.full((NUM_BINS,), 0, tl.int32)
    for b0 in range(0, num_blocks, CHUNK):
        rows = b0 + tl.arange(0, CHUNK)
        m = (rows < num_blocks)[:, None] & col_ok[None, :]
        c = tl.load(counts_ptr + rows[:, None] * width + bins[None, :], mask=m, other=0)
        totals += tl.reduce(c, 0, _SUM)
    starts = tl.associative_scan(totals, 0, _SUM) - totals  # exclusive: starts[E] = valid choices
    tl.store(a_offsets_ptr + bins, starts, mask=col_ok)
    blocks = tl.where(bins < E, (totals + 127) // 128, 0)
    block_starts = tl.associative_scan(blocks, 0, _SUM) - blocks
    tl.store(a_scale_offsets_ptr + bins, block_starts - starts // 128, mask=bins < E)
    running = starts
    for b0 in range(0, num_blocks, CHUNK):
        rows = b0 + tl.arange(0, CHUNK)
        m = (rows < num_blocks)[:, None] & col_ok[None, :]
        c = tl.load(counts_ptr + rows[:, None] * width + bins[None, :], mask=m, other=0)
        before = tl.associative_scan(c, 0, _SUM) - c + running[None, :]
        tl.store(base_ptr + rows[:, None] * width + bins[None, :], before, mask=m)
        running += tl.reduce(c, 0, _SUM)


@triton.jit
def routing_scatter_kernel(ids_ptr, base_ptr, grouped_row_ptr, token_index_ptr, expert_of_row_ptr, valid_ptr,
                           n, E, k, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Program b places the choices of block b, SUB at a time: a choice's row is the block's
    next free row of its key (carried in `nxt`) plus the earlier choices of the same key in
    its SUB-chunk (a SUB x SUB comparison). valid[i] (uint8) = choice i is not dropped."""
    b = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    nxt = tl.load(base_ptr + b * (E + 1) + bins, mask=bins <= E, other=0)
    lane = tl.arange(0, SUB)
    earlier = lane[None, :] < lane[:, None]
    for s in range(0, BLOCK, SUB):
        offs = b * BLOCK + s + lane
        mask = offs < n
        key = _keys(ids_ptr, offs, mask, n, E)
        same = (key[:, None] == key[None, :]) & earlier & mask[None, :]
        rank = tl.reduce(same.to(tl.int32), 1, _SUM)
        row = tl.gather(nxt, key, 0) + rank
        tl.store(grouped_row_ptr + offs, row.to(tl.int64), mask=mask)
        tl.store(valid_ptr + offs, (key < E).to(tl.uint8), mask=mask)
        tl.store(token_index_ptr + row, (offs // k).to(tl.int64), mask=mask)
        tl.store(expert_of_row_ptr + row, key, mask=mask)
        nxt += tl.histogram(key, NUM_BINS, mask=mask)


@triton.jit
def routing_combine_kernel(y_ptr, grouped_row_ptr, valid_ptr, weights_ptr, expert_of_row_ptr, bias_ptr, out_ptr,
                           T, N, stride_ym, stride_yn, stride_be, stride_bn,
                           K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t, n] = sum_j w[t, j] * (y[row, n] + bias[e, n]) over the valid choices j < K of token t
    (row = grouped_row[t, j], e its expert), accumulated in fp32 in choice order. A dropped
    choice's row is never read, so garbage (NaN) there cannot leak. The choices are unrolled
    (K constexpr), so their loads are in flight together: at decode the kernel is a chain of
    dependent loads (row index, then the row), four of them one after the other take 6.8 us
    (gpt-oss, 64 tokens, H100)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < T
    n_ok = cols < N
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    for j in tl.static_range(K):
        choice = t.to(tl.int64) * K + j
        row = tl.load(grouped_row_ptr + choice, mask=t_ok, other=0)
        ok = (tl.load(valid_ptr + choice, mask=t_ok, other=0) != 0) & t_ok
        m = ok[:, None] & n_ok[None, :]
        v = tl.load(y_ptr + row[:, None] * stride_ym + cols[None, :] * stride_yn, mask=m, other=0.0)
        v = v.to(tl.float32)
        if HAS_BIAS:
            e = tl.load(expert_of_row_ptr + row, mask=ok, other=0).to(tl.int64)
            bias = tl.load(bias_ptr + e[:, None] * stride_be + cols[None, :] * stride_bn, mask=m, other=0.0)
            v = v + bias.to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + choice, mask=ok, other=0.0).to(tl.float32)
            v = v * w[:, None]
        acc += tl.where(m, v, 0.0)
    out_offs = t.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def routing_scatter_rows_kernel(src_ptr, grouped_row_ptr, valid_ptr, out_ptr, T, C, stride_src, stride_out,
                                K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Token rows src [T, C] (words of any width) to the grouped rows of their valid choices (rows
    of dropped choices are not written): each tile of src is loaded once and stored K times."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < T
    c_ok = cols < C
    m = t_ok[:, None] & c_ok[None, :]
    tile = tl.load(src_ptr + t.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=m, other=0)
    for j in tl.static_range(K):
        choice = t.to(tl.int64) * K + j
        row = tl.load(grouped_row_ptr + choice, mask=t_ok, other=0)
        ok = (tl.load(valid_ptr + choice, mask=t_ok, other=0) != 0) & t_ok
        tl.store(out_ptr + row[:, None] * stride_out + cols[None, :], tile, mask=ok[:, None] & c_ok[None, :])
