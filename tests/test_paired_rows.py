"""Paired-adjacent weight rows: a projection whose epilogue pairs columns (GLU, RoPE) with its
weight rows permuted so partners are neighbours (fused_linear's `paired`) runs one accumulator
and splits it in registers; it agrees with eager, and eager of the permuted program equals eager
of the original one (the permutation is exact).

Under Triton's interpreter in f32; column tiles are capped so every case spans several tiles (a
misplaced tile boundary shows), and the decode case is run split-K.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from archc.codegen import blocks
from archc.errors import IRError
from archc.ir import format_program, parse_program
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder, Program
from archc.ir.ops import Op
from archc.ir.ops.steps import pair_order
from archc.ir.paramexpr import PARAM_FNS, rope_cos_sin, rope_inv_freq, rope_pair_order
from archc.ir.shapes import B, T, shape
from archc.ir.verify import verify_graph
from archc.runtime.eager import EagerContext, KVCache, run_graph
from tests.test_splitk import SplitK
from tests.test_triton_kernels import check, rand

D = 24   # K: not a multiple of the interpreter's K block


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(params=["pointers", "tma"])
def narrow(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column tiles of at most 32 weight rows (16 pairs): several tiles per projection; the K
    loop's tiles loaded through pointers, or through tensor descriptors (TMA = 1, which the
    interpreter runs too)."""
    config = blocks.launch_config

    def capped(family: str, target: str, **sizes: int) -> dict:
        cfg = config(family, target, **sizes)
        if family == "matmul":
            cfg["BLOCK_N"] = max(min(cfg["BLOCK_N"], 32), sizes.get("align", 16))
            cfg["TMA"] = int(request.param == "tma")
        return cfg

    monkeypatch.setattr(blocks, "launch_config", capped)


def call(name: str, /, **kw: object) -> Call:
    return Call(name, (), tuple(sorted(kw.items())))


def rope_step(heads: int, hd: int, rot: int, interleaved: bool) -> Call:
    return call("rope", heads=heads, head_dim=hd, rotary_dim=rot, interleaved=interleaved)


def graph(steps: tuple[Call, ...], n: int, extra: dict[str, tuple], *, paired: bool,
          prologue: str | None = None, d: int = D) -> Graph:
    """y = fused_linear(x [B, T, d], w [n, d], *extra) with `steps`, paired or not."""
    b = GraphBuilder("decoder")
    x = b.input("x", shape(B, T, d), "f32")
    w = b.input("w", shape(n, d), "f32")
    rest = [b.input(k, s, dt) for k, (s, dt) in extra.items()]
    y = b.emit(Op.FUSED_LINEAR, x, w, *rest, epilogue=steps, prologue=prologue,
               eps=1e-5 if prologue else None, paired=True if paired else None)
    b.output("y", y)
    g = b.build()
    verify_graph(g)
    return g


def run_case(kernel_dir: Path, steps: tuple[Call, ...], n: int, extra: dict[str, tuple],
             values: dict[str, torch.Tensor], dims: dict[str, int], *,
             prologue: str | None = None, past_kv: dict | None = None) -> None:
    """The paired program (weight rows permuted) against eager, and its eager value against the
    unpaired program's on the original weight."""
    w = values["w"]
    order = pair_order(steps, n)
    assert sorted(order) == list(range(n))   # a permutation
    permuted = {**values, "w": w[order]}
    plain, paired = (graph(steps, n, extra, paired=p, prologue=prologue, d=w.shape[1])
                     for p in (False, True))

    def eager(g: Graph, vals: dict[str, torch.Tensor]) -> torch.Tensor:
        cache = KVCache(64)
        for (layer, kind), past in (past_kv or {}).items():
            EagerContext({**dims, "T": past.shape[2], "P": 0}, cache).cache_append(layer, kind,
                                                                                    past)
        return run_graph(g, {}, vals, EagerContext(dims, cache))["y"]

    torch.testing.assert_close(eager(paired, permuted), eager(plain, values), rtol=1e-6,
                               atol=1e-6)
    check(paired, permuted, dims, kernel_dir, past_kv=past_kv)


def rope_inputs(t: int, rot: int, past: int = 0) -> tuple[dict[str, tuple], dict]:
    table = rope_cos_sin(rope_inv_freq(dim=rot, theta=10000.0), rows=past + t + 1)
    return ({"pos": (shape(T), "i64"), "table": (shape(*table.shape), "f32")},
            {"pos": torch.arange(past, past + t), "table": table})


# ---- the permutations -------------------------------------------------------------------------

@pytest.mark.parametrize("width,heads,hd,rot,interleaved", [
    (128, 8, 16, 16, False), (96, 6, 16, 8, True), (100, 4, 20, 8, False), (61, 2, 16, 16, False),
    (64, 4, 16, 16, True)])
