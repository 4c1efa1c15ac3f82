"""One row of `python -m moegemm bench` as operands: random codes and scales in our layouts
(`Inputs.ours`) and in the baselines' (`Inputs.torch_baseline`: torch's grouped kernels;
`deepgemm_runner`: DeepGEMM's contiguous grouped FP8 GEMM on 128-row padded groups, when it
imports), and the bytes the row moves.
"""

from __future__ import annotations

import math

import torch

from . import layouts
from .benchmark_rows import BF16_BASELINE_FORMATS
from .formats import FORMATS
from .ops import grouped_matmul


def _random_fp8(shape, device) -> torch.Tensor:
    """Random e4m3 values of unit scale, built in slices to keep the fp32 temporaries small."""
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    flat = out.view(-1, shape[-1])
    step = max(1, (1 << 26) // shape[-1])
    for i in range(0, flat.shape[0], step):
        flat[i:i + step] = torch.randn(flat[i:i + step].shape, device=device).to(torch.float8_e4m3fn)
    return out


class Inputs:
    """One row's operands in both our layout and the baselines' layouts."""

    def __init__(self, fmt: str, n: int, k: int, sizes: list[int], device):
        self.fmt, self.n, self.k, self.sizes = fmt, n, k, sizes
        g = len(sizes)
        m = sum(sizes)
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        self.a_offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
        self.expert_ids = torch.arange(g, dtype=torch.int32, device=device)
        self.torch_offs = self.a_offsets[1:].contiguous()
        self.scale_layout = "plain"
        self.expert_scales = None
        if fmt in BF16_BASELINE_FORMATS:
            self._block_format_inputs(m, g, n, k, device)
        elif fmt == "fp8_block":
            self.a = _random_fp8((m, k), device)
            self.b = _random_fp8((g, n, k), device)
            self.a_scales = torch.rand(m, math.ceil(k / 128), device=device) + 0.5
            self.b_scales = torch.rand(g, math.ceil(n / 128), math.ceil(k / 128), device=device) + 0.5
            self.row_a = torch.rand(m, device=device) + 0.5  # torch rowwise baseline scales
            self.row_b = torch.rand(g, n, device=device) + 0.5
        else:
            self.a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(g, n, k, device=device, dtype=torch.bfloat16)
            self.a_scales = self.b_scales = None
        self.out = torch.empty(m, n, device=device, dtype=torch.bfloat16)

    def _block_format_inputs(self, m, g, n, k, device):
        """Random codes and scales in the swizzled layout (what checkpoints and quantize() give):
        e8m0 scales around 2^0, nvfp4 e4m3 scales in [1, 2). A weight-only format's A is bf16
        without scales. NVFP4 weights' global scales (each expert's, times A's where A is nvfp4)
        come as expert_scales, where grouped_matmul folds those of quantize / quantize_weights."""
        f = FORMATS[self.fmt]
        self.scale_layout = "swizzled" if f.swizzle_capable else "plain"

        def elements(rows, op):
            if op.element.packed:
                return torch.randint(0, 256, (*rows, k // 2), dtype=torch.uint8, device=device)
            return _random_fp8((*rows, k), device)

        def scales(shape, op):
            if op.scale == "e8m0":
                return torch.randint(122, 132, shape, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
            return (torch.rand(shape, device=device) + 1).to(torch.float8_e4m3fn)

        if f.a.scale is None:
            self.a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            self.a_scales = None
        else:
            self.a = elements((m, ), f.a)
            a_blocks = sum(math.ceil(s / 128) for s in self.sizes)
            self.a_scales = scales(layouts.swizzled_a_shape(a_blocks, k // f.a.block_k), f.a)
        self.b = elements((g, n), f.b)
        b_kb = k // f.b.block_k
        b_shape = layouts.scale_layout_of(self.scale_layout).b_shape(g, n, b_kb)
        self.b_scales = scales(b_shape, f.b)
        if f.global_scale:
            self.expert_scales = torch.rand(g, device=device) + 0.5

    def ours(self):
        return grouped_matmul(self.a, self.b, self.a_scales, self.b_scales, self.a_offsets, self.expert_ids,
                              fmt=self.fmt, out=self.out, scale_layout=self.scale_layout,
                              expert_scales=self.expert_scales)

    def torch_baseline(self):
        if self.fmt == "fp8_block":
            return torch._scaled_grouped_mm(self.a, self.b.transpose(-2, -1), self.row_a, self.row_b,
                                            offs=self.torch_offs, out_dtype=torch.bfloat16, use_fast_accum=True)
        return torch._grouped_mm(self.a, self.b.transpose(-2, -1), offs=self.torch_offs, out_dtype=torch.bfloat16)

    def bytes_moved(self) -> float:
        """Weights of the experts used, activations and output once each, compressed: block and
        weight-only formats count their elements (2, 1 or 1/2 byte) and their scales (1 byte
        per block; a weight-only format's bf16 A has none)."""
        m = sum(self.sizes)
        used = len([s for s in self.sizes if s > 0])
        if self.fmt in BF16_BASELINE_FORMATS:
            f = FORMATS[self.fmt]
            a_elem, b_elem = (op.element.bits / 8 + (1 / op.block_k if op.scale else 0) for op in (f.a, f.b))
        else:
            a_elem = b_elem = 1 if self.fmt == "fp8_block" else 2
        return used * self.n * self.k * b_elem + m * self.k * a_elem + m * self.n * 2


def deepgemm_runner(inp: Inputs):
    """DeepGEMM's contiguous grouped FP8 GEMM on 128-row padded groups, or None."""
    if inp.fmt != "fp8_block":
        return None
    try:
        import deep_gemm
    except Exception:
        return None
    device = inp.a.device
    padded = [math.ceil(s / 128) * 128 for s in inp.sizes]
    mp = sum(padded)
    a = torch.zeros(mp, inp.k, dtype=torch.float8_e4m3fn, device=device)
    sa = torch.ones(mp, math.ceil(inp.k / 128), device=device)
    m_indices = torch.full((mp,), -1, dtype=torch.int32, device=device)
    src = dst = 0
    for g, (s, p) in enumerate(zip(inp.sizes, padded)):
        a[dst:dst + s] = inp.a[src:src + s]
        sa[dst:dst + s] = inp.a_scales[src:src + s]
        m_indices[dst:dst + s] = g
        src, dst = src + s, dst + p
    # DeepGEMM reads its token scales MN-major, each K block's column 16-byte aligned; laid out so
    # once here (torch, not DeepGEMM's helper: its JIT transpose is not what is measured), its call
    # checks the layout and runs the GEMM kernel alone (otherwise a transpose kernel a call)
    aligned_rows = math.ceil(mp / 4) * 4
    columns = torch.zeros(sa.shape[1], aligned_rows, device=device)
    columns[:, :mp] = sa.t()
    sa = columns[:, :mp].t()
    out = torch.empty(mp, inp.n, dtype=torch.bfloat16, device=device)
    fn = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None) or \
        getattr(deep_gemm, "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")
    return lambda: fn((a, sa), (inp.b, inp.b_scales), out, m_indices)
