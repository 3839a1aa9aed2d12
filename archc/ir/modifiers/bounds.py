"""Interval arithmetic as Triton scalar code: the rules of ``interval`` over bounds a kernel knows
only when it runs — its tile's q_pos ∈ [q_lo, q_hi], kv_pos ∈ [k_lo, k_hi], a per-token input's
min and max over the tile — so that the kernel classifies each (query tile, key tile) exactly as
``tiles.classify`` would given the same ranges.

A bound is a Python number, known when the kernel is generated (±inf for an integer not known
at all), or the Triton code of an integer scalar; each half of a truth value (can be true, can be
false) a Python bool or the code of an int1 scalar. Each operation folds what is known and names
what is not (``cls_3 = tl.minimum(q_hi, k_hi)``), so the code grows with the expression's size,
never with its nesting. Runtime bounds are finite (positions, ids, heads), so ±inf never reaches
the code: it folds away (``min(x, inf) = x``, ``x < inf``) or makes the result unknown.

Integers and bools only: a float computed from runtime bounds is any float to the caller, which
is sound (a comparison of it can be true or false); floats known when the kernel is generated
keep ``interval``'s rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Code = str | int | float | bool   # a value known now, or the code of a scalar
INF = math.inf


def known(x: Code) -> bool:
    return not isinstance(x, str)


@dataclass(frozen=True)
class Span:
    """An integer lo ≤ value ≤ hi."""

    lo: Code
    hi: Code


@dataclass(frozen=True)
class Maybe:
    """A bool: whether it can be true, whether it can be false, over the tile."""

    true: Code
    false: Code


ANY = Span(-INF, INF)


class Scalars:
    """The code of one classification: each scalar it computes is a line `prefix<n> = …`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.lines: list[str] = []
        self.named: dict[str, str] = {}     # code → its name: each scalar computed once

    def name(self, code: str) -> str:
        """`code` (of identifiers and literals) as an identifier."""
        if code.isidentifier():
            return code
        if code not in self.named:
            self.named[code] = f"{self.prefix}{len(self.lines)}"
            self.lines.append(f"{self.named[code]} = {code}")
        return self.named[code]

    # ---- numbers: Python ints (±inf) fold, code is named ----------------------------------

    def add(self, a: Code, b: Code) -> Code:
        if known(a) and known(b):
            return a + b                 # lower bounds never hold +inf, nor upper ones −inf
        if known(a) and (math.isinf(a) or a == 0):
            return a if a else b
        if known(b) and (math.isinf(b) or b == 0):
            return b if b else a
        return self.name(f"{a} + {b}")

    def neg(self, a: Code) -> Code:
        return -a if known(a) else self.name(f"-{a}")

    def sub(self, a: Code, b: Code) -> Code:
        if known(a) and known(b):
            return a - b
        if known(b) and math.isinf(b) or known(a) and math.isinf(a):
            return self.add(a, self.neg(b))
        return a if b == 0 else self.name(f"{a} - {b}")

    def mul(self, a: Code, b: Code) -> Code:
        """a·b with a or b a finite known value (0·∞ = 0, as interval's corners), or both code."""
        if known(a) and known(b):
            return 0 if a == 0 or b == 0 else a * b
        k, x = (a, b) if known(a) else (b, a)
        if known(k):
            return 0 if k == 0 else x if k == 1 else self.name(f"{x} * {k}")
        return self.name(f"{a} * {b}")

    def minimum(self, a: Code, b: Code) -> Code:
        if known(a) and known(b):
            return min(a, b)
        for x, y in ((a, b), (b, a)):
            if known(x) and math.isinf(x):
                return y if x > 0 else x
        return self.name(f"tl.minimum({a}, {b})")

    def maximum(self, a: Code, b: Code) -> Code:
        if known(a) and known(b):
            return max(a, b)
        for x, y in ((a, b), (b, a)):
            if known(x) and math.isinf(x):
                return x if x > 0 else y
        return self.name(f"tl.maximum({a}, {b})")

    def floordiv(self, a: Code, n: int) -> Code:
        """⌊a / n⌋ (Python's), n ≥ 1: C's // truncates, so the exact form for a of any sign."""
        if known(a):
            return a if math.isinf(a) else a // n
        return self.name(f"({a} - {self.mod(a, n)}) // {n}")  # a − (a mod n): an exact division

    def mod(self, a: Code, n: int) -> Code:
        if known(a):
            return a % n
        return self.name(f"(({a} % {n}) + {n}) % {n}")

    def select(self, c: Code, a: Code, b: Code) -> Code:
        """a where c else b, all finite."""
        if known(c):
            return a if c else b
        if a == b:
            return a
        return self.name(f"tl.where({c}, {a}, {b})")

    # ---- comparisons and logic: Python bools fold ----------------------------------------

    def lt(self, a: Code, b: Code) -> Code:
        if known(a) and known(b):
            return a < b
        if (known(a) and a == -INF) or (known(b) and b == INF):
            return True
        if (known(a) and a == INF) or (known(b) and b == -INF):
            return False
        return self.name(f"{a} < {b}")

    def le(self, a: Code, b: Code) -> Code:
        if known(a) and known(b):
            return a <= b
        if any(known(x) and math.isinf(x) for x in (a, b)):
            return self.lt(a, b)
        return self.name(f"{a} <= {b}")

    def ne(self, a: Code, b: Code) -> Code:
        if known(a) and known(b):
            return a != b
        if a == b:
            return False
        if any(known(x) and math.isinf(x) for x in (a, b)):
            return True
        return self.name(f"{a} != {b}")

    def and_(self, a: Code, b: Code) -> Code:
        if known(a) or known(b):
            x, y = (a, b) if known(a) else (b, a)
            return y if x else False
        return self.name(f"{a} & {b}")

    def or_(self, a: Code, b: Code) -> Code:
        if known(a) or known(b):
            x, y = (a, b) if known(a) else (b, a)
            return True if x else y
        return self.name(f"{a} | {b}")

    def not_(self, a: Code) -> Code:
        return (not a) if known(a) else self.name(f"~{a}")


