"""A peer measured against, never project code: OpenAI's `triton_kernels` (Triton 3.6.0's copy,
unmodified, at peers/triton_kernels; git-ignored, carried to the GPU machine) running our
bf16_mxfp4 grouped product on Hopper, so its time can sit beside ours.

The peer's gpt-oss path on Hopper (as vLLM sets it up): `matmul_ogs` on bf16 activations and
MXFP4 weights whose values are in `HopperMXValueLayout(mx_axis=1)` and whose e8m0 scales are in
`HopperMXScaleLayout(mx_axis=1, num_warps=8)`, with ragged routing metadata saying which rows go
to which expert. Here rows [a_offsets[g], a_offsets[g+1]) go to expert g, with no gather and no
scatter: out[rows of g] = a[rows of g] @ dequant(b[g]).T, the same product as ours.

All set-up (layout conversion, routing metadata, output buffer) happens in `mxfp4_call`; the
closure it returns launches only `matmul_ogs`, and captures in a CUDA graph. Only the peer's
public functions are called; nothing of it is copied here. triton_kernels is imported inside the
functions, so this module imports on a machine without it (or without a GPU).

    python bench/peer_triton_kernels.py     # on an sm90 GPU: check and time two gpt-oss shapes
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# the peer's package folder: the tree's own peers/, else the shared copy SOURCE.txt names
PEER_PATHS = (ROOT / "peers" / "triton_kernels", ROOT.parent / "shared" / "peers" / "triton_kernels")
MX_BLOCK = 32  # K elements per e8m0 scale
SCALE_K_ALIGN = 4  # scale blocks per 128-wide K step of the peer's Hopper kernel (its block_k)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def available() -> bool:
    """True when triton_kernels (and its matmul_ogs) imports; puts the peer's folder on sys.path."""
    for path in PEER_PATHS:
        if (path / "triton_kernels").is_dir() and str(path) not in sys.path:
            sys.path.insert(0, str(path))
            break
    try:
        import triton_kernels.matmul_ogs  # noqa: F401
    except Exception:  # noqa: BLE001 (an absent or broken peer: not available)
        return False
    return True


