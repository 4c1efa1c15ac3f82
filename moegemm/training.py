"""Routed experts with gradients: the forward on moegemm's grouped products, the backward as
grouped products over the same expert groups.

    y = experts_with_grad(x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_layout="concat")

For T tokens [T, H], k choices, E experts of width I, with the weights as the caller stores them
(`transposed=False`: w_gate_up [E, 2I, H], w_down [E, H, I], nn.Linear's [out, in];
`transposed=True`: w_gate_up [E, H, 2I], w_down [E, I, H], gpt-oss's [in, out]):

    forward   plan = route(topk_ids)                   choices grouped by expert (stable)
              x_g  = x[token of each grouped row]      [M, H], M = T*k
              h    = x_g @ w_gate_up[e]^T + b_gu[e]     grouped_matmul (bf16 out), bias in fp32
              a    = act(h)                            SwiGLU (activation.swiglu), fp32 -> bf16
              y    = a @ w_down[e]^T                    grouped_matmul
              out  = sum_j w_j * (y + b_d[e])           the combine kernel, fp32 sums
    backward  dy   = w_j * dout[token]                 [M, H]
              dw_j = <dout[token], y + b_d[e]>          the router's weights
              da   = dy @ w_down[e]                     torch._grouped_mm (dgrad, transposed weights)
              dW_d = dy_e^T a_e, db_d = sum_e dy        torch._grouped_mm grouped over each expert's rows
              dh   = act'(h) da                        autograd of the same fp32 activation
              dx_g = dh @ w_gate_up[e]; dW_gu, db_gu as above
              dx   = sum over a token's valid choices of dx_g    (routing.sum_rows, fp32, deterministic)

Precision, as torch.autocast gives nn.Linear: bf16 weights, or float weights under
torch.autocast(device, torch.bfloat16) (mixed precision with fp32 master weights), run the bf16
products above (the forward on moegemm's kernels, on bf16 casts of the weights), and each weight
gets its gradient in its own dtype. Float weights otherwise (fp32 without autocast) run fp32
products: torch._grouped_mm in fp32 forward and backward, not moegemm's kernels (torch's CUDA
fallback for fp32 reads the group offsets on the host).

Choices whose id lies outside [0, E) are dropped (no row in any group, zero gradient). Every
reduction runs in a fixed order (grouped products, the combine kernels), so gradients are
deterministic. No host synchronization on the bf16 path: every size is T*k or E.
"""

from __future__ import annotations

import torch

from .gate_up import check_activation, swiglu
from .ops import grouped_matmul
from .routing import route, scatter_tokens, sum_rows, unpermute_tokens
from .validation import readable_weights

__all__ = ["experts_with_grad"]

_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """bf16 for bf16 weights or under autocast to bf16 on x's device, else fp32 (module docstring)."""
    device = x.device.type
    if w.dtype == torch.bfloat16 or (torch.is_autocast_enabled(device)
                                     and torch.get_autocast_dtype(device) == torch.bfloat16):
        return torch.bfloat16
    return torch.float32


