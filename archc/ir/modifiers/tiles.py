"""Block sparsity from a mask expression: each (query tile, key tile) classified by interval
arithmetic over the tile's ranges as `full` (every pair visible: the kernel skips the mask),
`empty` (none: the kernel skips the tile) or `partial`, soundly — never empty where a pair is
visible, never full where one is hidden.

A tile knows its position ranges q_pos ∈ [q0, q1], kv_pos ∈ [k0, k1], its heads, and for each
per-token input its min and max over the query tile and over the key tile; a per-sequence
scalar or per-head parameter not given is any value. The ranges are independent, so
``q_pos - kv_pos`` is exactly [q0 − k1, q1 − k0]; ``q_pos // 8192`` is one value on a tile
inside one chunk, so chunked attention's tiles come out full or empty, never partial, when
they align with the chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch

from archc.ir.attrs import Call
from archc.ir.modifiers import bounds as bd
from archc.ir.modifiers import interval as iv
from archc.ir.modifiers.language import Env, Expr, Function, Type, fold

Range = tuple[float, float]     # inclusive [lo, hi] of ints, floats or bools


class TileClass(str, Enum):
    FULL = "full"
    PARTIAL = "partial"
    EMPTY = "empty"


@dataclass(frozen=True)
class Tile:
    """What a (query tile, key tile) pair knows: inclusive ranges, for each per-token input
    its (min, max) over the query tile and over the key tile, and for each per-head parameter
    its range at every head and KV head of the tile."""

    q_pos: Range
    kv_pos: Range
    head: Range = (0, math.inf)
    kv_head: Range = (0, math.inf)
    tokens: Mapping[str, tuple[Range, Range]] = field(default_factory=dict)
    scalars: Mapping[str, Range] = field(default_factory=dict)
    head_params: Mapping[str, Range] = field(default_factory=dict)


class Intervals:
    """The interval rendering over one tile (what `fold` calls)."""

    def __init__(self, tile: Tile) -> None:
        self.tile = tile

    def literal(self, v: bool | int | float) -> iv.Value:
        return iv.point(v)

    def leaf(self, e: Call, t: Type) -> iv.Value:
        tile, name = self.tile, e.args[0]
        unknown = iv.MAYBE if t is bool else iv.ANY_FLOAT if t is float else iv.ANY_INT
        if e.fn == "index":
            if name in tile.tokens:
                return iv.span(*tile.tokens[name][0 if e.args[1].args[0] == "q_pos" else 1])
            return iv.span(*tile.head_params[name]) if name in tile.head_params else unknown
        if name in ("q_pos", "kv_pos", "head", "kv_head"):
            return iv.span(*getattr(tile, name))
        return iv.span(*tile.scalars[name]) if name in tile.scalars else unknown

    def to_float(self, x: iv.Value) -> iv.Value:
        assert isinstance(x, iv.Interval)
        return iv.to_float(x)

    def apply(self, f: Function, args: list[iv.Value], result: Type) -> iv.Value:
        return f.interval(*args, result is float) if f.by_float else f.interval(*args)


def value_range(e: Expr, env: Env, tile: Tile) -> iv.Value:
    """The interval of `e` (or its Truth, for a bool) over `tile`."""
    return fold(e, env, Intervals(tile))[0]


def classify(mask: Expr, env: Env, tile: Tile) -> TileClass:
    """`mask` (a checked bool expression) over `tile`: full, empty or partial."""
    t = value_range(mask, env, tile)
    assert isinstance(t, iv.Truth)
    return TileClass.FULL if not t.can_false else TileClass.EMPTY if not t.can_true else \
        TileClass.PARTIAL


@dataclass(frozen=True)
class TileMap:
    """Every tile of T queries (at positions L − T … L − 1) over L keys, in tiles of block_m
    queries by block_n keys: classes[i][j] for query tile i, key tile j. The last tiles of each
    side hold what is left of the sequence; keys past L are the kernel's to mask, not the
    map's."""

    t: int
    length: int
    block_m: int
    block_n: int
    classes: tuple[tuple[TileClass, ...], ...]

    def count(self, c: TileClass) -> int:
        return sum(row.count(c) for row in self.classes)

    @property
    def tiles(self) -> int:
        return sum(len(row) for row in self.classes)

    @property
    def visited(self) -> float:
        """The fraction of tiles a kernel visits: those not empty."""
        return 1.0 - self.count(TileClass.EMPTY) / self.tiles if self.tiles else 0.0

    def text(self) -> str:
        """One line per query tile, one character per key tile: █ full, ▒ partial, · empty."""
        mark = {TileClass.FULL: "█", TileClass.PARTIAL: "▒", TileClass.EMPTY: "·"}
        return "\n".join("".join(mark[c] for c in row) for row in self.classes)


def _ranges(x: torch.Tensor, starts: range, size: int, end: int) -> list[Range]:
    return [(x[s:min(s + size, end)].min().item(), x[s:min(s + size, end)].max().item())
            for s in starts]


