"""Expert parallelism (moegemm.distributed, MoE(ep_group=...)): W spawned ranks against the
single-process layer, every format, both paths; gloo on the CPU, NCCL on GPUs (tests/ep_workers.py)."""

import pytest
import torch
from ep_workers import spawn

import moegemm

FORMATS = list(moegemm.FORMATS)
# hidden, width, experts, top_k, tokens a rank
CPU_SIZES = (256, 128, 8, 3, 9)
# More experts than ranks, tiles past the first on every product, groups of tens of tokens.
GPU_SIZES = (1024, 512, 32, 4, 96)
GPU_TOL = 1e-3  # relative (Frobenius): the combine adds fp32 partial sums in another order


# One spawn a group size (each rank imports torch and moegemm: seconds of make test's budget).
def test_two_ranks_cpu():
    spawn(2, "gloo", "check_all", ("check_layers", FORMATS, ("prefill", "decode", "capacity"), CPU_SIZES, 1e-5),
          ("check_functional",), ("check_loaders",), ("check_errors",), ("check_over_capacity",), timeout=300)


@pytest.mark.parametrize("case", ["fmt", "hidden_size", "num_experts", "ep_path", "ep_capacity", "loaded format"])
def test_disagreeing_ranks_fail_together_cpu(case):
    """Each misuse: a ValueError on every rank within seconds, never a hang (the test's timeout)."""
    spawn(2, "gloo", "check_misuse", case, timeout=60)


@pytest.mark.parametrize("world", [2, 4])
def test_disagreeing_calls_fail_together_cpu(world):
    """moe_forward calls whose ranks disagree (format, k, hidden size, path, capacity, the decode
    path's token counts), and MoE's decode path without a capacity on unequal counts: a ValueError
    on every rank, never a crash or a hang (the timeout), and the group still works after."""
    spawn(world, "gloo", "check_disagreeing_calls", timeout=90)


def test_transformers_blocks_two_ranks_cpu():
    pytest.importorskip("transformers")
    spawn(2, "gloo", "check_transformers_blocks")


def test_four_ranks_cpu():
    spawn(4, "gloo", "check_all", ("check_layers", FORMATS, ("prefill", "decode", "capacity"), CPU_SIZES, 1e-5),
          ("check_functional",), ("check_over_capacity",), timeout=300)


def _gpus(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_single_gpu_nccl(world):
    _gpus(world)
    spawn(world, "nccl", "check_layers", FORMATS, ("prefill", "decode", "capacity"), GPU_SIZES, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_disagreeing_calls_fail_together_nccl(world):
    _gpus(world)
    spawn(world, "nccl", "check_disagreeing_calls", timeout=180)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_decode_path_in_cuda_graph_nccl(world):
    _gpus(world)
    spawn(world, "nccl", "check_graph", FORMATS, GPU_SIZES, GPU_TOL)
