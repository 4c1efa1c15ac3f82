"""moegemm: grouped block-scaled matmuls for Mixture-of-Experts layers (PyTorch + Triton)."""

from . import codecs, distributed, hf, layouts, reference, routing
from . import library  # registers the torch.library custom ops  # noqa: F401
from .formats import FORMATS, Format, get_format
from .activation import gather_quantize, interleave_gate_up, swiglu_quantize
from .moe import MoE, moe_forward, select_experts
from .ops import BACKENDS, available_backends, grouped_matmul, grouped_matmul_swiglu
from .quantize import QuantizedTensor, dequantize, dequantize_operand, quantize, quantize_weights
from .routing import RoutingPlan, route, permute_tokens, unpermute_tokens

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
    "quantize",
    "quantize_weights",
    "reference",
    "route",
    "routing",
    "select_experts",
    "swiglu_quantize",
    "unpermute_tokens",
]
