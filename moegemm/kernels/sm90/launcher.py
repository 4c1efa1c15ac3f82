"""The one launch entry of the sm90 family. `plan` makes, once per problem, what every launch of
it needs that depends only on its shapes (KernelPlan: the kernel and its config, the grid, the
token pre-pass, the launch key and constexprs); `launch(plan, args)` then makes the TMA
descriptors of the call's tensors and launches. Nothing here reads a device value: the grid is
min(SMs, an upper bound of the tiles), and every shape comes from the problem.

    format                          kernel                 config (moegemm/config.py)
    bf16, fp8_block                 dense.dense_kernel     DenseConfig     (sm90_config)
    mxfp8                           mxfp8.mxfp8_kernel     Mxfp8Config     (sm90_mx_config)
    mxfp4, w4a8 at decode, plain    e2m1.e2m1_kernel       E2m1Config      (sm90_mx_config)
    mxfp4, nvfp4, w4a8 otherwise    decode.decode_kernel   DecodeConfig    (sm90_mx_config)
    and the weight-only formats     (prepacked weights: DecodeConfig.prepacked, PREPACKED)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl

from ...config import sm90_config, sm90_mx_config
from ...problem import GroupedProblem
from ...sm90_configs import MX_FORMATS, DecodeConfig, E2m1Config, Mxfp8Config, weight_bytes
from ...token_forms import ACC_ORDER_BLOCK, KernelTokens
from ..compiled_launch import Tma, site
from ..compiled_launch import launch as launch_kernel
from ..tokens import TokenPass, plan_tokens
from .decode import decode_kernel
from .dense import dense_kernel
from .e2m1 import E2M1_WEIGHT_EXP, e2m1_kernel
from .mxfp8 import mxfp8_kernel
from .pipeline import WG_ROWS


@dataclass(frozen=True)
class EpilogueSpec:
    """The fused SwiGLU epilogue (swiglu.py): `out` (the kernel's output tensor) gets
    act(h = acc * expert_scales[e] + bias[e]) as bf16 or quantized; `out_scale` its scales
    (or `out` again when unscaled) in the plain or per-group padded swizzled layout (the caller
    zeroes it); `a_scale_offsets` the slots' padded scale rows (swizzled). `act`, `out_code`:
    swiglu.ACT_* and swiglu.OUT_* codes; `vec`: elements a scale; `dequant`: store the quantized
    values decoded, bf16, without scales (the bf16 token form of the next product)."""

    out_scale: torch.Tensor
    bias: torch.Tensor | None
    global_scale: torch.Tensor | None
    a_scale_offsets: torch.Tensor | None
    num_scale_rows: int
    num_out_kb: int
    out_kb4: int
    alpha: float
    limit: float
    act: int
    out_code: int
    out_swizzled: bool
    vec: int
    dequant: bool = False

    def launch_key(self) -> tuple:
        """What of this epilogue the compiled kernel depends on (kernels/compiled_launch.py): every field but
        the tensors' addresses and the two floats."""
        return (self.num_scale_rows, self.num_out_kb, self.out_kb4, self.act, self.out_code, self.out_swizzled,
                self.vec, self.dequant, self.bias is None, self.global_scale is None, self.a_scale_offsets is None)

    def kernel_args(self, dummy: torch.Tensor) -> tuple[tuple, tuple]:
        """The kernels' (epi, EPI) arguments, in the order swiglu.Swiglu.create reads them."""
        pick = lambda t: t if t is not None else dummy
        epi = (self.out_scale, pick(self.bias), pick(self.global_scale), pick(self.a_scale_offsets),
               self.num_scale_rows, self.num_out_kb, self.out_kb4, self.alpha, self.limit)
        consts = (self.act, self.out_code, self.out_swizzled, self.bias is not None, self.vec, self.dequant)
        return epi, consts


def plain_epilogue_consts() -> tuple:
    """EPI of the plain epilogue: ACT = 0."""
    return 0, 0, False, False, 32, False


def plain_epilogue_args(dummy: torch.Tensor) -> tuple[tuple, tuple]:
    """(epi, EPI) of the plain epilogue: ACT = 0, placeholders."""
    return (dummy, dummy, dummy, dummy, 0, 0, 0, 1.0, 1.0), plain_epilogue_consts()


class LaunchArgs(NamedTuple):
    """The tensors of one grouped matmul on the sm90 family, into `out` ([M, N], or the fused
    epilogue's output when `epilogue` is given). `tokens`: A already in the form the kernel reads
    (token_forms.py, written by the layer's gather or activation kernel): no pre-pass, and a /
    a_scales are not read. Scales and offsets as the contract names them (docs/contract.md). (A
    NamedTuple: made on every launch, and a frozen dataclass costs several times as much to make.)"""

    a: torch.Tensor | None
    b: torch.Tensor
    a_scales: torch.Tensor | None
    b_scales: torch.Tensor | None
    a_offsets: torch.Tensor
    expert_ids: torch.Tensor
    out: torch.Tensor
    a_scale_offsets: torch.Tensor | None = None
    expert_scales: torch.Tensor | None = None
    row_scales: torch.Tensor | None = None
    epilogue: EpilogueSpec | None = None
    tokens: KernelTokens | None = None
    fresh_out: bool = False  # out is uninitialized: the pre-pass or the kernel (FILL) zeroes its free rows


def supports(p: GroupedProblem) -> bool:
    """Shapes the kernels take: 16-byte aligned rows of A, B and C for TMA (bf16, fp8_block; N-major
    bf16 weights: rows of N); for the block formats K % 32 == 0 (16-byte rows of packed weights)
    and K > 0 (K = 0 streams nothing; the portable kernel writes the zeros)."""
    if p.fmt.name in MX_FORMATS:
        return p.k % 32 == 0 and p.k > 0
    if p.fmt.name not in ("bf16", "fp8_block"):
        return False
    elem = 2 if p.fmt.name == "bf16" else 1
    out_elem = 2 if p.out_dtype == torch.bfloat16 else 4
    return (p.k * elem) % 16 == 0 and (p.n * out_elem) % 16 == 0 and (not p.b_n_major or (p.n * elem) % 16 == 0)


def fused_supports(p: GroupedProblem) -> bool:
    """Problems the fused SwiGLU epilogue takes: bf16 or a block format in, N % 128 == 0."""
    return supports(p) and p.fmt.name != "fp8_block" and p.n % 128 == 0


class KernelPlan:
    """What every launch of one problem needs that depends only on its shapes (`plan`), and
    `run`, its launch of a call's tensors (LaunchArgs -> the output), made once from them by
    cfg's kernel's _<kernel>_launch: the TMA boxes, the scalar arguments, the launch site."""

    __slots__ = ("problem", "cfg", "num_programs", "dynamic", "tokens", "fills", "key", "kwargs", "run")

    def __init__(self, problem: GroupedProblem, cfg, launches: Callable, num_programs: int, dynamic: bool,
                 tokens: TokenPass | None, key: tuple, kwargs: dict):
        self.problem = problem
        self.cfg = cfg  # its config (moegemm/config.py)
        self.num_programs = num_programs
        self.dynamic = dynamic  # a tile counter claims the last rounds' tiles (tile_counter)
        self.tokens = tokens  # the pre-pass of A (None: the kernel reads A as given, or in a token form)
        # its kernel zeroes a fresh output's rows no valid slot owns (FILL, free_rows.py): the dense
        # and the decoding kernel, where no pre-pass runs before them (the weight-only formats'
        # pass of their bf16 tokens launches nothing)
        self.fills = (tokens is None or tokens.site is None) and launches in (_dense_launch, _decode_launch)
        self.key = key  # the launch key but the epilogue's (kernels/compiled_launch.py)
        self.kwargs = kwargs  # the constexprs and launch options but EPI, the epilogue's
        self.run: Callable[[LaunchArgs], torch.Tensor] = launches(self)


def _config(p: GroupedProblem, fused: bool, out_bytes: int):
    """The problem's kernel config (moegemm/config.py)."""
    if p.fmt.name in MX_FORMATS:
        return sm90_mx_config(p.fmt, p.n, p.k, p.m / p.num_groups, fused=fused, prepacked=p.prepacked)
    return sm90_config(p.fmt, p.n, p.k, p.m / p.num_groups, out_bytes, fused=fused)


def plan(p: GroupedProblem, device: torch.device, *, fused: bool, out_bytes: int, expert_scales: bool,
         row_scales: bool, tokens: bool, scale_blocks: int) -> KernelPlan | None:
    """The launch of problem p (the caller checked `supports`) on `device`, None where it launches
    nothing (no group, no row or no column). fused: with the SwiGLU epilogue, whose output has
    elements of out_bytes; expert_scales, row_scales: whether the calls give them; tokens:
    whether A comes in its kernel's token form (no pre-pass); scale_blocks: the first dimension
    of A's scales (128-row blocks where swizzled)."""
    if p.num_groups == 0 or p.m == 0 or p.n == 0:
        return None
    cfg = _config(p, fused, out_bytes if p.fmt.name not in MX_FORMATS else 2)
    if isinstance(cfg, DecodeConfig) and not staged_scales(p, cfg):
        cfg = cfg.step_ahead(p.fmt, fused)
    num_programs, upper_tiles = _grid(p, cfg, device)
    dynamic = not isinstance(cfg, DecodeConfig) and _dynamic(cfg, upper_tiles, num_programs)
    token_pass = None if tokens or p.fmt.name not in MX_FORMATS else _token_pass(p, cfg, device, scale_blocks)
    key = (p.key, cfg, not expert_scales, not row_scales, not tokens)
    common = dict(EPI=plain_epilogue_consts(), STAGES=cfg.stages, GROUP_M=cfg.group_m, HAS_EXPERT_SCALES=expert_scales,
                  HAS_ROW_SCALES=row_scales, CONSUMER_REGS=cfg.consumer_regs)
    swizzled = p.scale_layout.swizzled
    if isinstance(cfg, DecodeConfig):
        return KernelPlan(p, cfg, _decode_launch, num_programs, False, token_pass, key, dict(
            common, VEC=p.fmt.scale_vec, NV_SCALE=p.fmt.b.scale == "e4m3", SWIZZLED=swizzled,
            PREPACKED=cfg.prepacked, CONSUMER_ROWS=cfg.consumer_rows, num_warps=4))
    key = (*key, not dynamic)
    if isinstance(cfg, Mxfp8Config):
        return KernelPlan(p, cfg, _mxfp8_launch, num_programs, dynamic, token_pass, key, dict(
            common, SWIZZLED=swizzled, DYNAMIC=dynamic, CHUNK_WALK=cfg.chunk_walk, SHORT_TAILS=cfg.short_tails,
            num_warps=4))
    if isinstance(cfg, E2m1Config):
        acc_factor = 1.0 if p.fmt.a.element.packed else float(2**E2M1_WEIGHT_EXP)  # w4a8 (see E2M1_WEIGHT_EXP)
        return KernelPlan(p, cfg, _e2m1_launch, num_programs, dynamic, token_pass, key, dict(
            common, SWIZZLED=swizzled, ACC_FACTOR=acc_factor, SPLIT_K=cfg.split_k, DYNAMIC=dynamic, num_warps=4))
    if p.fmt.name in MX_FORMATS:
        raise TypeError(f"config: no sm90 kernel runs {type(cfg).__name__}")
    return KernelPlan(p, cfg, _dense_launch, num_programs, dynamic, None, key, dict(
        common, SWAP=cfg.swap, PROMOTE=p.fmt.name == "fp8_block", DYNAMIC=dynamic, SCALE_RING=cfg.scale_ring,
        num_warps=4))


def _token_pass(p: GroupedProblem, cfg, device: torch.device, scale_blocks: int) -> TokenPass:
    """The pre-pass that brings A into the form cfg's kernel reads: bf16 tokens for the decoding
    kernel; for the promotion kernels the tokens' fp32 scales (e2m1 tokens also re-encoded as
    e4m3 times 2^6, w4a8's reordered to the decoded weights' K order). The e2m1 and the wide
    mxfp8 tiles take their scales K-block-major through the ring."""
    if isinstance(cfg, DecodeConfig):
        return plan_tokens(p, "dequantize", device, scale_blocks)
    fp4_weights = isinstance(cfg, E2m1Config)
    staged = fp4_weights or cfg.wide
    if p.fmt.a.element.packed:  # mxfp4 tokens: every e2m1 value times 2^6 is an e4m3 value (one launch)
        return plan_tokens(p, "e2m1", device, scale_blocks, pad_stages=not staged, kb_major=staged,
                           stage_blocks=cfg.stage_k // 32, exponent=E2M1_WEIGHT_EXP, even_odd=True)
    return plan_tokens(p, "row scales", device, scale_blocks, pad_stages=not staged, kb_major=staged,
                       stage_blocks=cfg.stage_k // 32,
                       column_block=4 if fp4_weights or not staged else ACC_ORDER_BLOCK,
                       even_odd=fp4_weights)  # w4a8's tokens meet the decoded weights


def launch(kernel: KernelPlan | None, args: LaunchArgs) -> torch.Tensor:
    """Run a planned problem on the call's tensors (module docstring)."""
    if args.fresh_out and (args.epilogue is not None or not zeroes_fresh_out(kernel)
                           or (args.tokens is not None and not kernel.fills)):
        raise ValueError("fresh_out: this launch zeroes no rows of out outside valid slots (no token pre-pass that "
                         "does, nor a kernel that does); pass a zeroed out")
    return args.out if kernel is None else kernel.run(args)


def zeroes_fresh_out(kernel: KernelPlan | None) -> bool:
    """Whether a launch of `kernel` may take an uninitialized [M, N] out (LaunchArgs.fresh_out):
    its token pre-pass runs first and zeroes the rows no valid slot owns (kernels/tokens.py), or,
    with no pre-pass, the kernel zeroes them after its tiles (KernelPlan.fills)."""
    return kernel is not None and (kernel.fills or (kernel.tokens is not None and kernel.tokens.fill is not None))


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32,
               torch.uint8: gl.uint8}


@functools.cache
def _layout(block: tuple, dtype):
    """Shared layout of a TMA block (cached: building it costs ~15 us of host time per call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


@functools.cache
def _unswizzled_32bit_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


class _Box:
    """A TMA box of a plan's launches: its block, and the shared layout of the dtype it was last
    made for (one tuple, replaced whole: threads may share a plan)."""

    __slots__ = ("block", "last")

    def __init__(self, *block: int):
        self.block, self.last = block, (None, None)

    def of(self, tensor: torch.Tensor, shape: tuple | None = None, strides: tuple | None = None) -> Tma:
        """The operand `tensor` (viewed as shape, strides where given: Tma) read in this box."""
        dtype, layout = self.last
        if tensor.dtype is not dtype:
            dtype, layout = tensor.dtype, _layout(self.block, tensor.dtype)
            self.last = dtype, layout
        return Tma(tensor, self.block, layout, shape, strides)


def _rows(rows: int, columns: int) -> tuple[tuple, tuple]:
    """(shape, strides) of a contiguous tensor as [rows, columns] (its reshape's: for a contiguous
    tensor the strides do not depend on those of its dimensions of size 1)."""
    return (rows, columns), (columns, 1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t as uint8 (1-byte scales: e8m0, e4m3 or their bytes already)."""
    return t if t.dtype is torch.uint8 else t.view(torch.uint8)


def _descriptor(tensor: torch.Tensor, block: tuple) -> Tma:
    return Tma(tensor, block, _layout(tuple(block), tensor.dtype))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=64)
