"""Symbolic shapes: sympy expressions over the dynamic dims ``B`` (batch), ``T`` (new tokens),
``P`` (tokens already cached) and ``S`` (encoder length), and their one-line text form; every
other dim is a static model size."""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping, Sequence

import sympy

from archc.dtypes import VALUE_BYTES
from archc.quant.schemes import SCHEMES

B = sympy.Symbol("B", integer=True, positive=True)
T = sympy.Symbol("T", integer=True, positive=True)
P = sympy.Symbol("P", integer=True, nonnegative=True)
S = sympy.Symbol("S", integer=True, positive=True)
DIMS: dict[str, sympy.Symbol] = {"B": B, "T": T, "P": P, "S": S}

Shape = tuple[sympy.Expr, ...]

# the dtypes an IR value may have, and the bytes of one element
DTYPE_BYTES: dict[str, int | sympy.Rational] = {
    **VALUE_BYTES,
    # a quantized weight's scheme is its dtype: bytes per element, codes and scales together
    **{name: sympy.Rational(s.bytes_per_element.numerator, s.bytes_per_element.denominator)
       for name, s in SCHEMES.items()}}
QUANT_DTYPES = tuple(SCHEMES)


def shape(*dims: int | sympy.Expr) -> Shape:
    return tuple(sympy.sympify(d) if isinstance(d, int) else d for d in dims)


def numel(s: Sequence[sympy.Expr]) -> sympy.Expr:
    return sympy.Mul(*s)


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


_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def parse_dim(text: str) -> sympy.Expr:
    """`P+T`, `2*T`, `(P+T)*4` as sympy: read by Python's parser, never evaluated (as ``sympify``
    would); only integers, the four dims, +, - and * are accepted."""
    def build(e: ast.expr) -> sympy.Expr:
        if isinstance(e, ast.Constant) and type(e.value) is int:
            return sympy.Integer(e.value)
        if isinstance(e, ast.Name) and e.id in DIMS:
            return DIMS[e.id]
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            return -build(e.operand)
        if isinstance(e, ast.BinOp) and type(e.op) in _ARITH:
            return _ARITH[type(e.op)](build(e.left), build(e.right))
        raise ValueError(f"dim {text!r}: {ast.unparse(e)!r} is not an integer, B, T, P or S, "
                         "or +, -, * of them")

    try:
        return build(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"cannot read dim {text!r}") from None
