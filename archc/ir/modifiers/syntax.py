"""The infix text of modifier expressions, read by a hand-written tokenizer and a
precedence-climbing parser (nothing is evaluated), and printed back so that
``parse(format_expr(e)).tree == e``::

    expr    := expr 'or' expr | expr 'and' expr | 'not' expr
             | sum (CMP sum)*                       # chained like Python's: a < b < c
    sum     := sum ('+' | '-') term | term
    term    := term ('*' | '/' | '//' | '%') unary | unary
    unary   := '-' unary | atom
    atom    := INT | FLOAT | 'true' | 'false' | '(' expr ')'
             | NAME | NAME '[' expr ']' | NAME '(' [expr {',' expr}] ')'

Precedence and associativity are Python's. A minus written before a number is part of the
literal (``-3`` is the integer −3, not ``neg(3)``). The parser records each node's column, so
the checker can name where a problem is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from archc.errors import SpecError
from archc.ir.attrs import Call
from archc.ir.modifiers.language import (
    BINARY,
    CALLS,
    FUNCTIONS,
    MAX_CHARS,
    MAX_DEPTH,
    MAX_FLOAT,
    MAX_INT,
    PREFIX,
    Expr,
    is_literal,
    var,
)


class ExprError(SpecError):
    """A modifier expression archc refuses: the field, the column in its text (1-based; none
    for a tree read from the IR) and what is allowed."""

    def __init__(self, field: str, column: int | None, problem: str,
                 allowed: str | None = None) -> None:
        self.column = column
        super().__init__(field, (f"column {column}: " if column else "") + problem,
                         allowed=allowed)


_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<float>(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)
  | (?P<int>\d+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>\*\*|<=|>=|==|!=|//|[-+*/%<>()\[\],])
""", re.X)

# characters people write from other languages, and what to write instead
_HINTS = {"=": "'=' does not compare: write ==", "&": "write and", "|": "write or",
          "!": "write not", "~": "write not", "'": "strings are not allowed",
          '"': "strings are not allowed", "^": "there is no power operator",
          ".": "attribute access (a.b) is not allowed"}
CMP = FUNCTIONS["lt"].prec
UNARY = FUNCTIONS["neg"].prec
ATOM = 8


@dataclass(frozen=True)
class Token:
    kind: str     # float, int, name, op, end
    text: str
    col: int


def tokenize(text: str, field: str) -> Iterator[Token]:
    """The tokens of `text`, refusing any character outside the grammar and literals past the
    bounds. Lazily: a problem early in the text is named before a later one."""
    if len(text) > MAX_CHARS:
        raise ExprError(field, None, f"the expression is {len(text)} characters long",
                        allowed=f"at most {MAX_CHARS}")
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        col = pos + 1
        if m is None:
            ch = text[pos]
            raise ExprError(field, col, f"unexpected {ch!r}" + (
                f": {_HINTS[ch]}" if ch in _HINTS else ""))
        kind, word = m.lastgroup or "", m.group()
        pos = m.end()
        if kind == "space":
            continue
        if word == "**":
            raise ExprError(field, col, "there is no power operator **",
                            allowed="+ - * / // % and the functions " + ", ".join(CALLS))
        if kind == "int" and (len(word) > 10 or int(word) > MAX_INT):
            raise ExprError(field, col, f"the integer {word} is too large",
                            allowed=f"magnitudes up to {MAX_INT}, the kernels' int32")
        if kind == "float" and not float(word) <= MAX_FLOAT:
            raise ExprError(field, col, f"the number {word} is too large",
                            allowed=f"magnitudes up to {MAX_FLOAT:g}")
        yield Token(kind, word, col)
    yield Token("end", "", len(text) + 1)


@dataclass
class Parsed:
    """A parsed expression and the column of each of its calls (by id: equal subtrees are
    distinct objects here)."""

    tree: Expr
    columns: dict[int, int] = field(default_factory=dict)

    def column(self, e: Expr) -> int | None:
        return None if is_literal(e) else self.columns.get(id(e))


