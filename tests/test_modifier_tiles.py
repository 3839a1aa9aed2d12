"""Tile classification by interval arithmetic is conservative — no tile called empty has a
visible pair, none called full a hidden one — over random masks and tiles, each pair checked by
brute force with the torch rendering; and the built-ins classify exactly (maps drawn by hand)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from archc.ir.modifiers import (
    EagerValues,
    Tile,
    TileClass,
    builtin,
    classify,
    evaluate,
    format_expr,
    parse_field,
    tile_map,
)
from archc.ir.modifiers import interval as iv
from archc.ir.modifiers.language import FUNCTIONS
from archc.ir.modifiers.library import library_env
from tests.modifier_exprs import ENV, masks

HEADS, KV_HEADS = 6, 3


@st.composite
def tiles(draw: st.DrawFn) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    q0, k0 = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    h0 = draw(st.integers(0, HEADS - 1))
    return ((q0, q0 + draw(st.integers(0, 12))), (k0, k0 + draw(st.integers(0, 12))),
            (h0, draw(st.integers(h0, HEADS - 1))))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(masks(2), tiles(), st.lists(st.integers(0, 3), min_size=56, max_size=56),
       st.integers(0, 50), st.booleans())
def test_classification_is_conservative(mask: object, tile: tuple, doc: list[int],
                                        prefix_len: int, prefix_known: bool) -> None:
    (q0, q1), (k0, k1), (h0, h1) = tile
    doc_t = torch.tensor([doc])
    slope = torch.linspace(-1.0, 2.0, HEADS)
    qs, ks = torch.arange(q0, q1 + 1), torch.arange(k0, k1 + 1)
    seen = evaluate(mask, ENV, EagerValues(
        qs, ks, HEADS, KV_HEADS, head_params={"slope": slope}, token_inputs={"doc": doc_t},
        scalars={"prefix_len": torch.tensor(prefix_len)}))
    seen = seen.expand(1, HEADS, len(qs), len(ks))[0, h0:h1 + 1]        # the tile's pairs
    group = HEADS // KV_HEADS
    c = classify(mask, ENV, Tile(
        (q0, q1), (k0, k1), (h0, h1), (h0 // group, h1 // group),
        tokens={"doc": ((min(doc[q0:q1 + 1]), max(doc[q0:q1 + 1])),
                        (min(doc[k0:k1 + 1]), max(doc[k0:k1 + 1])))},
        scalars={"prefix_len": (prefix_len, prefix_len)} if prefix_known else {},
        # slope at the tile's heads and KV heads (kv_head ≤ head)
        head_params={"slope": (slope[h0 // group:h1 + 1].min().item(),
                               slope[h0 // group:h1 + 1].max().item())}))
    if c is TileClass.EMPTY:
        assert not seen.any(), (format_expr(mask), tile)
    if c is TileClass.FULL:
        assert seen.all(), (format_expr(mask), tile)


def _map(mask: object, t: int, length: int, bm: int, bn: int, **kw: object) -> str:
    return tile_map(mask, library_env(), t=t, length=length, block_m=bm, block_n=bn,
                    **kw).text()


def test_causal_tiles() -> None:
    m = tile_map(builtin("causal"), library_env(), t=32, length=32, block_m=8, block_n=8)
    assert m.text() == "▒···\n█▒··\n██▒·\n███▒"
    assert m.visited == pytest.approx(10 / 16)
    # decode: one query at position 32 sees every key; T < L with a past of 12
    assert _map(builtin("causal"), 1, 33, 16, 8) == "█████"
    assert _map(builtin("causal"), 20, 32, 8, 8) == "█▒▒·\n██▒▒\n███▒"


def test_sliding_window_far_tiles_empty() -> None:
    m = builtin("sliding_window", window=8)
    assert _map(m, 32, 32, 8, 8) == "▒···\n▒▒··\n·▒▒·\n··▒▒"
    m = builtin("sliding_window_bidirectional", window=9)
    assert _map(m, 32, 32, 8, 8) == "█▒··\n▒█▒·\n·▒█▒\n··▒█"


def test_chunked_aligned_tiles_full_or_empty() -> None:
    m = builtin("chunked", chunk=16)
    assert _map(m, 32, 32, 8, 8) == "▒···\n█▒··\n··▒·\n··█▒"
    # without causality, a tile inside one chunk is full, across chunks empty — never partial
    m = parse_field("q_pos // 8192 == kv_pos // 8192", "f", "mask")
    got = tile_map(m, library_env(), t=32768, length=32768, block_m=4096, block_n=4096)
    assert got.count(TileClass.PARTIAL) == 0
    assert got.text().splitlines()[2] == "··██····"
    assert got.visited == pytest.approx(0.25)
    # misaligned tiles straddle a chunk edge: partial
    assert _map(parse_field("q_pos // 12 == kv_pos // 12", "f", "mask"), 16, 16, 8, 8) == \
        "█▒\n▒▒"


def test_global_and_prefix_tiles() -> None:
    m = builtin("longformer", window=8, global_tokens=4)
    assert _map(m, 32, 32, 8, 8) == "▒···\n▒▒··\n▒▒▒·\n▒·▒▒"
    # the prefix length known (3) or not: the tiles past the diagonal are partial only when
    # they can hold the prefix
    m = builtin("prefix_lm")
    assert _map(m, 32, 32, 8, 8, scalars={"prefix_len": (12, 12)}) == "█▒··\n█▒··\n██▒·\n███▒"
    assert _map(m, 32, 32, 8, 8) == "▒▒▒▒\n█▒▒▒\n██▒▒\n███▒"


def test_document_tiles_from_per_token_ranges() -> None:
    """Packed documents of 8, 8 and 16 tokens: a tile pair is full only where both tiles hold
    one document, and the same one; across documents empty."""
    doc = torch.tensor([0] * 8 + [1] * 8 + [2] * 16)
    m = parse_field("doc[q_pos] == doc[kv_pos]", "f", "mask", library_env())
    assert _map(m, 32, 32, 8, 8, tokens={"doc": doc}) == \
        "█···\n·█··\n··██\n··██"
    # a tile straddling two documents is partial with each
    doc = torch.tensor([0] * 12 + [1] * 20)
    assert _map(m, 32, 32, 8, 8, tokens={"doc": doc}) == \
        "█▒··\n▒▒▒▒\n·▒██\n·▒██"
    assert _map(builtin("document"), 32, 32, 8, 8, tokens={"doc": doc}) == \
        "▒···\n▒▒··\n·▒▒·\n·▒█▒"


# ---- each function's interval rule, on its own --------------------------------------------

f32s = st.floats(-60, 60, width=32).map(lambda x: x + 0.0)    # no −0.0


@st.composite
def operand(draw: st.DrawFn, t: type) -> tuple[object, list[object]]:
    """An interval (or truth value) of type `t` and points inside it, its bounds among them."""
    if t is bool:
        vals = draw(st.sampled_from([[True], [False], [True, False]]))
        return iv.Truth(True in vals, False in vals), vals
    lo, hi = sorted(draw(st.tuples(st.integers(-40, 40), st.integers(-40, 40)) if t is int
                         else st.tuples(f32s, f32s)))
    inner = st.integers(lo, hi) if t is int else st.floats(lo, hi, width=32)
    return iv.Interval(lo, hi), [lo, hi, *draw(st.lists(inner, min_size=1, max_size=6))]


SIGNATURES = {  # argument types each function is tried with
    **{n: [(int, int), (float, float), (int, float)] for n in
       ("add", "sub", "mul", "min", "max", "lt", "le", "gt", "ge", "eq", "ne")},
    "truediv": [(int, int), (float, float)], "floordiv": [(int, int)], "mod": [(int, int)],
    "neg": [(int,), (float,)], "abs": [(int,), (float,)], "floor": [(float,)],
    **{n: [(int,), (float,)] for n in ("exp", "log", "tanh", "sigmoid", "sqrt")},
    "and_": [(bool, bool)], "or_": [(bool, bool)], "not_": [(bool,)],
    "where": [(bool, int, int), (bool, float, float), (bool, bool, bool)],
}


@settings(max_examples=600, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(SIGNATURES)), st.data())
def test_each_interval_rule_is_sound(name: str, data: st.DataObject) -> None:
    """Every value torch computes (in f32 / int64) at points of the argument intervals lies in
    the function's interval of them."""
    f = FUNCTIONS[name]
    types = data.draw(st.sampled_from(SIGNATURES[name]))
    if name in ("floordiv", "mod"):     # the divisor is a positive literal
        d = data.draw(st.integers(1, 12))
        args = [data.draw(operand(int)), (iv.point(d), [d])]
    else:
        args = [data.draw(operand(t)) for t in types]
    want, result = f.typing(*types)
    ranges = [iv.to_float(r) if t is int and w is float else r
              for (r, _), t, w in zip(args, types, want)]
    out = f.interval(*ranges, result is float) if f.by_float else f.interval(*ranges)
    dtype = {bool: torch.bool, int: torch.int64, float: torch.float32}
    for point in itertools.product(*(p for _, p in args)):
        xs = [torch.tensor(v, dtype=dtype[w]) for v, w in zip(point, want)]
        v = f.torch(*xs).item()
        if isinstance(out, iv.Truth):
            assert out.can_true if v else out.can_false, (name, point, out)
        elif v != v:
            assert out.nan, (name, point, out)
        else:
            assert out.lo <= v <= out.hi, (name, point, v, out)


