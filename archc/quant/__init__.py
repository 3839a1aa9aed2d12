"""Quantized weights: the schemes (`schemes`), the tensor that keeps them quantized (`tensor`)."""

from archc.quant.schemes import BY_GGUF, SCHEMES, Scheme, is_quantized, scheme
from archc.quant.tensor import QTensor, Weight, dense, tensor_bytes

__all__ = ["BY_GGUF", "SCHEMES", "QTensor", "Scheme", "Weight", "dense", "is_quantized",
           "scheme", "tensor_bytes"]
