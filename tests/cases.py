"""Shared test material: the token patterns (TOKEN_PATTERNS), input builders, tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import moegemm
from moegemm.config import override_config
from moegemm.formats import FORMATS
from moegemm.validation import validate_grouped_matmul


@dataclass(frozen=True)
class TokenPattern:
    name: str
    tokens: tuple[int, ...]
    ids: tuple[int, ...] | None = None  # default 0..G-1
    start: int = 0  # a_offsets[0]
    tail: int = 0  # rows after a_offsets[G] that belong to no group
    why: str = ""
    experts: int | None = None  # E (default: one more than the groups and the ids need)

    @property
    def expert_ids(self) -> tuple[int, ...]:
        return self.ids if self.ids is not None else tuple(range(len(self.tokens)))

    @property
    def num_experts(self) -> int:
        """E >= number of groups, plus one expert no slot names (or `experts`)."""
        if self.experts is not None:
            return self.experts
        ids = self.expert_ids
        return max([len(ids)] + [i + 1 for i in ids]) + 1


TOKEN_PATTERNS = [
    TokenPattern("large", (512, 1000, 2000, 3000), why="many tiles per group, partial last tiles"),
    TokenPattern("ragged", (65, 1027, 386), why="group ends inside a tile; a 1-row overhang"),
    TokenPattern("aligned", (128, 256, 1024), why="every group 128-aligned: no partial tiles"),
    TokenPattern("mixed", (256, 519, 1037, 129), why="aligned and unaligned neighbours"),
    TokenPattern("one_less", (127, 257, 513, 1025), why="one row short/over of a power of two"),
    TokenPattern("small", (31, 97, 63), why="groups smaller than one tile"),
    TokenPattern("tiny", (0, 1, 2, 3), why="an empty group and 1-3 row groups"),
    TokenPattern("skip_first", (128, 256, 512), (-1, 0, 2), why="expert_id -1 on a full group: never written"),
    TokenPattern("skip_some", (0, 3, 1, 2), (-1, 2, -1, 0), why="skips and empty groups interleaved"),
    TokenPattern("skip_empty", (0, 64, 128, 0), (-1, 2, 4, -1), why="empty skipped slots at both ends"),
    TokenPattern("all_skipped", (40, 70), (-1, -1), why="nothing valid: output untouched"),
    TokenPattern("no_groups", (), why="G = 0: a no-op"),
    TokenPattern("repeated_unsorted", (50, 130, 70, 20), (3, 1, 3, 0), why="same expert twice, ids unsorted"),
    TokenPattern("offset_start", (90, 200, 33), start=37, tail=21, why="a_offsets[0] > 0 and rows after the end"),
]

# The rows a fresh output zeroes: before a_offsets[0] and after a_offsets[G] (several 32-row
# blocks), an empty slot, a skipped one, an empty skipped one; and G = 0 with rows.
EDGE_ROWS = TokenPattern("edge_rows", (3, 0, 5, 2, 0), (0, 1, -1, 2, -1), start=37, tail=70,
                         why="rows of no valid slot everywhere a fresh output has them")
ROWS_NO_GROUPS = TokenPattern("rows_no_groups", (), start=5, tail=4, why="G = 0 with rows: none valid")

FORMAT_LAYOUTS = [
    (name, layout)
    for name, f in FORMATS.items()
    for layout in (("plain", "swizzled") if f.swizzle_capable else ("plain",))
]


@dataclass(frozen=True)
class Tolerance:
    """Kernel vs the fp64 reference on the same quantized inputs.

    Decoding is exact (e2m1, e4m3, bf16 and the e8m0/e4m3 scale products are all exact in
    bf16 and fp32), so every format differs from the oracle only by fp32 accumulation order
    (acc_rtol, relative to sum |a*b|), by fp8_block's per-block fp32 promotion, and by the
    final rounding of the output (bf16: at most half an ulp, 2^-8 relative).
    normalized: bound on ||out - ref|| / ||ref|| over the valid rows.
    """

    normalized_bf16: float
    normalized_fp32: float
    acc_rtol: float


TOLERANCES = {
    "bf16": Tolerance(4e-3, 1e-5, 2e-6),
    "fp8_block": Tolerance(4e-3, 1e-5, 4e-6),
    "mxfp8": Tolerance(4e-3, 1e-5, 2e-6),
    "mxfp4": Tolerance(4e-3, 1e-5, 2e-6),
    "nvfp4": Tolerance(4e-3, 1e-5, 2e-6),
    "w4a8": Tolerance(4e-3, 1e-5, 2e-6),
    # Weight-only: bf16 activations as they are, the weights decoded exactly, fp32 sums: the
    # same bounds as the formats above.
    "bf16_mxfp4": Tolerance(4e-3, 1e-5, 2e-6),
    "bf16_nvfp4": Tolerance(4e-3, 1e-5, 2e-6),
    "bf16_mxfp8": Tolerance(4e-3, 1e-5, 2e-6),
}

# The sm90 kernel multiplies fp8 on Hopper's tensor cores, whose fp8 accumulator keeps fewer
# bits than fp32 inside each 128-wide K block (the block is then promoted into fp32, as in
# DeepGEMM): measured on an H100 (bench/accuracy.py), normalized 1.3e-4 with fp32 output and
# 3.4e-5 of sum |a*b| elementwise. bf16 wgmma accumulates in fp32 like the portable kernel.
SM90_TOLERANCES = {
    "bf16": TOLERANCES["bf16"],
    "fp8_block": Tolerance(4e-3, 5e-4, 2e-4),
    # mxfp8 runs fp8 wgmma per 32-wide block (kernels/sm90/mxfp8.py): the same fp8 accumulator,
    # promoted 4x as often; measured 4.7e-6 of sum |a*b| on an H100, past the exact bound. The
    # fp8_block bounds apply. They hold for data like the tests' (Gaussian values, then
    # quantized), not for every input: weights drawn uniformly from all e4m3 codes reached
    # 4.3e-4 of sum |a*b| (docs/perf-notes.md, "Block formats", Numerics).
    "mxfp8": Tolerance(4e-3, 5e-4, 2e-4),
    # w4a8 at decode runs the same fp8 wgmma (e2m1 weights decoded to e4m3): e4m3 x e2m1 products
    # need more bits than the accumulator keeps (1e-5 of sum |a*b| on an H100). mxfp4 on the
    # same path stays exact: its products are multiples of 1/4 below 36, a k32 sum below 2^11.
    "w4a8": Tolerance(4e-3, 5e-4, 2e-4),
    # The other block formats run bf16 wgmma on exactly decoded operands: the bf16 kernel's bounds.
    # So do the weight-only ones on the decoding kernel (bf16 tokens as they are).
    **{name: TOLERANCES[name] for name in ("mxfp4", "nvfp4", "bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")},
}


def tolerance(fmt: str, backend: str) -> Tolerance:
    return SM90_TOLERANCES[fmt] if backend == "sm90" else TOLERANCES[fmt]


def offsets_for(pattern: TokenPattern, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    bounds = [pattern.start]
    for t in pattern.tokens:
        bounds.append(bounds[-1] + t)
    m = bounds[-1] + pattern.tail
    a_offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
    expert_ids = torch.tensor(pattern.expert_ids, dtype=torch.int32, device=device)
    return a_offsets, expert_ids, m


def random_activations(m: int, k: int, device) -> torch.Tensor:
    """Rows of very different magnitudes (exercise the scales), some all-zero 32-blocks."""
    x = torch.randn(m, k, device=device) * torch.exp2(torch.randint(-6, 7, (m, 1), device=device).float())
    if k >= 64 and m:
        x[torch.rand(m, device=device) < 0.1, 32:64] = 0
    return x


def random_weights(e: int, n: int, k: int, device) -> torch.Tensor:
    return torch.randn(e, n, k, device=device) * torch.exp2(torch.randint(-3, 4, (e, n, 1), device=device).float())


@dataclass
class Problem:
    fmt: str
    layout: str
    a: moegemm.QuantizedTensor
    w: moegemm.QuantizedTensor
    a_offsets: torch.Tensor
    expert_ids: torch.Tensor
    expert_scales: torch.Tensor | None
    row_scales: torch.Tensor | None
    m: int
    n: int

    def args(self):
        return (self.a.data, self.w.data, self.a.scales, self.w.scales, self.a_offsets, self.expert_ids)

    def kwargs(self):
        return dict(fmt=self.fmt, scale_layout=self.layout, expert_scales=self.expert_scales,
                    row_scales=self.row_scales)

    def problem(self, out_dtype=torch.bfloat16):
        """The validated GroupedProblem of a call on these operands (validation.validate_grouped_matmul)."""
        return validate_grouped_matmul(*self.args(), **{**self.kwargs(), "fmt": FORMATS[self.fmt]},
                                       a_scale_offsets=None, out=None, out_dtype=out_dtype)

    def valid_rows(self) -> torch.Tensor:
        mask = torch.zeros(self.m, dtype=torch.bool)
        offsets = self.a_offsets.tolist()
        for g, e in enumerate(self.expert_ids.tolist()):
            if e >= 0:
                mask[offsets[g]:offsets[g + 1]] = True
        return mask


def make_problem(fmt: str, layout: str, pattern: TokenPattern, n: int, k: int, device,
                 with_scales: bool = True) -> Problem:
    a_offsets, expert_ids, m = offsets_for(pattern, device)
    e = pattern.num_experts
    qa = moegemm.quantize(random_activations(m, k, device), fmt, scale_layout=layout, a_offsets=a_offsets)
    qw = moegemm.quantize_weights(random_weights(e, n, k, device), fmt, scale_layout=layout)
    expert_scales = None
    if with_scales:
        expert_scales = torch.rand(e, device=device) + 0.5
    if qw.global_scale is not None:  # nvfp4's global scales (bf16_nvfp4: the weights') ride in expert_scales
        base = expert_scales if expert_scales is not None else torch.ones(e, device=device)
        expert_scales = base * qw.global_scale
        if qa.global_scale is not None:
            expert_scales = expert_scales * qa.global_scale
    row_scales = torch.rand(m, device=device) + 0.5 if with_scales else None
    return Problem(fmt, layout, qa, qw, a_offsets, expert_ids, expert_scales, row_scales, m, n)


def reference_and_bound(p: Problem):
    """fp64 oracle (moegemm.reference in fp64: exact products and sums of the decoded operands),
    and sum |a*b| * |scales| per element (the scale of the accumulation error). Rows outside
    valid groups are zero in both."""
    ref = torch.zeros(p.m, p.n, dtype=torch.float64, device=p.a.data.device)
    moegemm.reference.grouped_matmul(*p.args(), **p.kwargs(), out=ref, compute_dtype=torch.float64)
    a_abs = moegemm.dequantize_operand(p.a.data, p.a.scales, p.a.fmt, "a", scale_layout=p.a.scale_layout,
                                       a_offsets=p.a.a_offsets, dtype=torch.float64).abs()
    bound = torch.zeros_like(ref)
    offsets, ids = p.a_offsets.tolist(), p.expert_ids.tolist()
    for e in sorted({e for e in ids if e >= 0}):
        w_abs = moegemm.reference.expert_weights(p.w.data, p.w.scales, p.fmt, e, scale_layout=p.w.scale_layout,
                                                 dtype=torch.float64).abs()
        for g in (g for g, eg in enumerate(ids) if eg == e and offsets[g + 1] > offsets[g]):
            s, t = offsets[g], offsets[g + 1]
            mag = a_abs[s:t] @ w_abs.T
            if p.expert_scales is not None:
                mag = mag * p.expert_scales[e].double().abs()
            if p.row_scales is not None:
                mag = mag * p.row_scales[s:t, None].double().abs()
            bound[s:t] = mag
    return ref, bound


def poison_like(m: int, n: int, dtype, device) -> torch.Tensor:
    """Random bit patterns, NaNs included: any unwritten valid element fails the comparison."""
    bits = torch.randint(-(2**15), 2**15, (m, n * (4 if dtype == torch.float32 else 2) // 2), dtype=torch.int16)
    out = bits.view(dtype).to(device)
    out[:, : min(n, 3)] = float("nan")
    return out.contiguous()


def dirty_allocations(monkeypatch) -> None:
    """From here on (the test's end), torch.empty hands back memory of all-ones bits, a NaN in
    every float dtype: an allocator that returns what an earlier tensor left."""
    empty = torch.empty

    def dirty(*args, **kwargs):
        t = empty(*args, **kwargs)
        t.view(-1).view(torch.uint8).fill_(255)
        return t

    monkeypatch.setattr(torch, "empty", dirty)


def check_output(p: Problem, out: torch.Tensor, poisoned: torch.Tensor, tol: Tolerance | None = None):
    """Valid rows within the tolerance, elementwise and normalized; all other rows bit-identical."""
    tol = tol or TOLERANCES[p.fmt]
    valid = p.valid_rows().to(out.device)
    untouched_now = out[~valid].view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32)
    untouched_before = poisoned[~valid].view(untouched_now.dtype)
    assert torch.equal(untouched_now, untouched_before), "rows outside valid groups were written"
    if not bool(valid.any()) or p.n == 0:
        return
    ref, bound = reference_and_bound(p)
    got = out[valid].double()
    ref, bound = ref[valid], bound[valid]
    assert not bool(torch.isnan(got).any()), "NaN in a valid row (unwritten or wrong)"
    out_rel = 2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-23
    limit = out_rel * ref.abs() + tol.acc_rtol * bound + 1e-30
    excess = (got - ref).abs() - limit
    worst = int(torch.argmax(excess))
    assert float(excess.max()) <= 0, (
        f"elementwise: |out-ref|={float((got - ref).abs().flatten()[worst]):.3e} > {float(limit.flatten()[worst]):.3e} "
        f"(ref={float(ref.flatten()[worst]):.4e}, got={float(got.flatten()[worst]):.4e})"
    )
    norm_ref = float(ref.norm())
    if norm_ref > 0:
        normalized = float((got - ref).norm()) / norm_ref
        limit_n = tol.normalized_bf16 if out.dtype == torch.bfloat16 else tol.normalized_fp32
        assert normalized <= limit_n, f"normalized error {normalized:.3e} > {limit_n:.1e}"


def run_sm90(fmt: str, pattern: TokenPattern, n: int, k: int, out_dtype=torch.bfloat16, with_scales: bool = True,
             config=None, layout: str = "plain"):
    """One call on the sm90 backend (config forced when given) into a poisoned output, checked."""
    p = make_problem(fmt, layout, pattern, n, k, "cuda", with_scales=with_scales)
    poisoned = poison_like(p.m, n, out_dtype, "cuda")
    out = poisoned.clone()
    if config is None:
        moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, out_dtype=out_dtype, backend="sm90")
    else:
        with override_config(config):
            moegemm.grouped_matmul(*p.args(), **p.kwargs(), out=out, out_dtype=out_dtype, backend="sm90")
    check_output(p, out, poisoned, tolerance(fmt, "sm90"))


def dequantized_experts(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) of an MoE layer's quantized weights, fp32."""
    w_gate_up, w_down = layer.weights()
    gate_up, down = moegemm.dequantize(w_gate_up), moegemm.dequantize(w_down)
    if layer.gate_up_layout == "concat":
        gate, up = gate_up.chunk(2, dim=1)
    else:
        gate, up = moegemm.gate_up.deinterleave_gate_up(gate_up)
    return gate, up, down


def dirty_cached_blocks(nbytes: int):
    """Leave the caching allocator's free blocks of nbytes all-ones bits (NaN in every float
    dtype), so that the next tensors of that size start dirty; checked, else a test of fresh
    outputs would prove nothing."""
    blocks = [torch.full((nbytes, ), 255, dtype=torch.uint8, device="cuda") for _ in range(32)]
    del blocks
    probe = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    assert int(probe.min()) == 255, "the allocator handed out clean memory"
    del probe
