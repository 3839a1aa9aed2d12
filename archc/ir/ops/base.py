"""What an op is: its kind, its groups, and its one declaration (``OpDef``, made once with
``register``), which the verifier, printer, parser, passes, codegen and reference page all read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import sympy
import torch

from archc.dtypes import FLOAT_DTYPES
from archc.ir.attrs import REQUIRED, Attr, Attrs
from archc.ir.shapes import DTYPE_BYTES, Shape, numel


class Op(str, Enum):
    # graph boundary
    INPUT = "input"
    PARAM = "param"
    OUTPUT = "output"
    # views
    SPLIT_HEADS = "split_heads"
    MERGE_HEADS = "merge_heads"
    SLICE = "slice"
    LAST_TOKEN = "last_token"
    # as lowering emits them
    MATMUL = "matmul"
    ADD = "add"
    MUL = "mul"
    ACT = "act"
    SOFTMAX = "softmax"
    ROPE = "rope"
    REPEAT_KV = "repeat_kv"
    KV_CACHE = "kv_cache"
    SCORES = "scores"
    MASK = "mask"
    ALIBI = "alibi"
    REL_BIAS = "rel_bias"
    SCORE_MOD = "score_mod"
    NORMALIZE = "normalize"
    WEIGHTED_SUM = "weighted_sum"
    HEAD_LINEAR = "head_linear"
    # both: lowering emits them plainly, passes fuse more into them
    EMBEDDING = "embedding"
    NORM = "norm"
    POINTWISE = "pointwise"
    ROUTER = "router"
    MOE_LINEAR = "moe_linear"
    CAUSAL_CONV = "causal_conv"
    SSM_SCAN = "ssm_scan"
    LINEAR_ATTENTION = "linear_attention"
    DELTA_RULE = "delta_rule"
    # what the passes leave
    FUSED_LINEAR = "fused_linear"
    ATTENTION = "attention"
    # collectives: what sharded programs exchange between ranks
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    RING_PASS = "ring_pass"


# Group sets: patterns, cost reports and codegen key on these, not on long lists of ops.
META = frozenset({Op.INPUT, Op.PARAM, Op.OUTPUT})
VIEW = frozenset({Op.SPLIT_HEADS, Op.MERGE_HEADS, Op.SLICE, Op.LAST_TOKEN})
ELEMENTWISE = frozenset({Op.ADD, Op.MUL, Op.ACT, Op.POINTWISE})
POINTWISE = ELEMENTWISE | {Op.ROPE, Op.MASK, Op.ALIBI, Op.REL_BIAS, Op.SCORE_MOD}
REDUCTION = frozenset({Op.NORM, Op.SOFTMAX, Op.NORMALIZE})
MATMUL = frozenset({Op.MATMUL, Op.SCORES, Op.WEIGHTED_SUM, Op.HEAD_LINEAR, Op.FUSED_LINEAR,
                    Op.MOE_LINEAR})
# ops whose kernels write rows through an epilogue chain of steps
ROW_KERNELS = frozenset({Op.FUSED_LINEAR, Op.NORM, Op.MOE_LINEAR})
# recurrent mixers: they read and update a per-layer state (conv window, SSM state, sums)
RECURRENT = frozenset({Op.CAUSAL_CONV, Op.SSM_SCAN, Op.LINEAR_ATTENTION, Op.DELTA_RULE})
# collectives: they move data between the ranks of a group; no fusion crosses one, their bytes
# go over the link between GPUs, not to memory
COLLECTIVE = frozenset({Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.RING_PASS})


def is_compute(op: Op) -> bool:
    """Does a node of this op become a kernel (as opposed to a boundary or a view)?"""
    return op not in META and op not in VIEW


class ShapeError(ValueError):
    """A shape, dtype or attribute rule refused a node; the caller names the node."""


# ---- operands and what rules see -------------------------------------------------------------

RolesFn = Callable[[Mapping[str, Any], int], list[str]]


def operands(*spec: str | tuple[str, str]) -> RolesFn:
    """Operand roles in order: a name, or (name, attr) for one present when `attr` is true."""
    return lambda attrs, n: [s if isinstance(s, str) else s[0] for s in spec
                             if isinstance(s, str) or attrs.get(s[1])]


@dataclass(frozen=True)
class Sig:
    """What op rules see of a node: its inputs by role (shape and dtype), its attributes with
    defaults filled in, and (for costs) the output."""

    shapes: tuple[Shape, ...]
    dtypes: tuple[str, ...]
    attrs: Attrs
    roles: tuple[str, ...] = ()
    out_shape: Shape = ()
    out_dtype: str = "f32"

    def attr(self, name: str, default: Any = None) -> Any:
        v = self.attrs.get(name)
        return default if v is None else v

    def has(self, role: str) -> bool:
        return role in self.roles

    def shape(self, role: str) -> Shape:
        return self.shapes[self.roles.index(role)]

    def dtype(self, role: str) -> str:
        return self.dtypes[self.roles.index(role)]


class EagerCtx(Protocol):
    """What eager semantics may read besides their inputs: the KV cache and the recurrent state
    of each layer (zeros at P = 0, so a prefill starts fresh)."""

    def cache_append(self, layer: int, kind: str, x: torch.Tensor,
                     quant: str | None = None) -> torch.Tensor: ...
    def cache_read(self, layer: int, kind: str) -> torch.Tensor: ...
    def state_read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor: ...
    def state_write(self, layer: int, kind: str, value: torch.Tensor) -> None: ...
    def comm(self, group: str) -> Any: ...   # archc.runtime.comm.Comm of group "tp" or "cp"
    def paged_write(self, layer: int, kind: str, x: torch.Tensor, positions: torch.Tensor,
                    table: torch.Tensor) -> None: ...
    def paged_pool(self, layer: int, kind: str) -> torch.Tensor: ...


Args = dict[str, torch.Tensor]       # a node's inputs by role
CostFn = Callable[[Sig], sympy.Expr]


@dataclass(frozen=True)
class StateDecl:
    """A layer's recurrent state tensor `kind` ("conv", "ssm", "S", "z"), shape leading with B."""

    kind: str
    shape: Shape
    dtype: str

    @property
    def bytes(self) -> sympy.Expr:
        return numel(self.shape) * DTYPE_BYTES[self.dtype]


