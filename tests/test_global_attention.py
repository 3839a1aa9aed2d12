"""Sparse attention with global tokens (Longformer): a sliding window plus the first G positions,
which every query sees and which, in an encoder, see every key.

Checked at each layer: the mask semantics (`visible`) against the definition written out pair by
pair; the unfused mask op and the kernel-level attention op against plain softmax attention over
that definition; the attention template (FlashAttention-2 prefill and split-KV decode) against
eager on odd shapes — G not a multiple of a block, T past the window, GQA 9/3, head_dim 80 —
and that the blocks neither in the window nor global are skipped, not merely masked: their keys
and values are NaN, which a masked block would still spread (0·NaN) into the output.

Tolerance (f32): 1e-5 of the output scale — both sides sum in f32, in different orders.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import archc.ir.expr as E
from archc.ir.graph import GraphBuilder
from archc.ir.modifiers import EagerValues, evaluate, from_attention_attrs
from archc.ir.ops import Op
from archc.ir.ops.attention import query_key_positions
from archc.ir.shapes import B, S, T, shape
from archc.runtime.eager import EagerContext, run_graph
from tests.test_triton_kernels import DEVICE, build, check, force_tma, rand
from tests.triton_graph import run_graph_triton

TOL = 1e-5


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def longformer_seen(t: int, length: int, causal: bool, window: int, g: int) -> torch.Tensor:
    """The definition, pair by pair: query i sits at position L − T + i. A key is seen when it
    is within the window (behind the query when causal, either side when not) or one of the
    first G positions (behind the query when causal); an encoder's global query sees all."""
    out = torch.zeros(t, length, dtype=torch.bool)
    for i in range(t):
        q = length - t + i
        for j in range(length):
            if causal:
                out[i, j] = j <= q and (q - j < window or j < g)
            else:
                out[i, j] = abs(q - j) < window or j < g or q < g
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t,length,window,g", [(13, 13, 4, 2), (1, 20, 3, 5), (3, 20, 8, 1),
                                              (9, 9, 1, 9), (6, 30, 5, 3)])
def test_visible_is_the_longformer_pattern(causal: bool, t: int, length: int, window: int,
                                           g: int) -> None:
    want = longformer_seen(t, length, causal, window, g)
    assert torch.equal(visible(t, length, causal, window, global_tokens=g), want)
    # the global tokens matter: without them fewer pairs are seen
    assert int(visible(t, length, causal, window).sum()) < int(want.sum()) or window >= length


def visible(t: int, length: int, causal: bool, window: int,
            global_tokens: int | None = None) -> torch.Tensor:
    """[T, L]: the attention op's mask attributes as its library expression computes them."""
    mods = from_attention_attrs(dict(causal=causal, window=window, global_tokens=global_tokens))
    seen = evaluate(mods.mask, mods.env, EagerValues(*query_key_positions(t, length), 1, 1))
    return seen.expand(1, 1, t, length)[0, 0]


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    seen: torch.Tensor) -> torch.Tensor:
    """softmax over the seen keys only, written plainly: [B, H, T, D] → [B, T, H·D]."""
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~seen, float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


@pytest.mark.parametrize("causal", [True, False])
def test_mask_and_attention_ops_are_plain_sparse_attention(causal: bool) -> None:
    heads, hd, t, past, window, g = 4, 8, 7, 9, 3, 2
    length = past + t
    q, k, v = rand(2, heads, t, hd), rand(2, heads, length, hd, seed=1), \
        rand(2, heads, length, hd, seed=2)
    want = plain_attention(q, k, v, 0.4, longformer_seen(t, length, causal, window, g))
    mask = dict(causal=causal, padding=False, prefix=False, window=window, global_tokens=g)

    def unfused(b: GraphBuilder, i: dict[str, int]) -> int:
        s = b.emit(Op.POINTWISE, b.emit(Op.SCORES, i["q"], i["k"]),
                   expr=E.call("scale", E.x(0), by=0.4))
        p = b.emit(Op.SOFTMAX, b.emit(Op.MASK, s, **mask))
        return b.emit(Op.MERGE_HEADS, b.emit(Op.WEIGHTED_SUM, p, i["v"]))

    def fused(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.ATTENTION, i["q"], i["k"], i["v"], scale=0.4, **mask)

    for fn in (unfused, fused):
        bld = GraphBuilder("g")
        ids = {"q": bld.input("q", shape(B, heads, T, hd), "f32"),
               "k": bld.input("k", shape(B, heads, S, hd), "f32"),
               "v": bld.input("v", shape(B, heads, S, hd), "f32")}
        bld.output("y", fn(bld, ids))
        got = run_graph(bld.build(), {}, {"q": q, "k": k, "v": v},
                        EagerContext({"B": 2, "T": t, "P": 0, "S": length}))["y"]
        assert (got - want).abs().max() <= TOL * want.abs().max(), fn.__name__