class _Parser:
    def __init__(self, text: str, field: str) -> None:
        self.field = field
        self.tokens = tokenize(text, field)
        self.next = next(self.tokens)
        self.depth = 0
        self.columns: dict[int, int] = {}

    def fail(self, tok: Token, problem: str, allowed: str | None = None) -> ExprError:
        return ExprError(self.field, tok.col, problem, allowed)

    def peek(self) -> Token:
        return self.next

    def take(self) -> Token:
        tok = self.next
        if tok.kind != "end":
            self.next = next(self.tokens)
        return tok

    def expect(self, text: str, opened: Token) -> None:
        tok = self.take()
        if tok.text != text or tok.kind != "op":
            found = "the end" if tok.kind == "end" else repr(tok.text)
            raise self.fail(tok, f"expected {text!r} to close the {opened.text!r} at column "
                            f"{opened.col}, found {found}")

    def node(self, e: Call, col: int) -> Call:
        self.columns[id(e)] = col
        return e

    def expr(self, min_prec: int) -> Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(self.peek(), f"the expression nests deeper than {MAX_DEPTH} levels")
        left = self.prefix()
        while True:
            tok = self.peek()
            f = BINARY.get(tok.text) if tok.kind in ("op", "name") else None
            if f is None or f.prec < min_prec:
                break
            if f.prec == CMP:
                left = self.chain(left)
                continue
            self.take()
            left = self.node(Call(f.name, (left, self.expr(f.prec + 1))), tok.col)
        self.depth -= 1
        return left

    def chain(self, left: Expr) -> Expr:
        """a < b <= c: and_(lt(a, b), le(b, c)), as Python reads it."""
        parts: list[Call] = []
        while (tok := self.peek()).kind == "op" and (f := BINARY.get(tok.text)) and \
                f.prec == CMP:
            self.take()
            right = self.expr(CMP + 1)
            parts.append(self.node(Call(f.name, (left, right)), tok.col))
            left = right
        out: Call = parts[0]
        for p in parts[1:]:
            out = self.node(Call("and_", (out, p)), self.columns[id(p)])
        return out

    def prefix(self) -> Expr:
        tok = self.peek()
        if tok.kind == "op" and tok.text == "-" or tok.kind == "name" and tok.text == "not":
            self.take()
            nxt = self.peek()
            if tok.text == "-" and nxt.kind in ("int", "float"):
                self.take()
                return -self.number(nxt)
            f = PREFIX[tok.text]
            return self.node(Call(f.name, (self.expr(f.prec),)), tok.col)
        return self.atom()

    def number(self, tok: Token) -> int | float:
        return int(tok.text) if tok.kind == "int" else float(tok.text)

    def atom(self) -> Expr:
        tok = self.take()
        if tok.kind in ("int", "float"):
            return self.number(tok)
        if tok.kind == "op" and tok.text == "(":
            e = self.expr(0)
            self.expect(")", tok)
            return e
        if tok.kind == "name" and tok.text in ("true", "false"):
            return tok.text == "true"
        if tok.kind == "name" and tok.text not in ("and", "or", "not"):
            return self.name(tok)
        if tok.kind == "end":
            raise self.fail(tok, "the expression ends where an operand was expected")
        if tok.text in (")", "]"):
            raise self.fail(tok, f"unbalanced {tok.text!r}: nothing is open")
        raise self.fail(tok, f"expected an operand, found {tok.text!r}")

    def name(self, tok: Token) -> Expr:
        nxt = self.peek()
        if nxt.kind == "op" and nxt.text == "(":
            if tok.text not in CALLS:
                raise self.fail(tok, f"unknown function {tok.text}()",
                                allowed=", ".join(f"{c}()" for c in CALLS))
            self.take()
            args: list[Expr] = []
            if not (self.peek().kind == "op" and self.peek().text == ")"):
                args.append(self.expr(0))
                while self.peek().kind == "op" and self.peek().text == ",":
                    self.take()
                    args.append(self.expr(0))
            self.expect(")", nxt)
            return self.node(Call(tok.text, tuple(args)), tok.col)
        if nxt.kind == "op" and nxt.text == "[":
            self.take()
            at = self.expr(0)
            self.expect("]", nxt)
            return self.node(Call("index", (tok.text, at)), tok.col)
        return self.node(var(tok.text), tok.col)


def parse(text: str, field: str) -> Parsed:
    """The expression tree of `text`, with its columns (syntax only: `check` types it)."""
    p = _Parser(text, field)
    if p.peek().kind == "end":
        raise p.fail(p.peek(), "the expression is empty")
    tree = p.expr(0)
    tok = p.peek()
    if tok.kind != "end":
        if tok.text in (")", "]"):
            raise p.fail(tok, f"unbalanced {tok.text!r}: nothing is open")
        raise p.fail(tok, f"expected an operator, found {tok.text!r}")
    return Parsed(tree, p.columns)


# ---- printing ---------------------------------------------------------------------------------

def _prec(e: Expr) -> int:
    if is_literal(e):
        return UNARY if not isinstance(e, bool) and (e < 0 or math.copysign(1, e) < 0) \
            else ATOM
    f = FUNCTIONS.get(e.fn)
    return f.prec if f is not None and f.symbol else ATOM


def _literal(v: bool | int | float) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v)


def format_expr(e: Expr) -> str:
    """The infix text of `e`, parenthesized only where precedence needs it."""
    if is_literal(e):
        return _literal(e)
    if e.fn == "var":
        return e.args[0]
    if e.fn == "index":
        return f"{e.args[0]}[{format_expr(e.args[1])}]"
    f = FUNCTIONS[e.fn]
    if f.symbol is None:
        return f"{e.fn}({', '.join(format_expr(a) for a in e.args)})"

    def side(a: Expr, wrap: bool) -> str:
        return f"({format_expr(a)})" if wrap else format_expr(a)

    if f.arity == 1:
        a = e.args[0]
        # a number after a minus would read back as a negative literal
        wrap = _prec(a) < f.prec or f.symbol == "-" and is_literal(a) and _prec(a) == ATOM
        sep = " " if f.symbol == "not" else ""
        return f"{f.symbol}{sep}{side(a, wrap)}"
    a, b = e.args
    # left-associative: a child of equal precedence on the left reads back the same, on the
    # right it needs parentheses; comparisons chain, so a comparison under one is wrapped
    left = _prec(a) < f.prec or (f.prec == CMP and _prec(a) == CMP)
    return f"{side(a, left)} {f.symbol} {side(b, _prec(b) <= f.prec)}"
