"""Symbolic sizes compiled once into plain functions of the dims, for the hot path.

Shapes, strides and offsets in the IR are sympy expressions over B, T, P, S. Evaluating them with
sympy (``subs``, ``xreplace``) costs tens of microseconds each; a decode step needs hundreds. So
the runtime prints a list of them once, per graph, as Python host code (``codegen.printer.pexpr``,
the printer the generated launchers use) and compiles that into one function:

    dim_function([B*T*4096, T + P], "sizes")
        →  def sizes(B, T, P, S): return (B * T * 4096, P + T)

The source is archc's own printer output over integer arithmetic and the four dim names — the same
trust as the generated kernel module, which the runtime imports the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sympy

from archc.codegen.printer import pexpr
from archc.ir.shapes import DIMS

DimFn = Callable[[int, int, int, int], tuple[int, ...]]


def dim_function(exprs: Sequence[sympy.Expr | int], name: str = "dims") -> DimFn:
    """One function of (B, T, P, S) returning every expression of `exprs`, in order, as ints."""
    values = ", ".join(pexpr(e) for e in exprs)
    source = f"def {name}(B, T, P, S):\n    return ({values}{',' if exprs else ''})\n"
    namespace: dict[str, DimFn] = {}
    exec(compile(source, f"<archc {name}>", "exec"), namespace)  # archc's own printed sizes
    return namespace[name]


def uses_past(exprs: Sequence[sympy.Expr | int]) -> bool:
    """Does any of `exprs` change with the past length P?"""
    return any(isinstance(e, sympy.Basic) and e.has(DIMS["P"]) for e in exprs)
