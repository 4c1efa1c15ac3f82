"""The fused SwiGLU epilogue of the sm90 kernels (dense.py for bf16, decode.py, mxfp8.py and e2m1.py
for the block formats): the gate/up product never goes to memory.

Per accumulator tile (a warpgroup's [64, W] or, swapped, [W, T] piece of C):
    h = acc * expert_scales[e] + bias[e, n]               fp32, the expert scale first
    gate, up = h[:, 2j], h[:, 2j+1]                       weights permuted by interleave_gate_up
    y = silu(gate) * up | gpt-oss clamped variant          fp32
    y -> bf16, or quantized into the A operand of mxfp8/w4a8 (e4m3, e8m0 per 32), mxfp4
         (e2m1, e8m0 per 32) or nvfp4 (e2m1, e4m3 per 16 times a global fp32)
Scales go to the plain [M, I/vec] layout or the per-group padded swizzled one (scale row of
token m of slot g = 128 * (a_scale_offsets[g] + s // 128) + m - s); the caller zeroes the
scale buffer, so padding rows stay zero. Only rows [s, t) of the group are written.

The accumulator of a swapped tile holds weights along its rows, whose pairs (2j, 2j+1) sit in
lanes 4 apart. The wide mxfp8 tiles and their tails (SHUFFLE_PAIRS) bring them into one thread
by a swap of two bases of the layout within each warp (_row_pairs_layout), i.e. shuffles, and
run the activation there; only its output is converted (below). That saves the 32 KB a
warpgroup that converting the whole fp32 tile through shared memory takes, which would cost the
mxfp8 ring a stage: DeepSeek-V3's fused gate/up step runs at 0.99 of the unfused chain, 0.90
with the conversion. Other swapped tiles convert the tile to a blocked layout of 8 consecutive
weight rows a thread: with shuffles, gpt-oss-120b's mxfp4 step at ~16 tokens a slot (32-token
tiles of the decoding kernel) took 1086 us against 994, the same at ~128 (H100;
docs/perf-notes.md, "The fused SwiGLU epilogue and where it pays").
Normal tiles already hold column pairs in one thread: the activation runs in the accumulator's
layout. Then only the activation's output (half the columns; bf16, or fp32 before quantizing)
is converted, to a blocked layout of 4 columns a thread, for the block maxima and the stores
(converting the whole fp32 accumulator of a normal tile takes 8 rounds through shared
memory, 16 barriers a tile; quantizing in the shuffled layout instead, 16 tokens a
thread with their maxima reduced over warps, made the wide mxfp8 kernel 11000 SASS
instructions long against 9784, the plain epilogue 8792). The quantizer mirrors
kernels/_codecs_tl.py (tl and Gluon cannot share a helper) and moegemm.quantize bit for
bit on the same fp32 input.
"""


import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

# The epilogue's constexpr codes (the same as kernels/_activation_tl.py's).
ACT_SWIGLU = gl.constexpr(1)
ACT_SWIGLU_OAI = gl.constexpr(2)
OUT_BF16 = gl.constexpr(0)
OUT_E4M3_E8M0 = gl.constexpr(2)  # mxfp8, w4a8
OUT_E2M1_E8M0 = gl.constexpr(3)  # mxfp4
OUT_E2M1_E4M3 = gl.constexpr(4)  # nvfp4
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _max_keeping_nan(a, b):
    # As torch's amax and the activation kernel's: a block holding a NaN gets the NaN scale (gl.max
    # drops NaN operands).
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _pow2(e):
    bits = gl.where(e >= -126, (e + 127) << 23, 0x00400000)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _e8m0_exponent(amax, MAX_FINITE: gl.constexpr):
    """Smallest e in [-127, 127] with 2^e * MAX_FINITE >= amax, from amax's bits (the tl twin: _codecs_tl.e8m0_exponent)."""
    bits = amax.to(gl.int32, bitcast=True)
    field = (bits >> 23) & 0xFF
    if MAX_FINITE == 448.0:
        e = field - 135 + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)
    else:
        gl.static_assert(MAX_FINITE == 6.0, "e8m0 exponents for e4m3 (448) or e2m1 (6)")
        e = field - 129 + ((bits & 0x7FFFFF) > 0x400000).to(gl.int32)
    return gl.where(field == 255, 127, gl.maximum(gl.minimum(e, 127), -127))


