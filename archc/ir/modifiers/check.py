"""Typing of modifier expressions: which names mean what (an `Env`), what each function takes,
and what a field must be. A `score` field is a float expression and may use `score`; a `mask`
field is a bool expression and may not (a mask is known before the scores: that is what lets
the kernels skip whole tiles). Every refusal is one line naming the field, the column and what
is allowed."""

from __future__ import annotations

import math
from typing import Literal

from archc.ir.attrs import Call, format_value
from archc.ir.modifiers import interval as iv
from archc.ir.modifiers.language import (
    CALLS,
    FUNCTIONS,
    HEAD_INDEX,
    INTEGER_DIVISOR,
    MAX_DEPTH,
    MAX_FLOAT,
    MAX_INT,
    TOKEN_INDEX,
    Env,
    Expr,
    Type,
    TypeProblem,
    is_literal,
    substitute,
    type_of,
    type_of_literal,
    var,
)
from archc.ir.modifiers.syntax import ExprError, Parsed, format_expr, parse
from archc.ir.modifiers.tiles import Tile, value_range

Kind = Literal["score", "mask"]
FIELD_TYPES: dict[str, Type] = {"score": float, "mask": bool}


def _name(t: Type) -> str:
    return t.__name__


def _shown(e: Expr) -> str:
    """A subexpression of a tree read from the IR, as the IR prints it."""
    try:
        return format_value(e)
    except (TypeError, ValueError):
        return repr(e)


class _Checker:
    def __init__(self, field: str, kind: Kind, env: Env, parsed: Parsed) -> None:
        self.field, self.kind, self.env, self.parsed = field, kind, env, parsed

    def fail(self, e: Expr, problem: str, allowed: str | None = None) -> ExprError:
        col = self.parsed.column(e)
        where = f" (in {_shown(e)})" if col is None and not is_literal(e) else ""
        return ExprError(self.field, col, problem + where, allowed)

    def names(self) -> str:
        own = [n for n in self.env.names() if not (self.kind == "mask" and n == "score")]
        return ", ".join(own)

    def type(self, e: Expr) -> Type:
        if is_literal(e):
            return self.literal(e)
        if not isinstance(e, Call):
            raise self.fail(e, f"not an expression: {e!r}")
        if e.fn == "var":
            return self.variable(e)
        if e.fn == "index":
            return self.indexed(e)
        f = FUNCTIONS.get(e.fn)
        if f is None:
            raise self.fail(e, f"unknown function {e.fn}()",
                            allowed=", ".join(f"{c}()" for c in CALLS))
        what = f"{f.symbol!r}" if f.symbol else f"{e.fn}()"
        if len(e.args) != f.arity or e.kwargs:
            raise self.fail(e, f"{what} takes {f.arity} argument{'s' * (f.arity > 1)}, got "
                            f"{len(e.args)}")
        types = [self.type(a) for a in e.args]
        try:
            result = f.typing(*types)[1]
        except TypeProblem as err:
            raise self.fail(e, f"{what} {err}, got {' and '.join(map(_name, types))}") from None
        if e.fn in INTEGER_DIVISOR:
            d = e.args[1]
            if isinstance(d, Call) and d.fn == "var" and d.args[0] in self.env.constants:
                d = self.env.constants[d.args[0]]
            if not (isinstance(d, int) and not isinstance(d, bool) and d >= 1):
                raise self.fail(e, f"{what} divides by {format_expr(d)}",
                                allowed="a positive integer literal or constant on the right")
        return result

    def literal(self, v: bool | int | float, named: Call | None = None) -> Type:
        """A literal's type, or for `named`, a constant's; refused past the bounds."""
        at, what = (v, "the") if named is None else (named, f"the constant {named.args[0]} =")
        if not isinstance(v, bool) and isinstance(v, int) and abs(v) > MAX_INT:
            raise self.fail(at, f"{what} integer {v} is too large",
                            allowed=f"magnitudes up to {MAX_INT}")
        if isinstance(v, float) and not (math.isfinite(v) and abs(v) <= MAX_FLOAT):
            raise self.fail(at, f"{what} number {v!r} is out of range",
                            allowed=f"finite magnitudes up to {MAX_FLOAT:g}")
        if not isinstance(v, (bool, int, float)):
            raise self.fail(at, f"{what} value {v!r} is not a number or a bool")
        return type_of_literal(v)

    def variable(self, e: Call) -> Type:
        name = e.args[0] if len(e.args) == 1 else None
        kind = self.env.kind(name) if isinstance(name, str) else None
        if name == "score" and self.kind == "mask":
            raise self.fail(e, "a mask may not use score: it is known before the scores",
                            allowed=self.names())
        if kind in ("head_param", "token_input"):
            at = HEAD_INDEX if kind == "head_param" else TOKEN_INDEX
            raise self.fail(e, f"{name} is a per-{kind.split('_')[0]} "
                            f"{'parameter' if kind == 'head_param' else 'input'}: write "
                            f"{name}[{at[0]}] or {name}[{at[1]}]")
        if kind is None:
            hint = ": write true or false" if name in ("True", "False") else ""
            raise self.fail(e, f"undefined name {name!r}{hint}", allowed=self.names())
        if kind == "constant":
            return self.literal(self.env.constants[name], e)
        return self.env.leaf_type(e)

    def indexed(self, e: Call) -> Type:
        name, at = e.args if len(e.args) == 2 else (None, None)
        kind = self.env.kind(name) if isinstance(name, str) else None
        if kind not in ("head_param", "token_input"):
            params = [*self.env.head_params, *self.env.token_inputs]
            raise self.fail(e, f"{name} is not a per-head parameter or per-token input, so it "
                            "cannot be indexed", allowed=", ".join(params) or "none declared")
        allowed = HEAD_INDEX if kind == "head_param" else TOKEN_INDEX
        if not (isinstance(at, Call) and at.fn == "var" and at.args and at.args[0] in allowed):
            what = "per-head parameter" if kind == "head_param" else "per-token input"
            raise self.fail(e, f"{name} is a {what}, indexed by {format_expr(at)}",
                            allowed=f"{name}[{allowed[0]}] or {name}[{allowed[1]}]")
        return self.env.leaf_type(e)


