"""Checkpoint tensors -> the layer's expert weights: pure functions, shared by moegemm.MoE's loaders
and the transformers backend's conversion (moegemm/hf/).

    from_float(gate_up=..., down=..., ...)        float weights, quantized into the format
    from_fp8_block(gate=..., up=..., ...)         DeepSeek FP8 blocks, kept or requantized
    from_mxfp4(gate_up_blocks=..., ...)           gpt-oss MXFP4 blocks, kept or requantized

Each returns ExpertWeights: w_gate_up [E, 2I, H] and w_down [E, H, I] in the format's B operand,
and the biases in fp32 in w_gate_up's row order. The layouts a format's weights take in the layer
are fixed by the format (gate_up_layout, weight_scale_layout); whether the codes are kept in the
prepacked order is keeps_prepacked's choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from ..gate_up import deinterleave_gate_up, interleave_gate_up
from .. import layouts
from ..formats import PREPACK_BY_DEFAULT, PREPACK_FORMATS, get_format
from ..ops import available_backends
from ..prepack import PREPACK_K, PREPACK_ROWS
from ..quantize import dequantize_operand, prepack_weights, quantize_weights
from ..quantized_tensor import QuantizedTensor

__all__ = ["QUANTIZE_CHUNK", "ExpertWeights", "WeightForm", "check_sizes", "check_weight", "fp8_block_kept",
           "from_float", "from_fp8_block", "from_mxfp4", "gate_up_layout", "keeps_prepacked", "weight_scale_layout"]

# Weights a chunk of from_float's quantization holds (2^23: 32 MiB in fp32; _quantize_experts).
QUANTIZE_CHUNK = 1 << 23


def weight_scale_layout(fmt: str) -> layouts.ScaleLayout:
    """The scale layout of the layer's weights in fmt: swizzled where the format has it."""
    return layouts.SWIZZLED if get_format(fmt).swizzle_capable else layouts.PLAIN


def gate_up_layout(fmt: str) -> str:
    """The order of the layer's gate/up rows in fmt: fp8_block keeps DeepSeek's [gate; up] (its
    128x128 scale blocks stay whole), every other format interleaves them (the fused epilogue's)."""
    return "concat" if fmt == "fp8_block" else "interleaved"


def check_sizes(fmt: str, hidden_size: int, intermediate_size: int) -> None:
    """ValueError unless both sizes are multiples of fmt's K multiple."""
    f = get_format(fmt)
    for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if size % f.k_multiple:
            raise ValueError(f"{name}: must be a multiple of {f.k_multiple} for {f.name}, got {size}")


def keeps_prepacked(prepack: bool | None, backend: str, fmt: str, n: int, k: int, device: torch.device) -> bool:
    """Whether weights [E, n, k] of fmt on `device` are kept prepacked: prepack False never; True
    for every format of PREPACK_FORMATS where n and k allow; None for those of PREPACK_BY_DEFAULT
    where the sm90 decoding kernel reads them (a Hopper GPU, backend "auto" or "sm90")."""
    if prepack is False or fmt not in PREPACK_FORMATS:
        return False
    if prepack is None and fmt not in PREPACK_BY_DEFAULT:
        return False
    if n % PREPACK_ROWS or k % PREPACK_K:
        return False
    return bool(prepack) or (backend in ("auto", "sm90") and "sm90" in available_backends(device))


class WeightForm(NamedTuple):
    """What the weights are made into: the format, and the prepack choice (keeps_prepacked)."""
    fmt: str
    prepack: bool | None = None
    backend: str = "auto"

    def stored(self, q: QuantizedTensor) -> QuantizedTensor:
        """q in the code order this form keeps."""
        if not q.prepacked and keeps_prepacked(self.prepack, self.backend, q.fmt, q.data.shape[1], q.k,
                                               q.data.device):
            return prepack_weights(q)
        return q


