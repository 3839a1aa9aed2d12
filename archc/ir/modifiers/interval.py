"""Interval arithmetic over the modifier language's values, sound for what torch and the kernels
compute: a number's interval holds every value the expression can take over a tile, a truth
value says whether the expression can be true and whether it can be false there.

Integers are exact (Python ints; ±inf where a range is unknown). Floats are computed in f64 and
widened outward by a relative 2⁻²⁰ after each operation — far more than the f32 rounding of one
operation or of torch's and Triton's exp/log/tanh (a few ulps, 2⁻²² each) — and a bound past
f32's largest value becomes ±inf, where f32 overflows. A float that can be NaN (log or sqrt
outside their domain, ∞ − ∞, 0/0) carries `nan`: every comparison with NaN is false, except
``!=``, which is true.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

INF = math.inf
F32_MAX = 3.4028234663852886e38
_WIDEN = 2.0 ** -20


@dataclass(frozen=True)
class Interval:
    """lo ≤ value ≤ hi (ints or ±inf for an integer, floats for a float); `nan`: the value may
    also be NaN."""

    lo: float
    hi: float
    nan: bool = False

    @property
    def single(self) -> bool:
        return self.lo == self.hi and not self.nan and math.isfinite(self.lo)


@dataclass(frozen=True)
class Truth:
    """What a boolean expression can be over a tile: true somewhere, false somewhere."""

    can_true: bool
    can_false: bool


TRUE, FALSE, MAYBE = Truth(True, False), Truth(False, True), Truth(True, True)
ANY_INT = Interval(-INF, INF)
ANY_FLOAT = Interval(-INF, INF, nan=True)

Value = Interval | Truth


def truth(v: bool) -> Truth:
    return TRUE if v else FALSE


def point(v: float | bool) -> Value:
    return truth(v) if isinstance(v, bool) else Interval(v, v)


def span(lo: float | bool, hi: float | bool) -> Value:
    """[lo, hi] of numbers, or of truth values (False < True)."""
    if isinstance(lo, bool) and isinstance(hi, bool):
        return Truth(hi, not lo)
    return Interval(lo, hi)


def widen(lo: float, hi: float, nan: bool = False) -> Interval:
    """A float result [lo, hi] made sound for f32: widened outward, past F32_MAX infinite."""
    if math.isnan(lo) or math.isnan(hi):
        return ANY_FLOAT
    if math.isfinite(lo):
        lo = lo - abs(lo) * _WIDEN - 1e-38
    if math.isfinite(hi):
        hi = hi + abs(hi) * _WIDEN + 1e-38
    return Interval(-INF if lo < -F32_MAX else lo, INF if hi > F32_MAX else hi, nan)


def to_float(a: Interval) -> Interval:
    """An integer converted to f32 (rounded past 2²⁴)."""
    return widen(float(a.lo), float(a.hi), a.nan)


def _ints(lo: float, hi: float) -> Interval:
    return Interval(lo, hi)


def _corners(op: Callable[[float, float], float], a: Interval, b: Interval) -> list[float]:
    out = []
    for x in (a.lo, a.hi):
        for y in (b.lo, b.hi):
            try:
                v = op(x, y)
            except (OverflowError, ZeroDivisionError):
                v = math.nan
            out.append(v)
    return out


def _mul(x: float, y: float) -> float:
    # 0·∞ is 0 for the real values the bounds stand for
    return 0 if x == 0 or y == 0 else x * y


def _arith(op: Callable[[float, float], float], floats: bool) -> Callable[..., Interval]:
    def rule(a: Interval, b: Interval) -> Interval:
        vs = _corners(op, a, b)
        nan = a.nan or b.nan
        if any(math.isnan(v) for v in vs):
            return ANY_FLOAT if floats else ANY_INT
        if floats:
            # an infinite operand value can meet ∞ − ∞ or ∞·0
            nan = nan or any(math.isinf(v) for v in (a.lo, a.hi, b.lo, b.hi))
            return widen(min(vs), max(vs), nan)
        return _ints(min(vs), max(vs))
    return rule


def add(a: Interval, b: Interval, floats: bool) -> Interval:
    return _arith(lambda x, y: x + y, floats)(a, b)


def sub(a: Interval, b: Interval, floats: bool) -> Interval:
    return _arith(lambda x, y: x - y, floats)(a, b)


def mul(a: Interval, b: Interval, floats: bool) -> Interval:
    return _arith(_mul, floats)(a, b)


def truediv(a: Interval, b: Interval) -> Interval:
    if b.lo <= 0 <= b.hi or b.nan:
        return ANY_FLOAT
    return _arith(lambda x, y: x / y, True)(a, b)


def floordiv(a: Interval, b: Interval) -> Interval:
    """⌊a / b⌋ for 1 ≤ b < ∞: monotone in a, and in b on each sign of a, so the corners bound
    it (±∞ stays ±∞)."""
    if b.lo < 1 or math.isinf(b.hi):
        return ANY_INT
    vs = [x if math.isinf(x) else x // y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return _ints(min(vs), max(vs))


def mod(a: Interval, b: Interval) -> Interval:
    """a mod b ∈ [0, b − 1] for b ≥ 1; exact when a stays within one period of a single b."""
    if b.lo < 1:
        return ANY_INT
    if b.single and math.isfinite(a.lo) and math.isfinite(a.hi) and \
            a.lo // b.lo == a.hi // b.lo:
        return _ints(a.lo % b.lo, a.hi % b.lo)
    return _ints(0, b.hi - 1)


def neg(a: Interval, floats: bool) -> Interval:
    return Interval(-a.hi, -a.lo, a.nan)


def abs_(a: Interval, floats: bool) -> Interval:
    if a.lo >= 0:
        return a
    if a.hi <= 0:
        return Interval(-a.hi, -a.lo, a.nan)
    return Interval(0 if not floats else 0.0, max(-a.lo, a.hi), a.nan)


def minimum(a: Interval, b: Interval, floats: bool) -> Interval:
    # torch.minimum and tl.minimum propagate NaN
    return Interval(min(a.lo, b.lo), min(a.hi, b.hi), a.nan or b.nan)


def maximum(a: Interval, b: Interval, floats: bool) -> Interval:
    return Interval(max(a.lo, b.lo), max(a.hi, b.hi), a.nan or b.nan)


def increasing(f: Callable[[float], float], domain_lo: float = -INF,
               at_domain_lo: float | None = None) -> Callable[[Interval], Interval]:
    """The rule of a function increasing on [domain_lo, ∞], NaN below it (`at_domain_lo`: its
    value at domain_lo, log(0) = −∞). `f` takes ±∞ and overflows to ∞."""
    def rule(a: Interval) -> Interval:
        if a.hi < domain_lo:
            return ANY_FLOAT
        def g(x: float) -> float:
            return at_domain_lo if x == domain_lo and at_domain_lo is not None else f(x)
        return widen(g(max(a.lo, domain_lo)), g(a.hi), a.nan or a.lo < domain_lo)
    return rule


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= -700 else 0.0


exp = increasing(lambda x: math.exp(x) if x < 710 else INF)
log = increasing(lambda x: math.log(x) if x < INF else INF, 0.0, -INF)
sqrt = increasing(lambda x: math.sqrt(x) if x < INF else INF, 0.0, 0.0)
tanh = increasing(math.tanh)
sigmoid = increasing(_sigmoid)


def floor(a: Interval) -> Interval:
    """⌊a⌋ as an integer; what f32 NaN or ∞ convert to is unspecified, so then any integer."""
    if a.nan or math.isinf(a.lo) or math.isinf(a.hi):
        return ANY_INT
    return _ints(math.floor(a.lo), math.floor(a.hi))


def _compare(decide: Callable[[Interval, Interval], Truth], with_nan: bool
             ) -> Callable[[Value, Value], Truth]:
    """A comparison decided on the numbers, then joined with its value when an operand may be
    NaN (`with_nan`: false for < ≤ > ≥ ==, true for !=)."""
    def rule(a: Value, b: Value) -> Truth:
        if isinstance(a, Truth) and isinstance(b, Truth):   # == and != of truth values
            same = Truth(a.can_true and b.can_true or a.can_false and b.can_false,
                         a.can_true and b.can_false or a.can_false and b.can_true)
            return same if not with_nan else Truth(same.can_false, same.can_true)
        assert isinstance(a, Interval) and isinstance(b, Interval)
        t = decide(a, b)
        if a.nan or b.nan:
            return Truth(t.can_true or with_nan, t.can_false or not with_nan)
        return t
    return rule


def _lt(a: Interval, b: Interval) -> Truth:
    return Truth(a.lo < b.hi, a.hi >= b.lo)


def _le(a: Interval, b: Interval) -> Truth:
    return Truth(a.lo <= b.hi, a.hi > b.lo)


def _eq(a: Interval, b: Interval) -> Truth:
    return Truth(a.lo <= b.hi and b.lo <= a.hi, not (a.single and b.single and a.lo == b.lo))


lt = _compare(_lt, False)
le = _compare(_le, False)
gt = _compare(lambda a, b: _lt(b, a), False)
ge = _compare(lambda a, b: _le(b, a), False)
eq = _compare(_eq, False)
ne = _compare(lambda a, b: Truth(_eq(a, b).can_false, _eq(a, b).can_true), True)


def and_(a: Truth, b: Truth) -> Truth:
    return Truth(a.can_true and b.can_true, a.can_false or b.can_false)


def or_(a: Truth, b: Truth) -> Truth:
    return Truth(a.can_true or b.can_true, a.can_false and b.can_false)


def not_(a: Truth) -> Truth:
    return Truth(a.can_false, a.can_true)


def hull(a: Value, b: Value) -> Value:
    if isinstance(a, Truth) and isinstance(b, Truth):
        return Truth(a.can_true or b.can_true, a.can_false or b.can_false)
    assert isinstance(a, Interval) and isinstance(b, Interval)
    return Interval(min(a.lo, b.lo), max(a.hi, b.hi), a.nan or b.nan)


def where(c: Truth, a: Value, b: Value) -> Value:
    if not c.can_false:
        return a
    if not c.can_true:
        return b
    return hull(a, b)

