"""The attention kernels run the modifier expressions (Triton's interpreter, f32).

- The tile classifier the kernels run (``tiles.triton_classify``: interval arithmetic as Triton
  scalar code over a tile's bounds) against ``classify`` on random masks and tiles: the same
  class on integer masks, never less conservative on the others.
- Each kind of modifier, Triton against eager on the attention op: ALiBi from per-head slopes,
  packed documents from a per-token input, attention sinks, sigmoid attention, chunked
  attention, a dilated window, a per-KV-head bias over a soft-cap; GQA 9 query heads over 3 KV
  heads; 16 × 16 tiles, so that odd lengths span several tiles and end inside one; the prefill
  kernel and split-KV decode (its merge included).
- Tiles the mask leaves empty are never read: their keys are NaN and the output is eager's.
  A row that sees no key averages every value, as eager's finfo.min does.
- Whole models: ALiBi slopes read from a checkpoint, packed documents with ALiBi and sinks over
  prefill and decode steps, the paged engine and ring attention (cp = 2) with sinks.

Tolerance (f32): 1e-5 of the output's scale (tests.test_triton_kernels): both sides sum in f32,
in different orders.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import archc
from archc.codegen import blocks
from archc.ir.graph import GraphBuilder
from archc.ir.modifiers import (
    Tile,
    TileClass,
    classify,
    format_expr,
    index,
    parse,
    parse_field,
    var,
)
from archc.ir.modifiers.language import type_of
from archc.ir.modifiers.tiles import triton_classify
from archc.ir.ops import Op
from archc.ir.shapes import B, shape
from archc.runtime.eager import EagerContext, run_graph
from archc.spec.load import from_dict
from tests.modifier_exprs import ENV, masks
from tests.test_attention_expressions import (
    CASES,
    HEADS,
    KV_HEADS,
    PACKED,
    alibi_rewritten,
    close,
    doc_of,
    op_program,
    smollm2,
)
from tests.triton_graph import run_graph_triton

ROOT = Path(__file__).resolve().parents[1]
D = 8
BLOCK = 16


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 × 16 prefill tiles and 16-key decode steps: short sequences span several tiles."""
    real = blocks.launch_config

    def config(family: str, target: str, **sizes: int) -> dict:
        cfg = real(family, target, **sizes)
        if family == "attention":
            cfg.update(BLOCK_M=BLOCK, BLOCK_N=BLOCK)
        if family == "attention_decode":
            cfg.update(BLOCK_N=BLOCK)
        return cfg

    monkeypatch.setattr(blocks, "launch_config", config)


# ---- the kernels' tile classifier against classify -------------------------------------------

GROUP = 2
BOUNDS = {var("q_pos"): ("q_lo", "q_hi"), var("kv_pos"): ("k_lo", "k_hi"),
          var("head"): ("h_lo", "h_hi"), var("kv_head"): ("g_lo", "g_hi"),
          index("doc", "q_pos"): ("dq_lo", "dq_hi"), index("doc", "kv_pos"): ("dk_lo", "dk_hi"),
          var("prefix_len"): ("pl", "pl")}
NAMES = ["q_lo", "q_hi", "k_lo", "k_hi", "h_lo", "h_hi", "g_lo", "g_hi", "dq_lo", "dq_hi",
         "dk_lo", "dk_hi", "pl"]

KERNEL = '''
@triton.jit
def cls_{i}(out_ptr, tiles_ptr):
    # {text}
    at = tiles_ptr + tl.program_id(0) * {n}
{loads}
{lines}
    tl.store(out_ptr + tl.program_id(0) * 2, ({live}).to(tl.int32))
    tl.store(out_ptr + tl.program_id(0) * 2 + 1, ({full}).to(tl.int32))
'''

DRIVER = '''
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("classifiers", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
tiles = torch.load(sys.argv[2])
outs = []
for i in range(int(sys.argv[4])):
    out = torch.zeros(tiles.shape[0], 2, dtype=torch.int32)
    getattr(mod, f"cls_{i}")[(tiles.shape[0],)](out, tiles)
    outs.append(out)
torch.save(outs, sys.argv[3])
'''


def _floats_in(e: object) -> bool:
    """Does any subexpression of `e` have a float value?"""
    if isinstance(e, (bool, int)):
        return False
    if isinstance(e, float):
        return True
    if type_of(e, ENV) is float:
        return True
    return e.fn not in ("var", "index") and any(_floats_in(a) for a in e.args)


