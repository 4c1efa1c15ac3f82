"""The prepacked weight order: the block formats' weight codes reordered once, at load time, so
that the sm90 decoding kernel (kernels/sm90/decode.py) loads each thread's share of a weight
step with one 16- or 32-byte shared load, already in the order of the bf16 wgmma's register
A operand: no shared-memory round trip of the decoded weights, no fence, no barrier.

Within every block of 64 weight rows x 64 K elements (one consumer warpgroup's K step), with
row = 16 w + 8 r8 + 4 r4 + 2 r2 + r1 and K column = 32 k32 + 16 k16 + 8 k8 + 4 k4 + 2 k2 + k1
(each letter one bit), the element goes to

    prepacked row     16 w + 8 r4 + 4 r2 + 2 r1 + k4
    prepacked column  32 k2 + 16 r8 + 8 k32 + 4 k16 + 2 k8 + k1

so that the 32 elements of lane 16 r4 + 8 r2 + 4 r1 + 2 k4 + k2 of warp w are contiguous: rows
16 w + 4 r4 + 2 r2 + r1 and + 8, K columns 4 k4 + 2 k2 + {0, 1} and + 8 of each k16 slice, which
is the bf16 wgmma's A fragment (lane l: rows l / 4 and + 8, columns 2 (l % 4) + {0, 1} and + 8).
Packed e2m1 keeps its byte pairs (k1 is the nibble), and then each 32-bit word of it (four bytes,
eight elements) has its bits interleaved (E2M1_WORD_TERMS) so that the kernel turns byte t's two
elements into a bf16 pair with one rotation and one mask: bits 15 (sign) and 8 7 6 of each half
are the sign and the e2m1 magnitude e1 e0 m, whose bf16 value is the element times 2^-126
exactly (0.5 lands on the subnormal 2^-127); the kernel multiplies by 2^126. Three of the four
pairs take one term; no rotation of one mask covers the word, so the fourth takes two. Only the
codes move: the scales keep their plain or swizzled layout. Blocks never straddle an expert: N
and K are multiples of 64.
"""

from __future__ import annotations

import torch

from .formats import PREPACK_FORMATS, get_format

__all__ = ["PREPACK_ROWS", "PREPACK_K", "E2M1_WORD_TERMS", "prepack_codes", "unpack_codes", "check_prepackable"]

PREPACK_ROWS = 64  # weight rows of a block: one consumer warpgroup
PREPACK_K = 64  # K elements of a block: one K step

# Bit fields of a block, most significant first. Rows (w: 2 bits, then 1 bit each) and K columns.
_ROW_BITS = ("w", "r8", "r4", "r2", "r1")
_K_BITS = ("k32", "k16", "k8", "k4", "k2", "k1")
# The prepacked block's row and column fields in the same terms.
_PACKED_ROW_BITS = ("w", "r4", "r2", "r1", "k4")
_PACKED_K_BITS = ("k2", "r8", "k32", "k16", "k8", "k1")

# A prepacked e2m1 word's pair t (byte t's elements, the low nibble the bf16 pair's low half) is
# the OR of (word rotated left by r) & mask over E2M1_WORD_TERMS[t]'s (r, mask) terms.
E2M1_PAIR_MASK = 0x81C081C0  # bf16 bits 15 and 8 7 6 of both halves
E2M1_WORD_TERMS = (((0, E2M1_PAIR_MASK), ), ((4, E2M1_PAIR_MASK), ), ((10, E2M1_PAIR_MASK), ),
                   ((6, 0x80C080C0), (14, 0x01000100)))
_NIBBLE_TARGETS = (6, 7, 8, 15)  # bf16 bit of the nibble's bits m, e0, e1, s (in a half)


def _e2m1_bit_sources() -> list[tuple[int, int]]:
    """(bit of the plain word, bit of the interleaved word) for each of the 32 bits."""
    pairs = []
    for t, terms in enumerate(E2M1_WORD_TERMS):
        for half in range(2):
            for j, target in enumerate(_NIBBLE_TARGETS):
                target += 16 * half
                (rotation, ), = [(r, ) for r, mask in terms if mask >> target & 1]
                pairs.append((8 * t + 4 * half + j, (target - rotation) % 32))
    assert sorted(s for _, s in pairs) == list(range(32)), "the terms must place each bit once"
    return pairs


