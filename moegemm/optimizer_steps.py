"""Which watched tensors a torch optimizer has stepped: a change their version counter misses.

torch's fused optimizers (Adam, AdamW, SGD, Adagrad with fused=True, the transformers Trainer's
default where torch has them) write parameters in place from kernels that leave the tensors'
version counters as they were, so a copy made from a parameter cannot tell from the tensor that
an optimizer changed it. A post-step hook on every torch.optim.Optimizer (installed once, by the
first watch()) gives each watched tensor the step held a new generation:

    stamp = watch(t)                 # t's generation now
    ...                              # optimizer.step() on any optimizer holding t
    generation(t) != stamp           # stepped since

Every tensor in the optimizer's parameter groups counts as stepped, whether or not the step
changed it (a parameter without a gradient): a copy made again for nothing, never a stale one.
Only watched tensors are tracked (an entry lives as long as its tensor), so a step costs one
lookup per parameter of the optimizer, none when nothing is watched. Changes made through
`tensor.data` by anything other than an optimizer's step stay invisible here and to the version
counter.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["generation", "watch"]

_generations: dict[int, int] = {}  # id(watched tensor) -> the generation of the last step that held it
_steps = itertools.count(1)
_hook = None


def _after_step(optimizer, args, kwargs) -> None:
    if not _generations:
        return
    step = next(_steps)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in _generations:
                _generations[id(p)] = step


def watch(t: torch.Tensor) -> int:
    """Track `t` (installing the optimizer hook once); returns its generation now."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_after_step)
    key = id(t)
    if key not in _generations:
        _generations[key] = 0
        # (the entry goes with the tensor, before another object can take its id)
        weakref.finalize(t, _generations.pop, key, None)
    return _generations[key]


def generation(t: torch.Tensor) -> int:
    """The generation of the last optimizer step that held `t` (0: none since it was watched)."""
    return _generations.get(id(t), 0)
