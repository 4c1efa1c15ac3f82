"""moegemm.MoE against the MoE blocks of transformers (Qwen3-MoE, gpt-oss, DeepSeek-V3) built
from small random configurations (tests/hf_moe.py): bf16 weights through the bf16 format match
the block itself; quantized formats match the block's math on the dequantized weights within
the format's tolerance. CPU: the portable Triton backend (interpreter); GPU: sm90."""

import dataclasses

import pytest
import torch

import moegemm
from moegemm.kernels.tl_source import interpreter_usable

from cases import dequantized_experts

transformers = pytest.importorskip("transformers")
import hf_moe  # noqa: E402  (after the skip: it needs transformers)

# The weight-only formats round the tokens and the intermediate to bf16 and quantize neither:
# median and max of 100 draws a block kind on the CPU (reference backend) 0.0033-0.0043 and
# 0.0041-0.0062 for each of them, where mxfp4 had 0.18-0.23 and 0.23-0.28.
QUANTIZED_TOL = {"fp8_block": 0.1, "mxfp8": 0.1, "w4a8": 0.3, "mxfp4": 0.4, "nvfp4": 0.3,
                 "bf16_mxfp4": 0.015, "bf16_nvfp4": 0.015, "bf16_mxfp8": 0.015}


def _rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _device_backend(device):
    if device == "cuda":
        return "sm90"
    if not interpreter_usable():
        pytest.skip("Triton's CPU interpreter needs numpy < 2.4")
    return "triton"


def _sizes(device):
    # On the GPU the expert width is a multiple of 64 so the gate/up product takes the fused epilogue.
    return dict(hidden_size=128, intermediate_size=64) if device == "cuda" else dict(hidden_size=64,
                                                                                      intermediate_size=32)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", hf_moe.KINDS)
def test_bf16_matches_the_transformers_block(kind, device):
    backend = _device_backend(device)
    block = hf_moe.build_block(kind, dtype=torch.bfloat16, **_sizes(device)).to(device)
    layer = moegemm.hf.from_transformers(block, "bf16", backend=backend)
    x = torch.randn(3, 5, block_hidden(block), dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        got = layer(x)
    want = hf_moe.run_block(block, x)
    p = hf_moe.extract_params(block)
    # Same experts chosen; the block rounds each expert's rows to bf16 before summing them
    # (k-1 extra roundings): a bf16 tolerance scaled by k and the output's size.
    ids_ours, _ = layer.route_tokens(x.reshape(-1, x.shape[-1]))
    _, ids_hf = hf_moe.route(x, p)
    assert torch.equal(ids_ours.long().sort(-1).values, ids_hf.long().sort(-1).values)
    atol = p.top_k * 2 ** -7 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)


def block_hidden(block):
    p = hf_moe.extract_params(block)
    return p.router_weight.shape[1]


def _dequantized_params(layer, p):
    """The block's parameters with the layer's experts replaced by their dequantized values."""
    gate, up, down = dequantized_experts(layer)
    return dataclasses.replace(p, gate=gate, up=up, down=down)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", sorted(QUANTIZED_TOL))
@pytest.mark.parametrize("kind", hf_moe.KINDS)
def test_quantized_formats_match_the_dequantized_block(kind, fmt, device):
    backend = _device_backend(device)
    block = hf_moe.build_block(kind, dtype=torch.float32, **_sizes(device)).to(device)
    layer = moegemm.hf.from_transformers(block, fmt, backend=backend)
    p = hf_moe.extract_params(block)
    x = torch.randn(9, block_hidden(block), device=device)
    with torch.no_grad():
        got = layer(x)
    want = hf_moe.reference_moe(x, _dequantized_params(layer, p), compute_dtype=torch.float32)
    assert _rel_err(got, want) < QUANTIZED_TOL[fmt]


def test_from_transformers_rejects_other_blocks():
    with pytest.raises(TypeError, match="block"):
        moegemm.hf.from_transformers(torch.nn.Linear(4, 4))
