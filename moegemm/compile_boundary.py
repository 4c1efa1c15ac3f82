"""The one place where the public ops meet torch.compile.

dynamo cannot trace a Triton/Gluon launch, so under torch.compile each public op runs as one
opaque `torch.library` custom op (library.py). A public function is declared with
`@traced_as("name")`: its eager calls run the function as written; a call that torch.compile
traces goes to the function that library.py registered for that name (`register_traced`), which
calls the custom op, whose body runs the implementation (`public.eager`). No other module asks
whether it is being compiled: `compiling()` is the question for code that must behave
differently while traced (a CUDA-graph replay is not recorded into a trace).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["compiling", "register_traced", "traced_as"]

_TRACED: dict[str, Callable] = {}


def compiling() -> bool:
    """Whether torch.compile is tracing the running code."""
    return torch.compiler.is_compiling()


def traced_as(name: str):
    """Decorate a public op: traced calls go to the function registered for `name`; the
    undecorated implementation stays reachable as `.eager` (what the custom op runs)."""

    def wrap(implementation: Callable) -> Callable:
        @functools.wraps(implementation)
        def public(*args, **kwargs):
            if torch.compiler.is_compiling():
                return _TRACED[name](*args, **kwargs)
            return implementation(*args, **kwargs)

        public.eager = implementation
        return public

    return wrap


def register_traced(name: str, call: Callable) -> None:
    """What a traced call of the op declared `traced_as(name)` runs (library.py registers one per op)."""
    if name in _TRACED:
        raise ValueError(f"name: {name!r} already has a traced call")
    _TRACED[name] = call
