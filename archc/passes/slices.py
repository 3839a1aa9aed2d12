"""A rank's slices of a checkpoint, as the shard pass's program reads them.

The program sharded over tp ranks (``archc.passes.shard``) reads a weight a rank holds part of
as ``shard(w(NAME), dim, parts, every)`` into a param of that name. ``rank_slices`` names those
tensors and their cuts — what a rank's loader may read just its slice of (a tensor read any
other way as well is read whole); ``rank_span`` is the elements of a cut a rank keeps,
``take_slice`` cuts a tensor held whole, and ``presliced`` is the sharded program reading the
slices a loader already took."""

from __future__ import annotations

from typing import Any

from archc.ir.attrs import Call
from archc.ir.graph import Graph, Program
from archc.ir.ops import Op, canonical
from archc.ir.paramexpr import leaves, shard
from archc.passes.shard import shard_program
from archc.quant.tensor import Weight

Cut = tuple[int, int, int]     # (dim, parts, every): how the shard pass cuts a tensor


def rank_slices(program: Program, tp: int) -> dict[str, Cut]:
    """Checkpoint tensor → its cut, for each tensor that `program` (unfused, as lowered)
    sharded over `tp` ranks reads only in parts. Empty at tp = 1."""
    return _slices(shard_program(program, tp)) if tp > 1 else {}


def _slices(sharded: Program) -> dict[str, Cut]:
    slices: dict[str, Cut] = {}
    whole: set[str] = set()
    for g in sharded:
        for n in g.nodes:
            if n.op != Op.PARAM:
                continue
            expr = n.attr("expr")
            cut = _plain_shard(expr)
            if cut is not None and cut[0] == n.name:
                slices[n.name] = cut[1]
            else:
                whole.update(leaves(expr) if expr is not None else [n.name])
    return {k: v for k, v in slices.items() if k not in whole}


def _plain_shard(expr: Any) -> tuple[str, Cut] | None:
    """(NAME, (dim, parts, every)) when `expr` is ``shard(w(NAME), dim, parts, every)``."""
    if not isinstance(expr, Call) or expr.fn != "shard" or len(expr.args) != 1:
        return None
    arg, kw = expr.args[0], dict(expr.kwargs)
    if not isinstance(arg, Call) or arg.fn != "w":
        return None
    return arg.args[0], (int(kw["dim"]), int(kw["parts"]), int(kw.get("every", 1)))


def rank_span(cut: Cut, length: int, rank: int) -> tuple[int, int, int]:
    """(dim, start, stop): the elements of `dim` (of `length` in the whole tensor) that rank
    `rank` keeps of a tensor cut `cut` — what `take_slice` takes, and a loader reads."""
    dim, parts, every = cut
    size = length // parts
    index = rank // every
    return dim, index * size, (index + 1) * size


def take_slice(w: Weight, cut: Cut, rank: int) -> Weight:
    """Rank `rank`'s part of `w` (a copy: the whole tensor can be let go)."""
    dim, parts, every = cut
    return shard(w, dim, parts, every, rank=rank)


def presliced(program: Program, tp: int) -> Program:
    """`program` sharded over `tp` ranks, reading the tensors it reads in parts as they are:
    their ``shard()`` already taken when the checkpoint was read (``archc.load(…, tp=…,
    rank=…)``)."""
    sharded = shard_program(program, tp)
    names = set(_slices(sharded))
    graphs = []
    for g in sharded:
        nodes = tuple(n.replace(attrs=canonical(Op.PARAM, {**dict(n.attrs), "expr": None}))
                      if n.op == Op.PARAM and n.name in names and
                      (_plain_shard(n.attr("expr")) or ("",))[0] == n.name else n
                      for n in g.nodes)
        graphs.append(Graph(g.name, nodes))
    return Program(sharded.model, tuple(graphs))
