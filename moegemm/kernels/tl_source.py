"""Load a portable Triton (tl) kernel file once compiled and once for Triton's CPU interpreter.

triton.jit reads the interpreter knob when it decorates, so executing the source file twice,
with the knob set each way, gives one build for CUDA tensors and one for CPU tensors,
whatever TRITON_INTERPRET says. Used by the portable matmul, the routing and the activation
kernels.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import triton


@functools.cache
def load(source: Path, interpret: bool):
    """The module of `source` executed with triton.knobs.runtime.interpret = interpret (cached)."""
    name = f"moegemm.kernels.{source.stem}_{'interpreted' if interpret else 'compiled'}"
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module
