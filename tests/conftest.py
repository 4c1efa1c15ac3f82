import os

import pytest
import torch

# Every launch through a kernel's compiled launcher compares what its key promises with the
# arguments given (moegemm/kernels/compiled_launch.py): a key that misses an argument fails loudly.
os.environ.setdefault("MOEGEMM_CHECK_LAUNCH", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed
    with MOEGEMM_TEST_SEED=<seed>."""
    seed = int(os.environ.get("MOEGEMM_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"seed={seed}")
    yield seed


@pytest.fixture(autouse=True)
def release_gpu_cache():
    """Return a test's cached GPU blocks to the device when it ends, where they exceed 1 GiB: the
    GPU suite runs several pytest workers on one GPU, and the model-shape tests (GBs of weights)
    ran out of memory while other workers' allocators held what their finished tests had freed."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 1 << 30:
        torch.cuda.empty_cache()