def io_bytes(sig: Sig) -> sympy.Expr:
    """Default traffic: every input read once, the output written once."""
    return sympy.Add(*(numel(s) * DTYPE_BYTES[d] for s, d in
                       zip((*sig.shapes, sig.out_shape), (*sig.dtypes, sig.out_dtype))))


def per_element(k: int) -> CostFn:
    return lambda sig: k * numel(sig.out_shape)


zero = per_element(0)


@dataclass(frozen=True)
class OpDef:
    op: Op
    summary: str
    example: str
    roles: RolesFn
    infer: Callable[[Sig], tuple[Shape, str]]
    eager: Callable[[EagerCtx, Args, Attrs], torch.Tensor]
    attrs: tuple[Attr, ...] = ()
    flops: CostFn = zero
    bytes: CostFn = io_bytes          # state traffic is added by the cost model
    states: Callable[[Sig], tuple[StateDecl, ...]] = lambda sig: ()
    template: str | None = None          # kernel-level: the template it renders with
    docs: Mapping[str, str] = field(default_factory=dict)   # what each operand role holds
    commutative: bool = False            # its first two operands may be swapped
    arity: tuple[int, int] = (0, -1)     # for the reference: fewest and most inputs (-1: any)
    quantized: tuple[str, ...] = ()      # operand roles that may be a quantized weight

    @functools.cached_property
    def defaults(self) -> dict[str, Any]:
        """The default of each attribute that may be absent (None: no value)."""
        return {a.name: a.default for a in self.attrs if a.default is not REQUIRED}


OP_TABLE: dict[Op, OpDef] = {}


def register(d: OpDef) -> None:
    if d.op in OP_TABLE:
        raise ValueError(f"op {d.op.value} declared twice")
    OP_TABLE[d.op] = d


@functools.lru_cache(maxsize=65536)
def full_attrs(op: Op, attrs: Attrs) -> Attrs:
    """`attrs` with the op's defaults filled in (what rules and eager semantics read)."""
    defaults = OP_TABLE[op].defaults
    return Attrs({**defaults, **attrs}) if defaults else attrs


def canonical(op: Op, attrs: Mapping[str, Any]) -> Attrs:
    """`attrs` without None values and without values equal to (and typed as) their defaults."""
    defaults = OP_TABLE[op].defaults
    return Attrs({k: v for k, v in attrs.items() if v is not None
                  and not (v == defaults.get(k) and type(v) is type(defaults.get(k)))})


def attr_problems(op: Op, attrs: Attrs) -> list[str]:
    """What is wrong with a node's attributes: unknown, missing or ill-typed ones."""
    declared = {a.name: a for a in OP_TABLE[op].attrs}
    return [f"unknown attribute {k} (allowed: {', '.join(declared) or 'none'})" for k in attrs
            if k not in declared] + \
        [f"{k} {p}" for k, a in declared.items() if (p := a.problem(attrs.get(k)))]


def roles_of(op: Op, attrs: Mapping[str, Any], n: int) -> list[str]:
    """The operand roles of a node of `op` with (full) `attrs` and `n` inputs."""
    return OP_TABLE[op].roles(attrs, n)


def make_sig(op: Op, shapes: Sequence[Shape], dtypes: Sequence[str], attrs: Attrs,
             out_shape: Shape = (), out_dtype: str = "f32") -> Sig:
    full = full_attrs(op, attrs)
    roles = roles_of(op, full, len(shapes))
    if len(roles) != len(shapes):
        raise ShapeError(f"{op.value} takes {', '.join(roles) or 'no inputs'}, got "
                         f"{len(shapes)} inputs")
    return Sig(tuple(shapes), tuple(dtypes), full, tuple(roles), out_shape, out_dtype)


def bind(op: Op, attrs: Attrs, xs: Sequence[torch.Tensor]) -> Args:
    return dict(zip(roles_of(op, attrs, len(xs)), xs))


# ---- helpers shared by shape rules ---------------------------------------------------------

def same_dim(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.expand(a - b) == 0


def same_shape(a: Shape, b: Shape) -> bool:
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ShapeError(message)


def broadcast(a: Shape, b: Shape) -> Shape:
    """Numpy broadcasting of two symbolic shapes."""
    n = max(len(a), len(b))
    pairs = list(zip((1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)))
    require(all(x == 1 or y == 1 or same_dim(x, y) for x, y in pairs),
            f"shapes {list(a)} and {list(b)} do not broadcast")
    return tuple(sympy.sympify(y if x == 1 else x) for x, y in pairs)


def float_dtype(sig: Sig, i: int = 0) -> str:
    require(sig.dtypes[i] in FLOAT_DTYPES, f"input {i} is {sig.dtypes[i]}, not a float")
    return sig.dtypes[i]


def same_as_input(sig: Sig) -> tuple[Shape, str]:
    return sig.shapes[0], sig.dtypes[0]


def vector(sig: Sig, role: str, width: sympy.Expr) -> None:
    s = sig.shape(role)
    require(len(s) == 1 and same_dim(s[0], width), f"{role} {list(s)} must be [{width}]")


LAYER = Attr("layer", int, at_least=0)
