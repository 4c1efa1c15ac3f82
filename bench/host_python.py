"""The Python host work of an eager grouped_matmul call on the sm90 path, measured on the CPU.

    python bench/host_python.py [--formats bf16,mxfp8,...] [--tree DIR] [--direct]

The sm90 path runs with a Hopper faked (the capability check, the SM count) and every compiled
launch stubbed, on CPU tensors, with the value checks off as on a GPU without MOEGEMM_DEBUG: what
is left is the host's own work a call (the plan lookup, the operands, the launch arguments,
the token pre-pass's allocations and torch ops), at bench/host_time.decode_products' size
(8 slots of one token, N 512, K 1024). Per format: the best of 7 means of 200 calls in us, the
Triton kernels a call launches and the torch ops that would launch one on a GPU (every aten op
a call dispatches but views and allocations: fills, copies, arithmetic; each another 5-10 us of
host time there). --tree runs another revision's library (a `git archive` of it), so
two revisions compare on the same CPU. Launch costs (the driver's, 5-10 us each on a GPU host)
are not in it: bench/profiling.py host measures those on the GPU. --direct takes every launch
through kernels/compiled_launch.py as on a GPU (the record lookup, the checks of the arguments,
the TMA descriptors' cache) with only the compiled kernel faked: its C launcher a no-op, its TMA
encoding a list, the stream and the device fixed.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=None, help="comma-separated (default: all)")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--direct", action="store_true",
                        help="launch through kernels/compiled_launch.py, the compiled kernels faked")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree)
    import torch

    _fake_hopper(torch)
    import moegemm

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
    experts, n, k = 8, 512, 1024
    a_offsets = torch.arange(experts + 1, dtype=torch.int32)
    ids = torch.arange(experts, dtype=torch.int32)
    x, w = torch.randn(experts, k), torch.randn(experts, n, k) / 32
    print(f"# grouped_matmul, sm90 path, {'compiled kernels faked' if args.direct else 'launches stubbed'}: "
          f"{args.tree}")
    for fmt in (args.formats.split(",") if args.formats else moegemm.FORMATS):
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

        for _ in range(20):
            call()
        launched.clear()
        call()
        kernels = list(launched)
        torch_ops = _torch_launches(call)
        means = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(200):
                call()
            means.append((time.perf_counter() - start) / 200 * 1e6)
        print(f"{fmt:11s} {min(means):7.1f} us   {', '.join(kernels)}; torch: {', '.join(torch_ops) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
