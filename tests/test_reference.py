"""The reference against docs/contract.md sections 1 and 4 written out per element: sums over
scale blocks in Python floats, scales read by the index formulas of section 5 (plain and
swizzled), no shared dequantization code."""

import math

import pytest
import torch

import moegemm
from moegemm import codecs
from moegemm.formats import FORMATS

from cases import FORMAT_LAYOUTS


def element_values(data: torch.Tensor, element: str) -> torch.Tensor:
    if element == "e2m1":
        return codecs.decode_e2m1(codecs.unpack_fp4(data)).double()
    return data.double() if element == "bf16" else codecs.decode_e4m3(data).double()


def scale_value(raw: torch.Tensor, kind: str) -> float:
    if kind == "fp32":
        return float(raw)
    if kind == "e8m0":
        return math.ldexp(1.0, int(raw.view(torch.uint8)) - 127)
    return float(codecs.decode_e4m3(raw.reshape(1)))


def sfa(q, fmt, m, kb, a_offsets):
    op = FORMATS[fmt].a
    if op.scale is None:  # weight-only formats: bf16 activations
        return 1.0
    if q.scale_layout == "plain":
        return scale_value(q.scales[m, kb], op.scale)
    bounds = a_offsets.tolist()
    g = max(i for i in range(len(bounds) - 1) if bounds[i] <= m < bounds[i + 1])
    blocks = sum(math.ceil((bounds[j + 1] - bounds[j]) / 128) for j in range(g))
    r = 128 * blocks + (m - bounds[g])
    return scale_value(q.scales[r // 128, kb // 4, r % 32, (r % 128) // 32, kb % 4], op.scale)


def sfb(q, fmt, e, n, kb):
    op = FORMATS[fmt].b
    if op.block_n > 1:
        return scale_value(q.scales[e, n // 128, kb], op.scale)
    if q.scale_layout == "plain":
        return scale_value(q.scales[e, n, kb], op.scale)
    return scale_value(q.scales[e, n // 128, kb // 4, n % 32, (n % 128) // 32, kb % 4], op.scale)


@pytest.mark.parametrize("fmt,layout", FORMAT_LAYOUTS)
def test_reference_is_the_contract_formula(fmt, layout):
    f = FORMATS[fmt]
    k = 160 if fmt == "fp8_block" else 64  # fp8_block: a partial second 128-block
    e_count, n = 3, 5
    a_offsets = torch.tensor([2, 5, 5, 9], dtype=torch.int32)
    expert_ids = torch.tensor([2, 0, -1], dtype=torch.int32)
    m_rows = 11
    qa = moegemm.quantize(torch.randn(m_rows, k), fmt, scale_layout=layout, a_offsets=a_offsets)
    qw = moegemm.quantize_weights(torch.randn(e_count, n, k), fmt, scale_layout=layout)
    expert_scales = torch.rand(e_count) + 0.5
    row_scales = torch.rand(m_rows) + 0.5
    got = moegemm.reference.grouped_matmul(
        qa.data, qw.data, qa.scales, qw.scales, a_offsets, expert_ids, fmt=fmt, scale_layout=layout,
        expert_scales=expert_scales, row_scales=row_scales, out_dtype=torch.float32, compute_dtype=torch.float64,
    )
    a_vals = element_values(qa.data, f.a.element.name)
    b_vals = element_values(qw.data, f.b.element.name)
    vec = f.scale_vec
    bounds = a_offsets.tolist()
    want = torch.zeros(m_rows, n, dtype=torch.float64)
    for g, e in enumerate(expert_ids.tolist()):
        if e < 0:
            continue
        for m in range(bounds[g], bounds[g + 1]):
            for col in range(n):
                acc = 0.0
                for kb in range(math.ceil(k / vec) if f.scaled else 1):
                    ks = slice(kb * vec, (kb + 1) * vec) if f.scaled else slice(0, k)
                    block = float((a_vals[m, ks] * b_vals[e, col, ks]).sum())
                    if f.scaled:
                        block *= sfa(qa, fmt, m, kb, a_offsets) * sfb(qw, fmt, e, col, kb)
                    acc += block
                want[m, col] = acc * float(expert_scales[e]) * float(row_scales[m])
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9)
    # rows before a_offsets[0], of the skipped slot [5, 9), and after a_offsets[G] stay zero
    assert bool((got[[0, 1, 5, 6, 7, 8, 9, 10]] == 0).all())