def tile_map(mask: Expr, env: Env, *, t: int, length: int, block_m: int, block_n: int,
             heads: int | None = None, kv_heads: int | None = None,
             tokens: Mapping[str, torch.Tensor] | None = None,
             scalars: Mapping[str, Range] | None = None,
             head_params: Mapping[str, torch.Tensor] | None = None) -> TileMap:
    """The classification of every tile of one sequence (T queries at its end, L keys), for
    all heads at once. `tokens`: each per-token input over the sequence's positions [≥ L];
    `scalars`: each per-sequence scalar's known range (absent: any value); `head_params`:
    each per-head parameter's values (their range is used)."""
    tokens, head_params = tokens or {}, head_params or {}
    past = length - t
    q_starts, k_starts = range(0, t, block_m), range(0, length, block_n)
    q_tok = {n: _ranges(x, range(past, length, block_m), block_m, length)
             for n, x in tokens.items()}
    k_tok = {n: _ranges(x, k_starts, block_n, length) for n, x in tokens.items()}
    base = dict(head=(0, heads - 1) if heads else (0, math.inf),
                kv_head=(0, kv_heads - 1) if kv_heads else (0, math.inf),
                scalars=dict(scalars or {}),
                head_params={n: (p.min().item(), p.max().item()) for n, p in head_params.items()})
    rows = []
    for i, qs in enumerate(q_starts):
        q = (past + qs, past + min(qs + block_m, t) - 1)
        rows.append(tuple(
            classify(mask, env, Tile(q, (ks, min(ks + block_n, length) - 1), tokens={
                n: (q_tok[n][i], k_tok[n][j]) for n in tokens}, **base))
            for j, ks in enumerate(k_starts)))
    return TileMap(t, length, block_m, block_n, tuple(rows))


# ---- the same classification as Triton code, for a kernel that knows its tile when it runs ---

@dataclass(frozen=True)
class TileCode:
    """A mask's classification of one tile as Triton scalar code: statements, then whether a
    pair of the tile can be visible (`live`: the kernel visits the tile) and whether every pair
    is (`full`: it skips the mask) — each the code of an int1 scalar, or a Python bool when
    known as the kernel is generated."""

    lines: tuple[str, ...]
    live: str | bool
    full: str | bool


class _KernelIntervals:
    """`fold`'s backend for a kernel's classifier: a leaf of `ranges` is the Span of its
    bounds' code, any other leaf unknown; functions of known intervals apply interval's rule,
    of integer or bool bounds only known at run time their ``bounds`` rule."""

    def __init__(self, ranges: Mapping[Expr, tuple[str, str]], prefix: str) -> None:
        self.ranges = ranges
        self.scalars = bd.Scalars(prefix)

    def literal(self, v: bool | int | float) -> iv.Value:
        return iv.point(v)

    def leaf(self, e: Call, t: Type) -> iv.Value | bd.Span:
        if e in self.ranges and t is int:
            return bd.Span(*self.ranges[e])
        return iv.MAYBE if t is bool else iv.ANY_FLOAT if t is float else iv.ANY_INT

    def to_float(self, x: iv.Value | bd.Span) -> iv.Value:
        return iv.to_float(x) if isinstance(x, iv.Interval) else iv.ANY_FLOAT

    def apply(self, f: Function, args: list, result: Type) -> iv.Value | bd.Span | bd.Maybe:
        if all(isinstance(a, (iv.Interval, iv.Truth)) for a in args):
            return f.interval(*args, result is float) if f.by_float else f.interval(*args)
        if f.bounds is None:   # a float of runtime bounds (its arguments are ints here)
            return iv.ANY_FLOAT
        # runtime bounds: integers and bools (a float's arguments became known intervals)
        spans = [bd.Span(a.lo, a.hi) if isinstance(a, iv.Interval) else
                 bd.Maybe(a.can_true, a.can_false) if isinstance(a, iv.Truth) else a
                 for a in args]
        return f.bounds(self.scalars, *spans)


def triton_classify(mask: Expr, env: Env, ranges: Mapping[Expr, tuple[str, str]], *,
                    live_if: str | None = None, full_if: str | None = None,
                    prefix: str = "cls_") -> TileCode:
    """`mask` (a checked bool expression) classified in a kernel: `ranges` names the code of
    the (lo, hi) bounds of each leaf the kernel knows over its tile — var("q_pos") →
    ("q_lo", "q_hi"), index("doc", "kv_pos") → ("doc_k_lo", "doc_k_hi") — each an identifier
    of an integer scalar; every other leaf may be anything. `live_if` and `full_if`: what the
    tile itself needs besides (keys in it; no key past the end). Given the same ranges as a
    ``Tile``, the result is ``classify``'s on integer masks, and never less conservative."""
    backend = _KernelIntervals(ranges, prefix)
    t = fold(mask, env, backend)[0]
    s = backend.scalars
    can_true, can_false = (t.can_true, t.can_false) if isinstance(t, iv.Truth) else \
        (t.true, t.false)
    live, full = can_true, s.not_(can_false)
    if live_if is not None:
        live = s.and_(live, s.name(live_if))
    if full_if is not None:
        full = s.and_(full, s.name(full_if))
    return TileCode(tuple(s.lines), live, full)
