"""The one-line-per-node text form, and its parser.

    program tiny-llama3
    graph decoder {
      %0 : i64[B,T] = input() {name="tokens"}
      %7 : f32[B,T,64] = rmsnorm(%6, %3) {eps=1e-05}  # origin="norm.kind"
      ...
    }

``parse_program(format_program(p)) == p`` for every program; the provenance comment is printed
with ``provenance=True`` (and then round-trips too).
"""

from __future__ import annotations

import re

from archc.errors import IRError
from archc.ir.attrs import Attrs, ValueParser, format_call, format_value
from archc.ir.graph import Graph, Node, Program
from archc.ir.ops import Op
from archc.ir.shapes import format_shape, parse_dim


def format_node(i: int, n: Node, *, provenance: bool = False) -> str:
    line = f"%{i} : {format_shape(n.dtype, n.shape)} = {format_call(n.op.value, n.inputs, n.attrs)}"
    if provenance and (n.origin or n.passes):
        parts = []
        if n.origin:
            parts.append(f"origin={format_value(n.origin)}")
        if n.passes:
            parts.append(f"passes={format_value(n.passes)}")
        line += "  # " + " ".join(parts)
    return line


def format_graph(g: Graph, *, provenance: bool = False) -> str:
    lines = [f"graph {g.name} {{"]
    lines += ["  " + format_node(i, n, provenance=provenance) for i, n in enumerate(g.nodes)]
    lines.append("}")
    return "\n".join(lines)


def format_program(p: Program, *, provenance: bool = False) -> str:
    return "\n".join([f"program {p.model}"] +
                     [format_graph(g, provenance=provenance) for g in p.graphs]) + "\n"


# ---- parsing -------------------------------------------------------------------------------

_NODE = re.compile(r"^%(\d+)\s*:\s*(\w+)\[([^\]]*)\]\s*=\s*(\w+)\(([^)]*)\)\s*")
_GRAPH = re.compile(r"^graph\s+([\w.\-]+)\s*\{$")


def _parse_node(line: str, expect: int, where: str) -> Node:
    m = _NODE.match(line)
    if not m:
        raise IRError(f"{where}: cannot read a node from {line!r}")
    idx, dtype, dims, opname, args = m.groups()
    if int(idx) != expect:
        raise IRError(f"{where}: node %{idx} out of order (expected %{expect})")
    try:
        op = Op(opname)
    except ValueError:
        raise IRError(f"{where}: unknown op {opname!r}") from None
    try:
        shape = tuple(parse_dim(d) for d in dims.split(",")) if dims.strip() else ()
    except ValueError as err:
        raise IRError(f"{where}: {err}") from None
    inputs = []
    for a in (a.strip() for a in args.split(",") if a.strip()):
        if not re.fullmatch(r"%\d+", a):
            raise IRError(f"{where}: input {a!r} is not a %N reference")
        inputs.append(int(a[1:]))
    rest = line[m.end():]
    parser = ValueParser(rest)
    attrs = Attrs()
    origin, passes = "", ()
    try:
        nxt = parser.peek()
        if nxt == ("punct", "{"):
            parser.expect("{")
            attrs = parser.attrs()
            parser.expect("}")
        tail = rest[parser.pos:].strip()
        if tail.startswith("#"):
            prov = ValueParser(tail[1:])
            while prov.peek() is not None:
                kind, key = prov._next()
                prov.expect("=")
                value = prov.value()
                if key == "origin":
                    origin = value
                elif key == "passes":
                    passes = tuple(value)
                else:
                    raise ValueError(f"unknown provenance key {key!r}")
        elif tail:
            raise ValueError(f"trailing text {tail!r}")
    except ValueError as err:
        raise IRError(f"{where}: {err}") from None
    return Node(op, tuple(inputs), attrs, shape, dtype, origin, passes)


def parse_program(text: str) -> Program:
    """Parse the text form back into a program (no verification: call `verify` for that)."""
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines or not lines[0].startswith("program "):
        raise IRError("IR text must start with 'program NAME'")
    model = lines[0].split(None, 1)[1].strip()
    graphs: list[Graph] = []
    name: str | None = None
    nodes: list[Node] = []
    for lineno, line in enumerate(lines[1:], 2):
        where = f"line {lineno}"
        if name is None:
            m = _GRAPH.match(line)
            if not m:
                raise IRError(f"{where}: expected 'graph NAME {{', found {line!r}")
            name, nodes = m.group(1), []
        elif line == "}":
            graphs.append(Graph(name, tuple(nodes)))
            name = None
        else:
            nodes.append(_parse_node(line, len(nodes), where))
    if name is not None:
        raise IRError(f"graph {name} is not closed with '}}'")
    return Program(model, tuple(graphs))
