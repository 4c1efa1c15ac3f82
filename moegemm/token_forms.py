"""The token forms that the sm90 block-format kernels read, so the kernels that make the tokens can write them.

The sm90 kernels for mxfp8, mxfp4 and w4a8 do not read the format's A operand as it is:

    promotion kernels (Mxfp8Config, E2m1Config: kernels/sm90/mxfp8.py, kernels/sm90/e2m1.py)
        e4m3 tokens: mxfp4's e2m1 values times 2^6 (every such product is an e4m3 value, so
        the k32 sums stay exact); with e2m1 weights each group of 8 elements of K in the
        order 0 2 4 6 1 3 5 7, the order the kernel decodes the weights into.
        fp32 token scales, K-block-major [num_k_scales, B * ceil(M / B) + B * G] (B, the column
        block: 4, or 16 for mxfp8's wide tiles): slot g's row s + r at column
        B * ceil(s / B) + B * g + r (s: the slot's first row), so that TMA boxes start 16-byte
        aligned (tokens.decode_row_scales, kb_major); with B = 16 each 16 rows of a slot are
        stored in the order of the wgmma accumulator's columns a thread holds (kb_major_column):
        the wide tiles load a thread's four scales of 16 tokens with one 128-bit load. Only the
        tiles that take their token scales through the ring (64 tokens or more, and e2m1
        weights) read this layout.
    decoding kernel (kernels/sm90/decode.py)
        the tokens dequantized to bf16 (tokens.dequantize_rows).

Called on their own, the kernels build that form with a pre-pass over A. In the MoE layer the
kernel that makes the tokens writes it directly: gather_quantize, scatter_quantize and
swiglu_quantize (token_quantizers.py) take a TokenForm as their scale_layout and return a
QuantizedTensor in that layout, which grouped_matmul and grouped_matmul_swiglu take as `a` on
the sm90 backend: one launch and one pass over the tokens less per product. The values are
those of the format's operand, bit for bit (tests/test_token_forms.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import codecs
from .config import sm90_mx_config
from .formats import Format
from .layouts import ScaleLayout
from .sm90_configs import DecodeConfig, E2m1Config

__all__ = ["KernelTokens", "TokenForm", "token_form", "dequantize_tokens"]

# Formats whose A operand has e8m0 scales a token-making kernel can write in a kernel's form.
# The weight-only formats need none: their A operand is bf16 tokens as they are, the content of
# the bf16 form.
FORM_FORMATS = ("mxfp8", "mxfp4", "w4a8")
# e2m1 tokens enter the promotion kernel times 2^6 (kernels/sm90/e2m1.py, E2M1_WEIGHT_EXP).
E2M1_TOKEN_EXP = 6


@dataclass(frozen=True)
class TokenForm(ScaleLayout):
    """kind "e4m3" (promotion kernel: exponent, even_odd and the scales' column_block as above) or
    "bf16" (decoding kernel). A ScaleLayout (layouts.py): the scale_layout of tokens in this form."""

    kind: str
    exponent: int = 0
    even_odd: bool = False
    column_block: int = 4
    name = "token form"

    @property
    def form(self) -> TokenForm:
        return self

    @property
    def argument(self) -> TokenForm:
        return self


class KernelTokens(NamedTuple):
    """Tokens in a TokenForm as the sm90 launch takes them (kernels/sm90, LaunchArgs.tokens): data
    e4m3 or bf16 [M, K]; scales fp32 K-block-major for "e4m3", None for "bf16". Rows outside
    every slot hold unspecified data. Callers above the kernels hold the same tokens as a
    QuantizedTensor whose scale_layout is the TokenForm. (A NamedTuple: made on every launch of
    tokens in a form, and a frozen dataclass costs several times as much to make.)"""

    form: TokenForm
    data: torch.Tensor
    scales: torch.Tensor | None


def token_form(fmt: Format, n: int, k: int, rows: int, groups: int, prepacked: bool = False) -> TokenForm | None:
    """The form the sm90 kernel of a product of format fmt (N, K, rows of A over `groups` slots;
    `prepacked` weights) reads its tokens in, or None where a token-making kernel cannot write it
    (other formats, and mxfp8's narrow promotion tiles, which read row-major scales padded by
    stage: their pre-pass stays)."""
    if fmt.name not in FORM_FORMATS or rows == 0 or groups == 0 or k % 32:
        return None
    cfg = sm90_mx_config(fmt, n, k, rows / groups, prepacked=prepacked)
    if isinstance(cfg, DecodeConfig):
        return TokenForm("bf16")
    e2m1_weights = isinstance(cfg, E2m1Config)
    if not (e2m1_weights or cfg.wide):
        return None
    return TokenForm("e4m3", exponent=E2M1_TOKEN_EXP if fmt.a.element.packed else 0, even_odd=e2m1_weights,
                     column_block=4 if e2m1_weights else ACC_ORDER_BLOCK)


# The wide mxfp8 tiles' scale columns: 16-aligned slots, each 16 tokens in accumulator order.
ACC_ORDER_BLOCK = 16


def kb_major_columns(rows: int, groups: int, column_block: int = 4) -> int:
    """Columns of the K-block-major token scales of `rows` rows in `groups` slots; ValueError for
    a column block other than 4 and ACC_ORDER_BLOCK (the two the kernels write and read)."""
    if column_block not in (4, ACC_ORDER_BLOCK):
        raise ValueError(f"column_block: 4 or {ACC_ORDER_BLOCK}, got {column_block}")
    return column_block * (-(-rows // column_block) + groups)


def kb_major_column(r: int, s: int, g: int, column_block: int = 4) -> int:
    """Column of row s + r of slot g (first row s) in the K-block-major token scales.

    column_block 16: a thread of the wgmma accumulator (lane % 4 = c) holds the columns 2c, 2c + 1,
    2c + 8 and 2c + 9 of each 16; they are stored at 4c .. 4c + 3, i.e. r = 16b + 8h + 2c + l
    goes to 16b + 4c + 2h + l (the tl twin: _portable_tl.kb_major_column)."""
    base = column_block * (-(-s // column_block) + g)
    if column_block == ACC_ORDER_BLOCK:
        r = (r & ~15) | ((r & 6) << 1) | ((r & 8) >> 2) | (r & 1)
    return base + r


def dequantize_tokens(data: torch.Tensor, scales: torch.Tensor | None, form: TokenForm, a_offsets: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of tokens in `form` ([M, K], K in the format's order): rows of every slot of
    a_offsets decoded (those of slots the writer skipped are unspecified), other rows zero."""
    m, k = data.shape
    rows = torch.arange(m, device=data.device)
    offsets = a_offsets.long().clamp(0, m)
    groups = offsets.numel() - 1
    slot = torch.searchsorted(offsets[1:], rows, right=True).clamp(max=max(groups - 1, 0))
    inside = (rows >= offsets[0]) & (rows < offsets[-1]) if groups else torch.zeros_like(rows, dtype=torch.bool)
    if form.kind == "bf16":
        values = data.to(dtype)
    else:
        values = codecs.decode_e4m3(data.view(torch.float8_e4m3fn)) * 2.0 ** -form.exponent
        if form.even_odd:  # stored order 0 2 4 6 1 3 5 7 within each 8 elements
            values = values.reshape(m, k // 8, 2, 4).transpose(-1, -2).reshape(m, k)
        start = offsets[slot]
        columns = kb_major_column((rows - start).clamp(min=0), start, slot, form.column_block)
        columns = torch.where(inside, columns, torch.zeros_like(columns))
        row_scales = scales.t().index_select(0, columns)  # [M, num_k_scales]
        values = (values * row_scales.repeat_interleave(32, dim=1)[:, :k]).to(dtype)
    return torch.where(inside[:, None], values, torch.zeros_like(values))
