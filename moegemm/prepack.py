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
Packed e2m1 keeps its byte pairs (k1 is the nibble). Only the codes move: the scales keep their
plain or swizzled layout. Blocks never straddle an expert: N and K are multiples of 64.
"""

from __future__ import annotations

import torch

from .formats import PREPACK_FORMATS, get_format

__all__ = ["PREPACK_ROWS", "PREPACK_K", "prepack_codes", "unpack_codes", "check_prepackable"]

PREPACK_ROWS = 64  # weight rows of a block: one consumer warpgroup
PREPACK_K = 64  # K elements of a block: one K step

# Bit fields of a block, most significant first. Rows (w: 2 bits, then 1 bit each) and K columns.
_ROW_BITS = ("w", "r8", "r4", "r2", "r1")
_K_BITS = ("k32", "k16", "k8", "k4", "k2", "k1")
# The prepacked block's row and column fields in the same terms.
_PACKED_ROW_BITS = ("w", "r4", "r2", "r1", "k4")
_PACKED_K_BITS = ("k2", "r8", "k32", "k16", "k8", "k1")


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
        raise ValueError(f"{name}: prepacked weights are for {', '.join(PREPACK_FORMATS)} (the formats the decoding "
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
    return _reorder(codes, plain, prepacked)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of prepack_codes: prepacked codes back in the plain [E, N, K] order."""
    packed = codes.dtype == torch.uint8
    _check_shape(codes.shape, packed, "codes")
    plain, prepacked = _orders(packed)
    return _reorder(codes, prepacked, plain)
