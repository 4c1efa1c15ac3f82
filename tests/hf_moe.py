"""Test helper (not a test file): the MoE blocks of Hugging Face transformers as parity targets.

Three blocks, built from small random configs with random weights (torch's global RNG):

    kind           transformers class          router kind        activation
    "qwen3_moe"    Qwen3MoeSparseMoeBlock      "softmax_topk"     "swiglu"
    "gpt_oss"      GptOssMLP                   "topk_softmax"     "swiglu_oai"  (+ biases)
    "deepseek_v3"  DeepseekV3MoE               "sigmoid_grouped"  "swiglu"      (+ shared experts)

`extract_params(block)` turns any of them into a `MoEParams` of plain tensors in one layout (nn.Linear's
[out, in]): gate/up [E, I, H], down [E, H, I]; `reference_moe(x, params)` is a pure-torch forward of that;
`run_block(block, x)` runs the transformers block itself. Written against the fused-3D-tensor expert layout of
transformers 5.x (checked with 5.23.0 only); a block whose experts lack the fused gate_up_proj (older releases
kept a per-expert nn.ModuleList) is refused with a TypeError.

transformers is imported lazily, so importing this module never needs it; callers guard with
`pytest.importorskip("transformers")`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("qwen3_moe", "gpt_oss", "deepseek_v3")
ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")


@dataclass
class MoEParams:
    """One MoE layer in plain tensors. E experts, hidden H, expert intermediate I, shared intermediate Is.

    Routing, by `router_kind` (logits = x @ router_weight.T (+ router_bias)):
      "softmax_topk"    (Qwen3-MoE): p = softmax(logits) over all E (fp32); top-k of p;
                        if norm_topk_prob: w /= sum(w).
      "topk_softmax"    (gpt-oss):   top-k of logits (router_bias included); w = softmax over those k.
      "sigmoid_grouped" (DeepSeek-V3): s = sigmoid(logits) (fp32); choice = s + e_score_correction_bias;
                        the E experts form n_group groups of E/n_group; a group's score is the sum of its top-2
                        choice values; keep the topk_group best groups; top-k of choice within them;
                        w = s at those experts (not the bias-corrected value);
                        if norm_topk_prob: w /= (sum(w) + 1e-20); w *= routed_scaling_factor.
    Expert e on token x: g = x @ gate[e].T + gate_bias[e]; u = x @ up[e].T + up_bias[e];
      "swiglu":     h = silu(g) * u
      "swiglu_oai": g = min(g, limit); u = clamp(u, -limit, limit); h = (u + 1) * g * sigmoid(alpha * g)
      y_e = h @ down[e].T + down_bias[e]           (the down bias is inside, so it is scaled by w too)
    out = sum_k w_k * y_{e_k}  (+ shared: down_s(silu(x @ gate_s.T) * (x @ up_s.T)), unscaled)
    Biases are None where the model has none.
    """

    kind: str
    # router
    router_kind: str
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None  # [E]           gpt-oss
    e_score_correction_bias: torch.Tensor | None  # [E]  DeepSeek-V3 (fp32)
    top_k: int
    norm_topk_prob: bool
    n_group: int | None
    topk_group: int | None
    routed_scaling_factor: float
    # experts (nn.Linear [out, in] convention)
    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    gate_bias: torch.Tensor | None  # [E, I]
    up_bias: torch.Tensor | None  # [E, I]
    down_bias: torch.Tensor | None  # [E, H]
    activation: str  # "swiglu" | "swiglu_oai"
    swiglu_alpha: float | None
    swiglu_limit: float | None
    # shared experts (DeepSeek-V3), one dense SwiGLU MLP of Is = moe_intermediate_size * n_shared_experts
    shared_gate: torch.Tensor | None  # [Is, H]
    shared_up: torch.Tensor | None  # [Is, H]
    shared_down: torch.Tensor | None  # [H, Is]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[1]


# ----------------------------------------------------------------------------------------------------------------
# building blocks


def _normal_(t: torch.Tensor, std: float) -> None:
    # Draw in fp32 from the global RNG, then round: the same seed gives the same weights in any dtype.
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, dtype=torch.float32) * std)


def _drawn(block, dtype: torch.dtype, *draws):
    """The block with each (tensor, std) of `draws` drawn in order, in `dtype`, in eval mode."""
    for t, std in draws:
        _normal_(t, std)
    return block.to(dtype).eval()


# One decoder layer's attention sizes: the MoE block reads none of them, the configs want them.
_ONE_LAYER = dict(num_hidden_layers=1, num_attention_heads=4)


def build_qwen3_moe(
    *,
    hidden_size: int = 64,
    intermediate_size: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    norm_topk_prob: bool = True,
    std: float = 0.1,
    router_std: float = 0.1,
    dtype: torch.dtype = torch.float32,
    experts_implementation: str = "eager",
):
    """A Qwen3MoeSparseMoeBlock. Its expert weights are torch.empty and its router zeros until set: all drawn here."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=hidden_size,
        moe_intermediate_size=intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
        num_key_value_heads=2,
        experts_implementation=experts_implementation,
        **_ONE_LAYER,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    return _drawn(block, dtype, (block.gate.weight, router_std), (block.experts.gate_up_proj, std),
                  (block.experts.down_proj, std))


