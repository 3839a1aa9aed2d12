"""The one-line-per-node text form, and its parser: ``parse_program(format_program(p)) == p``
for every program, and with ``provenance=True`` (the comment after each node) too::

    program tiny-llama3
    graph decoder {
      %7 : f32[B,T,64] = norm(%6, %3) {eps=1e-05, kind="rms"}  # origin="norm.kind"
    }
"""

from __future__ import annotations

import re

from archc.errors import IRError
from archc.ir.attrs import Attrs, format_call, format_value, parse_value
from archc.ir.graph import Graph, Node, Program
from archc.ir.ops import Op
from archc.ir.shapes import format_shape, parse_dim


def format_node(i: int, n: Node, *, provenance: bool = False) -> str:
    line = f"%{i} : {format_shape(n.dtype, n.shape)} = {format_call(n.op.value, n.inputs, n.attrs)}"
    parts = [f"{k}={format_value(v)}" for k, v in (("origin", n.origin), ("passes", n.passes)) if v]
    return line + "  # " + " ".join(parts) if provenance and parts else line


def format_program(p: Program, *, provenance: bool = False) -> str:
    lines = [f"program {p.model}"]
    for g in p.graphs:
        lines += [f"graph {g.name} {{", *("  " + format_node(i, n, provenance=provenance)
                                          for i, n in enumerate(g.nodes)), "}"]
    return "\n".join(lines) + "\n"


# %i : dtype[dims] = op(%a, …), then {name=value, …} and the provenance comment
_STR = r'"(?:[^"\\]|\\.)*"'
_NODE = re.compile(
    r"%(\d+)\s*:\s*(\w+)\[([^\]]*)\]\s*=\s*(\w+)\(((?:%\d+(?:\s*,\s*%\d+)*)?)\)"
    r'(?:\s*\{((?:[^}"]|' + _STR + r")*)\})?"
    r"(?:\s*#\s*(?:origin=(" + _STR + r"))?\s*(?:passes=(\[.*\]))?)?\s*$")
_GRAPH = re.compile(r"^graph\s+([\w.\-]+)\s*\{$")


def _parse_node(line: str, expect: int, where: str) -> Node:
    m = _NODE.match(line)
    if not m:
        raise IRError(f"{where}: cannot read a node from {line!r}")
    idx, dtype, dims, opname, args, attrs, origin, passes = m.groups()
    if int(idx) != expect:
        raise IRError(f"{where}: node %{idx} out of order (expected %{expect})")
    try:
        op = Op(opname)
    except ValueError:
        raise IRError(f"{where}: unknown op {opname!r}") from None
    try:
        shape = tuple(parse_dim(d) for d in dims.split(",")) if dims.strip() else ()
        call = parse_value(f"_({attrs or ''})")
        if call.args:
            raise ValueError(f"attributes are name=value, got {attrs!r}")
        return Node(op, tuple(int(i) for i in re.findall(r"\d+", args)), Attrs(dict(call.kwargs)),
                    shape, dtype, parse_value(origin) if origin else "",
                    parse_value(passes) if passes else ())
    except ValueError as err:
        raise IRError(f"{where}: {err}") from None


def parse_program(text: str) -> Program:
    """Parse the text form back into a program (no verification: call `verify` for that)."""
    lines = [(no, ln.strip()) for no, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    if not lines or not lines[0][1].startswith("program "):
        raise IRError("IR text must start with 'program NAME'")
    model = lines[0][1].split(None, 1)[1].strip()
    graphs: list[Graph] = []
    name: str | None = None
    nodes: list[Node] = []
    for lineno, line in lines[1:]:
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
