"""Every launch: Triton's path once a key, then the compiled launcher (plan once, launch many).

`fn[grid](*args)` costs a Triton JITFunction.run on every call: binding and specializing each
argument, a cache lookup, and for each TMA descriptor a fresh cuTensorMapEncodeTiled (measured
on an H200 host: 15-22 us for a 30-argument kernel before the launch itself, 7 us). launch()
runs that path once per call-site key, keeps the compiled kernel, and launches it afterwards
through its C launcher with the arguments as given:

    launch(module.some_kernel, key, grid, (a, b, Tma(x, block, layout), n), dict(BLOCK=64, num_warps=4))

`site(fn, key)` is the LaunchSite of that key (one a key); a plan keeps its sites and launches
through them (`site.launch(grid, args, kwargs)`), so a call looks nothing up by its key.

`key` (hashable, cheap: a tuple of ints and strings) must determine every int argument, every
tensor dtype and every keyword argument (the constexprs and launch options): together with the
kernel it names the compiled specialization. What the key cannot promise is checked per call:
each tensor argument 16-byte aligned where the compiled kernel assumed it (else the call takes
Triton's path, which compiles the other specialization).

TMA operands are given as `Tma(tensor, block, layout)`. Their encoded descriptors are cached by
(address, shape, strides, box, encoding), so a weight's descriptor is encoded once, and an
activation's once per buffer address the allocator hands out; a descriptor is passed to the
kernel by value, so a CUDA graph captures it as launched.

On the CPU (Triton's interpreter), with a launch hook set (profilers), with MOEGEMM_LAUNCH=triton
(or direct_launches(False)), or for kernels that need a global scratch buffer, every call goes
through fn[grid] unchanged. MOEGEMM_CHECK_LAUNCH=1 compares, on every call, what a key promises
with the arguments given (the GPU tests set it).
"""

from __future__ import annotations

import inspect
import itertools
import os

import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel
from triton.runtime import driver


__all__ = ["LaunchSite", "Tma", "clear", "direct_launches", "launch", "site"]

_MAX_DESCRIPTORS = 4096  # cached encodings kept at once (cleared when full)


class Tma:
    """A TMA operand: `tensor` read in boxes of `block` staged in shared `layout` (the fields a
    TensorDescriptor has, without building one: Triton's make_tensordesc_arg reads these).
    shape, strides: the view of tensor's elements the boxes walk, where not tensor's own: what
    tensor.reshape(shape) would give, without making it; dtype: its elements' type where not
    tensor's (tensor.view(dtype) would give, made only for Triton's path: a launch reads the
    address alone)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "dtype")
    padding = "zero"

    def __init__(self, tensor: torch.Tensor, block, layout, shape: tuple | None = None, strides: tuple | None = None,
                 dtype: torch.dtype | None = None):
        self.base = tensor
        self.shape = tensor.shape if shape is None else shape
        self.strides = tensor.stride() if strides is None else strides
        self.block_shape = list(block)
        self.layout = layout
        self.dtype = dtype

    def descriptor(self):
        """The Gluon TensorDescriptor of Triton's launch path (which checks its fields)."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        base = self.base if self.dtype is None else self.base.view(self.dtype)
        return TensorDescriptor(base, list(self.shape), list(self.strides), self.block_shape, self.layout)


def _triton_args(args):
    return [a.descriptor() if type(a) is Tma else a for a in args]


def _raw_launcher(launcher):
    """The C launch function under the kernel's CudaLauncher (Triton 3.6 wraps it in a closure
    that encodes every TMA descriptor); None where the structure differs."""
    inner = launcher.launch
    closure = getattr(inner, "__closure__", None)
    if not closure:
        return inner
    for name, cell in zip(inner.__code__.co_freevars, closure):
        if name == "launcher":
            return cell.cell_contents
    return None


