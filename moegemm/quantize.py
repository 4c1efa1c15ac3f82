"""Block quantizers and dequantizers for every format (pure PyTorch, any device).

reference_quantize(x, fmt) activations [M, K]   -> A operand + A scales (the reference of
                                                   moegemm.quantize, token_quantizers.py, which
                                                   runs one kernel pass on CUDA with these bytes)
quantize_weights(w, fmt)  weights     [E, N, K] -> B operand + B scales
dequantize(q)             either one            -> fp32 values (global scale included)
prepack_weights(w)        B operand             -> its codes in the sm90 decoding kernel's order

Each returns or takes a QuantizedTensor (quantized_tensor.py).

Encodings per docs/contract.md section 3 (codecs.py holds the element rules):
- fp8_block: scale = amax / 448 in fp32 per 1x128 (A) or 128x128 (B) block (partial edge
  blocks use the elements present); element = e4m3(x / scale); an all-zero block has scale 0.
- mxfp8 / mxfp4 / w4a8: scale = smallest power of two >= amax / max_finite (e8m0);
  element = encode(x / scale), which is exact division by a power of two.
- nvfp4: global = amax(tensor or expert) / (448 * 6) (1 if that amax is 0, or user given);
  block scale = e4m3(amax_block / (6 * global)); element = e2m1(x / (scale * global)).
  `global_scale` is returned so the caller can fold A's and B's into `expert_scales`.
- bf16 and the activations of the weight-only formats (bf16_mxfp4, bf16_nvfp4, bf16_mxfp8):
  the values rounded to bf16, no scales. Their weights are those of mxfp4, nvfp4 and mxfp8.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import codecs, layouts, prepack
from .formats import E2M1, E4M3, SWIZZLE_FORMATS, Format, OperandFormat, get_format
from .quantized_tensor import QuantizedTensor
from .token_forms import dequantize_tokens

__all__ = [
    "check_activations",
    "check_scale_layout",
    "dequantize",
    "dequantize_operand",
    "prepack_weights",
    "quantize_weights",
    "reference_quantize",
    "unpack_weights",
]

_NVFP4_GLOBAL_DIVISOR = 448.0 * 6.0  # e4m3 max times e2m1 max


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks_along_k(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """[..., K] -> [..., ceil(K/block_k), block_k], zero-padded (zeros never raise an amax)."""
    k = x.shape[-1]
    pad = _cdiv(k, block_k) * block_k - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_k, block_k)


def _encode_elements(values: torch.Tensor, operand: OperandFormat) -> torch.Tensor:
    """Scaled fp32 values [..., K] -> stored elements (e4m3 tensor or packed e2m1 bytes)."""
    if operand.element is E4M3:
        return codecs.encode_e4m3(values)
    return codecs.pack_fp4(codecs.encode_e2m1(values))


def _decode_elements(data: torch.Tensor, operand: OperandFormat) -> torch.Tensor:
    if operand.element is E4M3:
        return codecs.decode_e4m3(data)
    if operand.element is E2M1:
        return codecs.decode_e2m1(codecs.unpack_fp4(data))
    return data.float()


def absolute_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| over all of x as a 0-d fp32 tensor (0 for an empty x; NaN where x holds one), read
    once in x's own dtype: no |x| or fp32 copy (the abs and the max are exact in any float dtype)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    low, high = torch.aminmax(x)
    return torch.maximum(-low, high).float()


def nvfp4_global_scale(x: torch.Tensor, dims: tuple[int, ...] = ()) -> torch.Tensor:
    """nvfp4's global scale: amax(|x|) over `dims` (all when empty) / (448 * 6), correctly rounded
    on every device; 1 where the amax is 0 or NaN, or nothing is there (over all dims: absolute_max)."""
    if x.numel() == 0:
        shape = [size for d, size in enumerate(x.shape) if dims and d not in dims]
        return torch.ones(shape, dtype=torch.float32, device=x.device)
    amax = x.abs().amax(dim=dims).float() if dims else absolute_max(x)
    return torch.where(amax > 0, _divided(amax, _NVFP4_GLOBAL_DIVISOR), torch.ones_like(amax))


def _divided(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor correctly rounded on every device: torch's CUDA division by a Python number
    multiplies by its reciprocal (1 ulp off the quotient, which moves e4m3 codes across ties),
    not by a tensor of the same values."""
    return t / torch.full_like(t, divisor)


