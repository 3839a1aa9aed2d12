"""Editing a graph inside a pass: add nodes, redirect uses, drop what the edit made dead; and the
two passes that only clean up, dce and cse.

A ``Rewriter`` holds a graph's nodes by id while a pass edits them. New nodes get new ids and a
position key just before an anchor node, so the printed graph keeps the order a reader expects;
``finish`` sorts, renumbers and drops the nodes the edits made dead (nodes already dead before
the pass are left for ``dce``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import networkx as nx
import sympy

from archc.errors import IRError, WeightsError
from archc.ir.attrs import Attrs, Call, format_call
from archc.ir.graph import Graph, Node, infer
from archc.ir.ops import Op, ShapeError, canonical
from archc.ir.ops.steps import HEAD_KERNELS
from archc.ir.paramexpr import leaf, quantized_result
from archc.ir.shapes import QUANT_DTYPES, Shape
from archc.ir.text import format_node
from archc.passes.manager import PassContext, register_pass

T = TypeVar("T")


class Refusal(Exception):
    """Raised inside a rewrite to refuse it: `why` names the rule that said no."""

    def __init__(self, why: str, *, profitability: bool = False) -> None:
        super().__init__(why)
        self.why, self.profitability = why, profitability


def is_root(n: Node) -> bool:
    """An output, an input (the graph's interface) or a KV-cache write: live even when nothing in
    the graph reads its value."""
    return n.op in (Op.OUTPUT, Op.INPUT, Op.KV_CACHE) or (n.op in HEAD_KERNELS and any(
        st.fn in ("kv_write", "paged_kv_write") for st in n.attr("epilogue", ())))


def live_nodes(nodes: dict[int, Node], killed: Iterable[int] = ()) -> set[int]:
    """Nodes reachable (through inputs) from the roots."""
    dead = set(killed)
    stack = [i for i, n in nodes.items() if i not in dead and is_root(n)]
    live: set[int] = set()
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        stack.extend(nodes[i].inputs)
    return live


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, or `base#2`, `base#3`… if it is taken; the name returned is taken from now on."""
    name, k = base, 2
    while name in taken:
        name, k = f"{base}#{k}", k + 1
    taken.add(name)
    return name


class Rewriter:
    def __init__(self, g: Graph, ctx: PassContext) -> None:
        self.g, self.ctx = g, ctx
        self.nodes: dict[int, Node] = dict(enumerate(g.nodes))
        self.key: dict[int, float] = {i: float(i) for i in self.nodes}
        self._users: defaultdict[int, list[int]] = defaultdict(list)
        for i, n in self.nodes.items():
            for j in n.inputs:
                self._users[j].append(i)
        self._live_before = live_nodes(self.nodes)
        self.killed: set[int] = set()
        self.gone: set[int] = set()      # replaced or killed: their reads no longer count
        self.changed = False
        self.param_names = {n.name for n in g.nodes if n.op == Op.PARAM}
        # the dtype of each parameter's expression: what a new parameter built from it keeps
        self.expr_dtypes = {n.attr("expr") or leaf(n.name): n.dtype for n in g.nodes
                            if n.op == Op.PARAM}
        # the activations' dtype: what a parameter computed from a quantized weight is held in
        self.compute_dtype = g.compute_dtype

    def op(self, i: int) -> Op:
        return self.nodes[i].op

    def users(self, i: int) -> list[int]:
        """Distinct live users of node i, in graph order."""
        return sorted({u for u in self._users[i] if u not in self.gone}, key=self.key.__getitem__)

    def is_dead(self, i: int) -> bool:
        """Replaced or removed: nothing reads it and it is not a root."""
        return i in self.gone or (not self.users(i) and not is_root(self.nodes[i]))

    def shape(self, i: int) -> Shape:
        return self.nodes[i].shape

    def order(self) -> list[int]:
        """Live node ids in position order (a snapshot; safe to edit while iterating)."""
        return sorted((i for i in self.nodes if i not in self.gone), key=self.key.__getitem__)

    def describe(self, i: int) -> str:
        """Node i in text form: as the pass received it, or as this pass made it."""
        return self.ctx.describe(i) if i < len(self.g.nodes) else \
            format_node(i, self.nodes[i]) + "  (made by this pass)"

    def param_expr(self, i: int) -> Call:
        """The parameter expression of param node i (its checkpoint tensor if it has none)."""
        n = self.nodes[i]
        if n.op != Op.PARAM:
            raise Refusal(f"%{i} is a {n.op.value}, not a parameter, so it cannot be rewritten "
                          "at weight-load time")
        return n.attr("expr") or leaf(n.name)

    def attempt(self, rule: str, where: int, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args), or None when it raises Refusal, which is recorded against node `where`."""
        try:
            return fn(*args)
        except Refusal as r:
            self.ctx.refused(rule, self.describe(where), r.why, profitability=r.profitability)
            return None

    def add_node(self, op: Op, inputs: Sequence[int], attrs: Attrs, shape: Shape, dtype: str,
                 like: Sequence[int], at: int) -> int:
        """A node placed just before `at`, with the origin of `like[0]` and the passes of all
        `like` nodes and this one."""
        passes = dict.fromkeys([p for j in like for p in self.nodes[j].passes]
                               + [self.ctx.pass_name])
        i = len(self.nodes)     # ids: the graph's 0…n-1, then n, n+1… in the order made
        self.nodes[i] = Node(op, tuple(inputs), attrs, tuple(shape), dtype,
                             self.nodes[like[0]].origin, tuple(passes))
        self.key[i] = self.key[at] - 0.5 + (i - len(self.g.nodes) + 1) * 1e-6
        for j in inputs:
            self._users[j].append(i)
        return i

    def emit(self, op: Op, inputs: Sequence[int], *, like: Sequence[int], at: int | None = None,
             **attrs: Any) -> int:
        """A new node of `op` over `inputs`, its shape from the op's rule, placed just before
        `at` (default `like[0]`)."""
        a = canonical(op, attrs)
        try:
            shape, dtype = infer(op, [self.nodes[j].shape for j in inputs],
                                 [self.nodes[j].dtype for j in inputs], a)
        except ShapeError as err:
            raise IRError(f"pass {self.ctx.pass_name}: cannot build "
                          f"{format_call(op.value, inputs, a)}: {err}") from None
        return self.add_node(op, inputs, a, shape, dtype, like, like[0] if at is None else at)

    def add_param(self, base: str, expr: Call, shape: Shape, dtype: str, *,
                  like: Sequence[int], at: int) -> int:
        """A new parameter computed at weight-load time from `expr`, named after `base`. Its
        dtype is `dtype`, but where `expr` reads quantized weights: then it is their scheme when
        `expr` only moves their rows, the activations' dtype when it computes with them."""
        try:
            scheme = quantized_result(expr, self.expr_dtypes)
        except WeightsError as err:
            raise Refusal(str(err)) from None
        if scheme is not None:
            dtype = scheme
        elif dtype in QUANT_DTYPES:
            dtype = self.compute_dtype
        self.expr_dtypes[expr] = dtype
        name = unique_name(base, self.param_names)
        return self.add_node(Op.PARAM, (), Attrs(name=name, expr=expr),
                             [sympy.Integer(int(d)) for d in shape], dtype, like, at)

    def replace(self, old: int, new: int) -> None:
        """Every use of `old` reads `new` instead."""
        if old == new:
            return
        for u in self.users(old):
            self.rewire(u, [new if j == old else j for j in self.nodes[u].inputs])
        self.gone.add(old)
        self.changed = True

    def rewire(self, i: int, inputs: Sequence[int]) -> None:
        """Node i reads `inputs` (same op, attrs and shape)."""
        n = self.nodes[i]
        for j in set(n.inputs):
            self._users[j] = [u for u in self._users[j] if u != i]
        self.nodes[i] = n.replace(inputs=tuple(inputs))
        for j in inputs:
            self._users[j].append(i)
        self.changed = True

    def kill(self, i: int) -> None:
        """Remove node i; nothing may still read it (`finish` checks)."""
        self.killed.add(i)
        self.gone.add(i)
        self.changed = True

    def finish(self) -> Graph:
        """The edited graph, sorted and renumbered; the original object if nothing changed."""
        if not self.changed:
            return self.g
        live = live_nodes(self.nodes, self.killed)
        n_orig = len(self.g.nodes)
        keep = {i for i in self.nodes if i not in self.killed and (
            i in live or (i < n_orig and i not in self._live_before))}
        dag = nx.DiGraph()
        dag.add_nodes_from(keep)
        for i in keep:
            for j in self.nodes[i].inputs:
                if j not in keep:
                    raise IRError(f"pass {self.ctx.pass_name}: %{i} reads %{j}, which was "
                                  "removed")
                dag.add_edge(j, i)
        try:    # among the nodes that are ready, the one with the smallest position key first
            order = list(nx.lexicographical_topological_sort(dag, key=self.key.__getitem__))
        except nx.NetworkXUnfeasible:
            raise IRError(f"pass {self.ctx.pass_name}: the edited graph has a cycle") from None
        number = {old: new for new, old in enumerate(order)}
        self.ctx.kept = {old: new for old, new in number.items() if old < n_orig}
        nodes = tuple(self.nodes[i].replace(inputs=tuple(number[j] for j in self.nodes[i].inputs))
                      for i in order)
        return Graph(self.g.name, nodes)


def register_rewrite_pass(name: str, summary: str
                          ) -> Callable[[Callable[[Rewriter], None]], Callable[[Rewriter], None]]:
    """Register an exact pass whose body edits each graph through a Rewriter."""
    def register(fn: Callable[[Rewriter], None]) -> Callable[[Rewriter], None]:
        @register_pass(name, summary)
        def run(g: Graph, ctx: PassContext) -> Graph:
            rw = Rewriter(g, ctx)
            fn(rw)
            return rw.finish()
        return fn
    return register


@register_rewrite_pass("dce", "drop nodes nothing reads (cache writes and inputs stay)")
def dce(rw: Rewriter) -> None:
    # 1. Mark live: the roots (outputs, inputs, cache writes) and what they read, transitively.
    # 2. Drop the rest.
    live = live_nodes(rw.nodes)
    for i in rw.order():
        if i not in live:
            rw.kill(i)
            rw.ctx.applied("dce", i, "read by nothing")


@register_rewrite_pass("cse", "nodes computing the same value from the same inputs become one")
def cse(rw: Rewriter) -> None:
    # 1. Walk in order; each node's inputs already point at their representatives.
    # 2. Key: op, inputs, attrs, shape, dtype — for a computed parameter its expression. Graph
    #    inputs, outputs, checkpoint parameters (a name, not a value) and cache writes never
    #    merge; a node whose key was seen is replaced by the first node with that key.
    seen: dict[Hashable, int] = {}
    for i in rw.order():
        n = rw.nodes[i]
        if is_root(n) or (n.op == Op.PARAM and n.attr("expr") is None):
            continue
        key = ("param", n.attr("expr"), n.shape, n.dtype) if n.op == Op.PARAM else \
            (n.op, n.inputs, n.attrs, n.shape, n.dtype)
        if key in seen:
            rw.replace(i, seen[key])
            rw.ctx.applied("cse", i, f"same as %{seen[key]}")
        else:
            seen[key] = i
