"""transformers integration: an experts backend, and drop-in construction of `moegemm.MoE`.

    backend.py    register, prepare, refresh: the "moegemm" experts implementation
    converted.py  the weights a module's calls read, converted once and checked at every call
    spec.py       how an experts module computes (its gate, order, layout), read off the module
    blocks.py     from_transformers: a standalone moegemm.MoE from a whole MoE block
"""

from .backend import NAME, experts_forward, experts_modules, prepare, refresh, register
from .blocks import from_transformers

__all__ = ["NAME", "experts_forward", "experts_modules", "from_transformers", "prepare", "refresh", "register"]
