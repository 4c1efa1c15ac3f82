"""The MoE layer's state dict: what its expert tensors mean, and a checkpoint's tensors made what a
layer holds (docs/contract.md section 7, checkpoints).

    MoE.get_extra_state()                the meaning, under "_extra_state": format, scale layout,
                                         gate/up order, each weight's code order, the experts held
    state_change(layer, state_dict, p)   the checkpoint's expert tensors converted to what `layer`'s
                                         loaders would have made (code order, scale layout, a rank's
                                         experts), or a ValueError naming both sides
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import layouts
from ..formats import FORMATS, get_format
from ..prepack import check_prepackable, prepack_codes, unpack_codes
from .weights import gate_up_layout, keeps_prepacked, weight_scale_layout

__all__ = ["EXPERT_WEIGHTS", "STATE_VERSION", "StateChange", "state_change"]


# The version of the extra state below: what a state dict's "_extra_state" holds.
STATE_VERSION = 1
_WEIGHT_PARTS = ("data", "scales", "global")
EXPERT_WEIGHTS = tuple(f"{w}_{part}" for w in ("gate_up", "down") for part in _WEIGHT_PARTS)
_STATE_CHOICES = {"fmt": tuple(FORMATS), "scale_layout": (layouts.PLAIN.name, layouts.SWIZZLED.name),
                  "gate_up_layout": ("concat", "interleaved"), "gate_up_order": ("plain", "prepacked"),
                  "down_order": ("plain", "prepacked")}


def _weight_parts(fmt: str, scale_layout: layouts.ScaleLayout, experts: int, n: int, k: int) -> dict:
    """part ("data", "scales", "global") -> (shape, accepted dtypes) of `experts` experts' weights
    [n, k] in fmt's B operand, scales in `scale_layout`; only the parts the format has."""
    b = get_format(fmt).b
    parts = {"data": ((experts, n, b.stored_k(k)), (b.element.storage_dtype, ))}
    if b.scaled:
        k_scales = math.ceil(k / b.block_k)
        if b.block_n > 1:
            shape = (experts, math.ceil(n / b.block_n), k_scales)
        else:
            shape = scale_layout.b_shape(experts, n, k_scales)
        parts["scales"] = (tuple(shape), b.accepted_scale_dtypes)
    if b.global_scale:
        parts["global"] = ((experts, ), (torch.float32, ))
    return parts


def _saved_meaning(saved, key: str) -> dict:
    """A checkpoint's MoE extra state (MoE.get_extra_state), checked: ValueError naming `key` unless
    it is a dict of this version with every field one of its values."""
    version = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
    if version != STATE_VERSION:
        raise ValueError(f"state_dict[{key!r}]: expected an MoE state of version {STATE_VERSION}, got version "
                         f"{version!r}")
    for field, choices in _STATE_CHOICES.items():
        if saved.get(field) not in choices:
            raise ValueError(f"state_dict[{key!r}]: expected {field} one of {list(choices)}, got {saved.get(field)!r}")
    experts, count = saved.get("experts"), saved.get("num_experts")
    if not (isinstance(count, int) and isinstance(experts, (tuple, list)) and len(experts) == 2
            and all(isinstance(v, int) for v in experts) and 0 <= experts[0] < experts[1] <= count):
        raise ValueError(f"state_dict[{key!r}]: expected experts (first, last) of num_experts, got {experts!r} of "
                         f"{count!r}")
    return saved


class StateChange(NamedTuple):
    """What a checkpoint's expert tensors become in a layer (state_change)."""
    fmt: str  # the layer's format after the load
    tensors: dict  # state-dict key -> the tensor, converted to the layer's order, layout and experts
    prepacked: dict  # "gate_up" / "down" -> the order of its loaded codes


