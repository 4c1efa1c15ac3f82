import os

import pytest
import torch


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
