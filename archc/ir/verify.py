"""The verifier, run after lowering and after every pass; its errors show the node in text form.
Each node's attributes, operands, shape and dtype must be what its op declares and infers."""

from __future__ import annotations

from archc.errors import IRError
from archc.ir.graph import Graph, Program, infer
from archc.ir.ops import META, Op, ShapeError
from archc.ir.ops.base import attr_problems, same_shape
from archc.ir.paramexpr import PARAM_FNS, calls
from archc.ir.shapes import DTYPE_BYTES
from archc.ir.text import format_node


def _fail(g: Graph, i: int, problem: str) -> IRError:
    return IRError(f"verifier: graph {g.name}: {format_node(i, g.nodes[i])}: {problem}")


def verify_graph(g: Graph) -> None:
    seen: dict[tuple[Op, str], int] = {}
    for i, n in enumerate(g.nodes):
        if n.dtype not in DTYPE_BYTES:
            raise _fail(g, i, f"unknown dtype {n.dtype!r}")
        for j in n.inputs:
            if not 0 <= j < i:
                raise _fail(g, i, f"input %{j} is not an earlier node")
        if n.op in META:
            key = (n.op, n.name)
            if key in seen:
                raise _fail(g, i, f"{n.op.value} name {n.name!r} already used by %{seen[key]}")
            seen[key] = i
        if n.op in (Op.INPUT, Op.PARAM):
            problems = attr_problems(n.op, n.attrs) + [
                f"unknown parameter function {c.fn!r}" for c in calls(n.attr("expr"))
                if c.fn != "w" and c.fn not in PARAM_FNS]
            if problems:
                raise _fail(g, i, "; ".join(problems))
            continue
        try:
            shape, dtype = infer(n.op, [g.nodes[j].shape for j in n.inputs],
                                 [g.nodes[j].dtype for j in n.inputs], n.attrs)
        except ShapeError as err:
            raise _fail(g, i, str(err)) from None
        if not same_shape(shape, n.shape):
            raise _fail(g, i, f"shape should be {[str(s) for s in shape]}")
        if dtype != n.dtype:
            raise _fail(g, i, f"dtype should be {dtype}")
    if not g.ids(Op.OUTPUT):
        raise IRError(f"verifier: graph {g.name} has no output")


def verify(p: Program) -> None:
    names = [g.name for g in p.graphs]
    if len(set(names)) != len(names):
        raise IRError(f"verifier: program {p.model} repeats a graph name: {names}")
    for g in p.graphs:
        verify_graph(g)
