"""What an op is: its kind, its group, and its one declaration (``OpDef``).

Every op is declared once, with ``register``: a summary, a one-line textual example, its arity and
attributes, a shape/dtype rule, its eager semantics in torch, and its FLOP and byte counts as sympy
expressions over B, T, P, S. Nothing else in archc keeps a list of ops that must be kept in sync.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import sympy
import torch

from archc.ir.attrs import Attrs
from archc.ir.shapes import DTYPE_BYTES, Shape, numel


class Op(str, Enum):
    # graph boundary
    INPUT = "input"
    PARAM = "param"
    OUTPUT = "output"
    # unfused, as lowering emits them
    EMBEDDING = "embedding"
    MATMUL = "matmul"
    BIAS_ADD = "bias_add"
    ADD = "add"
    MUL = "mul"
    SCALE = "scale"
    ACT = "act"
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    SOFTCAP = "softcap"
    SOFTMAX = "softmax"
    SPLIT_HEADS = "split_heads"
    MERGE_HEADS = "merge_heads"
    SLICE = "slice"
    ROPE = "rope"
    REPEAT_KV = "repeat_kv"
    KV_CACHE = "kv_cache"
    SCORES = "scores"
    MASK = "mask"
    ALIBI = "alibi"
    REL_BIAS = "rel_bias"
    WEIGHTED_SUM = "weighted_sum"
    ROUTER = "router"
    MOE_EXPERTS = "moe_experts"
    CONV1D = "conv1d"
    SELECTIVE_SCAN = "selective_scan"
    LINEAR_SCAN = "linear_scan"
    # kernel-level, as passes leave them
    FUSED_LINEAR = "fused_linear"
    ATTENTION = "attention"
    NORM = "norm"
    POINTWISE = "pointwise"
    MOE_LINEAR = "moe_linear"
    TOPK_ROUTER = "topk_router"
    CAUSAL_CONV = "causal_conv"
    SSM_SCAN = "ssm_scan"
    LINEAR_ATTENTION = "linear_attention"


# Group sets: patterns, cost reports and codegen key on these, not on long lists of ops.
META = frozenset({Op.INPUT, Op.PARAM, Op.OUTPUT})
VIEW = frozenset({Op.SPLIT_HEADS, Op.MERGE_HEADS, Op.SLICE})
POINTWISE = frozenset({Op.BIAS_ADD, Op.ADD, Op.MUL, Op.SCALE, Op.ACT, Op.SOFTCAP, Op.ROPE,
                       Op.MASK, Op.ALIBI, Op.REL_BIAS, Op.POINTWISE})
REDUCTION = frozenset({Op.LAYERNORM, Op.RMSNORM, Op.SOFTMAX, Op.NORM})
MATMUL = frozenset({Op.MATMUL, Op.SCORES, Op.WEIGHTED_SUM, Op.FUSED_LINEAR, Op.MOE_EXPERTS,
                    Op.MOE_LINEAR})
KERNEL_LEVEL = frozenset({Op.FUSED_LINEAR, Op.ATTENTION, Op.NORM, Op.POINTWISE, Op.MOE_LINEAR,
                          Op.TOPK_ROUTER, Op.CAUSAL_CONV, Op.SSM_SCAN, Op.LINEAR_ATTENTION})
# Recurrent mixers: they read and update a per-layer state (conv window, SSM state, running sums).
RECURRENT = frozenset({Op.CONV1D, Op.SELECTIVE_SCAN, Op.LINEAR_SCAN, Op.CAUSAL_CONV, Op.SSM_SCAN,
                       Op.LINEAR_ATTENTION})


def is_compute(op: Op) -> bool:
    """Does a node of this op become a kernel (as opposed to a boundary or a view)?"""
    return op not in META and op not in VIEW


class ShapeError(ValueError):
    """A shape or dtype rule refused its inputs; the caller names the node."""


@dataclass(frozen=True)
class Sig:
    """What a rule sees of a node: input shapes and dtypes, attrs, and (for costs) the
    output."""

    shapes: tuple[Shape, ...]
    dtypes: tuple[str, ...]
    attrs: Attrs
    out_shape: Shape = ()
    out_dtype: str = "f32"

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)


class EagerCtx(Protocol):
    """What eager semantics may read besides their inputs: concrete dims, the KV cache and the
    recurrent state of each layer (zeros at P = 0, so a prefill starts fresh)."""

    dims: Mapping[str, int]

    def cache_append(self, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor: ...

    def cache_read(self, layer: int, kind: str) -> torch.Tensor: ...

    def state_read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor: ...

    def state_write(self, layer: int, kind: str, value: torch.Tensor) -> None: ...


InferFn = Callable[[Sig], tuple[Shape, str]]
EagerFn = Callable[[EagerCtx, Sequence[torch.Tensor], Attrs], torch.Tensor]
CostFn = Callable[[Sig], sympy.Expr]


def io_bytes(sig: Sig) -> sympy.Expr:
    """Default traffic: every input read once, the output written once."""
    total: sympy.Expr = numel(sig.out_shape) * DTYPE_BYTES[sig.out_dtype]
    for s, d in zip(sig.shapes, sig.dtypes):
        total += numel(s) * DTYPE_BYTES[d]
    return total


def zero(sig: Sig) -> sympy.Expr:
    return sympy.Integer(0)


def per_element(k: int) -> CostFn:
    def flops(sig: Sig) -> sympy.Expr:
        return k * numel(sig.out_shape)
    return flops


@dataclass(frozen=True)
class OpDef:
    op: Op
    summary: str
    example: str
    arity: tuple[int, int]              # min, max inputs (max -1: any)
    infer: InferFn
    eager: EagerFn
    flops: CostFn = zero
    bytes: CostFn = io_bytes
    attrs: tuple[str, ...] = ()          # required
    optional: tuple[str, ...] = ()       # allowed besides the required
    extra: dict[str, Any] = field(default_factory=dict)


OP_TABLE: dict[Op, OpDef] = {}


def register(d: OpDef) -> OpDef:
    if d.op in OP_TABLE:
        raise ValueError(f"op {d.op.value} declared twice")
    OP_TABLE[d.op] = d
    return d


# ---- helpers shared by shape rules ---------------------------------------------------------

def same_dim(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.expand(a - b) == 0


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ShapeError(message)


def broadcast(a: Shape, b: Shape) -> Shape:
    """Numpy broadcasting of two symbolic shapes."""
    out: list[sympy.Expr] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else sympy.Integer(1)
        y = b[-i] if i <= len(b) else sympy.Integer(1)
        if x == 1:
            out.append(y)
        elif y == 1 or same_dim(x, y):
            out.append(x)
        else:
            raise ShapeError(f"shapes {list(a)} and {list(b)} do not broadcast")
    return tuple(reversed(out))


def float_dtype(sig: Sig, i: int = 0) -> str:
    require(sig.dtypes[i] in ("f32", "f16", "bf16"), f"input {i} is {sig.dtypes[i]}, "
            "not a float")
    return sig.dtypes[i]


def same_as_input(sig: Sig) -> tuple[Shape, str]:
    return sig.shapes[0], sig.dtypes[0]