def _placeholder_descriptor(n: int, block_n: int, device: torch.device) -> Tma:
    """A [1, n] bf16 C descriptor of a kernel that never stores through it (made once)."""
    return _descriptor(torch.empty(1, n, dtype=torch.bfloat16, device=device), (WG_ROWS.value, block_n))


def _grid(p: GroupedProblem, cfg, device: torch.device) -> tuple[int, int]:
    """(programs, an upper bound of the tiles): every slot may end in a partial token tile."""
    upper_tiles = (math.ceil(p.m / cfg.token_tile) + p.num_groups) * math.ceil(p.n / cfg.weight_tile)
    return min(_sm_count(device), upper_tiles), upper_tiles


def _dynamic(cfg, upper_tiles: int, num_programs: int) -> bool:
    """Whether a launch's programs claim the last rounds' tiles from a tile counter: where they
    may get more than one tile and the config claims rounds (pipeline.py, schedule). Else
    round-robin throughout (always for split-K)."""
    return upper_tiles > num_programs and cfg.claim_rounds > 0 and not (isinstance(cfg, E2m1Config) and cfg.split_k)


def _tile_counter(device: torch.device) -> torch.Tensor:
    """The tile counter of a dynamic launch: a zeroed int32 of this call (a fill in its stream; no
    host read)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


class _Launches:
    """A plan's launches of its kernel under `key`: with the plain epilogue through the key's
    site, with the fused epilogue (the call's EpilogueSpec) by the key and the epilogue's.
    With kernel.fills (the dense and the decoding kernel, no pre-pass), a fresh output's launch is the
    kernel's FILL variant, which zeroes the rows no valid slot owns (free_rows.py)."""

    __slots__ = ("fn", "key", "kwargs", "grid", "plain", "filling", "filling_kwargs")

    def __init__(self, fn, kernel: KernelPlan, key: tuple):
        self.fn, self.key, self.kwargs, self.grid = fn, key, kernel.kwargs, (kernel.num_programs, )
        self.plain = site(fn, key)
        self.filling = site(fn, (*key, "fill")) if kernel.fills else None
        self.filling_kwargs = dict(kernel.kwargs, FILL=True)

    def launch(self, args: LaunchArgs, positional: tuple) -> torch.Tensor:
        """fn(*positional, epi) of the call's epilogue; returns args.out."""
        dummy = args.a_offsets
        if args.epilogue is None:  # (plain_epilogue_args')
            positional = (*positional, (dummy, dummy, dummy, dummy, 0, 0, 0, 1.0, 1.0))
            if args.fresh_out and self.filling is not None:
                self.filling.launch(self.grid, positional, self.filling_kwargs)
            else:
                self.plain.launch(self.grid, positional, self.kwargs)
        else:
            epi, consts = args.epilogue.kernel_args(dummy)
            launch_kernel(self.fn, (*self.key, args.epilogue.launch_key()), self.grid, (*positional, epi),
                          dict(self.kwargs, EPI=consts))
        return args.out


def _or_dummy(tensor: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    return tensor if tensor is not None else dummy


def _weight_view(p: GroupedProblem) -> tuple[tuple, tuple]:
    """(shape, strides) of B as the dense kernel's weight boxes read it: [E*N, K], or for N-major
    bf16 weights (the transpose of a contiguous [E, K, N]) that [E, K, N] tensor, read in place in
    boxes of [1, block_k, weight_tile]: the 3-D box zero-fills K past an expert's end instead of
    reading the next expert's rows (the kernel tells the two by the box's rank). (The strides TMA
    needs: a dimension of size 1 may carry any stride in b.)"""
    if not p.b_n_major:
        return _rows(p.num_experts * p.n, p.k)
    return (p.num_experts, p.k, p.n), (p.k * p.n, p.n, 1)


def _dense_launch(kernel: KernelPlan) -> Callable[[LaunchArgs], torch.Tensor]:
    p, cfg = kernel.problem, kernel.cfg
    promote, dynamic = p.fmt.name == "fp8_block", kernel.dynamic
    a_box, c_box = _Box(cfg.token_tile, cfg.block_k), _Box(WG_ROWS.value, cfg.epilogue_n(promote))
    b_box = _Box(1, cfg.block_k, cfg.weight_tile) if p.b_n_major else _Box(cfg.weight_tile, cfg.block_k)
    weight_view = _weight_view(p)
    launches = _Launches(dense_kernel, kernel, kernel.key)
    scalars = (cfg.claim_rounds, p.m, p.n, p.k, p.num_experts, p.num_groups, p.num_k_scales if promote else 0)

    def run(args: LaunchArgs) -> torch.Tensor:
        out, dummy = args.out, args.a_offsets
        if args.epilogue is None:
            c_desc = c_box.of(out)
        else:  # the fused epilogue stores with masks: its TMA descriptor only has to exist
            c_desc = _placeholder_descriptor(p.n, cfg.epilogue_n(promote), out.device)
        return launches.launch(args, (
            a_box.of(args.a), b_box.of(args.b, *weight_view), c_desc, out,
            args.a_scales if promote else dummy, args.b_scales if promote else dummy, dummy, args.expert_ids,
            _or_dummy(args.expert_scales, dummy), _or_dummy(args.row_scales, dummy),
            _tile_counter(out.device) if dynamic else dummy, *scalars))

    return run


def _tokens(kernel: KernelPlan, args: LaunchArgs) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(token scales, tokens) as the kernel reads them: the layer's kernels' (args.tokens), else
    the planned pre-pass's."""
    if args.tokens is not None:
        return args.tokens.scales, args.tokens.data
    return kernel.tokens.run(args.a, args.a_scales, args.a_offsets, args.expert_ids, args.a_scale_offsets,
                             args.out if args.fresh_out and not kernel.fills else None)


def _decode_launch(kernel: KernelPlan) -> Callable[[LaunchArgs], torch.Tensor]:
    p, cfg = kernel.problem, kernel.cfg
    staged = staged_scales(p, cfg)
    t_box = _Box(cfg.token_tile, cfg.block_k)
    w_box = _Box(cfg.weight_tile, int(cfg.stage_k * weight_bytes(p.fmt)))
    ws_block = [cfg.stage_k // p.fmt.scale_vec // 4 * 32, 4]  # a stage's atoms of each 128-row block, [32, 4] words
    launches = _Launches(decode_kernel, kernel, kernel.key)
    weight_view = _rows(p.num_experts * p.n, p.fmt.b.stored_k(p.k))  # (packed e2m1: uint8 already)
    scalars = (p.m, p.n, p.k, p.num_experts, p.num_groups, p.num_k_scales, math.ceil(p.num_k_scales / 4))

    def run(args: LaunchArgs) -> torch.Tensor:
        _, decoded = _tokens(kernel, args)
        weight_scales = _bytes(args.b_scales)
        ws_desc = None
        if staged:  # (the bytes as [rows, 4] 32-bit words)
            ws_desc = Tma(weight_scales, ws_block, _unswizzled_32bit_layout(), *_rows(weight_scales.numel() // 16, 4),
                          torch.int32)
        dummy = args.a_offsets
        return launches.launch(args, (
            t_box.of(decoded), w_box.of(args.b, *weight_view), ws_desc, args.out,
            weight_scales, dummy, args.expert_ids, _or_dummy(args.expert_scales, dummy),
            _or_dummy(args.row_scales, dummy), *scalars))

    return run


def staged_scales(p: GroupedProblem, cfg: DecodeConfig) -> bool:
    """Whether the decoding kernel takes the weight scales through the ring (DecodeConfig.staged_scales;
    the producer copies the swizzled layout's atoms: plain scales are loaded by the consumers)."""
    return cfg.staged_scales and p.scale_layout.swizzled and p.fmt.b.element.packed


def _token_scales_block(cfg, tokens: int) -> list:
    """The box of the K-block-major token scales a stage: [K blocks of a stage, tokens]."""
    return [cfg.stage_k // 32, tokens]


def _mxfp8_launch(kernel: KernelPlan) -> Callable[[LaunchArgs], torch.Tensor]:
    p, cfg = kernel.problem, kernel.cfg
    swizzled, dynamic = p.scale_layout.swizzled, kernel.dynamic
    t_box, w_box = _Box(cfg.token_tile, cfg.block_k), _Box(cfg.weight_tile, cfg.block_k)
    tail_box = _Box(cfg.tail_tokens, cfg.block_k) if cfg.tail_tokens else None
    s_block, tail_s_block = _token_scales_block(cfg, cfg.token_tile), _token_scales_block(cfg, cfg.tail_tokens)
    words_layout = _unswizzled_32bit_layout()
    weight_view = _rows(p.num_experts * p.n, p.k)
    scalars = (cfg.claim_rounds, p.m, p.n, p.k, p.num_experts, p.num_groups, p.num_k_scales,
               math.ceil(p.num_k_scales / 4))
    by_scales = {}  # the token scales' shape (part of the launch key) -> its launches

    def run(args: LaunchArgs) -> torch.Tensor:
        token_scales, a = _tokens(kernel, args)
        shape = token_scales.shape
        launches = by_scales.get(shape)
        if launches is None:
            launches = by_scales.setdefault(shape, _Launches(mxfp8_kernel, kernel, (*kernel.key, tuple(shape))))
        out, dummy = args.out, args.a_offsets
        s_desc = Tma(token_scales, s_block, words_layout) if cfg.wide else None
        tail_desc = tail_s_desc = None
        if tail_box is not None:  # a slot's last tile: up to tail_tokens more tokens and their scales a stage
            tail_desc = tail_box.of(a)
            tail_s_desc = Tma(token_scales, tail_s_block, words_layout)
        return launches.launch(args, (
            t_box.of(a), w_box.of(args.b, *weight_view), s_desc, tail_desc, tail_s_desc, out,
            token_scales, args.b_scales.view(torch.int32) if swizzled else _bytes(args.b_scales), dummy,
            args.expert_ids,
            _or_dummy(args.expert_scales, dummy), _or_dummy(args.row_scales, dummy),
            _tile_counter(out.device) if dynamic else dummy, *scalars, 0 if s_desc is not None else shape[1]))

    return run


def _e2m1_launch(kernel: KernelPlan) -> Callable[[LaunchArgs], torch.Tensor]:
    p, cfg = kernel.problem, kernel.cfg
    swizzled, dynamic = p.scale_layout.swizzled, kernel.dynamic
    t_box, w_box = _Box(cfg.token_tile, cfg.block_k), _Box(cfg.weight_tile, cfg.block_k)
    half_box = None
    if cfg.split_k and 0 < p.n % cfg.weight_tile <= cfg.weight_tile // 2:  # (gpt-oss down: 2880 = 22.5 x 128)
        half_box = _Box(cfg.weight_tile // 2, cfg.block_k)
    ws_block = [cfg.stage_k // 128 * 32, 4]  # the stage's two atoms of the tile's 128 rows, [32, 4] words each
    s_block, words_layout = _token_scales_block(cfg, cfg.token_tile), _unswizzled_32bit_layout()
    weight_view = _rows(p.num_experts * p.n, p.k // 2)  # (packed e2m1: uint8 already)
    launches = _Launches(e2m1_kernel, kernel, kernel.key)
    scalars = (cfg.claim_rounds, p.m, p.n, p.k, p.num_experts, p.num_groups, p.num_k_scales,
               math.ceil(p.num_k_scales / 4))

    def run(args: LaunchArgs) -> torch.Tensor:
        token_scales, a = _tokens(kernel, args)
        out, dummy = args.out, args.a_offsets
        # 128 bytes of each weight row a stage: 256 packed e2m1 (two token tiles).
        b, ws_desc = args.b, None
        if swizzled:  # the weight scales as 32-bit words (a row's four K blocks), read [rows, 4] a box
            weight_scales = args.b_scales.view(torch.int32)
            ws_desc = Tma(weight_scales, ws_block, words_layout, *_rows(weight_scales.numel() // 4, 4))
        else:
            weight_scales = _bytes(args.b_scales)
        return launches.launch(args, (
            t_box.of(a), w_box.of(b, *weight_view), Tma(token_scales, s_block, words_layout), ws_desc,
            half_box.of(b, *weight_view) if half_box is not None else None, out, weight_scales, dummy, args.expert_ids,
            _or_dummy(args.expert_scales, dummy), _or_dummy(args.row_scales, dummy),
            _tile_counter(out.device) if dynamic else dummy, *scalars))

    return run