class ExpertWeights(NamedTuple):
    """A layer's expert weights (B operands of its format) and biases (fp32, or None)."""
    w_gate_up: QuantizedTensor
    w_down: QuantizedTensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def check_weight(name: str, w, shape: tuple, hint: str = "") -> None:
    """TypeError unless w is a tensor, ValueError unless of `shape` (hint: said after the shape)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}{hint}, got {tuple(w.shape)}")


def _arrange(gate: torch.Tensor, up: torch.Tensor, fmt: str) -> torch.Tensor:
    """gate, up [E, I, X] -> the [E, 2I, X] row order of fmt (gate_up_layout)."""
    if gate_up_layout(fmt) == "concat":
        return torch.cat((gate, up), dim=1)
    return interleave_gate_up(gate.contiguous(), up.contiguous())


def _quantize_experts(experts: Callable[[int, int], torch.Tensor], count: int, size: int,
                      form: WeightForm) -> QuantizedTensor:
    """Quantize (and prepack, as WeightForm.stored would) `count` experts a chunk at a time:
    experts(first, last) gives float weights [last - first, N, K] of `size` = N * K elements an
    expert. The quantizers' temporaries are a few fp32 copies of their input, GBs for a whole
    layer of a large model (Qwen3-30B-A3B's gate/up: 1.6 GB in fp32), so each chunk holds at most
    QUANTIZE_CHUNK elements, written into tensors allocated once for the layer. Exact:
    quantization, nvfp4's global scale and the prepacked order are each expert's own."""
    step = max(1, QUANTIZE_CHUNK // max(size, 1))
    whole = None
    for first in range(0, count, step):
        last = min(first + step, count)
        q = form.stored(quantize_weights(experts(first, last).float(), form.fmt,
                                         scale_layout=weight_scale_layout(form.fmt)))
        if first == 0 and last == count:
            return q
        if whole is None:
            grown = lambda t: None if t is None else t.new_empty((count, *t.shape[1:]))  # noqa: E731
            whole = replace(q, data=grown(q.data), scales=grown(q.scales), global_scale=grown(q.global_scale))
        for part, into in ((q.data, whole.data), (q.scales, whole.scales), (q.global_scale, whole.global_scale)):
            if part is not None:
                into[first:last].copy_(part)
    return whole


def _bias(t) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()  # (a checkpoint's Parameter: no grad)


def _checked_biases(gate_up_bias, down_bias, sizes: tuple[int, int, int], hint: str = "") -> tuple:
    """(gate_up_bias [E, 2I], down_bias [E, H]) in fp32, checked against sizes (E, I, H)."""
    e, i, h = sizes
    if gate_up_bias is not None:
        check_weight("gate_up_bias", gate_up_bias, (e, 2 * i), hint)
    if down_bias is not None:
        check_weight("down_bias", down_bias, (e, h), hint)
    return _bias(gate_up_bias), _bias(down_bias)


@torch.no_grad()
def from_float(*, down, sizes: tuple[int, int, int], form: WeightForm, gate=None, up=None, gate_up=None,
               gate_up_order: str = "concat", gate_bias=None, up_bias=None, gate_up_bias=None, down_bias=None,
               hint: str = "") -> ExpertWeights:
    """Float expert weights in nn.Linear's [out, in] convention quantized into form.fmt, a few
    experts at a time. sizes: (E, I, H). Per expert: gate, up [E, I, H] and down [E, H, I]; or a
    fused gate_up [E, 2I, H] whose rows are [gate; up] (gate_up_order="concat") or alternate
    ("interleaved", gpt-oss). Biases likewise: gate_bias/up_bias [E, I] or gate_up_bias [E, 2I],
    down_bias [E, H]. hint: said after an expected shape in a shape's ValueError."""
    e, i, h = sizes
    if gate_up is None:
        if gate is None or up is None:
            raise ValueError("gate, up: give both, or gate_up")
        check_weight("gate", gate, (e, i, h), hint)
        check_weight("up", up, (e, i, h), hint)
    else:
        check_weight("gate_up", gate_up, (e, 2 * i, h), hint)
        if gate_up_order not in ("concat", "interleaved"):
            raise ValueError(f"gate_up_order: expected 'concat' or 'interleaved', got {gate_up_order!r}")
        gate, up = gate_up.chunk(2, dim=1) if gate_up_order == "concat" else deinterleave_gate_up(gate_up)
    check_weight("down", down, (e, h, i), hint)
    if gate_up_bias is not None and gate_up_order == "interleaved":
        gate_bias, up_bias = gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]
    elif gate_up_bias is not None:
        gate_bias, up_bias = gate_up_bias.chunk(2, dim=1)
    w_gate_up = _quantize_experts(lambda first, last: _arrange(gate[first:last], up[first:last], form.fmt), e,
                                  2 * i * h, form)
    w_down = _quantize_experts(lambda first, last: down[first:last], e, h * i, form)
    bias = None
    if gate_bias is not None or up_bias is not None:
        zeros = torch.zeros(e, i, device=down.device)
        gb = gate_bias if gate_bias is not None else zeros
        ub = up_bias if up_bias is not None else zeros
        bias = _arrange(gb.float().unsqueeze(-1), ub.float().unsqueeze(-1), form.fmt).squeeze(-1)
    return ExpertWeights(w_gate_up, w_down, *_checked_biases(bias, down_bias, sizes, hint))


