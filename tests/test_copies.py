"""kernels/copies.py: copy_into, the one-launch copies of a replayed graph's inputs and output."""

import pytest
import torch

from moegemm.kernels import copies, tl_source

needs_interpreter = pytest.mark.skipif(not tl_source.interpreter_usable(),
                                       reason="Triton's CPU interpreter needs numpy < 2.4")


@needs_interpreter
def test_copy_kernel_copies_each_pair_and_nothing_past_it():
    """Three pairs of other dtypes and sizes (one past a program's block, one empty) on the
    interpreter: each destination gets its source's elements and keeps every element past them."""
    module = tl_source.load(copies._SOURCE, True)
    sizes = (copies.BLOCK + 37, 5, 0)
    srcs = [torch.randn(sizes[0] + 64).bfloat16(), torch.randint(-9, 9, (sizes[1] + 64, )), torch.rand(sizes[2] + 64)]
    dsts = [torch.full_like(s, 3) for s in srcs]
    args = [a for d, s, n in zip(dsts, srcs, sizes) for a in (d, s, n)]
    module.copy_kernel[(-(-max(sizes) // copies.BLOCK), )](*args, BLOCK=copies.BLOCK)
    for d, s, n in zip(dsts, srcs, sizes):
        assert torch.equal(d[:n], s[:n])
        assert bool((d[n:] == 3).all())


def test_copy_into_on_the_cpu_is_copy_():
    dst, src = torch.zeros(3, 4), torch.randn(3, 4)
    copies.copy_into([dst], [src])
    assert torch.equal(dst, src)


@pytest.mark.gpu
def test_copy_into_copies_every_pair_bit_for_bit():
    """Four pairs of mixed dtypes (two launches), one of them a strided view (copy_): every
    destination holds its source, bit for bit, and nothing else is written."""
    device = torch.device("cuda")
    srcs = [torch.randn(1, 2880, device=device).bfloat16(), torch.randint(0, 32, (1, 4), device=device),
            torch.rand(1, 4, device=device), torch.randn(7, 5000, device=device)]
    strided_src = torch.randn(8, 6, device=device)[:, ::2]
    dsts = [torch.full_like(s, float("nan")) if s.is_floating_point() else torch.full_like(s, -1) for s in srcs]
    strided_dst = torch.zeros(8, 3, device=device)
    guard = torch.full((1024, ), 7.0, device=device)  # (allocated after the destinations)
    copies.copy_into(dsts + [strided_dst], srcs + [strided_src])
    for d, s in zip(dsts + [strided_dst], srcs + [strided_src]):
        assert torch.equal(d, s)
    assert bool((guard == 7.0).all())
