"""The IR: plain-data nodes in topological order (nothing callable, so graphs print, parse, hash
and compare as data), graphs of them, and a builder. A ``Program`` is a model's graphs:
``decoder``, ``encoder``, or both (the decoder reads the encoder's output), and ``cross_kv``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from archc.dtypes import FLOAT_DTYPES
from archc.errors import IRError
from archc.ir.attrs import Attrs, Call, format_call
from archc.ir.ops import OP_TABLE, Op, ShapeError, canonical, full_attrs, is_compute
from archc.ir.ops.base import Sig, attr_problems, make_sig, require
from archc.ir.shapes import Shape

# the graph hoist-cross-kv adds (archc.passes.cross_kv)
CROSS_KV = "cross_kv"
# what the runtime runs the decoder's last-token-logits variant as (archc.passes.logits): a
# prefill whose caller uses only each sequence's last logits
LAST_TOKEN = "decoder_last"


@dataclass(frozen=True)
class Node:
    op: Op
    inputs: tuple[int, ...]
    attrs: Attrs
    shape: Shape
    dtype: str
    origin: str = ""                 # the spec field that made this node
    passes: tuple[str, ...] = ()     # the passes that rewrote it, in order

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute's value: as stored, else the op's default, else `default`."""
        v = full_attrs(self.op, self.attrs).get(name)
        return default if v is None else v

    @property
    def name(self) -> str:
        """The `name` attr of inputs, params and outputs ('' for other nodes)."""
        return self.attrs.get("name", "")

    def replace(self, **changes: Any) -> Node:
        """This node with `changes`; the same object when nothing changes."""
        return self if all(getattr(self, k) == v for k, v in changes.items()) else \
            replace(self, **changes)


@dataclass(frozen=True)
class Graph:
    name: str
    nodes: tuple[Node, ...]

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def ids(self, op: Op) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.op == op]

    def named(self, op: Op) -> dict[str, int]:
        return {self.nodes[i].name: i for i in self.ids(op)}

    @property
    def inputs(self) -> dict[str, int]:
        return self.named(Op.INPUT)

    @property
    def params(self) -> dict[str, int]:
        return self.named(Op.PARAM)

    @property
    def outputs(self) -> dict[str, int]:
        return self.named(Op.OUTPUT)

    @property
    def compute_dtype(self) -> str:
        """The dtype the graph computes in: its first float node past the inputs and params
        (what a parameter computed from a quantized weight is held in)."""
        return next((n.dtype for n in self.nodes if n.op not in (Op.PARAM, Op.INPUT)
                     and n.dtype in FLOAT_DTYPES), "f32")

    def compute_ids(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if is_compute(n.op)]

    def with_inputs(self, inputs: Sequence[tuple[str, Shape, str]], origin: str) -> Graph:
        """This graph with those of `inputs` (name, shape, dtype) it lacks put first."""
        new = [Node(Op.INPUT, (), canonical(Op.INPUT, {"name": name}), shape, dtype, origin)
               for name, shape, dtype in inputs if name not in self.inputs]
        return Graph(self.name, (*new, *(n.replace(inputs=tuple(j + len(new) for j in n.inputs))
                                        for n in self.nodes)))

    def users(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for j in n.inputs:
                out[j].append(i)
        return out

    def sig(self, i: int) -> Sig:
        n = self.nodes[i]
        return make_sig(n.op, [self.nodes[j].shape for j in n.inputs],
                        [self.nodes[j].dtype for j in n.inputs], n.attrs, n.shape, n.dtype)


@dataclass(frozen=True)
class Program:
    """All graphs of one model, in execution order."""

    model: str
    graphs: tuple[Graph, ...]

    def __iter__(self) -> Iterator[Graph]:
        return iter(self.graphs)

    def graph(self, name: str) -> Graph:
        for g in self.graphs:
            if g.name == name:
                return g
        raise KeyError(f"program {self.model} has no graph {name!r}")


def infer(op: Op, shapes: Sequence[Shape], dtypes: Sequence[str], attrs: Attrs) -> \
        tuple[Shape, str]:
    """Shape and dtype of a node from its attributes and its op's rule; raises ShapeError."""
    problems = attr_problems(op, attrs)
    require(not problems, "; ".join(problems))
    return OP_TABLE[op].infer(make_sig(op, shapes, dtypes, attrs))


@dataclass
class GraphBuilder:
    """Appends nodes in topological order, inferring each shape from the op table. Inputs and
    params are deduplicated by name, so a tied weight is one node used twice."""

    name: str
    nodes: list[Node] = field(default_factory=list)
    origin: str = ""                  # provenance given to nodes emitted without one
    _by_name: dict[tuple[Op, str], int] = field(default_factory=dict)

    def declare(self, op: Op, name: str, shape: Shape, dtype: str, *, expr: Call | None = None,
                origin: str | None = None, default: int | None = None) -> int:
        i = self._by_name.get((op, name))
        if i is None:
            at = {"name": name, "expr": expr} if op == Op.PARAM else {"name": name,
                                                                       "default": default}
            self.nodes.append(Node(op, (), canonical(op, at),
                                   tuple(shape), dtype, self.origin if origin is None else origin))
            i = self._by_name[op, name] = len(self.nodes) - 1
        have = self.nodes[i]
        if have.shape != tuple(shape) or have.dtype != dtype or have.attr("expr") != expr or \
                have.attr("default") != default:
            raise IRError(f"{op.value} {name!r} declared twice with different shapes: "
                          f"{list(have.shape)} and {list(shape)}")
        return i

    def input(self, name: str, shape: Shape, dtype: str, origin: str | None = None, *,
              default: int | None = None) -> int:
        """A runtime input; `default`: a per-token input's value where the caller gives none."""
        return self.declare(Op.INPUT, name, shape, dtype, origin=origin, default=default)

    def param(self, name: str, shape: Shape, dtype: str, *, expr: Call | None = None) -> int:
        return self.declare(Op.PARAM, name, shape, dtype, expr=expr)

    def emit(self, op: Op, *inputs: int, origin: str | None = None, **attrs: Any) -> int:
        at = canonical(op, attrs)
        try:
            out_shape, dtype = infer(op, [self.nodes[i].shape for i in inputs],
                                     [self.nodes[i].dtype for i in inputs], at)
        except ShapeError as err:
            raise IRError(f"cannot build {format_call(op.value, inputs, at)} in graph "
                          f"{self.name}: {err}") from None
        self.nodes.append(Node(op, tuple(inputs), at, out_shape, dtype,
                               origin=self.origin if origin is None else origin))
        return len(self.nodes) - 1

    def output(self, name: str, x: int, origin: str | None = None) -> int:
        return self.emit(Op.OUTPUT, x, name=name, origin=origin)

    def build(self) -> Graph:
        return Graph(self.name, tuple(self.nodes))
