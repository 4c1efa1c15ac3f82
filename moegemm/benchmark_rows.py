"""The rows of `python -m moegemm bench`: the formats, the named model shapes (N, K) of real
expert projections, the groups x nominal tokens each runs at, and a row's group sizes, drawn
+-30% around the nominal count and nudged off multiples of 128.

Named presets (PRESETS, `--preset NAME`) pick other rows: `model-formats` is every format of
FORMATS on the DeepSeek-V3 and gpt-oss expert shapes at decode and prefill token counts, with a
summary per shape (ms, xtorch, xfp8b) at the end.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .formats import FORMATS

# the formats whose A and B both carry scales in 32- or 16-wide K blocks (the swizzled layout is theirs)
BLOCK_FORMATS = tuple(name for name, f in FORMATS.items() if f.swizzle_capable and f.a_scaled)
# weight-only formats: bf16 activations without scales times block-scaled weights
WEIGHT_ONLY_FORMATS = tuple(name for name, f in FORMATS.items() if f.weight_only)
# The formats compared with BF16 torch._grouped_mm on the same groups: PyTorch has no grouped
# product of them on Hopper.
BF16_BASELINE_FORMATS = BLOCK_FORMATS + WEIGHT_ONLY_FORMATS
DEFAULT_FORMATS = ("fp8_block", "bf16") + BLOCK_FORMATS

# (N, K) of real expert projections.
MODEL_SHAPES = {
    "dsv3-up": (4096, 7168),  # DeepSeek-V3 / Kimi K2 gate+up
    "dsv3-down": (7168, 2048),
    "k2.5-tp8-up": (512, 7168),  # Kimi K2.5 at TP8
    "k2.5-tp8-down": (7168, 256),
    "qwen3-235b-up": (3072, 4096),
    "qwen3-235b-down": (4096, 1536),
    "gptoss-up": (5760, 2880),  # gpt-oss-120b
    "gptoss-down": (2880, 2880),
    "qwen3-tp8-up": (192, 4096),  # Qwen3 at TP8
}
# The shapes of the fp8_block targets (the peer figures for them: bench/data/peers.json).
TARGET_SHAPES = {"t-6144x7168": (6144, 7168), "t-7168x3072": (7168, 3072), "t-4096x4096": (4096, 4096),
                 "t-4096x2048": (4096, 2048)}
PREFILL = [(4, 8192), (8, 4096), (32, 256), (64, 128)]
DECODE = [(256, 16), (32, 32)]


def default_rows(fmts=DEFAULT_FORMATS) -> list[tuple[str, str, int, int]]:
    """(format, shape name, groups, nominal tokens per group)."""
    rows = []
    for fmt in fmts:
        rows += [(fmt, name, g, t) for name in TARGET_SHAPES for g, t in PREFILL]
        rows += [(fmt, name, g, t) for name in ("dsv3-up", "dsv3-down") for g, t in DECODE]
        rows += [(fmt, name, 8, 4096) for name in MODEL_SHAPES if name not in ("dsv3-up",)]
        rows += [(fmt, name, g, t) for name in ("k2.5-tp8-up", "gptoss-up", "gptoss-down", "qwen3-tp8-up")
                 for g, t in DECODE]
    return rows


# The model-formats preset: the expert projections of DeepSeek-V3 and gpt-oss-120b at decode
# (256 x 16, 32 x 32) and prefill (64 x 128, 8 x 4096) groups x nominal tokens.
MODEL_FORMAT_SHAPES = ("dsv3-up", "dsv3-down", "gptoss-up", "gptoss-down")
MODEL_FORMAT_REGIMES = ((256, 16), (32, 32), (64, 128), (8, 4096))


def model_format_rows(fmts=None) -> list[tuple[str, str, int, int]]:
    """Every format of `fmts` (default: all of FORMATS) on each (shape, groups, tokens) of the
    preset, key by key. Within a key fp8_block comes first, so that every other row of the key
    finds its time for vs_fp8_block, then FORMATS' order (bf16 next: its row times the BF16
    torch baseline the block and weight-only rows of the key reuse)."""
    chosen = set(FORMATS if fmts is None else fmts)
    order = [f for f in dict.fromkeys(("fp8_block", *FORMATS)) if f in chosen]
    return [(fmt, shape, g, t) for shape in MODEL_FORMAT_SHAPES for g, t in MODEL_FORMAT_REGIMES for fmt in order]


@dataclass(frozen=True)
class Preset:
    about: str
    rows: Callable  # rows(fmts or None for the preset's default formats) -> [(fmt, shape, groups, nominal)]
    warmup_ms: float  # do_bench's warm-up time per timed call


WARMUP_MS = 25  # do_bench's default
PRESETS = {
    # 16 keys x every format (144 rows with nine formats): at do_bench's 25 ms of warm-up a call,
    # warm-up alone would take about 9 s of the run. Before its warm-up do_bench has already made
    # six calls (one, then five to estimate the time), and a graph is timed right after the eager
    # call it captures, so one warm-up call suffices; the 100 ms of timed calls, their median and
    # the L2 flush before each stay.
    "model-formats": Preset("every format on DeepSeek-V3 and gpt-oss expert shapes, decode and prefill",
                            model_format_rows, warmup_ms=1),
}


def select_rows(preset: str = "", formats: str = "", only: str = "") -> list[tuple[str, str, int, int]]:
    """The rows of `python -m moegemm bench`: the preset's (its default formats: all of FORMATS)
    or default_rows' (DEFAULT_FORMATS), in `formats` (comma-separated) when given, and matching a
    word of `only` (comma-separated substrings of 'fmt shape GxT') when given."""
    fmts = tuple(f for f in formats.split(",") if f) or None
    unknown = [f for f in fmts or () if f not in FORMATS]
    if unknown:
        raise ValueError(f"formats: {', '.join(unknown)} not in FORMATS ({', '.join(FORMATS)})")
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
        rows = PRESETS[preset].rows(fmts)
    else:
        rows = default_rows(fmts or DEFAULT_FORMATS)
    if only:
        rows = [r for r in rows if any(word in f"{r[0]} {r[1]} {r[2]}x{r[3]}" for word in only.split(","))]
    return rows


def group_sizes(groups: int, nominal: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    sizes = []
    for _ in range(groups):
        size = max(1, round(nominal * rng.uniform(0.7, 1.3)))
        sizes.append(size + 1 if size % 128 == 0 else size)
    return sizes
