"""Prefill attention's grid and load paths.

- The query blocks run heaviest first: the stores of every program are recorded under Triton's
  interpreter, and, taken in the order a GPU launches programs (grid axis 0 fastest), the query
  blocks they write go from the last to the first, each (head, block) once, every output
  element written exactly once.
- Tensor descriptors (TMA) only where the layout allows: a q slice that starts off a 16-byte
  boundary keeps the pointer path, an aligned one gets descriptors; both agree with eager
  (the descriptor path forced: its default is pointers under the interpreter).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sympy

from archc.codegen import blocks
from archc.codegen.build import CodegenOptions, _multiple_of
from archc.codegen.render import generate
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder, Program
from archc.ir.ops import Op
from archc.ir.shapes import B, S, T, shape
from tests.test_triton_kernels import DEVICE, build, check, force_tma, rand


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def attention_graph(heads: int, kv_heads: int, hd: int, q_offset: int, causal: bool) -> Graph:
    """Attention over q, k, v sliced from two projections: q from column `q_offset` of one."""
    width = heads * hd

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        q = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["qp"], start=q_offset,
                                          stop=q_offset + width), heads=heads)
        k = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["kvp"], start=0, stop=kv_heads * hd),
                   heads=kv_heads)
        v = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["kvp"], start=kv_heads * hd,
                                          stop=2 * kv_heads * hd), heads=kv_heads)
        return b.emit(Op.ATTENTION, q, k, v, scale=0.3, causal=causal, padding=False,
                      prefix=False)

    return build({"qp": (shape(B, T, width + q_offset), "f32"),
                  "kvp": (shape(B, S, 2 * kv_heads * hd), "f32")}, fn)


def small_blocks(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """Prefill attention at `block` queries × `block` keys: short sequences then span several
    blocks, some of them seen in full (no mask) by a tile's queries."""
    real = blocks.launch_config

    def config(family: str, target: str, **sizes: int) -> dict:
        cfg = real(family, target, **sizes)
        if family == "attention":
            cfg.update(BLOCK_M=block, BLOCK_N=block)
        return cfg

    monkeypatch.setattr(blocks, "launch_config", config)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_unmasked_blocks_scale_scores_in_the_exponent(kernel_dir: Path, causal: bool, tma: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """16 × 16 tiles over 37 queries: the blocks below a causal diagonal (every block without
    a mask) take the raw scores' max times the scale, and exp2(qk·scale − m) in one FMA; the
    diagonal and edge blocks scale first and mask. Both must agree with eager, on both load
    paths."""
    if tma:
        force_tma(monkeypatch)
    small_blocks(monkeypatch, 16)
    g = attention_graph(2, 1, 16, 8, causal=causal)
    values = {"qp": rand(2, 37, 40), "kvp": 3 * rand(2, 37, 32, seed=1)}
    check(g, values, {"B": 2, "T": 37, "P": 0, "S": 37}, kernel_dir, decode_max_rows=0)


@pytest.mark.parametrize("tma", [False, True])
def test_prefill_over_a_cached_past(kernel_dir: Path, tma: bool,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of 21 tokens after 11 cached ones, read from the KV cache (its K and V tiles
    through descriptors over the cache's live P + T rows), the prefill kernel at 16 × 16 tiles:
    full blocks over the past, masked ones on the diagonal."""
    if tma:
        force_tma(monkeypatch)
    small_blocks(monkeypatch, 16)
    heads, kv_heads, hd, d, t, past = 4, 2, 16, 24, 21, 11
    width = (heads + 2 * kv_heads) * hd

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        qkv = b.emit(Op.FUSED_LINEAR, i["x"], i["w"], epilogue=(
            Call("kv_write", (), (("head_dim", hd), ("k_start", heads * hd),
                                  ("kv_heads", kv_heads), ("layer", 0),
                                  ("v_start", (heads + kv_heads) * hd))),))
        q = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, qkv, start=0, stop=heads * hd), heads=heads)
        return b.emit(Op.ATTENTION, q, cache_layer=0, kv_heads=kv_heads, scale=hd ** -0.5,
                      causal=True, padding=False, prefix=False)

    g = build({"x": (shape(B, T, d), "f32"), "w": (shape(width, d), "f32")}, fn)
    check(g, {"x": rand(2, t, d), "w": rand(width, d)}, {"B": 2, "T": t, "P": past},
          kernel_dir, decode_max_rows=0,
          past_kv={(0, "k"): rand(2, kv_heads, past, hd, seed=1),
                   (0, "v"): rand(2, kv_heads, past, hd, seed=2)})


@pytest.mark.skipif(DEVICE != "cpu", reason="records the stores of Triton's interpreter")
def test_query_blocks_run_heaviest_first_each_once(kernel_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter

    heads, hd, t, block = 2, 16, 37, 16        # 3 query blocks, the last one short

    stores: list[tuple[tuple[int, int], tuple[int, int], np.ndarray]] = []
    store = interpreter.InterpreterBuilder.create_masked_store

    def record(self, ptrs, value, mask, cache_policy):  # noqa: ANN001, ANN202
        stores.append((tuple(self.grid_idx[:2]), tuple(self.grid_dim[:2]),
                       ptrs.data[mask.data].copy()))
        return store(self, ptrs, value, mask, cache_policy)

    small_blocks(monkeypatch, block)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", record)
    g = attention_graph(heads, 1, hd, 8, causal=True)
    values = {"qp": rand(2, t, heads * hd + 8), "kvp": rand(2, t, 2 * hd, seed=1)}
    dims = {"B": 2, "T": t, "P": 0, "S": t}
    check(g, values, dims, kernel_dir, decode_max_rows=0)
    # the graph launches the prefill kernel only (slices and head splits are views); it
    # stores nothing but its output
    grid = {dim for _, dim, _ in stores}
    assert grid == {(2 * heads, 3)}, grid
    gx = 2 * heads
    addrs = np.concatenate([a for _, _, a in stores])
    base = addrs.min()
    assert ((addrs - base) % 4 == 0).all()
    # every element of the [B, T, H·D] f32 output exactly once
    elems = (addrs - base) // 4
    assert len(elems) == 2 * t * heads * hd and len(np.unique(elems)) == len(elems)
    assert elems.max() == 2 * t * heads * hd - 1
    # the query block of each program, in the GPU's launch order: axis 0 (batch × head) fastest
    written: dict[tuple[int, int], set[int]] = {}
    for (x, y), _, a in stores:
        rows = ((a - base) // 4) // (heads * hd)
        b, query = rows // t, rows % t
        head = ((a - base) // 4) % (heads * hd) // hd
        assert len(set(b * heads + head)) == 1 and int((b * heads + head)[0]) == x
        written.setdefault((x, y), set()).update(int(q) // block for q in query)
    assert all(len(v) == 1 for v in written.values())
    order = sorted(written, key=lambda p: p[1] * gx + p[0])
    launched = [next(iter(written[p])) for p in order]
    assert launched == sorted(launched, reverse=True) and launched[0] == 2
    assert sorted((p[0], next(iter(written[p]))) for p in written) == [
        (x, m) for x in range(gx) for m in range(3)]


@pytest.mark.parametrize("q_offset,aligned", [(8, True), (1, False), (6, False)])
def test_descriptors_only_where_the_layout_is_aligned(kernel_dir: Path, q_offset: int,
                                                      aligned: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """f32: q's columns start q_offset·4 bytes into each row, and rows are (64 + q_offset)·4
    bytes apart: 16-byte aligned only at offset 8."""
    g = attention_graph(4, 2, 16, q_offset, causal=True)
    gen = generate(Program(g.name, (g,)), CodegenOptions(max_seq_len=64))
    unit = next(u for u in gen.units if u.family == "attention")
    text = gen.unit_text(unit.name)
    assert ("tl.make_tensor_descriptor" in text) == aligned
    assert ("not 16-byte aligned" in text) == (not aligned)
    values = {"qp": rand(2, 21, 64 + q_offset), "kvp": rand(2, 21, 64, seed=1)}
    if aligned:
        force_tma(monkeypatch)
    check(g, values, {"B": 2, "T": 21, "P": 0, "S": 21}, kernel_dir, decode_max_rows=0)


def test_multiple_of_holds_at_every_value_of_the_dims() -> None:
    t, s = sympy.symbols("T S", integer=True, positive=True)
    assert _multiple_of(72 * t + 8, 4)
    assert _multiple_of(0, 4) and _multiple_of(sympy.Integer(64), 16)
    assert not _multiple_of(72 * t + 2, 4)
    assert not _multiple_of(3 * t * s, 4)          # 12 at T = 2, S = 2, not at T = S = 1
    assert not _multiple_of(sympy.floor(t / 2) * 8, 4)   # not a polynomial: not proven


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b"])
def test_hopper_prefill_runs_both_products_at_m64n128(name: str, tmp_path: Path) -> None:
    """The ahead-of-time compile for sm_90a at the launch configuration of a full-size prefill:
    128×128 tiles, QKᵀ and PV both at wgmma m64n128k16 (no narrower shape), Q, K and V through
    TMA, no spills."""
    from archc.codegen.aot import compile_module
    from archc.codegen.render import write_module
    from archc.ir.lower import lower
    from archc.passes import optimize
    from archc.spec import load_spec

    spec = load_spec(name)
    gen = generate(optimize(lower(spec, "bf16")),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    path = write_module(gen, tmp_path / name)
    [r] = compile_module(path, "sm_90a", jobs=1, kernels=["attention_0_prefill"])
    assert r.ok, r.error
    assert "BLOCK_M=128, BLOCK_N=128" in r.config and "TMA=1" in r.config, r.config
    assert r.wgmma == ["m64n128k16"], r.wgmma
    assert r.tma and r.spill_bytes == 0, (r.tma, r.spill_bytes)
