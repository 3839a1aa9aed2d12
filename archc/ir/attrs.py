"""Node attributes: an immutable, hashable mapping of plain values, and their text form.

Values are ``None``, bools, ints, floats, strings, tuples of values, and ``Call``s (a function
name with positional and keyword arguments — how parameter expressions are written). The text
grammar, shared by attrs and parameter expressions::

    value := INT | FLOAT | STRING | true | false | none | '[' [value {',' value}] ']'
           | NAME '(' [arg {',' arg}] ')'
    arg   := value | NAME '=' value

Floats print with ``repr`` so they parse back to the same bits.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Iterator, Mapping, Sequence
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

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None, **kw: Any) -> None:
        self._items = tuple(sorted((k, freeze(v)) for k, v in {**(items or {}), **kw}.items()))

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Attrs):
            return self._items == other._items
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __repr__(self) -> str:
        return f"Attrs({dict(self._items)!r})"

    def replace(self, **kw: Any) -> Attrs:
        """A copy with `kw` set; a value of ``None`` removes the key."""
        return Attrs({k: v for k, v in {**dict(self._items), **kw}.items() if v is not None})


def freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, Mapping):
        raise TypeError("attr values are plain data: use a Call, not a mapping")
    return value


# ---- printing ------------------------------------------------------------------------------

def format_value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
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


# ---- parsing -------------------------------------------------------------------------------

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