def _quantize_rows(x: torch.Tensor, operand: OperandFormat, global_scale: torch.Tensor | None):
    """Quantize [..., R, K] with one scale per (row, K block); returns (data, plain scales).

    global_scale (nvfp4) broadcasts against [..., R, nkb].
    """
    blocks = _blocks_along_k(x, operand.block_k)  # [..., R, nkb, vec]
    amax = blocks.abs().amax(dim=-1)  # [..., R, nkb]
    maxf = operand.element.max_finite
    if operand.scale == "e8m0":
        scale_bytes = codecs.encode_e8m0(amax, maxf)
        scale = codecs.decode_e8m0(scale_bytes)
        scaled = blocks * scale.unsqueeze(-1).reciprocal()  # exact: a power of two
        stored_scales = scale_bytes.view(torch.float8_e8m0fnu)
    elif operand.scale == "e4m3":
        stored_scales = codecs.encode_e4m3(amax / (global_scale * 6.0))
        denom = (codecs.decode_e4m3(stored_scales) * global_scale).unsqueeze(-1)
        scaled = torch.where(denom > 0, blocks / denom, torch.zeros_like(blocks))
    else:  # fp8_block activations: fp32 amax / 448
        scale = _divided(amax, maxf)
        denom = scale.unsqueeze(-1)
        scaled = torch.where(denom > 0, blocks / denom, torch.zeros_like(blocks))
        stored_scales = scale
    k = x.shape[-1]
    scaled = scaled.reshape(*scaled.shape[:-2], scaled.shape[-2] * scaled.shape[-1])[..., :k]
    return _encode_elements(scaled, operand), stored_scales


def _quantize_fp8_block_weights(w: torch.Tensor, operand: OperandFormat):
    """[E, N, K] with one fp32 scale per 128x128 (N x K) block -> (e4m3 data, [E, nN, nK])."""
    e, n, k = w.shape
    bn, bk = operand.block_n, operand.block_k
    pn, pk = _cdiv(n, bn) * bn - n, _cdiv(k, bk) * bk - k
    padded = torch.nn.functional.pad(w, (0, pk, 0, pn))
    tiles = padded.reshape(e, _cdiv(n, bn), bn, _cdiv(k, bk), bk)
    scale = _divided(tiles.abs().amax(dim=(2, 4)), operand.element.max_finite)  # [E, nN, nK]
    denom = scale[:, :, None, :, None]
    scaled = torch.where(denom > 0, tiles / denom, torch.zeros_like(tiles))
    scaled = scaled.reshape(e, padded.shape[1], padded.shape[2])[:, :n, :k]
    return codecs.encode_e4m3(scaled), scale


def _prepared_weights(w, fmt: str, scale_layout):
    """(format, ScaleLayout, w as fp32, the QuantizedTensor when the weights are unscaled bf16:
    bf16's) of quantize_weights' checked input [E, N, K]."""
    f = get_format(fmt)
    _check_float_input(w, "w", 3, f, f.b)
    layout = check_scale_layout(f, scale_layout)
    w = w.float()
    if f.b.scale is None:
        return f, layout, w, QuantizedTensor(w.to(torch.bfloat16).contiguous(), None, f.name, "b", layout)
    return f, layout, w, None


def _check_float_input(x: torch.Tensor, name: str, ndim: int, fmt: Format, operand: OperandFormat):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() != ndim:
        weights = (" (the shape of weights [E, N, K]: quantize_weights quantizes weights)"
                   if (ndim, x.dim()) == (2, 3) else "")
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}{weights}")
    k = x.shape[-1]
    if k % fmt.k_multiple:
        raise ValueError(f"{name}: K must be a multiple of {fmt.k_multiple} for {fmt.name}, got K={k}")


def _check_global_scale(global_scale, expected_numel: int, device) -> torch.Tensor:
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.numel() != expected_numel:
        raise ValueError(f"global_scale: expected {expected_numel} value(s), got shape {tuple(g.shape)}")
    return g.reshape(-1) if expected_numel > 1 else g.reshape(())


