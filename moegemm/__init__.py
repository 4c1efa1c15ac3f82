"""moegemm: grouped block-scaled matmuls for Mixture-of-Experts layers (PyTorch + Triton)."""

from . import (
                       codecs,
                       distributed,
                       hf,
                       layouts,
                       library,  # registers the torch.library custom ops  # noqa: F401
                       reference,
                       routing,
)
from .formats import FORMATS, Format, get_format
from .gate_up import interleave_gate_up
from .moe import MoE, moe_forward
from .ops import BACKENDS, available_backends, grouped_matmul, grouped_matmul_swiglu
from .quantize import (
                       dequantize,
                       dequantize_operand,
                       prepack_weights,
                       quantize_weights,
                       unpack_weights,
)
from .quantized_tensor import QuantizedTensor
from .routing import RoutingPlan, permute_tokens, route, select_experts, unpermute_tokens
from .token_quantizers import gather_quantize, quantize, swiglu_quantize

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "MoE",
    "FORMATS",
    "Format",
    "QuantizedTensor",
    "RoutingPlan",
    "available_backends",
    "codecs",
    "dequantize",
    "dequantize_operand",
    "distributed",
    "gather_quantize",
    "get_format",
    "grouped_matmul",
    "grouped_matmul_swiglu",
    "hf",
    "interleave_gate_up",
    "layouts",
    "moe_forward",
    "permute_tokens",
    "prepack_weights",
    "quantize",
    "quantize_weights",
    "reference",
    "route",
    "routing",
    "select_experts",
    "swiglu_quantize",
    "unpack_weights",
    "unpermute_tokens",
]
