"""Every element type archc names, declared once: its IR name, torch dtype, bytes and Triton
type, and the codes a quantized KV cache stores. The IR's dtype bytes, the runtime's torch
dtypes, the kernels' pointer types and the quantized parts' storage all read this table.

IR values are f32, f16, bf16, i64, i32 and bool (a quantized weight's scheme is its dtype too:
``archc.ir.shapes``). The rest are storage only: the codes of a quantized KV cache (i8, f8e4m3)
and the parts of a quantized weight (i8, u8, f16, f32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str                     # as the IR prints it
    torch: torch.dtype | None     # None where this torch has none (float8 before torch 2.1)
    bytes: int
    triton: str                   # Triton's name: pointers are "*" + it
    value: bool = True            # an IR value may have it (else: storage only)
    floating: bool = False
    aliases: tuple[str, ...] = ()  # other spellings a user may give (torch's, the usual short)


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("f32", torch.float32, 4, "fp32", floating=True, aliases=("float32", "float", "fp32")),
    DType("f16", torch.float16, 2, "fp16", floating=True, aliases=("float16", "half", "fp16")),
    DType("bf16", torch.bfloat16, 2, "bf16", floating=True, aliases=("bfloat16",)),
    DType("i64", torch.int64, 8, "i64"),
    DType("i32", torch.int32, 4, "i32"),
    DType("bool", torch.bool, 1, "i1"),
    DType("i8", torch.int8, 1, "i8", value=False),
    DType("u8", torch.uint8, 1, "u8", value=False),
    DType("f8e4m3", getattr(torch, "float8_e4m3fn", None), 1, "fp8e4nv", value=False,
          floating=True),
)}
FLOAT_DTYPES = tuple(n for n, d in DTYPES.items() if d.value and d.floating)   # f32, f16, bf16
VALUE_BYTES = {n: d.bytes for n, d in DTYPES.items() if d.value}
TORCH_DTYPES: dict[str, torch.dtype] = {n: d.torch for n, d in DTYPES.items()
                                        if d.torch is not None}


def triton_pointer(name: str) -> str:
    """`*fp16`: the Triton type of a pointer to elements of dtype `name`."""
    return "*" + DTYPES[name].triton


@dataclass(frozen=True)
class KVCode:
    """How a quantized KV cache stores a row: codes of `dtype`, and one f32 scale
    = max|x| / qmax over the row (``archc.ir.ops.attention`` says why)."""

    dtype: str       # a key of DTYPES
    qmax: float      # the largest code

    @property
    def torch(self) -> torch.dtype | None:
        return DTYPES[self.dtype].torch


KV_CODES: dict[str, KVCode] = {"int8": KVCode("i8", 127.0), "fp8": KVCode("f8e4m3", 448.0)}
