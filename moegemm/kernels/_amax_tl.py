"""max |x| of tokens as fp32 bits, in portable Triton (tl): nvfp4's default global scale of the
tokens (kernels/quantize_kernels.py, tokens_amax_bits), one pass over x without a copy.

Executed twice as the other tl files (compiled and interpreted, kernels/tl_source.py), so it
calls no @triton.jit function of Triton's standard library, only builtins and the helper below.
"""

import triton
import triton.language as tl


@triton.jit
def _max_abs(a, b):
    return tl.maximum(a, b)


@triton.jit
def absolute_max_bits_kernel(x_ptr, out_ptr, ROWS, K, X_STRIDE, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 bits of max |x| over x [ROWS, K] (row stride X_STRIDE), into out[0] (int32, zero
    before) by one atomic max a program. Integer maxima of the magnitudes' bits order them as the
    values (and put a NaN above inf, where the GPU's float maximum would drop it). Program (i, j):
    rows [i*BLOCK_R, (i+1)*BLOCK_R), columns [j*BLOCK_K, (j+1)*BLOCK_K)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < ROWS)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * X_STRIDE + cols[None, :], mask=mask, other=0.0)
    bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(out_ptr, tl.reduce(tl.reduce(bits, 1, _max_abs), 0, _max_abs))
