"""Argument checks of the public grouped matmul (docs/contract.md section 8).

Every check here reads only shapes, dtypes, devices and strides, so it never synchronizes
the GPU. Checks that need tensor *values* (offsets, expert ids, finite expert scales, enough
swizzled scale rows) run when the tensors live on the CPU, where reading them is free, and on
the GPU only in debug mode (MOEGEMM_DEBUG=1). Without debug mode the kernels still clamp
offsets to [0, M] and skip expert ids outside [0, E), so bad values can never make them
write outside `out` or read outside `b`.
"""

from __future__ import annotations

import math

import torch

from . import layouts
from .debug import values_checked
from .formats import Format
from .prepack import check_prepackable
from .problem import GroupedProblem
from .token_forms import TokenForm, kb_major_columns, token_form

__all__ = ["validate_grouped_matmul", "validate_values", "check_no_grad", "readable_weights"]

OUT_DTYPES = (torch.bfloat16, torch.float32)


def check_no_grad(without_backward: str, **tensors):
    """ValueError for inputs that require grad where the computation (`without_backward`, e.g.
    "backend 'sm90'") has no backward: its output would silently drop the gradient. Calls
    under torch.no_grad() / inference_mode() pass."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and isinstance(t, torch.Tensor) and t.requires_grad:  # (None first: most are)
            raise ValueError(f"{name}: requires grad, but {without_backward} has no backward (the output would drop "
                             f"the gradient); call it under torch.no_grad() or torch.inference_mode()")


def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _dtype(x: torch.Tensor, name: str, allowed: tuple[torch.dtype, ...]):
    if x.dtype not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {want}, got {x.dtype}")


def _shape(x: torch.Tensor, name: str, expected: tuple[int, ...], what: str = ""):
    if tuple(x.shape) != tuple(expected):
        detail = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {tuple(expected)}{detail}, got {tuple(x.shape)}")


def _device(x: torch.Tensor, name: str, device: torch.device):
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of a), got {x.device}")


def _contiguous(x: torch.Tensor, name: str):
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(x.stride())}")


def _check(x, name: str, dtypes, device, shape=None, what: str = "") -> torch.Tensor:
    x = _tensor(x, name)
    _dtype(x, name, dtypes)
    _device(x, name, device)
    if shape is not None:
        _shape(x, name, shape, what)
    _contiguous(x, name)
    return x


def validate_grouped_matmul(
    a, b, a_scales, b_scales, a_offsets, expert_ids, *, fmt: Format, a_scale_offsets, expert_scales,
    row_scales, scale_layout, out, out_dtype, quantized_a_offsets=None, a_form=None, b_prepacked=False,
) -> GroupedProblem:
    """Raise TypeError/ValueError naming the first bad argument; return the problem sizes.
    fmt: the call's Format (formats.get_format of its name, looked up by the caller).
    quantized_a_offsets: the a_offsets swizzled A scales (or a token form) were made for (a
    QuantizedTensor operand's), which must be the call's. a_form: a holds tokens in this token
    form, a_scales their K-block-major scales (or None), the form the problem's sm90 kernel
    reads. b_prepacked: b holds its codes in moegemm.prepack's order. The checks that read
    tensor values are validate_values' (a plan's run calls it; it checks where debug.values_checked says)."""
    f = fmt

    a = _tensor(a, "a")
    device = a.device
    if a_form is None:
        _dtype(a, "a", (f.a.element.storage_dtype,))
        if a.dim() != 2:
            raise ValueError(f"a: expected 2 dimensions [M, K{'/2' if f.a.element.packed else ''}], got shape "
                             f"{tuple(a.shape)}")
    else:
        _dtype(a, "a", (torch.float8_e4m3fn if a_form.kind == "e4m3" else torch.bfloat16,))
        if a.dim() != 2:
            raise ValueError(f"a: expected 2 dimensions [M, K] (tokens in {a_form}), got shape {tuple(a.shape)}")
    _contiguous(a, "a")
    b = _tensor(b, "b")
    _dtype(b, "b", (f.b.element.storage_dtype,))
    _device(b, "b", device)
    if b.dim() != 3:
        raise ValueError(f"b: expected 3 dimensions [E, N, K{'/2' if f.b.element.packed else ''}], got shape {tuple(b.shape)}")
    b_n_major = _weight_order(b, f)

    m = a.shape[0]
    k = f.a.logical_k(a.shape[1]) if a_form is None else a.shape[1]
    e, n = b.shape[0], b.shape[1]
    if f.b.logical_k(b.shape[2]) != k:
        raise ValueError(
            f"b: expected K={k} (from a: shape {tuple(a.shape)}), got shape {tuple(b.shape)} meaning K={f.b.logical_k(b.shape[2])}"
        )
    if k % f.k_multiple:
        raise ValueError(f"a: K must be a multiple of {f.k_multiple} for {f.name}, got K={k}")

    a_offsets = _check(a_offsets, "a_offsets", (torch.int32,), device)
    if a_offsets.dim() != 1 or a_offsets.numel() < 1:
        raise ValueError(f"a_offsets: expected a 1-D tensor [G+1] with G >= 0, got shape {tuple(a_offsets.shape)}")
    g = a_offsets.numel() - 1
    _check(expert_ids, "expert_ids", (torch.int32,), device, (g,), "G = len(a_offsets) - 1")

    problem = GroupedProblem(f, m, n, k, e, g, scale_layout, out_dtype, b_prepacked, b_n_major)
    _validate_scales(problem, a_scales, b_scales, a_scale_offsets, device, a_form is not None)

    if expert_scales is not None:
        _check(expert_scales, "expert_scales", (torch.float32,), device, (e,), "one per expert")
    if row_scales is not None:
        _check(row_scales, "row_scales", (torch.float32, torch.bfloat16), device, (m,), "one per row of a")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    if out is not None:
        _check(out, "out", (out_dtype,), device, (m, n), "[M, N]")

    if quantized_a_offsets is not None:
        _check(quantized_a_offsets, "a_offsets", (torch.int32,), device, (g + 1,),
               "the group offsets a's swizzled scales were quantized for have another length")
    # (the checks that other modules' rules make)
    if a_form is not None:
        _validate_form(problem, a_form, a_scales, device)
    if b_prepacked:
        check_prepackable(f.name, b.shape, "b")
    return problem


def _n_major(b: torch.Tensor, fmt_name: str) -> bool:
    """b [E, N, K] is bf16's other order: the transpose(1, 2) of a contiguous [E, K, N] tensor."""
    return fmt_name == "bf16" and not b.is_contiguous() and b.transpose(1, 2).is_contiguous()


