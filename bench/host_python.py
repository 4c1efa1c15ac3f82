"""The Python host work of an eager grouped_matmul call (or, with --layer, of an eager moe_forward
call) on the sm90 path, measured on the CPU.

    python bench/host_python.py [--formats bf16,mxfp8,...] [--tree DIR] [--direct] [--layer] [--calls N]

The sm90 path runs with a Hopper faked (the capability check, the SM count) and every compiled
launch stubbed, on CPU tensors, with the value checks off as on a GPU without MOEGEMM_DEBUG: what
is left is the host's own work a call (the plan lookup, the operands, the launch arguments,
the token pre-pass's allocations and torch ops), at bench/host_time.decode_products' size
(8 slots of one token, N 512, K 1024). Per format: the best of 7 means of 200 calls (--calls) in us, the
Triton kernels a call launches and the torch ops that would launch one on a GPU (every aten op
a call dispatches but views and allocations: fills, copies, arithmetic; each another 5-10 us of
host time there). --tree runs another revision's library (a `git archive` of it), so
two revisions compare on the same CPU. Launch costs (the driver's, 5-10 us each on a GPU host)
are not in it: bench/profiling.py host measures those on the GPU. --direct takes every launch
through kernels/compiled_launch.py as on a GPU (the record lookup, the checks of the arguments,
the TMA descriptors' cache) with only the compiled kernel faked: its C launcher a no-op, its TMA
encoding a list, the stream and the device fixed.

--layer: moe_forward (eager, no CUDA graph) at Qwen3-30B-A3B's sizes (E 128, I 768, H 2048, top-8)
at 1 and 64 tokens, with the routing kernels' path taken as on a GPU (routing's backend resolved
for a CUDA device) and the weights as the transformers backend holds them on a Hopper (the
format's scale layout and prepacked order; gate/up rows concatenated for bf16 and fp8_block, as
Qwen3's bf16 checkpoint and DeepSeek's FP8 blocks keep them, interleaved otherwise). T stays
small: torch ops run their math on the CPU, which a GPU's host does not pay (the zero fills of
swizzled token scales, ~1 MB each at E 128: ~50 us of mxfp8's time; nvfp4's dynamic
intermediate global scale, torch arithmetic over the rows: ms at 64 tokens). One intra-op thread,
and the unfused chain's product buffer left uninitialized as on a GPU (_gpu_like_memory).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _fake_hopper(torch):
    torch.cuda.get_device_properties = lambda device=None: type("Props", (), {"multi_processor_count": 132})()


def _torch_launches(call) -> list[str]:
    """The aten ops one call dispatches that would launch a kernel on a GPU (not views, not
    allocations)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not func.is_view and not name.startswith("empty"):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    with Recording():
        call()
    return seen


def _stub(moegemm_modules, real, fake):
    for module in moegemm_modules:
        for attr in dir(module):
            if getattr(module, attr, None) is real:
                setattr(module, attr, fake)


def _record_launch(launched: list, name: str, *args):
    launched.append(name)


def _fake_compiled_kernels(launches, launched: list):
    """--direct: Triton's launch path (a kernel's first launch a key) returns a compiled kernel
    whose C launcher only records the launch; the TMA encodings and the stream are faked."""
    import collections
    import functools

    import triton.backends.nvidia.driver as nvidia
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import KernelInterface

    meta = collections.namedtuple("Meta", "tensordesc_meta global_scratch_size profile_scratch_size")

    def compiled(fn, args):
        kernel = object.__new__(CompiledKernel)
        launcher = type("Launcher", (), {"launch_cooperative_grid": False, "launch_pdl": False})()
        launcher.launch = functools.partial(_record_launch, launched, fn.__name__)  # (no closure: the C one's place)
        kernel._run, kernel.function, kernel.packed_metadata = launcher, 0, (4, 1, 0)
        kernel.metadata = meta([dict(swizzle=3, elem_size=1, elem_type=0, block_size=list(a.block_shape),
                                     fp4_padded=False) for a in args if hasattr(a, "block_shape")], 0, 0)
        return kernel

    KernelInterface.__getitem__ = lambda fn, grid: lambda *args, **kwargs: compiled(fn, args)
    nvidia.make_tensordesc_arg = lambda tma, meta: [None, *tma.shape, *tma.strides]
    launches.driver = type("Driver", (), {"active": type("Active", (), {
        "get_current_stream": staticmethod(lambda device: 0)})})
    launches._current_device = lambda: 0


def _measure(call, calls: int) -> float:
    """The best of 7 means of `calls` calls, in us."""
    means = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return min(means)


def _report(label: str, call, launched: list, calls: int) -> None:
    for _ in range(min(calls, 20)):
        call()
    launched.clear()
    call()
    kernels = list(launched)
    torch_ops = _torch_launches(call)
    print(f"{label} {_measure(call, calls):7.1f} us   {', '.join(kernels)}; torch: {', '.join(torch_ops) or '-'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=None, help="comma-separated (default: all)")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--direct", action="store_true",
                        help="launch through kernels/compiled_launch.py, the compiled kernels faked")
    parser.add_argument("--layer", action="store_true", help="moe_forward at Qwen3-30B-A3B's sizes (module docstring)")
    parser.add_argument("--calls", type=int, default=200, help="calls a timed mean (default 200)")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree)
    import torch

    _fake_hopper(torch)
    import moegemm
    import moegemm.routing

    try:
        from moegemm.kernels import compiled_launch as launches
    except ImportError:  # (a revision before its rename)
        from moegemm.kernels import launch as launches
    launched = []
    ours = [m for name, m in sys.modules.items() if name.startswith("moegemm") and m is not None]
    if args.direct:
        _fake_compiled_kernels(launches, launched)
    else:
        _stub(ours, launches.launch, lambda fn, *rest, **kw: launched.append(getattr(fn, "__name__", repr(fn))))
        if hasattr(launches, "LaunchSite"):  # (the launches of a plan's sites)
            launches.LaunchSite.launch = lambda site, *rest: launched.append(site.fn.__name__)
    for module in ours:
        if hasattr(module, "values_checked"):
            module.values_checked = lambda device: False
        if hasattr(module, "_is_hopper"):
            module._is_hopper = lambda device: True
    formats = args.formats.split(",") if args.formats else list(moegemm.FORMATS)
    if args.layer:
        _layer(torch, moegemm, formats, launched, args.tree, args.calls, args.direct)
    else:
        _products(torch, moegemm, formats, launched, args.tree, args.calls, args.direct)
    return 0


