"""The verifier, run after lowering and after every pass; its errors show the node in text form.
Each node's attributes, operands, shape and dtype must be what its op declares and infers."""

from __future__ import annotations

from archc.errors import IRError
from archc.ir.graph import Graph, Program, infer
from archc.ir.ops import META, OP_TABLE, Op, ShapeError, full_attrs, roles_of
from archc.ir.ops.base import attr_problems, same_shape
from archc.ir.paramexpr import PARAM_FNS, buffer_shape, calls
from archc.ir.shapes import DTYPE_BYTES, QUANT_DTYPES
from archc.ir.text import format_node


def _problem(g: Graph, i: int, seen: dict[tuple[Op, str], int]) -> str | None:
    """What is wrong with node i, if anything; `seen` holds the boundary names so far."""
    n = g.nodes[i]
    if n.dtype not in DTYPE_BYTES:
        return f"unknown dtype {n.dtype!r}"
    if bad := [j for j in n.inputs if not 0 <= j < i]:
        return f"input %{bad[0]} is not an earlier node"
    if n.dtype in QUANT_DTYPES and n.op != Op.PARAM:
        return f"only a param is quantized ({n.dtype})"
    roles = roles_of(n.op, full_attrs(n.op, n.attrs), len(n.inputs))
    for role, j in zip(roles, n.inputs):
        if g.nodes[j].dtype in QUANT_DTYPES and role not in OP_TABLE[n.op].quantized:
            return (f"its {role} %{j} is {g.nodes[j].dtype}: {n.op.value} reads a quantized "
                    f"weight only as {' or '.join(OP_TABLE[n.op].quantized) or 'nothing'}")
    if n.op in META:
        if (n.op, n.name) in seen:
            return f"{n.op.value} name {n.name!r} already used by %{seen[n.op, n.name]}"
        seen[n.op, n.name] = i
    if n.op in (Op.INPUT, Op.PARAM):
        made = buffer_shape(n.attr("expr"))   # a RoPE buffer's shape follows from its expression
        return "; ".join(attr_problems(n.op, n.attrs) + [
            f"unknown parameter function {c.fn!r}" for c in calls(n.attr("expr"))
            if c.fn != "w" and c.fn not in PARAM_FNS] + (
            [f"shape should be {list(made)}, as its expression makes it"]
            if made is not None and not same_shape(made, n.shape) else [])) or None
    try:
        shape, dtype = infer(n.op, [g.nodes[j].shape for j in n.inputs],
                             [g.nodes[j].dtype for j in n.inputs], n.attrs)
    except ShapeError as err:
        return str(err)
    if not same_shape(shape, n.shape):
        return f"shape should be {[str(s) for s in shape]}"
    return None if dtype == n.dtype else f"dtype should be {dtype}"


def verify_graph(g: Graph) -> None:
    seen: dict[tuple[Op, str], int] = {}
    for i in range(len(g.nodes)):
        if problem := _problem(g, i, seen):
            raise IRError(f"verifier: graph {g.name}: {format_node(i, g.nodes[i])}: {problem}")
    if not g.ids(Op.OUTPUT):
        raise IRError(f"verifier: graph {g.name} has no output")


def verify(p: Program) -> None:
    names = [g.name for g in p.graphs]
    if len(set(names)) != len(names):
        raise IRError(f"verifier: program {p.model} repeats a graph name: {names}")
    for g in p.graphs:
        verify_graph(g)
