"""Split-K matmuls: the K loop of a tile shared by SPLIT_K programs, the last to arrive adding the
partial sums and running the epilogue, agree with the eager interpreter.

On a GPU only decode GEMVs split (``blocks.launch_config``); here SPLIT_K is forced on every
single-operand matmul, with narrow tiles (several tiles, so each has its own counter) and 16-column
K steps (several steps per split), under Triton's interpreter in f32 and f16. Besides the outputs,
each test checks that every (tile, split) program left its partial sums in the scratch (it starts
as NaN) and that the arrival counters are back to zero after the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.codegen import blocks
from archc.ir.attrs import Call
from archc.ir.graph import GraphBuilder
from archc.ir.ops import Op
from archc.ir.paramexpr import rope_cos_sin, rope_inv_freq
from archc.ir.shapes import B, T, shape
from archc.runtime.launch import LaunchContext
from tests.test_triton_kernels import (
    DEVICE,
    DTYPES,
    build,
    check,
    check_concat_k_operands,
    check_head_norm,
    check_rms_prologue_glu_bias_residual,
    rand,
)

BLOCK_K = 16
MODEL_TOL = 1e-4   # a whole model in f32, as tests/test_triton_models.py


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


class SplitK:
    """Forces SPLIT_K on matmuls and watches what the split launches use: the configurations
    chosen, the partial-sum scratch (filled with NaN when a plan takes it) and the counters."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, splits: int, block_n: int = 32) -> None:
        self.splits = splits
        self.split_configs: list[dict[str, Any]] = []
        self.parts: list[torch.Tensor] = []
        self.counters: list[torch.Tensor] = []
        config, scratch, counters = (blocks.launch_config, LaunchContext.scratch,
                                     LaunchContext.counters)

        def forced(family: str, target: str, **sizes: int) -> dict[str, Any]:
            cfg = config(family, target, **sizes)
            if family == "matmul" and sizes["operands"] == 1:
                cfg.update(BLOCK_M=16, BLOCK_K=BLOCK_K, SPLIT_K=splits,
                           BLOCK_N=max(min(cfg["BLOCK_N"], block_n), sizes["align"]))
                self.split_configs.append(dict(cfg, K=sizes["K"]))
            return cfg

        def watched_scratch(ctx: LaunchContext, name: str, numel: int, dtype: str
                            ) -> torch.Tensor:
            buf = scratch(ctx, name, numel, dtype)
            if name == "matmul_splitk":
                buf.fill_(float("nan"))
                self.parts.append(buf)
            return buf

        def watched_counters(ctx: LaunchContext, name: str, numel: int) -> torch.Tensor:
            buf = counters(ctx, name, numel)
            if name == "matmul_splitk":
                self.counters.append(buf)
            return buf

        monkeypatch.setattr(blocks, "launch_config", forced)
        monkeypatch.setattr(LaunchContext, "scratch", watched_scratch)
        monkeypatch.setattr(LaunchContext, "counters", watched_counters)

    def check_ran(self) -> None:
        """Split launches ran: every slot of the scratch written, every counter back to 0."""
        assert self.split_configs and self.parts and self.counters
        assert all(cfg["SPLIT_K"] == self.splits for cfg in self.split_configs)
        for part in self.parts:
            assert not part.isnan().any(), "a (tile, split) program left its slot unwritten"
        for count in self.counters:
            assert int(count.abs().sum()) == 0, f"counters left at {count.tolist()}"


# ---- the K ranges ----------------------------------------------------------------------------

def test_split_ranges_cover_k_in_whole_steps() -> None:
    for k, splits in [(40, 2), (40, 3), (32, 3), (4096, 3), (14336, 3), (17, 2)]:
        ranges = [blocks.split_k_range(k, BLOCK_K, splits, s) for s in range(splits)]
        assert ranges[0][0] == 0 and ranges[-1][1] == k
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(lo % BLOCK_K == 0 for lo, _ in ranges)
    # the cases the kernel tests below rely on
    assert blocks.split_k_range(40, BLOCK_K, 2, 1) == (32, 40)       # a short last split
    assert blocks.split_k_range(32, BLOCK_K, 3, 2) == (32, 32)       # an empty last split


