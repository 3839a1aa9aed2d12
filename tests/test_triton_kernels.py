"""Each template, rendered from hand-built kernel-level nodes, agrees with the eager interpreter.

Odd shapes on purpose: widths that are not multiples of any block, 9 query heads over 3 KV heads,
head_dim 80, sequences longer than the sliding window, padding that hides keys in the middle of
blocks, partial rotary dims. Without a GPU the kernels run under Triton's interpreter.

Tolerances, relative to the output's largest magnitude:
- f32 (1e-5): both sides accumulate in f32, in different orders; a few ulps of the scale.
- f16 (2e-3): inputs and outputs are rounded to f16 (2^-11 ≈ 4.9e-4 relative) on both sides, and
  an intermediate rounding (p·v with p in f16) may differ by an ulp more.
- bf16 (1.6e-2, GPU only): 2^-8 ≈ 3.9e-3 per rounding, same reasoning.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from archc.codegen import blocks
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder
from archc.ir.ops import Op
from archc.ir.paramexpr import rope_cos_sin, rope_inv_freq
from archc.ir.shapes import B, S, T, shape
from archc.ir.verify import verify_graph
from archc.runtime.eager import EagerContext, KVCache, run_graph
from tests.triton_graph import run_graph_triton

TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["f32", "f16"] if DEVICE == "cpu" else ["f32", "f16", "bf16"]
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def rand(*dims: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*dims, generator=torch.Generator().manual_seed(seed + 7 * len(dims)))


Build = Callable[[GraphBuilder, dict[str, int]], int]


def build(inputs: dict[str, tuple[tuple, str]], fn: Build, name: str = "decoder") -> Graph:
    b = GraphBuilder(name)
    ids = {k: b.input(k, spec[0], spec[1]) for k, spec in inputs.items()}
    b.output("y", fn(b, ids))
    g = b.build()
    verify_graph(g)
    return g


def check(g: Graph, values: dict[str, torch.Tensor], dims: dict[str, int], kernel_dir: Path,
          *, dtype: str = "f32", past_kv: dict[tuple[int, str], torch.Tensor] | None = None,
          decode_max_rows: int | None = None) -> None:
    """Eager and triton on the same graph and values: outputs and KV caches agree."""
    cast = {k: (v.to(TORCH[dtype]) if v.is_floating_point() else v) for k, v in values.items()}
    cache = KVCache(64)
    for (layer, kind), past in (past_kv or {}).items():
        EagerContext({**dims, "T": past.shape[2], "P": 0}, cache).cache_append(
            layer, kind, past.to(TORCH[dtype]))
    ref = run_graph(g, {}, cast, EagerContext(dims, cache))["y"]
    run = run_graph_triton(g, {}, cast, dims, past_kv=past_kv, max_seq_len=64, device=DEVICE,
                           cache_dir=kernel_dir, decode_max_rows=decode_max_rows)
    out = run.outputs["y"].cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.float().abs().max()
    err = (out.float() - ref.float()).abs().max()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} at scale {scale:.3g}"
    for key, want in cache.store.items():
        length = dims["P"] + dims["T"]
        got = run.cache.get(*key)[:, :, :length].cpu().float()
        cerr = (got - want[:, :, :length].float()).abs().max()
        assert cerr <= TOL[dtype] * want.float().abs().max(), f"cache {key}: error {cerr:.3g}"


# ---- fused_linear --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rms_prologue_glu_bias_residual(kernel_dir: Path, dtype: str) -> None:
    check_rms_prologue_glu_bias_residual(kernel_dir, dtype)


def check_rms_prologue_glu_bias_residual(kernel_dir: Path, dtype: str) -> None:
    """Folded RMSNorm, the GLU pair, a bias and the residual in one kernel (also run split-K)."""
    k, n = 40, 2 * 23  # K not a multiple of 16; 23 output columns

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["bias"], i["r"], prologue="rms",
                      eps=1e-5, epilogue=(Call("rms_scale"), Call("glu", (), (("fn", "silu"),)),
                                          Call("bias"), Call("residual")))

    g = build({"x": (shape(B, T, k), dtype), "w": (shape(n, k), dtype),
               "bias": (shape(n // 2), dtype), "r": (shape(B, T, n // 2), dtype)}, fn)
    check(g, {"x": rand(3, 7, k), "w": rand(n, k) / k ** 0.5, "bias": rand(n // 2),
              "r": rand(3, 7, n // 2)}, {"B": 3, "T": 7, "P": 0}, kernel_dir, dtype=dtype)


def layernorm_activations(fn_name: str) -> Callable[[GraphBuilder, dict[str, int]], int]:
    """A fused_linear of x, w with a LayerNorm prologue (colsum, bias), then activation
    `fn_name` over columns 5..30, a soft-cap and a scale: every kind of epilogue step at once."""
    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["colsum"], i["bias"], prologue="layer",
                      eps=1e-5, epilogue=(Call("ln_scale"), Call("bias"),
                                          Call("act", (), (("fn", fn_name), ("start", 5),
                                                           ("stop", 30))),
                                          Call("softcap", (), (("cap", 3.0),)),
                                          Call("scale", (), (("by", 0.5),))))
    return fn


@pytest.mark.parametrize("fn_name", ["gelu", "gelu_tanh", "relu", "sigmoid"])
def test_matmul_layernorm_prologue_and_activations(kernel_dir: Path, fn_name: str) -> None:
    k, n = 24, 37

    fn = layernorm_activations(fn_name)

    w = rand(n, k)
    g = build({"x": (shape(B, T, k), "f32"), "w": (shape(n, k), "f32"),
               "colsum": (shape(n), "f32"), "bias": (shape(n), "f32")}, fn)
    check(g, {"x": 2 + rand(2, 5, k), "w": w, "colsum": w.sum(1), "bias": rand(n)},
          {"B": 2, "T": 5, "P": 0}, kernel_dir)


@pytest.mark.parametrize("interleaved,rot,hd", [(False, 16, 16), (True, 8, 16), (False, 8, 20)])
def test_matmul_rope_kv_write_then_cached_attention(kernel_dir: Path, interleaved: bool, rot: int,
                                                    hd: int) -> None:
    """QKV with RoPE (full, interleaved partial, half-split partial on head_dim 20) and the cache
    write in the epilogue, then attention over the cache with a past of 3 tokens."""
    heads, kv_heads, d, t, past = 6, 2, 24, 5, 3
    width = (heads + 2 * kv_heads) * hd
    # a table with an attention scale (YaRN's mscale), one row past the last position
    table = rope_cos_sin(rope_inv_freq(dim=rot, theta=10000.0), rows=past + t + 1, mscale=1.25)

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        qkv = b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["pos"], i["table"], epilogue=(
            Call("rope", (), (("heads", heads + kv_heads), ("head_dim", hd),
                              ("interleaved", interleaved), ("rotary_dim", rot))),
            Call("kv_write", (), (("head_dim", hd), ("k_start", heads * hd),
                                  ("kv_heads", kv_heads), ("layer", 1),
                                  ("v_start", (heads + kv_heads) * hd)))))
        q = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, qkv, start=0, stop=heads * hd), heads=heads)
        return b.emit(Op.ATTENTION, q, cache_layer=1, kv_heads=kv_heads, scale=hd ** -0.5,
                      causal=True, padding=False, prefix=False, window=4)

    g = build({"x": (shape(B, T, d), "f32"), "w": (shape(width, d), "f32"),
               "pos": (shape(T), "i64"), "table": (shape(*table.shape), "f32")}, fn)
    check(g, {"x": rand(2, t, d), "w": rand(width, d), "pos": torch.arange(past, past + t),
              "table": table}, {"B": 2, "T": t, "P": past}, kernel_dir,
          past_kv={(1, "k"): rand(2, kv_heads, past, hd, seed=1),
                   (1, "v"): rand(2, kv_heads, past, hd, seed=2)})


@pytest.mark.parametrize("kind,interleaved,rot,hd,unit_offset", [
    ("rms", False, 10, 10, False), ("rms", True, 8, 12, True), ("layer", False, 6, 10, False)])
def test_norm_over_spans_rope_kv_write_then_cached_attention(
        kernel_dir: Path, kind: str, interleaved: bool, rot: int, hd: int,
        unit_offset: bool) -> None:
    """A QK-norm over the whole q and k projections (OLMo 2): one norm over a QKV row, q's and
    k's columns each on their own statistics, v passed through; then (a LayerNorm's shift, which
    the rotated partners must see too) RoPE — half-split, interleaved partial, half-split
    partial — and the cache write; then attention over the cache with a past of 3 tokens."""
    heads, kv_heads, t, past = 6, 2, 5, 3
    width = (heads + 2 * kv_heads) * hd
    normed = (heads + kv_heads) * hd
    table = rope_cos_sin(rope_inv_freq(dim=rot, theta=10000.0), rows=past + t + 1)
    bias = kind == "layer"

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        shift = [i["shift"]] if bias else []
        qkv = b.emit(Op.NORM, i["x"], i["g"], *shift, i["pos"], i["table"], kind=kind,
                     eps=1e-6, unit_offset=unit_offset, spans=(heads * hd, kv_heads * hd),
                     epilogue=(*((Call("bias"),) if bias else ()), Call("rope", (), (
                         ("heads", heads + kv_heads), ("head_dim", hd),
                         ("interleaved", interleaved), ("rotary_dim", rot))),
                         Call("kv_write", (), (("head_dim", hd), ("k_start", heads * hd),
                                               ("kv_heads", kv_heads), ("layer", 0),
                                               ("v_start", normed)))))
        q = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, qkv, start=0, stop=heads * hd), heads=heads)
        return b.emit(Op.ATTENTION, q, cache_layer=0, kv_heads=kv_heads, scale=hd ** -0.5,
                      causal=True, padding=False, prefix=False)

    g = build({"x": (shape(B, T, width), "f32"), "g": (shape(normed), "f32"),
               "shift": (shape(width), "f32"), "pos": (shape(T), "i64"),
               "table": (shape(*table.shape), "f32")}, fn)
    # q's columns larger than k's: one statistic over the row would be visibly wrong
    x = rand(2, t, width) * torch.cat([torch.full((heads * hd,), 3.0),
                                       torch.ones(width - heads * hd)])
    check(g, {"x": x + 0.5, "g": 1 + 0.3 * rand(normed), "shift": rand(width, seed=5),
              "pos": torch.arange(past, past + t), "table": table},
          {"B": 2, "T": t, "P": past}, kernel_dir,
          past_kv={(0, "k"): rand(2, kv_heads, past, hd, seed=1),
                   (0, "v"): rand(2, kv_heads, past, hd, seed=2)})


def test_matmul_concat_k_operands(kernel_dir: Path) -> None:
    check_concat_k_operands(kernel_dir)


def check_concat_k_operands(kernel_dir: Path) -> None:
    """A K loop over two inputs (the concatenation never materialized) and a residual."""
    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["a"], i["h"], i["w"], i["r"], concat_k=True,
                      epilogue=(Call("residual"),))

    g = build({"a": (shape(B, T, 20), "f32"), "h": (shape(B, T, 36), "f32"),
               "w": (shape(9, 56), "f32"), "r": (shape(B, T, 9), "f32")}, fn)
    check(g, {"a": rand(2, 3, 20), "h": rand(2, 3, 36), "w": rand(9, 56), "r": rand(2, 3, 9)},
          {"B": 2, "T": 3, "P": 0}, kernel_dir)


# ---- attention -----------------------------------------------------------------------------

ATTENTION_CASES = [
    # heads, kv_heads, head_dim, T, keys, causal, window, padding, softcap, bias, prefix
    (4, 2, 16, 37, 37, True, None, False, None, None, False),
    (9, 3, 80, 7, 7, True, None, False, None, None, False),
    (4, 2, 16, 37, 37, True, 8, False, None, None, False),
    (4, 2, 16, 37, 37, False, 8, False, None, None, False),
    (4, 2, 16, 21, 21, False, None, True, None, "t5", False),
    (4, 2, 16, 21, 21, True, None, False, 5.0, "alibi", False),
    (4, 2, 16, 21, 21, True, None, False, None, "t5", False),
    (4, 2, 16, 21, 21, True, None, False, None, None, True),
    (4, 1, 16, 3, 11, False, None, True, None, None, False),    # cross-attention shape
    (4, 2, 16, 1, 37, True, 8, False, None, None, False),       # one new token over a past
    (4, 2, 16, 2, 37, True, 8, False, 3.0, "alibi", False),
    (9, 3, 80, 1, 20, True, None, False, None, None, False),
    (4, 1, 16, 3, 20, False, None, True, None, "t5", False),
    (4, 2, 16, 1, 20, True, None, False, None, None, True),
]


def force_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill attention reads its Q, K, V tiles through tensor descriptors (the GPU's load
    path; the interpreter's default is pointers). The build must have found the layout aligned:
    a kernel without the descriptor path would otherwise pass unseen on pointers."""
    real = blocks.launch_config

    def config(family: str, target: str, **sizes: int) -> dict:
        cfg = real(family, target, **sizes)
        if family == "attention":
            assert sizes["tma"], "the build found no tensor-descriptor path for this layout"
            cfg["TMA"] = 1
        return cfg

    monkeypatch.setattr(blocks, "launch_config", config)


