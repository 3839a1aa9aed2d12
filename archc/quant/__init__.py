"""Quantized weights: the schemes (`schemes`), the tensor that keeps them quantized (`tensor`)."""

from archc.quant.schemes import BY_GGUF, SCHEMES, Scheme, is_quantized, scheme
from archc.quant.tensor import QTensor, Weight, by_rows, dense, linear, tensor_bytes

__all__ = ["BY_GGUF", "SCHEMES", "QTensor", "Scheme", "Weight", "by_rows", "dense",
           "is_quantized", "linear", "scheme", "tensor_bytes"]
