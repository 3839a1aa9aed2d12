"""Tensor parallelism: the ``shard`` pass (option ``tp``; ``shard_program(program, tp)``)
rewrites the unfused program (as ``lower`` makes it) into the program every one of `tp` ranks
runs, Megatron-style.

One program serves every rank: a weight a rank holds part of is a ``param`` whose expression is
``shard(w("NAME"), dim=D, parts=P, every=E)`` (the rank is chosen when weights load), shapes and
attributes are a rank's (heads/tp, d_ff/tp, …), and the ranks meet at collective ops.

- Column-parallel: Q/K/V, gate and up projections (and their biases) keep rows of the rank's
  heads or FFN columns; the attention between them runs on the rank's heads alone. A projection
  is one of them by what reads its output (``read_as``): the q, k or v operand of attention, or
  the FFN's activation and gated product, past biases, the split into heads, norms and RoPE.
  KV heads are split kv/tp per rank, or replicated (`every` = tp/kv ranks share one) when
  kv < tp divides tp, as serving engines do. Per-head parameters (ALiBi slopes, T5
  relative-bias columns) are cut alike; head-dim norms (QK-norm) are replicated.
- Row-parallel: the output and down projections read the rank's slice of K and give a partial
  sum; one ``all_reduce`` makes the whole, and a row-parallel bias is added once, after it.
  Partial sums that are only added to each other (a parallel block's attention and FFN, an MoE's
  routed and shared experts) share one all_reduce.
- Vocabulary-parallel embedding (each rank its rows; ids of other ranks give 0; all_reduce) and
  head (a rank's logits columns; ``all_gather`` along the vocabulary), when the vocabulary divides
  by tp; otherwise both are replicated (a decision the pass reports).
- MoE: each expert's FFN width is split (up rows, down columns); the router is replicated.
- Norms and everything else are replicated: a value a replicated op needs whole is made whole
  first (all_reduce of a partial sum, all_gather of a split).

Refused, with a ``ShardError`` naming the spec field, its value and the tp values that work:
heads, KV heads or FFN widths that do not divide, quantized row-parallel weights whose K would not
split on whole groups, and the recurrent mixers (Mamba, linear attention), which are not split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from archc.errors import ArchcError
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder, Node, Program
from archc.ir.modifiers import leaves
from archc.ir.ops import Op, full_attrs
from archc.ir.ops.base import ELEMENTWISE, RECURRENT, roles_of
from archc.ir.ops.modifiers import modifiers_of
from archc.ir.paramexpr import leaf
from archc.passes.manager import PassContext, register_pass, run_pass
from archc.quant.schemes import is_quantized, scheme

NAME = "shard"
# What reads a projection's output, by op and operand role (the op table's): attention's q, k and
# v (head by head) or the FFN's activation and gated product (feature by feature) make it
# column-parallel; the logits, the vocabulary-parallel head.
READ_AS: dict[tuple[Op, str], str] = {
    (Op.SCORES, "q"): "q", (Op.SCORES, "k"): "k", (Op.WEIGHTED_SUM, "v"): "v",
    (Op.ACT, "x"): "ffn", (Op.MUL, "a"): "ffn", (Op.MUL, "b"): "ffn", (Op.OUTPUT, "x"): "logits"}
# ops a value passes through on its way there, as their first operand beside parameters and
# inputs alone: a bias, a scale or soft-cap, the split into heads, QK-norm, RoPE, the KV cache
ON_THE_WAY = frozenset({Op.ADD, Op.POINTWISE, Op.SPLIT_HEADS, Op.NORM, Op.ROPE, Op.KV_CACHE,
                        Op.REPEAT_KV})
# ops that work over the head dim or along the sequence: head by head on heads split over ranks
# (a mask or score expression only where it does not read the head: ``_reads_heads``)
HEAD_WISE = frozenset({Op.NORM, Op.SOFTMAX, Op.ROPE, Op.MASK, Op.SCORE_MOD, Op.KV_CACHE,
                       Op.REPEAT_KV, Op.SCORES, Op.WEIGHTED_SUM})


class ShardError(ArchcError):
    """A program that cannot be split over the requested tensor-parallel ranks."""


@dataclass(frozen=True)
class Rule:
    """One divisibility requirement of the program: spec `field` has `value`, and `works(tp)`."""

    field: str
    value: int | str
    problem: str                       # why a tp fails, after "field = value"
    works: Callable[[int], bool]


def _reads_heads(n: Node) -> bool:
    """Whether a mask or score expression reads the head (`head`, `kv_head`, a per-head
    parameter): on a rank's heads it would see their local numbers, so it runs on the whole
    scores. An expression of positions and per-token inputs alone runs head by head."""
    if n.op not in (Op.MASK, Op.SCORE_MOD):
        return False
    mods = modifiers_of(full_attrs(n.op, n.attrs))
    exprs = (mods.mask,) if n.op == Op.MASK else (mods.score,)
    return bool(mods.env.head_params) or any(
        leaf.fn == "var" and leaf.args[0] in ("head", "kv_head")
        for e in exprs for leaf in leaves(e))


def read_as(g: Graph, i: int, users: list[list[int]]) -> str | None:
    """What the value of node i is read as (`READ_AS`), followed through `ON_THE_WAY` ops."""
    frontier = [i]
    while frontier:
        j = frontier.pop(0)
        for u in users[j]:
            n = g.nodes[u]
            roles = roles_of(n.op, full_attrs(n.op, n.attrs), len(n.inputs))
            for k, (x, role) in enumerate(zip(n.inputs, roles)):
                if x == j and (n.op, role) in READ_AS:
                    return READ_AS[n.op, role]
                if x == j and k == 0 and n.op in ON_THE_WAY and all(
                        g.nodes[y].op in (Op.PARAM, Op.INPUT) for y in n.inputs[1:]):
                    frontier.append(u)
    return None


def _token_table(g: Graph) -> int | None:
    """The param embedding the `tokens` input (not positions or token types), if any."""
    return next((n.inputs[0] for n in g if n.op == Op.EMBEDDING
                 and g.nodes[n.inputs[1]].op == Op.INPUT and g.nodes[n.inputs[1]].name == "tokens"
                 and g.nodes[n.inputs[0]].op == Op.PARAM), None)


def _rules(program: Program) -> list[Rule]:
    """The requirements tp must meet for `program`, read from its unfused graphs."""
    rules: dict[tuple[str, int | str, str], Rule] = {}

    def need(field: str, value: int | str, problem: str, works: Callable[[int], bool]) -> None:
        rules.setdefault((field, value, problem), Rule(field, value, problem, works))

    for g in program:
        users = g.users()
        for i, n in enumerate(g.nodes):
            if n.op in RECURRENT:
                mixer = "linear_attention" if n.op == Op.LINEAR_ATTENTION else \
                    "gated_deltanet" if (n.origin or "").startswith("mixer.deltanet") else "mamba"
                need("mixer.pattern" if n.origin == "mixer.pattern" else "mixer.kind", mixer,
                     "layers are not split by tensor parallelism", lambda tp: tp == 1)
            elif n.op == Op.SPLIT_HEADS and (n.origin == "attention.heads" or (
                    # latent attention's query heads (its one shared latent "head" is whole)
                    (n.origin or "").startswith("attention.latent") and n.attr("heads") > 1)):
                h = int(n.attr("heads"))
                need("attention.heads", h, "does not divide by tp", lambda tp, h=h: h % tp == 0)
            elif n.op == Op.SPLIT_HEADS and n.origin == "attention.kv_heads":
                kv = int(n.attr("heads"))
                need("attention.kv_heads", kv, "neither divides by tp nor divides tp",
                     lambda tp, kv=kv: kv % tp == 0 or tp % kv == 0)
            elif n.op == Op.MATMUL and g.nodes[n.inputs[1]].op == Op.PARAM:
                _matmul_rules(g, i, users, need)
            elif n.op == Op.MOE_LINEAR:
                w = g.nodes[n.inputs[2]]
                width = int(w.shape[1] if n.attr("stage") == "up" else w.shape[2])
                need("ffn.d_ff", width, "does not divide by tp", lambda tp, f=width: f % tp == 0)
                if n.attr("bias"):   # a row-parallel down projection would add it tp times
                    need("ffn.moe.bias", "true", "expert biases are not split over ranks",
                         lambda tp: tp == 1)
                if n.attr("stage") == "down" and is_quantized(w.dtype):
                    _group_rule(need, "ffn.d_ff", width, w.dtype)
    return list(rules.values())


def _matmul_rules(g: Graph, i: int, users: list[list[int]], need: Callable[..., None]) -> None:
    """Requirements of a row-parallel projection, over the FFN's hidden features (its K is the
    FFN's width, which the column-parallel projections before it split too) or the heads
    merged (only a quantized weight's groups)."""
    x, w = (g.nodes[j] for j in g.nodes[i].inputs)
    k = int(w.shape[1])
    if x.op in (Op.ACT, Op.MUL):
        shared = any(g.nodes[u].op == Op.ADD and any(   # added to the routed experts' sum
            g.nodes[j].op == Op.MOE_LINEAR for j in g.nodes[u].inputs) for u in users[i])
        field_ = "ffn.moe.shared_expert_d_ff" if shared else "ffn.d_ff"
        need(field_, k, "does not divide by tp", lambda tp, f=k: f % tp == 0)
    elif x.op == Op.MERGE_HEADS:
        field_ = "attention.heads × attention.head_dim"
    else:
        return
    if is_quantized(w.dtype):
        _group_rule(need, field_, k, w.dtype)


def _group_rule(need: Callable[..., None], field_: str, k: int, dtype: str) -> None:
    """A quantized row-parallel weight splits along K only on whole groups."""
    step = scheme(dtype).k_step(k)
    what = "does not divide by tp" if step == 1 else \
        f"does not split into tp parts of whole {step}-element groups"
    need(field_, k, f"(K of the {dtype} weights) {what}",
         lambda tp, k=k: k % tp == 0 and (k // tp) % step == 0)


def check(program: Program, tp: int) -> None:
    """Raise ShardError when `program` cannot be split over `tp` ranks, naming the spec field,
    its value and the tp values that do work."""
    rules = _rules(program)
    failed = [r for r in rules if not r.works(tp)]
    if not failed:
        return
    top = max([r.value for r in rules if isinstance(r.value, int)] + [8])
    working = [t for t in range(1, 2 * top + 1) if all(r.works(t) for r in rules)]
    r = min(failed, key=lambda r: isinstance(r.value, int))   # a mixer first: no tp helps
    raise ShardError(f"cannot shard {program.model} over tp={tp}: {r.field} = {r.value} "
                     f"{r.problem}; tp values that work: {', '.join(map(str, working))}")


# ---- layouts ---------------------------------------------------------------------------------

Kind = Literal["rep", "split", "sum"]


@dataclass(frozen=True)
class Val:
    """How a value of the unsharded graph is held on a rank.

    rep: whole on every rank (`node`). split: `parts` parts of its features (last dim; dim 1 of
    heads-major [B, H, T, D] values when `heads`), rank r holding part r // `every`. sum: the whole
    is all_reduce(`node`) (a partial sum, None when there is none) plus the replicated `terms`
    (node, is_bias), which are added after the all_reduce so that each counts once."""

    kind: Kind
    node: int | None
    parts: int = 1
    every: int = 1
    heads: bool = False
    terms: tuple[tuple[int, bool], ...] = ()


@dataclass
class _Sharder:
    """Rewrites one graph for `tp` ranks, value by value, recording its decisions."""

    graph: Graph
    tp: int
    kv_split: tuple[int, int]          # (parts, every) of the KV projections' rows
    vocab: bool                        # vocabulary-parallel embedding and head
    ctx: PassContext
    b: GraphBuilder = field(init=False)
    users: list[list[int]] = field(init=False)
    vals: dict[int, Val] = field(default_factory=dict)
    made: dict[int, int] = field(default_factory=dict)   # old node → the first node made for it

    def __post_init__(self) -> None:
        self.b = GraphBuilder(self.graph.name)
        self.users = self.graph.users()

    def _made(self, i: int, new: int) -> int:
        self.made.setdefault(i, new)
        return new

    # -- parameters

    def param(self, i: int, dim: int | None = None, parts: int = 1, every: int = 1) -> int:
        """Param node i whole, or its `parts` parts along `dim` (rank r: part r // every)."""
        n = self.graph.nodes[i]
        expr = n.attr("expr")
        if dim is None or parts == 1:
            return self._made(i, self.b.param(n.name, n.shape, n.dtype, expr=expr))
        dim %= len(n.shape)
        sliced = Call("shard", (expr or leaf(n.name),),
                      (("dim", dim), ("parts", parts)) + ((("every", every),) if every > 1 else ()))
        shape = tuple(s // parts if d == dim else s for d, s in enumerate(n.shape))
        return self._made(i, self.b.param(n.name, shape, n.dtype, expr=sliced))

    # -- values

    def emit(self, i: int, *inputs: int, **attrs: object) -> int:
        n = self.graph.nodes[i]
        return self._made(i, self.b.emit(n.op, *inputs, origin=n.origin,
                                         **{**dict(n.attrs), **attrs}))

    def collective(self, op: Op, x: int, origin: str, **attrs: object) -> int:
        return self.b.emit(op, x, origin=origin, group="tp", ranks=self.tp, **attrs)

    def whole(self, i: int) -> int:
        """Value i of the old graph whole on this rank: partial sums reduced, splits gathered."""
        if self.graph.nodes[i].op == Op.PARAM:
            return self.param(i)
        v = self.vals[i]
        if v.kind == "rep":
            assert v.node is not None
            return v.node
        origin = self.graph.nodes[i].origin
        if v.kind == "sum":
            assert v.node is not None
            origin = self.b.nodes[v.node].origin     # the projection (or block) that made it
            y = self.collective(Op.ALL_REDUCE, v.node, origin)
            self.ctx.applied("all-reduce", i, "the ranks' partial sums added once")
            for term, bias in sorted(v.terms, key=lambda t: not t[1]):   # biases first
                y = self.b.emit(Op.ADD, *((y, term) if bias else (term, y)), origin=origin)
        else:
            if v.parts != self.tp or v.every != 1:
                raise ShardError(f"graph {self.graph.name}: {self.ctx.describe(i)} is needed "
                                 f"whole but is split into {v.parts} parts shared by {v.every} "
                                 f"ranks each")
            assert v.node is not None
            y = self.collective(Op.ALL_GATHER, v.node, origin, dim=1 if v.heads else -1)
            self.ctx.applied("all-gather", i, f"the ranks' {v.parts} parts concatenated")
        self.vals[i] = Val("rep", self._made(i, y))
        return y


    # -- rules by op

    def node(self, i: int) -> Val | None:
        n, g = self.graph.nodes[i], self.graph
        if n.op == Op.PARAM:
            return None                    # emitted where used, whole or sliced
        if n.op == Op.INPUT:
            return Val("rep", self._made(i, self.b.input(n.name, n.shape, n.dtype, n.origin)))
        if n.op == Op.MATMUL and g.nodes[n.inputs[1]].op == Op.PARAM:
            return self.matmul(i)
        if n.op == Op.MOE_LINEAR:
            return self.moe_linear(i)
        if n.op == Op.EMBEDDING and self.vocab and n.inputs[0] == _token_table(g):
            table = self.param(n.inputs[0], 0, self.tp)
            self.ctx.applied("vocab-parallel", i, f"{self.tp} parts of the vocabulary's rows")
            return Val("sum", self.emit(i, table, self.whole(n.inputs[1]), parts=self.tp))
        if n.op == Op.ADD:
            return self.add(i)
        if n.op in (Op.ALIBI, Op.REL_BIAS):
            return self.per_head(i)
        if n.op in HEAD_WISE | ELEMENTWISE | {Op.SPLIT_HEADS, Op.MERGE_HEADS}:
            return self.keep_split(i)
        return self.rep(i)

    def matmul(self, i: int) -> Val:
        x, w = self.graph.nodes[i].inputs
        xv = self.vals[x]
        if xv.kind == "split" and not xv.heads:       # row-parallel: this rank's slice of K
            y = self.emit(i, xv.node, self.param(w, 1, xv.parts, xv.every))
            self.ctx.applied("row-parallel", i, f"K split in {xv.parts}; a partial sum")
            return Val("sum", y)
        read = read_as(self.graph, i, self.users)
        if read in ("q", "k", "v", "ffn"):
            parts, every = self.kv_split if read in ("k", "v") else (self.tp, 1)
            y = self.emit(i, self.whole(x), self.param(w, 0, parts, every))
            shared = f", each part shared by {every} ranks" if every > 1 else ""
            self.ctx.applied("column-parallel", i, f"rows split in {parts}{shared}")
            return Val("split", y, parts, every)
        if self.vocab and read == "logits":
            y = self.emit(i, self.whole(x), self.param(w, 0, self.tp))
            self.ctx.applied("vocab-parallel", i, f"the logits' {self.tp} parts of the vocabulary")
            return Val("split", y, self.tp)
        return Val("rep", self.emit(i, self.whole(x), self.param(w)))

    def moe_linear(self, i: int) -> Val:
        n = self.graph.nodes[i]
        x, gates, w = n.inputs
        if n.attr("stage") == "down":
            xv = self.vals[x]
            if xv.kind != "split":
                return self.rep(i)
            y = self.emit(i, xv.node, self.whole(gates), self.param(w, 2, xv.parts, xv.every))
            self.ctx.applied("row-parallel", i, f"each expert's K split in {xv.parts}")
            return Val("sum", y)
        y = self.emit(i, self.whole(x), self.whole(gates), self.param(w, 1, self.tp))
        self.ctx.applied("column-parallel", i, f"each expert's rows split in {self.tp}")
        return Val("split", y, self.tp)

    def add(self, i: int) -> Val:
        n = self.graph.nodes[i]
        a, c = n.inputs
        kinds = {self.vals_of(j).kind for j in (a, c)}
        if "sum" in kinds and "split" not in kinds:
            return self.add_sums(a, c, i)
        return self.keep_split(i)

    def vals_of(self, j: int) -> Val:
        """The layout of old value j (a param not yet emitted counts as replicated)."""
        return self.vals.get(j) or Val("rep", None)

    def add_sums(self, a: int, c: int, i: int) -> Val:
        """a + c where one is (or both are) a partial sum: the partials add before the one
        all_reduce, the replicated terms after it."""
        partial: int | None = None
        terms: list[tuple[int, bool]] = []
        for j in (a, c):
            v = self.vals_of(j)
            if v.kind == "sum":
                terms += v.terms
                if v.node is not None:
                    partial = v.node if partial is None else \
                        self.b.emit(Op.ADD, partial, v.node, origin=self.graph.nodes[i].origin)
            elif self.graph.nodes[j].op == Op.PARAM:
                terms.append((self.param(j), True))
            else:
                terms.append((self.whole(j), False))
        return Val("sum", partial, terms=tuple(terms))

    def keep_split(self, i: int) -> Val:
        """An op that works head by head or feature by feature on a split value: a split output,
        with the params it reads cut alike; otherwise a replicated op."""
        n = self.graph.nodes[i]
        first = self.vals_of(n.inputs[0])
        if first.kind != "split" or not self._splits(n, first):
            return self.rep(i)
        ins = []
        for j in n.inputs:
            v = self.vals_of(j)
            if self.graph.nodes[j].op == Op.PARAM:
                cut = v.kind == "rep" and n.op in ELEMENTWISE and \
                    self.graph.nodes[j].shape[-1:] == self.graph.nodes[i].shape[-1:]
                ins.append(self.param(j, -1, first.parts, first.every) if cut and not first.heads
                           else self.param(j))
            elif v.kind == "split":
                if (v.parts, v.every, v.heads) != (first.parts, first.every, first.heads):
                    return self.rep(i)
                ins.append(v.node)
            else:
                ins.append(self.whole(j))
        out = Val("split", None, first.parts, first.every, first.heads)
        attrs: dict[str, object] = {}
        if n.op == Op.SPLIT_HEADS:
            attrs["heads"] = int(n.attr("heads")) // first.parts
            out = Val("split", None, first.parts, first.every, True)
        elif n.op == Op.MERGE_HEADS:
            out = Val("split", None, first.parts, first.every, False)
        elif n.op == Op.REPEAT_KV:
            local_kv = int(self.b.nodes[ins[0]].shape[1])
            heads = int(self.graph.nodes[n.inputs[0]].shape[1]) * int(n.attr("groups"))
            attrs["groups"] = heads // self.tp // local_kv
            out = Val("split", None, self.tp, 1, True)
        return Val(out.kind, self.emit(i, *ins, **attrs), out.parts, out.every, out.heads)

    def _splits(self, n: Node, v: Val) -> bool:
        """Can op n run on each rank's part of split value v alone?"""
        if n.op in (Op.SPLIT_HEADS, Op.MERGE_HEADS):
            return n.op == Op.SPLIT_HEADS and not v.heads or n.op == Op.MERGE_HEADS and v.heads
        if n.op in HEAD_WISE:
            return v.heads and not _reads_heads(n)
        return n.op in ELEMENTWISE

    def rep(self, i: int) -> Val:
        """Node i replicated: every input whole."""
        return Val("rep", self.emit(i, *(self.whole(j) for j in self.graph.nodes[i].inputs)))

    def per_head(self, i: int) -> Val:
        """ALiBi slopes [heads] and relative-bias tables [buckets, heads]: the rank's heads."""
        n = self.graph.nodes[i]
        scores, table = n.inputs
        v = self.vals[scores]
        if v.kind != "split" or not v.heads:
            return self.rep(i)
        dim = 0 if n.op == Op.ALIBI else 1
        self.ctx.applied("per-head", i, f"the per-head parameter cut in {v.parts}")
        return Val("split", self.emit(i, v.node, self.param(table, dim, v.parts, v.every)),
                   v.parts, v.every, True)

    def run(self) -> Graph:
        for i, n in enumerate(self.graph.nodes):
            if n.op == Op.OUTPUT:
                self.emit(i, self.whole(n.inputs[0]))
                continue
            v = self.node(i)
            if v is not None:
                self.vals[i] = v
        return self.b.build()


def _kv_split(program: Program, tp: int) -> tuple[int, int]:
    """(parts, every) of the K/V projections' rows: kv/tp heads per rank, or tp/kv ranks sharing
    each of kv heads when there are fewer than tp."""
    kvs = [int(n.attr("heads")) for g in program for n in g
           if n.op == Op.SPLIT_HEADS and n.origin == "attention.kv_heads"]
    kv = kvs[0] if kvs else tp
    return (tp, 1) if kv % tp == 0 else (kv, tp // kv)


@register_pass(NAME, "tensor parallelism: the unfused program as each of tp ranks runs it, "
               "projections column- then row-parallel (an all_reduce after), a vocabulary-"
               "parallel embedding and head, the rest replicated", program=True, options={"tp": 1})
def shard(program: Program, contexts: Mapping[str, PassContext], tp: int) -> Program:
    check(program, tp)
    if tp == 1:
        return program
    if any(n.op in (Op.FUSED_LINEAR, Op.ATTENTION) for g in program for n in g):
        raise ShardError(f"the shard pass splits the unfused program, as lowered; "
                         f"{program.model} has kernel-level nodes: run shard first")
    kv_split = _kv_split(program, tp)
    tables = {g.name: _token_table(g) for g in program}    # the vocabulary: their rows
    vocab = next((int(program.graph(g).nodes[t].shape[0]) for g, t in tables.items()
                  if t is not None), None)
    parallel_vocab = vocab is not None and vocab % tp == 0
    graphs = []
    for g in program:
        ctx, table = contexts[g.name], tables[g.name]
        if vocab is not None and not parallel_vocab:
            ctx.refused("vocab-parallel", g.name if table is None else table,
                        f"vocab_size {vocab} does not divide by tp={tp}: embedding and head "
                        f"replicated")
        if kv_split[1] > 1:
            ctx.applied("kv-replicated", "attention.kv_heads",
                        f"{kv_split[0]} KV heads, each shared by {kv_split[1]} ranks")
        sharder = _Sharder(g, tp, kv_split, parallel_vocab, ctx)
        graphs.append(sharder.run())
        ctx.kept = sharder.made     # what `archc ir --diff shard` numbers as the old nodes
        whole = [n.name for n in graphs[-1] if n.op == Op.PARAM
                 and (n.attr("expr") is None or n.attr("expr").fn != "shard")]
        if whole:
            ctx.applied("replicated", g.name, f"{len(whole)} params whole on every rank "
                        f"(norm gains, routers, RoPE tables, unsplit tables): "
                        f"{', '.join(whole[:3])}{', …' if len(whole) > 3 else ''}")
    return Program(program.model, tuple(graphs))


def shard_program(program: Program, tp: int) -> Program:
    """`program` (unfused, as lowered) split over `tp` tensor-parallel ranks: the one program
    each rank runs, its weights read through shard() slices. tp=1 returns it unchanged."""
    return run_pass(program, NAME, options={"tp": tp}).after