def _plain_scales(inp) -> torch.Tensor:
    """B's e8m0 codes as plain uint8 [G, N, K/32], from the swizzled layout where inp has it."""
    scales = inp.b_scales
    if inp.scale_layout == "swizzled":
        from moegemm import layouts

        scales = layouts.unswizzle_b_scales(scales, inp.n, inp.k // MX_BLOCK)
    return scales.view(torch.uint8).contiguous()


def mxfp4_call(inp) -> Callable[[], torch.Tensor]:
    """The peer's grouped product of `inp` (a moegemm.benchmark_inputs.Inputs of fmt "bf16_mxfp4") as a
    zero-argument closure returning the [M, N] bf16 result; all set-up is done here, once."""
    if inp.fmt != "bf16_mxfp4":
        raise ValueError(f"fmt: the peer runs bf16_mxfp4 here, got {inp.fmt!r}")
    if not available():
        raise RuntimeError(f"triton_kernels does not import (looked in {', '.join(map(str, PEER_PATHS))})")
    device = inp.a.device
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        raise RuntimeError("the peer's Hopper MX layouts need an sm90 GPU")
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig, RoutingData, matmul_ogs
    from triton_kernels.numerics import InFlexData
    from triton_kernels.tensor import FP4, convert_layout, make_ragged_tensor_metadata, wrap_torch_tensor
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    groups, n, k = inp.b.shape[0], inp.n, inp.k
    m = inp.a.shape[0]
    if k % MX_BLOCK or inp.b.shape != (groups, n, k // 2) or sum(inp.sizes) != m or len(inp.sizes) != groups:
        raise ValueError("expected a [M, K] (K a multiple of 32), b [G, N, K/2], one size a group summing to M")
    # Values: our [G, N, K/2] codes seen as [G, K/2, N] (K contiguous) are the peer's FP4 [G, K, N]
    # (in, out) weights; its Hopper layout pads K/2 and N to multiples of 64 itself.
    w = convert_layout(wrap_torch_tensor(inp.b.transpose(1, 2), dtype=FP4), HopperMXValueLayout, mx_axis=1)
    # Scales: plain [G, N, K/32] -> [G, K/32, N] in the peer's Hopper scale layout (which pads N to
    # 256 and K/32 to 2). Its kernel reads the scales of whole 128-wide K steps unmasked, so K/32 is
    # padded here to a multiple of 4 with zero codes (2^-127), which meet only masked-off zero
    # weights and activations: without it the last K step of K=2880 (90 blocks) reads 64 bytes
    # past the last expert's scales. A setup-time copy; the product is unchanged.
    scales = _plain_scales(inp)
    kb = k // MX_BLOCK
    kb_padded = -(-kb // SCALE_K_ALIGN) * SCALE_K_ALIGN
    if kb_padded != kb:
        scales = torch.nn.functional.pad(scales, (0, kb_padded - kb))
    w_scale = convert_layout(wrap_torch_tensor(scales.transpose(1, 2)), HopperMXScaleLayout, mx_axis=1, num_warps=8)
    # Routing: group g's rows are the g-th contiguous slice of a (no gather, no scatter), one
    # expert a row (n_expts_act=1); the ragged metadata is built once, on the device.
    slice_sizes = torch.tensor(inp.sizes, dtype=torch.int32, device=device)
    ragged = make_ragged_tensor_metadata(slice_sizes, m)
    routing = RoutingData(None, ragged.slice_sizes, groups, 1, expt_data=ragged)
    precision = PrecisionConfig(weight_scale=w_scale, flex_ctx=FlexCtx(rhs_data=InFlexData()),
                                out_dtype=torch.bfloat16)
    x = inp.a
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

    def call() -> torch.Tensor:
        return matmul_ogs(x, w, None, routing_data=routing, precision_config=precision, y=out)

    return call


def reference(inp) -> torch.Tensor:
    """fp32 product from the same codes and scales: e2m1 table times 2^(code-127) per 32-block,
    then a[rows of g] @ w[g].T group by group."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=inp.a.device)
    scales = _plain_scales(inp)
    out = torch.zeros(inp.a.shape[0], inp.n, dtype=torch.float32, device=inp.a.device)
    start = 0
    for g, size in enumerate(inp.sizes):
        if size:
            codes = inp.b[g]
            nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(inp.n, inp.k).long()
            w = table[nibbles] * torch.exp2(scales[g].float() - 127).repeat_interleave(MX_BLOCK, dim=1)
            out[start:start + size] = inp.a[start:start + size].float() @ w.T
        start += size
    return out


def check(inp, out: torch.Tensor) -> float:
    """max |out - ref| / max |ref| of the peer's [M, N] result against `reference`."""
    ref = reference(inp)
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def main() -> int:
    if not torch.cuda.is_available():
        print("peer_triton_kernels: a CUDA GPU (sm90) is needed; nothing run")
        return 0
    sys.path.insert(0, str(ROOT))
    from moegemm import benchmark, benchmark_inputs

    if not available():
        print(f"peer_triton_kernels: triton_kernels does not import (looked in {', '.join(map(str, PEER_PATHS))})")
        return 1
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)} | torch {torch.__version__} | triton "
          f"{__import__('triton').__version__} | peer triton_kernels from {sys.modules['triton_kernels'].__file__}")
    sizes = [13, 17, 16, 19]  # 4 groups of ~16 tokens
    for shape, (n, k) in (("gptoss-up", (5760, 2880)), ("gptoss-down", (2880, 2880))):
        torch.manual_seed(0)
        inp = benchmark_inputs.Inputs("bf16_mxfp4", n, k, sizes, device)
        fn = mxfp4_call(inp)
        out = fn()
        torch.cuda.synchronize()
        err = check(inp, out)
        peer_ms = benchmark._bench_graph(fn)
        inp.ours()
        torch.cuda.synchronize()
        ours_err = check(inp, inp.out)
        ours_ms = benchmark._bench_graph(inp.ours)
        verdict = "ok" if err < 1e-2 else "MISMATCH"
        print(f"{shape} N={n} K={k} groups={sizes}: peer max rel err {err:.2e} ({verdict}), {peer_ms * 1e3:.1f} us"
              f" | ours max rel err {ours_err:.2e}, {ours_ms * 1e3:.1f} us | peer/ours {peer_ms / ours_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
