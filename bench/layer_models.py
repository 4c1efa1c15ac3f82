"""The layer bench's models (DeepSeek-V3, gpt-oss-120b, and toy sizes of both for the CPU):
random weights built on the device, the plain PyTorch baseline, routing inputs and our layer's
calls on them. bench/moe_layer.py times them; bench/ab.py's layer plans and bench/profiling.py
reuse them. moe_layer.py's docstring describes the weights and the baseline."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# moegemm from MOEGEMM_TREE (bench/ab.py's two-revision runs: another revision's tree), else this one
sys.path.insert(0, os.environ.get("MOEGEMM_TREE") or str(Path(__file__).resolve().parents[1]))

import moegemm
from moegemm import layouts
from moegemm.formats import PREPACK_BY_DEFAULT

# "fmts": the formats every script times the model in. "table_fmts": formats moe_layer.py's
# table also times, at these token counts only; gpt-oss's weight-only MXFP4 (bf16 activations,
# the same e2m1 weights and e8m0 scales), where this tree's FORMATS has it.
MODELS = {
    "DeepSeek-V3": {"hidden": 7168, "width": 2048, "experts": 256, "top_k": 8, "activation": "swiglu",
                    "family": "fp8", "fmts": ("fp8_block", "mxfp8")},
    "gpt-oss-120b": {"hidden": 2880, "width": 2880, "experts": 128, "top_k": 4, "activation": "swiglu_oai",
                     "family": "mxfp4", "fmts": ("mxfp4", "bf16"),
                     "table_fmts": {"bf16_mxfp4": (64, 4096)} if "bf16_mxfp4" in moegemm.FORMATS else {}},
}
# moe_layer.py --cpu-smoke: the same two families at toy sizes.
SMOKE_MODELS = {
    "tiny-dsv3": {"hidden": 256, "width": 128, "experts": 8, "top_k": 2, "activation": "swiglu",
                  "family": "fp8", "fmts": ("fp8_block", "mxfp8")},
    "tiny-gpt-oss": {"hidden": 256, "width": 128, "experts": 8, "top_k": 2, "activation": "swiglu_oai",
                     "family": "mxfp4", "fmts": ("mxfp4", "bf16")},
}
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU


def gate_up_layout(fmt: str) -> str:
    """The gate/up row order of the layer's weights (moegemm.MoE's): [gate; up] for fp8_block."""
    return "concat" if fmt == "fp8_block" else "interleaved"


# ---- random weights, built on the device -------------------------------------------------

def random_e4m3(shape, device, gen) -> torch.Tensor:
    """e4m3 codes of randn values (unit scale), in slices to keep the fp32 temporaries small."""
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    flat = out.view(-1, shape[-1])
    step = max(1, (1 << 26) // shape[-1])
    for i in range(0, flat.shape[0], step):
        rows = flat[i:i + step]
        rows.copy_(torch.randn(rows.shape, device=device, generator=gen))
    return out


def e8m0_value(b: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> fp32 2^(b - 127)."""
    return torch.exp2(b.float() - 127.0)