@gluon.jit
def _encode_e2m1(x):
    mag = gl.abs(x)
    code = ((mag > 0.25).to(gl.int32) + (mag >= 0.75).to(gl.int32) + (mag > 1.25).to(gl.int32)
            + (mag >= 1.75).to(gl.int32) + (mag > 2.5).to(gl.int32) + (mag >= 3.5).to(gl.int32)
            + (mag > 5.0).to(gl.int32))
    return code | ((x.to(gl.int32, bitcast=True) >> 28) & 8)


@gluon.jit
def _decode_e2m1(code):
    """e2m1 code (int32, 0..15) -> fp32 (the tl twin: _codecs_tl.decode_e2m1)."""
    mag = code & 7
    exp = mag >> 1
    man = mag & 1
    normal = (((exp + 126) << 23) | (man << 22)).to(gl.float32, bitcast=True)
    val = gl.where(exp == 0, man.to(gl.float32) * 0.5, normal)
    return gl.where((code & 8) != 0, -val, val)


@gluon.jit
def _e8m0_value(stored):
    """e8m0 byte (int32) -> fp32 2^(b-127): 2^-127 (subnormal) for 0, NaN for 255, as
    kernels/_codecs_tl.decode_e8m0 (what dequantize_rows multiplies by)."""
    bits = gl.where(stored == 0, 0x00400000, stored << 23)
    return gl.where(stored == 255, 0x7FC00000, bits).to(gl.float32, bitcast=True)


@gluon.jit
def _e4m3_bits(x):
    """fp32 -> e4m3fn byte: the hardware conversion rounds to nearest even and saturates."""
    return x.to(gl.float8e4nv).to(gl.uint8, bitcast=True)