def _too_deep(e: Expr) -> Expr | None:
    """The first call nested past MAX_DEPTH (or holding a literal past it), found without
    recursion."""
    stack = [(e, e, 1)]
    while stack:
        x, call, d = stack.pop()
        if d > MAX_DEPTH:
            return call
        if isinstance(x, Call) and x.fn not in ("var", "index"):
            stack.extend((a, a if isinstance(a, Call) else x, d + 1) for a in x.args)
    return None


def check(e: Expr, field: str, kind: Kind, env: Env, parsed: Parsed | None = None) -> Type:
    """Refuse `e` unless it is a well-typed `kind` expression over `env` (an ExprError naming
    the field and, with the `parsed` text's columns, where); its type otherwise."""
    parsed = parsed or Parsed(e)
    checker = _Checker(field, kind, env, parsed)
    if (deep := _too_deep(e)) is not None:
        raise checker.fail(deep, f"the expression nests deeper than {MAX_DEPTH} levels")
    t = checker.type(e)
    if t is not FIELD_TYPES[kind]:
        what = "a float expression (of score and positions)" if kind == "score" else \
            "a bool expression (true where a key is visible)"
        raise ExprError(field, 1 if parsed.columns else None,
                        f"a {kind} is {what}; this one is {_name(t)}")
    return t


def parse_field(text: str, field: str, kind: Kind, env: Env | None = None) -> Expr:
    """Read the `kind` expression `text` of spec field `field`: parsed, checked over `env`, its
    named constants replaced by their values. Any problem is one ExprError line."""
    env = env or Env()
    if not isinstance(text, str):
        raise ExprError(field, None, f"must be an expression written as text, got {text!r}")
    parsed = parse(text, field)
    check(parsed.tree, field, kind, env, parsed)
    return substitute(parsed.tree, {var(n): v for n, v in env.constants.items()})


def _subtrees(e: Expr) -> list[Call]:
    """The calls of `e` that are not leaves, each after its arguments."""
    if is_literal(e) or e.fn in ("var", "index"):
        return []
    return [*(s for a in e.args for s in _subtrees(a)), e]


def check_int32(e: Expr, field: str, env: Env, max_position: int) -> None:
    """Refuse `e` (checked) if an integer it computes can leave int32 (the kernels' positions)
    at positions below `max_position`: each integer subexpression's interval over the tile of
    every position and head. What is computed from per-token inputs or scalars, whose values
    are not known here, is not refused."""
    tile = Tile((0, max_position - 1), (0, max_position - 1))
    for sub in _subtrees(e):
        if type_of(sub, env) is not int:
            continue
        r = value_range(sub, env, tile)
        assert isinstance(r, iv.Interval)
        past = [b for b in (r.lo, r.hi) if math.isfinite(b) and abs(b) > MAX_INT]
        if past:
            raise ExprError(field, None, f"{format_expr(sub)} reaches {past[0]:g} at positions "
                            f"below {max_position}",
                            allowed=f"integers within ±{MAX_INT}, the kernels' int32")