class Fp8Weights:
    """DeepSeek-V3-like: one set of e4m3 codes [E, 2I, H] / [E, H, I] and power-of-two scales
    per (expert, 128-row block), constant along K: the same real weights in fp8_block, mxfp8,
    rowwise FP8 and bf16."""

    def __init__(self, cfg: dict, device, gen):
        e, h, i = cfg["experts"], cfg["hidden"], cfg["width"]
        self.cfg, self.device = cfg, device
        self.gu_codes = random_e4m3((e, 2 * i, h), device, gen)
        self.dn_codes = random_e4m3((e, h, i), device, gen)

        def row_bytes(n):  # scale byte of every row, constant over 128-row blocks; ~2^-6 (1/sqrt(K))
            blocks = torch.randint(120, 123, (e, math.ceil(n / 128)), dtype=torch.uint8, device=device, generator=gen)
            return blocks.repeat_interleave(128, dim=1)[:, :n].contiguous()

        self.gu_bytes, self.dn_bytes = row_bytes(2 * i), row_bytes(h)
        self._ours: dict = {}
        self._bf16 = None

    def ours(self, fmt: str):
        if fmt not in self._ours:
            self._ours = {fmt: (self._operand(self.gu_codes, self.gu_bytes, fmt),
                                self._operand(self.dn_codes, self.dn_bytes, fmt))}
        return self._ours[fmt]

    @staticmethod
    def _operand(codes, row_bytes, fmt):
        e, n, k = codes.shape
        if fmt == "fp8_block":
            blocks = e8m0_value(row_bytes[:, ::128])  # [E, ceil(N/128)]
            scales = blocks[:, :, None].expand(e, blocks.shape[1], math.ceil(k / 128)).contiguous()
            return moegemm.QuantizedTensor(codes, scales, "fp8_block", "b", "plain")
        if fmt == "mxfp8":
            plain = row_bytes[:, :, None].expand(e, n, k // 32).contiguous()
            scales = layouts.swizzle_b_scales(plain).view(torch.float8_e8m0fnu)
            return moegemm.QuantizedTensor(codes, scales, "mxfp8", "b", "swizzled")
        raise ValueError(fmt)

    def rowwise(self):
        """(e4m3 [E, 2I, H], fp32 [E, 2I], e4m3 [E, H, I], fp32 [E, H]) for _scaled_grouped_mm."""
        return self.gu_codes, e8m0_value(self.gu_bytes), self.dn_codes, e8m0_value(self.dn_bytes)

    def bf16(self):
        """The same real weights in bf16 (built on first use, in slices of experts)."""
        if self._bf16 is None:
            def dequant(codes, row_bytes):
                out = torch.empty(codes.shape, dtype=torch.bfloat16, device=codes.device)
                for s in range(0, codes.shape[0], 8):
                    out[s:s + 8] = (codes[s:s + 8].float() * e8m0_value(row_bytes[s:s + 8])[:, :, None])
                return out
            self._bf16 = (dequant(self.gu_codes, self.gu_bytes), dequant(self.dn_codes, self.dn_bytes))
        return self._bf16

    def biases(self):
        return None, None


class Mxfp4Weights:
    """gpt-oss-like: packed e2m1 codes (random bytes) with e8m0 scales per 1x32 block, gate/up
    rows interleaved, biases; the bf16 row and the baseline use the exact bf16 decoding. The
    weight-only bf16_mxfp4 rows read the same codes and scales as the mxfp4 rows."""

    def __init__(self, cfg: dict, device, gen):
        e, h, i = cfg["experts"], cfg["hidden"], cfg["width"]
        self.cfg, self.device = cfg, device

        def operand(n, k):  # codes RMS ~2.9, scales ~2^-7: ~1/sqrt(K) overall
            data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
            sb = torch.randint(118, 122, (e, n, k // 32), dtype=torch.uint8, device=device, generator=gen)
            return data, sb

        self.gu_data, self.gu_sbytes = operand(2 * i, h)
        self.dn_data, self.dn_sbytes = operand(h, i)
        self._mx_scales = None
        self._mx: dict = {}  # fmt -> (gate/up, down) QuantizedTensors
        self._bf16 = (self._decode(self.gu_data, self.gu_sbytes), self._decode(self.dn_data, self.dn_sbytes))
        # bf16-representable values, so that ours (fp32 bias) and the baseline (bf16) add the same bias
        self.gu_bias = (torch.randn(e, 2 * i, device=device, generator=gen) * 0.1).bfloat16().float()
        self.dn_bias = (torch.randn(e, h, device=device, generator=gen) * 0.1).bfloat16().float()

    @staticmethod
    def _decode(data, sbytes):
        out = torch.empty(*data.shape[:2], data.shape[2] * 2, dtype=torch.bfloat16, device=data.device)
        for s in range(0, data.shape[0], 4):
            out[s:s + 4] = moegemm.dequantize_operand(data[s:s + 4], sbytes[s:s + 4].view(torch.float8_e8m0fnu),
                                                      "mxfp4", "b")
        return out

    def ours(self, fmt: str):
        if fmt == "bf16":
            return (moegemm.QuantizedTensor(self._bf16[0], None, "bf16", "b", "plain"),
                    moegemm.QuantizedTensor(self._bf16[1], None, "bf16", "b", "plain"))
        if fmt in ("mxfp4", "bf16_mxfp4"):
            if self._mx_scales is None:  # one swizzled copy, read by both formats
                def swz(sb):
                    return layouts.swizzle_b_scales(sb).view(torch.float8_e8m0fnu)

                self._mx_scales = (swz(self.gu_sbytes), swz(self.dn_sbytes))
            if fmt not in self._mx:
                weights = (moegemm.QuantizedTensor(self.gu_data, self._mx_scales[0], fmt, "b", "swizzled"),
                           moegemm.QuantizedTensor(self.dn_data, self._mx_scales[1], fmt, "b", "swizzled"))
                if fmt in PREPACK_BY_DEFAULT:  # as MoE.load_mxfp4 keeps them
                    weights = tuple(moegemm.prepack_weights(w) for w in weights)
                self._mx[fmt] = weights
            return self._mx[fmt]
        raise ValueError(fmt)

    def rowwise(self):
        return None

    def bf16(self):
        return self._bf16

    def biases(self):
        return self.gu_bias, self.dn_bias


def weight_bytes_per_expert(w_gate_up, w_down) -> float:
    total = 0
    for q in (w_gate_up, w_down):
        total += q.data.numel() * q.data.element_size()
        if q.scales is not None:
            total += q.scales.numel() * q.scales.element_size()
    return total / w_gate_up.data.shape[0]


# ---- the PyTorch baseline ----------------------------------------------------------------

def rowwise_fp8(a: torch.Tensor):
    """[M, K] -> (e4m3 [M, K], fp32 [M]): scale = amax / 448 per row."""
    scale = a.abs().amax(dim=1).float().clamp(min=1e-12) / 448.0
    return (a.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


class TorchMoE:
    """The routed experts in plain PyTorch. kind: "fp8_rowwise" (torch._scaled_grouped_mm) or
    "bf16" (torch._grouped_mm). Weights [E, N, K] (nn.Linear's layout), passed transposed."""

    def __init__(self, kind, w_gu, w_dn, s_gu=None, s_dn=None, *, gate_up_layout, activation, gu_bias=None,
                 dn_bias=None):
        self.kind, self.w_gu, self.w_dn, self.s_gu, self.s_dn = kind, w_gu, w_dn, s_gu, s_dn
        self.layout, self.activation = gate_up_layout, activation
        self.gu_bias = None if gu_bias is None else gu_bias.to(torch.bfloat16)
        self.dn_bias = None if dn_bias is None else dn_bias.to(torch.bfloat16)
        self.num_experts = w_gu.shape[0]

    def _mm(self, a, w, s, offs):
        if self.kind == "fp8_rowwise":
            aq, sa = rowwise_fp8(a)
            return torch._scaled_grouped_mm(aq, w.transpose(-2, -1), sa, s, offs=offs, out_dtype=torch.bfloat16,
                                            use_fast_accum=True)
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)

    def __call__(self, x, topk_ids, topk_weights):
        t, k = topk_ids.shape
        e = self.num_experts
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=e, min=0, max=e)  # ids are integers in [0, E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        token = order // k
        expert = flat.index_select(0, order).long()
        a = x.index_select(0, token)
        h = self._mm(a, self.w_gu, self.s_gu, offs)
        if self.gu_bias is not None:
            h = h + self.gu_bias.index_select(0, expert)
        if self.layout == "interleaved":
            gate, up = h[:, 0::2], h[:, 1::2]
        else:
            gate, up = h.chunk(2, dim=-1)
        if self.activation == "swiglu":
            mid = F.silu(gate) * up
        else:
            gate = gate.clamp(max=LIMIT)
            up = up.clamp(min=-LIMIT, max=LIMIT)
            mid = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
        c = self._mm(mid, self.w_dn, self.s_dn, offs)
        if self.dn_bias is not None:
            c = c + self.dn_bias.index_select(0, expert)
        w = topk_weights.reshape(-1).index_select(0, order).float()
        out = torch.zeros(t, c.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token, c.float() * w[:, None])
        return out.to(x.dtype)


# ---- inputs and calls -------------------------------------------------------------------

def routing_inputs(cfg: dict, tokens: int, seed: int, device):
    """x [T, H] bf16, topk_ids int32 [T, k] (distinct, uniform), topk_weights fp32 [T, k] (positive, sum 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, k = cfg["experts"], cfg["top_k"]
    x = torch.randn(tokens, cfg["hidden"], device=device, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, e, device=device, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, k, device=device, generator=gen) + 0.05
    weights = weights / weights.sum(dim=1, keepdim=True)
    return x, ids, weights


def baseline_for(weights, fmt: str, cfg: dict, kind: str) -> TorchMoE:
    gu_bias, dn_bias = weights.biases()
    common = {"gate_up_layout": gate_up_layout(fmt), "activation": cfg["activation"], "gu_bias": gu_bias,
              "dn_bias": dn_bias}
    if kind == "fp8_rowwise":
        w_gu, s_gu, w_dn, s_dn = weights.rowwise()
        return TorchMoE("fp8_rowwise", w_gu, w_dn, s_gu, s_dn, **common)
    w_gu, w_dn = weights.bf16()
    return TorchMoE("bf16", w_gu, w_dn, **common)


BASELINE_NAMES = {"fp8_rowwise": "torch._scaled_grouped_mm fp8 rowwise", "bf16": "torch._grouped_mm bf16"}


def build_weights(cfg: dict, m_index: int, device):
    """The model's weights (its index in MODELS seeds them)."""
    gen = torch.Generator(device=device).manual_seed(1234 + m_index)
    return (Fp8Weights if cfg["family"] == "fp8" else Mxfp4Weights)(cfg, device, gen)


def layer_call(cfg: dict, x, ids, topk_weights, weights, fmt: str, fused: bool):
    """Our layer on the row's inputs: moe_forward with fmt's weights (and the model's biases)."""
    w_gu, w_dn = weights.ours(fmt)
    gu_bias, dn_bias = weights.biases()
    return lambda: moegemm.moe_forward(x, ids, topk_weights, w_gu, w_dn, gate_up_layout=gate_up_layout(fmt),
                                       activation=cfg["activation"],
                                       gate_up_bias=gu_bias, down_bias=dn_bias, alpha=ALPHA, limit=LIMIT,
                                       fused=fused, backend="auto")


@dataclass
class GateUpStep:
    """The gate/up step alone, on tokens routed and quantized once as moe_forward does."""

    cfg: dict
    fmt: str
    w_gu: object
    bias: torch.Tensor | None
    plan: object
    a: object  # the quantized, routed tokens (moegemm.gather_quantize)
    layout: str
    a_scale_offsets: torch.Tensor | None

    @classmethod
    def build(cls, cfg: dict, x, ids, topk_weights, weights, fmt: str) -> GateUpStep:
        w_gu, _ = weights.ours(fmt)
        gu_bias, _ = weights.biases()
        plan = moegemm.route(ids, cfg["experts"], topk_weights)
        layout = w_gu.scale_layout if w_gu.scales is not None else "plain"
        aso = plan.a_scale_offsets if layout == "swizzled" else None
        a = moegemm.gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, a_scale_offsets=aso,
                                    scale_layout=layout, num_scale_blocks=plan.scale_blocks_bound)
        return cls(cfg, fmt, w_gu, gu_bias, plan, a, layout, aso)

    def call(self, fused: bool):
        """grouped_matmul_swiglu with the fused epilogue or the unfused chain."""
        return lambda: moegemm.grouped_matmul_swiglu(
            self.a.data, self.w_gu, self.a.scales, None, self.plan.a_offsets, self.plan.expert_ids,
            fmt=self.fmt, gate_up_layout=gate_up_layout(self.fmt), out_fmt=self.fmt,
            activation=self.cfg["activation"], a_scale_offsets=self.a_scale_offsets,
            bias=self.bias, scale_layout=self.layout, out_scale_layout=self.layout,
            num_scale_blocks=self.plan.scale_blocks_bound, alpha=ALPHA, limit=LIMIT, fused=fused, backend="auto")
