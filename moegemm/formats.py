"""Format descriptors: the single source of truth for what each format stores.

A format names two operand formats, one for the activations A and one for the weights B.
Each operand format says how its elements are encoded and how its scale factors are laid
out along K (and, for the DeepSeek 128x128 weight blocks, along N). Every other module
(quantizers, layouts, validation, kernels, reference) reads these descriptors instead of
re-deriving the numbers.

The weight-only formats (bf16_mxfp4, bf16_nvfp4, bf16_mxfp8) pair unscaled bf16 activations
with a block format's weights, so code that asks about scales must ask about the operand it
reads: `Format.a_scaled` for the activations, `Format.scaled` for the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ElementFormat",
    "OperandFormat",
    "Format",
    "FORMATS",
    "PREPACK_FORMATS",
    "PREPACK_BY_DEFAULT",
    "SWIZZLE_FORMATS",
    "E2M1",
    "E4M3",
    "BF16",
    "get_format",
]


@dataclass(frozen=True)
class ElementFormat:
    """How one element is stored."""

    name: str
    bits: int
    max_finite: float
    storage_dtype: torch.dtype  # dtype of the tensor that holds the elements

    @property
    def packed(self) -> bool:
        """Two 4-bit elements share one byte: element 2i in the low nibble, 2i+1 in the high."""
        return self.bits == 4


BF16 = ElementFormat("bf16", 16, float(torch.finfo(torch.bfloat16).max), torch.bfloat16)
E4M3 = ElementFormat("e4m3", 8, 448.0, torch.float8_e4m3fn)
E2M1 = ElementFormat("e2m1", 4, 6.0, torch.uint8)

# Scale encodings. "fp32": arbitrary fp32 factor; "e8m0": a power of two 2^(b-127);
# "e4m3": an fp8 factor (NVFP4's first level).
SCALE_DTYPES = {
    "fp32": torch.float32,
    "e8m0": torch.float8_e8m0fnu,
    "e4m3": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class OperandFormat:
    """One operand (A or B) of a format."""

    element: ElementFormat
    scale: str | None = None  # key of SCALE_DTYPES, or None for unscaled bf16
    block_k: int = 1  # elements along K that share one scale
    block_n: int = 1  # rows (tokens for A, output columns for B) that share one scale
    # NVFP4's second level: one fp32 factor over the whole tensor (A) or per expert (B).
    global_scale: bool = False

    @property
    def scaled(self) -> bool:
        return self.scale is not None

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return None if self.scale is None else SCALE_DTYPES[self.scale]

    @property
    def accepted_scale_dtypes(self) -> tuple[torch.dtype, ...]:
        """e8m0 scales may also come as uint8 holding the same bytes (docs/contract.md section 3)."""
        if self.scale is None:
            return ()
        if self.scale == "e8m0":
            return (torch.float8_e8m0fnu, torch.uint8)
        return (SCALE_DTYPES[self.scale],)

    def stored_k(self, k: int) -> int:
        """Length of the stored K dimension for a logical K (packed fp4 holds K/2 bytes)."""
        return k // 2 if self.element.packed else k

    def logical_k(self, stored_k: int) -> int:
        return stored_k * 2 if self.element.packed else stored_k


@dataclass(frozen=True)
class Format:
    """A grouped-matmul format: what A and B hold and which scale layouts apply."""

    name: str
    a: OperandFormat
    b: OperandFormat
    k_multiple: int  # K must be a multiple of this (scale block, or 16 for TMA alignment)
    swizzle_capable: bool  # the 128x4 swizzled layout is defined for the MX/NV block formats

    @property
    def scaled(self) -> bool:
        """The weights carry block scales: every format but bf16. The activations do too unless
        the format is weight-only (a_scaled)."""
        return self.b.scaled

    @property
    def a_scaled(self) -> bool:
        """The activations carry block scales (a_scales): the block formats but not the weight-only ones."""
        return self.a.scaled

    @property
    def weight_only(self) -> bool:
        """bf16 activations, read as they are, against block-scaled weights."""
        return self.b.scaled and not self.a.scaled

    @property
    def global_scale(self) -> bool:
        """NVFP4: the weights carry a per-expert fp32 factor, which goes into expert_scales (the
        activations' tensor-wide one too where a.global_scale)."""
        return self.b.global_scale

    @property
    def scale_vec(self) -> int:
        """Elements along K per weight scale; where the activations are scaled, theirs is the same."""
        return self.b.block_k


_MXFP8 = OperandFormat(E4M3, "e8m0", block_k=32)
_MXFP4 = OperandFormat(E2M1, "e8m0", block_k=32)
_NVFP4 = OperandFormat(E2M1, "e4m3", block_k=16, global_scale=True)
_BF16 = OperandFormat(BF16)

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("bf16", _BF16, _BF16, k_multiple=16, swizzle_capable=False),
        Format(
            "fp8_block",
            OperandFormat(E4M3, "fp32", block_k=128, block_n=1),
            OperandFormat(E4M3, "fp32", block_k=128, block_n=128),
            k_multiple=16,
            swizzle_capable=False,
        ),
        Format("mxfp8", _MXFP8, _MXFP8, k_multiple=32, swizzle_capable=True),
        Format("mxfp4", _MXFP4, _MXFP4, k_multiple=32, swizzle_capable=True),
        Format("nvfp4", _NVFP4, _NVFP4, k_multiple=16, swizzle_capable=True),
        Format("w4a8", _MXFP8, _MXFP4, k_multiple=32, swizzle_capable=True),
        # Weight-only: bf16 activations against the weights of mxfp4, nvfp4 and mxfp8 (gpt-oss
        # runs its MXFP4 experts this way).
        Format("bf16_mxfp4", _BF16, _MXFP4, k_multiple=32, swizzle_capable=True),
        Format("bf16_nvfp4", _BF16, _NVFP4, k_multiple=16, swizzle_capable=True),
        Format("bf16_mxfp8", _BF16, _MXFP8, k_multiple=32, swizzle_capable=True),
    )
}

# The formats whose block scales may come in the swizzled layout (docs/contract.md section 5).
SWIZZLE_FORMATS = tuple(name for name, f in FORMATS.items() if f.swizzle_capable)

# The formats whose weights may come prepacked (moegemm.prepack): on prepacked weights every sm90
# kernel of theirs is the decoding kernel, which reads the prepacked order into its wgmma's
# registers (mxfp4 and w4a8 on the plain order run the e2m1 promotion kernel at decode). mxfp8
# stays plain: its promotion kernels beat bf16_mxfp8's prepacked decode (docs/perf-notes.md).
PREPACK_FORMATS = ("nvfp4", "mxfp4", "w4a8", "bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")
# Those the MoE loaders prepack unless told not to: mxfp4 and w4a8 only when asked (prepack=True):
# up to 12 tokens a slot (gpt-oss decode: ~2) their plain order runs the e2m1 promotion kernel
# (8-token tiles), which prepacked weights cannot, and the decoding kernel's 256-row tiles are
# not measured against it there (docs/perf-notes.md, prepacked weights).
PREPACK_BY_DEFAULT = ("nvfp4", "bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")


def get_format(fmt: str | Format) -> Format:
    """Look up a format by name; the error lists the valid names."""
    if fmt.__class__ is str:  # (the common case first: every op call looks up its format)
        found = FORMATS.get(fmt)
        if found is not None:
            return found
    if isinstance(fmt, Format):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"fmt: expected a format name (str), got {type(fmt).__name__}")
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"fmt: expected one of {sorted(FORMATS)}, got {fmt!r}") from None
