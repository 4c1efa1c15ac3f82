"""Load a portable Triton (tl) kernel file once compiled and once for Triton's CPU interpreter.

triton.jit reads the interpreter knob when it decorates, so executing the source file twice,
with the knob set each way, gives one build for CUDA tensors and one for CPU tensors,
whatever TRITON_INTERPRET says. Used by the portable matmul, the routing and the activation
kernels.

A @triton.jit function can call only functions built for its own mode, so a tl file that uses
another (the codecs of _codecs_tl.py) loads it with load_beside, which builds it for the mode
the using file is being executed in.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from pathlib import Path

import numpy
import torch
import triton

# Where the interpreter is not usable, what installs what it needs (the extra pins numpy < 2.4).
INTERPRETER_FIX = 'pip install "moegemm[cpu]"'

# The interpreter knob is process-wide: one file is executed at a time. Reentrant, since a file
# being executed loads the files it uses.
_lock = threading.RLock()
_executing: list[bool] = []  # the mode of each file load() is executing, innermost last


@functools.cache
def load(source: Path, interpret: bool):
    """The module of `source` executed with triton.knobs.runtime.interpret = interpret (cached)."""
    name = f"moegemm.kernels.{source.stem}_{'interpreted' if interpret else 'compiled'}"
    with _lock, triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        _executing.append(interpret)
        try:
            spec = importlib.util.spec_from_file_location(name, source)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            _executing.pop()
    return module


def interpreted() -> bool:
    """Whether the tl file load() is executing is built for the interpreter (for its top level)."""
    if not _executing:
        raise RuntimeError("tl_source.interpreted: only a tl file executed by tl_source.load has a mode")
    return _executing[-1]


def load_beside(tl_file: str, name: str):
    """The tl file `name` in the folder of tl_file, built for the mode tl_file is being executed
    in: call it at the top level of a tl file, as `load_beside(__file__, "_codecs_tl.py")`."""
    return load(Path(tl_file).with_name(name), interpreted())


@functools.cache
def interpreter_usable() -> bool:
    """Triton 3.6's CPU interpreter converts 1-element arrays with int(), which numpy >= 2.4 refuses."""
    major, minor = (int(part) for part in numpy.__version__.split(".")[:2])
    return (major, minor) < (2, 4)


def interpreter_note(device: torch.device | str) -> str:
    """For an error about the Triton kernels on `device`: why the CPU cannot run them and the fix,
    where the interpreter is not usable; '' otherwise."""
    if torch.device(device).type != "cpu" or interpreter_usable():
        return ""
    return f" (Triton's CPU interpreter needs numpy < 2.4: {INTERPRETER_FIX})"