def _in_out(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """[E, in, out]: the weight as the B operand of torch._grouped_mm's forward product (a view)."""
    return w.detach() if transposed else w.detach().transpose(1, 2)


def _expert_weights(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The [E, N, K] operand moegemm's grouped product reads: a view of w, transposed weights
    ([E, in, out]) read N-major (bf16 grouped_matmul takes either major order); a copy only
    where w is laid out otherwise in memory (no stride along N or K is 1)."""
    return readable_weights(w.detach().transpose(1, 2) if transposed else w.detach(), "bf16")


def _row_bias(bias: torch.Tensor | None, expert_of_row: torch.Tensor, rows: int) -> torch.Tensor | None:
    """bias[e] of each grouped row in fp32 (dropped rows clamped to an expert: never read)."""
    if bias is None:
        return None
    experts = bias.shape[0]
    return bias.detach().float().index_select(0, expert_of_row[:rows].clamp(max=experts - 1).long())


def _grouped(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over groups of rows ending at `ends` (int32 [E]); bf16 or fp32 operands."""
    return torch._grouped_mm(a, b, offs=ends)


def _segment_sums(rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[E, C]: the sum of each expert's rows of `rows` [M, C] (a grouped product with columns of
    ones: a fixed reduction order, deterministic)."""
    ones = torch.ones(rows.shape[0], 8, dtype=rows.dtype, device=rows.device)  # (16-byte rows)
    return _grouped(rows.t(), ones, ends)[:, :, 0]


def _expert_product(rows: torch.Tensor, kernel_weights: torch.Tensor | None, weights: torch.Tensor,
                    transposed: bool, plan, backend: str) -> torch.Tensor:
    """rows [M, K] (grouped by plan) times each group's expert weights: moegemm's bf16 product on
    kernel_weights [E, N, K] where the forward runs bf16, else torch's grouped product on `weights`
    as stored, in rows' dtype."""
    if kernel_weights is not None:
        out = torch.empty(rows.shape[0], kernel_weights.shape[1], dtype=rows.dtype, device=rows.device)
        return grouped_matmul(rows, kernel_weights, None, None, plan.a_offsets, plan.expert_ids, fmt="bf16",
                              backend=backend, out=out)
    return _grouped(rows, _in_out(weights, transposed).to(rows.dtype), plan.a_offsets[1:])


class RoutedExpertsFunction(torch.autograd.Function):
    """The routed experts with their backward (module docstring): what experts_with_grad applies."""

    @staticmethod
    def forward(ctx, x, topk_weights, w_gate_up, w_down, gate_up_bias, down_bias, topk_ids, gate_up_layout,
                activation, alpha, limit, transposed, backend, kernel_gate_up, kernel_down):
        # kernel_*: the bf16 [E, N, K] operands of moegemm's kernels; None: fp32 products.
        with torch.autocast(x.device.type, enabled=False):  # (every dtype here is chosen, module docstring)
            return RoutedExpertsFunction._forward(ctx, x, topk_weights, w_gate_up, w_down, gate_up_bias, down_bias,
                                                  topk_ids, gate_up_layout, activation, alpha, limit, transposed,
                                                  backend, kernel_gate_up, kernel_down)

    @staticmethod
    def _forward(ctx, x, topk_weights, w_gate_up, w_down, gate_up_bias, down_bias, topk_ids, gate_up_layout,
                 activation, alpha, limit, transposed, backend, kernel_gate_up, kernel_down):
        num_experts = w_gate_up.shape[0]
        plan = route(topk_ids, num_experts, topk_weights.detach())
        rows = plan.num_grouped_rows
        compute = torch.bfloat16 if kernel_gate_up is not None else torch.float32
        x_g = scatter_tokens(x.detach().to(compute), plan)
        h = _expert_product(x_g, kernel_gate_up, w_gate_up, transposed, plan, backend)
        expert_of_row = plan.expert_of_row
        bias = _row_bias(gate_up_bias, expert_of_row, rows)
        h = (h.float() + bias).to(compute) if bias is not None else h
        a = swiglu(h, activation, gate_up_layout=gate_up_layout, alpha=alpha, limit=limit).to(compute)
        y = _expert_product(a, kernel_down, w_down, transposed, plan, backend)
        out = unpermute_tokens(y, plan, topk_weights.detach(), out_dtype=x.dtype,
                               expert_bias=None if down_bias is None else down_bias.detach().float())
        ctx.save_for_backward(x_g, h, y, topk_weights, w_gate_up, w_down, gate_up_bias, down_bias,
                              plan.token_index, plan.grouped_row, plan.valid, plan.a_offsets, expert_of_row)
        ctx.options = (gate_up_layout, activation, alpha, limit, transposed)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return RoutedExpertsFunction._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        (x_g, h, y, topk_weights, w_gate_up, w_down, gate_up_bias, down_bias, token_index, grouped_row, valid,
         a_offsets, expert_of_row) = ctx.saved_tensors
        gate_up_layout, activation, alpha, limit, transposed = ctx.options
        need_x, need_w, need_gu, need_d, need_bgu, need_bd = ctx.needs_input_grad[:6]
        rows, ends = y.shape[0], a_offsets[1:]
        t, k = grouped_row.shape
        dout = dout.contiguous()
        compute = h.dtype
        # The choice each grouped row holds (grouped_row is a permutation of the T*k rows).
        choice = torch.empty(rows, dtype=torch.int64, device=y.device)
        choice.scatter_(0, grouped_row.reshape(-1), torch.arange(rows, device=y.device))
        dout_rows = dout.index_select(0, token_index).float()
        row_weight = topk_weights.detach().reshape(-1).index_select(0, choice).float()
        dy = (dout_rows * row_weight.unsqueeze(1)).to(compute)
        d_topk = None
        if need_w:
            bias = _row_bias(down_bias, expert_of_row, rows)
            y_full = y.float() + bias if bias is not None else y.float()
            per_row = (dout_rows * y_full).sum(dim=1)
            d_topk = torch.where(valid, per_row.index_select(0, grouped_row.reshape(-1)).view(t, k),
                                 0.0).to(topk_weights.dtype)
        w_down_kn = w_down.detach().transpose(1, 2) if transposed else w_down.detach()  # [E, H, I]
        w_gate_up_kn = w_gate_up.detach().transpose(1, 2) if transposed else w_gate_up.detach()  # [E, 2I, H]
        da = _grouped(dy, w_down_kn.to(compute), ends)
        d_down = d_bias_down = d_gate_up = d_bias_gate_up = dx = None
        if need_d or need_gu or need_x or need_bgu:
            a = swiglu(h, activation, gate_up_layout=gate_up_layout, alpha=alpha, limit=limit).to(compute)
        if need_d:
            d_down = _grouped(a.t(), dy, ends) if transposed else _grouped(dy.t(), a, ends)
            d_down = d_down.to(w_down.dtype)
        if need_bd:
            d_bias_down = _segment_sums(dy, ends).to(down_bias.dtype)
        if need_x or need_gu or need_bgu:
            with torch.enable_grad():
                h_var = h.float().requires_grad_()
                act = swiglu(h_var, activation, gate_up_layout=gate_up_layout, alpha=alpha, limit=limit)
                (dh,) = torch.autograd.grad(act, h_var, da.float())
            dh = dh.to(compute)
            if need_gu:
                d_gate_up = _grouped(x_g.t(), dh, ends) if transposed else _grouped(dh.t(), x_g, ends)
                d_gate_up = d_gate_up.to(w_gate_up.dtype)
            if need_bgu:
                d_bias_gate_up = _segment_sums(dh, ends).to(gate_up_bias.dtype)
            if need_x:
                dx = sum_rows(_grouped(dh, w_gate_up_kn.to(compute), ends), grouped_row, valid,
                              out_dtype=ctx.x_dtype)
        return (dx, d_topk, d_gate_up, d_down, d_bias_gate_up, d_bias_down) + (None,) * 9


def experts_with_grad(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor, *, gate_up_layout: str, activation: str = "swiglu",
                      gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                      alpha: float = 1.702, limit: float = 7.0, transposed: bool = False,
                      backend: str = "auto") -> torch.Tensor:
    """The routed experts of x [T, H] (module docstring) with gradients to x, topk_weights, the
    weights and the biases. Weights of one float dtype, in the caller's layout (`transposed`);
    gate/up rows (columns when transposed) "concat" ([gate; up]) or "interleaved" as
    gate_up_layout states. bf16 weights, or any under torch.autocast to bf16, run bf16 products
    on moegemm's kernels, else fp32 products (module docstring). The kernels read bf16 [E, N, K]
    weights in place (transposed ones N-major); other dtypes are cast each call (training changes
    them every step). x may be any view: x whose columns are strided is copied once (the grouped
    products read rows of unit column stride). Returns [T, H] in x's dtype; each gradient in
    its tensor's dtype."""
    check_activation(activation, gate_up_layout)
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in _WEIGHT_DTYPES:
            raise TypeError(f"{name}: expected a bf16, fp16 or fp32 [E, N, K] tensor, got "
                            f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.stride(-1) != 1:
        x = x.contiguous()
    if w_down.dtype != w_gate_up.dtype:
        raise TypeError(f"w_down: expected w_gate_up's dtype {w_gate_up.dtype}, got {w_down.dtype}")
    kernels = (None, None)
    if _compute_dtype(x, w_gate_up) == torch.bfloat16:
        kernels = tuple(_expert_weights(w.detach().to(torch.bfloat16), transposed) for w in (w_gate_up, w_down))
    return RoutedExpertsFunction.apply(x, topk_weights, w_gate_up, w_down, gate_up_bias, down_bias, topk_ids,
                                       gate_up_layout, activation, float(alpha), float(limit), transposed, backend,
                                       *kernels)
