"""Hypothesis strategies for random, well-typed modifier expressions over one environment:
a per-head float parameter `slope`, a per-token int input `doc`, a per-sequence scalar
`prefix_len`. Integers stay small (no int32 overflow in a kernel); `exact` floats use only
operations IEEE rounds correctly (+ − · /), so torch and Triton agree on them bit for bit and
they may feed comparisons and floor; the transcendental functions appear only in float
results, compared within a tolerance."""

from __future__ import annotations

from hypothesis import strategies as st

from archc.ir.attrs import Call
from archc.ir.modifiers import Env, index, leaves, var

ENV = Env(head_params={"slope": float}, token_inputs={"doc": int}, scalars={"prefix_len": int})

INT_LEAVES = [var("q_pos"), var("kv_pos"), var("head"), var("kv_head"), var("prefix_len"),
              index("doc", "q_pos"), index("doc", "kv_pos")]
FLOAT_LEAVES = [var("score"), index("slope", "head"), index("slope", "kv_head")]
TRANSCENDENTAL = ("exp", "log", "tanh", "sigmoid", "sqrt")


def _call(fn: str, *args: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(*args).map(lambda a: Call(fn, a))


def ints(depth: int, positions_only: bool = False) -> st.SearchStrategy:
    """Integer expressions; `positions_only`: of q_pos, kv_pos and doc (no score, no floats:
    what a mask over positions is made of)."""
    leaves = INT_LEAVES if not positions_only else INT_LEAVES[:2] + INT_LEAVES[5:]
    leaf = st.one_of(st.sampled_from(leaves), st.integers(-20, 20))
    if depth == 0:
        return leaf
    sub = ints(depth - 1, positions_only)
    parts = [leaf,
             *(_call(fn, sub, sub) for fn in ("add", "sub", "min", "max")),
             _call("mul", sub, st.integers(-4, 4)),
             _call("neg", sub), _call("abs", sub),
             *(_call(fn, sub, st.integers(1, 9)) for fn in ("floordiv", "mod")),
             _call("where", bools(depth - 1, positions_only), sub, sub)]
    if not positions_only:
        parts.append(_call("floor", exact(depth - 1)))
    return st.one_of(*parts)


def exact(depth: int) -> st.SearchStrategy:
    """Float expressions of correctly rounded operations (and ints promoted to floats)."""
    leaf = st.one_of(st.sampled_from(FLOAT_LEAVES),
                     st.integers(-16, 16).map(lambda k: k / 4))
    if depth == 0:
        return leaf
    sub, num = exact(depth - 1), st.one_of(exact(depth - 1), ints(depth - 1))
    return st.one_of(leaf, *(_call(fn, sub, num) for fn in ("add", "sub", "mul")),
                     _call("truediv", num, st.sampled_from([0.5, 3.0, -2.0, 7])),
                     _call("neg", sub), _call("abs", sub))


def floats(depth: int) -> st.SearchStrategy:
    """Float expressions with exp, log, tanh, sigmoid and sqrt of exact arguments."""
    term = st.one_of(exact(1), *(_call(fn, exact(1)) for fn in TRANSCENDENTAL))
    if depth == 0:
        return term
    sub = floats(depth - 1)
    return st.one_of(term, *(_call(fn, sub, sub) for fn in ("add", "sub", "mul", "min", "max")),
                     _call("where", bools(1), sub, sub), _call("neg", sub), _call("abs", sub))


def bools(depth: int, positions_only: bool = False) -> st.SearchStrategy:
    """Bool expressions: comparisons, and/or/not, == of bools; over positions alone (a mask
    over q_pos, kv_pos and doc) or over everything but score's transcendental functions."""
    num = ints(max(depth - 1, 0), positions_only)
    if not positions_only:
        num = st.one_of(num, exact(max(depth - 1, 0)))
    compare = st.one_of(*(_call(fn, num, num) for fn in ("lt", "le", "gt", "ge", "eq", "ne")))
    if depth == 0:
        return st.one_of(compare, st.booleans())
    sub = bools(depth - 1, positions_only)
    return st.one_of(compare, _call("and_", sub, sub), _call("or_", sub, sub),
                     _call("not_", sub), _call("eq", sub, sub), _call("ne", sub, sub))


def _affine(depth: int) -> st.SearchStrategy:
    """a·q_pos + b·kv_pos + c, or a random integer expression of positions."""
    coef = st.integers(-3, 3)
    return st.one_of(
        st.tuples(coef, coef, st.integers(-30, 30)).map(lambda t: Call("add", (Call("add", (
            Call("mul", (var("q_pos"), t[0])), Call("mul", (var("kv_pos"), t[1])))), t[2]))),
        ints(depth, positions_only=True))


def masks(depth: int) -> st.SearchStrategy:
    """Masks as the tile classifier meets them: comparisons of affine, floor-div and mod
    expressions of positions, per-token equality, per-head and scalar terms, float terms with
    transcendental functions (no score), and/or/not."""
    cmp = st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"])
    chunk = st.integers(1, 12)
    affine_cmp = st.tuples(cmp, _affine(2), _affine(1)).map(lambda t: Call(t[0], t[1:]))
    chunks = st.tuples(cmp, _affine(1), _affine(1), chunk).map(lambda t: Call(t[0], (
        Call("floordiv", (t[1], t[3])), Call("floordiv", (t[2], t[3])))))
    residues = st.tuples(cmp, _affine(1), chunk, st.integers(-2, 12)).map(lambda t: Call(
        t[0], (Call("mod", (t[1], t[2])), t[3])))
    doc_eq = st.just(Call("eq", (index("doc", "q_pos"), index("doc", "kv_pos"))))
    float_cmp = st.tuples(cmp, floats(0).filter(_no_score),
                          st.integers(-40, 40).map(lambda k: k / 8)).map(
        lambda t: Call(t[0], t[1:]))
    leaf = st.one_of(affine_cmp, chunks, residues, doc_eq, float_cmp,
                     bools(2).filter(_no_score))
    if depth == 0:
        return leaf
    sub = masks(depth - 1)
    return st.one_of(leaf, _call("and_", sub, sub), _call("or_", sub, sub), _call("not_", sub))


def _no_score(e: object) -> bool:
    return var("score") not in leaves(e)