def _layer_weights(torch, moegemm, fmt: str, n: int, k: int, experts: int):
    """Weights [experts, n, k] of fmt as the layer holds them on a Hopper (scale layout, prepacked
    order): one expert quantized, the others uninitialized storage of its shapes (the launches
    are stubbed: no value is read)."""
    f = moegemm.get_format(fmt)
    one = torch.randn(1, n, k) / 32
    if fmt == "bf16":
        return moegemm.QuantizedTensor(torch.empty(experts, n, k, dtype=torch.bfloat16), None, fmt, "b")
    q = moegemm.quantize_weights(one, fmt, scale_layout="swizzled" if f.swizzle_capable else "plain")
    try:
        from moegemm.moe.weights import WeightForm

        q = WeightForm(fmt).stored(q)  # (prepacked where a Hopper's layer keeps it so)
    except ImportError:  # (a revision before moe/weights.py)
        pass
    grow = lambda t: None if t is None else torch.empty((experts, *t.shape[1:]), dtype=t.dtype)
    global_scale = None if q.global_scale is None else torch.ones(experts, dtype=q.global_scale.dtype)
    return moegemm.QuantizedTensor(grow(q.data), grow(q.scales), fmt, "b", q.scale_layout, global_scale,
                                   prepacked=q.prepacked)


def _gpu_like_memory(torch, moegemm) -> None:
    """What a call allocates costs the CPU no more than the GPU's host: one intra-op thread (a fill of
    a buffer past torch's grain size is split over threads otherwise, which wait for each other for
    ms on a loaded machine; a GPU's host fills nothing), and the unfused chain's product buffer
    uninitialized, as on a GPU (on the CPU it is zeroed, for Triton's interpreter)."""
    torch.set_num_threads(1)
    plan = sys.modules.get("moegemm.plan")
    if plan is not None and hasattr(plan, "_product_buffer"):
        plan._product_buffer = lambda problem, device: torch.empty(problem.m, problem.n, dtype=torch.bfloat16,
                                                                   device=device)


def _layer(torch, moegemm, formats, launched, tree, calls: int, direct: bool) -> None:
    experts, inter, hidden, top_k = 128, 768, 2048, 8
    _gpu_like_memory(torch, moegemm)
    real_use_triton = moegemm.routing._use_triton
    cuda = torch.device("cuda")
    # The routing kernels' path, as a GPU's tensors take it (the backend still checked).
    moegemm.routing._use_triton = lambda backend, device: real_use_triton(backend, cuda)
    print(f"# moe_forward, E {experts} I {inter} H {hidden} top-{top_k}, sm90 path, "
          f"{'compiled kernels faked' if direct else 'launches stubbed'}: {tree}")
    generator = torch.Generator().manual_seed(0)
    for fmt in formats:
        w_gate_up = _layer_weights(torch, moegemm, fmt, 2 * inter, hidden, experts)
        w_down = _layer_weights(torch, moegemm, fmt, hidden, inter, experts)
        order = "concat" if fmt in ("bf16", "fp8_block") else "interleaved"
        for tokens in (1, 64):
            x = torch.randn(tokens, hidden, generator=generator).bfloat16()
            ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).int()
            weights = torch.rand(tokens, top_k, generator=generator)

            def call():
                return moegemm.moe_forward(x, ids, weights, w_gate_up, w_down, gate_up_layout=order, backend="sm90")

            _report(f"{fmt:11s} T={tokens:<3d} {order:11s}", call, launched, calls)


def _products(torch, moegemm, formats, launched, tree, calls: int, direct: bool) -> None:
    experts, n, k = 8, 512, 1024
    a_offsets = torch.arange(experts + 1, dtype=torch.int32)
    ids = torch.arange(experts, dtype=torch.int32)
    x, w = torch.randn(experts, k), torch.randn(experts, n, k) / 32
    print(f"# grouped_matmul, sm90 path, {'compiled kernels faked' if direct else 'launches stubbed'}: {tree}")
    for fmt in formats:
        f = moegemm.get_format(fmt)
        layout = "swizzled" if f.swizzle_capable else "plain"
        if fmt == "bf16":
            a, b = x.bfloat16(), w.bfloat16()
        else:
            a = x.bfloat16() if f.name.startswith("bf16_") else moegemm.reference.quantize(
                x, fmt, scale_layout=layout, a_offsets=a_offsets)
            b = moegemm.quantize_weights(w, fmt, scale_layout=layout)

        def call():
            return moegemm.grouped_matmul(a, b, None, None, a_offsets, ids, fmt=fmt, backend="sm90")

        _report(f"{fmt:11s}", call, launched, calls)


if __name__ == "__main__":
    sys.exit(main())
