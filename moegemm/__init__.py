"""moegemm: grouped block-scaled matmuls for Mixture-of-Experts layers (PyTorch + Triton)."""

from . import codecs, layouts, reference, routing
from .formats import FORMATS, Format, get_format
from .ops import BACKENDS, available_backends, grouped_matmul
from .quantize import QuantizedTensor, dequantize, dequantize_operand, quantize, quantize_weights
from .routing import RoutingPlan, route, permute_tokens, unpermute_tokens

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "FORMATS",
    "Format",
    "QuantizedTensor",
    "RoutingPlan",
    "available_backends",
    "codecs",
    "dequantize",
    "dequantize_operand",
    "get_format",
    "grouped_matmul",
    "layouts",
    "permute_tokens",
    "quantize",
    "quantize_weights",
    "reference",
    "route",
    "routing",
    "unpermute_tokens",
]
