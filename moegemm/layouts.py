"""Scale-factor layouts: plain and the 128x4 "swizzled" layout, each beside its inverse.

plain:    A scales [rows, ceil(K/vec)] by absolute token row; B scales [E, N, ceil(K/vec)].
swizzled: the tcgen05 / cuBLASLt / CUTLASS 128x4 atom. A scale (r, kb) lives at
          [r // 128, kb // 4, r % 32, (r % 128) // 32, kb % 4] of a
          [row_blocks, ceil(nkb / 4), 32, 4, 4] tensor; B scales use the same atom per expert,
          [E, ceil(N / 128), ceil(nkb / 4), 32, 4, 4].
For A, every group slot (skipped ones too) starts on a fresh 128-row block:
    blocks(g)          = sum_{j<g} ceil(tokens_j / 128)
    a_scale_offsets[g] = blocks(g) - a_offsets[g] // 128
    scale row of token m in group g = 128 * blocks(g) + (m - a_offsets[g])
Padding entries (rows past a group's tokens, K blocks past K) are written as zero.

All layout work is byte moves, done on uint8 views (float8_e8m0fnu / float8_e4m3fn scales
keep their dtype on the way out).

Code above this module holds a layout as a ScaleLayout object (PLAIN, SWIZZLED, or a token form:
token_forms.TokenForm is a ScaleLayout), made once where a call enters (scale_layout_of), and
asks it what it needs; the public functions take the names "plain" and "swizzled".
"""

from __future__ import annotations

import torch

__all__ = [
    "PLAIN",
    "SWIZZLED",
    "ScaleLayout",
    "layout_named",
    "scale_layout_of",
    "ROWS_PER_BLOCK",
    "a_scale_offsets",
    "scale_row_blocks",
    "num_a_scale_blocks",
    "a_scale_rows",
    "swizzle_a_scales",
    "place_a_scales",
    "unswizzle_a_scales",
    "swizzle_b_scales",
    "unswizzle_b_scales",
    "swizzled_a_shape",
    "swizzled_b_shape",
]

ROWS_PER_BLOCK = 128  # rows of one swizzle atom
_ATOM_K = 4  # scale columns of one swizzle atom


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group_tokens(a_offsets: torch.Tensor) -> torch.Tensor:
    """Tokens per slot, as int64; a decreasing pair counts as an empty group."""
    offsets = a_offsets.long()
    return (offsets[1:] - offsets[:-1]).clamp(min=0)