def build_gpt_oss(
    *,
    hidden_size: int = 64,
    intermediate_size: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    std: float = 0.1,
    router_std: float = 0.1,
    bias_std: float = 0.1,
    dtype: torch.dtype = torch.float32,
    experts_implementation: str = "eager",
):
    """A GptOssMLP (router with bias + experts with biases). All expert tensors are torch.empty until set.
    Real checkpoints start the expert biases at zero; here they are random so that their placement is tested."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
        num_key_value_heads=2,
        head_dim=16,
        experts_implementation=experts_implementation,
        **_ONE_LAYER,
    )
    block = GptOssMLP(config)
    experts = block.experts
    # (releases up to 5.17 at least fix the experts' alpha and limit at 1.702 and 7.0, whatever the config says)
    experts.alpha, experts.limit = swiglu_alpha, swiglu_limit
    return _drawn(block, dtype, (block.router.weight, router_std), (block.router.bias, bias_std),
                  (experts.gate_up_proj, std), (experts.gate_up_proj_bias, bias_std), (experts.down_proj, std),
                  (experts.down_proj_bias, bias_std))


def build_deepseek_v3(
    *,
    hidden_size: int = 64,
    intermediate_size: int = 32,
    num_experts: int = 16,
    top_k: int = 4,
    n_group: int = 4,
    topk_group: int = 2,
    n_shared_experts: int = 1,
    routed_scaling_factor: float = 2.5,
    norm_topk_prob: bool = True,
    std: float = 0.1,
    router_std: float = 0.1,
    correction_bias_std: float = 0.1,
    dtype: torch.dtype = torch.float32,
    experts_implementation: str = "eager",
):
    """A DeepseekV3MoE (routed experts + shared experts). Needs num_experts % n_group == 0 and >= 2 experts per
    group (group score = sum of a group's top-2). Experts are torch.empty, router zeros, e_score_correction_bias
    zeros until set: all drawn here. As from_pretrained does (_keep_in_fp32_modules_strict), the correction bias
    stays fp32 whatever `dtype` is."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=hidden_size,
        moe_intermediate_size=intermediate_size,
        intermediate_size=4 * intermediate_size,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=n_shared_experts,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
        first_k_dense_replace=0,
        hidden_act="silu",
        num_key_value_heads=4,
        experts_implementation=experts_implementation,
        **_ONE_LAYER,
    )
    block = DeepseekV3MoE(config)
    shared = block.shared_experts
    block = _drawn(block, dtype, (block.gate.weight, router_std),
                   (block.gate.e_score_correction_bias, correction_bias_std), (block.experts.gate_up_proj, std),
                   (block.experts.down_proj, std), (shared.gate_proj.weight, std), (shared.up_proj.weight, std),
                   (shared.down_proj.weight, std))
    block.gate.e_score_correction_bias = block.gate.e_score_correction_bias.float()  # buffer stays registered
    return block


BUILDERS = {"qwen3_moe": build_qwen3_moe, "gpt_oss": build_gpt_oss, "deepseek_v3": build_deepseek_v3}