@gluon.constexpr_function
def _row_pairs_layout(tokens):
    """The layout of a wgmma accumulator [64 weight rows, tokens] (4 warps of 16 rows) with its
    first register basis (token 1) and third lane basis (weight row 1) exchanged: a thread's
    register pairs hold weight rows 2j, 2j + 1 of one token. Only registers and lanes of a warp
    trade places, so the conversion is shuffles (sm_90 compile at 128 tokens: 32 SHFL, no shared
    memory)."""
    regs = [[1, 0], [8, 0]] + [[0, 8 << i] for i in range((tokens // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [0, 1], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, tokens])


@gluon.jit
def _store_rows(ptr, value, toks, tok_mask, row_stride, cols, col_limit, layout: gl.constexpr):
    """ptr[toks, cols] = value for tokens of the group and cols < col_limit (value in `layout`)."""
    value = gl.convert_layout(value, layout)
    ptrs = ptr + gl.expand_dims(toks.to(gl.int64) * row_stride, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(tok_mask, 1) & gl.expand_dims(cols < col_limit, 0)
    gl.store(ptrs, value, mask=mask)


@gluon.jit
def swiglu_epilogue(acc, out_ptr, out_scale_ptr, bias_ptr, global_ptr, expert_scales_ptr, e, tok0, t, w0, N,
                    scale_row_base, NUM_SCALE_ROWS, NUM_OUT_KB, OUT_KB4, alpha, limit,
                    SWAP: gl.constexpr, HAS_EXPERT_SCALES: gl.constexpr, HAS_BIAS: gl.constexpr,
                    ACT: gl.constexpr, OUT: gl.constexpr, OUT_SWIZZLED: gl.constexpr, VEC: gl.constexpr,
                    SHUFFLE_PAIRS: gl.constexpr = False, DEQUANT: gl.constexpr = False):
    """See the module docstring. acc: [64, W] (tokens x weights) or, SWAP, [W, T]; its tokens
    start at row tok0 (group end t), its weight columns at w0 (even). SHUFFLE_PAIRS (SWAP): a
    swapped tile's row pairs meet by shuffles, else through shared memory. DEQUANT (e8m0
    formats): store the quantized values decoded, bf16(value * 2^e), and no scales: the bf16
    token form of the next product (token_forms.py), which dequantize_rows would build."""
    if HAS_EXPERT_SCALES:
        acc = acc * gl.load(expert_scales_ptr + e)
    if SWAP and SHUFFLE_PAIRS:
        h = gl.permute(gl.convert_layout(acc, _row_pairs_layout(acc.shape[1])), (1, 0))
    elif SWAP:  # 8 consecutive weight rows a thread
        pairs: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        h = gl.convert_layout(gl.permute(acc, (1, 0)), pairs)
    else:
        h = acc  # (a wgmma accumulator thread holds columns 2j and 2j+1 together)
    TR: gl.constexpr = h.shape[0]
    WC: gl.constexpr = h.shape[1]
    OC: gl.constexpr = WC // 2
    if HAS_BIAS:
        wcols = w0 + gl.arange(0, WC, layout=gl.SliceLayout(0, h.type.layout))
        bias = gl.load(bias_ptr + e * N + wcols, mask=wcols < N, other=0.0)
        h = h + gl.expand_dims(bias, 0)
    gate, up = gl.split(gl.reshape(h, [TR, OC, 2]))
    # exp(-x) as exp2(x * -log2(e)), without gl.exp's separate negation: the same ex2 input
    # (gl.exp multiplies by fp32 log2(e)); exp2's ex2.approx.ftz flushes subnormal results, which
    # 1 + exp absorbs, so the sum has the same bits
    if ACT == ACT_SWIGLU:
        y = gate / (1.0 + gl.exp2(gate * -LOG2E)) * up
    else:
        gate = gl.minimum(gate, limit)
        up = gl.minimum(gl.maximum(up, -limit), limit)
        y = gate / (1.0 + gl.exp2((alpha * gate) * -LOG2E)) * (up + 1.0)

    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    toks = tok0 + gl.arange(0, TR, layout=gl.SliceLayout(1, out_layout))
    tok_mask = toks < t
    n_out = N // 2
    col0 = w0 // 2
    cols = col0 + gl.arange(0, OC, layout=gl.SliceLayout(0, out_layout))
    if OUT == OUT_BF16:
        _store_rows(out_ptr, y.to(gl.bfloat16), toks, tok_mask, n_out, cols, n_out, out_layout)
    else:
        y = gl.convert_layout(y, out_layout)
        NBLK: gl.constexpr = OC // VEC
        y3 = gl.reshape(y, [TR, NBLK, VEC])
        amax = gl.reduce(gl.abs(y3), 2, _max_keeping_nan)  # [TR, NBLK]
        if OUT == OUT_E2M1_E4M3:
            g = gl.load(global_ptr)
            stored = _e4m3_bits(gl.div_rn(amax, g * 6.0))
            denom = gl.expand_dims(stored.to(gl.float8e4nv, bitcast=True).to(gl.float32) * g, 2)
            scaled = gl.where(denom > 0, gl.div_rn(y3, denom), 0.0)
        else:
            ex = _e8m0_exponent(amax, 448.0 if OUT == OUT_E4M3_E8M0 else 6.0)
            scaled = y3 * gl.expand_dims(_pow2(-ex), 2)
            stored = gl.where(amax < float("inf"), ex + 127, 255).to(gl.uint8)  # inf, NaN: the NaN scale
        if DEQUANT:
            gl.static_assert(OUT == OUT_E4M3_E8M0 or OUT == OUT_E2M1_E8M0, "token forms: e8m0 formats only")
            if OUT == OUT_E4M3_E8M0:  # (the hardware decode, as dequantize_rows' on the GPU)
                values = _e4m3_bits(scaled).to(gl.float8e4nv, bitcast=True).to(gl.float32)
            else:
                values = _decode_e2m1(_encode_e2m1(scaled))
            values = values * gl.expand_dims(_e8m0_value(stored.to(gl.int32)), 2)
            _store_rows(out_ptr, gl.reshape(values, [TR, OC]).to(gl.bfloat16), toks, tok_mask, n_out, cols, n_out,
                        out_layout)
            return
        if OUT == OUT_E4M3_E8M0:
            data = gl.reshape(_e4m3_bits(scaled), [TR, OC])
            _store_rows(out_ptr, data, toks, tok_mask, n_out, cols, n_out, out_layout)
        else:
            low, high = gl.split(gl.reshape(_encode_e2m1(scaled), [TR, OC // 2, 2]))
            packed = (low | (high << 4)).to(gl.uint8)
            half_layout: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])
            hcols = col0 // 2 + gl.arange(0, OC // 2, layout=gl.SliceLayout(0, half_layout))
            htoks = tok0 + gl.arange(0, TR, layout=gl.SliceLayout(1, half_layout))
            _store_rows(out_ptr, packed, htoks, htoks < t, n_out // 2, hcols, n_out // 2, half_layout)
        scale_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // NBLK, NBLK], [4, 1], [1, 0])
        stored = gl.convert_layout(stored, scale_layout)
        stoks = tok0 + gl.arange(0, TR, layout=gl.SliceLayout(1, scale_layout))
        kb = col0 // VEC + gl.arange(0, NBLK, layout=gl.SliceLayout(0, scale_layout))
        kb2 = gl.expand_dims(kb, 0)
        if OUT_SWIZZLED:
            srow = gl.expand_dims((stoks + scale_row_base).to(gl.int64), 1)
            offset = ((srow // 128) * OUT_KB4 + kb2 // 4) * 512 + (srow % 32) * 16 + ((srow % 128) // 32) * 4 + kb2 % 4
            row_ok = gl.expand_dims((stoks < t) & (stoks + scale_row_base < NUM_SCALE_ROWS), 1)
        else:
            offset = gl.expand_dims(stoks.to(gl.int64) * NUM_OUT_KB, 1) + kb2
            row_ok = gl.expand_dims(stoks < t, 1)
        gl.store(out_scale_ptr + offset, stored, mask=row_ok & (kb2 < NUM_OUT_KB))


@aggregate
class Swiglu:
    """The fused epilogue's settings, typed (the kernels take them as `epi`, runtime values, and
    `EPI`, constexprs; EpilogueSpec.kernel_args on the host makes both). ACT == 0: no fused
    epilogue (the plain one runs; the runtime values are placeholders)."""

    out_scale_ptr: gl.tensor
    bias_ptr: gl.tensor
    global_ptr: gl.tensor
    a_scale_offsets_ptr: gl.tensor
    num_scale_rows: gl.tensor
    num_out_kb: gl.tensor
    out_kb4: gl.tensor
    alpha: gl.tensor
    limit: gl.tensor
    ACT: gl.constexpr
    OUT: gl.constexpr
    OUT_SWIZZLED: gl.constexpr
    HAS_BIAS: gl.constexpr
    VEC: gl.constexpr
    DEQUANT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, out_scale_ptr, bias_ptr, global_ptr, a_scale_offsets_ptr, num_scale_rows, num_out_kb, out_kb4,
                 alpha, limit, ACT, OUT, OUT_SWIZZLED, HAS_BIAS, VEC, DEQUANT):
        self.out_scale_ptr = out_scale_ptr
        self.bias_ptr = bias_ptr
        self.global_ptr = global_ptr
        self.a_scale_offsets_ptr = a_scale_offsets_ptr
        self.num_scale_rows = num_scale_rows
        self.num_out_kb = num_out_kb
        self.out_kb4 = out_kb4
        self.alpha = alpha
        self.limit = limit
        self.ACT = gl.constexpr(ACT)
        self.OUT = gl.constexpr(OUT)
        self.OUT_SWIZZLED = gl.constexpr(OUT_SWIZZLED)
        self.HAS_BIAS = gl.constexpr(HAS_BIAS)
        self.VEC = gl.constexpr(VEC)
        self.DEQUANT = gl.constexpr(DEQUANT)

    @gluon.jit
    def create(epi, EPI: gl.constexpr):
        """From the kernel arguments: epi = (out_scale_ptr, bias_ptr, global_ptr, a_scale_offsets_ptr,
        num_scale_rows, num_out_kb, out_kb4, alpha, limit), EPI = (ACT, OUT, OUT_SWIZZLED, HAS_BIAS,
        VEC, DEQUANT), in EpilogueSpec.kernel_args' order."""
        return Swiglu(epi[0], epi[1], epi[2], epi[3], gl.to_tensor(epi[4]), gl.to_tensor(epi[5]),
                      gl.to_tensor(epi[6]), gl.to_tensor(epi[7]), gl.to_tensor(epi[8]), EPI[0], EPI[1], EPI[2], EPI[3],
                      EPI[4], EPI[5])

    @gluon.jit
    def store(self, acc, out, slot, tok0, w0, N, SWAP: gl.constexpr, SHUFFLE_PAIRS: gl.constexpr = False):
        """swiglu_epilogue of a tile of `slot` (tokens from tok0, weight columns from w0) into
        out.out_ptr, scaled by out's expert scales."""
        if self.OUT_SWIZZLED:
            scale_row_base = 128 * (gl.load(self.a_scale_offsets_ptr + slot.g) + slot.s // 128) - slot.s
        else:
            scale_row_base = slot.s * 0
        swiglu_epilogue(acc, out.out_ptr, self.out_scale_ptr, self.bias_ptr, self.global_ptr, out.expert_scales_ptr,
                        slot.e, tok0, slot.t, w0, N, scale_row_base, self.num_scale_rows, self.num_out_kb,
                        self.out_kb4, self.alpha, self.limit, SWAP, out.HAS_EXPERT_SCALES, self.HAS_BIAS, self.ACT,
                        self.OUT, self.OUT_SWIZZLED, self.VEC, SHUFFLE_PAIRS, self.DEQUANT)
