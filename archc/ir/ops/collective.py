"""Collectives: the ops a sharded program exchanges data with, between the ranks of one group —
"tp" (tensor parallel: ranks hold slices of every layer's weights) or "cp" (context parallel:
ranks hold slices of the sequence). Each names its group and the group's size; its eager
semantics call the group's communicator (``archc.runtime.comm``); its bytes are those one rank
moves over the link (ring algorithms: an all-reduce of n bytes over N ranks sends and receives
2·(N − 1)/N·n), which the cost model keeps apart from memory traffic.
"""

from __future__ import annotations

import sympy

from archc.ir.attrs import Attr
from archc.ir.ops.base import (
    Args,
    EagerCtx,
    Op,
    OpDef,
    Sig,
    float_dtype,
    operands,
    register,
    require,
)
from archc.ir.shapes import DTYPE_BYTES, Shape, numel

GROUP = Attr("group", str, choices=("tp", "cp"))
RANKS = Attr("ranks", int, at_least=1)
DIM = Attr("dim", int, -1)


def _axis(sig: Sig) -> int:
    """The dim a gather or scatter works along, counted from the front."""
    rank = len(sig.shapes[0])
    dim = sig.attr("dim")
    require(-rank <= dim < rank, f"dim {dim} outside a {rank}-d value")
    return dim % rank


def _same(sig: Sig) -> tuple[Shape, str]:
    return sig.shapes[0], float_dtype(sig)


def _gathered(sig: Sig) -> tuple[Shape, str]:
    x, d = sig.shapes[0], _axis(sig)
    return (*x[:d], x[d] * sig.attr("ranks"), *x[d + 1:]), float_dtype(sig)


def _scattered(sig: Sig) -> tuple[Shape, str]:
    x, d, n = sig.shapes[0], _axis(sig), sig.attr("ranks")
    require(isinstance(x[d], sympy.Integer) and int(x[d]) % n == 0,
            f"dim {d} of {list(x)} does not split into {n} equal parts")
    return (*x[:d], x[d] / n, *x[d + 1:]), float_dtype(sig)


def _value_bytes(shape: Shape, dtype: str) -> sympy.Expr:
    return numel(shape) * DTYPE_BYTES[dtype]


def _share(sig: Sig) -> sympy.Expr:
    """(N − 1)/N: the part of the whole a rank sends (and receives) in a ring collective."""
    n = sig.attr("ranks")
    return sympy.Rational(n - 1, n)


def _collective(op: Op, summary: str, example: str, infer, eager, link, *extra: Attr,  # noqa: ANN001
                ) -> None:
    register(OpDef(op, summary, example, operands("x"), infer, eager,
                   attrs=(GROUP, RANKS, *extra), bytes=link, arity=(1, 1),
                   docs={"x": "this rank's value"}))


def _comm(ctx: EagerCtx, at: dict) -> object:
    comm = ctx.comm(at["group"])
    if comm.size != at["ranks"]:
        raise ValueError(f"the program is sharded over {at['ranks']} {at['group']} ranks; this "
                         f"run has {comm.size}")
    return comm


def _all_reduce(ctx: EagerCtx, a: Args, at: dict) -> object:
    return _comm(ctx, at).all_reduce(a["x"])


def _all_gather(ctx: EagerCtx, a: Args, at: dict) -> object:
    return _comm(ctx, at).all_gather(a["x"], at["dim"])


def _reduce_scatter(ctx: EagerCtx, a: Args, at: dict) -> object:
    return _comm(ctx, at).reduce_scatter(a["x"], at["dim"])


def _ring_pass(ctx: EagerCtx, a: Args, at: dict) -> object:
    return _comm(ctx, at).ring_pass([a["x"]])[0]


_collective(Op.ALL_REDUCE, "The sum over the group's ranks of x, on every rank (after a "
            "row-parallel matmul: each rank's partial product over its slice of K).",
            '%40 : f32[B,T,64] = all_reduce(%39) {group="tp", ranks=2}', _same, _all_reduce,
            lambda sig: 2 * _share(sig) * _value_bytes(sig.shapes[0], sig.dtypes[0]))
_collective(Op.ALL_GATHER, "Every rank's x concatenated along dim, in rank order, on every "
            "rank (a vocabulary-parallel head's logits).",
            '%60 : f32[B,T,96] = all_gather(%59) {group="tp", ranks=2}', _gathered, _all_gather,
            lambda sig: _share(sig) * _value_bytes(sig.out_shape, sig.dtypes[0]), DIM)
_collective(Op.REDUCE_SCATTER, "This rank's 1/ranks slice along dim of the sum over the group "
            "of x.", '%40 : f32[B,T,32] = reduce_scatter(%39) {group="tp", ranks=2}',
            _scattered, _reduce_scatter,
            lambda sig: _share(sig) * _value_bytes(sig.shapes[0], sig.dtypes[0]), DIM)
_collective(Op.RING_PASS, "x of the previous rank in the ring (rank r receives rank r − 1's and "
            "sends its own to r + 1): how ring attention circulates K/V blocks.",
            '%30 : f32[B,2,T,16] = ring_pass(%29) {group="cp", ranks=2}', _same, _ring_pass,
            lambda sig: _value_bytes(sig.shapes[0], sig.dtypes[0]))
