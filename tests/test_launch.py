"""kernels/compiled_launch.py on the CPU: a fake kernel and a fake C launcher stand in for a compiled
Triton kernel, so that what launch() passes, and when it falls back to Triton's path, is checked
without a GPU (the GPU tests run every kernel through it, MOEGEMM_CHECK_LAUNCH=1)."""

import collections

import pytest
import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel
from triton.experimental.gluon import language as gl

from moegemm.kernels import compiled_launch as launch_module
from moegemm.kernels.compiled_launch import Tma, launch

Meta = collections.namedtuple("Meta", "tensordesc_meta global_scratch_size profile_scratch_size")
TMA_META = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [16, 64], "fp4_padded": False}


class FakeKernel:
    """A jit function: kernel[grid](*args, **kwargs) records a Triton launch and returns a
    compiled kernel whose C launcher records the direct ones."""

    __name__ = "fake_kernel"

    def __init__(self, descriptors: int = 0):
        self.calls = []
        self.descriptors = descriptors

    @staticmethod
    def fn(x, desc, n, scale, BLOCK, FLAG=7):
        """The kernel's signature (launch() reads the parameters after the positional ones)."""

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return self._compiled()
        return run

    def _direct(self, *args):
        self.calls.append(("direct", args))

    def _compiled(self):
        kernel = object.__new__(CompiledKernel)
        launcher = type("Launcher", (), {"launch_cooperative_grid": False, "launch_pdl": False})()
        launcher.launch = self._direct  # (a C function there: no closure)
        kernel._run, kernel.function, kernel.packed_metadata = launcher, "function", (4, 1, 0)
        kernel.metadata = Meta([getattr(self, "_compiled_meta", TMA_META)] * self.descriptors, 0, 0)
        return kernel


@pytest.fixture(autouse=True)
def fake_device(monkeypatch):
    """No CUDA: a stream of 7, and TMA encodings as tuples (counted)."""
    launch_module.clear()
    monkeypatch.setattr(launch_module, "driver",
                        type("Driver", (), {"active": type("Active", (), {
                            "get_current_stream": staticmethod(lambda device: 7)})}))
    monkeypatch.setattr(launch_module, "_current_device", lambda: 0)
    encoded = []

    def encode(tma, meta):
        encoded.append((tma.base.data_ptr(), tuple(tma.shape)))
        return [f"desc{len(encoded)}", *tma.shape, *tma.strides]

    import triton.backends.nvidia.driver as nvidia
    monkeypatch.setattr(nvidia, "make_tensordesc_arg", encode)
    yield encoded
    launch_module.clear()


LAYOUT = gl.NVMMASharedLayout.get_default_for([4, 4], gl.float32)
TILE = torch.zeros(4, 4)


def _args(x, n=5):
    return (x, Tma(TILE, (4, 4), LAYOUT), n, 0.5)


def test_second_launch_goes_through_the_compiled_launcher(fake_device):
    kernel = FakeKernel(descriptors=1)
    x = torch.zeros(16)
    for _ in range(3):
        launch(kernel, ("key",), (3, 2), _args(x), dict(BLOCK=64))
    assert [c[0] for c in kernel.calls] == ["triton", "direct", "direct"]
    args = kernel.calls[1][1]
    assert args[:13] == (3, 2, 1, 7, "function", False, False, None, None, (4, 1, 0), None, None, None)
    # x, the descriptor expanded ([descriptor, *shape, *strides]), n, scale, then BLOCK and FLAG's default.
    assert args[13] is x and args[14:19] == ("desc1", 4, 4, 4, 1) and args[19:] == (5, 0.5, 64, 7)
    assert fake_device == [(TILE.data_ptr(), (4, 4))]  # encoded once, the cached encoding reused


def test_the_triton_path_where_the_compiled_kernel_does_not_fit():
    kernel = FakeKernel(descriptors=1)
    x = torch.zeros(64)
    launch(kernel, ("key",), (1,), _args(x[:16]), dict(BLOCK=64))
    launch(kernel, ("key",), (1,), _args(x[1:17]), dict(BLOCK=64))  # 4 bytes off: not 16-byte aligned
    launch(kernel, ("key",), (1,), _args(x[:16].double()), dict(BLOCK=64))  # another dtype
    assert [c[0] for c in kernel.calls] == ["triton", "triton", "triton"]
    launch(kernel, ("key",), (1,), _args(torch.zeros(16, dtype=torch.float64)), dict(BLOCK=64))
    assert kernel.calls[-1][0] == "direct"  # (the last specialization recorded is the one kept)


def test_the_triton_path_while_a_launch_hook_is_set():
    kernel = FakeKernel(descriptors=1)
    x = torch.zeros(16)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(kernel, ("key",), (1,), _args(x), dict(BLOCK=64))
        launch(kernel, ("key",), (1,), _args(x), dict(BLOCK=64))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launch(kernel, ("key",), (1,), _args(x), dict(BLOCK=64))
    assert [c[0] for c in kernel.calls] == ["triton", "triton", "direct"]