def test_decode_split_count_fills_two_waves() -> None:
    """llama3-8b's o-proj and down-proj (128 tiles of 32 columns) and QKV (192 tiles of 16
    pairs) reach DECODE_TARGET_PROGRAMS with splits of ≥ DECODE_MIN_SPLIT_STEPS steps; tiles
    that are already enough (the lm head, gate/up) and concatenated operands do not split; the
    interpreter never splits."""
    def split(n: int, k: int, cols: int | None = None, **kw: int) -> dict[str, Any]:
        sizes = dict(M=1, N=n, K=k, paired=int(cols is not None), align=16,
                     head_norm=0, layer_norm=0, operands=1)
        return blocks.launch_config("matmul", "gpu", **{**sizes, **kw})

    for n, k, cols in [(4096, 4096, None), (4096, 14336, None), (6144, 4096, 3072)]:
        cfg = split(n, k, cols)
        tile_n = cfg["BLOCK_N"] // 2 if cols else cfg["BLOCK_N"]
        tiles = -(-(cols or n) // tile_n)
        splits = cfg["SPLIT_K"]
        assert tiles < blocks.DECODE_TARGET_PROGRAMS <= tiles * splits
        lo, hi = blocks.split_k_range(k, cfg["BLOCK_K"], splits, splits - 1)
        assert hi - lo >= cfg["BLOCK_K"]                       # the last split has work
        steps = blocks.split_k_range(k, cfg["BLOCK_K"], splits, 0)[1] // cfg["BLOCK_K"]
        assert steps >= blocks.DECODE_MIN_SPLIT_STEPS
    assert split(128256, 4096)["SPLIT_K"] == 1
    assert split(28672, 4096, 14336)["SPLIT_K"] == 1
    assert split(4096, 4096, operands=2)["SPLIT_K"] == 1
    assert split(4096, 4096, M=512)["SPLIT_K"] == 1
    assert split(64, 64)["SPLIT_K"] == 1                    # one BLOCK_K step: nothing to split
    assert blocks.launch_config("matmul", "interpret", M=1, N=4096, K=4096, paired=0,
                                align=16, operands=1)["SPLIT_K"] == 1


# ---- kernels ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,splits", [(40, 2), (40, 3), (32, 3), (64, 2)])
def test_plain(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, k: int, splits: int,
               dtype: str) -> None:
    """No epilogue. K = 40 is no multiple of BLOCK_K·SPLIT_K (a short last split); 32 over 3
    splits leaves the last one empty."""
    spy = SplitK(monkeypatch, splits)
    n = 70

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"])

    g = build({"x": (shape(B, T, k), dtype), "w": (shape(n, k), dtype)}, fn)
    check(g, {"x": rand(3, 7, k), "w": rand(n, k) / k ** 0.5}, {"B": 3, "T": 7, "P": 0},
          kernel_dir, dtype=dtype)
    spy.check_ran()


@pytest.mark.parametrize("splits", [2, 3])
def test_bias_residual(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, splits: int) -> None:
    spy = SplitK(monkeypatch, splits)
    k, n = 56, 45

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["bias"], i["r"],
                      epilogue=(Call("bias"), Call("residual")))

    g = build({"x": (shape(B, T, k), "f32"), "w": (shape(n, k), "f32"),
               "bias": (shape(n), "f32"), "r": (shape(B, T, n), "f32")}, fn)
    check(g, {"x": rand(2, 5, k), "w": rand(n, k), "bias": rand(n), "r": rand(2, 5, n)},
          {"B": 2, "T": 5, "P": 0}, kernel_dir)
    spy.check_ran()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [2, 3])
def test_rms_prologue_glu_pair(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, splits: int,
                               dtype: str) -> None:
    """Folded RMSNorm (Σx² from every split) and the GLU pair (both accumulators split)."""
    spy = SplitK(monkeypatch, splits)
    check_rms_prologue_glu_bias_residual(kernel_dir, dtype)
    spy.check_ran()


@pytest.mark.parametrize("splits", [2, 3])
def test_layernorm_prologue(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch,
                            splits: int) -> None:
    """Folded LayerNorm: Σx and Σx² from every split; inputs off zero so the mean matters."""
    spy = SplitK(monkeypatch, splits)
    k, n = 40, 37

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["colsum"], i["bias"], prologue="layer",
                      eps=1e-5, epilogue=(Call("ln_scale"), Call("bias"),
                                          Call("act", (), (("fn", "gelu"),))))

    w = rand(n, k)
    g = build({"x": (shape(B, T, k), "f32"), "w": (shape(n, k), "f32"),
               "colsum": (shape(n), "f32"), "bias": (shape(n), "f32")}, fn)
    check(g, {"x": 2 + rand(2, 5, k), "w": w, "colsum": w.sum(1), "bias": rand(n)},
          {"B": 2, "T": 5, "P": 0}, kernel_dir)
    spy.check_ran()


