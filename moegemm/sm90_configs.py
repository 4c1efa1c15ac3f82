"""The sm90 kernels' configurations as frozen data: one class per kernel of kernels/sm90/
(DenseConfig, DecodeConfig, Mxfp8Config, E2m1Config) with its legality rules (`check`) and its
shared-memory budget (`smem_bytes`), and the ring depths those budgets allow. Which config a
shape gets is chosen in config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .formats import Format

__all__ = [
    "DecodeConfig",
    "DenseConfig",
    "E2m1Config",
    "Mxfp8Config",
]


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
    scale_ring (fp8_block, normal tiles): the producer stages each K block's token and weight
    scales in the ring beside its operands (kernels/sm90/stage_scales.py), and the K loop reads them from
    shared memory (dense._promote_staged); else the consumers load them from global memory.
    """

    block_n: int
    block_k: int
    stages: int
    group_m: int  # token blocks per band of the tile order (L2 reuse)
    swap: bool = False
    split_n: bool = False
    consumer_regs: int = 232
    claim_rounds: int = 2
    scale_ring: bool = False

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
        if self.scale_ring:  # fp32 scales of the stage's tokens and of up to 2 weight blocks
            stage += (self.token_tile + 2) * 4
        return self.stages * (stage + _RING_BARRIERS) + epilogue + _SCHEDULE

    def check(self, fmt: Format, out_bytes: int = 2, fused: bool = False):
        if fmt.name not in ("bf16", "fp8_block"):
            raise ValueError(f"config: DenseConfig runs bf16 and fp8_block, not {fmt.name}")
        if self.block_n not in (16, 32, 64, 128, 256) or (self.swap and self.split_n):
            raise ValueError(f"config: block_n must be 16..256 (powers of two), swap and split_n exclusive: {self}")
        fp8 = fmt.name == "fp8_block"
        if fp8 and (self.block_k != 128 or min(self.epilogue_n(True), self.weight_tile) > 128 and not self.swap):
            raise ValueError(f"config: fp8_block promotes per 128x128 block; an accumulator spans <= 128 weights: {self}")
        if self.scale_ring and (not fp8 or self.swap or self.split_n):
            raise ValueError(f"config: scale_ring stages fp8_block scales of normal tiles (not swap or split_n): {self}")
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
    # Prepacked e2m1 on 256-row tiles with swizzled scales: the scales come through the ring (the
    # producer's TMA copy of the tile's atoms) and e8m0's 2^126 is folded into them; plain scales,
    # or False, keep the loop that loads them a step ahead (kernels/sm90/decode.py, _staged_chain).
    staged_scales: bool = False
    # 128: two consumer warpgroups on a 256-row tile, each with two 64-row accumulators (staged
    # scales only; consumer_regs 192..240), an iteration's fixed cost spread over twice the rows.
    consumer_rows: int = 64

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
        if self.staged_scales and fmt.b.element.packed:  # (a byte a K block of a weight row, a stage)
            stage += self.weight_tile * self.stage_k // fmt.scale_vec
        # (a 256-token tile stores its two 128-token halves one after the other)
        epilogue = self.weight_tile // 64 * min(self.token_tile, 128) * 64 * 4 if fused else 0
        # (four consumer warpgroups: ~2 KB more of the compiler's own scratch, read off compiles)
        partitions = 2048 if self.weight_tile == 256 else 0
        return self.stages * (stage + _RING_BARRIERS) + operands + epilogue + partitions + _SCHEDULE

    def step_ahead(self, fmt: Format, fused: bool = False) -> DecodeConfig:
        """This config with the weight scales loaded by the consumers a step ahead, where the
        scales cannot be staged (plain ones, or e4m3 weights): four consumer warpgroups of 64 rows
        on 256-row tiles, the ring as deep as it then fits."""
        if not self.staged_scales:
            return self
        wide = dict(consumer_regs=112) if self.consumer_rows == 128 else {}
        return deepest_ring(replace(self, staged_scales=False, consumer_rows=64, stages=2, **wide), fmt, fused=fused)

    def check(self, fmt: Format, out_bytes: int = 2, fused: bool = False):
        if fmt.name not in MX_FORMATS:
            raise ValueError(f"config: DecodeConfig runs the block formats {MX_FORMATS}, not {fmt.name}")
        if self.token_tile not in (16, 32, 64, 128, 256):
            raise ValueError(f"config: token_tile must be 16..256 (powers of two): {self}")
        if self.consumer_rows not in (64, 128) or self.consumer_rows == 128 and not (
                self.staged_scales and self.weight_tile == 256 and 192 <= self.consumer_regs <= 240):
            raise ValueError(f"config: consumer_rows 64, or 128 with staged_scales on 256-row tiles and consumer_regs "
                             f"192..240: {self}")
        if self.weight_tile == 256 and self.consumer_rows == 128:
            if self.token_tile > 64:
                raise ValueError(f"config: 256-row tiles take up to 64 tokens: {self}")
        elif self.weight_tile == 256:
            if not self.prepacked or self.token_tile > 64 or not 96 <= self.consumer_regs <= 112:
                raise ValueError(f"config: 256-row tiles (four consumer warpgroups) take prepacked weights, up to 64 "
                                 f"tokens and consumer_regs 96..112 (the producer keeps 480 - 4 x that): {self}")
        elif self.weight_tile != 128:
            raise ValueError(f"config: weight_tile 128 or 256: {self}")
        elif self.token_tile == 256 and self.consumer_regs < 240 or not 192 <= self.consumer_regs <= 240:
            raise ValueError(f"config: consumer_regs 192..240, 240 for 256-token tiles (two accumulators): {self}")
        if self.staged_scales and not (self.prepacked and self.weight_tile == 256 and self.sub_steps == 2):
            raise ValueError(f"config: staged_scales are for prepacked 256-row tiles of sub_steps 2: {self}")
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
