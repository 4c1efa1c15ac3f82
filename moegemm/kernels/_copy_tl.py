"""Copies of up to three contiguous tensors in one launch, in portable Triton (tl): the
inputs of a replayed CUDA graph copied into its buffers (kernels/copies.py).

Executed twice as the other tl files (compiled and interpreted, kernels/tl_source.py).
"""

import triton
import triton.language as tl


@triton.jit
def copy_kernel(dst0, src0, n0, dst1, src1, n1, dst2, src2, n2, BLOCK: tl.constexpr):
    """dst_i[:n_i] = src_i[:n_i] (elements of each pair's dtype) for i = 0, 1, 2; program p copies
    elements [p*BLOCK, (p+1)*BLOCK) of each (a pair with n_i = 0 copies nothing)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst0 + offsets, tl.load(src0 + offsets, mask=offsets < n0), mask=offsets < n0)
    tl.store(dst1 + offsets, tl.load(src1 + offsets, mask=offsets < n1), mask=offsets < n1)
    tl.store(dst2 + offsets, tl.load(src2 + offsets, mask=offsets < n2), mask=offsets < n2)