def check_activations(x, fmt: str, scale_layout, a_offsets,
                      global_scale) -> tuple[Format, layouts.ScaleLayout, torch.Tensor | None]:
    """The checks of moegemm.quantize's arguments (either backend), in this order: fmt; x
    (activations [M, K] of a floating dtype, K a multiple of the format's); scale_layout;
    a_offsets where swizzled scales need them; nvfp4's global_scale where given. Returns the
    format, the ScaleLayout, and that global scale as a 0-d fp32 tensor on x's device (None
    where not given or where the format's activations have none)."""
    f = get_format(fmt)
    _check_float_input(x, "x", 2, f, f.a)
    layout = check_scale_layout(f, scale_layout)
    if f.a.scale is None:
        return f, layout, None
    if layout.swizzled and a_offsets is None:
        raise ValueError("a_offsets: required to place activation scales in the swizzled layout (quantize takes "
                         "activations [M, K]; weights [E, N, K] go through quantize_weights)")
    if f.a.global_scale and global_scale is not None:
        return f, layout, _check_global_scale(global_scale, 1, x.device)
    return f, layout, None


def reference_quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    scale_layout: str = "plain",
    a_offsets: torch.Tensor | None = None,
    num_scale_blocks: int | None = None,
    global_scale: torch.Tensor | float | None = None,
) -> QuantizedTensor:
    """Quantize activations [M, K] into the A operand of `fmt`, in PyTorch on any device: the
    reference of moegemm.quantize (moegemm.reference.quantize; `backend="reference"` there).

    scale_layout="swizzled" places each group's scale rows by `a_offsets` (required); rows
    outside every slot get no scales. num_scale_blocks may give the first dimension (an upper
    bound) so that no device value is read; left out, it is the blocks the groups need (read
    from a_offsets). nvfp4 uses one global scale for the whole tensor (computed, or
    `global_scale`). bf16 and the weight-only formats (bf16 activations) return x rounded to
    bf16, without scales.
    """
    f, layout, given_global = check_activations(x, fmt, scale_layout, a_offsets, global_scale)
    operand = f.a
    x = x.float()
    if operand.scale is None:
        return QuantizedTensor(x.to(torch.bfloat16).contiguous(), None, f.name, "a", layout)
    gscale = None
    if operand.global_scale:
        gscale = nvfp4_global_scale(x) if given_global is None else given_global
    data, scales = _quantize_rows(x, operand, gscale)
    if layout.swizzled:
        scales = layout.a_from_plain(scales, a_offsets, num_scale_blocks)
        return QuantizedTensor(data.contiguous(), scales.contiguous(), f.name, "a", layout, gscale, a_offsets,
                               layouts.a_scale_offsets(a_offsets))
    return QuantizedTensor(data.contiguous(), scales.contiguous(), f.name, "a", layout, gscale)


