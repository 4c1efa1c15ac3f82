"""Which configuration each kernel runs: a pure function of (format, shape, device), cached.

The portable kernel's tiles (PortableConfig) and the choice per shape of every kernel's config
(the sm90 kernels' config classes: sm90_configs.py); what else the choice depends on
(`planned_tokens_per_slot`, `choice_context`). MOEGEMM_PRINT_CONFIG=1 prints each choice once.
Tests may force a choice with `override_config(cfg)` (per config function: portable, dense sm90,
block-format sm90).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass, replace

from .formats import FORMATS, PREPACK_FORMATS, Format
from .sm90_configs import (DecodeConfig, DenseConfig, E2m1Config, MxConfig, Mxfp8Config, deepest_ring,
                           with_epilogue_scratch)

__all__ = [
    "PortableConfig",
    "override_config",
    "planned_tokens_per_slot",
    "portable_config",
    "sm90_config",
    "sm90_mx_config",
]


@dataclass(frozen=True)
class PortableConfig:
    """Tile shape and launch shape of the portable tl kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int  # persistent grid: programs = SMs * this (capped by an upper bound of the tiles)

    def check(self, fmt: Format):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"config: {name} must be a power of two >= 16, got {value}")
        if fmt.name == "fp8_block":
            if fmt.a.block_k % self.block_k:
                raise ValueError(f"config: fp8_block K steps must not straddle its 128-wide scale blocks, got block_k={self.block_k}")
        elif fmt.scaled and self.block_k % fmt.scale_vec:
            raise ValueError(f"config: block_k={self.block_k} must be a multiple of the scale block {fmt.scale_vec}")


_overrides: dict[str, object] = {}


def _family(config) -> str:
    """Overrides apply per config function: the dense kernel's, or the block formats' (any of
    their three kernels' configs)."""
    if isinstance(config, DenseConfig):
        return "sm90"
    if isinstance(config, (DecodeConfig, Mxfp8Config, E2m1Config)):
        return "sm90-mx"
    return type(config).__name__


@contextlib.contextmanager
def override_config(config):
    """Force a config inside the block (for tests that must cover edge cases): a PortableConfig,
    a DenseConfig, or one of the block formats' (DecodeConfig, Mxfp8Config, E2m1Config)."""
    kind = _family(config)
    previous = _overrides.get(kind)
    _overrides[kind] = config
    try:
        yield
    finally:
        if previous is None:
            del _overrides[kind]
        else:
            _overrides[kind] = previous


# Tokens a slot the sm90 kernels are chosen for inside planned_tokens_per_slot, else None.
_planned: contextvars.ContextVar[float | None] = contextvars.ContextVar("moegemm_planned_tokens", default=None)


@contextlib.contextmanager
def planned_tokens_per_slot(tokens_per_slot: float):
    """Choose every sm90 kernel and config inside the block as if its slots held this many tokens
    on average, whatever the rows of the call: under expert parallelism a rank runs its share of
    a batch with the kernels one GPU would choose for the whole batch, so that the arithmetic (the
    kernel, its sums' order, the fused epilogue) and so the results are the same. Any choice is
    correct for any group sizes; only its speed depends on them."""
    token = _planned.set(float(tokens_per_slot))
    try:
        yield
    finally:
        _planned.reset(token)


def choice_context():
    """What besides a problem's shapes the config choice depends on, for callers that cache it:
    the planned tokens a slot, or None while a test forces a config (then nothing is cached)."""
    return None if _overrides else ("planned", _planned.get())


def _tokens_per_slot(tokens_per_slot: float) -> float:
    planned = _planned.get()
    return tokens_per_slot if planned is None else planned


def _print_choice(kind: str, key: str, config):
    if os.environ.get("MOEGEMM_PRINT_CONFIG", "0") not in ("", "0"):
        print(f"[moegemm] {kind} config {key}: {config}")


def portable_config(fmt: Format, n: int, k: int, device_type: str) -> PortableConfig:
    config = _overrides.get("PortableConfig") or _portable_config(fmt.name, fmt.scale_vec, n, k, device_type)
    config.check(fmt)
    return config


def sm90_config(fmt: Format, n: int, k: int, tokens_per_slot: float, out_bytes: int = 2,
                fused: bool = False) -> DenseConfig:
    """The dense kernel's config: a pure function of (format, N, K, token regime); the regime is
    M / G, known on the host. `fused`: the kernel runs the fused SwiGLU epilogue."""
    forced = _overrides.get("sm90")
    config = forced or _sm90_config(fmt.name, n, k, _regime(_tokens_per_slot(tokens_per_slot)), out_bytes, fused)
    return _checked(config, fmt, out_bytes, fused)


@functools.cache
def _checked(config, fmt: Format, out_bytes: int, fused: bool):
    """config, its ring shortened for the fused epilogue's scratch where need be (a forced
    swapped config's may be too deep), checked; cached: a call of the op pays a lookup."""
    if fused:
        config = with_epilogue_scratch(config, fmt)
    config.check(fmt, out_bytes, fused)
    return config


