"""One sm90 fp8_block launch for Nsight Compute: the 4 x ~8192-token (6144, 7168) shape."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegemm import benchmark  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "t-6144x7168"
groups, nominal = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4x8192").split("x"))
fmt = sys.argv[3] if len(sys.argv) > 3 else "fp8_block"
n, k = {**benchmark.MODEL_SHAPES, **benchmark.TARGET_SHAPES}[shape]
inp = benchmark.Inputs(fmt, n, k, benchmark.group_sizes(groups, nominal, seed=groups * 100003 + nominal), "cuda")
for _ in range(3):
    inp.ours()
torch.cuda.synchronize()
