"""Printing sympy index and size expressions over B, T, P, S as Triton (device) or Python (host)
code: into kernels (`b * (T*192) + t * 192`) and into launchers (grids, row counts).

Triton's integer `//` and `%` are C-like — they truncate toward zero — while sympy's ``floor`` and
``Mod`` (and Python's operators) round toward minus infinity. The two agree only when the operands
are non-negative, so the device printer emits the plain operators only when sympy can prove that,
and an exact form otherwise:

    Mod(a, b)        →  ((a % b) + b) % b            (b > 0)
    floor(a / b)     →  (a - Mod(a, b)) // b          (an exact division: truncation is floor)

Anything that is not integer arithmetic (a rational, a float, an unknown function) is refused
rather than printed wrongly.

Evaluating an expression with sympy (``subs``, ``xreplace``) costs tens of microseconds and a
decode step needs hundreds, so the runtime compiles the host code of those it reads into one
plain function per use (``dim_function``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import sympy
from sympy.printing.str import StrPrinter

from archc.errors import ArchcError
from archc.ir.shapes import DIMS

DimFn = Callable[[int, int, int, int], tuple[int, ...]]


class PrintError(ArchcError):
    """An expression codegen cannot print as integer index arithmetic."""


class _IndexPrinter(StrPrinter):
    """Integer printing with symbols renamed and products and sums parenthesized safely; on the
    `device`, C-like `//` and `%` only where they equal floor and Mod."""

    def __init__(self, names: Mapping[str, str] | None, device: bool) -> None:
        super().__init__({"order": "none"})
        self.names = dict(names or {})
        self.device = device

    def _print_Symbol(self, e: sympy.Symbol) -> str:
        name = self.names.get(e.name, e.name)
        if not name.isidentifier():
            raise PrintError(f"symbol {e.name!r} prints as {name!r}, not an identifier")
        return name

    def emptyPrinter(self, e: object) -> str:  # noqa: N802  (sympy's name)
        raise PrintError(f"cannot print {e!r} as index arithmetic: it is not integer arithmetic")

    _print_Rational = _print_Float = _print_Function = emptyPrinter

    def _print_Pow(self, e: sympy.Pow, rational: bool = False) -> str:
        base, exp = e.args
        if exp.is_Integer and int(exp) >= 1:
            return "(" + " * ".join([self._wrap(base)] * int(exp)) + ")"
        raise PrintError(f"cannot print {e} as integer arithmetic")

    def _wrap(self, e: sympy.Expr) -> str:
        text = self._print(e)
        return text if (e.is_Atom and not (e.is_Integer and e < 0)) else f"({text})"

    def _print_Mul(self, e: sympy.Mul) -> str:
        coeff, terms = e.as_coeff_mul()
        if coeff.is_Rational and not coeff.is_Integer:
            raise PrintError(f"{e} is not an integer product")
        parts = [self._wrap(t) for t in terms]
        if coeff == -1:
            return "-" + " * ".join(parts) if len(parts) == 1 else "-(" + " * ".join(parts) + ")"
        if coeff != 1:
            parts.insert(0, str(int(coeff)))
        return " * ".join(parts)

    def _print_Add(self, e: sympy.Add, order: str | None = None) -> str:
        terms = sorted(e.args, key=lambda t: (t.is_Number, sympy.default_sort_key(t)))
        out = self._print(terms[0])
        for t in terms[1:]:
            coeff, rest = t.as_coeff_Mul()
            if coeff.is_Number and coeff < 0:
                out += f" - {self._print(-t) if rest != 1 else str(-int(coeff))}"
            else:
                out += f" + {self._print(t)}"
        return out

    def _plain(self, e: sympy.Expr, a: sympy.Expr, b: sympy.Expr) -> bool:
        """May `a // b` and `a % b` print as the plain operators (always on the host)?"""
        if not self.device or (a.is_nonnegative and b.is_positive):
            return True
        if not b.is_positive:
            raise PrintError(f"{e}: the divisor must be known positive")
        return False

    def _print_Mod(self, e: sympy.Mod) -> str:
        a, b = (self._wrap(x) for x in e.args)
        mod = f"({a} % {b})"
        return mod if self._plain(e, *e.args) else f"(({mod} + {b}) % {b})"

    def _print_floor(self, e: sympy.floor) -> str:
        num, den = e.args[0].as_numer_denom()
        if not (den.is_integer and num.is_integer):
            raise PrintError(f"cannot print {e}: only floor(a / b) of integers")
        if den == 1:
            return self._print(num)
        a, b = self._wrap(num), self._wrap(den)
        if self._plain(e, num, den):
            return f"({a} // {b})"
        return f"(({a} - ((({a} % {b}) + {b}) % {b})) // {b})"

    def _fold(self, e: sympy.Expr, fn: str) -> str:
        return functools.reduce(lambda a, b: f"{fn}({a}, {b})", map(self._print, e.args))

    def _print_Min(self, e: sympy.Min) -> str:
        return self._fold(e, "tl.minimum" if self.device else "min")

    def _print_Max(self, e: sympy.Max) -> str:
        return self._fold(e, "tl.maximum" if self.device else "max")


def texpr(e: sympy.Expr | int, names: Mapping[str, str] | None = None) -> str:
    """`e` as Triton device code."""
    return _IndexPrinter(names, device=True).doprint(sympy.sympify(e))


def pexpr(e: sympy.Expr | int, names: Mapping[str, str] | None = None) -> str:
    """`e` as Python host code: Python's `//` and `%` already floor."""
    return _IndexPrinter(names, device=False).doprint(sympy.sympify(e))


def dim_function(exprs: Sequence[sympy.Expr | int], name: str = "dims") -> DimFn:
    """One function of (B, T, P, S) returning every expression of `exprs`, in order, as ints:

        dim_function([B*T*4096, T + P], "sizes")
            →  def sizes(B, T, P, S): return (4096 * B * T, P + T)
    """
    values = ", ".join(pexpr(e) for e in exprs)
    source = f"def {name}(B, T, P, S):\n    return ({values}{',' if exprs else ''})\n"
    namespace: dict[str, DimFn] = {}
    # archc's own printed integer arithmetic over the four dims: trusted as the generated module
    exec(compile(source, f"<archc {name}>", "exec"), namespace)
    return namespace[name]


def uses_past(exprs: Sequence[sympy.Expr | int]) -> bool:
    """Does any of `exprs` change with the past length P?"""
    return any(isinstance(e, sympy.Basic) and e.has(DIMS["P"]) for e in exprs)