def test_the_documents_maps_and_fractions_are_computed() -> None:
    """docs/attention-expressions.md shows maps and fractions of tiles visited: these."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "attention-expressions.md").read_text()
    causal = _map(builtin("causal"), 64, 64, 8, 8).splitlines()
    chunked = _map(builtin("chunked", chunk=16), 64, 64, 8, 8).splitlines()
    assert "\n".join(f"{a}      {b}" for a, b in zip(causal, chunked)) in doc

    def visited(mask: object, **kw: object) -> str:
        m = tile_map(mask, library_env(), t=8192, length=8192, block_m=64, block_n=64, **kw)
        return f"{m.visited:.4f}"
    per_head = parse_field("kv_pos <= q_pos and q_pos - kv_pos < where(head < 4, 128, 4096)",
                           "f", "mask")
    assert (f"causal {visited(builtin('causal'))}; a causal window of\n4096, "
            f"{visited(builtin('sliding_window', window=4096))}; Longformer's window of 512 "
            f"with 16 global tokens, {visited(builtin('longformer', window=512, global_tokens=16))}"
            f"; the window per head\nabove, {visited(per_head, heads=8)} over all 8 heads and "
            f"{visited(per_head, heads=4)} over heads 0–3 alone.") in doc
    for name, f in FUNCTIONS.items():      # every function of the table is documented
        form = f"`{name}(" if f.symbol is None else f"`a {f.symbol} b`" if f.arity == 2 else \
            "`-e`" if f.symbol == "-" else f"`{f.symbol} a`"
        assert form in doc, name
