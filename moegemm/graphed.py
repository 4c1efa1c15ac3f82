"""Eager calls of the MoE layer at decode sizes, replayed from CUDA graphs captured once.

An eager layer call is a dozen kernel launches and the Python that plans them: at one token
its host time is several times its GPU time. A CUDA graph replays the same launches for the
cost of one. So a layer's eager call with few tokens (the decode steps of generate(), or an
eval loop) is captured once per shape into a graph, with inputs copied into the graph's own
buffers, and afterwards replayed:

    calls = GraphedCalls()
    y = calls(key, layer_fn, x, topk_ids, topk_weights)    # layer_fn(x, ...) -> y, same every call

The key names everything the graph bakes in besides the inputs' values: their shapes, dtypes
and strides (added here), and what the caller adds (the weights' addresses, the options). The
result is a fresh tensor (a copy of the graph's output), so callers may keep it.

Used only where capture is safe and cheap: CUDA tensors, no gradient needed, not inside
another capture or torch.compile (where the outer graph already captures the launches), not on
the reference backend nor under MOEGEMM_DEBUG=1 (both read device values on the host, which a
capture forbids), at most MAX_TOKENS tokens (the graphs' buffers stay allocated). A shape whose
capture fails anyway runs eagerly from then on. MOEGEMM_EAGER_GRAPHS=0 turns it off. The key
also holds what changes what a call computes without changing its inputs: autocast, inference
mode, a forced kernel config (moegemm/config.py). Copies of a layer (deepcopy, pickle) start
with no graphs.
A shape is captured at its second call (one warm-up call and the captured one): the decode
steps of a batch size repeat it, a prompt's length usually does not.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from .compile_boundary import compiling
from .config import choice_context
from .debug import debug_mode

__all__ = ["GraphedCalls", "MAX_TOKENS", "usable"]

MAX_TOKENS = 256  # tokens of a call replayed from a graph, at most
MAX_GRAPHS = 8  # graphs kept per GraphedCalls (the least recently used one freed first)


def usable(x: torch.Tensor, *tensors, backend: str = "auto") -> bool:
    """Whether a call on tokens x [T, H] with `backend` runs from a graph (module docstring)."""
    if x.device.type != "cuda" or x.shape[0] > MAX_TOKENS or os.environ.get("MOEGEMM_EAGER_GRAPHS") == "0":
        return False
    if backend == "reference" or debug_mode():
        return False
    if compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return not torch.is_grad_enabled() or not any(
        t.requires_grad for t in (x, *tensors) if isinstance(t, torch.Tensor))


class _Graph:
    __slots__ = ("graph", "inputs", "output")

    def __init__(self, fn, inputs):
        self.inputs = [t.clone() for t in inputs]
        # Warm-up on a side stream (compiles, creates launch records and caches), as torch asks
        # before a capture; then the capture itself.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(*self.inputs)

    def __call__(self, inputs) -> torch.Tensor:
        for static, given in zip(self.inputs, inputs):
            static.copy_(given)
        self.graph.replay()
        return self.output.clone()


class GraphedCalls:
    """The graphs of one layer's calls, by key (module docstring)."""

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        self.max_graphs = max_graphs
        self.graphs: OrderedDict = OrderedDict()
        self.seen: OrderedDict = OrderedDict()  # keys called once, not captured (yet)
        self.eager: set = set()  # keys whose capture failed

    def __deepcopy__(self, memo) -> GraphedCalls:
        return GraphedCalls(self.max_graphs)  # (a graph holds the original's buffers: not copied)

    def __getstate__(self) -> dict:
        return {"max_graphs": self.max_graphs}

    def __setstate__(self, state: dict):
        self.__init__(state["max_graphs"])

    def __call__(self, key, fn, *inputs: torch.Tensor) -> torch.Tensor:
        """fn(*inputs), from the graph of `key` and the inputs' shapes: captured at the second call
        of a shape (a shape met once, e.g. a prompt's length, is not worth a capture)."""
        key = (key, torch.is_autocast_enabled("cuda"), torch.is_inference_mode_enabled(), choice_context(),
               *((t.shape, t.dtype, t.stride()) for t in inputs))
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph(inputs)
        if key in self.eager or self.seen.pop(key, None) is None:
            self.seen[key] = True
            if len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
            return fn(*inputs)
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        try:
            graph = _Graph(fn, inputs)
        except RuntimeError:  # (a capture CUDA refused: the call runs eagerly, and so does its shape from now on)
            self.eager.add(key)
            return fn(*inputs)
        self.graphs[key] = graph
        return graph(inputs)

    def clear(self):
        self.graphs.clear()
        self.seen.clear()
        self.eager.clear()
