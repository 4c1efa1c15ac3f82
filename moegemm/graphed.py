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
result is a fresh tensor, so callers may keep it.

Pointer graphs: the copies in and out cost more host time than the replay. In steady-state
decode the caching allocator hands a layer's inputs, and its fresh output, the same addresses
step after step, so a second graph is also keyed by those addresses: captured on the caller's
own tensors, writing into the fresh output, it replays with no copy. At most MAX_POINTER_GRAPHS
a layer (the least recently used freed first); a shape whose captures of them outrun their
replays (addresses that do not repeat within MAX_POINTER_GRAPHS) captures none any more. A call
no pointer graph matches takes the copying graph of its shape.

Used only where capture is safe and cheap: CUDA tensors, no gradient needed, not inside
another capture or torch.compile (where the outer graph already captures the launches), not on
the reference backend nor under MOEGEMM_DEBUG=1 (both read device values on the host, which a
capture forbids), at most MAX_TOKENS tokens (the graphs' buffers stay allocated). A shape whose
capture fails anyway runs eagerly from then on, one whose pointer capture fails from its
copying graph. MOEGEMM_EAGER_GRAPHS=0 turns it off. The key also holds what changes what a call
computes without changing its inputs: autocast, inference mode, a forced kernel config
(moegemm/config.py). Copies of a layer (deepcopy, pickle) start with no graphs. One layer's
calls are stream-ordered (not run concurrently on two streams): its graphs' buffers serve every
call.
A shape is captured at its second call (one warm-up call and the captured one), and a pointer
graph at the second call with the same addresses: the decode steps of a batch size repeat
them, a prompt's length usually does not.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict

import torch

from .compile_boundary import compiling
from .config import choice_context
from .debug import debug_mode

__all__ = ["GraphedCalls", "MAX_TOKENS", "usable"]

MAX_TOKENS = 256  # tokens of a call replayed from a graph, at most
MAX_GRAPHS = 8  # graphs kept per GraphedCalls (the least recently used one freed first)
MAX_POINTER_GRAPHS = 4  # pointer graphs kept per GraphedCalls (likewise)
# A capture costs milliseconds, a copying replay microseconds: beyond MAX_POINTER_GRAPHS captures,
# a shape keeps capturing pointer graphs only while each one has paid for itself this many times.
REPLAYS_PER_CAPTURE = 16
# A call's fresh output, like the graph's (the CPU tests put an allocator whose addresses they
# choose in its place: the caching allocator's reuse is what pointer graphs rely on).
_fresh_output = torch.empty_like


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


def _on_a_side_stream(call):
    """call() on a fresh stream ordered after the current one's work, which then waits for it
    (a capture needs a stream of its own; torch asks for the warm-up before one there too)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)


def _seen_twice(seen: OrderedDict, key, bound: int) -> bool:
    """Whether `key` was seen once before (then forgotten); else it is remembered, the oldest of
    more than `bound` forgotten."""
    if seen.pop(key, None) is not None:
        return True
    seen[key] = True
    if len(seen) > bound:
        seen.popitem(last=False)
    return False


class _Graph:
    """fn captured on buffers of its own: the inputs copied in, the output copied out."""

    __slots__ = ("graph", "inputs", "output")

    def __init__(self, fn, inputs):
        self.inputs = [t.clone() for t in inputs]
        _on_a_side_stream(lambda: fn(*self.inputs))  # (compiles, creates launch records and caches)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(*self.inputs)

    def __call__(self, inputs, out: torch.Tensor) -> torch.Tensor:
        for static, given in zip(self.inputs, inputs):
            static.copy_(given)
        self.graph.replay()
        return out.copy_(self.output)


class _PointerGraph:
    """fn captured on the caller's own tensors, its result copied (a node of the graph) into
    `out`. It holds none of them: a replay reads and writes the addresses it was captured
    with, which is right only where the caller's tensors and a fresh output lie there now;
    GraphedCalls replays it only then (its key holds those addresses)."""

    __slots__ = ("graph",)

    def __init__(self, fn, inputs, out: torch.Tensor, pool):
        # Not torch.cuda.graph, whose entry empties the allocator's cache: the blocks it frees
        # would move the very addresses pointer graphs wait to see repeat, in every layer, and a
        # capture of each would follow. The warm-up runs on the current stream for the same reason
        # (a side stream's blocks stay its own): it makes what the capture cannot (a TMA
        # descriptor of a new address, launch records).
        fn(*inputs)
        self.graph = torch.cuda.CUDAGraph()

        def capture():
            self.graph.capture_begin(pool=pool)
            try:
                out.copy_(fn(*inputs))
            finally:
                self.graph.capture_end()

        _on_a_side_stream(capture)

    def __call__(self):
        self.graph.replay()


class GraphedCalls:
    """The graphs of one layer's calls, by key (module docstring). `stats` counts what the calls
    ran: "eager", "captures", "replays", "pointer_captures", "pointer_replays"."""

    def __init__(self, max_graphs: int = MAX_GRAPHS, max_pointer_graphs: int = MAX_POINTER_GRAPHS):
        self.max_graphs = max_graphs
        self.max_pointer_graphs = max_pointer_graphs
        self.graphs: OrderedDict = OrderedDict()
        self.seen: OrderedDict = OrderedDict()  # keys called once, not captured (yet)
        self.eager: set = set()  # keys whose capture failed
        self.pointer_graphs: OrderedDict = OrderedDict()  # (key, input addresses, output address) -> _PointerGraph
        self.pointers_seen: OrderedDict = OrderedDict()  # pointer keys called once, not captured (yet)
        self.pointer_counts: dict = {}  # key -> [pointer graphs captured, pointer replays]
        self.no_pointers: set = set()  # keys that capture no pointer graphs (thrash, or a failed capture)
        self.stats: Counter = Counter()
        # The pointer graphs share one memory pool, for their temporaries only: each one's output
        # lies outside it (the caller's fresh tensor) and every tensor it allocates is dead at its
        # end, so a later capture may reuse those blocks. Replays are stream-ordered (module
        # docstring), so one graph's use of a block ends before the next graph writes it, and a
        # graph writes each temporary before reading it.
        self.pool = None

    def __deepcopy__(self, memo) -> GraphedCalls:
        # (a graph holds the original's buffers: not copied)
        return GraphedCalls(self.max_graphs, self.max_pointer_graphs)

    def __getstate__(self) -> dict:
        return {"max_graphs": self.max_graphs, "max_pointer_graphs": self.max_pointer_graphs}

    def __setstate__(self, state: dict):
        self.__init__(state["max_graphs"], state.get("max_pointer_graphs", MAX_POINTER_GRAPHS))

    def __call__(self, key, fn, *inputs: torch.Tensor) -> torch.Tensor:
        """fn(*inputs), from the graph of `key` and the inputs' shapes: captured at the second call
        of a shape (a shape met once, e.g. a prompt's length, is not worth a capture)."""
        key = (key, torch.is_autocast_enabled("cuda"), torch.is_inference_mode_enabled(), choice_context(),
               *((t.shape, t.dtype, t.stride()) for t in inputs))
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return self._replay(key, graph, fn, inputs)
        if key in self.eager or not _seen_twice(self.seen, key, 4 * self.max_graphs):
            self.stats["eager"] += 1
            return fn(*inputs)
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        try:
            graph = _Graph(fn, inputs)
        except RuntimeError:  # (a capture CUDA refused: the call runs eagerly, and so does its shape from now on)
            self.eager.add(key)
            self.stats["eager"] += 1
            return fn(*inputs)
        self.graphs[key] = graph
        self.stats["captures"] += 1
        return self._replay(key, graph, fn, inputs)

    def _replay(self, key, graph: _Graph, fn, inputs) -> torch.Tensor:
        """fn(*inputs) into a fresh tensor: from the pointer graph of the inputs' and that tensor's
        addresses where there is one (captured at their second call), else from `graph`."""
        out = _fresh_output(graph.output)
        pointer_graph = None if key in self.no_pointers else self._pointer_graph(key, fn, inputs, out)
        if pointer_graph is None:
            self.stats["replays"] += 1
            return graph(inputs, out)
        pointer_graph()
        return out

    def _pointer_graph(self, key, fn, inputs, out: torch.Tensor) -> _PointerGraph | None:
        """The pointer graph of the inputs' and out's addresses: one captured before (its replay
        counted), or captured now at their second call; None where there is none to replay."""
        # A pointer graph reads its inputs and writes its output at the addresses it was captured
        # with. Its key holds those addresses beside the shapes, dtypes and strides (`key`), so a
        # hit means the caller's tensors lie exactly there now (addresses are unique across
        # devices), and `out`, allocated by the caller, is ours: the replay, in stream order, reads
        # the caller's values of this call and writes only our fresh result.
        pointer_key = (key, *(t.data_ptr() for t in inputs), out.data_ptr())
        pointer_graph = self.pointer_graphs.get(pointer_key)
        if pointer_graph is not None:
            self.pointer_graphs.move_to_end(pointer_key)
            self.pointer_counts[key][1] += 1
            self.stats["pointer_replays"] += 1
            return pointer_graph
        if not _seen_twice(self.pointers_seen, pointer_key, 4 * self.max_pointer_graphs):
            return None
        counts = self.pointer_counts.setdefault(key, [0, 0])
        captures, replays = counts
        if captures >= self.max_pointer_graphs and replays < REPLAYS_PER_CAPTURE * captures:
            self._stop_pointers(key)  # (addresses that do not repeat within the cache: captures would thrash)
            return None
        if len(self.pointer_graphs) >= self.max_pointer_graphs:
            self.pointer_graphs.popitem(last=False)
        if not self.pointer_graphs:  # (a pool no graph holds any more is being freed: not shared)
            self.pool = torch.cuda.graph_pool_handle()
        try:
            pointer_graph = _PointerGraph(fn, inputs, out, self.pool)
        except RuntimeError:  # (a capture CUDA refused: the shape's calls take its copying graph from now on)
            self._stop_pointers(key)
            return None
        self.pointer_graphs[pointer_key] = pointer_graph
        counts[0] += 1
        self.stats["pointer_captures"] += 1
        return pointer_graph

    def _stop_pointers(self, key):
        """No pointer graphs for `key` from now on (its copying graph instead)."""
        self.no_pointers.add(key)
        for pointer_key in [k for k in self.pointer_graphs if k[0] == key]:
            del self.pointer_graphs[pointer_key]

    def clear(self):
        self.graphs.clear()
        self.seen.clear()
        self.eager.clear()
        self.pointer_graphs.clear()
        self.pointers_seen.clear()
        self.pointer_counts.clear()
        self.no_pointers.clear()
        self.stats.clear()
