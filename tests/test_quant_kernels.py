"""Quantized weights in the Triton kernels: the matmul (tiled prefill, decode, split-K), the
expert matmuls and the router, and the embedding gather read a weight's stored parts and
dequantize each tile where it is read (templates/dequant.j2) — and agree with eager, which
dequantizes the whole weight (QTensor.dequantize) and then multiplies.

Tolerance, relative to the output's largest magnitude: 1e-5 in f32, the single-kernel tolerance
of tests/test_triton_kernels.py (tighter than the 1e-4 of whole models). The dequantized values
are bitwise eager's (the same f32 operations in the same order), so what is left is the f32
accumulation order of the products: a few ulps of the scale. f16: 2e-3, as for float weights
(the dequantized tile and the activations are rounded to f16 on both sides). Whole models: 1e-4,
as tests/test_triton_models.py.

Shapes are odd on purpose: K = 300 (not a multiple of any block, of q6_k's 16-element groups or
of the k-quants' 256-element super-blocks), N = 19, K steps of 64 (several per row, a split
starting mid super-block). Each kernel family is run under Triton's interpreter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.codegen import blocks
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder
from archc.ir.ops import Op
from archc.ir.paramexpr import rope_cos_sin, rope_inv_freq
from archc.ir.shapes import B, T, shape
from archc.ir.verify import verify_graph
from archc.quant.schemes import SCHEMES
from archc.quant.tensor import QTensor
from archc.runtime import tuning
from archc.runtime.eager import EagerContext, KVCache, run_graph
from tests.test_quant_core import random_qtensor
from tests.test_triton_kernels import DEVICE, layernorm_activations
from tests.triton_graph import run_graph_triton

TOL = {"f32": 1e-5, "f16": 2e-3}
MODEL_TOL = 1e-4
TORCH = {"f32": torch.float32, "f16": torch.float16}
K, N = 300, 19


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def force(monkeypatch: pytest.MonkeyPatch, **forced: int) -> list[dict[str, Any]]:
    """Launch configurations with `forced` block sizes for the matmul-shaped families (K steps
    of 64 unless told); returns the configurations the launches chose."""
    real, seen = blocks.launch_config, []

    def config(family: str, target: str, **sizes: int) -> dict[str, Any]:
        cfg = real(family, target, **sizes)
        if family in ("matmul", "moe", "router"):
            cfg.update({"BLOCK_K": 64, **{k: v for k, v in forced.items() if k in cfg
                                          or k == "SPLIT_K" and family == "matmul"}})
            seen.append(dict(cfg, family=family, **sizes))
        return cfg

    monkeypatch.setattr(blocks, "launch_config", config)
    return seen


def graph(inputs: dict[str, tuple[Any, str]], params: dict[str, tuple[Any, str]], fn: Any
          ) -> Graph:
    b = GraphBuilder("decoder")
    ids = {k: b.input(k, s, dt) for k, (s, dt) in inputs.items()}
    ids.update({k: b.param(k, s, dt) for k, (s, dt) in params.items()})
    b.output("y", fn(b, ids))
    g = b.build()
    verify_graph(g)
    return g


def check(g: Graph, params: dict[str, Any], values: dict[str, torch.Tensor],
          dims: dict[str, int], kernel_dir: Path, dtype: str = "f32") -> torch.Tensor:
    """Eager (weights dequantized, then the op) and triton (dequantized in the kernels) on one
    graph: the outputs and any KV cache written agree; returns triton's output."""
    dims = {"P": 0, **dims}
    cast = {k: v.to(TORCH[dtype]) if v.is_floating_point() else v for k, v in values.items()}
    params = {k: v.to(TORCH[dtype]) if isinstance(v, torch.Tensor) else v
              for k, v in params.items()}
    cache = KVCache(64)
    want = run_graph(g, params, cast, EagerContext(dims, cache))["y"]
    run = run_graph_triton(g, params, cast, dims, max_seq_len=64, device=DEVICE,
                           cache_dir=kernel_dir)
    got = run.outputs["y"].cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    err, scale = (got.float() - want.float()).abs().max(), want.float().abs().max()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} at scale {scale:.3g}"
    for key, ref in cache.store.items():
        length = dims["P"] + dims["T"]
        cached = run.cache.get(*key)[:, :, :length].cpu().float()
        cerr = (cached - ref[:, :, :length].float()).abs().max()
        assert cerr <= TOL[dtype] * ref.float().abs().max(), f"cache {key}: error {cerr:.3g}"
    return got


def rand(*dims: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*dims, generator=torch.Generator().manual_seed(seed))


