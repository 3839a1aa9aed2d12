"""The verifier: run after lowering and after every pass. Its errors show the node in text form.

Checks: inputs come from earlier nodes (topological order); attributes are those the op
declares, of their types and allowed values; the inputs are the operands the attributes call
for; every shape and dtype equals what the op's rule infers from the inputs; input, param and
output names are unique; there is at least one output; parameter expressions only call
registered functions.
"""

from __future__ import annotations

from archc.errors import IRError
from archc.ir.attrs import Call
from archc.ir.graph import Graph, Program, infer
from archc.ir.ops import Op, ShapeError, attr_problems
from archc.ir.paramexpr import PARAM_FNS
from archc.ir.shapes import DTYPE_BYTES
from archc.ir.text import format_node


def _fail(g: Graph, i: int, problem: str) -> IRError:
    return IRError(f"verifier: graph {g.name}: {format_node(i, g.nodes[i])}: {problem}")


def _check_expr(expr: object) -> str | None:
    if isinstance(expr, Call):
        if expr.fn != "w" and expr.fn not in PARAM_FNS:
            return f"unknown parameter function {expr.fn!r}"
        for a in list(expr.args) + [v for _, v in expr.kwargs]:
            problem = _check_expr(a)
            if problem:
                return problem
    elif isinstance(expr, tuple):
        for a in expr:
            problem = _check_expr(a)
            if problem:
                return problem
    return None


def verify_graph(g: Graph) -> None:
    seen: dict[tuple[Op, str], int] = {}
    for i, n in enumerate(g.nodes):
        if n.dtype not in DTYPE_BYTES:
            raise _fail(g, i, f"unknown dtype {n.dtype!r}")
        for j in n.inputs:
            if not 0 <= j < i:
                raise _fail(g, i, f"input %{j} is not an earlier node")
        problems = attr_problems(n.op, n.attrs)
        if problems:
            raise _fail(g, i, "; ".join(problems))
        if n.op in (Op.INPUT, Op.PARAM, Op.OUTPUT):
            key = (n.op, n.name)
            if key in seen:
                raise _fail(g, i, f"{n.op.value} name {n.name!r} already used by %{seen[key]}")
            seen[key] = i
        if n.op in (Op.INPUT, Op.PARAM):
            problem = _check_expr(n.attr("expr"))
            if problem:
                raise _fail(g, i, problem)
            continue
        try:
            shape, dtype = infer(n.op, [g.nodes[j].shape for j in n.inputs],
                                 [g.nodes[j].dtype for j in n.inputs], n.attrs)
        except ShapeError as err:
            raise _fail(g, i, str(err)) from None
        if len(shape) != len(n.shape) or any(
                (a - b).expand() != 0 for a, b in zip(shape, n.shape)):
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