def test_rope_pair_order_is_a_permutation_of_partners(width: int, heads: int, hd: int, rot: int,
                                                      interleaved: bool) -> None:
    """Each column once; rotary partners side by side as rope() rotates them (interleaved: 2j,
    2j + 1; half-split: j, j + rot/2 of the same head)."""
    order = rope_pair_order(width, heads, hd, rot, interleaved)
    assert sorted(order) == list(range(width))
    for h in range(heads):
        for j in range(rot // 2):
            first = h * hd + (2 * j if interleaved else j)
            second = first + (1 if interleaved else rot // 2)
            at = order.index(first)
            assert at % 2 == 0 and order[at + 1] == second
    rows = torch.arange(width * 3, dtype=torch.float32).reshape(width, 3)
    permuted = PARAM_FNS["rope_pairs"](rows, heads=heads, head_dim=hd, rotary_dim=rot,
                                       interleaved=interleaved)
    assert torch.equal(permuted, rows[order])


def test_glu_order_is_the_interleave_param_function() -> None:
    rows = torch.arange(20, dtype=torch.float32)[:, None]
    order = pair_order((call("glu", fn="silu"),), 20)
    assert torch.equal(PARAM_FNS["interleave"](rows), rows[order])


def test_paired_needs_a_pairing_step() -> None:
    with pytest.raises(IRError, match="paired weight rows need exactly one glu"):
        graph((call("bias"),), 8, {"bias": (shape(8), "f32")}, paired=True)


def test_a_dense_glu_is_not_marked_interleaved() -> None:
    """Interleaved glu rows are the experts' marking; a dense projection says paired=true (the
    matmul template reads only that), so the other marking is refused, never half-honoured."""
    with pytest.raises(IRError, match="interleaved=true"):
        graph((call("glu", fn="silu", interleaved=True),), 8, {}, paired=False)


def test_paired_prints_and_parses_back() -> None:
    g = graph((call("glu", fn="silu"),), 8, {}, paired=True)
    text = format_program(Program("m", (g,)))
    assert "paired=true" in text
    assert parse_program(text) == Program("m", (g,))


# ---- kernels against eager ----------------------------------------------------------------------

@pytest.mark.parametrize("rows", [7, 21])
def test_glu_one_accumulator(kernel_dir: Path, narrow: None, rows: int) -> None:
    """Folded RMSNorm, GLU of 23 pairs (odd: the last tile is partial), bias, residual."""
    n = 2 * 23
    steps = (call("rms_scale"), call("glu", fn="silu"), call("bias"), call("residual"))
    extra = {"bias": (shape(n // 2), "f32"), "r": (shape(B, T, n // 2), "f32")}
    values = {"x": rand(3, rows, D), "w": rand(n, D) / D ** 0.5, "bias": rand(n // 2),
              "r": rand(3, rows, n // 2)}
    run_case(kernel_dir, steps, n, extra, values, {"B": 3, "T": rows, "P": 0}, prologue="rms")


@pytest.mark.parametrize("interleaved,rot,hd,tail", [
    (False, 16, 16, 0), (True, 8, 16, 0), (False, 8, 20, 0), (False, 16, 16, 7),
    (True, 16, 16, 10)])
def test_rope_kv_write_one_accumulator(kernel_dir: Path, narrow: None, interleaved: bool,
                                       rot: int, hd: int, tail: int) -> None:
    """RoPE over q and k heads (half-split, interleaved partial, half-split partial on head_dim
    20, an odd and an even tail past the heads), the cache write of k and v, a past of 3."""
    heads, kv_heads, t, past = 4, 2, 5, 3
    width = (heads + 2 * kv_heads) * hd + tail
    steps = (rope_step(heads + kv_heads, hd, rot, interleaved),
             call("kv_write", head_dim=hd, k_start=heads * hd, kv_heads=kv_heads, layer=1,
                  v_start=(heads + kv_heads) * hd))
    extra, vals = rope_inputs(t, rot, past)
    run_case(kernel_dir, steps, width, extra, {"x": rand(2, t, D), "w": rand(width, D), **vals},
             {"B": 2, "T": t, "P": past},
             past_kv={(1, "k"): rand(2, kv_heads, past, hd, seed=1),
                      (1, "v"): rand(2, kv_heads, past, hd, seed=2)})


@pytest.mark.parametrize("kind,hd", [("rms", 16), ("layer", 20)])
def test_qk_norm_then_rope_one_accumulator(kernel_dir: Path, narrow: None, kind: str,
                                           hd: int) -> None:
    """QK-norm over the q and k heads (a power-of-two head, and head-aligned tiles for 20),
    then RoPE and the cache write."""
    heads, kv_heads, t = 4, 2, 5
    normed = (heads + kv_heads) * hd
    width = normed + kv_heads * hd
    steps = (call("head_norm", eps=1e-6, head_dim=hd, heads=heads + kv_heads, kind=kind),
             rope_step(heads + kv_heads, hd, hd, False),
             call("kv_write", head_dim=hd, k_start=heads * hd, kv_heads=kv_heads, layer=0,
                  v_start=normed))
    extra, vals = rope_inputs(t, hd)
    extra = {"gain": (shape(normed), "f32"), "shift": (shape(normed), "f32"), **extra}
    run_case(kernel_dir, steps, width, extra,
             {"x": rand(2, t, D), "w": rand(width, D), "gain": 1 + 0.1 * rand(normed),
              "shift": 0.1 * rand(normed, seed=1), **vals}, {"B": 2, "T": t, "P": 0})


@pytest.mark.parametrize("pairing", ["glu", "rope"])
def test_split_k_decode_one_accumulator(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                        pairing: str) -> None:
    """A decode row split-K: each split's slot holds the one accumulator; the last arrival adds
    them and splits it for the epilogue."""
    forced = SplitK(monkeypatch, splits=3)
    d, t = 48, 1
    if pairing == "glu":
        n, steps = 40, (call("rms_scale"), call("glu", fn="gelu_tanh"))
        extra, vals = {}, {}
    else:
        n, steps = 64, (rope_step(3, 16, 8, True),)
        extra, vals = rope_inputs(t, 8, 4)
    run_case(kernel_dir, steps, n, extra, {"x": rand(2, t, d), "w": rand(n, d), **vals},
             {"B": 2, "T": t, "P": 4}, prologue="rms" if pairing == "glu" else None)
    assert forced.split_configs and all(c["SPLIT_K"] == 3 for c in forced.split_configs)
    assert all(not torch.isnan(p).any() for p in forced.parts)
    assert all(int(c.abs().sum()) == 0 for c in forced.counters)