def fp8_block_kept(fmt: str, intermediate_size: int) -> bool:
    """Whether FP8 block checkpoints are kept as they are (from_fp8_block): fp8_block with whole
    gate and up blocks (I % 128 == 0); other formats dequantize and requantize."""
    return fmt == "fp8_block" and intermediate_size % 128 == 0


@torch.no_grad()
def from_fp8_block(*, gate, up, down, gate_scale_inv, up_scale_inv, down_scale_inv, sizes: tuple[int, int, int],
                   form: WeightForm, hint: str = "") -> ExpertWeights:
    """DeepSeek-V3 FP8 experts: e4m3 [E, out, in] with fp32 scale_inv [E, ceil(out/128), ceil(in/128)]
    (weight = e4m3 * scale_inv per 128x128 block). Kept exactly where fp8_block_kept; dequantized
    and quantized into form.fmt otherwise. No biases."""
    e, i, h = sizes
    nb = lambda n: math.ceil(n / 128)  # noqa: E731
    for name, w, shape in (("gate", gate, (e, i, h)), ("up", up, (e, i, h)), ("down", down, (e, h, i))):
        check_weight(name, w, shape, hint)
        if w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: expected torch.float8_e4m3fn, got {w.dtype}")
    for name, s, w in (("gate_scale_inv", gate_scale_inv, gate), ("up_scale_inv", up_scale_inv, up),
                       ("down_scale_inv", down_scale_inv, down)):
        check_weight(name, s, (e, nb(w.shape[1]), nb(w.shape[2])), hint)
    if fp8_block_kept(form.fmt, i):
        gate_up_scales = torch.cat((gate_scale_inv, up_scale_inv), dim=1).float().contiguous()
        w_gate_up = QuantizedTensor(torch.cat((gate, up), dim=1).contiguous(), gate_up_scales, form.fmt, "b")
        w_down = QuantizedTensor(down.contiguous(), down_scale_inv.float().contiguous(), form.fmt, "b")
        return ExpertWeights(form.stored(w_gate_up), form.stored(w_down))
    deq = lambda w, s: dequantize_operand(w, s.float(), "fp8_block", "b")  # noqa: E731
    return from_float(gate=deq(gate, gate_scale_inv), up=deq(up, up_scale_inv), down=deq(down, down_scale_inv),
                      sizes=sizes, form=form, hint=hint)


@torch.no_grad()
def from_mxfp4(*, gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias=None, down_bias=None,
               sizes: tuple[int, int, int], form: WeightForm, hint: str = "") -> ExpertWeights:
    """gpt-oss MXFP4 experts: blocks uint8 [E, out, in/32, 16] (two e2m1 a byte, element 2i in the
    low nibble), scales uint8 e8m0 [E, out, in/32]; gate_up rows interleaved (gate 0::2, up 1::2),
    biases [E, 2I] and [E, H]. The formats of MXFP4 weights (mxfp4, w4a8, bf16_mxfp4) keep the
    bytes; others dequantize and quantize into form.fmt."""
    e, i, h = sizes
    check_weight("gate_up_blocks", gate_up_blocks, (e, 2 * i, h // 32, 16), hint)
    check_weight("gate_up_scales", gate_up_scales, (e, 2 * i, h // 32), hint)
    check_weight("down_blocks", down_blocks, (e, h, i // 32, 16), hint)
    check_weight("down_scales", down_scales, (e, h, i // 32), hint)
    gu_data = gate_up_blocks.reshape(e, 2 * i, h // 2).view(torch.uint8).contiguous()
    dn_data = down_blocks.reshape(e, h, i // 2).view(torch.uint8).contiguous()
    gu_scales = gate_up_scales.view(torch.uint8).contiguous()
    dn_scales = down_scales.view(torch.uint8).contiguous()
    if get_format(form.fmt).b == get_format("mxfp4").b:
        layout = weight_scale_layout(form.fmt)
        kept = []
        for data, scales in ((gu_data, gu_scales), (dn_data, dn_scales)):
            scales = layout.b_from_plain(scales)
            kept.append(form.stored(QuantizedTensor(data, scales.view(torch.float8_e8m0fnu), form.fmt, "b", layout)))
        return ExpertWeights(*kept, *_checked_biases(gate_up_bias, down_bias, sizes, hint))
    gate_up = dequantize_operand(gu_data, gu_scales.view(torch.float8_e8m0fnu), "mxfp4", "b")
    down = dequantize_operand(dn_data, dn_scales.view(torch.float8_e8m0fnu), "mxfp4", "b")
    return from_float(gate_up=gate_up, gate_up_order="interleaved", down=down, gate_up_bias=gate_up_bias,
                      down_bias=down_bias, sizes=sizes, form=form, hint=hint)
