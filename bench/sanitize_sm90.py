"""A few sm90 shapes for `compute-sanitizer --tool memcheck`: both operand orders, tiles that
cross group ends, skipped and empty groups, partial K and N blocks. Also checks the result."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import moegemm  # noqa: E402
from moegemm.config import Sm90Config, override_config  # noqa: E402

from cases import TOKEN_PATTERNS, check_output, make_problem, poison_like, tolerance  # noqa: E402

CASES = [
    ("fp8_block", TOKEN_PATTERNS[1], 192, 2880, None),  # ragged, partial K and N
    ("fp8_block", TOKEN_PATTERNS[9], 320, 576, Sm90Config(32, 128, 4, 1, True)),  # skips, swapped
    ("bf16", TOKEN_PATTERNS[13], 320, 576, None),  # a_offsets[0] > 0, tail rows
    ("bf16", TOKEN_PATTERNS[12], 256, 512, Sm90Config(32, 64, 4, 1, True)),  # repeated experts, swapped
    # The block-format kernel: decode and prefill tiles, both scale layouts, partial K steps.
    ("mxfp4", TOKEN_PATTERNS[1], 192, 2880, None),
    ("nvfp4", TOKEN_PATTERNS[9], 320, 608, Sm90Config(16, 64, 4, 1, True, consumer_regs=192)),
    ("mxfp8", TOKEN_PATTERNS[13], 320, 608, None),
    ("w4a8", TOKEN_PATTERNS[12], 256, 512, Sm90Config(128, 64, 4, 4, True, consumer_regs=192)),
]

for i, (fmt, pattern, n, k, cfg) in enumerate(CASES):
    layout = "swizzled" if fmt in ("mxfp4", "nvfp4") else "plain"
    p = make_problem(fmt, layout, pattern, n, k, "cuda")
    poisoned = poison_like(p.m, n, torch.bfloat16, "cuda")
    out = poisoned.clone()
    if cfg is None:
        moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
    else:
        with override_config(cfg):
            moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, backend="sm90")
    torch.cuda.synchronize()
    check_output(p, out, poisoned, tolerance(fmt, "sm90"))
    print(f"ok {fmt} {pattern.name} N={n} K={k} {'swapped' if cfg is not None and cfg.swap else 'default'}")