_E2M1_BITS = _e2m1_bit_sources()


def _signed(mask: int) -> int:
    return mask - (1 << 32) if mask >= 1 << 31 else mask


def _move_bits(codes: torch.Tensor, moves) -> torch.Tensor:
    """uint8 codes (a multiple of 4 bytes a row) with the bits of every 32-bit word moved: one
    rotation and mask for each distance a bit moves (10 of them, not 32 single-bit moves)."""
    masks: dict[int, int] = {}
    for source, target in moves:
        distance = (target - source) % 32
        masks[distance] = masks.get(distance, 0) | 1 << target
    words = codes.contiguous().view(torch.int32)
    out = torch.zeros_like(words)
    for distance, mask in masks.items():
        # (a rotation left; >> is arithmetic on int32, so the bits coming around are masked)
        rotated = words if distance == 0 else (words << distance) | ((words >> (32 - distance)) & ((1 << distance) - 1))
        out |= rotated & _signed(mask)
    return out.view(torch.uint8)


def _check_shape(shape, packed: bool, name: str):
    """ValueError unless codes of this shape ([E, N, K] or packed [E, N, K/2]) can be prepacked:
    N and K multiples of 64."""
    if len(shape) != 3:
        raise ValueError(f"{name}: expected weight codes [E, N, K] (packed e2m1: [E, N, K/2]), got {tuple(shape)}")
    n, k = shape[1], shape[2] * (2 if packed else 1)
    if n % PREPACK_ROWS or k % PREPACK_K:
        raise ValueError(f"{name}: the prepacked order needs N and K multiples of {PREPACK_ROWS}, got N={n}, K={k}")


def check_prepackable(fmt: str, shape, name: str):
    """ValueError (naming `name`) unless weight codes of format `fmt` and this shape can be
    prepacked: a format of formats.PREPACK_FORMATS, N and K multiples of 64."""
    if fmt not in PREPACK_FORMATS:
        raise ValueError(f"{name}: prepacked weights are for {', '.join(PREPACK_FORMATS)} (on them the decoding "
                         f"kernel runs in every regime), not {fmt}")
    _check_shape(shape, get_format(fmt).b.element.packed, name)


def _reorder(codes: torch.Tensor, source: tuple[str, ...], target: tuple[str, ...]) -> torch.Tensor:
    """Codes whose 64 x 64 blocks hold their bit fields in the `source` order (five row fields,
    then the K fields), with the fields moved to the `target` order."""
    data = codes.view(torch.uint8)
    e, n, width = data.shape
    k_fields = len(source) - 5
    blocks_k = width // 2**k_fields
    view = data.reshape(e, n // PREPACK_ROWS, 4, 2, 2, 2, 2, blocks_k, *[2] * k_fields)
    where = {name: i for i, name in enumerate(("e", "nb", *source[:5], "kb", *source[5:]))}
    order = [where[name] for name in ("e", "nb", *target[:5], "kb", *target[5:])]
    return view.permute(order).contiguous().reshape(e, n, width).view(codes.dtype)


def _orders(packed: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(plain, prepacked) field orders; packed e2m1 leaves k1 inside its byte."""
    keep = [b for b in _K_BITS if not (packed and b == "k1")]
    packed_k = [b for b in _PACKED_K_BITS if not (packed and b == "k1")]
    return _ROW_BITS + tuple(keep), _PACKED_ROW_BITS + tuple(packed_k)


def prepack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Weight codes [E, N, K] (e4m3) or packed e2m1 [E, N, K/2] (uint8) in the prepacked order
    (module docstring); same shape and dtype."""
    packed = codes.dtype == torch.uint8
    _check_shape(codes.shape, packed, "codes")
    plain, prepacked = _orders(packed)
    reordered = _reorder(codes, plain, prepacked)
    return _move_bits(reordered, _E2M1_BITS) if packed else reordered


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of prepack_codes: prepacked codes back in the plain [E, N, K] order."""
    packed = codes.dtype == torch.uint8
    _check_shape(codes.shape, packed, "codes")
    plain, prepacked = _orders(packed)
    if packed:
        codes = _move_bits(codes, [(target, source) for source, target in _E2M1_BITS])
    return _reorder(codes, prepacked, plain)