@pytest.mark.parametrize("kernel", ["prefill", "prefill-tma", "decode"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention(kernel_dir: Path, case: tuple, kernel: str,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each case through both kernels: FlashAttention-2 tiles over the queries (both load paths:
    pointers and tensor descriptors), and split-KV decoding with the GQA group's heads as the
    rows of one tile."""
    if kernel == "prefill-tma":
        force_tma(monkeypatch)
    heads, kv_heads, hd, t, keys, causal, window, padding, softcap, bias, prefix = case
    width = heads * hd
    values = {"qp": rand(2, t, width + 8), "kvp": rand(2, keys, 2 * kv_heads * hd, seed=1)}
    inputs: dict[str, tuple[tuple, str]] = {"qp": (shape(B, T, width + 8), "f32"),
                                            "kvp": (shape(B, S, 2 * kv_heads * hd), "f32")}
    if padding:
        pad = torch.ones(2, keys, dtype=torch.long)
        pad[1, :3] = 0
        pad[0, keys // 2] = 0
        inputs["pad"], values["pad"] = (shape(B, S), "i64"), pad
    if prefix:
        inputs["prefix_len"], values["prefix_len"] = ((), "i64"), torch.tensor(3)
    bias_call = None
    if bias == "alibi":
        inputs["table"], values["table"] = (shape(heads), "f32"), rand(heads).abs()
        bias_call = Call("alibi")
    elif bias == "t5":
        inputs["table"], values["table"] = (shape(8, heads), "f32"), rand(8, heads)
        bias_call = Call("t5", (), (("bidirectional", not causal), ("max_distance", 16)))

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        # q, k, v are views into wider projections: read through strides and offsets
        q = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["qp"], start=8, stop=8 + width),
                   heads=heads)
        k = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["kvp"], start=0, stop=kv_heads * hd),
                   heads=kv_heads)
        v = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["kvp"], start=kv_heads * hd,
                                          stop=2 * kv_heads * hd), heads=kv_heads)
        extra = [i[name] for name in ("pad", "prefix_len", "table") if name in i]
        return b.emit(Op.ATTENTION, q, k, v, *extra, scale=0.3, causal=causal, padding=padding,
                      prefix=prefix, window=window, softcap=softcap, bias=bias_call)

    g = build(inputs, fn)
    check(g, values, {"B": 2, "T": t, "P": 0, "S": keys}, kernel_dir,
          decode_max_rows=1 << 20 if kernel == "decode" else 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_low_precision(kernel_dir: Path, dtype: str) -> None:
    heads, kv_heads, hd, t = 4, 2, 32, 19

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        q = b.emit(Op.SPLIT_HEADS, i["q"], heads=heads)
        k = b.emit(Op.SPLIT_HEADS, i["k"], heads=kv_heads)
        v = b.emit(Op.SPLIT_HEADS, i["v"], heads=kv_heads)
        return b.emit(Op.ATTENTION, q, k, v, scale=hd ** -0.5, causal=True, padding=False,
                      prefix=False)

    g = build({"q": (shape(B, T, heads * hd), dtype), "k": (shape(B, T, kv_heads * hd), dtype),
               "v": (shape(B, T, kv_heads * hd), dtype)}, fn)
    check(g, {"q": rand(2, t, heads * hd), "k": rand(2, t, kv_heads * hd, seed=1),
              "v": rand(2, t, kv_heads * hd, seed=2)}, {"B": 2, "T": t, "P": 0}, kernel_dir,
          dtype=dtype)


# ---- norm, pointwise, embedding -------------------------------------------------------------

@pytest.mark.parametrize("kind,where,unit_offset,bias", [
    ("rms", "before", False, False), ("rms", "after", True, False),
    ("layer", "before", False, True), ("layer", None, False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm(kernel_dir: Path, kind: str, where: str | None, unit_offset: bool, bias: bool,
              dtype: str) -> None:
    width = 50

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        args = [i["x"], i["g"]] + ([i["r"]] if where == "before" else [])
        steps = []
        if bias:                                      # the LayerNorm shift, then a residual
            args.append(i["b"])
            steps.append(Call("bias"))
        if where == "after":
            args.append(i["r"])
            steps.append(Call("residual"))
        return b.emit(Op.NORM, *args, kind=kind, eps=1e-6, unit_offset=unit_offset,
                      add_before=where == "before", epilogue=tuple(steps))

    g = build({"x": (shape(B, T, width), dtype), "g": (shape(width), dtype),
               "b": (shape(width), dtype), "r": (shape(B, T, width), dtype)}, fn)
    check(g, {"x": 1 + rand(2, 7, width), "g": 1 + 0.1 * rand(width), "b": rand(width, seed=3),
              "r": rand(2, 7, width, seed=4)}, {"B": 2, "T": 7, "P": 0}, kernel_dir,
          dtype=dtype)


def test_pointwise_broadcast_chain(kernel_dir: Path) -> None:
    x0, x1, x2 = Call("x", (0,)), Call("x", (1,)), Call("x", (2,))
    expr = Call("softcap", (Call("sub", (Call("scale", (Call("mul", (
        Call("act", (x0,), (("fn", "gelu"),)), x1)),), (("by", 0.5),)), x2)),), (("cap", 2.0),))

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        a = b.emit(Op.SLICE, i["a"], start=3, stop=3 + 33)  # a strided view as an input
        return b.emit(Op.POINTWISE, a, i["c"], i["v"], expr=expr)

    g = build({"a": (shape(B, T, 40), "f32"), "c": (shape(B, T, 33), "f32"),
               "v": (shape(33), "f32")}, fn)
    check(g, {"a": rand(2, 5, 40), "c": rand(2, 5, 33, seed=1), "v": rand(33, seed=2)},
          {"B": 2, "T": 5, "P": 0}, kernel_dir)


def test_embedding_gather(kernel_dir: Path) -> None:
    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.EMBEDDING, i["table"], i["ids"])

    g = build({"table": (shape(97, 72), "f32"), "ids": (shape(B, T), "i64")}, fn)
    check(g, {"table": rand(97, 72), "ids": torch.randint(0, 97, (3, 5))},
          {"B": 3, "T": 5, "P": 0}, kernel_dir)


# ---- mixture of experts ----------------------------------------------------------------------

@pytest.mark.parametrize("gated,act,top_k", [(True, "silu", 2), (False, "gelu", 3)])
def test_moe_router_and_grouped_experts(kernel_dir: Path, gated: bool, act: str,
                                        top_k: int) -> None:
    n_experts, d, f = 5, 24, 20
    rows = 2 * f if gated else f

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        gates = b.emit(Op.ROUTER, i["x"], i["wr"], top_k=top_k, normalize=gated)
        h = b.emit(Op.MOE_LINEAR, i["x"], gates, i["up"], stage="up", top_k=top_k,
                   epilogue=(Call("glu" if gated else "act", (), (("fn", act),)),))
        if not gated:                                  # the down stage's sum adds a residual
            return b.emit(Op.MOE_LINEAR, h, gates, i["down"], i["x"], stage="down",
                          top_k=top_k, epilogue=(Call("residual"),))
        return b.emit(Op.MOE_LINEAR, h, gates, i["down"], stage="down", top_k=top_k)

    g = build({"x": (shape(B, T, d), "f32"), "wr": (shape(n_experts, d), "f32"),
               "up": (shape(n_experts, rows, d), "f32"),
               "down": (shape(n_experts, d, f), "f32")}, fn)
    check(g, {"x": rand(3, 7, d), "wr": rand(n_experts, d, seed=1),
              "up": rand(n_experts, rows, d, seed=2) / d ** 0.5,
              "down": rand(n_experts, d, f, seed=3) / f ** 0.5}, {"B": 3, "T": 7, "P": 0},
          kernel_dir)


@pytest.mark.parametrize("kind,rope,hd", [("rms", True, 16), ("layer", True, 16),
                                          ("rms", False, 16), ("layer", False, 16),
                                          ("rms", True, 20), ("layer", True, 12),
                                          ("layer", False, 20), ("rms", False, 12)])
def test_matmul_head_norm(kernel_dir: Path, kind: str, rope: bool, hd: int,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """QK-norm in the epilogue: each of the first heads normalized over its head_dim columns
    (tiles hold whole heads: a reshape for a power-of-two head, head-aligned tiles with masked
    lanes for 20 or 12, with 6 pairs or 10 per head in each of RoPE's accumulators), then RoPE
    and the cache write when `rope`. Column tiles are capped at 64 so that heads span several
    tiles and a misplaced tile boundary shows."""
    from archc.codegen import blocks
    config = blocks.launch_config

    def narrow(family: str, target: str, **sizes: int) -> dict:
        cfg = config(family, target, **sizes)
        if family == "matmul":
            cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
        return cfg

    monkeypatch.setattr(blocks, "launch_config", narrow)
    check_head_norm(kernel_dir, kind, hd, rope)


def check_head_norm(kernel_dir: Path, kind: str, hd: int, rope: bool, d: int = 24,
                    t: int = 5) -> None:
    """QK-norm over the first 6 of 8 heads, then RoPE and the cache write when `rope`, against
    eager (also run split-K)."""
    heads, kv_heads = 4, 2
    normed = (heads + kv_heads) * hd
    width = normed + kv_heads * hd
    steps = [Call("head_norm", (), (("eps", 1e-6), ("head_dim", hd), ("heads", heads + kv_heads),
                                    ("kind", kind)))]
    if rope:
        steps += [Call("rope", (), (("heads", heads + kv_heads), ("head_dim", hd),
                                    ("interleaved", False), ("rotary_dim", hd))),
                  Call("kv_write", (), (("head_dim", hd), ("k_start", heads * hd),
                                        ("kv_heads", kv_heads), ("layer", 0),
                                        ("v_start", normed)))]

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        extra = [i["pos"], i["freq"]] if rope else []
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["gain"], i["shift"], *extra,
                      epilogue=tuple(steps))

    g = build({"x": (shape(B, T, d), "f32"), "w": (shape(width, d), "f32"),
               "gain": (shape(normed), "f32"), "shift": (shape(normed), "f32"),
               "pos": (shape(T), "i64"), "freq": (shape(t, 2, hd // 2), "f32")}, fn)
    check(g, {"x": rand(2, t, d), "w": rand(width, d), "gain": 1 + 0.1 * rand(normed),
              "shift": 0.1 * rand(normed, seed=1), "pos": torch.arange(t),
              "freq": rope_cos_sin(rope_inv_freq(dim=hd, theta=10000.0), rows=t)},
          {"B": 2, "T": t, "P": 0},
          kernel_dir)


# ---- epilogues on every kernel that writes rows ---------------------------------------------

def steps(*calls: tuple) -> tuple[Call, ...]:
    return tuple(Call(fn, (), tuple(sorted(kw.items()))) for fn, kw in calls)


def test_norm_runs_any_elementwise_epilogue(kernel_dir: Path) -> None:
    """A norm's epilogue is the elementwise steps of a matmul's: bias, an activation on some
    columns, a scale, a soft-cap and a residual, in that order."""
    width = 40

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.NORM, i["x"], i["g"], i["b"], i["r"], kind="layer", eps=1e-5,
                      epilogue=steps(("bias", {}), ("act", {"fn": "gelu", "start": 8,
                                                             "stop": 30}),
                                     ("scale", {"by": 0.5}), ("softcap", {"cap": 1.5}),
                                     ("residual", {})))

    g = build({"x": (shape(B, T, width), "f32"), "g": (shape(width), "f32"),
               "b": (shape(width), "f32"), "r": (shape(B, T, width), "f32")}, fn)
    check(g, {"x": rand(2, 5, width), "g": 1 + 0.1 * rand(width), "b": rand(width, seed=2),
              "r": rand(2, 5, width, seed=3)}, {"B": 2, "T": 5, "P": 0}, kernel_dir)


def test_expert_matmuls_run_any_elementwise_epilogue(kernel_dir: Path) -> None:
    """The up stage's glu, then a bias on each (token, slot) row; the down stage's sum, then a
    residual and a soft-cap."""
    n_experts, d, f = 4, 24, 12

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        gates = b.emit(Op.ROUTER, i["x"], i["wr"], top_k=2, normalize=True)
        h = b.emit(Op.MOE_LINEAR, i["x"], gates, i["gu"], i["bias"], stage="up", top_k=2,
                   epilogue=steps(("glu", {"fn": "silu"}), ("bias", {})))
        return b.emit(Op.MOE_LINEAR, h, gates, i["down"], i["x"], stage="down", top_k=2,
                      epilogue=steps(("residual", {}), ("softcap", {"cap": 2.0})))

    g = build({"x": (shape(B, T, d), "f32"), "wr": (shape(n_experts, d), "f32"),
               "gu": (shape(n_experts, 2 * f, d), "f32"), "bias": (shape(f), "f32"),
               "down": (shape(n_experts, d, f), "f32")}, fn)
    check(g, {"x": rand(3, 5, d), "wr": rand(n_experts, d, seed=1),
              "gu": rand(n_experts, 2 * f, d, seed=2) / d ** 0.5, "bias": rand(f, seed=4),
              "down": rand(n_experts, d, f, seed=3) / f ** 0.5}, {"B": 3, "T": 5, "P": 0},
          kernel_dir)
