"""The fused SwiGLU epilogue's policy at op level: which problems and outputs it takes, where it
pays, and the output it allocates (the device code is kernels/sm90/swiglu.py).
"""

from __future__ import annotations

import math

import torch

from . import layouts
from .config import sm90_mx_config
from .formats import E2M1, E4M3, get_format
from .kernels import sm90
from .quantized_tensor import QuantizedTensor, allocate_a_operand, as_quantized
from .sm90_configs import MX_FORMATS, E2m1Config, Mxfp8Config
from .token_forms import TokenForm


def out_kind(out_fmt: str) -> tuple[int, int]:
    """(OUT code, scale block) of out_fmt's A operand (bf16 for bf16 and the weight-only formats);
    OUT -1 when the epilogue cannot produce it."""
    op = get_format(out_fmt).a
    if op.scale is None:
        return sm90.OUT_BF16.value, 32
    if op.scale == "e8m0":
        return (sm90.OUT_E4M3_E8M0 if op.element is E4M3 else sm90.OUT_E2M1_E8M0).value, op.block_k
    if op.scale == "e4m3" and op.element is E2M1:
        return sm90.OUT_E2M1_E4M3.value, op.block_k
    return -1, 0  # fp8_block: a 1x128 block spans two 64-wide output tiles


def fused_supports(p, out_fmt: str) -> bool:
    """The fused path: bf16 or a block format in, a bf16/MX/NV A operand out, I % 64 == 0."""
    return sm90.fused_supports(p) and out_kind(out_fmt)[0] >= 0


def fused_pays(fmt_name: str, n: int, k: int, tokens_per_slot: float, prepacked: bool = False) -> bool:
    """False where the fused epilogue measured slower than the unfused chain it replaces, so
    that the MoE layer (moe/forward.py) runs the chain there (H100, docs/perf-notes.md):
    - mxfp8 weights on 128-token promotion tiles (prefill): DeepSeek-V3's gate/up product at
      4096 tokens took 9.69 ms fused, 7.22 ms unfused (product, then swiglu_quantize); the ring
      depth made no difference, 64-token promotion tiles took 8.88 ms fused. With the tails of
      the unfused kernel (up to 32 more tokens on a slot's last tile; 4 stages instead of 5) the
      fused step was 0.94-0.95x the unfused one, and the layer 0.96x; with the row pairs by
      shuffles and the ring's fifth stage, 0.99x (5148 against 5094 us; docs/perf-notes.md, the fused
      SwiGLU epilogue).
    - e2m1 weights on the split-K promotion kernel (mxfp4/w4a8 at decode) from half a token a
      slot on: gpt-oss-120b's gate/up step at 64 tokens (2 a slot) took 428 us fused, 404 us
      unfused; on 8-token tiles the epilogue's layout conversions and quantization cost about a
      microsecond a tile, ~38 tiles an SM. At 1 token (0.03 a slot, one or two tiles an SM) the
      fused step was faster, 59.8 against 66.1 us."""
    if fmt_name not in MX_FORMATS:
        return True
    cfg = sm90_mx_config(get_format(fmt_name), n, k, tokens_per_slot, prepacked=prepacked)
    if isinstance(cfg, E2m1Config) and cfg.split_k:
        return tokens_per_slot < 0.5
    return not (isinstance(cfg, Mxfp8Config) and cfg.token_tile == 128)


def launch_fused(kernel: sm90.KernelPlan | None, p, a, b, a_scales, b_scales, a_offsets, expert_ids, a_scale_offsets,
                 expert_scales, bias, *, out_fmt, activation, out_scale_layout, num_scale_blocks, out_global_scale,
                 alpha, limit, tokens=None, out_form: TokenForm | None = None):
    """Allocate the quantized output (scales zeroed) and run the matmul with the fused epilogue:
    problem p's launch planned with it (`kernel`, sm90.plan with fused=True).
    `tokens`: A in the form its sm90 kernel reads (token_forms.py), a and a_scales then unused.
    `out_form`: the output in that token form instead (the bf16 form only: the quantized values
    decoded, for the down product's kernel), rows outside the slots unwritten. Returns the
    output as a QuantizedTensor (of scale_layout out_form where given)."""
    f = get_format(out_fmt)
    out_code, vec = out_kind(out_fmt)
    swizzled = layouts.scale_layout_of(out_scale_layout).swizzled and f.a.scale is not None
    if out_form is not None:
        if out_form.kind != "bf16" or f.a.scale != "e8m0":
            raise ValueError(f"out_form: the fused epilogue writes the bf16 token form of an e8m0 format, "
                             f"not the {out_form.kind} form of {f.name}")
        swizzled, num_scale_rows = False, 0
        data, scales = torch.empty(p.m, p.n // 2, dtype=torch.bfloat16, device=b.device), None
    else:
        data, scales, num_scale_rows = allocate_a_operand(f, p.m, p.n // 2, swizzled, num_scale_blocks,
                                                          p.num_groups, b.device)
    nkb = math.ceil(p.n // 2 / vec) if f.a.scale is not None else 0
    if f.a.global_scale:
        if out_global_scale is None:
            raise ValueError("out_global_scale: nvfp4 output from the fused epilogue needs a static global scale")
        out_global_scale = torch.as_tensor(out_global_scale, dtype=torch.float32, device=b.device).reshape(())
    if swizzled and a_scale_offsets is None:
        a_scale_offsets = layouts.a_scale_offsets(a_offsets)
    if bias is not None:
        bias = bias.float().contiguous()
    epilogue = sm90.EpilogueSpec(
        out_scale=scales if scales is not None else data, bias=bias, global_scale=out_global_scale,
        a_scale_offsets=a_scale_offsets, num_scale_rows=num_scale_rows, num_out_kb=nkb, out_kb4=math.ceil(nkb / 4),
        alpha=float(alpha), limit=float(limit),
        act=(sm90.ACT_SWIGLU if activation == "swiglu" else sm90.ACT_SWIGLU_OAI).value, out_code=out_code,
        out_swizzled=swizzled, vec=vec, dequant=out_form is not None,
    )
    sm90.launch(kernel, sm90.LaunchArgs(a, b, a_scales, b_scales, a_offsets, expert_ids, data,
                                        a_scale_offsets=a_scale_offsets, expert_scales=expert_scales,
                                        epilogue=epilogue, tokens=tokens))
    if out_form is not None:
        return QuantizedTensor(data, None, f.name, "a", out_form, None, a_offsets)
    return as_quantized(f, data, scales, swizzled, out_global_scale, a_offsets, a_scale_offsets)