def readable_weights(w: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """Weights [E, N, K] of fmt as grouped_matmul takes them (_weight_order): w itself where its
    strides are already taken (no copy), else a contiguous copy."""
    return w if w.is_contiguous() or _n_major(w, fmt_name) else w.contiguous()


def _weight_order(b: torch.Tensor, f: Format) -> bool:
    """Whether b [E, N, K] is read N-major. Every format takes contiguous weights (K-major); bf16
    also the transpose(1, 2) of a contiguous [E, K, N] tensor (unit stride along N: gpt-oss
    stores its experts [E, in, out]), read in place by every backend. Other strides raise."""
    if b.is_contiguous():
        return False
    if _n_major(b, f.name):
        return True
    either = " or the transpose(1, 2) of a contiguous [E, K, N] tensor (bf16 only)" if f.name == "bf16" else ""
    raise ValueError(f"b: expected a contiguous tensor{either}, got shape {tuple(b.shape)} and strides "
                     f"{tuple(b.stride())}")


def _validate_form(p: GroupedProblem, form: TokenForm, a_scales, device):
    """Tokens in `form` for problem p: the form its sm90 kernel reads, with its scales."""
    if p.m and p.num_groups:
        want = token_form(p.fmt, p.n, p.k, p.m, p.num_groups, p.prepacked)
        if form != want:
            raise ValueError(f"a: tokens in {form}, but the sm90 kernel of this problem reads "
                             f"{'no token form' if want is None else want} (token_forms.token_form)")
    if form.kind == "bf16":
        if a_scales is not None:
            raise ValueError(f"a_scales: tokens in the bf16 form have no scales, got a {type(a_scales).__name__}")
        return
    _check(a_scales, "a_scales", (torch.float32,), device,
           (p.num_k_scales, kb_major_columns(p.m, p.num_groups, form.column_block)), "K-block-major token scales")


def _validate_scales(p: GroupedProblem, a_scales, b_scales, a_scale_offsets, device, a_form: bool = False):
    """The scales of a (unless a_form: a token form's, checked by _validate_form) and b. A
    weight-only format's a is bf16 without scales."""
    f = p.fmt
    if not f.scaled:
        for name, s in (("a_scales", a_scales), ("b_scales", b_scales), ("a_scale_offsets", a_scale_offsets)):
            if s is not None:
                raise ValueError(f"{name}: bf16 takes no scales, got a {type(s).__name__}")
        return
    if not f.a_scaled:
        for name, s in (("a_scales", a_scales), ("a_scale_offsets", a_scale_offsets)):
            if s is not None:
                raise ValueError(f"{name}: {f.name} is weight-only (bf16 activations, no scales), got a "
                                 f"{type(s).__name__}")
    a_scaled = f.a_scaled and not a_form
    nkb = p.num_k_scales
    if not p.scale_layout.swizzled:
        a_shape = (p.m, nkb)
        if f.b.block_n > 1:
            b_shape = (p.num_experts, math.ceil(p.n / f.b.block_n), nkb)
        else:
            b_shape = p.scale_layout.b_shape(p.num_experts, p.n, nkb)
        b_what = "plain layout [E, ceil(N/128), ceil(K/128)]" if f.b.block_n > 1 else "plain layout [E, N, K/vec]"
        if a_scaled:
            _check(a_scales, "a_scales", f.a.accepted_scale_dtypes, device, a_shape, "plain layout [M, K/vec]")
        _check(b_scales, "b_scales", f.b.accepted_scale_dtypes, device, b_shape, b_what)
        if a_scale_offsets is not None:
            raise ValueError("a_scale_offsets: only used with scale_layout='swizzled', got a tensor with 'plain'")
        return
    if a_scaled:
        a_scales = _check(a_scales, "a_scales", f.a.accepted_scale_dtypes, device)
        atom = layouts.swizzled_a_shape(0, nkb)[1:]
        if a_scales.dim() != 5 or tuple(a_scales.shape[1:]) != atom:
            raise ValueError(f"a_scales: expected the swizzled shape (row_blocks, {', '.join(map(str, atom))}), got "
                             f"{tuple(a_scales.shape)}")
    _check(b_scales, "b_scales", f.b.accepted_scale_dtypes, device, p.scale_layout.b_shape(p.num_experts, p.n, nkb),
           "swizzled layout")
    if a_scale_offsets is not None:
        _check(a_scale_offsets, "a_scale_offsets", (torch.int32,), device, (p.num_groups,), "one per group slot")


def validate_values(p: GroupedProblem, a_offsets, expert_ids, expert_scales, a_scales, a_scale_offsets,
                    quantized_a_offsets=None, a_form: TokenForm | None = None):
    """The checks that read tensor values, for a problem whose shapes validate_grouped_matmul
    has checked, where debug.values_checked says (free on the CPU, debug mode only on the GPU:
    they synchronize); elsewhere none."""
    if not values_checked(a_offsets.device):
        return
    offsets = a_offsets.long().cpu()
    if offsets.numel() and offsets[0] < 0:
        raise ValueError(f"a_offsets: expected a_offsets[0] >= 0, got {int(offsets[0])}")
    if p.num_groups and bool((offsets[1:] < offsets[:-1]).any()):
        bad = int(torch.nonzero(offsets[1:] < offsets[:-1])[0])
        raise ValueError(
            f"a_offsets: expected non-decreasing values, got a_offsets[{bad}]={int(offsets[bad])} > "
            f"a_offsets[{bad + 1}]={int(offsets[bad + 1])}"
        )
    if int(offsets[-1]) > p.m:
        raise ValueError(f"a_offsets: expected a_offsets[G] <= M={p.m}, got {int(offsets[-1])}")
    ids = expert_ids.cpu()
    if p.num_groups and int(ids.max()) >= p.num_experts:
        raise ValueError(f"expert_ids: expected ids < E={p.num_experts} (or < 0 to skip), got {int(ids.max())}")
    if expert_scales is not None and not bool(torch.isfinite(expert_scales).all()):
        raise ValueError("expert_scales: expected finite values, got NaN or inf")
    if p.fmt.a_scaled and p.scale_layout.swizzled and p.num_groups and a_form is None:
        _, scale_rows, slot = layouts.a_scale_rows(
            a_offsets.cpu(), None if a_scale_offsets is None else a_scale_offsets.cpu()
        )
        scale_rows = scale_rows[ids.long()[slot] >= 0]  # skipped slots are never read
        rows_available = a_scales.shape[0] * layouts.ROWS_PER_BLOCK
        if scale_rows.numel() and (int(scale_rows.min()) < 0 or int(scale_rows.max()) >= rows_available):
            raise ValueError(
                f"a_scales: the groups need scale rows up to {int(scale_rows.max())}, but the swizzled tensor "
                f"holds {a_scales.shape[0]} blocks of 128 rows"
            )
    if quantized_a_offsets is not None and quantized_a_offsets is not a_offsets:
        placed, given = quantized_a_offsets.cpu(), a_offsets.cpu()
        if not torch.equal(placed, given):
            g = int(torch.nonzero(placed != given)[0])
            raise ValueError(f"a_offsets: a's {'token form' if a_form else 'swizzled scales'} were placed for other "
                             f"group offsets (moegemm.quantize(..., a_offsets=...) had a_offsets[{g}]={int(placed[g])}, "
                             f"the call gives {int(given[g])})")