def build_block(kind: str, **kwargs):
    """build_block("qwen3_moe" | "gpt_oss" | "deepseek_v3", **builder kwargs)."""
    return BUILDERS[kind](**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# extracting parameters


def block_kind(block) -> str:
    name = type(block).__name__
    kinds = {"Qwen3MoeSparseMoeBlock": "qwen3_moe", "GptOssMLP": "gpt_oss", "DeepseekV3MoE": "deepseek_v3"}
    if name not in kinds:
        raise TypeError(f"not a supported transformers MoE block: {name}")
    return kinds[name]


def _t(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.detach().clone().contiguous()


def _fused_experts(experts):
    if not hasattr(experts, "gate_up_proj"):
        raise TypeError(
            f"{type(experts).__name__} has no fused gate_up_proj: this helper reads the transformers 5.x layout"
        )
    return experts


def extract_router(block) -> dict:
    """Router weight [E, H], router_bias [E] | None, e_score_correction_bias [E] | None, and its settings."""
    kind = block_kind(block)
    if kind == "qwen3_moe":
        g = block.gate
        return {
            "router_kind": "softmax_topk",
            "router_weight": _t(g.weight),
            "router_bias": None,
            "e_score_correction_bias": None,
            "top_k": int(g.top_k),
            "norm_topk_prob": bool(g.norm_topk_prob),
            "n_group": None,
            "topk_group": None,
            "routed_scaling_factor": 1.0,
        }
    if kind == "gpt_oss":
        r = block.router
        return {
            "router_kind": "topk_softmax",
            "router_weight": _t(r.weight),
            "router_bias": _t(r.bias),
            "e_score_correction_bias": None,
            "top_k": int(r.top_k),
            "norm_topk_prob": False,  # the softmax over the k already sums to 1
            "n_group": None,
            "topk_group": None,
            "routed_scaling_factor": 1.0,
        }
    g = block.gate
    return {
        "router_kind": "sigmoid_grouped",
        "router_weight": _t(g.weight),
        "router_bias": None,
        "e_score_correction_bias": _t(g.e_score_correction_bias),
        "top_k": int(g.top_k),
        "norm_topk_prob": bool(g.norm_topk_prob),
        "n_group": int(g.num_group),
        "topk_group": int(g.topk_group),
        "routed_scaling_factor": float(g.routed_scaling_factor),
    }


def extract_experts(block) -> dict:
    """gate/up [E, I, H], down [E, H, I], gate_bias/up_bias [E, I] | None, down_bias [E, H] | None."""
    kind = block_kind(block)
    ex = _fused_experts(block.experts)
    if kind == "gpt_oss":
        # gate_up_proj [E, H, 2I] ([in, out]), columns INTERLEAVED: gate = 0::2, up = 1::2;
        # gate_up_proj_bias [E, 2I] interleaved the same way; down_proj [E, I, H] ([in, out]); down_proj_bias [E, H].
        w = ex.gate_up_proj.detach()
        b = ex.gate_up_proj_bias.detach()
        return {
            "gate": _t(w[:, :, 0::2].transpose(1, 2)),
            "up": _t(w[:, :, 1::2].transpose(1, 2)),
            "down": _t(ex.down_proj.detach().transpose(1, 2)),
            "gate_bias": _t(b[:, 0::2]),
            "up_bias": _t(b[:, 1::2]),
            "down_bias": _t(ex.down_proj_bias),
        }
    # Qwen3-MoE, DeepSeek-V3: gate_up_proj [E, 2I, H] ([out, in]), CONCATENATED: rows [:I] gate, [I:] up
    # (forward: F.linear(x, gate_up_proj[e]).chunk(2, -1)); down_proj [E, H, I] ([out, in]); no biases.
    w = ex.gate_up_proj.detach()
    i = w.shape[1] // 2
    return {
        "gate": _t(w[:, :i, :]),
        "up": _t(w[:, i:, :]),
        "down": _t(ex.down_proj),
        "gate_bias": None,
        "up_bias": None,
        "down_bias": None,
    }


def extract_activation(block) -> dict:
    kind = block_kind(block)
    if kind == "gpt_oss":
        return {"activation": "swiglu_oai", "swiglu_alpha": float(block.experts.alpha),
                    "swiglu_limit": float(block.experts.limit)}
    act = block.experts.config.hidden_act
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: only silu (SwiGLU) is described here")
    return {"activation": "swiglu", "swiglu_alpha": None, "swiglu_limit": None}


def extract_shared(block) -> dict:
    """DeepSeek-V3's shared experts as one SwiGLU MLP: gate/up [Is, H], down [H, Is]; None elsewhere."""
    if block_kind(block) != "deepseek_v3":
        return {"shared_gate": None, "shared_up": None, "shared_down": None}
    s = block.shared_experts
    if s.config.hidden_act != "silu":
        raise ValueError(f"shared experts hidden_act={s.config.hidden_act!r}")
    return {
        "shared_gate": _t(s.gate_proj.weight),
        "shared_up": _t(s.up_proj.weight),
        "shared_down": _t(s.down_proj.weight),
    }


def extract_params(block) -> MoEParams:
    return MoEParams(
        kind=block_kind(block),
        **extract_router(block),
        **extract_experts(block),
        **extract_activation(block),
        **extract_shared(block),
    )


# ----------------------------------------------------------------------------------------------------------------
# running


@torch.no_grad()
def run_block(block, x: torch.Tensor) -> torch.Tensor:
    """The block's MoE output [B, S, H] for x [B, S, H] (gpt-oss's router scores dropped)."""
    out = block(x)
    if isinstance(out, tuple):
        out = out[0]
    return out


# ----------------------------------------------------------------------------------------------------------------
# pure-torch reference


def route(x: torch.Tensor, p: MoEParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k] int64) for x [..., H], in transformers' dtypes:
    softmax_topk: logits in x's dtype, softmax + renorm in fp32, weights cast back to x's dtype;
    topk_softmax: logits (+bias) and the softmax over the k in x's dtype;
    sigmoid_grouped: x, weight and everything after in fp32; weights stay fp32."""
    x = x.reshape(-1, p.router_weight.shape[1])
    k = p.top_k
    if p.router_kind == "softmax_topk":
        logits = F.linear(x, p.router_weight.to(x.dtype))
        probs = torch.softmax(logits.float(), dim=-1)
        w, ids = probs.topk(k, dim=-1)
        if p.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype), ids
    if p.router_kind == "topk_softmax":
        bias = None if p.router_bias is None else p.router_bias.to(x.dtype)
        logits = F.linear(x, p.router_weight.to(x.dtype), bias)  # bias fused, as transformers (one rounding)
        top, ids = logits.topk(k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    if p.router_kind == "sigmoid_grouped":
        scores = torch.sigmoid(F.linear(x.float(), p.router_weight.float()))  # [T, E]
        choice = scores
        if p.e_score_correction_bias is not None:
            choice = scores + p.e_score_correction_bias.float()
        t, e = choice.shape
        per_group = e // p.n_group
        groups = choice.view(t, p.n_group, per_group)
        group_score = groups.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(p.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        w = scores.gather(1, ids)
        if p.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * p.routed_scaling_factor, ids
    raise ValueError(f"unknown router_kind {p.router_kind!r}")


def expert_mlp(x: torch.Tensor, p: MoEParams, e: int) -> torch.Tensor:
    """Expert e on rows x [N, H] -> [N, H], computed in x's dtype."""
    dt = x.dtype

    def lin(w, b):
        y = x @ w.to(dt).t()
        return y if b is None else y + b.to(dt)

    g = lin(p.gate[e], None if p.gate_bias is None else p.gate_bias[e])
    u = lin(p.up[e], None if p.up_bias is None else p.up_bias[e])
    if p.activation == "swiglu":
        h = F.silu(g) * u
    elif p.activation == "swiglu_oai":
        g = g.clamp(max=p.swiglu_limit)
        u = u.clamp(min=-p.swiglu_limit, max=p.swiglu_limit)
        h = (u + 1) * (g * torch.sigmoid(p.swiglu_alpha * g))
    else:
        raise ValueError(f"unknown activation {p.activation!r}")
    y = h @ p.down[e].to(dt).t()
    if p.down_bias is not None:
        y = y + p.down_bias[e].to(dt)
    return y


@torch.no_grad()
def reference_moe(
    x: torch.Tensor,
    p: MoEParams,
    *,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The MoE layer on x [..., H] -> same shape and dtype as x.

    routing: (weights [T, k], ids [T, k]) to use instead of `route(x, p)` (to compare experts/combine alone).
    compute_dtype: None computes the experts in x's dtype, as transformers does; torch.float32 upcasts x and all
    weights for the experts and shared experts (an fp32-accumulating kernel's ideal), rounding once at the end.
    Routing always follows transformers' dtypes (see `route`). The k contributions of a token are summed in fp32
    (transformers' eager path index_add_s them into an x-dtype buffer, one rounding per expert)."""
    shape, out_dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])
    w, ids = route(x2, p) if routing is None else routing
    xc = x2 if compute_dtype is None else x2.to(compute_dtype)
    acc = torch.zeros(x2.shape, dtype=torch.float32, device=x.device)
    for e in range(p.num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert_mlp(xc[tok], p, e) * w[tok, slot, None]  # torch's type promotion, as transformers
        if compute_dtype is None:
            y = y.to(out_dtype)  # transformers rounds each expert's weighted rows to x's dtype
        acc.index_add_(0, tok, y.float())
    if p.shared_gate is None:
        return acc.to(out_dtype).reshape(shape)
    dt = xc.dtype
    shared = (F.silu(xc @ p.shared_gate.to(dt).t()) * (xc @ p.shared_up.to(dt).t())) @ p.shared_down.to(dt).t()
    if compute_dtype is None:  # transformers: routed (x's dtype) + shared (x's dtype)
        out = acc.to(out_dtype) + shared.to(out_dtype)
    else:
        out = (acc + shared.float()).to(out_dtype)
    return out.reshape(shape)
