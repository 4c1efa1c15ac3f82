"""Time sm90 configurations on a few shapes (the measurements behind config.sm90_config).

python3 bench/tune_sm90.py [out.json]: for each (format, shape, regime) below, every listed
config via override_config, median of do_bench; prints TFLOP/s (valid tokens) and TB/s.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegemm import benchmark  # noqa: E402
from moegemm.config import Sm90Config, override_config  # noqa: E402


def C(fmt, block_n, stages, group_m=8, swap=False, split_n=False):
    return Sm90Config(block_n, 128 if fmt == "fp8_block" else 64, stages, group_m, swap, split_n)


F, B = "fp8_block", "bf16"
PLAN = [
    (F, "dsv3-up", 256, 16, [C(F, 32, 10, 1, swap=True), C(F, 32, 11, 1, swap=True), C(F, 16, 12, 1, swap=True)]),
    (F, "dsv3-down", 256, 16, [C(F, 32, 10, 1, swap=True), C(F, 32, 11, 1, swap=True)]),
    (F, "dsv3-up", 32, 32, [C(F, 64, 8, 1, swap=True), C(F, 64, 9, 1, swap=True), C(F, 32, 11, 1, swap=True)]),
    (F, "dsv3-down", 32, 32, [C(F, 64, 8, 1, swap=True), C(F, 64, 9, 1, swap=True), C(F, 32, 11, 1, swap=True)]),
]

rows = []
device = torch.device("cuda")
for fmt, shape, groups, nominal, configs in PLAN:
    n, k = {**benchmark.MODEL_SHAPES, **benchmark.TARGET_SHAPES}[shape]
    sizes = benchmark.group_sizes(groups, nominal, seed=groups * 100003 + nominal)
    torch.cuda.empty_cache()
    inp = benchmark.Inputs(fmt, n, k, sizes, device)
    flops = 2.0 * sum(sizes) * n * k
    best = None
    for cfg in configs:
        with override_config(cfg):
            try:
                ms = benchmark._bench(inp.ours)
            except Exception as exc:
                print(f"{fmt} {shape} {groups}x{nominal} {cfg}: failed {type(exc).__name__} {str(exc)[:100]}")
                continue
        tflops, tbps = flops / ms / 1e9, inp.bytes_moved() / ms / 1e9
        rows.append(dict(fmt=fmt, shape=shape, groups=groups, nominal=nominal, config=cfg.__dict__, ms=ms,
                         tflops=tflops, tbps=tbps))
        best = max(best or (0, None), (tflops, cfg), key=lambda b: b[0])
        print(f"{fmt:<9} {shape:<12} {groups:>3}x{nominal:<5} bn={cfg.block_n:<3} st={cfg.stages:<2} gm={cfg.group_m:<2} "
              f"{'swap' if cfg.swap else 'split' if cfg.split_n else 'norm'}  {ms:7.3f} ms  {tflops:7.1f} TFLOP/s  {tbps:5.2f} TB/s", flush=True)
    print(f"BEST {fmt} {shape} {groups}x{nominal}: {best[1]} {best[0]:.1f} TFLOP/s", flush=True)
    del inp
if len(sys.argv) > 1:
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