def _regime(tokens_per_slot: float, smallest: int = 16) -> int:
    """Bucket the mean tokens per slot so the config cache stays small: 16, 32, 64 (decode:
    the token tile that holds a group of +-30% around the mean; 8 below 4 tokens a slot where
    the kernel has 8-token tiles, smallest=8), 192 (small groups) or 0 (many)."""
    for bound, regime in ((4, 8), (12, 16), (24, 32), (48, 64), (192, 192)):
        if regime < smallest:
            continue
        if tokens_per_slot <= bound:
            return regime
    return 0


@functools.cache
def _sm90_config(fmt_name: str, n: int, k: int, regime: int, out_bytes: int, fused: bool) -> DenseConfig:
    fp8 = fmt_name == "fp8_block"
    block_k = 128 if fp8 else 64
    if regime in (16, 32, 64):
        # Few tokens per expert: weights are the 128-row wgmma side, the tokens of a group
        # (one tile of 16/32/64) the narrow side. The run streams the weights, so the ring is
        # as deep as shared memory allows.
        cfg = DenseConfig(block_n=regime, block_k=block_k, stages=2, group_m=1, swap=True)
    elif regime == 192:
        # Small groups: 64-token tiles waste less on ragged group ends than 128-token tiles.
        cfg = DenseConfig(block_n=128, block_k=block_k, stages=2, group_m=4, split_n=True)
    else:
        # 128 x 256 tiles: fp8_block as two 128-wide halves (two fp32 accumulators and one
        # block in flight per warpgroup); the wider tile cuts L2 traffic per flop, which bound
        # the 128 x 128 tile (docs/perf-notes.md, tile shapes). Bands of 4 token blocks.
        cfg = DenseConfig(block_n=256 if n >= 1024 else 128, block_k=block_k, stages=2, group_m=4)
    if fp8:
        # Claimed last rounds did not pay on fp8_block (docs/perf-notes.md, round-robin tiles).
        cfg = replace(cfg, claim_rounds=0)
        if regime == 0 and cfg.block_n == 256:
            # The scales staged in the ring: no global load or pointer in the K loop. At 216
            # registers a consumer ptxas spills nothing; at 232 it spilled in the loop of the
            # specialization with row or expert scales (sm_90 SASS, tests/test_compile_sm90.py).
            cfg = replace(cfg, scale_ring=True, consumer_regs=216)
    # The ring is as deep as shared memory allows, up to 12 stages, with the fused epilogue's
    # scratch in place of the plain epilogue's buffers when fused.
    config = deepest_ring(cfg, FORMATS[fmt_name], out_bytes, fused=fused)
    _print_choice("sm90", f"fmt={fmt_name} N={n} K={k} regime={regime or 'many'} fused={fused}", config)
    return config


def sm90_mx_config(fmt: Format, n: int, k: int, tokens_per_slot: float, fused: bool = False,
                   prepacked: bool = False) -> MxConfig:
    """The block formats' kernel and config: a pure function of (format, N, K, token regime,
    weight order). `fused`: the ring is shortened, if need be, for the fused epilogue's scratch.
    `prepacked` weights (moegemm.prepack; formats.PREPACK_FORMATS, which run the decoding kernel
    in every regime) are decoded into the wgmma's registers."""
    # e2m1 weights in the plain order run 8-token tiles at the fewest tokens (kernels/sm90/e2m1.py).
    smallest = 8 if fmt.name in ("mxfp4", "w4a8") and not prepacked else 16
    regime = _regime(_tokens_per_slot(tokens_per_slot), smallest)
    config = _overrides.get("sm90-mx") or _sm90_mx_config(fmt.name, n, k, regime, prepacked)
    if getattr(config, "prepacked", False) != prepacked:
        raise ValueError(f"config: {config} does not read {'prepacked' if prepacked else 'plain'} weights")
    return _checked(config, fmt, 2, fused)


