"""A uniform view of a linear layer, whether it is still `matmul` (+ `bias_add`) or already a
`fused_linear` with a prologue and an epilogue chain — so passes can rewrite either.

    Linear(root, operands, weight, prologue, eps, steps)

``root`` is the node whose value the view stands for (the `bias_add` when a bias is looked
through), ``steps`` the epilogue, each with the extra inputs it reads. ``emit`` builds the
`fused_linear` node of a view.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from archc.ir.attrs import Call
from archc.ir.ops import Op
from archc.ir.ops.fused import EPILOGUE
from archc.passes.rewrite import Rewriter

LINEAR = frozenset({Op.MATMUL, Op.FUSED_LINEAR})
NORMS = frozenset({Op.RMSNORM, Op.LAYERNORM})


@dataclass(frozen=True)
class Step:
    call: Call
    inputs: tuple[int, ...] = ()

    @property
    def fn(self) -> str:
        return self.call.fn

    def kw(self, name: str, default: Any = None) -> Any:
        return self.call.kw(name, default)


def step(fn: str, /, *inputs: int, **kw: Any) -> Step:
    """An epilogue step; keyword arguments sorted so equal steps compare equal."""
    return Step(Call(fn, (), tuple(sorted(kw.items()))), tuple(inputs))


@dataclass(frozen=True)
class Linear:
    root: int                          # the node whose value this is
    operands: tuple[int, ...]          # x, or x1 and x2 concatenated along K
    weight: int
    prologue: str | None = None        # row statistics of a folded norm: "rms" | "layer"
    eps: float | None = None
    steps: tuple[Step, ...] = ()
    covers: tuple[int, ...] = ()       # the nodes it stands for: matmul [, bias_add]

    @property
    def x(self) -> int:
        return self.operands[0]

    def then(self, *steps: Step) -> Linear:
        return dataclasses.replace(self, steps=self.steps + steps)

    def replace(self, **changes: Any) -> Linear:
        return dataclasses.replace(self, **changes)


def merged_name(names: Sequence[str]) -> str:
    """layers.0.attn.q.weight + layers.0.attn.k.weight → layers.0.attn.q+k.weight"""
    parts = [n.split(".") for n in names]
    prefix = os.path.commonprefix(parts)
    rest = [p[len(prefix):] for p in parts]
    suffix = rest[0][-1:] if all(r and r[-1:] == rest[0][-1:] for r in rest) else []
    middles = [".".join(r[:len(r) - len(suffix)]) or "_" for r in rest]
    return ".".join(prefix + ["+".join(middles)] + suffix)


def view(rw: Rewriter, i: int, *, through_bias: bool = True) -> Linear | None:
    """The linear layer computed by node i, or None. A `bias_add` over a matmul read by nothing
    else is seen as the matmul with a `bias` step."""
    n = rw.node(i)
    if n.op == Op.MATMUL:
        return Linear(i, (n.inputs[0],), n.inputs[1], covers=(i,))
    if n.op == Op.FUSED_LINEAR:
        k = 2 if n.attr("concat_k") else 1
        rest = list(n.inputs[k + 1:])
        steps = []
        for call in n.attr("epilogue", ()):
            m = EPILOGUE[call.fn].inputs
            steps.append(Step(call, tuple(rest[:m])))
            rest = rest[m:]
        return Linear(i, tuple(n.inputs[:k]), n.inputs[k], n.attr("prologue"), n.attr("eps"),
                      tuple(steps), covers=(i,))
    if through_bias and n.op == Op.BIAS_ADD:
        inner = view(rw, n.inputs[0], through_bias=False)
        if inner is None or rw.users(inner.root) != [i]:
            return None
        return inner.replace(root=i, covers=inner.covers + (i,)).then(
            Step(Call("bias"), (n.inputs[1],)))
    return None


def view_with_bias(rw: Rewriter, i: int) -> Linear | None:
    """The linear layer at node i, extended by the bias_add that alone reads it, if any."""
    lin = view(rw, i)
    if lin is None:
        return None
    users = rw.users(i)
    if len(users) == 1 and rw.op(users[0]) == Op.BIAS_ADD and rw.node(users[0]).inputs[0] == i:
        return view(rw, users[0]) or lin
    return lin


def emit(rw: Rewriter, lin: Linear, *, like: Sequence[int], at: int | None = None) -> int:
    """The `fused_linear` node of `lin`."""
    inputs = [*lin.operands, lin.weight]
    for s in lin.steps:
        inputs += s.inputs
    return rw.emit(Op.FUSED_LINEAR, inputs, like=like, at=at, prologue=lin.prologue,
                   eps=lin.eps, epilogue=tuple(s.call for s in lin.steps) or None,
                   concat_k=True if len(lin.operands) == 2 else None)


def replace_linear(rw: Rewriter, old: Linear, new: Linear) -> int:
    """Emit `new` in place of `old` (same value, more work fused in); returns its id."""
    i = emit(rw, new, like=list(old.covers))
    rw.replace(old.root, i)
    return i
