"""A standalone moegemm.MoE from a transformers MoE block (router included).

Supported blocks and the checkpoint layouts they hold (read from transformers 5.23):
    Qwen3MoeSparseMoeBlock  experts.gate_up_proj [E, 2I, H] ([out, in], gate rows then up rows),
                            experts.down_proj [E, H, I]; router gate.weight [E, H], softmax then
                            top-k, renormalized when norm_topk_prob
    GptOssMLP               experts.gate_up_proj [E, H, 2I] ([in, out], gate and up columns
                            interleaved) + gate_up_proj_bias [E, 2I], down_proj [E, I, H] +
                            down_proj_bias [E, H]; router.weight/bias, top-k then softmax;
                            clamped SwiGLU (alpha, limit)
    DeepseekV3MoE           experts as Qwen3; gate.weight, gate.e_score_correction_bias,
                            grouped sigmoid routing, routed_scaling_factor; shared_experts MLP
"""

from __future__ import annotations

import torch

from ..moe import MoE

__all__ = ["from_transformers"]


@torch.no_grad()
def from_transformers(block, fmt: str = "bf16", *, backend: str = "auto", fused: bool = True, ep_group=None,
                      ep_path: str = "auto", ep_capacity: int | None = None) -> MoE:
    """A moegemm.MoE computing `block`'s output, its experts quantized into `fmt` (any format; the
    weight-only ones, e.g. "bf16_mxfp4" for gpt-oss, keep the activations in bf16). ep_group,
    ep_path, ep_capacity: MoE's expert parallelism (this rank keeps its experts of the block's)."""
    name = type(block).__name__
    device = next(block.parameters()).device
    dtype = next(block.parameters()).dtype if name != "DeepseekV3MoE" else block.experts.gate_up_proj.dtype
    common = dict(fmt=fmt, backend=backend, fused=fused, device=device, dtype=dtype, ep_group=ep_group,
                  ep_path=ep_path, ep_capacity=ep_capacity)
    if name in ("Qwen3MoeSparseMoeBlock", "DeepseekV3MoE"):
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        num_experts, two_i, hidden = gate_up.shape
        gate = block.gate
        if name == "Qwen3MoeSparseMoeBlock":
            layer = MoE(hidden, two_i // 2, num_experts, int(gate.top_k), router="softmax_topk",
                        norm_topk_prob=bool(gate.norm_topk_prob), **common)
            layer.load_router(gate.weight)
        else:
            shared = block.shared_experts
            layer = MoE(hidden, two_i // 2, num_experts, int(gate.top_k), router="sigmoid_grouped",
                        norm_topk_prob=bool(gate.norm_topk_prob), n_group=int(gate.num_group),
                        topk_group=int(gate.topk_group), routed_scaling_factor=float(gate.routed_scaling_factor),
                        correction_bias=True, shared_intermediate_size=shared.gate_proj.weight.shape[0], **common)
            layer.load_router(gate.weight, correction_bias=gate.e_score_correction_bias.float())
            layer.shared["gate"].weight.copy_(shared.gate_proj.weight)
            layer.shared["up"].weight.copy_(shared.up_proj.weight)
            layer.shared["down"].weight.copy_(shared.down_proj.weight)
        return layer.load_experts(gate_up=gate_up, gate_up_order="concat", down=down)
    if name == "GptOssMLP":
        ex, router = block.experts, block.router
        num_experts, hidden, two_i = ex.gate_up_proj.shape
        layer = MoE(hidden, two_i // 2, num_experts, int(router.top_k), activation="swiglu_oai", router="topk_softmax",
                    router_bias=True, expert_bias=True, swiglu_alpha=float(ex.alpha), swiglu_limit=float(ex.limit),
                    **common)
        layer.load_router(router.weight, router.bias)
        return layer.load_experts(gate_up=ex.gate_up_proj.transpose(1, 2), gate_up_order="interleaved",
                                  down=ex.down_proj.transpose(1, 2), gate_up_bias=ex.gate_up_proj_bias,
                                  down_bias=ex.down_proj_bias)
    raise TypeError(f"block: expected Qwen3MoeSparseMoeBlock, GptOssMLP or DeepseekV3MoE, got {name}")
