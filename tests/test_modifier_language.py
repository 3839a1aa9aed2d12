"""The modifier language's text: it parses with Python's precedence and meaning (checked against
Python's own grammar, read by `ast`, and Python's integer arithmetic), prints back to the same
tree, and every bad expression is refused in one line naming the field and the column."""

from __future__ import annotations

import ast
import operator
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from archc.errors import SpecError
from archc.ir.attrs import Call, format_value, parse_value
from archc.ir.modifiers import (
    EagerValues,
    Env,
    ExprError,
    check,
    check_int32,
    evaluate,
    format_expr,
    index,
    parse,
    parse_field,
    var,
)
from tests.modifier_exprs import ENV, bools, floats, ints

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


@SETTINGS
@given(st.one_of(ints(3), bools(3), floats(2)))
def test_print_parse_round_trip(e: object) -> None:
    text = format_expr(e)
    assert parse(text, "f").tree == e, text
    assert parse_value(format_value(e)) == e     # and as an IR attribute value


# ---- the meaning is Python's ------------------------------------------------------------------

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne}


def python_value(node: ast.expr, names: dict[str, object]) -> object:
    """The value Python gives the text's syntax tree, by Python's operators: the oracle."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.Subscript):
        return names[node.value.id][python_value(node.slice, names)]
    if isinstance(node, ast.BinOp):
        return _BIN[type(node.op)](python_value(node.left, names),
                                   python_value(node.right, names))
    if isinstance(node, ast.UnaryOp):
        v = python_value(node.operand, names)
        return -v if isinstance(node.op, ast.USub) else not v
    if isinstance(node, ast.BoolOp):
        vs = [python_value(v, names) for v in node.values]
        return all(vs) if isinstance(node.op, ast.And) else any(vs)
    if isinstance(node, ast.Compare):
        left, out = python_value(node.left, names), True
        for o, right in zip(node.ops, node.comparators):
            r = python_value(right, names)
            out, left = out and _CMP[type(o)](left, r), r
        return out
    assert isinstance(node, ast.Call)
    args = [python_value(a, names) for a in node.args]
    return {"where": lambda c, a, b: a if c else b, "min": min, "max": max,
            "abs": abs}[node.func.id](*args)


@SETTINGS
@given(st.one_of(ints(3, positions_only=True), bools(3, positions_only=True)))
def test_meaning_is_pythons(e: object) -> None:
    """Over every (query, key) pair of a small grid, torch's value of the tree equals the value
    Python's grammar and integer arithmetic give the printed text (negative // and % included:
    differences of positions and negative literals)."""
    text = format_expr(e)
    doc = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    q, k = torch.arange(4, 9), torch.arange(0, 9)
    got = evaluate(e, ENV, EagerValues(q, k, 1, 1, token_inputs={"doc": torch.tensor([doc])}))
    got = got.expand(1, 1, len(q), len(k))[0, 0]
    tree = ast.parse(text, mode="eval").body
    for i, qp in enumerate(q.tolist()):
        for j, kp in enumerate(k.tolist()):
            names = {"q_pos": qp, "kv_pos": kp, "doc": doc, "true": True, "false": False}
            assert got[i, j].item() == python_value(tree, names), (text, qp, kp)


def test_precedence_and_chains() -> None:
    q, k = var("q_pos"), var("kv_pos")
    d = Call("sub", (q, k))
    assert parse("0 <= q_pos - kv_pos < 3", "f").tree == \
        Call("and_", (Call("le", (0, d)), Call("lt", (d, 3))))
    assert parse("not q_pos < 1 or kv_pos < 2 and q_pos > 3", "f").tree == Call("or_", (
        Call("not_", (Call("lt", (q, 1)),)),
        Call("and_", (Call("lt", (k, 2)), Call("gt", (q, 3))))))
    assert parse("-q_pos // -3 % 2", "f").tree == \
        Call("mod", (Call("floordiv", (Call("neg", (q,)), -3)), 2))
    assert parse("q_pos - (kv_pos - 1)", "f").tree == Call("sub", (q, Call("sub", (k, 1))))
    assert format_expr(Call("neg", (3,))) == "-(3)"     # not the literal −3
    assert format_expr(Call("sub", (q, Call("sub", (k, 1))))) == "q_pos - (kv_pos - 1)"


# ---- refusals ----------------------------------------------------------------------------------

FULL = Env(head_params={"slope": float}, token_inputs={"doc": int},
           scalars={"prefix_len": int}, constants={"W": 512, "BIG": 10 ** 12})

BAD = [
    # text, kind, what the message must say (after "attention.mask: ")
    ("foo < 1", "mask", "column 1: undefined name 'foo'"),
    ("q_pos < True", "mask", "column 9: undefined name 'True': write true or false"),
    ("score < 1.0", "mask", "column 1: a mask may not use score"),
    ("q_pos - kv_pos", "mask", "column 1: a mask is a bool expression"),
    ("score < 1.0", "score", "column 1: a score is a float expression"),
    ("q_pos and kv_pos", "mask", "column 7: 'and' takes bools, got int and int"),
    ("not q_pos", "mask", "column 1: 'not' takes bools, got int"),
    ("q_pos < 1 < true", "mask", "column 11: '<' takes numbers, got int and bool"),
    ("where(q_pos, 1, 2) == 1", "mask", "column 1: where() takes a bool condition first"),
    ("where(q_pos < 1, 2) == 1", "mask", "column 1: where() takes 3 arguments, got 2"),
    ("floor(q_pos) < 1", "mask", "column 1: floor() takes a float"),
    ("q_pos // kv_pos < 1", "mask", "column 7: '//' divides by kv_pos"),
    ("q_pos % 0 < 1", "mask", "column 7: '%' divides by 0"),
    ("q_pos // 2.0 < 1", "mask", "column 7: '//' takes integers, got int and float"),
    ("(q_pos < 1", "mask", "column 11: expected ')' to close the '(' at column 1, found the end"),
    ("q_pos < 1)", "mask", "column 10: unbalanced ')': nothing is open"),
    ("doc[q_pos < 1", "mask", "column 14: expected ']' to close the '[' at column 4"),
    ("q_pos <", "mask", "column 8: the expression ends where an operand was expected"),
    ("", "mask", "column 1: the expression is empty"),
    ("q_pos < 1 kv_pos", "mask", "column 11: expected an operator, found 'kv_pos'"),
    ('__import__("os")', "mask", "column 1: unknown function __import__()"),
    ("eval(q_pos) < 1", "mask", "column 1: unknown function eval()"),
    ("q_pos.bit_length() < 1", "mask", "column 6: unexpected '.': attribute access"),
    ("q_pos < 'a'", "mask", "column 9: unexpected \"'\": strings are not allowed"),
    ("q_pos = 1", "mask", "column 7: unexpected '=': '=' does not compare: write =="),
    ("q_pos < 1 && kv_pos < 1", "mask", "column 11: unexpected '&': write and"),
    ("q_pos ** 2 < 1", "mask", "column 7: there is no power operator **"),
    ("q_pos < 99999999999", "mask", "column 9: the integer 99999999999 is too large"),
    ("q_pos < 2147483648", "mask", "column 9: the integer 2147483648 is too large"),
    ("q_pos < 1e31", "mask", "column 9: the number 1e31 is too large"),
    ("q_pos < BIG", "mask", "column 9: the constant BIG = integer 1000000000000 is too large"),
    ("q_pos[head] < 1", "mask", "column 1: q_pos is not a per-head parameter or per-token input"),
    ("W[q_pos] < 1", "mask", "column 1: W is not a per-head parameter or per-token input"),
    ("slope[q_pos] < 1.0", "mask", "column 1: slope is a per-head parameter, indexed by q_pos"),
    ("doc[head] == 1", "mask", "column 1: doc is a per-token input, indexed by head"),
    ("doc[q_pos + 1] == 1", "mask", "column 1: doc is a per-token input, indexed by q_pos + 1"),
    ("slope < 1.0", "mask", "column 1: slope is a per-head parameter: write slope[head]"),
    ("doc == 1", "mask", "column 1: doc is a per-token input: write doc[q_pos]"),
    ("(" * 70 + "true" + ")" * 70, "mask", "column 65: the expression nests deeper than 64"),
    (" + ".join(["q_pos"] * 80) + " < 1", "mask", "column 137: the expression nests deeper"),
    ("-" * 80 + "q_pos < 1", "mask", "column 65: the expression nests deeper than 64"),
    ("q_pos < 1 or " * 200 + "true", "mask", "the expression is 2604 characters long"),
]


@pytest.mark.parametrize("text,kind,message", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_expression_refused_in_one_line(text: str, kind: str, message: str) -> None:
    with pytest.raises(ExprError) as err:
        parse_field(text, "attention.mask", kind, FULL)   # type: ignore[arg-type]
    line = str(err.value)
    assert "\n" not in line and isinstance(err.value, SpecError)
    assert line.startswith("attention.mask: " + message), line


def test_refusals_name_what_is_allowed() -> None:
    with pytest.raises(ExprError, match=r"\(allowed: q_pos, kv_pos, head, kv_head, "
                       r"slope\[head\], doc\[q_pos\], prefix_len, W, BIG\)$"):
        parse_field("score > 0.0", "attention.mask", "mask", FULL)
    with pytest.raises(ExprError, match=r"\(allowed: where\(\), min\(\), max\(\), abs\(\), "
                       r"exp\(\), log\(\), tanh\(\), sigmoid\(\), sqrt\(\), floor\(\)\)$"):
        parse_field("print(1) < 2", "attention.mask", "mask", FULL)


@pytest.mark.parametrize("tree,message", [
    (Call("lt", (Call("pow", (var("q_pos"), 2)), 1)),
     'unknown function pow() (in pow(var("q_pos"), 2))'),
    (Call("lt", (var("q_pos"),)), "'<' takes 2 arguments, got 1 (in lt(var(\"q_pos\")))"),
    (Call("lt", (var("q_pos"), "x")), "not an expression: 'x'"),
    (Call("lt", (var("q_pos"), 1e40)), "the number 1e+40 is out of range"),
    (Call("lt", (var("q_pos"), float("nan"))), "the number nan is out of range"),
])
def test_trees_from_the_ir_are_checked(tree: Call, message: str) -> None:
    """A tree read from IR text has no columns: a refusal shows the subexpression instead."""
    with pytest.raises(ExprError) as err:
        check(tree, "attention.mask", "mask", FULL)
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("env,message", [
    (Env(head_params={"q_pos": float}), "'q_pos' is taken by the language"),
    (Env(scalars={"where": int}), "'where' is taken by the language"),
    (Env(token_inputs={"doc": int}, scalars={"doc": int}), "'doc' is declared twice"),
    (Env(constants={"__x": 1}), "'__x' is not a name"),
])
def test_environment_names_checked(env: Env, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        env.check_names("attention")


def test_constants_become_literals() -> None:
    e = parse_field("q_pos - kv_pos < W and kv_pos % W == 0", "f", "mask", FULL)
    assert format_expr(e) == "q_pos - kv_pos < 512 and kv_pos % 512 == 0"
    assert e == parse_field("q_pos - kv_pos < 512 and kv_pos % 512 == 0", "f", "mask", FULL)
    assert parse_field("slope[kv_head] * score", "f", "score", FULL) == \
        Call("mul", (index("slope", "kv_head"), var("score")))


@pytest.mark.parametrize("text,refused", [
    ("q_pos * 100000 < kv_pos", "q_pos * 100000 reaches 1.31071e+10 at positions below 131072"),
    ("q_pos * kv_pos < 5", "q_pos * kv_pos reaches 1.71796e+10"),
    ("kv_pos <= q_pos and q_pos // 8192 == kv_pos // 8192", None),
    ("q_pos * 16000 < kv_pos", None),                   # 131071·16000 < 2³¹
    ("doc[q_pos] * 100000 == 3", None),                 # unknown values: not refused
])
def test_int32_overflow_at_the_longest_sequence(text: str, refused: str | None) -> None:
    e = parse_field(text, "attention.mask", "mask", FULL)
    if refused is None:
        check_int32(e, "attention.mask", FULL, 131072)
        return
    with pytest.raises(ExprError, match=re.escape(f"attention.mask: {refused}")):
        check_int32(e, "attention.mask", FULL, 131072)
