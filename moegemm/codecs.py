"""Bit-exact element and scale codecs (pure PyTorch, any device).

Rules (docs/contract.md section 3), each tested against an exhaustive code table:
- e2m1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; round to nearest, ties to the
  even code; saturate to +-6. Sign comes from the sign bit, so -0.0 encodes as 0x8.
- e4m3 (float8_e4m3fn): round to nearest even, saturating to +-448 (the cast alone would
  turn values past 464 into NaN).
- e8m0: byte b means 2^(b-127); 0xFF is NaN. A block scale is the smallest power of two
  >= amax / max_finite(element), clamped to the representable range.
- fp4 packing: element 2i in the low nibble, element 2i+1 in the high nibble.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "encode_e2m1",
    "decode_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "encode_e4m3",
    "decode_e4m3",
    "e8m0_exponent_for",
    "encode_e8m0",
    "decode_e8m0",
]

# Code i (0..15) decodes to E2M1_VALUES[i]; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Midpoints between consecutive magnitudes, and whether a tie there rounds up (to the even
# code) or down. Code k is reached once |x| has passed k of these midpoints.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> e2m1 codes (uint8, 0..15), round-to-nearest-even, saturating.

    NaN encodes as 0 (e2m1 has no NaN); block quantizers propagate NaN through the scale.
    """
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_ROUNDS_UP):
        passed = (mag >= mid) if tie_up else (mag > mid)
        code += passed.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, low 4 bits used) -> fp32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes & 0xF).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: the last dimension must be even to pack fp4, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of pack_fp4)."""
    packed = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating to +-448; NaN stays NaN."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def decode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its bytes as uint8) -> fp32."""
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    return x.float()


def e8m0_exponent_for(amax: torch.Tensor, max_finite: float) -> torch.Tensor:
    """The unbiased exponent e of the smallest power of two with 2^e * max_finite >= amax.

    Exact: float64 division of an fp32 amax by max_finite cannot land on a power of two
    unless the exact quotient is one (the quotient's rounding error, 2^-53, is far below the
    relative gap of 2^-24 that separates an fp32 amax from max_finite * 2^e). Clamped to
    e8m0's range [-127, 127]; the result is int32 and undefined for non-finite amax.
    """
    ratio = amax.double() / max_finite
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)
    e = torch.where(ratio == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127).to(torch.int32)


def encode_e8m0(amax: torch.Tensor, max_finite: float) -> torch.Tensor:
    """Block amax -> e8m0 scale byte (uint8): round-up rule, 0xFF (NaN) where amax is not finite."""
    byte = (e8m0_exponent_for(amax, max_finite) + 127).to(torch.uint8)
    return torch.where(torch.isfinite(amax), byte, torch.full_like(byte, 0xFF))


def decode_e8m0(b: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (uint8 or float8_e8m0fnu) -> fp32: 2^(b-127), NaN for 0xFF."""
    b = b.view(torch.uint8) if b.dtype != torch.uint8 else b
    value = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b.int() - 127)
    return torch.where(b == 0xFF, torch.full_like(value, float("nan")), value)
