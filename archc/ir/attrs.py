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

import json
import math
import re
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
        for k, v in self.kwargs:
            if k == name:
                return v
        return default


class Attrs(Mapping[str, Any]):
    """An immutable mapping, ordered by key, hashable, so nodes compare as plain data."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None, **kw: Any) -> None:
        merged = dict(items or {})
        merged.update(kw)
        self._items = tuple(sorted((k, freeze(v)) for k, v in merged.items()))

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
        merged = dict(self._items)
        for k, v in kw.items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        return Attrs(merged)


def freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    if isinstance(value, tuple):
        return tuple(freeze(v) for v in value)
    if isinstance(value, (dict, Mapping)):
        raise TypeError("attr values are plain data: use a Call, not a mapping")
    return value


# ---- printing ------------------------------------------------------------------------------

def format_value(value: Any) -> str:
    if value is None:
        return "none"
    if value is True:
        return "true"
    if value is False:
        return "false"
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


def format_attrs(attrs: Attrs) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in attrs.items())


def format_call(name: str, inputs: Sequence[int], attrs: Attrs) -> str:
    """`op(%1, %2) {k=v}`: a node's right-hand side."""
    text = f"{name}({', '.join(f'%{i}' for i in inputs)})"
    return text + (" {" + format_attrs(attrs) + "}" if attrs else "")


# ---- parsing -------------------------------------------------------------------------------

_TOKENS = re.compile(r"""
    \s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<num>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\.\d+(?:[eE][-+]?\d+)?|\d+))
    | (?P<name>[A-Za-z_][\w.]*)
    | (?P<punct>[\[\](),={}])
    )""", re.VERBOSE)


class ValueParser:
    """Recursive descent over the grammar above. `pos` indexes into `text`."""

    def __init__(self, text: str, pos: int = 0) -> None:
        self.text = text
        self.pos = pos

    def _next(self) -> tuple[str, str]:
        m = _TOKENS.match(self.text, self.pos)
        if not m or m.end() == self.pos and self.pos < len(self.text):
            rest = self.text[self.pos:self.pos + 20]
            raise ValueError(f"cannot read {rest!r} at column {self.pos + 1}")
        if m.lastgroup is None:
            raise ValueError(f"unexpected end of text at column {self.pos + 1}")
        self.pos = m.end()
        return m.lastgroup, m.group(m.lastgroup)

    def peek(self) -> tuple[str, str] | None:
        save = self.pos
        try:
            return self._next()
        except ValueError:
            return None
        finally:
            self.pos = save

    def expect(self, punct: str) -> None:
        kind, tok = self._next()
        if tok != punct:
            raise ValueError(f"expected {punct!r} but found {tok!r} at column {self.pos}")

    def value(self) -> Any:
        kind, tok = self._next()
        if kind == "str":
            return json.loads(tok)
        if kind == "num":
            return float(tok) if any(c in tok for c in ".eE") else int(tok)
        if kind == "name":
            if tok in ("true", "false", "none"):
                return {"true": True, "false": False, "none": None}[tok]
            return self._call(tok)
        if tok == "[":
            items: list[Any] = []
            if self.peek() == ("punct", "]"):
                self._next()
                return ()
            while True:
                items.append(self.value())
                kind, tok = self._next()
                if tok == "]":
                    return tuple(items)
                if tok != ",":
                    raise ValueError(f"expected ',' or ']' but found {tok!r}")
        raise ValueError(f"unexpected {tok!r} at column {self.pos}")

    def _call(self, fn: str) -> Call:
        self.expect("(")
        args: list[Any] = []
        kwargs: list[tuple[str, Any]] = []
        if self.peek() == ("punct", ")"):
            self._next()
            return Call(fn)
        while True:
            save = self.pos
            kind, tok = self._next()
            if kind == "name" and self.peek() == ("punct", "="):
                self._next()
                kwargs.append((tok, self.value()))
            else:
                self.pos = save
                if kwargs:
                    raise ValueError(f"positional argument after keyword in {fn}(...)")
                args.append(self.value())
            kind, tok = self._next()
            if tok == ")":
                return Call(fn, tuple(args), tuple(kwargs))
            if tok != ",":
                raise ValueError(f"expected ',' or ')' in {fn}(...) but found {tok!r}")

    def attrs(self) -> Attrs:
        """`{k=v, ...}` (the braces already consumed by the caller are not expected here)."""
        items: dict[str, Any] = {}
        if self.peek() == ("punct", "}"):
            return Attrs()
        while True:
            kind, key = self._next()
            if kind != "name":
                raise ValueError(f"expected an attribute name but found {key!r}")
            self.expect("=")
            items[key] = self.value()
            nxt = self.peek()
            if nxt == ("punct", ","):
                self._next()
                continue
            return Attrs(items)


def parse_value(text: str) -> Any:
    parser = ValueParser(text)
    value = parser.value()
    if text[parser.pos:].strip():
        raise ValueError(f"trailing text {text[parser.pos:]!r}")
    return value