# ---- the rules: interval's, over Spans and Maybes -------------------------------------------

def _finite(*spans: Span) -> bool:
    return all(not (known(x) and math.isinf(x)) for s in spans for x in (s.lo, s.hi))


def add(s: Scalars, a: Span, b: Span) -> Span:
    return Span(s.add(a.lo, b.lo), s.add(a.hi, b.hi))


def sub(s: Scalars, a: Span, b: Span) -> Span:
    return Span(s.sub(a.lo, b.hi), s.sub(a.hi, b.lo))


def neg(s: Scalars, a: Span) -> Span:
    return Span(s.neg(a.hi), s.neg(a.lo))


def _point(a: Span) -> int | None:
    return a.lo if known(a.lo) and a.lo == a.hi and not math.isinf(a.lo) else None


def mul(s: Scalars, a: Span, b: Span) -> Span:
    for c, x in ((a, b), (b, a)):
        k = _point(c)
        if k is not None:     # a known factor: the bounds scale (and swap when it is negative)
            lo, hi = s.mul(k, x.lo), s.mul(k, x.hi)
            return Span(lo, hi) if k >= 0 else Span(hi, lo)
    if not _finite(a, b):
        return ANY
    corners = [s.mul(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo, hi = corners[0], corners[0]
    for c in corners[1:]:
        lo, hi = s.minimum(lo, c), s.maximum(hi, c)
    return Span(lo, hi)


def floordiv(s: Scalars, a: Span, b: Span) -> Span:
    n = _point(b)
    if n is None or n < 1:
        return ANY
    return Span(s.floordiv(a.lo, n), s.floordiv(a.hi, n))


def mod(s: Scalars, a: Span, b: Span) -> Span:
    """Exact within one period of n, else [0, n − 1] (interval.mod)."""
    n = _point(b)
    if n is None or n < 1:
        return ANY
    if not _finite(a):
        return Span(0, n - 1)
    same = s.lt(s.sub(s.floordiv(a.hi, n), s.floordiv(a.lo, n)), 1)
    return Span(s.select(same, s.mod(a.lo, n), 0), s.select(same, s.mod(a.hi, n), n - 1))


def abs_(s: Scalars, a: Span) -> Span:
    return Span(s.maximum(s.maximum(a.lo, s.neg(a.hi)), 0), s.maximum(s.neg(a.lo), a.hi))


def minimum(s: Scalars, a: Span, b: Span) -> Span:
    return Span(s.minimum(a.lo, b.lo), s.minimum(a.hi, b.hi))


def maximum(s: Scalars, a: Span, b: Span) -> Span:
    return Span(s.maximum(a.lo, b.lo), s.maximum(a.hi, b.hi))


def lt(s: Scalars, a: Span, b: Span) -> Maybe:
    return Maybe(s.lt(a.lo, b.hi), s.le(b.lo, a.hi))


def le(s: Scalars, a: Span, b: Span) -> Maybe:
    return Maybe(s.le(a.lo, b.hi), s.lt(b.lo, a.hi))


def gt(s: Scalars, a: Span, b: Span) -> Maybe:
    return lt(s, b, a)


def ge(s: Scalars, a: Span, b: Span) -> Maybe:
    return le(s, b, a)


def _same(s: Scalars, a: Maybe, b: Maybe) -> Maybe:
    """a == b of truth values: each can equal the other where both can be true or both false."""
    return Maybe(s.or_(s.and_(a.true, b.true), s.and_(a.false, b.false)),
                 s.or_(s.and_(a.true, b.false), s.and_(a.false, b.true)))


def eq(s: Scalars, a: Span | Maybe, b: Span | Maybe) -> Maybe:
    if isinstance(a, Maybe) and isinstance(b, Maybe):
        return _same(s, a, b)
    assert isinstance(a, Span) and isinstance(b, Span)
    # can be false unless both are one and the same value
    return Maybe(s.and_(s.le(a.lo, b.hi), s.le(b.lo, a.hi)),
                 s.or_(s.or_(s.ne(a.lo, a.hi), s.ne(b.lo, b.hi)), s.ne(a.lo, b.lo)))


def ne(s: Scalars, a: Span | Maybe, b: Span | Maybe) -> Maybe:
    e = eq(s, a, b)
    return Maybe(e.false, e.true)


def and_(s: Scalars, a: Maybe, b: Maybe) -> Maybe:
    return Maybe(s.and_(a.true, b.true), s.or_(a.false, b.false))


def or_(s: Scalars, a: Maybe, b: Maybe) -> Maybe:
    return Maybe(s.or_(a.true, b.true), s.and_(a.false, b.false))


def not_(s: Scalars, a: Maybe) -> Maybe:
    return Maybe(a.false, a.true)


def where(s: Scalars, c: Maybe, a: Span | Maybe, b: Span | Maybe) -> Span | Maybe:
    """Either branch the condition can take; with a runtime condition, the branch the tile
    takes (both: their hull)."""
    if isinstance(a, Maybe) and isinstance(b, Maybe):
        return Maybe(s.or_(s.and_(c.true, a.true), s.and_(c.false, b.true)),
                     s.or_(s.and_(c.true, a.false), s.and_(c.false, b.false)))
    assert isinstance(a, Span) and isinstance(b, Span)
    if c.false is False:
        return a
    if c.true is False:
        return b
    lo, hi = s.minimum(a.lo, b.lo), s.maximum(a.hi, b.hi)
    if not _finite(a, b):
        return Span(lo, hi)
    # only the true branch where the condition cannot be false, only the false one where it
    # cannot be true, else both
    return Span(s.select(c.false, s.select(c.true, lo, b.lo), a.lo),
                s.select(c.false, s.select(c.true, hi, b.hi), a.hi))
