"""A uniform view of a linear layer, whether it is still `matmul` (+ a bias `add`) or already a
`fused_linear` with a prologue and an epilogue of steps — so passes can rewrite either — and the
one way to extend the epilogue of any kernel that writes rows (matmul, norm, expert matmul).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import archc.ir.expr as E
from archc.ir.attrs import Call
from archc.ir.graph import Node
from archc.ir.ops import Op
from archc.ir.ops.steps import STEPS
from archc.ir.ops.steps import step as step_call
from archc.passes.rewrite import Refusal, Rewriter
from archc.quant.schemes import SCHEMES

LINEAR = frozenset({Op.MATMUL, Op.FUSED_LINEAR})


@dataclass(frozen=True)
class Step:
    call: Call
    inputs: tuple[int, ...] = ()

    @property
    def fn(self) -> str:
        return self.call.fn


def step(fn: str, /, *inputs: int, **kw: Any) -> Step:
    """An epilogue step reading nodes `inputs` (keywords sorted: equal steps compare equal)."""
    return Step(step_call(fn, **kw), tuple(inputs))


def unary(n: Node) -> str | None:
    """`fn` when n is a pointwise `fn(x(0), …)` (a scale, a soft-cap): one input, one function."""
    e = n.attr("expr")
    return e.fn if n.op == Op.POINTWISE and len(n.inputs) == 1 and e.args == (E.x(0),) else None


def bias_of(rw: Rewriter, i: int) -> tuple[int, int] | None:
    """(value, bias) when node i adds a [N] parameter along the last dim of the value."""
    n = rw.nodes[i]
    if n.op != Op.ADD:
        return None
    for a, b in (n.inputs, n.inputs[::-1]):
        if rw.op(b) == Op.PARAM and len(rw.shape(b)) == 1 and rw.shape(a) == rw.shape(i):
            return a, b
    return None


def epilogue_steps(rw: Rewriter, i: int, taken: int) -> tuple[Step, ...]:
    """The epilogue of node i as steps with the nodes they read (after its `taken` operands)."""
    rest = iter(rw.nodes[i].inputs[taken:])
    return tuple(Step(call, tuple(islice(rest, len(STEPS[call.fn].inputs))))
                 for call in rw.nodes[i].attr("epilogue", ()))


@dataclass(frozen=True)
class Linear:
    root: int                          # the node whose value this is (a bias add looked through)
    operands: tuple[int, ...]          # x, or x1 and x2 concatenated along K
    weight: int
    prologue: str | None = None        # row statistics of a folded norm: "rms" | "layer"
    eps: float | None = None
    steps: tuple[Step, ...] = ()       # the epilogue, each step with the inputs it reads
    covers: tuple[int, ...] = ()       # the nodes it stands for: matmul [, bias_add]
    paired: bool = False               # weight rows in the order of the glu/rope step's pairs
    gain: int | None = None            # a [K] gain applied to x as it is read (a folded norm's)

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


def cat_params(rw: Rewriter, params: Sequence[int], dim: int, *, like: Sequence[int],
               at: int) -> int:
    """One parameter: `params` concatenated along `dim` at load time, named after them all.
    Quantized weights join along K only where each ends on a whole group of its scheme."""
    shape = list(rw.shape(params[0]))
    dtype = rw.nodes[params[0]].dtype
    if dtype in SCHEMES and dim % len(shape) == len(shape) - 1:
        align = SCHEMES[dtype].align
        if any(int(rw.shape(p)[-1]) % align for p in params[:-1]):
            raise Refusal(f"{dtype} weights join along K only at multiples of {align} "
                          f"elements; K = {[int(rw.shape(p)[-1]) for p in params]}")
    shape[dim] = sum(rw.shape(p)[dim] for p in params)
    return rw.add_param(merged_name([rw.nodes[p].name for p in params]),
                        E.call("cat", *map(rw.param_expr, params), dim=dim), shape,
                        rw.nodes[params[0]].dtype, like=like, at=at)


def view(rw: Rewriter, i: int, *, through_bias: bool = True) -> Linear | None:
    """The linear layer computed by node i, or None. A bias `add` over a matmul read by nothing
    else is seen as the matmul with a `bias` step."""
    n = rw.nodes[i]
    if n.op == Op.MATMUL:
        return Linear(i, (n.inputs[0],), n.inputs[1], covers=(i,))
    if n.op == Op.FUSED_LINEAR:
        k = 2 if n.attr("concat_k") else 1
        gain = n.inputs[k + 1] if n.attr("gain") else None
        return Linear(i, tuple(n.inputs[:k]), n.inputs[k], n.attr("prologue"), n.attr("eps"),
                      epilogue_steps(rw, i, k + 1 + (gain is not None)), covers=(i,),
                      paired=bool(n.attr("paired")), gain=gain)
    found = bias_of(rw, i) if through_bias else None
    inner = view(rw, found[0], through_bias=False) if found else None
    if inner is None or rw.users(inner.root) != [i]:
        return None
    return inner.replace(root=i, covers=inner.covers + (i,)).then(step("bias", found[1]))


def view_with_bias(rw: Rewriter, i: int) -> Linear | None:
    """The linear layer at node i, extended by the bias_add that alone reads it, if any."""
    lin = view(rw, i)
    users = rw.users(i)
    if lin is not None and len(users) == 1 and (bias_of(rw, users[0]) or (None,))[0] == i:
        return view(rw, users[0]) or lin
    return lin


def emit(rw: Rewriter, lin: Linear, *, like: Sequence[int], at: int | None = None) -> int:
    """The `fused_linear` node of `lin`."""
    inputs = [*lin.operands, lin.weight, *([] if lin.gain is None else [lin.gain]),
              *(j for s in lin.steps for j in s.inputs)]
    return rw.emit(Op.FUSED_LINEAR, inputs, like=like, at=at, prologue=lin.prologue, eps=lin.eps,
                   epilogue=tuple(s.call for s in lin.steps) or None,
                   concat_k=True if len(lin.operands) == 2 else None, paired=lin.paired or None,
                   gain=True if lin.gain is not None else None)


def extend(rw: Rewriter, i: int, new: Step, *, like: Sequence[int]) -> int:
    """Kernel node i (a matmul, fused_linear, norm or expert matmul) with `new` appended to its
    epilogue, as a new node for the caller to put in place; Refusal if it has no such step."""
    op = rw.op(i)
    if (Op.FUSED_LINEAR if op == Op.MATMUL else op) not in STEPS[new.fn].kernels:
        raise Refusal(f"{op.value} %{i} has no {new.fn}() epilogue step")
    lin = view(rw, i, through_bias=False)
    if lin is not None:
        return emit(rw, lin.then(new), like=[*lin.covers, *like])
    n = rw.nodes[i]
    return rw.emit(op, [*n.inputs, *new.inputs], like=[i, *like],
                   **n.attrs.replace(epilogue=(*n.attr("epilogue", ()), new.call)))


def norm_parts(rw: Rewriter, i: int) -> tuple[int, int, int | None]:
    """(x, gain, shift or None) of a plain norm node — no residual, no epilogue but its bias —
    whose gain and shift are parameters, so a pass can move them; Refusal otherwise."""
    n = rw.nodes[i]
    if n.attr("add_before"):
        raise Refusal(f"%{i} adds a residual before normalizing")
    steps = epilogue_steps(rw, i, 2)
    if [s.fn for s in steps] not in ([], ["bias"]):
        raise Refusal(f"%{i} has an epilogue ({', '.join(s.fn for s in steps)}) besides its "
                      "bias")
    shift = steps[0].inputs[0] if steps else None
    for p in (n.inputs[1], shift):
        if p is not None and rw.op(p) != Op.PARAM:
            raise Refusal(f"the gain or shift %{p} of %{i} is not a parameter")
    return n.inputs[0], n.inputs[1], shift