def scale_row_blocks(a_offsets: torch.Tensor) -> torch.Tensor:
    """blocks(g) for g in [0, G]: 128-row scale blocks used by the slots before g (int64, on device)."""
    blocks_per_group = (_group_tokens(a_offsets) + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    return torch.cat((blocks_per_group.new_zeros(1), torch.cumsum(blocks_per_group, 0)))


def a_scale_offsets(a_offsets: torch.Tensor) -> torch.Tensor:
    """a_scale_offsets[g] = blocks(g) - a_offsets[g] // 128 (int32 [G], computed on a_offsets' device)."""
    blocks = scale_row_blocks(a_offsets)[:-1]
    return (blocks - a_offsets[:-1].long() // ROWS_PER_BLOCK).to(torch.int32)


def num_a_scale_blocks(a_offsets: torch.Tensor) -> int:
    """sum_g ceil(tokens_g / 128): the first dimension of swizzled A scales (reads a device value)."""
    return int(scale_row_blocks(a_offsets)[-1])


def swizzled_a_shape(num_blocks: int, num_k_scales: int) -> tuple[int, ...]:
    return (num_blocks, _cdiv(num_k_scales, _ATOM_K), 32, 4, _ATOM_K)


def swizzled_b_shape(num_experts: int, n: int, num_k_scales: int) -> tuple[int, ...]:
    return (num_experts, _cdiv(n, ROWS_PER_BLOCK), _cdiv(num_k_scales, _ATOM_K), 32, 4, _ATOM_K)


def a_scale_rows(a_offsets: torch.Tensor, a_scale_offsets_: torch.Tensor | None = None):
    """For every token row m inside some slot: (m, its swizzled scale row, its slot).

    Returns three int64 tensors of equal length, rows in ascending order. Reads a_offsets[0]
    and a_offsets[G] on the host (layout conversion is set-up work, not the hot path).
    """
    offsets = a_offsets.long()
    first, last = int(offsets[0]), int(offsets[-1])
    rows = torch.arange(first, max(first, last), device=a_offsets.device)
    if a_offsets.numel() < 2 or rows.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=a_offsets.device)
        return empty, empty, empty
    slot = torch.searchsorted(offsets[1:], rows, right=True)  # the slot whose [s, t) holds the row
    if a_scale_offsets_ is None:
        group_block = scale_row_blocks(a_offsets)[:-1]
    else:
        group_block = a_scale_offsets_.long() + offsets[:-1] // ROWS_PER_BLOCK
    scale_rows = ROWS_PER_BLOCK * group_block[slot] + (rows - offsets[slot])
    return rows, scale_rows, slot


def _atoms_from_padded(padded: torch.Tensor) -> torch.Tensor:
    """[..., R*128, KB4*4] -> [..., R, KB4, 32, 4, 4] (the 128x4 atom order)."""
    *lead, rows, cols = padded.shape
    x = padded.reshape(*lead, rows // ROWS_PER_BLOCK, 4, 32, cols // _ATOM_K, _ATOM_K)
    nd = len(lead)
    # axes after lead: block, row//32 within block, row%32, kb//4, kb%4
    order = list(range(nd)) + [nd, nd + 3, nd + 2, nd + 1, nd + 4]
    return x.permute(order).contiguous()


def _padded_from_atoms(atoms: torch.Tensor) -> torch.Tensor:
    """Inverse of _atoms_from_padded."""
    *lead, blocks, kb4, _, _, _ = atoms.shape
    nd = len(lead)
    order = list(range(nd)) + [nd, nd + 3, nd + 2, nd + 1, nd + 4]
    return atoms.permute(order).reshape(*lead, blocks * ROWS_PER_BLOCK, kb4 * _ATOM_K)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 1:
        raise TypeError(f"scales: the swizzled layout holds 1-byte scales, got {t.dtype}")
    return t.view(torch.uint8)


def swizzle_a_scales(plain: torch.Tensor, a_offsets: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
    """Plain A scales [M, nkb] -> swizzled [num_blocks, ceil(nkb/4), 32, 4, 4].

    num_blocks defaults to sum_g ceil(tokens_g / 128); a larger value (an upper bound known on
    the host, such as ceil(M / 128) + G) leaves the extra blocks zero.
    """
    needed = num_a_scale_blocks(a_offsets)
    num_blocks = needed if num_blocks is None else num_blocks
    if num_blocks < needed:
        raise ValueError(f"num_blocks: the groups need {needed} 128-row scale blocks, got {num_blocks}")
    src = _as_bytes(plain)
    nkb = src.shape[1]
    padded = src.new_zeros(num_blocks * ROWS_PER_BLOCK, _cdiv(nkb, _ATOM_K) * _ATOM_K)
    rows, scale_rows, _ = a_scale_rows(a_offsets)
    padded[scale_rows, :nkb] = src[rows]
    return _atoms_from_padded(padded).view(plain.dtype)


def place_a_scales(plain: torch.Tensor, row_slot: torch.Tensor, a_offsets: torch.Tensor,
                   a_scale_offsets_: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """swizzle_a_scales without a host read: plain scales [M, nkb] of grouped rows whose slots
    row_slot [M] names (G or more for a row outside every slot, which gets no scales) ->
    swizzled [num_blocks, ceil(nkb/4), 32, 4, 4]; num_blocks must bound the slots' blocks (a
    host-known bound such as ceil(M / 128) + G). Device work only, so it captures in a CUDA graph."""
    src = _as_bytes(plain)
    rows, nkb = src.shape
    groups = a_scale_offsets_.numel()
    offsets = a_offsets.long()
    slot = row_slot.long().clamp(max=groups)
    inside = row_slot.long() < groups
    safe = slot.clamp(max=max(groups - 1, 0))
    if groups:
        first_row = offsets.index_select(0, safe)
        block = a_scale_offsets_.long().index_select(0, safe) + first_row // ROWS_PER_BLOCK
        scale_row = ROWS_PER_BLOCK * block + torch.arange(rows, device=src.device) - first_row
    else:
        scale_row = torch.zeros(rows, dtype=torch.long, device=src.device)
    spare = num_blocks * ROWS_PER_BLOCK  # one row past the atoms takes the rows outside every slot
    padded = src.new_zeros(spare + 1, _cdiv(nkb, _ATOM_K) * _ATOM_K)
    padded[:, :nkb].index_copy_(0, torch.where(inside, scale_row, spare), src)
    return _atoms_from_padded(padded[:spare]).view(plain.dtype)


def unswizzle_a_scales(
    swizzled: torch.Tensor,
    a_offsets: torch.Tensor,
    num_rows: int,
    num_k_scales: int,
    a_scale_offsets_: torch.Tensor | None = None,
) -> torch.Tensor:
    """Swizzled A scales -> plain [num_rows, num_k_scales]; rows outside every slot are zero."""
    padded = _padded_from_atoms(_as_bytes(swizzled))
    plain = padded.new_zeros(num_rows, num_k_scales)
    rows, scale_rows, _ = a_scale_rows(a_offsets, a_scale_offsets_)
    plain[rows] = padded[scale_rows, :num_k_scales]
    return plain.view(swizzled.dtype)


def swizzle_b_scales(plain: torch.Tensor) -> torch.Tensor:
    """Plain B scales [E, N, nkb] -> swizzled [E, ceil(N/128), ceil(nkb/4), 32, 4, 4]."""
    src = _as_bytes(plain)
    e, n, nkb = src.shape
    padded = src.new_zeros(e, _cdiv(n, ROWS_PER_BLOCK) * ROWS_PER_BLOCK, _cdiv(nkb, _ATOM_K) * _ATOM_K)
    padded[:, :n, :nkb] = src
    return _atoms_from_padded(padded).view(plain.dtype)


def unswizzle_b_scales(swizzled: torch.Tensor, n: int, num_k_scales: int) -> torch.Tensor:
    """Swizzled B scales -> plain [E, n, num_k_scales]."""
    padded = _padded_from_atoms(_as_bytes(swizzled))
    return padded[:, :n, :num_k_scales].contiguous().view(swizzled.dtype)


class ScaleLayout:
    """Where an operand's block scales sit. PLAIN and SWIZZLED are this module's two layouts
    (docs/contract.md section 5); a token form (token_forms.TokenForm, a subclass) is the form an
    sm90 kernel reads A tokens in, data included, and has no plain scales to convert.

    name:      "plain", "swizzled" (a token form: "token form")
    swizzled:  scales in the 128x4 atoms
    form:      the token form this layout is, None for PLAIN and SWIZZLED
    argument:  the value the public functions take and QuantizedTensor.scale_layout holds: the
               name, or the TokenForm itself
    """

    __slots__ = ()
    name = ""
    swizzled = False

    @property
    def form(self):
        return None

    @property
    def argument(self):
        return self.name

    def __repr__(self):  # (as the argument reads in messages; TokenForm has its dataclass repr)
        return repr(self.name)

    def a_from_plain(self, plain: torch.Tensor, a_offsets: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
        """Plain A scales [M, nkb] in this layout (swizzle_a_scales' arguments)."""
        raise TypeError(f"scale_layout: {self!r} converts no plain A scales")

    def a_to_plain(self, scales: torch.Tensor, a_offsets: torch.Tensor, num_rows: int, num_k_scales: int,
                   a_scale_offsets: torch.Tensor | None = None) -> torch.Tensor:
        """A scales of this layout as plain ones [num_rows, num_k_scales] (unswizzle_a_scales')."""
        raise TypeError(f"scale_layout: {self!r} converts no plain A scales")

    def b_from_plain(self, plain: torch.Tensor) -> torch.Tensor:
        """Plain B scales [E, N, nkb] in this layout."""
        raise TypeError(f"scale_layout: {self!r} converts no plain B scales")

    def b_to_plain(self, scales: torch.Tensor, n: int, num_k_scales: int) -> torch.Tensor:
        """B scales of this layout as plain ones [E, n, num_k_scales]."""
        raise TypeError(f"scale_layout: {self!r} converts no plain B scales")

    def b_shape(self, num_experts: int, n: int, num_k_scales: int) -> tuple[int, ...]:
        """The shape of B scales [E, N, nkb] (per element row) in this layout."""
        raise TypeError(f"scale_layout: {self!r} converts no plain B scales")


class _Plain(ScaleLayout):
    __slots__ = ()
    name = "plain"

    def __reduce__(self):  # (copies and pickles are the one object)
        return "PLAIN"

    def a_from_plain(self, plain, a_offsets, num_blocks=None):
        return plain

    def a_to_plain(self, scales, a_offsets, num_rows, num_k_scales, a_scale_offsets=None):
        return scales

    def b_from_plain(self, plain):
        return plain

    def b_to_plain(self, scales, n, num_k_scales):
        return scales

    def b_shape(self, num_experts, n, num_k_scales):
        return (num_experts, n, num_k_scales)


class _Swizzled(ScaleLayout):
    __slots__ = ()
    name = "swizzled"
    swizzled = True

    def __reduce__(self):
        return "SWIZZLED"

    def a_from_plain(self, plain, a_offsets, num_blocks=None):
        return swizzle_a_scales(plain, a_offsets, num_blocks)

    def a_to_plain(self, scales, a_offsets, num_rows, num_k_scales, a_scale_offsets=None):
        return unswizzle_a_scales(scales, a_offsets, num_rows, num_k_scales, a_scale_offsets)

    def b_from_plain(self, plain):
        return swizzle_b_scales(plain)

    def b_to_plain(self, scales, n, num_k_scales):
        return unswizzle_b_scales(scales, n, num_k_scales)

    def b_shape(self, num_experts, n, num_k_scales):
        return swizzled_b_shape(num_experts, n, num_k_scales)


PLAIN = _Plain()
SWIZZLED = _Swizzled()
_BY_NAME = {"plain": PLAIN, "swizzled": SWIZZLED}


def layout_named(name: str) -> ScaleLayout | None:
    """PLAIN or SWIZZLED by its name, None for another string."""
    return _BY_NAME.get(name)


def scale_layout_of(value, name: str = "scale_layout", forms: bool = True) -> ScaleLayout:
    """The ScaleLayout of a public argument: "plain", "swizzled", or a ScaleLayout as it is (a
    TokenForm where `forms`); else ValueError naming `name`."""
    if isinstance(value, ScaleLayout) and (forms or value.form is None):
        return value
    layout = _BY_NAME.get(value) if isinstance(value, str) else None
    if layout is None:
        raise ValueError(f"{name}: expected 'plain', 'swizzled'{' or a TokenForm' if forms else ''}, got {value!r}")
    return layout