def quantize_weights(
    w: torch.Tensor,
    fmt: str,
    *,
    scale_layout: str = "plain",
    global_scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize expert weights [E, N, K] into the B operand of `fmt`.

    nvfp4 and bf16_nvfp4 use one global scale per expert (computed from the expert's amax, or
    given as [E]). A weight-only format's weights are the bytes of its block format's (bf16_mxfp4
    those of mxfp4, ...).
    """
    f, layout, w, bf16 = _prepared_weights(w, fmt, scale_layout)
    if bf16 is not None:
        return bf16
    operand = f.b
    if operand.block_n > 1:
        data, scales = _quantize_fp8_block_weights(w, operand)
        return QuantizedTensor(data.contiguous(), scales.contiguous(), f.name, "b", layout)
    gscale = None
    if operand.global_scale:
        e = w.shape[0]
        gscale = (nvfp4_global_scale(w, (1, 2)) if global_scale is None
                  else _check_global_scale(global_scale, e, w.device))
    data, scales = _quantize_rows(w, operand, None if gscale is None else gscale.reshape(-1, 1, 1))
    scales = layout.b_from_plain(scales)
    return QuantizedTensor(data.contiguous(), scales.contiguous(), f.name, "b", layout, gscale)


def check_scale_layout(f: Format, scale_layout, forms: bool = False) -> layouts.ScaleLayout:
    """The ScaleLayout of a scale_layout argument for format f: "plain", "swizzled" (for the
    formats that have it), a ScaleLayout, or a TokenForm where `forms` (token_forms checks it
    further); else ValueError naming scale_layout."""
    layout = layouts.scale_layout_of(scale_layout, forms=forms)
    if layout.swizzled and f.scaled and not f.swizzle_capable:
        raise ValueError(f"scale_layout: 'swizzled' is defined for {', '.join(SWIZZLE_FORMATS)}; {f.name} uses 'plain'")
    return layout


def dequantize_operand(
    data: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: str | Format,
    operand: str,
    *,
    scale_layout: str = "plain",
    a_offsets: torch.Tensor | None = None,
    a_scale_offsets: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode an operand as `grouped_matmul` reads it: elements times block scales (times global).

    A in the swizzled layout or a token form needs `a_offsets` (and honours `a_scale_offsets`);
    rows outside every slot have no scales and decode to zero.
    """
    f = get_format(fmt)
    layout = layouts.scale_layout_of(scale_layout)
    if layout.form is not None:
        return dequantize_tokens(data, scales, layout.form, a_offsets, dtype)
    op = f.a if operand == "a" else f.b
    values = _decode_elements(data, op).to(dtype)
    if op.scale is None:
        return values
    k = values.shape[-1]
    nkb = _cdiv(k, op.block_k)
    if op.block_n > 1:  # fp8_block weights: [E, nN, nK] -> per element
        s = scales.to(dtype).repeat_interleave(op.block_n, dim=1)[:, : values.shape[1]]
    else:
        if operand == "a":
            s = layout.a_to_plain(scales, a_offsets, values.shape[0], nkb, a_scale_offsets)
        else:
            s = layout.b_to_plain(scales, values.shape[1], nkb)
        s = _decode_scales(s, op).to(dtype)
    s = s.repeat_interleave(op.block_k, dim=-1)[..., :k]
    out = values * s
    if global_scale is not None:
        g = global_scale.to(dtype)
        out = out * (g.reshape(-1, 1, 1) if g.dim() == 1 else g)
    return out


def _decode_scales(s: torch.Tensor, op: OperandFormat) -> torch.Tensor:
    if op.scale == "e8m0":
        return codecs.decode_e8m0(s)
    if op.scale == "e4m3":
        return codecs.decode_e4m3(s)
    return s.float()


def prepack_weights(w: QuantizedTensor) -> QuantizedTensor:
    """quantize_weights' output with its codes reordered once into the order the sm90 decoding
    kernel reads (moegemm.prepack: each thread's share of a weight step in one load, already the
    wgmma's register operand); same shapes, dtypes and scales. Formats: formats.PREPACK_FORMATS;
    N and K multiples of 64. Every backend takes the result (the reference and portable kernels
    unpack it first: a copy a call); unpack_weights undoes it bit for bit."""
    if not isinstance(w, QuantizedTensor) or w.operand != "b":
        raise TypeError(f"w: expected the QuantizedTensor of moegemm.quantize_weights, got {type(w).__name__}"
                        + (f" of operand {w.operand!r}" if isinstance(w, QuantizedTensor) else ""))
    if w.prepacked:
        raise ValueError("w: already prepacked")
    prepack.check_prepackable(w.fmt, w.data.shape, "w")
    return replace(w, data=prepack.prepack_codes(w.data), prepacked=True)


def unpack_weights(w: QuantizedTensor) -> QuantizedTensor:
    """The plain order of prepack_weights' output (bit for bit what quantize_weights gave)."""
    if not isinstance(w, QuantizedTensor) or not w.prepacked:
        raise ValueError("w: expected a QuantizedTensor of prepack_weights")
    return replace(w, data=prepack.unpack_codes(w.data), prepacked=False)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a QuantizedTensor back to real values (its global scale included)."""
    if q.prepacked:
        q = unpack_weights(q)
    return dequantize_operand(
        q.data,
        q.scales,
        q.fmt,
        q.operand,
        scale_layout=q.scale_layout,
        a_offsets=q.a_offsets,
        a_scale_offsets=q.a_scale_offsets,
        global_scale=q.global_scale,
        dtype=dtype,
    )
