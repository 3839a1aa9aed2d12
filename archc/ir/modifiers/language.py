"""The attention modifier language, declared once: its variables, the names an environment
adds, and a table of functions — each with its arity, typing rule, torch code, Triton code and
interval rule — that the checker, the renderings and the tile classifier all read.

An expression is a tree of ``Call``s, so it prints and parses as an IR attribute value and
compares as plain data::

    kv_pos <= q_pos and q_pos - kv_pos < 512
      = and_(le(var("kv_pos"), var("q_pos")), lt(sub(var("q_pos"), var("kv_pos")), 512))

Leaves are literals (int, float, bool), ``var(NAME)`` (a variable, a per-sequence scalar input
or a named constant) and ``index(NAME, var(I))`` (a per-head parameter at I = head or kv_head, a
per-token input at I = q_pos or kv_pos). Operators carry the names of Python's ``operator``
module (``and_``, ``floordiv``), so no name is a Python keyword and the IR's attribute parser
reads them back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from archc.errors import SpecError
from archc.ir.attrs import Call
from archc.ir.expr import act_code, tanh_code
from archc.ir.modifiers import bounds as bd
from archc.ir.modifiers import interval as iv

Expr = Any   # a Call tree, or an int, float or bool literal
Type = type  # int, float or bool

# the variables every expression may use; a mask may not use score
VARIABLES: dict[str, Type] = {"score": float, "q_pos": int, "kv_pos": int, "head": int,
                              "kv_head": int}
HEAD_INDEX = ("head", "kv_head")     # what indexes a per-head parameter
TOKEN_INDEX = ("q_pos", "kv_pos")    # what indexes a per-token input
KEYWORDS = ("and", "or", "not", "true", "false")

MAX_INT = 2 ** 31 - 1     # integer literals: the kernels' positions are int32
MAX_FLOAT = 1e30          # float literals: far from f32's overflow at 3.4e38
MAX_CHARS = 2000          # text of one expression
MAX_DEPTH = 64            # nesting of one expression (every walk of a tree recurses this deep)


def var(name: str) -> Call:
    return Call("var", (name,))


def index(name: str, at: str) -> Call:
    return Call("index", (name, var(at)))


def is_literal(e: Expr) -> bool:
    return isinstance(e, (bool, int, float))


def type_of_literal(v: bool | int | float) -> Type:
    return bool if isinstance(v, bool) else int if isinstance(v, int) else float


@dataclass(frozen=True)
class Env:
    """The names an expression may use beyond VARIABLES, each with its type: per-head
    parameters (`slope[head]`: a checkpoint tensor or constants from the spec, one per query or
    KV head), per-token inputs (`doc[q_pos]`: a tensor over the sequence's positions),
    per-sequence scalar inputs (`prefix_len`) and named constants, replaced by their values
    when the text is read."""

    head_params: Mapping[str, Type] = field(default_factory=dict)
    token_inputs: Mapping[str, Type] = field(default_factory=dict)
    scalars: Mapping[str, Type] = field(default_factory=dict)
    constants: Mapping[str, bool | int | float] = field(default_factory=dict)

    def kind(self, name: str) -> str | None:
        """What `name` is here: "variable", "head_param", "token_input", "scalar",
        "constant", or None."""
        if name in VARIABLES:
            return "variable"
        for kind in ("head_params", "token_inputs", "scalars", "constants"):
            if name in getattr(self, kind):
                return kind[:-1]
        return None

    def check_names(self, field: str) -> None:
        """Refuse a name declared twice, or one that is a variable, function or keyword."""
        seen: set[str] = set()
        for kind in ("head_params", "token_inputs", "scalars", "constants"):
            for name in getattr(self, kind):
                if not name.isidentifier() or name.startswith("_"):
                    problem = "is not a name (letters, digits and _, not first)"
                elif name in VARIABLES or name in CALLS or name in KEYWORDS:
                    problem = "is taken by the language"
                elif name in seen:
                    problem = "is declared twice"
                else:
                    seen.add(name)
                    continue
                raise SpecError(field, f"{name!r} {problem}",
                                allowed="names other than " + ", ".join(
                                    (*VARIABLES, *KEYWORDS, *CALLS)))

    def leaf_type(self, e: Call) -> Type:
        """The type of a checked leaf, var(...) or index(...)."""
        name = e.args[0]
        if e.fn == "index":
            kind = self.head_params if name in self.head_params else self.token_inputs
            return kind[name]
        if name in VARIABLES:
            return VARIABLES[name]
        if name in self.constants:
            return type_of_literal(self.constants[name])
        return self.scalars[name]

    def names(self) -> list[str]:
        """What the expression may name, as the text writes it (for refusals)."""
        return [*VARIABLES, *(f"{p}[head]" for p in self.head_params),
                *(f"{t}[q_pos]" for t in self.token_inputs), *self.scalars, *self.constants]


# ---- typing rules: the argument types (after int → float promotion) and the result's -------

class TypeProblem(Exception):
    """An argument list a function does not take: the message says what it takes."""


Signature = tuple[tuple[Type, ...], Type]
NUMBERS = (int, float)


def _numeric(types: Sequence[Type], what: str) -> Type:
    if any(t not in NUMBERS for t in types):
        raise TypeProblem(f"takes {what}")
    return float if float in types else int


def same_number(*types: Type) -> Signature:
    """int op int → int; with a float, both are floats."""
    t = _numeric(types, "numbers")
    return (t,) * len(types), t


def real(*types: Type) -> Signature:
    """Numbers in, a float out: true division, exp, log …"""
    _numeric(types, "numbers")
    return (float,) * len(types), float


def integers(*types: Type) -> Signature:
    if any(t is not int for t in types):
        raise TypeProblem("takes integers")
    return (int,) * len(types), int


def floor_of(t: Type) -> Signature:
    if t is not float:
        raise TypeProblem("takes a float (an integer is its own floor)")
    return (float,), int


def order(a: Type, b: Type) -> Signature:
    t = _numeric((a, b), "numbers")
    return (t, t), bool


def equality(a: Type, b: Type) -> Signature:
    if a is bool and b is bool:
        return (bool, bool), bool
    t = _numeric((a, b), "two numbers or two bools")
    return (t, t), bool


def logic(*types: Type) -> Signature:
    if any(t is not bool for t in types):
        raise TypeProblem("takes bools")
    return (bool,) * len(types), bool


def choice(c: Type, a: Type, b: Type) -> Signature:
    if c is not bool:
        raise TypeProblem("takes a bool condition first")
    if a is bool and b is bool:
        return (bool, bool, bool), bool
    t = _numeric((a, b), "two numbers or two bools after the condition")
    return (bool, t, t), t


# ---- the function table --------------------------------------------------------------------

@dataclass(frozen=True)
class Function:
    """One function of the language. `symbol` and `prec` (Python's precedence, 1 = or … 7 =
    unary minus) make it an operator; otherwise it is written `name(args)`. `triton` takes the
    arguments' code and returns a primary expression (parenthesized, or a call); `bind`: it
    uses its first argument's code twice, so a rendering names that argument first unless it
    is a leaf. `interval` takes the arguments' intervals (and, for the rules that differ
    between ints and floats, whether the result is a float); `bounds`, the same rule over
    integer and bool bounds a kernel computes (``bounds``: none for a float result, which a
    kernel's classifier takes as any float)."""

    name: str
    arity: int
    typing: Callable[..., Signature]
    torch: Callable[..., torch.Tensor]
    triton: Callable[..., str]
    interval: Callable[..., iv.Value]
    doc: str
    symbol: str | None = None
    prec: int = 8
    bind: bool = False
    by_float: bool = False    # `interval` takes the float flag
    # and/or of a scalar bool (a head's) and a tile's: Triton's interpreter cannot broadcast a
    # scalar int1 into & or | (3.6 and 3.9), so the scalar (first) selects instead
    triton_mixed: Callable[[str, str], str] | None = None
    # its code where the first argument is known ≥ 0 (C's // and % are Python's there)
    triton_nonnegative: Callable[[str, str], str] | None = None
    bounds: Callable[..., Any] | None = None


def _tl(fn: str) -> Callable[..., str]:
    return lambda *a: f"{fn}({', '.join(a)})"


def _nan_kept(fn: str) -> Callable[[str, str], str]:
    return lambda a, b: f"{fn}({a}, {b}, propagate_nan=tl.PropagateNan.ALL)"


def _bin(sym: str) -> Callable[[str, str], str]:
    return lambda a, b: f"({a} {sym} {b})"


def _py_mod(a: str, b: str) -> str:
    # Triton's % truncates (C): a % b has a's sign; Python's has b's (b > 0 here)
    return f"((({a} % {b}) + {b}) % {b})"


def _py_floordiv(a: str, b: str) -> str:
    # a − (a mod b) is a multiple of b, so truncating division is exact: ⌊a / b⌋
    return f"(({a} - {_py_mod(a, b)}) // {b})"


FUNCTIONS: dict[str, Function] = {f.name: f for f in (
    Function("add", 2, same_number, torch.add, _bin("+"), iv.add, "a + b", "+", 5,
             by_float=True, bounds=bd.add),
    Function("sub", 2, same_number, torch.sub, _bin("-"), iv.sub, "a − b", "-", 5,
             by_float=True, bounds=bd.sub),
    Function("mul", 2, same_number, torch.mul, _bin("*"), iv.mul, "a · b", "*", 6,
             by_float=True, bounds=bd.mul),
    Function("truediv", 2, real, torch.div, _bin("/"), iv.truediv, "a / b, a float", "/", 6),
    Function("floordiv", 2, integers, lambda a, b: torch.div(a, b, rounding_mode="floor"),
             _py_floordiv, iv.floordiv, "⌊a / b⌋ (Python's //), b a positive integer literal",
             "//", 6, bind=True, triton_nonnegative=_bin("//"), bounds=bd.floordiv),
    Function("mod", 2, integers, torch.remainder, _py_mod, iv.mod,
             "a − b·⌊a / b⌋ ∈ [0, b) (Python's %), b a positive integer literal", "%", 6,
             triton_nonnegative=_bin("%"), bounds=bd.mod),
    Function("neg", 1, same_number, torch.neg, lambda a: f"(-{a})", iv.neg, "−a", "-", 7,
             by_float=True, bounds=bd.neg),
    Function("lt", 2, order, torch.lt, _bin("<"), iv.lt, "a < b", "<", 4, bounds=bd.lt),
    Function("le", 2, order, torch.le, _bin("<="), iv.le, "a ≤ b", "<=", 4, bounds=bd.le),
    Function("gt", 2, order, torch.gt, _bin(">"), iv.gt, "a > b", ">", 4, bounds=bd.gt),
    Function("ge", 2, order, torch.ge, _bin(">="), iv.ge, "a ≥ b", ">=", 4, bounds=bd.ge),
    Function("eq", 2, equality, torch.eq, _bin("=="), iv.eq, "a = b", "==", 4, bounds=bd.eq),
    Function("ne", 2, equality, torch.ne, _bin("!="), iv.ne, "a ≠ b", "!=", 4, bounds=bd.ne),
    Function("and_", 2, logic, torch.logical_and, _bin("&"), iv.and_, "a and b", "and", 2,
             triton_mixed=lambda s, t: f"tl.where({s}, {t}, False)", bounds=bd.and_),
    Function("or_", 2, logic, torch.logical_or, _bin("|"), iv.or_, "a or b", "or", 1,
             triton_mixed=lambda s, t: f"tl.where({s}, True, {t})", bounds=bd.or_),
    Function("not_", 1, logic, torch.logical_not, lambda a: f"(~{a})", iv.not_, "not a",
             "not", 3, bounds=bd.not_),
    Function("where", 3, choice, torch.where, _tl("tl.where"), iv.where, "a if c else b",
             bounds=bd.where),
    # NaN propagates, as in torch (Triton's default returns the other operand)
    Function("min", 2, same_number, torch.minimum, _nan_kept("tl.minimum"), iv.minimum,
             "the smaller of a and b", by_float=True, bounds=bd.minimum),
    Function("max", 2, same_number, torch.maximum, _nan_kept("tl.maximum"), iv.maximum,
             "the larger of a and b", by_float=True, bounds=bd.maximum),
    Function("abs", 1, same_number, torch.abs, _tl("tl.abs"), iv.abs_, "|a|", by_float=True,
             bounds=bd.abs_),
    Function("exp", 1, real, torch.exp, _tl("tl.exp"), iv.exp, "eᵃ"),
    Function("log", 1, real, torch.log, _tl("tl.log"), iv.log, "ln a (NaN below 0)"),
    Function("tanh", 1, real, torch.tanh, tanh_code, iv.tanh, "tanh a"),
    Function("sigmoid", 1, real, torch.sigmoid, lambda a: act_code("sigmoid", a), iv.sigmoid,
             "1 / (1 + e⁻ᵃ)"),
    Function("sqrt", 1, real, torch.sqrt, _tl("tl.sqrt"), iv.sqrt, "√a (NaN below 0)"),
    Function("floor", 1, floor_of, lambda a: torch.floor(a).long(),
             lambda a: f"tl.floor({a}).to(tl.int32)", iv.floor, "⌊a⌋ of a float, an integer"),
)}
CALLS = tuple(n for n, f in FUNCTIONS.items() if f.symbol is None)
BINARY = {f.symbol: f for f in FUNCTIONS.values() if f.symbol and f.arity == 2}
PREFIX = {f.symbol: f for f in FUNCTIONS.values() if f.symbol and f.arity == 1}
INTEGER_DIVISOR = ("floordiv", "mod")   # their right operand: a positive integer literal


# ---- one walk for every rendering ------------------------------------------------------------

V = TypeVar("V")


class Backend(Protocol[V]):
    """What a rendering supplies to `fold`: its values of literals and leaves, conversion of an
    int to a float, and the application of a function to values of the argument types."""

    def literal(self, v: bool | int | float) -> V: ...
    def leaf(self, e: Call, t: Type) -> V: ...
    def to_float(self, v: V) -> V: ...
    def apply(self, f: Function, args: list[V], result: Type) -> V: ...


def fold(e: Expr, env: Env, backend: Backend[V]) -> tuple[V, Type]:
    """`e` (checked) rendered by `backend`, with its type."""
    if is_literal(e):
        return backend.literal(e), type_of_literal(e)
    if e.fn == "var" and e.args[0] in env.constants:
        return fold(env.constants[e.args[0]], env, backend)
    if e.fn in ("var", "index"):
        t = env.leaf_type(e)
        return backend.leaf(e, t), t
    f = FUNCTIONS[e.fn]
    args = [fold(a, env, backend) for a in e.args]
    want, result = f.typing(*(t for _, t in args))
    values = [backend.to_float(v) if t is int and w is float else v
              for (v, t), w in zip(args, want)]
    return backend.apply(f, values, result), result


class _Types:
    """A rendering to nothing: `fold` then gives the type alone."""

    def literal(self, v: bool | int | float) -> None: ...
    def leaf(self, e: Call, t: Type) -> None: ...
    def to_float(self, v: None) -> None: ...
    def apply(self, f: Function, args: list[None], result: Type) -> None: ...


def type_of(e: Expr, env: Env) -> Type:
    """The type of `e` (checked over `env`)."""
    return fold(e, env, _Types())[1]


def substitute(e: Expr, replace: Mapping[Expr, Expr]) -> Expr:
    """`e` with each subtree that is a key of `replace` replaced by its value (a library
    expression composed with another: a bias over the soft-capped score)."""
    if not is_literal(e) and e in replace:
        return replace[e]
    if is_literal(e) or e.fn in ("var", "index"):
        return e
    return Call(e.fn, tuple(substitute(a, replace) for a in e.args))


def leaves(e: Expr) -> list[Call]:
    """The var(...) and index(...) leaves of `e`, each once, in order of first use: what a
    kernel must hold before it computes `e`."""
    out: list[Call] = []

    def walk(x: Expr) -> None:
        if is_literal(x):
            return
        if x.fn in ("var", "index"):
            if x not in out:
                out.append(x)
            return
        for a in x.args:
            walk(a)
    walk(e)
    return out
