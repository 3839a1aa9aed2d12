"""Node attributes: an immutable, hashable mapping of plain values (``None``, bools, ints, floats,
strings, tuples, and ``Call``s: a function with positional and keyword arguments), their typed
declarations (``Attr``) and their text form, shared with parameter expressions::

    value := INT | FLOAT | STRING | true | false | none | '[' [value {',' value}] ']'
           | NAME '(' [arg {',' arg}] ')'
    arg   := value | NAME '=' value

Floats print with ``repr`` so they parse back to the same bits.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    """`fn(args..., key=value...)`: a parameter expression, or any structured attr value."""

    fn: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def kw(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.kwargs if k == name), default)


class Attrs(Mapping[str, Any]):
    """An immutable mapping, ordered by key, hashable, so nodes compare as plain data."""

    __slots__ = ("_items", "_dict")

    def __init__(self, items: Mapping[str, Any] | None = None, **kw: Any) -> None:
        self._items = tuple(sorted((k, freeze(v)) for k, v in {**(items or {}), **kw}.items()))
        self._dict = dict(self._items)

    def __getitem__(self, key: str) -> Any:
        return self._dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        return self._dict == (other._dict if isinstance(other, Attrs) else other)

    def __repr__(self) -> str:
        return f"Attrs({self._dict!r})"

    def replace(self, **kw: Any) -> Attrs:
        """A copy with `kw` set; a value of ``None`` removes the key."""
        return Attrs({k: v for k, v in {**self._dict, **kw}.items() if v is not None})


def freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, Mapping):
        raise TypeError("attr values are plain data: use a Call, not a mapping")
    return value


# ---- typed declarations: an op's attributes, a step's or a function's parameters ---------------

REQUIRED: Any = ...   # the default of an attribute that must be given


class Expression:
    """The type of an attribute holding an attention modifier expression (``archc.ir.modifiers``):
    a Call tree, or a literal (a mask of ``true``)."""


class Widths:
    """The type of an attribute holding a list of whole numbers ≥ 1 (a norm's column spans)."""

# each attribute type: what its values must be, and the test
_TYPES: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a finite number", lambda v: isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)),
    str: ("a string", lambda v: isinstance(v, str)),
    Call: ("a call", lambda v: isinstance(v, Call)),
    tuple: ("a list of calls", lambda v: isinstance(v, tuple)
            and all(isinstance(s, Call) for s in v)),
    Widths: ("a list of whole numbers ≥ 1", lambda v: isinstance(v, tuple) and len(v) > 0
             and all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in v)),
    Expression: ("an expression (a call or a literal)",
                 lambda v: isinstance(v, (Call, bool, int, float))),
}


@dataclass(frozen=True)
class Attr:
    """A typed attribute: `type` is one of _TYPES (tuple: a list of Calls, an epilogue). A
    default of None means it may be absent, REQUIRED that it must be given; values equal to the
    default are not stored, so a node prints only what differs. `choices` are the allowed
    values, or for a Call the allowed functions, as a tuple of names or a mapping from each name
    to its keyword parameters."""

    name: str
    type: type
    default: Any = REQUIRED
    choices: tuple[Any, ...] | Mapping[str, tuple[Attr, ...]] = ()
    at_least: float | None = None

    def problem(self, v: Any) -> str | None:
        """What is wrong with `v` as this attribute's value; None when nothing is."""
        if v is None:
            return "is required" if self.default is REQUIRED else None
        what, ok = _TYPES[self.type]
        if not ok(v):
            return f"must be {what}, got {v!r}"
        key = v.fn if isinstance(v, Call) else v
        if self.choices and key not in self.choices:
            shown = ", ".join(f"{c}()" if self.type is Call else repr(c) for c in self.choices)
            return f"is {v!r}, not one of {shown}"
        if isinstance(self.choices, Mapping):
            return call_problem(v, self.choices[key])
        if self.at_least is not None and v < self.at_least:
            return f"must be ≥ {self.at_least:g}, got {v!r}"
        return None


def call_problem(c: Call, params: tuple[Attr, ...]) -> str | None:
    """What is wrong with `fn(name=value, …)` as a call with keyword parameters `params`."""
    given = dict(c.kwargs)
    if c.args or not set(given) <= {p.name for p in params}:
        return f"{c.fn}() takes {', '.join(p.name + '=' for p in params) or 'nothing'}, got {c!r}"
    return next((f"{c.fn}() {p.name} {m}" for p in params if (m := p.problem(given.get(p.name)))),
                None)


def format_value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"attr value {value} is not finite")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, Call):
        parts = [format_value(a) for a in value.args]
        parts += [f"{k}={format_value(v)}" for k, v in value.kwargs]
        return f"{value.fn}({', '.join(parts)})"
    raise TypeError(f"cannot print attr value {value!r}")


def format_call(name: str, inputs: Sequence[int], attrs: Attrs) -> str:
    """`op(%1, %2) {k=v}`: a node's right-hand side."""
    text = f"{name}({', '.join(f'%{i}' for i in inputs)})"
    return text + (" {" + ", ".join(f"{k}={format_value(v)}" for k, v in attrs.items()) + "}"
                   if attrs else "")


_WORDS = {"true": True, "false": False, "none": None}


def parse_value(text: str) -> Any:
    """A value of the grammar above, read by Python's parser (the grammar is a subset of Python's
    expressions) and never evaluated: every other form is refused."""
    text = text.strip()
    try:
        return _value(ast.parse(text, mode="eval").body, text)
    except SyntaxError as err:
        raise ValueError(f"cannot read {text!r}: {err.msg}") from None


def _value(e: ast.expr, text: str) -> Any:
    if isinstance(e, ast.Constant) and isinstance(e.value, str):
        return json.loads(ast.get_source_segment(text, e) or "")   # JSON, as printed
    if isinstance(e, (ast.Constant, ast.UnaryOp)) and type(ast.literal_eval(e)) in (int, float):
        return ast.literal_eval(e)
    if isinstance(e, ast.Name) and e.id in _WORDS:
        return _WORDS[e.id]
    if isinstance(e, ast.List):
        return tuple(_value(v, text) for v in e.elts)
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and all(k.arg for k in e.keywords):
        return Call(e.func.id, tuple(_value(a, text) for a in e.args),
                    tuple((str(k.arg), _value(k.value, text)) for k in e.keywords))
    raise ValueError(f"not an attribute value: {ast.get_source_segment(text, e)!r}")