def test_a_key_that_misses_an_argument_fails_when_checked(monkeypatch):
    monkeypatch.setenv("MOEGEMM_CHECK_LAUNCH", "1")
    kernel = FakeKernel(descriptors=1)
    x = torch.zeros(16)
    launch(kernel, ("key",), (1,), _args(x, n=5), dict(BLOCK=64))
    launch(kernel, ("key",), (1,), _args(x, n=5), dict(BLOCK=64))
    with pytest.raises(RuntimeError, match="does not determine its arguments"):
        launch(kernel, ("key",), (1,), _args(x, n=6), dict(BLOCK=64))


def test_direct_launches_can_be_turned_off():
    kernel = FakeKernel()
    x = torch.zeros(16)
    previous = launch_module.direct_launches(False)
    try:
        for _ in range(2):
            launch(kernel, ("key",), (1,), (x, None, 5, 0.5), dict(BLOCK=64))
    finally:
        launch_module.direct_launches(previous)
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]


def test_a_site_is_one_per_key_and_forgets_its_records_with_clear():
    """A plan keeps its sites: the one of its key, whose compiled records clear() forgets too."""
    kernel = FakeKernel(descriptors=1)
    kept = launch_module.site(kernel, ("key",))
    assert launch_module.site(kernel, ("key",)) is kept and launch_module.site(kernel, ("other",)) is not kept
    x = torch.zeros(16)
    kept.launch((1,), _args(x), dict(BLOCK=64))
    launch(kernel, ("key",), (1,), _args(x), dict(BLOCK=64))
    launch_module.clear()
    kept.launch((1,), _args(x), dict(BLOCK=64))
    assert [c[0] for c in kernel.calls] == ["triton", "direct", "triton"]


def test_an_argument_given_twice_is_checked_against_each_position():
    """A tensor in two positions of one dtype each (as the placeholders are) is checked once; in
    positions of two dtypes it cannot fit both: Triton's path."""
    kernel = FakeKernel(descriptors=1)
    ints, floats = torch.zeros(16, dtype=torch.int32), torch.zeros(16)
    def args(first, second):
        return ints, Tma(TILE, (4, 4), LAYOUT), (first, second), 0.5

    launch(kernel, ("key",), (1,), args(ints, floats), dict(BLOCK=64))
    launch(kernel, ("key",), (1,), args(ints, floats), dict(BLOCK=64))
    launch(kernel, ("key",), (1,), args(ints, ints), dict(BLOCK=64))
    assert [c[0] for c in kernel.calls] == ["triton", "direct", "triton"]
    launch(kernel, ("key",), (1,), args(ints, ints), dict(BLOCK=64))  # (the record kept: the last one's)
    assert kernel.calls[-1][0] == "direct"


def test_a_tma_view_is_launched_without_being_made(fake_device):
    """Tma(tensor, block, layout, shape, strides, dtype): the launch encodes that view of tensor's
    address; Triton's path gets a descriptor of tensor viewed as dtype."""
    kernel = FakeKernel(descriptors=1)
    scales = torch.zeros(2, 8, 4, dtype=torch.uint8)  # 64 bytes: [4, 4] 32-bit words
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    args = (torch.zeros(16), Tma(scales, (4, 4), layout, (4, 4), (4, 1), torch.int32), 5, 0.5)
    for _ in range(2):
        launch(kernel, ("key",), (1,), args, dict(BLOCK=64))
    descriptor = kernel.calls[0][2][1]
    assert descriptor.base.dtype == torch.int32 and descriptor.base.data_ptr() == scales.data_ptr()
    assert list(descriptor.shape) == [4, 4] and list(descriptor.strides) == [4, 1]
    assert kernel.calls[1][0] == "direct" and kernel.calls[1][1][14:19] == ("desc1", 4, 4, 4, 1)
    assert fake_device == [(scales.data_ptr(), (4, 4))]


def test_a_descriptor_is_cached_per_encoding(fake_device):
    """The same tensor read by parameters of two TMA encodings gets a descriptor of each."""
    first, second = FakeKernel(descriptors=1), FakeKernel(descriptors=1)
    second._compiled_meta = dict(TMA_META, block_size=[8, 64])
    x = torch.zeros(16)
    for kernel in (first, second, first, second):
        launch(kernel, ("key",), (1,), _args(x), dict(BLOCK=64))
    assert [c[0] for c in first.calls + second.calls] == ["triton", "direct", "triton", "direct"]
    assert len(fake_device) == 2


def test_a_tensor_repeated_across_a_tuple_argument_is_checked_against_each_position():
    """The tensors of a tuple argument are checked after the other arguments: one given in a
    tuple before, and again after it, meets the expectation of each of its positions."""
    kernel = FakeKernel(descriptors=1)
    ints, floats = torch.zeros(16, dtype=torch.int32), torch.zeros(16)

    def args(first, nested, last):
        return first, Tma(TILE, (4, 4), LAYOUT), (nested,), last

    kernel.fn = lambda x, desc, pair, y, BLOCK, FLAG=7: None  # (the parameters after the positional ones)
    launch(kernel, ("key",), (1,), args(floats, ints, ints), dict(BLOCK=64))
    launch(kernel, ("key",), (1,), args(floats, ints, ints), dict(BLOCK=64))
    launch(kernel, ("key",), (1,), args(floats, ints, floats), dict(BLOCK=64))  # (float32 where int32 was)
    assert [c[0] for c in kernel.calls] == ["triton", "direct", "triton"]