class _Record:
    """One compiled specialization of a kernel and how to call its C launcher."""

    __slots__ = ("raw", "function", "packed_metadata", "coop", "pdl", "tail", "tma", "tensors", "nested", "check")

    def __init__(self, fn, kernel, args, kwargs):
        launcher = kernel.run
        self.raw = _raw_launcher(launcher)
        self.function = kernel.function
        self.packed_metadata = kernel.packed_metadata
        self.coop = launcher.launch_cooperative_grid
        self.pdl = launcher.launch_pdl
        # Parameters after the positional arguments: keyword constexprs (or defaults), which the C
        # launcher parses and ignores; passed as Triton passes them.
        params = list(inspect.signature(fn.fn).parameters.values())[len(args):]
        self.tail = tuple(kwargs.get(p.name, p.default) for p in params)
        metas = kernel.metadata.tensordesc_meta or []
        positions = [i for i, a in enumerate(args) if type(a) is Tma]
        if len(metas) != len(positions) or kernel.metadata.global_scratch_size or kernel.metadata.profile_scratch_size:
            self.raw = None  # (a kernel lowered otherwise: Triton's path serves it)
        # (position, encoding, the encoding's part of a cached descriptor's key), last first: each
        # expansion shifts the positions after it
        self.tma = tuple((i, meta, _encoding_key(meta)) for i, meta in zip(positions, metas))[::-1]
        # Each tensor argument (also inside a tuple argument): its dtype, whether the kernel was
        # specialized for a 16-byte aligned address, and whether the argument before it had the
        # same two (an argument given again there, as the placeholders are, is checked once).
        # (in the order fits checks them: the arguments, then the tensors inside tuple arguments)
        facts = sorted(((i, j, t.dtype, t.data_ptr() % 16 == 0) for i, j, t in _tensor_args(args)),
                       key=lambda fact: fact[1] >= 0)
        facts = [(i, j, dtype, aligned, k > 0 and facts[k - 1][2:] == (dtype, aligned))
                 for k, (i, j, dtype, aligned) in enumerate(facts)]
        self.tensors = tuple((i, *rest) for i, j, *rest in facts if j < 0)
        self.nested = tuple(fact for fact in facts if fact[1] >= 0)
        # MOEGEMM_CHECK_LAUNCH=1 (the GPU tests): everything else the key promises, compared on
        # every call.
        self.check = _key_facts(args, kwargs) if os.environ.get("MOEGEMM_CHECK_LAUNCH") == "1" else None

    def fits(self, args) -> bool:
        """Whether every tensor argument has the dtype and the alignment of the compiled kernel's."""
        last = None
        for i, dtype, aligned, as_before in self.tensors:
            t = args[i]
            if t is not last or not as_before:
                if t.dtype is not dtype or (aligned and t.data_ptr() & 15):
                    return False
                last = t
        for i, j, dtype, aligned, as_before in self.nested:
            t = args[i][j]
            if t is not last or not as_before:
                if t.dtype is not dtype or (aligned and t.data_ptr() & 15):
                    return False
                last = t
        return True

    def run(self, grid, args, device: int):
        expanded = list(args)
        for i, meta, encoding in self.tma:
            tma = args[i]
            key = (tma.base.data_ptr(), tma.shape, tma.strides, encoding)
            found = _ENCODED.get(key)
            expanded[i:i + 1] = found if found is not None else _encode(tma, meta, key)
        stream = driver.active.get_current_stream(device)
        self.raw(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, self.function,
                 self.coop, self.pdl, None, None, self.packed_metadata, None, None, None, *expanded, *self.tail)


def _tensor_args(args):
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            yield i, -1, a
        elif type(a) is tuple:
            for j, b in enumerate(a):
                if isinstance(b, torch.Tensor):
                    yield i, j, b


def _key_facts(args, kwargs) -> tuple:
    """What a launch key must determine: every non-tensor argument's value (floats aside: they
    are never specialized), which arguments are tensors, and the keyword arguments."""
    def fact(a):
        if isinstance(a, torch.Tensor):
            return "tensor"
        if type(a) is tuple:
            return tuple(fact(b) for b in a)
        if type(a) is Tma:
            return ("tma", tuple(a.shape), tuple(a.block_shape))
        return "float" if type(a) is float else a
    return tuple(fact(a) for a in args), tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))


