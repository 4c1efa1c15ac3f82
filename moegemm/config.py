"""Kernel configurations: frozen data from a pure function of (format, shape, device).

MOEGEMM_PRINT_CONFIG=1 prints each choice once. Tests may force a choice with
`override_config(cfg)` (per config function: portable, dense sm90, block-format sm90).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass, replace

from .formats import FORMATS, PREPACK_FORMATS, Format

__all__ = [
    "DecodeConfig",
    "DenseConfig",
    "E2m1Config",
    "Mxfp8Config",
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


SM90_SMEM_BYTES = 232448  # per block on H100/H200 (227 KiB)
# The formats of block-scaled weights (kernels/sm90: decode, mxfp8, e2m1): the block formats and
# the weight-only ones (bf16 activations, which only the decoding kernel takes).
MX_FORMATS = ("mxfp8", "mxfp4", "nvfp4", "w4a8", "bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")
_RING_BARRIERS = 2 * 8  # a stage's ready and empty mbarriers
_SCHEDULE = 128  # the tile-id words and their barriers, with room to spare


def weight_bytes(fmt: Format) -> float:
    """Bytes a weight element takes in the ring (packed fp4: 1/2)."""
    return fmt.b.element.bits / 8


def _check_smem(cfg, fmt: Format, out_bytes: int, fused: bool):
    smem = cfg.smem_bytes(fmt, out_bytes, fused)
    if smem > SM90_SMEM_BYTES:
        raise ValueError(f"config: {smem} bytes of shared memory > {SM90_SMEM_BYTES}: {cfg}")


@dataclass(frozen=True)
class DenseConfig:
    """kernels/sm90/dense.py (bf16, fp8_block), two consumer warpgroups on a tile of

    normal   (default)   128 tokens x block_n weights; warpgroups split the tokens
    split_n              64 tokens x 2*block_n weights; warpgroups split the weights
    swap                 block_n tokens x 128 weights; weights are the wgmma M side (decode)

    The last claim_rounds * programs tiles of a call are claimed from a counter as programs free
    up, the rest dealt round-robin (kernels/sm90/pipeline.py, schedule); 0: round-robin throughout.
    """

    block_n: int
    block_k: int
    stages: int
    group_m: int  # token blocks per band of the tile order (L2 reuse)
    swap: bool = False
    split_n: bool = False
    consumer_regs: int = 232
    claim_rounds: int = 2

    @property
    def token_tile(self) -> int:
        return self.block_n if self.swap else (64 if self.split_n else 128)

    @property
    def weight_tile(self) -> int:
        return 128 if self.swap else (2 * self.block_n if self.split_n else self.block_n)

    @property
    def stage_k(self) -> int:
        return self.block_k

    def epilogue_n(self, promote: bool) -> int:
        """Columns of one accumulator: fp8_block computes a normal 256-wide tile as two halves."""
        return 128 if promote and not self.swap and not self.split_n and self.block_n > 128 else self.block_n

    def fused_scratch(self) -> int:
        """Shared memory of the fused SwiGLU epilogue's layout conversions (kernels/sm90/swiglu.py),
        which runs instead of the plain epilogue and needs none of its buffers: swapped tiles
        convert each warpgroup's fp32 accumulator [64, tokens]; normal tiles only their [64, W/2]
        output, which Triton converts in pieces (sm_90 compile: 8 KB for both warpgroups at
        64 x 256 and 128 x 256 tiles, bf16 or quantized out): twice that is kept."""
        return 2 * self.token_tile * 64 * 4 if self.swap else 2 * 8192

    def smem_bytes(self, fmt: Format, out_bytes: int = 2, fused: bool = False) -> int:
        """The ring, and the plain epilogue's TMA buffers (normal tiles) or the fused one's scratch."""
        element = fmt.b.element.bits // 8
        stage = (self.token_tile + self.weight_tile) * element * self.stage_k
        if fused:
            epilogue = self.fused_scratch()
        else:
            epilogue = 0 if self.swap else 2 * 64 * self.epilogue_n(element == 1) * out_bytes
        return self.stages * (stage + _RING_BARRIERS) + epilogue + _SCHEDULE

    def check(self, fmt: Format, out_bytes: int = 2, fused: bool = False):
        if fmt.name not in ("bf16", "fp8_block"):
            raise ValueError(f"config: DenseConfig runs bf16 and fp8_block, not {fmt.name}")
        if self.block_n not in (16, 32, 64, 128, 256) or (self.swap and self.split_n):
            raise ValueError(f"config: block_n must be 16..256 (powers of two), swap and split_n exclusive: {self}")
        fp8 = fmt.name == "fp8_block"
        if fp8 and (self.block_k != 128 or min(self.epilogue_n(True), self.weight_tile) > 128 and not self.swap):
            raise ValueError(f"config: fp8_block promotes per 128x128 block; an accumulator spans <= 128 weights: {self}")
        if self.block_k * (1 if fp8 else 2) != 128:
            raise ValueError(f"config: block_k rows must be 128 bytes (the TMA swizzle), got block_k={self.block_k}")
        _check_smem(self, fmt, out_bytes, fused)


@dataclass(frozen=True)
class DecodeConfig:
    """kernels/sm90/decode.py (nvfp4 and the weight-only formats everywhere, mxfp4 and w4a8 above
    12 tokens a slot or prepacked, mxfp8 at many): swapped tiles of weight_tile weight rows (decoded to bf16 by
    the consumers, a warpgroup for each 64) x token_tile tokens, sub_steps 64-wide K steps a ring
    stage (at most 128 bytes of a weight row); the producer gets 504 - 2 * consumer_regs registers
    (four consumers: 480 - 4 * consumer_regs, at least 24)."""

    token_tile: int
    stages: int
    group_m: int
    consumer_regs: int = 192
    sub_steps: int = 1
    prepacked: bool = False  # weights in moegemm.prepack's order, decoded into the wgmma's registers
    weight_tile: int = 128  # 256: four consumer warpgroups share each token stage (prepacked, <= 64 tokens)

    block_k = 64
    claim_rounds = 0  # (round-robin throughout)

    @property
    def stage_k(self) -> int:
        return self.block_k * self.sub_steps

    def smem_bytes(self, fmt: Format, out_bytes: int = 2, fused: bool = False) -> int:
        """The ring (bf16 tokens, compressed weights), the decoded-weight operand buffers (two of
        [64, 64] bf16 a warpgroup), and the fused epilogue's conversion of each warpgroup's fp32
        accumulator (of a 128-token half at most) when fused (the plain epilogue stores with
        masks)."""
        stage = int((self.token_tile * 2 + self.weight_tile * weight_bytes(fmt)) * self.stage_k)
        operands = 0 if self.prepacked else 2 * 2 * 64 * self.block_k * 2
        # (a 256-token tile stores its two 128-token halves one after the other)
        epilogue = self.weight_tile // 64 * min(self.token_tile, 128) * 64 * 4 if fused else 0
        # (four consumer warpgroups: ~2 KB more of the compiler's own scratch, read off compiles)
        partitions = 2048 if self.weight_tile == 256 else 0
        return self.stages * (stage + _RING_BARRIERS) + operands + epilogue + partitions + _SCHEDULE

    def check(self, fmt: Format, out_bytes: int = 2, fused: bool = False):
        if fmt.name not in MX_FORMATS:
            raise ValueError(f"config: DecodeConfig runs the block formats {MX_FORMATS}, not {fmt.name}")
        if self.token_tile not in (16, 32, 64, 128, 256):
            raise ValueError(f"config: token_tile must be 16..256 (powers of two): {self}")
        if self.weight_tile == 256:
            if not self.prepacked or self.token_tile > 64 or not 96 <= self.consumer_regs <= 112:
                raise ValueError(f"config: 256-row tiles (four consumer warpgroups) take prepacked weights, up to 64 "
                                 f"tokens and consumer_regs 96..112 (the producer keeps 480 - 4 x that): {self}")
        elif self.weight_tile != 128:
            raise ValueError(f"config: weight_tile 128 or 256: {self}")
        elif self.token_tile == 256 and self.consumer_regs < 240 or not 192 <= self.consumer_regs <= 240:
            raise ValueError(f"config: consumer_regs 192..240, 240 for 256-token tiles (two accumulators): {self}")
        if self.sub_steps not in (1, 2, 4) or self.stage_k * weight_bytes(fmt) > 128:
            raise ValueError(f"config: a stage holds at most 128 bytes of a weight row (sub_steps 1, 2, 4): {self}")
        _check_smem(self, fmt, out_bytes, fused)


@dataclass(frozen=True)
class Mxfp8Config:
    """kernels/sm90/mxfp8.py: swapped tiles of 128 weight rows x token_tile tokens, one 128-wide K
    step (four scale blocks) a stage. Wide tiles (64 or 128 tokens) bring their token scales
    through the ring; a slot's last 128-token tile may take up to tail_tokens more tokens on a
    second accumulator (short_tails: a tail of up to tail_tokens // 2 on one of half the width);
    chunk_walk (narrow tiles): the consumers walk the slots from chunks of 31 loaded at once."""

    token_tile: int
    stages: int
    group_m: int
    consumer_regs: int = 192
    tail_tokens: int = 0
    short_tails: bool = False
    chunk_walk: bool = False
    claim_rounds: int = 2

    block_k = 128
    weight_tile = 128
    stage_k = 128

    @property
    def wide(self) -> bool:
        return self.token_tile > 32

    def swap_store_scratch(self, out_bytes: int) -> int:
        """Shared memory of the wide tiles' plain epilogue, which converts each warpgroup's
        [64, tokens] bf16 output for 16-byte stores (fp32 outputs keep the 2-byte stores that need
        none): Triton does it in pieces through a 4 KB buffer (sm_90 compile: the kernels' shared
        memory grew by 4112 bytes at 64 and 128 tokens), so room for two warpgroups' [64, 32]
        pieces is reserved."""
        return 2 * 64 * 32 * out_bytes

    def smem_bytes(self, fmt: Format, out_bytes: int = 2, fused: bool = False) -> int:
        """The ring (e4m3 tokens and weights; wide tiles: the stage's [4, tokens] fp32 token scales;
        tails: their tokens and scales) and the epilogue's conversions: the fused one converts
        only the activation's [tokens, 32] output on wide tiles (row pairs by shuffles), each
        warpgroup's fp32 accumulator on narrow ones."""
        stage = (self.token_tile + self.weight_tile) * self.stage_k
        if self.wide:
            stage += 4 * 4 * self.token_tile
        if self.tail_tokens:
            stage += self.tail_tokens * self.stage_k + 4 * 4 * self.tail_tokens
        if fused:
            epilogue = 2 * self.token_tile * (32 if self.wide else 64) * 4
        else:
            epilogue = self.swap_store_scratch(out_bytes) if self.wide else 0
        return self.stages * (stage + _RING_BARRIERS) + epilogue + _SCHEDULE

    def check(self, fmt: Format, out_bytes: int = 2, fused: bool = False):
        if fmt.name != "mxfp8":
            raise ValueError(f"config: Mxfp8Config runs mxfp8, not {fmt.name}")
        if self.token_tile not in (16, 32, 64, 128):
            raise ValueError(f"config: mxfp8 promotion tiles hold 16, 32, 64 or 128 tokens: {self}")
        if self.chunk_walk and self.wide:
            raise ValueError(f"config: chunk_walk is for narrow tiles (<= 32 tokens): {self}")
        if self.tail_tokens not in (0, 16, 32) or (self.tail_tokens and self.token_tile != 128):
            raise ValueError(f"config: tail_tokens (0, 16 or 32) is for 128-token tiles: {self}")
        if self.short_tails and self.tail_tokens != 32:
            raise ValueError(f"config: short_tails halve tails of tail_tokens=32: {self}")
        max_regs = 240 if self.wide else 192
        if self.consumer_regs > max_regs:
            raise ValueError(f"config: tiles of {self.token_tile} tokens allow consumer_regs <= {max_regs}: {self}")
        _check_smem(self, fmt, out_bytes, fused)


@dataclass(frozen=True)
class E2m1Config:
    """kernels/sm90/e2m1.py (mxfp4, w4a8 at decode, plain order): swapped tiles of 128 weight rows x 8 or 16
    tokens, 256 K a stage (two token boxes, the weight rows' 128 bytes, the scales); split_k:
    four consumer warpgroups, a pair for each 128-K half of a stage, their two partial sums added
    at the tile's end through shared memory (tiles then dealt round-robin)."""

    token_tile: int
    stages: int
    group_m: int = 1
    consumer_regs: int = 112
    split_k: bool = True
    claim_rounds: int = 2

    block_k = 128
    weight_tile = 128
    stage_k = 256

    def smem_bytes(self, fmt: Format, out_bytes: int = 2, fused: bool = False) -> int:
        """The ring (e4m3 tokens, packed weights, eight K blocks' token scales and the weight
        scales' two atoms), the decoded e4m3 operand buffers (four of [64, 128]), the fused
        epilogue's conversion of each warpgroup's accumulator, split-K's partial sums."""
        stage = int((self.token_tile + self.weight_tile * 0.5) * self.stage_k)
        stage += 8 * 4 * self.token_tile + self.weight_tile * 8
        operands = 2 * 2 * 64 * self.block_k
        consumers = 4 if self.split_k else 2
        epilogue = consumers * self.token_tile * 64 * 4 if fused else 0
        if self.split_k:
            epilogue += 2 * 64 * self.token_tile * 4 + 4 * 8
        return self.stages * (stage + _RING_BARRIERS) + operands + epilogue + _SCHEDULE

    def check(self, fmt: Format, out_bytes: int = 2, fused: bool = False):
        if fmt.name not in ("mxfp4", "w4a8"):
            raise ValueError(f"config: E2m1Config runs mxfp4 and w4a8 (e2m1 weights, e8m0 scales), not {fmt.name}")
        if self.token_tile not in (8, 16):
            raise ValueError(f"config: e2m1 weight tiles hold 8 or 16 tokens: {self}")
        max_regs = 112 if self.split_k else 192
        if self.consumer_regs > max_regs:
            raise ValueError(f"config: consumer_regs <= {max_regs} with split_k={self.split_k}: {self}")
        _check_smem(self, fmt, out_bytes, fused)


MxConfig = DecodeConfig | Mxfp8Config | E2m1Config  # the block formats' three kernels


def with_epilogue_scratch(cfg, fmt: Format):
    """A swapped tile's fused SwiGLU epilogue converts each warpgroup's output through shared
    memory: shorten the ring, if need be, to leave that room (a tail's output is converted after
    the tile's, in the same room). Normal tiles are sized for it by sm90_config(fused=True)."""
    if isinstance(cfg, DenseConfig) and not cfg.swap:
        return cfg
    while cfg.stages > 2 and cfg.smem_bytes(fmt, 2, fused=True) > SM90_SMEM_BYTES:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg


def deepest_ring(cfg, fmt: Format, out_bytes: int = 2, fused: bool = False, max_stages: int = 12):
    """cfg with its ring as deep as shared memory allows (up to max_stages), from its stages up."""
    while (cfg.stages < max_stages
           and replace(cfg, stages=cfg.stages + 1).smem_bytes(fmt, out_bytes, fused) <= SM90_SMEM_BYTES):
        cfg = replace(cfg, stages=cfg.stages + 1)
    return cfg


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
    config = _overrides.get("sm90-mx") or _sm90_mx_config(fmt.name, n, k,
                                                          _regime(_tokens_per_slot(tokens_per_slot), smallest),
                                                          prepacked)
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
        # (docs/perf-notes.md, prepacked weights).
        return DecodeConfig(token_tile=tokens, stages=2, group_m=1, consumer_regs=112, sub_steps=2, prepacked=True,
                            weight_tile=256)
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
