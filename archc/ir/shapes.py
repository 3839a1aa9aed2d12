"""Symbolic shapes: sympy expressions over the dynamic dims, and their one-line text form.

The dims are ``B`` (batch), ``T`` (new tokens this call), ``P`` (past tokens already in the KV
cache) and ``S`` (encoder length, seen by a decoder's cross-attention). Everything else in a shape
is a static model size. Dims parse with a small grammar of their own (integers, the four symbols,
``+``, ``-``, ``*``, parentheses) — never with ``sympify``, which evaluates Python.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import sympy

B = sympy.Symbol("B", integer=True, positive=True)
T = sympy.Symbol("T", integer=True, positive=True)
P = sympy.Symbol("P", integer=True, nonnegative=True)
S = sympy.Symbol("S", integer=True, positive=True)
DIMS: dict[str, sympy.Symbol] = {"B": B, "T": T, "P": P, "S": S}

Dim = sympy.Expr
Shape = tuple[sympy.Expr, ...]

DTYPE_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "bool": 1}
FLOAT_DTYPES = ("f32", "f16", "bf16")


def shape(*dims: int | sympy.Expr) -> Shape:
    return tuple(sympy.sympify(d) if isinstance(d, int) else d for d in dims)


def numel(s: Sequence[sympy.Expr]) -> sympy.Expr:
    out: sympy.Expr = sympy.Integer(1)
    for d in s:
        out = out * d
    return out


def format_dim(d: sympy.Expr) -> str:
    return str(d).replace(" ", "")


def format_shape(dtype: str, s: Sequence[sympy.Expr]) -> str:
    return f"{dtype}[{','.join(format_dim(d) for d in s)}]"


def evaluate(expr: sympy.Expr | int, dims: Mapping[str, int]) -> int:
    """A dim or cost at concrete B, T, P, S."""
    if isinstance(expr, int):
        return expr
    value = expr.subs({DIMS[k]: v for k, v in dims.items() if k in DIMS})
    if value.free_symbols:
        missing = ", ".join(sorted(str(s) for s in value.free_symbols))
        raise ValueError(f"{expr} needs a value for {missing}")
    return int(value)


def concrete(s: Sequence[sympy.Expr], dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(d, dims) for d in s)


# ---- parsing dims --------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*)|(.))")


def parse_dim(text: str) -> sympy.Expr:
    """Parse `P+T`, `2*T`, `576`, `(P+T)*4` into a sympy expression over B, T, P, S."""
    tokens: list[tuple[str, str]] = []
    for num, name, punct in _TOKEN.findall(text):
        if num:
            tokens.append(("num", num))
        elif name:
            if name not in DIMS:
                raise ValueError(f"unknown dim {name!r} in {text!r} (known: B, T, P, S)")
            tokens.append(("sym", name))
        elif punct.strip():
            if punct not in "+-*()":
                raise ValueError(f"unexpected {punct!r} in dim {text!r}")
            tokens.append(("op", punct))
    pos = 0

    def peek() -> tuple[str, str] | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> tuple[str, str]:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"dim {text!r} ends early")
        pos += 1
        return tokens[pos - 1]

    def expr() -> sympy.Expr:
        value = term()
        while (tok := peek()) and tok[1] in "+-" and tok[0] == "op":
            take()
            rhs = term()
            value = value + rhs if tok[1] == "+" else value - rhs
        return value

    def term() -> sympy.Expr:
        value = atom()
        while (tok := peek()) and tok == ("op", "*"):
            take()
            value = value * atom()
        return value

    def atom() -> sympy.Expr:
        kind, val = take()
        if kind == "num":
            return sympy.Integer(int(val))
        if kind == "sym":
            return DIMS[val]
        if val == "-":
            return -atom()
        if val == "(":
            inner = expr()
            if take() != ("op", ")"):
                raise ValueError(f"unbalanced parentheses in dim {text!r}")
            return inner
        raise ValueError(f"unexpected {val!r} in dim {text!r}")

    result = expr()
    if pos != len(tokens):
        raise ValueError(f"trailing text in dim {text!r}")
    return result
