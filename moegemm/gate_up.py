"""The gate/up product of an MoE layer and the gated activations applied to it.

    interleave_gate_up(gate, up)     [E, I, K] x 2 -> [E, 2I, K], rows 2j = gate_j, 2j+1 = up_j
    deinterleave_gate_up(gate_up)    its inverse
    swiglu(h)                        the activation of a gate/up product in PyTorch, fp32 (the
                                     reference of the kernels')
    reference_activation(h, ...)     the same after an expert bias per row (swiglu_quantize's
                                     activation in PyTorch)

Activations (SwiGLU, docs/contract.md section 6):
    swiglu      silu(gate) * up
    swiglu_oai  gpt-oss: gate = min(gate, limit); up = clamp(up, -limit, limit);
                gate * sigmoid(alpha * gate) * (up + 1)          (alpha 1.702, limit 7.0)
Gate/up layouts of the product's columns: "interleaved" (2j gate, 2j+1 up) or "concat"
([gate, up]). An optional expert bias [E, 2I] (gpt-oss) is added to gate and up first; the
row's expert comes from its slot in a_offsets / expert_ids.
"""

from __future__ import annotations

import torch

__all__ = [
    "ACTIVATIONS",
    "GATE_UP_LAYOUTS",
    "check_activation",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "reference_activation",
    "slot_rows",
    "swiglu",
]

ACTIVATIONS = ("swiglu", "swiglu_oai")
GATE_UP_LAYOUTS = ("interleaved", "concat")


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up weights [..., I, K] -> one [..., 2I, K] whose rows 2j and 2j+1 are gate_j and up_j.

    Works on anything laid out by output row: float weights, packed fp4 data, plain per-row
    scales ([E, I, K/vec]) and biases ([E, I] with a trailing unit dimension added by the caller).
    """
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError("gate, up: expected torch.Tensors")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"up: expected the shape and dtype of gate {tuple(gate.shape)} {gate.dtype}, "
                         f"got {tuple(up.shape)} {up.dtype}")
    if gate.dim() < 2:
        raise ValueError(f"gate: expected [..., I, K], got shape {tuple(gate.shape)}")
    both = torch.stack((gate, up), dim=-2)  # [..., I, 2, K]
    return both.reshape(*gate.shape[:-2], 2 * gate.shape[-2], gate.shape[-1])


def deinterleave_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of interleave_gate_up: rows 0::2 and 1::2."""
    return gate_up[..., 0::2, :], gate_up[..., 1::2, :]


def check_activation(activation: str, gate_up_layout: str = "interleaved"):
    """ValueError unless activation is one of ACTIVATIONS and gate_up_layout one of GATE_UP_LAYOUTS."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout: expected one of {list(GATE_UP_LAYOUTS)}, got {gate_up_layout!r}")


def swiglu(h: torch.Tensor, activation: str = "swiglu", *, gate_up_layout: str = "interleaved",
           alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """[M, 2I] gate/up product -> [M, I] in fp32 (the reference of the kernels' activation)."""
    check_activation(activation, gate_up_layout)
    h = h.float()
    if gate_up_layout == "interleaved":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def slot_rows(a_offsets, expert_ids, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [rows] bool, expert [rows] int64): whether each row lies in a slot with an expert
    (expert_ids >= 0), and that expert (-1 elsewhere). Without a_offsets every row is valid;
    without expert_ids every row inside a_offsets' span is (expert 0)."""
    index = torch.arange(rows, device=device)
    if a_offsets is None:
        return torch.ones(rows, dtype=torch.bool, device=device), torch.zeros_like(index)
    offsets = a_offsets.long()
    inside = (index >= offsets[0]) & (index < offsets[-1])
    if expert_ids is None:
        expert = torch.zeros_like(index)
    elif expert_ids.numel():
        slot = torch.searchsorted(offsets[1:], index, right=True).clamp(max=expert_ids.numel() - 1)
        expert = expert_ids.long()[slot]
    else:
        expert = torch.full_like(index, -1)
    valid = inside & (expert >= 0)
    return valid, torch.where(valid, expert, torch.full_like(expert, -1))


def _row_bias(bias, a_offsets, expert_ids, rows: int) -> torch.Tensor:
    """bias[expert of row] per row ([rows, 2I]); zero for rows outside every valid slot."""
    valid, expert = slot_rows(a_offsets, expert_ids, rows, bias.device)
    picked = bias.float()[expert.clamp(min=0)] if bias.shape[0] else bias.float().new_zeros(rows, bias.shape[1])
    return torch.where(valid[:, None], picked, torch.zeros_like(picked))


def reference_activation(h, activation, gate_up_layout, bias, a_offsets, expert_ids, alpha, limit):
    """swiglu_quantize's activation in fp32 PyTorch, before its quantization: [M, 2I] -> [M, I],
    each row plus the bias [E, 2I] of its slot's expert (rows outside a valid slot: no bias)."""
    h = h.float()
    if bias is not None:
        h = h + _row_bias(bias, a_offsets, expert_ids, h.shape[0])
    return swiglu(h, activation, gate_up_layout=gate_up_layout, alpha=alpha, limit=limit)