def attention_graph(heads: int, kv_heads: int, hd: int, causal: bool, window: int, g: int,
                    padding: bool = False) -> tuple:
    width = heads * hd
    inputs: dict[str, tuple[tuple, str]] = {"qp": (shape(B, T, width), "f32"),
                                            "kvp": (shape(B, S, 2 * kv_heads * hd), "f32")}
    if padding:
        inputs["pad"] = (shape(B, S), "i64")

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        q = b.emit(Op.SPLIT_HEADS, i["qp"], heads=heads)
        k = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["kvp"], start=0, stop=kv_heads * hd),
                   heads=kv_heads)
        v = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["kvp"], start=kv_heads * hd,
                                          stop=2 * kv_heads * hd), heads=kv_heads)
        extra = [i["pad"]] if padding else []
        return b.emit(Op.ATTENTION, q, k, v, *extra, scale=hd ** -0.5, causal=causal,
                      padding=padding, prefix=False, window=window, global_tokens=g)

    return build(inputs, fn), width


CASES = [
    # heads, kv_heads, head_dim, T, keys, causal, window, global tokens, padding
    (4, 2, 16, 37, 37, True, 8, 5, False),      # a prompt past the window, G inside a block
    (4, 2, 16, 37, 37, False, 4, 3, False),     # an encoder: global rows see every key
    (9, 3, 80, 21, 21, False, 3, 1, True),      # odd heads and head_dim, padding
    (4, 2, 16, 1, 45, True, 6, 2, False),       # one new token over a past
    (4, 1, 16, 3, 45, True, 5, 17, False),      # more global tokens than a block holds
    (4, 2, 16, 40, 150, True, 7, 3, False),     # two key blocks under the interpreter
    (4, 2, 16, 40, 150, False, 7, 3, False),
    (4, 2, 16, 40, 300, True, 7, 130, False),   # a whole block of global keys, then part of one
    (4, 2, 16, 40, 300, False, 7, 130, False),
]


@pytest.mark.parametrize("kernel", ["prefill", "prefill-tma", "decode"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_kernels_with_global_tokens(kernel_dir: Path, case: tuple, kernel: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel == "prefill-tma":  # the prefill kernel's tensor-descriptor load path
        force_tma(monkeypatch)
    heads, kv_heads, hd, t, keys, causal, window, g, padding = case
    graph, width = attention_graph(heads, kv_heads, hd, causal, window, g, padding)
    values = {"qp": rand(2, t, width), "kvp": rand(2, keys, 2 * kv_heads * hd, seed=1)}
    if padding:
        pad = torch.ones(2, keys, dtype=torch.long)
        pad[1, keys // 2:] = 0
        values["pad"] = pad
    check(graph, values, {"B": 2, "T": t, "P": 0, "S": keys}, kernel_dir,
          decode_max_rows=1 << 20 if kernel == "decode" else 0)


@pytest.mark.parametrize("kernel", ["prefill", "prefill-tma", "decode"])
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_neither_near_nor_global_are_skipped(kernel_dir: Path, kernel: str,
                                                    causal: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Three queries at the end of 600 keys, window 8, 5 global tokens: under the interpreter
    the key blocks are 128 wide, and keys [128, 512) lie in blocks no query may see. They are
    NaN here; the kernels must give eager's output on clean keys, so they never touched them."""
    if kernel == "prefill-tma":
        force_tma(monkeypatch)
    heads, kv_heads, hd, t, keys, window, g = 4, 2, 16, 3, 600, 8, 5
    graph, width = attention_graph(heads, kv_heads, hd, causal, window, g)
    clean = rand(2, keys, 2 * kv_heads * hd, seed=1)
    poisoned = clean.clone()
    poisoned[:, 128:512] = float("nan")
    q = rand(2, t, width)
    dims = {"B": 2, "T": t, "P": 0, "S": keys}
    want = run_graph(graph, {}, {"qp": q, "kvp": clean}, EagerContext(dims))["y"]
    got = run_graph_triton(graph, {}, {"qp": q, "kvp": poisoned}, dims, device=DEVICE,
                           cache_dir=kernel_dir,
                           decode_max_rows=1 << 20 if kernel == "decode" else 0).outputs["y"]
    got = got.cpu()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= TOL * want.abs().max()
