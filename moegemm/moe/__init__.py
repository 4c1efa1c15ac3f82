"""The MoE layer: moegemm.MoE (module.py) and the routed experts as functions (forward.py).

    weights.py   checkpoint tensors -> the layer's expert weights (pure functions)
    plan.py      how the layer runs its products for a shape, decided once
    forward.py   moe_forward: the local path and the received path (expert parallelism)
    parallel.py  the layer's expert parallelism around distributed.py's exchange
    state.py     the module's state dict: what its tensors mean, a checkpoint's converted
    module.py    the nn.Module: router, loaders, buffers, graph keying
"""

from ..routing import ROUTERS
from .forward import moe_forward, moe_forward_received
from .module import MoE

__all__ = ["ROUTERS", "MoE", "moe_forward", "moe_forward_received"]