@functools.cache
def _sm90_mx_config(fmt_name: str, n: int, k: int, regime: int, prepacked: bool = False) -> MxConfig:
    fmt = FORMATS[fmt_name]
    if prepacked and fmt_name not in PREPACK_FORMATS:
        raise ValueError(f"config: prepacked weights are for {', '.join(PREPACK_FORMATS)}, not {fmt_name}")
    if fmt_name == "mxfp8" and regime in (16, 32):
        # Both operands are e4m3: fp8 wgmma straight from the ring, scales promoted per k32 block,
        # no weight decoding; at ~32-48 tokens an expert the decoding kernel's 64-token tiles
        # were faster than two 32-token promotion tiles. The slot walk from chunks of slots pays
        # on 32-token tiles only (docs/perf-notes.md, block formats; slot walk).
        cfg = Mxfp8Config(token_tile=regime, stages=2, group_m=1, consumer_regs=192, chunk_walk=regime == 32)
    elif fmt_name == "mxfp8" and regime in (64, 192):
        # More tokens an expert: 64- (regime 64) or 128-token tiles, the token scales through the
        # ring. Up to 192 tokens a slot, a slot's last 128-token tile takes a tail of up to 32 more
        # tokens; tails of up to 16 tokens run on a 16-wide accumulator. The tail's accumulator needs 240 registers a consumer thread (232 spilled
        # in its K loop). docs/perf-notes.md, wide mxfp8 tiles.
        tokens = 64 if regime == 64 else 128
        tail = 32 if regime == 192 else 0
        cfg = Mxfp8Config(token_tile=tokens, stages=2, group_m=4, consumer_regs=240 if tail else 232,
                          tail_tokens=tail, short_tails=tail == 32)
    elif fmt_name in ("mxfp4", "w4a8") and regime in (8, 16) and not prepacked:
        # e2m1 weights at decode: decoded to e4m3 in shared memory (1 instruction an element) and
        # run like mxfp8, 256 K a stage; 8-token tiles up to 4 tokens a slot. Regime 32 stays on
        # the decoding kernel: 32-token tiles spilled ~190 values. Split-K: four consumer
        # warpgroups, one 128-K half of every stage to each pair (docs/perf-notes.md, e2m1 weights).
        cfg = E2m1Config(token_tile=regime, stages=2, group_m=1, consumer_regs=112, split_k=True)
    else:
        # Weights are always the 128-row wgmma side (decoded into shared memory, the A operand;
        # prepacked ones into the A operand's registers: 1.0-1.26x, docs/perf-notes.md);
        # the tokens (bf16) the N side: one group's tokens at decode, 128 for small groups, 256
        # (two 128-token halves on one decoded operand: the decode paid once for 256 tokens) for
        # many; mxfp8 too at many tokens an expert, where its 256-token tiles ran 1.10-1.15x the
        # promotion kernel's 128-token tiles. A stage carries two 64-wide K steps below 128 tokens
        # (1.2-1.3x faster than one in every format and regime, four no better); 128- and
        # 256-token tiles keep one, an iteration taking two stages. 256-token tiles need 240
        # registers a consumer (the producer then 24) (docs/perf-notes.md, block formats).
        cfg = _decode_config(regime, prepacked)
    cfg = deepest_ring(cfg, fmt)
    _print_choice("sm90-mx", f"fmt={fmt_name} N={n} K={k} regime={regime or 'many'}", cfg)
    return cfg


def _decode_config(regime: int, prepacked: bool = False) -> DecodeConfig:
    tokens = regime if regime in (16, 32, 64) else 128 if regime == 192 else 256
    if prepacked and tokens <= 64:
        # Few tokens a slot: 256-row tiles, four consumer warpgroups on each token stage (the
        # bf16 tokens were half the bytes of fp4 weight rows on 128-row tiles): 1.2-1.9x
        # (docs/perf-notes.md, prepacked weights). e2m1 weights on swizzled scales take those
        # scales through the ring with their codes (no global load in the K loop): nvfp4 1.03-1.16x,
        # bf16_mxfp4 0.97-1.07x the loop that loads them a step ahead; the launcher steps back to
        # that loop where the scales cannot be staged (DecodeConfig.step_ahead).
        return DecodeConfig(token_tile=tokens, stages=2, group_m=1, consumer_regs=112, sub_steps=2, prepacked=True,
                            weight_tile=256, staged_scales=True)
    return DecodeConfig(token_tile=tokens, stages=2, group_m=1 if regime in (16, 32, 64) else 4,
                        consumer_regs=240 if tokens == 256 else 192, sub_steps=2 if tokens < 128 else 1,
                        prepacked=prepacked)


@functools.cache
def _portable_config(fmt_name: str, scale_vec: int, n: int, k: int, device_type: str) -> PortableConfig:
    if device_type == "cpu":
        # The interpreter pays per operation, not per element: few large tiles (128^3 ran the
        # 6512-row test pattern 5x faster than 64^3); three programs so the persistent stride
        # is exercised on the CPU too.
        config = PortableConfig(block_m=128, block_n=128, block_k=128, num_warps=4, num_stages=1, programs_per_sm=3)
    else:
        # Operands are decoded in registers before the dot, so register pressure decides the
        # tile. With 32-wide K steps on 8 warps, 64x128 compiled without spills for every
        # format but mxfp8 with plain scales (15), which is clean at 128x64 (where w4a8
        # spilled 27). 64-wide K steps spilled 11-46 registers, 4 warps 5-72 (sm_90 SASS,
        # tests/test_compile_sm90.py keeps this true).
        block_m, block_n = (128, 64) if fmt_name == "mxfp8" else (64, 64 if n <= 64 else 128)
        config = PortableConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=8, num_stages=3,
                                programs_per_sm=2)
    _print_choice("portable", f"fmt={fmt_name} N={n} K={k} device={device_type}", config)
    return config