@pytest.mark.parametrize("splits", [2, 3])
def test_rope_pair_kv_write_decode_step(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                        splits: int) -> None:
    """A tiny llama decode step: RMSNorm-folded QKV with RoPE pairs and the KV-cache write in the
    epilogue (one new token over a past of 6), then attention over the cache."""
    spy = SplitK(monkeypatch, splits)
    heads, kv_heads, hd, d, past = 4, 2, 16, 40, 6
    width = (heads + 2 * kv_heads) * hd

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        qkv = b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["pos"], i["freq"], prologue="rms",
                     eps=1e-5, epilogue=(
                         Call("rms_scale"),
                         Call("rope", (), (("heads", heads + kv_heads), ("head_dim", hd),
                                           ("interleaved", False), ("rotary_dim", hd))),
                         Call("kv_write", (), (("head_dim", hd), ("k_start", heads * hd),
                                               ("kv_heads", kv_heads), ("layer", 0),
                                               ("v_start", (heads + kv_heads) * hd)))))
        q = b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, qkv, start=0, stop=heads * hd), heads=heads)
        return b.emit(Op.ATTENTION, q, cache_layer=0, kv_heads=kv_heads, scale=hd ** -0.5,
                      causal=True, padding=False, prefix=False, window=None)

    g = build({"x": (shape(B, T, d), "f32"), "w": (shape(width, d), "f32"),
               "pos": (shape(T), "i64"), "freq": (shape(past + 1, 2, hd // 2), "f32")}, fn)
    check(g, {"x": rand(2, 1, d), "w": rand(width, d), "pos": torch.arange(past, past + 1),
              "freq": rope_cos_sin(rope_inv_freq(dim=hd, theta=10000.0), rows=past + 1)},
          {"B": 2, "T": 1, "P": past},
          kernel_dir, past_kv={(0, "k"): rand(2, kv_heads, past, hd, seed=1),
                               (0, "v"): rand(2, kv_heads, past, hd, seed=2)})
    spy.check_ran()


@pytest.mark.parametrize("kind,hd", [("rms", 16), ("layer", 20)])
def test_head_norm_rope(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                        hd: int) -> None:
    """QK-norm after the split sums: whole heads per tile (a reshape for 16, head-aligned tiles
    for 20), then RoPE and the cache write."""
    spy = SplitK(monkeypatch, 3, block_n=64)
    check_head_norm(kernel_dir, kind, hd, rope=True, d=40, t=3)
    spy.check_ran()


def test_concatenated_operands_do_not_split(kernel_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A K loop over two inputs keeps SPLIT_K = 1 (the forcing skips it) and is still right."""
    spy = SplitK(monkeypatch, 2)
    check_concat_k_operands(kernel_dir)
    assert not spy.split_configs


# ---- a whole model ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gpt2"])
def test_model_decodes_token_by_token(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                      name: str) -> None:
    """Prefill, then decode token by token with every single-operand matmul split in 3 (the
    same launch plan replayed: the counters must be zero again after each step): the logits
    agree with eager at every step. tiny-llama3: RMSNorm prologues, RoPE + cache write, GLU;
    tiny-gpt2: LayerNorm prologues, biases, residuals."""
    spy = SplitK(monkeypatch, 3)
    model = archc.load(name, seed=3)
    eager = model.compile("eager", dtype="f32", device=DEVICE)
    triton = model.compile("triton", dtype="f32", device=DEVICE, cache_dir=kernel_dir)
    sessions = (eager.session, triton.session)
    for s in sessions:
        s.reset()
    x = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    for _ in range(4):
        want, got = (s.step(x)[:, -1] for s in sessions)
        err = (got.float() - want.float()).abs().max()
        assert err <= MODEL_TOL * want.float().abs().max(), f"max error {err:.3g}"
        x = want.argmax(-1)[:, None]
    spy.check_ran()


# ---- compiled for Hopper -------------------------------------------------------------------

@pytest.mark.slow
def test_decode_kernels_compile_for_sm90a_without_spills(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """llama3-8b's matmuls at their batch-1 decode configuration (split-K for QKV, o-proj and
    down-proj; one split for gate/up and the lm head) compile for sm_90a without spills: the
    interpreter cannot see what the compiled split path does (the early return of all but the
    last split, the atomic, the L2 loads)."""
    from archc.codegen import aot
    from archc.codegen.build import CodegenOptions
    from archc.codegen.render import generate, write_module
    from archc.ir.lower import lower
    from archc.passes import optimize
    from archc.spec import load_spec

    spec = load_spec("llama3-8b")
    gen = generate(optimize(lower(spec, "bf16")),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    path = write_module(gen, tmp_path / spec.name)
    # each kernel at each of its uses' sizes: the o-proj and down-proj share one kernel
    table = aot.kernel_table(path)
    decode = {(name, k): blocks.launch_config("matmul", "gpu", M=1, **{**entry["sizes"], **st})
              for name, entry in table.items() if entry["family"] == "matmul"
              for k, st in enumerate(entry["static"])}
    assert sorted(cfg["SPLIT_K"] for cfg in decode.values()) == [1, 1, 2, 3, 3]
    monkeypatch.setattr(aot, "aot_config", lambda family, sizes, sm=90: blocks.launch_config(
        family, "gpu", M=1, sm=sm, **sizes))
    results = aot.compile_module(path, "sm_90a", jobs=1,
                                 kernels=sorted({name for name, _ in decode}))
    assert len(results) == len(decode)
    failed = [f"{r.kernel}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.registers > 0 for r in results)
    spilled = [f"{r.kernel} ({r.spill_bytes} bytes)" for r in results if r.spill_bytes]
    assert not spilled, f"kernels spill registers: {', '.join(spilled)}"