_SITES: dict = {}  # (fn, key) -> LaunchSite
_ENCODED: dict = {}  # (address, shape, strides, _encoding_key) -> [descriptor, *shape, *strides]


def _current_device() -> int:
    """The current CUDA device's index (-1 where CUDA is not initialized: the interpreter)."""
    return torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1


_ENCODINGS: dict = {}  # what of a kernel parameter's TMA encoding its descriptors depend on -> a number
_NUMBERS = itertools.count()


def _encoding_key(meta: dict) -> int:
    """The number of a kernel parameter's TMA encoding (what a descriptor depends on besides the
    tensor), the same for equal encodings: a cheap part of a cached descriptor's key."""
    encoding = tuple(meta["block_size"]), meta["swizzle"], meta["elem_type"], meta["fp4_padded"]
    return _ENCODINGS.setdefault(encoding, next(_NUMBERS))  # (next: a number no other thread gets)


def _encode(tma: Tma, meta: dict, key: tuple) -> list:
    """[descriptor, *shape, *strides] of a TMA operand for a kernel parameter of encoding `meta`,
    cached under `key` (_Record.run's)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    if len(_ENCODED) >= _MAX_DESCRIPTORS:
        _ENCODED.clear()
    found = _ENCODED[key] = make_tensordesc_arg(tma, meta)
    return found


_DIRECT = os.environ.get("MOEGEMM_LAUNCH", "direct") != "triton"


def direct_launches(enabled: bool) -> bool:
    """Turn launches through the compiled launchers on or off (off: every call takes Triton's
    path, e.g. to record the launches); returns the previous setting."""
    global _DIRECT
    previous, _DIRECT = _DIRECT, bool(enabled)
    return previous


def _direct() -> bool:
    """Whether launches take the compiled launchers: turned on, and no launch hook calls anything
    (Triton 3.6 keeps an empty HookChain there)."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return _DIRECT and (enter is None or (isinstance(enter, knobs.HookChain) and not enter.calls)) and (
        leave is None or (isinstance(leave, knobs.HookChain) and not leave.calls))


class LaunchSite:
    """The launches of one kernel under one key (`site`): its compiled specialization on each
    device. A caller that launches a key many times (a plan) keeps its site, and its launches
    then look nothing up by the key."""

    __slots__ = ("fn", "key", "records")

    def __init__(self, fn, key):
        self.fn, self.key, self.records = fn, key, {}

    def launch(self, grid: tuple, args: tuple, kwargs: dict):
        """launch(self.fn, self.key, grid, args, kwargs)."""
        # (a compiled kernel is loaded per device: Triton launches on the current one)
        device = _current_device()
        record = self.records.get(device)
        if record is not None and record.raw is not None and _direct() and record.fits(args):
            if record.check is not None and record.check != _key_facts(args, kwargs):
                raise RuntimeError(f"launch key {self.key!r} of {self.fn.__name__} does not determine its arguments: "
                                   f"{record.check} then {_key_facts(args, kwargs)}")
            record.run(grid, args, device)
            return
        kernel = self.fn[grid](*_triton_args(args), **kwargs)
        if isinstance(kernel, CompiledKernel) and (record is None or record.raw is not None):
            # (a kernel the direct path cannot serve keeps its record: Triton's path, not a new record each call)
            self.records[device] = _Record(self.fn, kernel, args, kwargs)


def site(fn, key) -> LaunchSite:
    """The one LaunchSite of kernel `fn` under launch key `key` (module docstring)."""
    found = _SITES.get((fn, key))
    return found if found is not None else _SITES.setdefault((fn, key), LaunchSite(fn, key))


def launch(fn, key, grid: tuple, args: tuple, kwargs: dict):
    """fn[grid](*args, **kwargs), through the compiled kernel's launcher once `key` has been
    launched before (module docstring). Tma arguments become TMA descriptors."""
    site(fn, key).launch(grid, args, kwargs)


def clear():
    """Forget every record and cached descriptor (tests)."""
    for known in _SITES.values():
        known.records.clear()
    _ENCODED.clear()
