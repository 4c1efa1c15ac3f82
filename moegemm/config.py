"""Kernel configurations: frozen data from a pure function of (format, shape, device).

MOEGEMM_PRINT_CONFIG=1 prints each choice once. Tests may force a choice with
`override_config(cfg)` (per config type).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace

from .formats import FORMATS, Format

__all__ = ["PortableConfig", "Sm90Config", "portable_config", "sm90_config", "sm90_mx_config", "override_config"]


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


@dataclass(frozen=True)
class Sm90Config:
    """Tile shape and pipeline depth of the sm90 Gluon kernel (two consumer warpgroups).

    normal   (default)   128 tokens x block_n weights; warpgroups split the tokens
    split_n              64 tokens x 2*block_n weights; warpgroups split the weights
    swap                 block_n tokens x 128 weights; weights are the wgmma M side (decode)
    """

    block_n: int
    block_k: int
    stages: int
    group_m: int  # token blocks per band of the tile order (L2 reuse)
    swap: bool = False
    split_n: bool = False
    consumer_regs: int = 232
    sub_steps: int = 1  # MX kernel: block_k-wide steps per ring stage (weight rows in wider TMA boxes)
    # fp8 wgmma per 32-wide K block and fp32 promotion (kernels/sm90_mxfp8.py): mxfp8, and the
    # e2m1 weights of mxfp4/w4a8 decoded to e4m3 (two 128-wide token tiles a stage: sub_steps=2)
    fp8_mma: bool = False
    # e2m1 weights on fp8_mma: four consumer warpgroups, a pair for each 128-K half of a stage
    # (rows split as before), their two partial sums added at the tile's end through shared
    # memory: twice the warps to hide each stage's chain of waits (kernels/sm90_mxfp8.py)
    split_k: bool = False
    # Wide mxfp8 fp8_mma tiles: a slot's last token tile also takes up to tail_tokens more
    # tokens, on a second accumulator of the same warpgroups (kernels/sm90_mxfp8.py), instead of
    # a nearly empty tile of its own that streams the weight block again
    tail_tokens: int = 0
    # ... and a tail of up to tail_tokens // 2 tokens runs on an accumulator of half the width
    # (a third K loop in the kernel), not on the full tail's
    short_tails: bool = False
    # The last claim_rounds * programs tiles of a call are claimed from a counter as programs
    # free up, the rest dealt round-robin (kernels/sm90.py, schedule); 0: round-robin throughout
    # (always for split-K). Two rounds measured best of 0/2/4/8/16/all on DeepSeek-V3's mxfp8
    # products (0.99x, 0.986x the time of 0) and gpt-oss's bf16 fused gate/up step (0.992x);
    # fp8_block keeps 0 (_sm90_config). bench/results/schedule-*.json, H100.
    claim_rounds: int = 2
    # Narrow fp8_mma tiles: the consumers walk the slots from chunks of 31 loaded at once
    # (kernels/sm90_mxfp8.py, sm90._slot_chunk) instead of three loads a slot
    chunk_walk: bool = False

    @property
    def stage_k(self) -> int:
        """K elements a ring stage carries (the MX kernel's stage holds sub_steps K steps)."""
        return self.block_k * self.sub_steps

    @property
    def token_tile(self) -> int:
        return self.block_n if self.swap else (64 if self.split_n else 128)

    @property
    def weight_tile(self) -> int:
        return 128 if self.swap else (2 * self.block_n if self.split_n else self.block_n)

    @property
    def wide_promotion(self) -> bool:
        """fp8_mma tiles of 64 or 128 tokens: their token scales travel through the ring
        (kernels/sm90_mxfp8.py)."""
        return self.fp8_mma and self.token_tile > 32

    def swap_store_scratch(self, out_bytes: int) -> int:
        """Shared memory of the wide mxfp8 tiles' plain epilogue, which converts each warpgroup's
        [64, tokens] bf16 output for 16-byte stores (fp32 outputs keep the 2-byte stores that
        need none): Triton does it in pieces through a 4 KB buffer (sm_90 compile: the kernels'
        shared memory grew by 4112 bytes at 64 and 128 tokens), so room for two warpgroups'
        [64, 32] pieces is reserved."""
        return 2 * 64 * 32 * out_bytes

    def epilogue_n(self, promote: bool) -> int:
        """Columns of one accumulator: fp8_block computes a normal 256-wide tile as two halves."""
        return 128 if promote and not self.swap and not self.split_n and self.block_n > 128 else self.block_n

    def fused_scratch(self) -> int:
        """Shared memory of the fused SwiGLU epilogue's layout conversions (kernels/sm90_epilogue.py),
        which runs instead of the plain epilogue and needs none of its buffers. Swapped tiles
        convert each warpgroup's fp32 accumulator [64, tokens] that may run it; the wide mxfp8
        tiles only the activation's [tokens, 32] output (their row pairs meet by shuffles; sm_90
        compile at 128 tokens, two warpgroups, mxfp8 out: 32 KB). Normal tiles only their
        [64, W/2] output, which Triton converts in pieces (sm_90 compile: 8 KB for both
        warpgroups at 64 x 256 and 128 x 256 tiles, bf16 or quantized out): twice that is kept."""
        if self.swap:
            per_token = 32 * 4 if self.wide_promotion else 64 * 4
            return (4 if self.split_k else 2) * self.token_tile * per_token
        return 2 * 8192

    def smem_bytes(self, element_bytes: int, out_bytes: int, weight_bytes: float | None = None,
                   fused: bool = False) -> int:
        """Shared memory of the ring and epilogue; `weight_bytes` per weight element when the
        weights stay compressed in the ring (MX/NV formats: 1 or 1/2), else `element_bytes`.
        `fused`: the kernel runs the fused SwiGLU epilogue (fused_scratch) instead of the plain one."""
        # The MX kernel decodes the weights into two bf16 [64, block_k] buffers per warpgroup;
        # the promotion kernel its e2m1 weights into two e4m3 [64, 128] buffers.
        if weight_bytes is None or (self.fp8_mma and weight_bytes == 1):
            operands = 0
        elif self.fp8_mma:
            operands = 2 * 2 * 64 * self.block_k
        else:
            operands = 2 * 2 * 64 * self.block_k * 2
        weight_bytes = element_bytes if weight_bytes is None else weight_bytes
        stage = int((self.token_tile * element_bytes + self.weight_tile * weight_bytes) * self.stage_k)
        if self.wide_promotion:  # the tokens' fp32 scales of the stage's four K blocks
            stage += 4 * 4 * self.token_tile
        elif self.fp8_mma and weight_bytes == 0.5:  # e2m1 weights: eight K blocks' token scales
            stage += 8 * 4 * self.token_tile + self.weight_tile * 8  # and weight scales (two atoms)
        if self.tail_tokens:  # the tail's tokens and scales
            stage += int(self.tail_tokens * element_bytes * self.stage_k) + 4 * 4 * self.tail_tokens
        if fused:
            epilogue = self.fused_scratch()
        else:
            epilogue = 0 if self.swap else 2 * 64 * self.epilogue_n(element_bytes == 1) * out_bytes
            if self.swap and self.wide_promotion:  # tiles converted for 16-byte stores (sm90._store_swapped)
                epilogue += self.swap_store_scratch(out_bytes)
        if self.split_k:  # the K-half-1 warpgroups' partial sums and their four barriers
            epilogue += 2 * 64 * self.token_tile * 4 + 4 * 8
        # The tile schedule's two words and four barriers, and the word through which the
        # producer's claim reaches its warp (kernels/sm90.py, schedule): ~100 bytes aligned.
        schedule = 128
        return self.stages * stage + operands + epilogue + 2 * 8 * self.stages + schedule

    def check(self, fmt: Format, out_bytes: int = 2, fused: bool = False):
        e2m1_fp8 = self.fp8_mma and fmt.b.element.packed
        if self.split_k and not e2m1_fp8:
            raise ValueError(f"config: split_k is the e2m1 weights' arrangement on fp8_mma: {self}")
        if self.block_n not in ((8, 16) if e2m1_fp8 else (16, 32, 64, 128, 256)) or (self.swap and self.split_n):
            raise ValueError(f"config: block_n must be 16..256 (powers of two; 8 or 16 for e2m1 weights on fp8_mma), "
                             f"swap and split_n exclusive: {self}")
        if self.fp8_mma:
            if fmt.name not in FP8_MMA_FORMATS or not self.swap or self.block_k != 128:
                raise ValueError(f"config: fp8_mma runs {'/'.join(FP8_MMA_FORMATS)} on swapped tiles with block_k=128 "
                                 f"(four scale blocks a token tile): {self}")
            if self.sub_steps != (2 if e2m1_fp8 else 1):
                raise ValueError(f"config: fp8_mma stages hold 128 bytes of a weight row: one token tile with mxfp8, "
                                 f"two with e2m1 weights (sub_steps=2, 8- or 16-token tiles): {self}")
            if self.block_n > 128:
                raise ValueError(f"config: fp8_mma tiles hold <= 128 tokens: {self}")
            if self.chunk_walk and self.wide_promotion:
                raise ValueError(f"config: chunk_walk is for narrow fp8_mma tiles (<= 32 tokens): {self}")
            if self.tail_tokens not in (0, 16, 32) or (self.tail_tokens and (e2m1_fp8 or self.token_tile != 128)):
                raise ValueError(f"config: tail_tokens (0, 16 or 32) is for 128-token mxfp8 fp8_mma tiles: {self}")
            if self.short_tails and self.tail_tokens != 32:
                raise ValueError(f"config: short_tails halve tails of tail_tokens=32: {self}")
            # The kernel's producer keeps 120 registers on narrow tiles, 40 on wide ones: the
            # consumers' share of the 64K-register file is what is left. Split-K has four consumer
            # warpgroups and the producer gets 512 - 4 * consumer_regs (64 at 112 still leaves
            # ptxas room to keep the wgmmas in flight; 104 spilled in the 16-token K loop).
            max_regs = 112 if self.split_k else 240 if self.wide_promotion else 192
            if self.consumer_regs > max_regs:
                raise ValueError(f"config: fp8_mma tiles of {self.token_tile} tokens allow consumer_regs <= "
                                 f"{max_regs}: {self}")
            smem = self.smem_bytes(1, out_bytes, weight_bytes(fmt))
            if smem > SM90_SMEM_BYTES:
                raise ValueError(f"config: {smem} bytes of shared memory > {SM90_SMEM_BYTES}")
            return
        if self.tail_tokens or self.chunk_walk or self.short_tails:
            raise ValueError(f"config: tail_tokens, short_tails and chunk_walk are fp8_mma settings: {self}")
        if fmt.name in MX_FORMATS:
            if not self.swap or self.block_k != 64:
                raise ValueError(f"config: {fmt.name} runs swapped tiles (decoded weights as the wgmma A side) "
                                 f"with block_k=64: {self}")
            if self.sub_steps not in (1, 2, 4) or self.stage_k * weight_bytes(fmt) > 128:
                raise ValueError(f"config: a stage holds at most 128 bytes of a weight row (sub_steps 1, 2, 4): {self}")
            smem = self.smem_bytes(2, out_bytes, weight_bytes(fmt))
            if smem > SM90_SMEM_BYTES:
                raise ValueError(f"config: {smem} bytes of shared memory > {SM90_SMEM_BYTES}")
            return
        if self.sub_steps != 1:
            raise ValueError(f"config: sub_steps is a block-format (MX kernel) setting: {self}")
        fp8 = fmt.name == "fp8_block"
        if fp8 and (self.block_k != 128 or min(self.epilogue_n(True), self.weight_tile) > 128 and not self.swap):
            raise ValueError(f"config: fp8_block promotes per 128x128 block; an accumulator spans <= 128 weights: {self}")
        element = 1 if fp8 else 2
        if self.block_k * element != 128:
            raise ValueError(f"config: block_k rows must be 128 bytes (the TMA swizzle), got block_k={self.block_k}")
        smem = self.smem_bytes(element, out_bytes, fused=fused)
        if smem > SM90_SMEM_BYTES:
            raise ValueError(f"config: {smem} bytes of shared memory > {SM90_SMEM_BYTES}")


SM90_SMEM_BYTES = 232448  # per block on H100/H200 (227 KiB)
MX_FORMATS = ("mxfp8", "mxfp4", "nvfp4", "w4a8")  # the block formats of kernels/sm90_mx.py
FP8_MMA_FORMATS = ("mxfp8", "mxfp4", "w4a8")  # e8m0 scales per 32: one k32 fp8 wgmma a scale block


def with_epilogue_scratch(cfg: Sm90Config, element_bytes: int, out_bytes: int, weight_bytes: float | None = None):
    """A swapped tile's fused SwiGLU epilogue converts each warpgroup's [tokens, 32] output
    through shared memory (Sm90Config.fused_scratch): shorten the ring, if need be, to leave
    that room (a tail's output is converted after the tile's, in the same room). Normal tiles
    are sized for it by their config function (sm90_config, fused)."""
    if not cfg.swap:
        return cfg
    while cfg.stages > 2 and cfg.smem_bytes(element_bytes, out_bytes, weight_bytes, fused=True) > SM90_SMEM_BYTES:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg


def deepest_ring(cfg: Sm90Config, element_bytes: int, out_bytes: int, weight_bytes: float | None = None,
                 max_stages: int = 12, fused: bool = False) -> Sm90Config:
    """cfg with its ring as deep as shared memory allows (up to max_stages), from its stages up."""
    while (cfg.stages < max_stages and replace(cfg, stages=cfg.stages + 1).smem_bytes(
            element_bytes, out_bytes, weight_bytes, fused) <= SM90_SMEM_BYTES):
        cfg = replace(cfg, stages=cfg.stages + 1)
    return cfg


def weight_bytes(fmt: Format) -> float:
    """Bytes a weight element takes in the ring (packed fp4: 1/2)."""
    return fmt.b.element.bits / 8

_overrides: dict[type, object] = {}


@contextlib.contextmanager
def override_config(config):
    """Force a config of this type inside the block (for tests that must cover edge cases)."""
    kind = type(config)
    previous = _overrides.get(kind)
    _overrides[kind] = config
    try:
        yield
    finally:
        if previous is None:
            del _overrides[kind]
        else:
            _overrides[kind] = previous


def _print_choice(kind: str, key: str, config):
    if os.environ.get("MOEGEMM_PRINT_CONFIG", "0") not in ("", "0"):
        print(f"[moegemm] {kind} config {key}: {config}")


def portable_config(fmt: Format, n: int, k: int, device_type: str) -> PortableConfig:
    config = _overrides.get(PortableConfig) or _portable_config(fmt.name, fmt.scale_vec, n, k, device_type)
    config.check(fmt)
    return config


def sm90_config(fmt: Format, n: int, k: int, tokens_per_slot: float, out_bytes: int = 2,
                fused: bool = False) -> Sm90Config:
    """Pure function of (format, N, K, token regime); the regime is M / G, known on the host.
    `fused`: the kernel runs the fused SwiGLU epilogue (Sm90Config.fused_scratch)."""
    config = _overrides.get(Sm90Config) or _sm90_config(fmt.name, n, k, _regime(tokens_per_slot), out_bytes, fused)
    if fused:  # (a forced config's swapped ring may be too deep for the fused scratch)
        config = with_epilogue_scratch(config, 1 if fmt.name == "fp8_block" else 2, out_bytes)
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


@functools.lru_cache(maxsize=None)
def _sm90_config(fmt_name: str, n: int, k: int, regime: int, out_bytes: int, fused: bool) -> Sm90Config:
    fp8 = fmt_name == "fp8_block"
    block_k = 128 if fp8 else 64
    if regime in (16, 32, 64):
        # Few tokens per expert: weights are the 128-row wgmma side, the tokens of a group
        # (one tile of 16/32/64) the narrow side. The run streams the weights, so the ring is
        # as deep as shared memory allows.
        cfg = Sm90Config(block_n=regime, block_k=block_k, stages=2, group_m=1, swap=True)
    elif regime == 192:
        # Small groups: 64-token tiles waste less on ragged group ends than 128-token tiles.
        cfg = Sm90Config(block_n=128, block_k=block_k, stages=2, group_m=4, split_n=True)
    else:
        # 128 x 256 tiles: fp8_block as two 128-wide halves (two fp32 accumulators and one
        # block in flight per warpgroup); the wider tile cuts L2 traffic per flop, which bound
        # the 128 x 128 tile (L2 throughput 87% in Nsight Compute; 976 -> 1218 TFLOP/s at
        # 4 x 8192 x (6144, 7168)). Bands of 4 token blocks measured best of 4/8/16/32
        # (bench/tune_sm90.py, H100, 2026-11-22).
        cfg = Sm90Config(block_n=256 if n >= 1024 else 128, block_k=block_k, stages=2, group_m=4)
    # The ring is as deep as shared memory allows, up to 12 stages, with the fused epilogue's
    # scratch in place of the plain epilogue's buffers when fused (Sm90Config.fused_scratch): on
    # normal tiles one stage more at ~128 tokens a slot (gpt-oss-120b's gate/up at 4096 tokens).
    element = 1 if fp8 else 2
    if fp8:
        # Claimed last rounds did not pay on fp8_block: DeepSeek-V3's gate/up 1.006x slower, its
        # down product 1.39x (2596 against 1866 us), though claiming every tile made that one
        # 0.89x (bench/results/schedule-*.json; see docs/perf-notes.md, seventeenth session).
        cfg = replace(cfg, claim_rounds=0)
    config = deepest_ring(cfg, element, out_bytes, fused=fused)
    _print_choice("sm90", f"fmt={fmt_name} N={n} K={k} regime={regime or 'many'} fused={fused}", config)
    return config


def sm90_mx_config(fmt: Format, n: int, k: int, tokens_per_slot: float) -> Sm90Config:
    """The MX/NV kernel's config: a pure function of (format, N, K, token regime)."""
    # e2m1 weights run 8-token tiles at the fewest tokens (kernels/sm90_mxfp8.py).
    smallest = 8 if fmt.b.element.packed and fmt.name in FP8_MMA_FORMATS else 16
    config = _overrides.get(Sm90Config) or _sm90_mx_config(fmt.name, n, k, _regime(tokens_per_slot, smallest))
    config.check(fmt)
    return config


@functools.lru_cache(maxsize=None)
def _sm90_mx_config(fmt_name: str, n: int, k: int, regime: int) -> Sm90Config:
    if fmt_name == "mxfp8" and regime in (16, 32):
        # Both operands are e4m3: fp8 wgmma straight from the ring, scales promoted per k32 block
        # (kernels/sm90_mxfp8.py), no weight decoding: 1.24-1.37x the decoding kernel at 2 and 16
        # tokens an expert (DeepSeek-V3 shapes, H100). At ~32-48 tokens an expert the decoding
        # kernel's 64-token tiles were faster (1.08-1.57x) than two 32-token promotion tiles.
        # On 32-token tiles (~12-24 tokens an expert: DeepSeek-V3 at 512 tokens) the slot walk
        # from chunks of slots took DeepSeek-V3's down and up products 1.034-1.046x faster; on
        # 16-token tiles it was even at 2 tokens an expert and 1.02-1.03x slower at 1 token; on the
        # e2m1 split-K tiles 1.02x faster at 8 tokens an expert, 1.01-1.11x slower at 1-2; on wide
        # ones 0.99-1.0x (bench/results/slot-walk-chunks-*.json, H100).
        cfg = Sm90Config(block_n=regime, block_k=128, stages=2, group_m=1, swap=True, consumer_regs=192,
                         fp8_mma=True, chunk_walk=regime == 32)
    elif fmt_name == "mxfp8":
        # More tokens an expert: the same fp8 wgmma and promotion on 64-token (regime 64) or
        # 128-token tiles, the token scales through the ring (kernels/sm90_mxfp8.py):
        # 1.10-1.17x the decoding kernel's tiles of the same size (DeepSeek-V3 shapes at 40, 128
        # and 1024 tokens an expert, bench/results/mxfp8-wide-*.json, H100). Bands of 8 token
        # blocks were within 4% of 4 either way.
        # Up to 192 tokens a slot, a slot's last 128-token tile takes a tail of up to 32 more
        # tokens: at ~128 tokens an expert about half the experts had a second tile of a few
        # tokens, which cost a full tile's wgmmas and promotion (tiles of their own for them
        # were 1.3x slower still: the weight block is then streamed twice,
        # bench/results/mxfp8-narrow-tails-*.json). With tails DeepSeek-V3's up and down
        # products at ~128 tokens an expert ran 1.26x and 1.23x faster; at ~1024 tokens an
        # expert 0.90x (an expert's tiles there share weight blocks through L2, and the tail
        # tile lags its band), so not there (bench/results/mxfp8-tail-*.json, H100). The tail's
        # accumulator needs 240 registers a consumer thread (232 spilled in its K loop).
        tokens = 64 if regime == 64 else 128
        tail = 32 if regime == 192 else 0
        # Tails of up to 16 tokens (~40% of DeepSeek-V3's experts at ~128 tokens have 129-144)
        # run on a 16-wide accumulator: their K loop is 803 instructions a stage against the
        # 32-wide tail's 873 and the plain tile's 700 (sm_90 SASS).
        cfg = Sm90Config(block_n=tokens, block_k=128, stages=2, group_m=4, swap=True,
                         consumer_regs=240 if tail else 232, fp8_mma=True, tail_tokens=tail, short_tails=tail == 32)
    elif fmt_name in ("mxfp4", "w4a8") and regime in (8, 16):
        # e2m1 weights at decode: decoded to e4m3 in shared memory (1 instruction an element)
        # and run like mxfp8, 256 K a stage (kernels/sm90_mxfp8.py); mxfp4 tokens are
        # re-encoded as e4m3 by a pre-pass. 1.31-1.39x the decoding kernel at 2 tokens an expert
        # (gpt-oss and DeepSeek-V3 shapes, bench/results/e2m1-promotion-*.json, H100). 8-token
        # tiles up to 4 tokens a slot (regime 8): half the promotion of 16 (4 accumulators a
        # thread and K block), 1.13-1.15x at 1-4 tokens an expert (e2m1-decode8-*.json). Regime 32
        # stays on the decoding kernel: 32-token tiles spilled ~190 values, and two 16-token
        # tiles were 0.96-1.0x its 32-token tile at 16 tokens an expert.
        # Split-K: four consumer warpgroups, one 128-K half of every stage to each pair, 1.02-1.05x
        # the two warpgroups at 2 and 8 tokens an expert (gpt-oss and DeepSeek-V3 shapes,
        # bench/results/e2m1-split-k-*.json, H100).
        cfg = Sm90Config(block_n=regime, block_k=128, stages=2, group_m=1, swap=True, consumer_regs=112,
                         sub_steps=2, fp8_mma=True, split_k=True)
    else:
        cfg = None
    if cfg is not None:
        w_bytes = weight_bytes(FORMATS[fmt_name])
        cfg = deepest_ring(cfg, 1, 2, w_bytes)
        _print_choice("sm90-mx", f"fmt={fmt_name} N={n} K={k} regime={regime}", cfg)
        return cfg
    # Weights are always the 128-row wgmma side (decoded into shared memory, the A operand); the
    # tokens (bf16) the N side: one group's tokens at decode, else 128. A 256-token tile would
    # amortize the decoding over more tokens, but its accumulator (128 registers) spilled over
    # 100 registers in every format (sm_90 compile: ptxas allocates within the kernel's 168).
    tokens = regime if regime in (16, 32, 64) else 128
    w_bytes = weight_bytes(FORMATS[fmt_name])
    # A ring stage carries two 64-wide K steps. With one step (32 or 64 bytes of a weight row)
    # the run took ~0.7 us per stage whatever the bytes, fp4 or fp8, 16 or 128 tokens; two steps
    # were 1.2-1.3x faster in every format and regime, four steps of fp4 no better than two
    # (bench/results/mx-stages-*.json, H100).
    # 128-token tiles keep one step a stage (the ring is twice as deep). Their wrong rows with
    # two steps were the accumulator read before the last wgmma retired (kernels/sm90_mx.py,
    # _upcast_chain, fixed); two steps there have not been timed since.
    sub_steps = 2 if tokens < 128 else 1
    cfg = Sm90Config(block_n=tokens, block_k=64, stages=2, group_m=1 if regime in (16, 32, 64) else 4, swap=True,
                     consumer_regs=192, sub_steps=sub_steps)
    cfg = deepest_ring(cfg, 2, 2, w_bytes)
    _print_choice("sm90-mx", f"fmt={fmt_name} N={n} K={k} regime={regime or 'many'}", cfg)
    return cfg


@functools.lru_cache(maxsize=None)
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