def plain(scheme: str, dims: dict[str, int], kernel_dir: Path, dtype: str = "f32") -> None:
    g = graph({"x": (shape(B, T, K), dtype)}, {"w": (shape(N, K), scheme)},
              lambda b, i: b.emit(Op.FUSED_LINEAR, i["x"], i["w"]))
    check(g, {"w": random_qtensor(scheme, (N, K), seed=1)},
          {"x": rand(dims["B"], dims["T"], K)}, dims, kernel_dir, dtype)


# ---- the matmul: every scheme, each path ------------------------------------------------------

@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_decode_rows(scheme: str, kernel_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """6 rows (the decode sizes), 19 weight rows in tiles of 16, K = 300 in steps of 64."""
    seen = force(monkeypatch, BLOCK_N=16)
    plain(scheme, {"B": 2, "T": 3}, kernel_dir)
    assert seen and all(c["quant"] == SCHEMES[scheme].bits for c in seen)


@pytest.mark.parametrize("scheme", ["q4_k", "q6_k", "int4_g32", "q8_0", "q5_1"])
def test_tiled_prefill_rows(scheme: str, kernel_dir: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """40 rows in row tiles of 32: the prefill tiles (and their TMA flag, ignored: a quantized
    weight has no descriptor path)."""
    seen = force(monkeypatch, BLOCK_M=32, BLOCK_N=16, TMA=1)
    plain(scheme, {"B": 2, "T": 20}, kernel_dir)
    assert any(c["M"] > 16 for c in seen)


@pytest.mark.parametrize("scheme,splits", [("q4_k", 3), ("int4_g64", 2), ("q6_k", 4),
                                           ("int8_ch", 3), ("q5_0", 2)])
def test_split_k_gemv(scheme: str, splits: int, kernel_dir: Path,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One row, the K loop split in whole 64-column steps (a split starting inside a group or a
    super-block, the last one short or empty)."""
    seen = force(monkeypatch, BLOCK_M=16, BLOCK_N=16, SPLIT_K=splits)
    plain(scheme, {"B": 1, "T": 1}, kernel_dir)
    assert any(c.get("SPLIT_K") == splits for c in seen)


def test_f16(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    force(monkeypatch, BLOCK_N=16)
    plain("q4_k", {"B": 2, "T": 3}, kernel_dir, "f16")


def test_no_tma_for_quantized_weights() -> None:
    """The launch heuristic and the autotuner's candidates never choose TMA for a quantized
    weight (its tiles are dequantized from pointer loads); a float one takes it in prefill."""
    sizes = dict(M=512, N=4096, K=4096, paired=0, align=16, operands=1)
    assert blocks.launch_config("matmul", "gpu", **sizes)["TMA"] == 1
    assert blocks.launch_config("matmul", "gpu", **sizes, quant=4)["TMA"] == 0
    assert any(c["TMA"] for c in blocks.autotune_configs("matmul", **sizes))
    assert not any(c["TMA"] for c in blocks.autotune_configs("matmul", **sizes, quant=4))
    assert not any(c["TMA"] for c in tuning.candidates("matmul", {**sizes, "quant": 4}))


# ---- epilogues, prologues and the gain ----------------------------------------------------------

@pytest.mark.parametrize("split", [1, 2])
def test_rms_prologue_glu_bias_residual(split: int, kernel_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Folded RMSNorm with a gain on x, paired-adjacent GLU rows, a bias and the residual."""
    force(monkeypatch, BLOCK_N=32, SPLIT_K=split, BLOCK_M=16)
    n = 2 * 23

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["gain"], i["bias"], i["r"],
                      prologue="rms", eps=1e-5, gain=True, paired=True,
                      epilogue=(Call("rms_scale"), Call("glu", (), (("fn", "silu"),)),
                                Call("bias"), Call("residual")))

    g = graph({"x": (shape(B, T, K), "f32"), "gain": (shape(K), "f32"),
               "bias": (shape(n // 2), "f32"), "r": (shape(B, T, n // 2), "f32")},
              {"w": (shape(n, K), "q4_k")}, fn)
    check(g, {"w": random_qtensor("q4_k", (n, K), seed=2)},
          {"x": rand(2, 3, K), "gain": 0.5 + rand(K, seed=1).abs(), "bias": rand(n // 2),
           "r": rand(2, 3, n // 2, seed=3)}, {"B": 2, "T": 3}, kernel_dir)


@pytest.mark.parametrize("weight,tma", [("int4_g32", 0), ("f32", 0), ("f32", 1)])
def test_gain_scales_the_activations(weight: str, tma: int, kernel_dir: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """x·diag(gain)·Wᵀ, for a quantized and a float weight (pointer loads and tensor
    descriptors), on prefill tiles."""
    seen = force(monkeypatch, BLOCK_N=16, BLOCK_M=32, TMA=tma)
    g = graph({"x": (shape(B, T, K), "f32"), "gain": (shape(K), "f32")},
              {"w": (shape(N, K), weight)},
              lambda b, i: b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["gain"], gain=True))
    w = random_qtensor(weight, (N, K), seed=1) if weight != "f32" else rand(N, K) / K ** 0.5
    got = check(g, {"w": w}, {"x": rand(1, 20, K), "gain": rand(K, seed=4)}, {"B": 1, "T": 20},
                kernel_dir)
    assert all(c["TMA"] == tma for c in seen)
    # the gain matters: without it the product is far from this one
    dense = w.dequantize() if isinstance(w, QTensor) else w
    assert (got - rand(1, 20, K) @ dense.T).abs().max() > 0.1 * got.abs().max()


@pytest.mark.parametrize("fn_name", ["gelu", "relu"])
def test_layernorm_prologue_and_activations(fn_name: str, kernel_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A LayerNorm prologue (ln_scale: acc − μ·colsum, which cancels: small weights, so that
    the f32 rounding of the accumulator before the cancellation stays below the tolerance, as
    for the float weights of tests/test_triton_kernels.py) and activations over columns 5..30."""
    force(monkeypatch, BLOCK_N=16)
    n = 37
    w = random_qtensor("int4_g64", (n, K), seed=5)

    fn = layernorm_activations(fn_name)

    g = graph({"x": (shape(B, T, K), "f32"), "colsum": (shape(n), "f32"),
               "bias": (shape(n), "f32")}, {"w": (shape(n, K), "int4_g64")}, fn)
    check(g, {"w": w}, {"x": 2 + rand(2, 5, K), "colsum": w.dequantize().sum(1),
                        "bias": rand(n)}, {"B": 2, "T": 5}, kernel_dir)


@pytest.mark.parametrize("paired", [False, True])
def test_rope_kv_write(paired: bool, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QKV with RoPE and the KV-cache write in the epilogue (after a past of 3 tokens), over
    partner row sets or paired-adjacent rows."""
    force(monkeypatch, BLOCK_N=32)
    heads, kv_heads, hd, t, past = 6, 2, 16, 5, 3
    width, k = (heads + 2 * kv_heads) * hd, 64
    table = rope_cos_sin(rope_inv_freq(dim=hd, theta=10000.0), rows=past + t + 1)
    rope = Call("rope", (), (("head_dim", hd), ("heads", heads + kv_heads),
                             ("interleaved", False), ("rotary_dim", hd)))
    kv = Call("kv_write", (), (("head_dim", hd), ("k_start", heads * hd), ("kv_heads", kv_heads),
                               ("layer", 0), ("v_start", (heads + kv_heads) * hd)))

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["pos"], i["table"],
                      epilogue=(rope, kv), paired=paired)

    w = random_qtensor("q6_k", (width, k), seed=6)
    if paired:   # partners side by side: what the rope_pairs param function does at load
        from archc.ir.paramexpr import ROW_FNS
        w = ROW_FNS["rope_pairs"](w, head_dim=hd, heads=heads + kv_heads, interleaved=False,
                                  rotary_dim=hd)
    g = graph({"x": (shape(B, T, k), "f32"), "pos": (shape(T), "i64"),
               "table": (shape(*table.shape), "f32")}, {"w": (shape(width, k), "q6_k")}, fn)
    check(g, {"w": w}, {"x": rand(2, t, k), "pos": torch.arange(past, past + t), "table": table},
          {"B": 2, "T": t, "P": past}, kernel_dir)


def test_two_operands_concatenated_along_k(kernel_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """concat_k (a parallel block's out + down in one matmul): x1's 100 columns, then x2's 200,
    read against the weight's columns [0, 100) and [100, 300) — the second loop starts inside a
    group and a super-block."""
    force(monkeypatch, BLOCK_N=16)
    g = graph({"x1": (shape(B, T, 100), "f32"), "x2": (shape(B, T, K - 100), "f32"),
               "r": (shape(B, T, N), "f32")}, {"w": (shape(N, K), "q5_k")},
              lambda b, i: b.emit(Op.FUSED_LINEAR, i["x1"], i["x2"], i["w"], i["r"],
                                  concat_k=True, epilogue=(Call("residual"),)))
    check(g, {"w": random_qtensor("q5_k", (N, K), seed=11)},
          {"x1": rand(2, 3, 100), "x2": rand(2, 3, K - 100, seed=1), "r": rand(2, 3, N, seed=2)},
          {"B": 2, "T": 3}, kernel_dir)


# ---- experts, router, embedding ------------------------------------------------------------------

def test_experts_up_glu_down_residual_quantized_router(kernel_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """x → router (quantized) → up with glu (quantized [E, 2F, K]) → down with the residual
    (quantized [E, K, F]), 11 tokens over 5 experts, 2 each."""
    force(monkeypatch, BLOCK_N=16)
    experts, top_k, d, f = 5, 2, 40, 24

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        gates = b.emit(Op.ROUTER, i["x"], i["wr"], top_k=top_k, normalize=True)
        h = b.emit(Op.MOE_LINEAR, i["x"], gates, i["up"], stage="up", top_k=top_k,
                   epilogue=(Call("glu", (), (("fn", "silu"),)),))
        return b.emit(Op.MOE_LINEAR, h, gates, i["down"], i["x"], stage="down", top_k=top_k,
                      epilogue=(Call("residual"),))

    g = graph({"x": (shape(B, T, d), "f32")},
              {"wr": (shape(experts, d), "q8_0"), "up": (shape(experts, 2 * f, d), "q4_1"),
               "down": (shape(experts, d, f), "int4_g32")}, fn)
    check(g, {"wr": random_qtensor("q8_0", (experts, d), seed=7),
              "up": random_qtensor("q4_1", (experts, 2 * f, d), seed=8),
              "down": random_qtensor("int4_g32", (experts, d, f), seed=9)},
          {"x": rand(1, 11, d)}, {"B": 1, "T": 11}, kernel_dir)


@pytest.mark.parametrize("scheme,dtype", [("q4_k", "f32"), ("q6_k", "f32"), ("q8_0", "f16")])
def test_embedding_of_a_quantized_table(scheme: str, dtype: str, kernel_dir: Path) -> None:
    vocab, d = 13, 300
    g = graph({"ids": (shape(B, T), "i64")}, {"table": (shape(vocab, d), scheme)},
              lambda b, i: b.emit(Op.EMBEDDING, i["table"], i["ids"], dtype=dtype))
    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(3))
    table = random_qtensor(scheme, (vocab, d), seed=10)
    got = check(g, {"table": table}, {"ids": ids}, {"B": 2, "T": 5}, kernel_dir, dtype)
    assert torch.equal(got, table.dequantize(TORCH[dtype])[ids])   # a gather: bitwise


# ---- whole models -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,kind", [("tiny-llama3", "int4"), ("tiny-mixtral", "int8")])
def test_quantized_model_prefill_then_decode(name: str, kind: str, kernel_dir: Path) -> None:
    """Every linear weight quantized at load: triton (dequantizing in its kernels) matches
    eager on a prefill and three greedy decode steps at 1e-4."""
    model = archc.load(name, seed=3, quantize=kind, group=32)
    assert model.quant, "nothing was quantized"
    sessions = [model.compile(b, dtype="f32", device=DEVICE, **kw).session
                for b, kw in (("eager", {}), ("triton", {"cache_dir": kernel_dir}))]
    x = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    for s in sessions:
        s.reset()
    for _ in range(4):
        want, got = (s.step(x)[:, -1] for s in sessions)
        err, scale = (got - want).abs().max(), want.abs().max()
        assert err <= MODEL_TOL * scale, f"max error {err:.3g} at scale {scale:.3g}"
        x = want.argmax(-1)[:, None]


def test_kernels_are_shared_across_layers_and_keyed_by_scheme() -> None:
    """The two layers of tiny-llama3 share every kernel with their weights quantized alike; a
    layer whose weights are of another scheme with the same code width and group (q4_0 beside
    int4_g32) gets kernels of its own."""
    from archc.codegen.build import CodegenOptions
    from archc.codegen.render import generate
    from archc.ir.lower import lower
    from archc.passes import optimize
    from archc.runtime.weights import quantizable
    from archc.spec import load_spec

    spec = load_spec("tiny-llama3")
    names = quantizable(lower(spec))

    def units(scheme_of: Any) -> int:
        quant = {name: scheme_of(name) for name in names}
        return len(generate(optimize(lower(spec, "f32", quant)), CodegenOptions()).units)

    alike = units(lambda name: "int4_g32")
    assert alike == 7   # embedding, head; qkv, attention, o, gate/up, down shared by both layers
    mixed = units(lambda name: "q4_0" if name.startswith("layers.1.") else "int4_g32")
    assert mixed == alike + 4   # layer 1's four matmuls: their own kernels


def test_compile_command_takes_quantized_weights(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """`archc compile --quantize int4 --group 64`: the kernels read the weights' parts."""
    from archc.cli import main
    assert main(["compile", "tiny-llama3", "--quantize", "int4", "--group", "64",
                 "--kernel", "fused_linear_1", "--cache-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "weight_q_ptr" in text and "weight_scale_ptr" in text and "int4_g64" in text
    assert main(["compile", "tiny-llama3", "--kernel", "fused_linear_1",
                 "--cache-dir", str(tmp_path)]) == 0
    assert "weight_q_ptr" not in capsys.readouterr().out
