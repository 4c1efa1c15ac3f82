"""Zeros into the rows of a fresh output that no valid slot owns, inside the product's launch.

A grouped_matmul into a fresh output must read zero outside the valid slots (rows before the
first offset, past the last one, and those of skipped or empty slots); the tiles only write the
rows their slot owns. The block formats' token pre-pass zeroes them before the product
(kernels/tokens.py); kernels without a pre-pass zero them here, after their tiles, instead of a
zero fill launched before the call (a torch launch, ~8 us of host time at decode).

Ownership is the schedule's (pipeline._slot_tiles: offsets clamped to [0, M], a slot whose
expert id is outside [0, E) owns nothing), and a row is tested against every slot, so unsorted
or overlapping offsets leave no row both zeroed and stored. One consumer warpgroup of each
program takes FILL_ROWS-row blocks program_id, program_id + nprog, ...: at decode a call has
a few free rows at most, so the cost is the ownership test of M rows over G slots.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .pipeline import _slot_tiles

FILL_ROWS = gl.constexpr(32)  # rows a block (one warp a row of each 4, lanes over slots or columns)
FILL_SLOTS = gl.constexpr(32)  # slots tested at once
FILL_COLUMNS = gl.constexpr(128)  # columns a store


@gluon.jit
def zero_free_rows(sched, out_ptr):
    """out ([M, N], contiguous) = 0 in the rows no valid slot of `sched` owns, this program's
    share of FILL_ROWS-row blocks (module docstring). Run by one warpgroup after its tiles."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [gl.num_warps(), 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    slot_layout: gl.constexpr = gl.SliceLayout(0, layout)
    M = sched.M
    N = sched.N
    G = sched.G
    zeros = gl.full([FILL_ROWS, FILL_COLUMNS], 0.0, out_ptr.dtype.element_ty, layout)
    for block in range(gl.program_id(0), gl.cdiv(M, FILL_ROWS), gl.num_programs(0)):
        rows = block * FILL_ROWS + gl.arange(0, FILL_ROWS, layout=row_layout)
        owned = (rows >= M).to(gl.int32)  # (rows past M: nothing to write)
        for g0 in range(0, G, FILL_SLOTS):
            # (slots past G repeat slot G - 1: the same rows again)
            g = gl.minimum(g0 + gl.arange(0, FILL_SLOTS, layout=slot_layout), G - 1)
            s, _, _, rows_owned = _slot_tiles(gl.load(sched.a_offsets_ptr + g), gl.load(sched.a_offsets_ptr + g + 1),
                                              gl.load(sched.expert_ids_ptr + g), M, sched.E, 1, 0)
            end = s + rows_owned
            inside = (gl.expand_dims(rows, 1) >= gl.expand_dims(s, 0)) & (gl.expand_dims(rows, 1) < gl.expand_dims(end, 0))
            owned = gl.maximum(owned, gl.max(inside.to(gl.int32), axis=1))
        free = owned == 0
        if gl.max(free.to(gl.int32), axis=0) > 0:
            row_starts = gl.expand_dims(rows.to(gl.int64) * N, 1)
            for c0 in range(0, N, FILL_COLUMNS):
                cols = c0 + gl.arange(0, FILL_COLUMNS, layout=slot_layout)
                gl.store(out_ptr + row_starts + gl.expand_dims(cols, 0), zeros,
                         mask=gl.expand_dims(free, 1) & gl.expand_dims(cols < N, 0))