@st.composite
def tile_bounds(draw: st.DrawFn) -> list[int]:
    q0, k0, h0 = draw(st.integers(0, 40)), draw(st.integers(0, 40)), draw(st.integers(0, 5))
    q1, k1, h1 = q0 + draw(st.integers(0, 12)), k0 + draw(st.integers(0, 12)), \
        draw(st.integers(h0, 5))
    d = sorted(draw(st.tuples(*[st.integers(0, 3)] * 4)))
    dq, dk = (d[0], d[2]), (d[1], d[3]) if draw(st.booleans()) else (d[0], d[0])
    return [q0, q1, k0, k1, h0, h1, h0 // GROUP, h1 // GROUP, *dq, *dk,
            draw(st.integers(0, 50))]


# one batch, one subprocess; a failure names its mask
@settings(max_examples=1, deadline=None, derandomize=True, phases=[Phase.generate])
@given(st.lists(masks(2), min_size=40, max_size=40),
       st.lists(tile_bounds(), min_size=12, max_size=12))
def test_kernel_classifier_agrees_with_classify(tmp_path_factory: pytest.TempPathFactory,
                                                mask_list: list, tile_list: list) -> None:
    tmp = tmp_path_factory.mktemp("classify")
    loads = "\n".join(f"    {n} = tl.load(at + {k})" for k, n in enumerate(NAMES))
    codes, kernels = [], []
    for i, mask in enumerate(mask_list):
        code = triton_classify(mask, ENV, BOUNDS, prefix=f"c{i}_")
        codes.append(code)
        as_int1 = {True: "tl.full((), 1, tl.int1)", False: "tl.full((), 0, tl.int1)"}
        kernels.append(KERNEL.format(
            i=i, text=format_expr(mask)[:200].replace("\n", " "), n=len(NAMES), loads=loads,
            lines="\n".join(f"    {ln}" for ln in code.lines),
            live=as_int1.get(code.live, code.live), full=as_int1.get(code.full, code.full)))
    (tmp / "kernels.py").write_text("import triton\nimport triton.language as tl\n" +
                                    "".join(kernels))
    tiles = torch.tensor(tile_list, dtype=torch.int32)
    torch.save(tiles, tmp / "tiles.pt")
    run = subprocess.run([sys.executable, "-c", DRIVER, str(tmp / "kernels.py"),
                          str(tmp / "tiles.pt"), str(tmp / "out.pt"), str(len(mask_list))],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    outs = torch.load(tmp / "out.pt")
    exact = 0
    for mask, out in zip(mask_list, outs):
        for bounds, (live, full) in zip(tile_list, out.tolist()):
            b = dict(zip(NAMES, bounds))
            want = classify(mask, ENV, Tile(
                (b["q_lo"], b["q_hi"]), (b["k_lo"], b["k_hi"]), (b["h_lo"], b["h_hi"]),
                (b["g_lo"], b["g_hi"]),
                tokens={"doc": ((b["dq_lo"], b["dq_hi"]), (b["dk_lo"], b["dk_hi"]))},
                scalars={"prefix_len": (b["pl"], b["pl"])}))
            text = (format_expr(mask), bounds)
            if not _floats_in(mask):
                exact += 1
                assert (bool(live), bool(full)) == (want is not TileClass.EMPTY,
                                                    want is TileClass.FULL), text
            else:   # never less conservative: live where classify is, full only where it is
                assert bool(live) or want is TileClass.EMPTY, text
                assert not full or want is TileClass.FULL, text
    assert exact >= 12 * 10        # most masks are integer ones


def test_classifier_code_folds_what_is_known() -> None:
    """A causal mask is two comparisons; a mask that is always true needs no code; a per-head
    parameter is any float to the classifier, so a mask of it is never full."""
    causal = parse_field("kv_pos <= q_pos", "mask", "mask", ENV)
    code = triton_classify(causal, ENV, BOUNDS)
    assert code.lines == ("cls_0 = k_lo <= q_hi", "cls_1 = q_lo < k_hi", "cls_2 = ~cls_1")
    assert (code.live, code.full) == ("cls_0", "cls_2")
    assert triton_classify(True, ENV, BOUNDS) == type(code)((), True, True)
    slope = parse_field("slope[head] > 0.5 and kv_pos <= q_pos", "mask", "mask", ENV)
    assert triton_classify(slope, ENV, BOUNDS).full is False


# ---- each kind of modifier, Triton against eager --------------------------------------------

# (T, L, kernel): a prompt of 21 over 16-wide tiles (the second one short: full, partial and
# empty tiles under a causal mask), 5 new tokens after a past of 32 through the prefill kernel
# and through split-KV decode (three busy splits, merged), one token after 36
RUNS = [(21, 21, "prefill"), (5, 37, "prefill"), (5, 37, "decode"), (1, 37, "decode")]


def check_op(graph: Any, values: dict[str, torch.Tensor], t: int, length: int, kernel: str,
             kernel_dir: Path, clean: dict[str, torch.Tensor] | None = None) -> None:
    """Eager (on `clean` values where given) against Triton on `values`."""
    dims = {"B": 2, "T": t, "P": length - t, "S": 0}
    want = run_graph(graph, {}, clean or values, EagerContext(dims))["o"]
    got = run_graph_triton(graph, {}, values, dims, cache_dir=kernel_dir,
                           decode_max_rows=1 << 20 if kernel == "decode" else 0).outputs["o"]
    assert torch.isfinite(got).all()
    assert close(got, want), float((got - want).abs().max())


def qkv(t: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(2, HEADS, t, D, generator=g),
            "k": torch.randn(2, KV_HEADS, length, D, generator=g),
            "v": torch.randn(2, KV_HEADS, length, D, generator=g)}


@pytest.mark.parametrize("t,length,kernel", RUNS, ids=lambda x: str(x))
@pytest.mark.parametrize("case", list(CASES))
def test_modifier_on_triton_equals_eager(case: str, t: int, length: int, kernel: str,
                                         kernel_dir: Path, small_tiles: None) -> None:
    attrs, operands, *_ = CASES[case]
    names = {n: f(length) for n, f in operands.items()}
    check_op(op_program(attrs, names, length, t).graphs[0],
             {**qkv(t, length, t * 31 + length), **names}, t, length, kernel, kernel_dir)


def program(attrs: dict[str, Any], tokens: dict[str, torch.Tensor], length: int, t: int,
            name: str = "decoder") -> Any:
    """One attention of q [B, 9, T, 8] over k, v [B, 3, L, 8]; `tokens`: per-token inputs."""
    b = GraphBuilder(name)
    q = b.input("q", shape(B, HEADS, t, D), "f32")
    k, v = (b.input(n, shape(B, KV_HEADS, length, D), "f32") for n in "kv")
    at = {key: parse(x, key).tree if key in ("score", "mask") else x for key, x in attrs.items()}
    extra = [b.input(n, shape(B, length), "i64") for n in sorted(tokens)]
    b.output("o", b.emit(Op.ATTENTION, q, k, v, *extra, scale=0.3, **at))
    return b.build()


def documents(length: int, starts: list[list[int]]) -> torch.Tensor:
    """[2, L] document ids, a new document at each of a row's `starts`."""
    doc = torch.zeros(2, length, dtype=torch.long)
    for row, where in enumerate(starts):
        for p in where:
            doc[row, p:] += 1
    return doc


# mask, per-token inputs, T, L, keys no query of the call may see (NaN in k and v)
SKIPPED = {
    "chunks": ("kv_pos <= q_pos and q_pos // 16 == kv_pos // 16", {}, 3, 60, (0, 48)),
    "documents": ("kv_pos <= q_pos and doc[q_pos] == doc[kv_pos]",
                  {"doc": documents(60, [[20, 40], [20, 40]])}, 5, 60, (0, 32)),
    "dilated": ("kv_pos <= q_pos and q_pos - kv_pos < 3 * 2 and (q_pos - kv_pos) % 2 == 0",
                {}, 3, 60, (0, 48)),
    # live tiles apart: the first keys, and the window's
    "window-and-first": ("kv_pos <= q_pos and (q_pos - kv_pos < 8 or kv_pos < 4)", {}, 3, 60,
                         (16, 48)),
}


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
@pytest.mark.parametrize("case", list(SKIPPED))
def test_empty_tiles_are_never_read(case: str, kernel: str, kernel_dir: Path,
                                    small_tiles: None) -> None:
    mask, tokens, t, length, (lo, hi) = SKIPPED[case]
    clean = {**qkv(t, length, 7), **tokens}
    poisoned = dict(clean)
    for n in "kv":
        poisoned[n] = clean[n].clone()
        poisoned[n][:, :, lo:hi] = float("nan")
    check_op(program({"mask": mask}, tokens, length, t), poisoned, t, length, kernel,
             kernel_dir, clean)


# a strict causal mask within documents: each document's first token sees no key, and
# averages every value as eager's finfo.min does — prefill; decode over three splits merged, a
# lone query the merge finds blind; and a lone busy split whose only tile is empty
STRICT = "kv_pos < q_pos and doc[q_pos] == doc[kv_pos]"
BLIND = [(STRICT, 21, 21, "prefill", [[7], [11, 19]]), (STRICT, 5, 37, "decode", [[34], [32, 35]]),
         (STRICT, 1, 37, "decode", [[36], [20]]), ("kv_pos < q_pos - 20", 1, 9, "decode", None)]


@pytest.mark.parametrize("mask,t,length,kernel,starts", BLIND, ids=lambda x: str(x))
def test_a_row_that_sees_no_key_averages_every_value(mask: str, t: int, length: int,
                                                    kernel: str, starts: list | None,
                                                    kernel_dir: Path, small_tiles: None) -> None:
    tokens = {"doc": documents(length, starts)} if starts else {}
    check_op(program({"mask": mask}, tokens, length, t), {**qkv(t, length, 3), **tokens}, t,
             length, kernel, kernel_dir)


def test_padding_hides_a_whole_sequence(kernel_dir: Path, small_tiles: None) -> None:
    """An encoder's padding mask (the shorthand, as an expression): keys missing in the middle
    of one sequence, all of the other's."""
    pad = torch.ones(2, 21, dtype=torch.long)
    pad[0, 5:9] = 0
    pad[1] = 0
    check_op(program({"padding": True}, {"padding": pad}, 21, 21, name="encoder"),
             {**qkv(21, 21, 5), "padding": pad}, 21, 21, "prefill", kernel_dir)


# ---- whole models ---------------------------------------------------------------------------

def test_alibi_slopes_from_a_checkpoint_on_triton() -> None:
    shorthand, explicit = alibi_rewritten("tiny-bloom")
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    assert close(explicit.compile("triton")(ids), shorthand.compile("eager")(ids))


def test_packed_documents_alibi_and_sinks_prefill_then_decode() -> None:
    """tiny-smollm2 with packed documents, ALiBi as a score and sinks: a prompt of 6 tokens,
    then one token a step, each with its document id, on Triton against eager's whole
    forward."""
    model = archc.from_spec(from_dict(smollm2(PACKED)))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    doc = doc_of(11)
    want = model.compile("eager")(ids, inputs={"doc": doc})
    s = model.compile("triton").session
    s.reset()
    steps = [s.step(ids[:, :6], inputs={"doc": doc[:, :6]})]
    for n in range(6, 11):
        steps.append(s.step(ids[:, n:n + 1], inputs={"doc": doc[:, n:n + 1]}))
    assert close(torch.cat(steps, dim=1), want)


def expression_spec(tmp_path: Path, name: str, attention: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(smollm2(attention, name=name)))
    return str(path)


def test_paged_triton_runs_the_expressions(tmp_path: Path) -> None:
    """The paged engine's Triton steps give the contiguous cache's logits with ALiBi slopes,
    sinks and a window written as expressions."""
    from tests.test_paged import check_against_contiguous
    attention = {key: PACKED[key] for key in ("score", "params", "normalizer")}
    attention["mask"] = "kv_pos <= q_pos and q_pos - kv_pos < 5"
    check_against_contiguous(expression_spec(tmp_path, "paged-expressions", attention),
                             "triton")


RING = {
    # sinks in the first block's state, chunks of 5 across the ranks' slices
    "sinks-alibi-chunks": {"mask": "kv_pos <= q_pos and q_pos // 5 == kv_pos // 5",
                           **{key: PACKED[key] for key in ("score", "params", "normalizer")}},
    # the first token sees no key, and no query sees the other rank's block: that block's
    # tiles are skipped, then visited for the first token
    "first-keys-strict": {"mask": "kv_pos < q_pos and kv_pos < 3"}}


@pytest.mark.parametrize("case", list(RING))
def test_ring_triton_runs_the_expressions(case: str, tmp_path: Path) -> None:
    """cp = 2 over 20 tokens: each rank's zig-zag queries against both blocks."""
    from tests.test_ring_triton import check_spec
    assert set(check_spec(expression_spec(tmp_path, case, RING[case]), 2, 20, tmp_path,
                          decode=1)) == {10}
