"""The token forms that the sm90 block-format kernels read, so the kernels that make the tokens can write them.

The sm90 kernels for mxfp8, mxfp4 and w4a8 do not read the format's A operand as it is:

    promotion kernel (config fp8_mma, kernels/sm90_mxfp8.py)
        e4m3 tokens: mxfp4's e2m1 values times 2^6 (every such product is an e4m3 value, so
        the k32 sums stay exact); with e2m1 weights each group of 8 elements of K in the
        order 0 2 4 6 1 3 5 7, the order the kernel decodes the weights into.
        fp32 token scales, K-block-major [num_k_scales, 4 * ceil(M / 4) + 4 * G]: slot g's row m
        at column m - s + 4 * ceil(s / 4) + 4 * g (s: the slot's first row), so that TMA boxes
        start 16-byte aligned (portable.decode_row_scales, kb_major). Only the tiles that take
        their token scales through the ring (64 tokens or more, and e2m1 weights) read this layout.
    decoding kernel (kernels/sm90_mx.py)
        the tokens dequantized to bf16 (portable.dequantize_rows).

Called on their own, the kernels build that form with a pre-pass over A. In the MoE layer the
kernel that makes the tokens (gather + quantize, SwiGLU + quantize: activation.py) writes it
directly: one launch and one pass over the tokens less per product. The values are those of
the format's operand, bit for bit (tests/test_token_forms.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import sm90_mx_config
from .formats import get_format

__all__ = ["KernelTokens", "TokenForm", "token_form"]

# Formats whose A operand has e8m0 scales a token-making kernel can write in a kernel's form.
_FORM_FORMATS = ("mxfp8", "mxfp4", "w4a8")
# e2m1 tokens enter the promotion kernel times 2^6 (kernels/sm90_mxfp8.py, E2M1_WEIGHT_EXP).
E2M1_TOKEN_EXP = 6


@dataclass(frozen=True)
class TokenForm:
    """kind "e4m3" (promotion kernel: exponent and even_odd as above) or "bf16" (decoding kernel)."""

    kind: str
    exponent: int = 0
    even_odd: bool = False


@dataclass(frozen=True)
class KernelTokens:
    """Tokens in a TokenForm: data e4m3 bytes (uint8) or bf16 [M, K]; scales fp32 K-block-major
    for "e4m3", None for "bf16". Rows outside every slot hold unspecified data."""

    form: TokenForm
    data: torch.Tensor
    scales: torch.Tensor | None


def token_form(fmt_name: str, n: int, k: int, rows: int, groups: int) -> TokenForm | None:
    """The form the sm90 kernel of a product (N, K, rows of A over `groups` slots) reads its tokens
    in, or None where a token-making kernel cannot write it (other formats, and mxfp8's narrow
    promotion tiles, which read row-major scales padded by stage: their pre-pass stays)."""
    if fmt_name not in _FORM_FORMATS or rows == 0 or groups == 0 or k % 32:
        return None
    fmt = get_format(fmt_name)
    cfg = sm90_mx_config(fmt, n, k, rows / groups)
    if not cfg.fp8_mma:
        return TokenForm("bf16")
    e2m1_weights = fmt.b.element.packed
    if not (cfg.wide_promotion or e2m1_weights):
        return None
    return TokenForm("e4m3", exponent=E2M1_TOKEN_EXP if fmt.a.element.packed else 0, even_odd=e2m1_weights)


def kb_major_columns(rows: int, groups: int) -> int:
    """Columns of the K-block-major token scales of `rows` rows in `groups` slots."""
    return 4 * -(-rows // 4) + 4 * groups
