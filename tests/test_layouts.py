"""Scale layouts: positions checked against the formulas of docs/contract.md section 5 element
by element, round trips, zero padding, a_scale_offsets."""

import math

import pytest
import torch

from moegemm import layouts


def distinct_bytes(*shape) -> torch.Tensor:
    """Non-zero, mostly distinct bytes, so a misplaced or dropped entry shows."""
    return (torch.randperm(math.prod(shape)) % 255 + 1).to(torch.uint8).reshape(shape)


def test_b_swizzle_positions_and_padding():
    e, n, nkb = 2, 200, 6  # N and nkb not multiples of 128 and 4
    plain = distinct_bytes(e, n, nkb)
    swz = layouts.swizzle_b_scales(plain)
    assert swz.shape == (2, 2, 2, 32, 4, 4)
    for ei in range(e):
        for r in range(n):
            for kb in range(nkb):
                assert swz[ei, r // 128, kb // 4, r % 32, (r % 128) // 32, kb % 4] == plain[ei, r, kb]
    assert int((swz != 0).sum()) == e * n * nkb  # every other entry is padding, written as zero
    assert torch.equal(layouts.unswizzle_b_scales(swz, n, nkb), plain)


def test_swizzle_keeps_fp8_dtypes():
    plain = distinct_bytes(1, 130, 4).view(torch.float8_e8m0fnu)
    swz = layouts.swizzle_b_scales(plain)
    assert swz.dtype == torch.float8_e8m0fnu
    assert torch.equal(layouts.unswizzle_b_scales(swz, 130, 4).view(torch.uint8), plain.view(torch.uint8))
    with pytest.raises(TypeError, match="scales"):
        layouts.swizzle_b_scales(torch.ones(1, 4, 4))


PATTERNS = [
    ([0, 100, 100, 356, 357], "ragged with an empty group"),
    ([37, 37, 165, 420], "a_offsets[0] > 0, first group empty"),
    ([0, 128, 256, 512], "aligned"),
    ([5], "zero groups"),
]


@pytest.mark.parametrize("bounds,why", PATTERNS)
def test_a_swizzle_positions_offsets_and_padding(bounds, why):
    a_offsets = torch.tensor(bounds, dtype=torch.int32)
    m, nkb = bounds[-1] + 9, 5
    plain = distinct_bytes(m, nkb)
    tokens = [t - s for s, t in zip(bounds, bounds[1:])]
    blocks = [0]
    for t in tokens:
        blocks.append(blocks[-1] + math.ceil(t / 128))
    assert layouts.num_a_scale_blocks(a_offsets) == blocks[-1]
    assert layouts.a_scale_offsets(a_offsets).tolist() == [blocks[g] - bounds[g] // 128 for g in range(len(tokens))]
    swz = layouts.swizzle_a_scales(plain, a_offsets)
    assert swz.shape == (blocks[-1], 2, 32, 4, 4)
    for g, (s, t) in enumerate(zip(bounds, bounds[1:])):
        for row in range(s, t):
            r = 128 * blocks[g] + (row - s)
            for kb in range(nkb):
                assert swz[r // 128, kb // 4, r % 32, (r % 128) // 32, kb % 4] == plain[row, kb]
    assert int((swz != 0).sum()) == sum(tokens) * nkb
    back = layouts.unswizzle_a_scales(swz, a_offsets, m, nkb)
    inside = torch.zeros(m, dtype=torch.bool)
    inside[bounds[0]:bounds[-1]] = True
    assert torch.equal(back[inside], plain[inside]) and bool((back[~inside] == 0).all())


def test_a_scale_offsets_locate_rows_as_the_kernel_does():
    # The consumer's formula: row = 128 * (a_scale_offsets[g] + s // 128) + (m - s).
    a_offsets = torch.tensor([300, 301, 555, 555, 1000], dtype=torch.int32)
    _, rows, _ = layouts.a_scale_rows(a_offsets)
    aso = layouts.a_scale_offsets(a_offsets)
    bounds = a_offsets.tolist()
    want = [128 * (int(aso[g]) + s // 128) + (m - s) for g, (s, t) in enumerate(zip(bounds, bounds[1:])) for m in range(s, t)]
    assert rows.tolist() == want


def test_a_swizzle_with_an_upper_bound_of_blocks():
    a_offsets = torch.tensor([0, 10, 20], dtype=torch.int32)
    plain = distinct_bytes(20, 3)
    swz = layouts.swizzle_a_scales(plain, a_offsets, num_blocks=5)
    assert swz.shape[0] == 5 and bool((swz[2:] == 0).all())
    assert torch.equal(layouts.unswizzle_a_scales(swz, a_offsets, 20, 3), plain)
    with pytest.raises(ValueError, match="num_blocks"):
        layouts.swizzle_a_scales(plain, a_offsets, num_blocks=1)


@pytest.mark.parametrize("dropped", [0, 9])
def test_place_a_scales_equals_swizzle_without_a_host_read(dropped):
    """Rows of grouped slots (some empty, one past a 128-row block) plus `dropped` rows outside
    every slot (slot G), which get no scales."""
    a_offsets = torch.tensor([0, 5, 5, 140, 300], dtype=torch.int32)
    rows = 300 + dropped
    plain = distinct_bytes(rows, 6)
    slot = torch.searchsorted(a_offsets[1:].contiguous(), torch.arange(rows, dtype=torch.int32), right=True)
    bound = math.ceil(rows / 128) + 4
    got = layouts.place_a_scales(plain, slot, a_offsets, layouts.a_scale_offsets(a_offsets), bound)
    assert torch.equal(got, layouts.swizzle_a_scales(plain[:300], a_offsets, bound))


def test_scale_layout_objects_round_trip_and_name_their_argument():
    """PLAIN and SWIZZLED carry their conversions (the functions above, bit for bit) and shapes;
    scale_layout_of takes the names, the objects and token forms, and names a bad value."""
    import copy
    import pickle

    from moegemm.token_forms import TokenForm

    a_offsets = torch.tensor([0, 100, 100, 357], dtype=torch.int32)
    a_plain, b_plain = distinct_bytes(357, 5), distinct_bytes(2, 200, 6)
    for name, layout in (("plain", layouts.PLAIN), ("swizzled", layouts.SWIZZLED)):
        assert layouts.scale_layout_of(name) is layout and layout.name == name and layout.argument == name
        assert layout.swizzled == (name == "swizzled") and layout.form is None
        assert copy.deepcopy(layout) is layout and pickle.loads(pickle.dumps(layout)) is layout
        a = layout.a_from_plain(a_plain, a_offsets)
        b = layout.b_from_plain(b_plain)
        assert tuple(b.shape) == layout.b_shape(2, 200, 6)
        assert torch.equal(layout.a_to_plain(a, a_offsets, 357, 5), a_plain)
        assert torch.equal(layout.b_to_plain(b, 200, 6), b_plain)
    assert torch.equal(layouts.SWIZZLED.a_from_plain(a_plain, a_offsets), layouts.swizzle_a_scales(a_plain, a_offsets))
    assert torch.equal(layouts.SWIZZLED.b_from_plain(b_plain), layouts.swizzle_b_scales(b_plain))
    assert {layouts.PLAIN: 1, layouts.SWIZZLED: 2}[layouts.scale_layout_of("swizzled")] == 2  # hashable keys
    form = TokenForm("e4m3", column_block=16)
    assert layouts.scale_layout_of(form) is form and form.form is form and form.argument is form
    with pytest.raises(ValueError, match="^scale_layout: expected 'plain', 'swizzled', got"):
        layouts.scale_layout_of(form, forms=False)
    for bad in ("Swizzled", None, ["plain"]):
        with pytest.raises(ValueError, match="^scale_layout: expected 'plain', 'swizzled' or a TokenForm, got"):
            layouts.scale_layout_of(bad)
    with pytest.raises(TypeError, match="^scale_layout:"):
        form.b_from_plain(b_plain)