def state_change(layer, state_dict: dict, prefix: str) -> StateChange | None:
    """The checkpoint's expert tensors (weights and biases) as `layer` (an MoE) would hold them, or
    None where there are none; nothing on the layer changes. ValueError unless the
    checkpoint's extra state says what they mean, or where it differs in what cannot be
    converted: another format (unless the layer was built with fmt=None: then it takes the
    checkpoint's), another gate/up row order, other experts than the layer's or all of them.
    Converted: the codes' order (prepacked or plain, to what weights.keeps_prepacked says for
    the layer on its device), the scale layout, the full checkpoint cut to a rank's experts."""
    names = EXPERT_WEIGHTS + (("gate_up_bias", "down_bias") if layer.has_expert_bias else ())
    given = {name: state_dict[prefix + name] for name in names if prefix + name in state_dict}
    if not given:
        return None
    key = prefix + "_extra_state"
    if key not in state_dict:
        raise ValueError(f"state_dict: expected {key!r} (what the expert tensors mean: format, order, scale "
                         f"layout) beside {', '.join(repr(prefix + name) for name in given)}")
    saved = _saved_meaning(state_dict[key], key)
    fmt = saved["fmt"]
    if fmt != layer.fmt and layer.chosen_fmt is not None:
        raise ValueError(f"state_dict: expected experts of format {layer.fmt} (this layer's), got {fmt} (the "
                         f"checkpoint's); build the layer with fmt={fmt!r}, or fmt=None to take the checkpoint's")
    f = get_format(fmt)
    for name, size in (("hidden_size", layer.hidden_size), ("intermediate_size", layer.intermediate_size)):
        if size % f.k_multiple:
            raise ValueError(f"state_dict: the checkpoint's format {fmt} needs {name} a multiple of "
                             f"{f.k_multiple}, this layer's is {size}")
    if saved["gate_up_layout"] != gate_up_layout(fmt):
        raise ValueError(f"state_dict: expected gate/up rows {gate_up_layout(fmt)!r} (this layer's order), got "
                         f"{saved['gate_up_layout']!r}")
    layout, saved_layout = weight_scale_layout(fmt), layouts.scale_layout_of(saved["scale_layout"])
    if saved_layout != layout and f.scaled and not f.swizzle_capable:
        raise ValueError(f"state_dict: expected scale layout {layout!r} (the only one of {fmt}), got "
                         f"{saved['scale_layout']!r}")
    first, last = layer.expert_range
    saved_first, saved_last = saved["experts"]
    if saved["num_experts"] != layer.num_experts or (saved_first, saved_last) not in ((first, last),
                                                                                    (0, layer.num_experts)):
        raise ValueError(f"state_dict: holds experts [{saved_first}, {saved_last}) of {saved['num_experts']}, "
                         f"this layer keeps [{first}, {last}) of {layer.num_experts}: expected those or all "
                         f"{layer.num_experts}")
    cut = (saved_first, saved_last) != (first, last)
    device = layer.router_weight.device
    e, i, h = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
    tensors, prepacked = {}, {}
    for weight, n, k in (("gate_up", 2 * i, h), ("down", h, i)):
        parts = _weight_parts(fmt, saved_layout, e, n, k)
        present = [part for part in _WEIGHT_PARTS if f"{weight}_{part}" in given]
        if not present:
            continue
        if list(parts) != present:  # (a weight's parts mean something only together)
            keys = lambda names: ", ".join(repr(f"{prefix}{weight}_{part}") for part in names)  # noqa: E731
            raise ValueError(f"state_dict: expected {keys(parts)} ({fmt} weights), got {keys(present)}")
        for part, (shape, dtypes) in parts.items():
            name = f"{weight}_{part}"
            t = _checked_state(layer, given[name], f"state_dict[{prefix + name!r}]", shape, dtypes, cut)
            if part == "scales":
                t = t.view(dtypes[0])  # (e8m0 scales may come as their bytes)
                if saved_layout != layout:
                    t = layout.b_from_plain(saved_layout.b_to_plain(t, n, math.ceil(k / f.b.block_k)))
            elif part == "data":
                was = saved[f"{weight}_order"] == "prepacked"
                if was:
                    check_prepackable(fmt, shape, f"state_dict[{key!r}] ({weight}_order 'prepacked')")
                keeps = keeps_prepacked(layer.prepack, layer.backend, fmt, n, k, device)
                if was != keeps:  # (where the tensor lies: assign=True keeps the checkpoint's device)
                    t = prepack_codes(t) if keeps else unpack_codes(t)
                prepacked[weight] = keeps
            tensors[name] = t
    for name, shape in (("gate_up_bias", (e, 2 * i)), ("down_bias", (e, h))):
        if name in given:
            t = _checked_state(layer, given[name], f"state_dict[{prefix + name!r}]", shape, None, cut)
            tensors[name] = t.float()
    return StateChange(fmt, tensors, prepacked)


def _checked_state(layer, t, name: str, shape: tuple, dtypes, cut: bool) -> torch.Tensor:
    """A checkpoint's per-expert tensor: cut to the layer's rank's experts where `cut` (it holds all
    of them), then of `shape` and one of `dtypes` (None: any float dtype), else ValueError
    naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if cut:
        if t.dim() == 0 or t.shape[0] != layer.num_experts:
            raise ValueError(f"{name}: expected the {layer.num_experts} experts its extra state says it holds, "
                             f"got shape {tuple(t.shape)}")
        t = t[layer.expert_range[0]:layer.expert_range[1]]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is None and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected {' or '.join(map(str, dtypes))}, got {t.dtype}")
    return t
