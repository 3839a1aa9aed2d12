"""Autotuning (``archc.runtime.tuning``): on by default on a CUDA GPU only, pre-filtered by the
ahead-of-time compile, its choices cached on disk per kernel source, shape bucket and GPU name,
and `--no-autotune` on every command that builds a triton session.

There is no GPU here: the pieces are tested one by one, and a tuned launch end to end under
Triton's interpreter with a stand-in timer (every candidate is launched, the one the timer calls
fastest is kept) and a stand-in pre-filter.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import archc.runtime.triton_backend as backend
from archc.cli import build_parser
from archc.codegen import aot, blocks
from archc.gpus import GPU_TARGETS, target_of
from archc.ir.attrs import Call
from archc.ir.graph import GraphBuilder, Program
from archc.ir.ops import Op
from archc.ir.shapes import B, T, shape
from archc.runtime import tuning
from archc.runtime.eager import EagerContext, run_graph
from archc.runtime.triton_backend import TritonOptions, TritonSession
from archc.runtime.tuning import Tuner, TuningCache, bucket
from tests.test_triton_kernels import build, check, rand

DIGEST = "ab" * 32

pytestmark = pytest.mark.autotune       # sessions tune by default here, as users' do


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def matmul_graph(k: int = 24, n: int = 40) -> Any:
    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"])
    return build({"x": (shape(B, T, k), "f32"), "w": (shape(n, k), "f32")}, fn)


# ---- when a session tunes ------------------------------------------------------------------

def test_on_by_default_for_a_gpu_off_on_the_interpreter(kernel_dir: Path) -> None:
    assert TritonOptions().autotune is True
    assert tuning.tuning_enabled(True, "gpu", "cuda")
    assert not tuning.tuning_enabled(False, "gpu", "cuda")          # --no-autotune
    assert not tuning.tuning_enabled(True, "interpret", "cpu")      # the interpreter
    assert not tuning.tuning_enabled(True, "gpu", "cpu")            # bench --host-time, occupancy
    g = matmul_graph()
    s = TritonSession(Program(g.name, (g,)), {}, max_seq_len=64, device="cpu",
                      options=TritonOptions(passes=None, cache_dir=kernel_dir))
    assert s.tuner is None and s.ctx.tuner is None and not s.ctx.autotuned
    assert s.tuning_stats() == {"enabled": False, "seconds": 0.0, "kernels_tuned": 0,
                                "cache_hits": 0, "cache_misses": 0, "configs_dropped": 0}


def test_aot_target_of_a_capability() -> None:
    assert target_of((9, 0)) == "sm_90a"
    assert target_of((8, 6)) == "sm_80"
    # 10.x only where the ahead-of-time compile knows sm_100a; 7.x never: no pre-filter
    assert target_of((10, 0)) == ("sm_100a" if "sm_100a" in GPU_TARGETS else None)
    assert target_of((7, 5)) is None


# ---- candidates and buckets ----------------------------------------------------------------

def test_decode_gemvs_are_tuned_over_their_tiles_and_splits() -> None:
    """M ≤ 16 (decode): GEMV tiles of 16 rows, each at its split-K counts — the heuristic (with
    its split-K) first — pointer loads and the row statistics in the K loop, as the heuristic
    (decode's launch count and fixed shape stay). Decode attention is not tuned."""
    sizes = dict(N=4096, K=4096, paired=0, align=16, head_norm=0, layer_norm=0,
                 operands=1)
    for m in (1, 16):
        found = tuning.candidates("matmul", {**sizes, "M": m})
        heuristic = blocks.launch_config("matmul", "gpu", **sizes, M=m)
        assert found[0] == heuristic and heuristic["SPLIT_K"] > 1
        assert len(found) > 4 and all(set(c) == set(heuristic) for c in found)
        assert len({json.dumps(c, sort_keys=True) for c in found}) == len(found)
        assert all(c["BLOCK_M"] == 16 and c["TMA"] == 0 and c["ROW_STATS"] == 0 for c in found)
        assert {c["SPLIT_K"] for c in found} > {heuristic["SPLIT_K"]}   # other splits too
        for c in found:                                 # no split without a K step
            assert 1 <= c["SPLIT_K"] <= -(-4096 // c["BLOCK_K"])
    # paired columns: 16 pairs a tile at least; a quantized weight: K steps of 128 at most;
    # concatenated operands do not split
    paired = tuning.candidates("matmul", {**sizes, "M": 1, "paired": 1})
    assert paired and all(c["BLOCK_N"] >= 32 for c in paired)
    quant = tuning.candidates("matmul", {**sizes, "M": 1, "quant": 4})
    assert quant and all(c["BLOCK_K"] <= 128 for c in quant)
    concat = tuning.candidates("matmul", {**sizes, "M": 1, "operands": 2})
    assert concat and all(c["SPLIT_K"] == 1 for c in concat)
    assert tuning.candidates("attention", {"T": 1, "L": 4096, "D": 128}) == []
    assert tuning.candidates("attention_decode", {"R": 4, "L": 4096, "D": 128}) == []
    assert tuning.candidates("norm", {"M": 4096, "N": 4096}) == []


def test_candidates_start_with_the_heuristic_and_keep_its_keys() -> None:
    sizes = dict(M=4096, N=4096, K=4096, paired=0, align=16, head_norm=0,
                 layer_norm=0, operands=1)
    found = tuning.candidates("matmul", sizes)
    heuristic = blocks.launch_config("matmul", "gpu", **sizes)
    assert found[0] == heuristic
    assert len(found) > 1 and all(set(c) == set(heuristic) for c in found)
    assert len({json.dumps(c, sort_keys=True) for c in found}) == len(found)
    assert all(c["SPLIT_K"] == 1 for c in found)
    # a head-aligned epilogue: every candidate's BLOCK_N holds whole heads
    aligned = tuning.candidates("matmul", {**sizes, "align": 256})
    assert aligned and all(c["BLOCK_N"] % 256 == 0 for c in aligned)


def test_buckets_round_up_to_powers_of_two() -> None:
    assert bucket({"M": 300, "T": 300}) == (("M", 512), ("T", 512))
    assert bucket({"M": 512, "T": 1, "S": 0}) == (("M", 512), ("T", 1), ("S", 0))
    assert bucket({"M": 513}) != bucket({"M": 512})
    assert tuning.bucket_text(bucket({"M": 17, "T": 3})) == "M=32,T=4"


# ---- the disk cache ------------------------------------------------------------------------

CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def test_cache_round_trips_by_source_bucket_and_gpu(tmp_path: Path) -> None:
    b = bucket({"M": 300, "T": 300})
    TuningCache(tmp_path, DIGEST, "NVIDIA H200").put("mm_kernel", b, CONFIG)
    path = tmp_path / "tuning" / "nvidia-h200.json"
    data = json.loads(path.read_text())
    assert data["module"] == DIGEST and data["gpu"] == "NVIDIA H200"
    assert data["choices"] == {"mm_kernel": {"M=512,T=512": CONFIG}}
    again = TuningCache(tmp_path, DIGEST, "NVIDIA H200")
    assert again.get("mm_kernel", b) == CONFIG
    assert again.get("mm_kernel", bucket({"M": 260, "T": 260})) == CONFIG     # same bucket
    assert again.get("mm_kernel", bucket({"M": 600, "T": 600})) is None       # another
    assert again.get("other_kernel", b) is None
    assert TuningCache(tmp_path, "cd" * 32, "NVIDIA H200").get("mm_kernel", b) is None
    assert TuningCache(tmp_path, DIGEST, "NVIDIA H100 80GB HBM3").get("mm_kernel", b) is None
    # a second choice keeps the first
    again.put("mm_kernel", bucket({"M": 20, "T": 20}), {**CONFIG, "BLOCK_M": 64})
    final = TuningCache(tmp_path, DIGEST, "NVIDIA H200")
    assert final.get("mm_kernel", b) == CONFIG
    assert final.get("mm_kernel", bucket({"M": 20, "T": 20}))["BLOCK_M"] == 64


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"choices": {"k": 3}}'])
def test_a_corrupt_cache_is_ignored_with_a_warning(tmp_path: Path, text: str) -> None:
    path = tmp_path / "tuning" / "nvidia-h200.json"
    path.parent.mkdir()
    path.write_text(text)
    cache = TuningCache(tmp_path, DIGEST, "NVIDIA H200")
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        assert cache.get("mm_kernel", bucket({"M": 64})) is None
    with warnings.catch_warnings():   # said once; rewritten whole at the next choice
        warnings.simplefilter("error")
        cache.put("mm_kernel", bucket({"M": 64}), CONFIG)
    assert TuningCache(tmp_path, DIGEST, "NVIDIA H200").get("mm_kernel",
                                                            bucket({"M": 64})) == CONFIG


# ---- the pre-filter and the tuner ----------------------------------------------------------

def test_prefilter_drops_configs_that_fail_or_spill(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    configs = [dict(CONFIG, BLOCK_M=m) for m in (16, 32, 64, 128)]
    asked: list[Any] = []

    def compiled(module_path: Path, target: str, pairs: list[tuple[str, dict[str, Any]]],
                 **kw: Any) -> list[aot.AotResult]:
        asked.append((module_path, target, pairs, kw))
        outcome = {16: {}, 32: {"spill_bytes": 96}, 64: {"error": "out of resources"},
                   128: {"registers": 168}}
        return [aot.AotResult(kernel, "mm", "matmul", target, **outcome[c["BLOCK_M"]])
                for kernel, c in pairs]

    monkeypatch.setattr(aot, "compile_configs", compiled)
    module = tmp_path / "model.py"
    kept = tuning.aot_prefilter(module, "sm_90a")("mm_kernel", configs)
    assert [c["BLOCK_M"] for c in kept] == [16, 128]
    (path, target, pairs, kw), = asked
    assert path == module and target == "sm_90a" and kw["cache_dir"] == tmp_path / "aot"
    assert pairs == [("mm_kernel", c) for c in configs]


class Clock:
    """A stand-in for timing: runs every candidate and calls the one with BLOCK_M = `best`
    fastest."""

    def __init__(self, best: int) -> None:
        self.best = best
        self.calls: list[list[dict[str, Any]]] = []

    def __call__(self, kernel: str, configs: list[dict[str, Any]], run: Any) -> list[float]:
        self.calls.append(configs)
        for c in configs:
            run(c)
        return [1.0 if c["BLOCK_M"] == self.best else 2.0 for c in configs]


def test_tuner_times_once_then_reads_the_cache(tmp_path: Path) -> None:
    configs = [dict(CONFIG, BLOCK_M=m) for m in (128, 64, 32)]
    b = bucket({"M": 100})
    ran: list[int] = []
    clock = Clock(best=64)
    tuner = Tuner({"mm_kernel"}, TuningCache(tmp_path, DIGEST, "NVIDIA H200"), benchmark=clock)
    assert tuner.choose("mm_kernel", b, configs, lambda c: ran.append(c["BLOCK_M"]))["BLOCK_M"] \
        == 64
    assert ran == [128, 64, 32]
    assert tuner.choose("mm_kernel", b, configs, lambda c: None)["BLOCK_M"] == 64
    stats = tuner.summary()
    assert (stats["kernels_tuned"], stats["cache_misses"], stats["cache_hits"]) == (1, 1, 1)
    assert stats["seconds"] > 0
    # a new session (process) on the same GPU: read from disk, nothing timed
    fresh = Tuner({"mm_kernel"}, TuningCache(tmp_path, DIGEST, "NVIDIA H200"), benchmark=clock)
    assert fresh.choose("mm_kernel", b, configs, lambda c: None)["BLOCK_M"] == 64
    assert len(clock.calls) == 1 and fresh.summary()["cache_hits"] == 1
    assert fresh.summary()["seconds"] == 0
    # another GPU tunes anew
    other = Tuner({"mm_kernel"}, TuningCache(tmp_path, DIGEST, "NVIDIA A100-SXM4-80GB"),
                  benchmark=clock)
    other.choose("mm_kernel", b, configs, lambda c: None)
    assert len(clock.calls) == 2 and other.summary()["cache_misses"] == 1


def test_tuner_never_has_an_empty_set(tmp_path: Path) -> None:
    """Every candidate dropped: the heuristic (the first) launches, nothing is timed."""
    configs = [dict(CONFIG, BLOCK_M=m) for m in (128, 64)]
    clock = Clock(best=64)
    tuner = Tuner({"mm_kernel"}, TuningCache(tmp_path, DIGEST, "NVIDIA H200"),
                  prefilter=lambda kernel, cs: [], benchmark=clock)
    assert tuner.choose("mm_kernel", bucket({"M": 100}), configs, lambda c: None) == configs[0]
    assert not clock.calls and tuner.summary()["configs_dropped"] == 2
    # one left after the pre-filter: launched as it is, nothing timed
    tuner = Tuner({"mm_kernel"}, TuningCache(tmp_path / "b", DIGEST, "NVIDIA H200"),
                  prefilter=lambda kernel, cs: cs[1:], benchmark=clock)
    assert tuner.choose("mm_kernel", bucket({"M": 100}), configs, lambda c: None) == configs[1]
    assert not clock.calls


# ---- a tuned launch, end to end under the interpreter --------------------------------------

def test_tuned_launch_runs_the_chosen_config(kernel_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A session forced to tune: the matmul's launch (M = 21 > 16) is recorded as a tuned
    kernel, each candidate runs, the chosen one computes what eager does and is kept on disk;
    a second session reads it back and times nothing."""
    clock = Clock(best=16)
    tuners: list[Tuner] = []
    launched: list[tuning.TunedKernel] = []

    class Watched(Tuner):
        def kernel(self, *args: Any) -> tuning.TunedKernel:
            launched.append(super().kernel(*args))
            return launched[-1]

    def stand_in(kernels: Any, module_path: Path, digest: str, device: torch.device) -> Tuner:
        tuners.append(Watched(tuning.tuned_kernels(kernels),
                            TuningCache(module_path.parent, digest, "Test GPU"),
                            prefilter=lambda kernel, cs: [c for c in cs if c["BLOCK_M"] <= 32],
                            benchmark=clock))
        return tuners[-1]

    monkeypatch.setattr(tuning, "tuning_enabled", lambda *a: True)
    monkeypatch.setattr(backend, "_tuner", stand_in)
    g = matmul_graph()
    values = {"x": rand(3, 7, 24), "w": rand(40, 24) / 24 ** 0.5}
    check(g, values, {"B": 3, "T": 7, "P": 0}, tmp_path)
    tuner, = tuners
    (tried,) = clock.calls
    assert len(tried) == 4 and any(c["BLOCK_M"] == 16 for c in tried)
    assert tuner.summary()["kernels_tuned"] == 1 and tuner.summary()["configs_dropped"] > 0
    name, = tuner.tuned
    saved = json.loads(next((tmp_path).glob("*/tuning/test-gpu.json")).read_text())
    # the bucket: M and T rounded up to powers of two, the kernel's constexpr N and K as they are
    assert saved["choices"][name]["M=32,T=8,N=40,K=24"]["BLOCK_M"] == 16
    tuned, = launched                                           # the plan's launch, chosen
    assert tuned.bucket == (("M", 32), ("T", 8), ("N", 40), ("K", 24))
    assert tuned.config == saved["choices"][name]["M=32,T=8,N=40,K=24"]
    check(g, values | {"x": rand(3, 5, 24)}, {"B": 3, "T": 5, "P": 0}, tmp_path)  # M=15: decode
    check(g, values | {"x": rand(3, 6, 24)}, {"B": 3, "T": 6, "P": 0}, tmp_path)  # M=18: cached
    # decode's own candidates (GEMV tiles of 16 rows), then the prefill choice from the cache
    assert len(clock.calls) == 2 and all(c["BLOCK_M"] == 16 for c in clock.calls[1])
    assert len(launched) == 3 and launched[2].config["BLOCK_M"] == 16
    assert [t.summary()["cache_hits"] for t in tuners] == [0, 0, 1]


def tune_with(monkeypatch: pytest.MonkeyPatch, benchmark: tuning.Benchmark) -> None:
    """Sessions tune (as on a GPU) with `benchmark` standing in for the timer."""
    monkeypatch.setattr(tuning, "tuning_enabled", lambda *a: True)
    monkeypatch.setattr(backend, "_tuner", lambda kernels, module_path, digest, device: Tuner(
        tuning.tuned_kernels(kernels), TuningCache(module_path.parent, digest, "Test GPU"),
        benchmark=benchmark))


def normed_projection(b: GraphBuilder, i: dict[str, int]) -> int:
    """A projection with a folded RMSNorm: its row statistics in the K loop or a pre-pass."""
    return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], prologue="rms", eps=1e-5,
                  epilogue=(Call("rms_scale"),))


def test_a_tuned_decode_gemv_splits_its_k_loop_and_replays_its_choice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-size launch (M = 2) of a normed projection, tuned under the interpreter: every
    candidate runs — split-K ones among them, their partial sums (the norm's Σx² too) in a
    scratch sized for the largest — and the stand-in timer calls the one with the most splits
    fastest. The launch computes what eager does, its arrival counters end at zero, and the
    choice is kept at the bucket M=2, T=1 (N=40, K=512). The plan is a decode step's fixed
    shape: replayed, it launches the chosen config and times nothing again."""
    calls: list[list[dict[str, Any]]] = []

    def most_splits(kernel: str, configs: list[dict[str, Any]], run: Any) -> list[float]:
        calls.append(configs)
        for c in configs:
            run(c)
        best = max(c["SPLIT_K"] for c in configs)
        first = next(i for i, c in enumerate(configs) if c["SPLIT_K"] == best)
        return [1.0 if i == first else 2.0 for i in range(len(configs))]

    tune_with(monkeypatch, most_splits)
    k = 512                                              # 4 steps of 128, 2 of 256
    g = build({"x": (shape(B, T, k), "f32"), "w": (shape(40, k), "f32")}, normed_projection)
    s = TritonSession(Program(g.name, (g,)), {}, max_seq_len=64, device="cpu",
                      options=TritonOptions(passes=None, cache_dir=tmp_path))
    runner = s.runners[g.name]
    plan = runner.plan(s.ctx, 2, 1, 0, 0, 1)
    assert len(plan.launches) == 1 and not calls     # one launch; chosen when it first runs
    values = {"x": rand(2, 1, k), "w": rand(40, k) / k ** 0.5}
    want = run_graph(g, {}, values, EagerContext({"B": 2, "T": 1, "P": 0, "S": 0}, None))["y"]
    for step in range(2):
        runner.feed(plan, values)
        runner.execute(plan, s.ctx, 0)
        got = plan.outputs["y"]
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), f"step {step}"
        assert not s.ctx.counters("matmul_splitk", 3).any()  # ⌈40 / 16⌉ tiles at most
    (tried,) = calls                                     # timed once, at the first launch
    assert {c["SPLIT_K"] for c in tried} >= {1, 2} and all(c["BLOCK_M"] == 16 for c in tried)
    chosen = s.tuner.cache.get(next(iter(s.tuner.tuned)),
                               (("M", 2), ("T", 1), ("N", 40), ("K", k)))
    assert chosen is not None and chosen["SPLIT_K"] == max(c["SPLIT_K"] for c in tried) > 1


@pytest.mark.parametrize("pick", [0, -1])
def test_every_candidate_of_a_normed_projection_is_right(pick: int, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A folded RMSNorm's projection tuned at prefill size: whichever candidate wins (the
    heuristic, first; a tile of the list, last), the launch computes what eager does — each
    candidate reads the row statistics of the pre-pass its launcher ran."""

    def fastest(kernel: str, configs: list[dict[str, Any]], run: Any) -> list[float]:
        for c in configs:
            run(c)
        return [1.0 if i == range(len(configs))[pick] else 2.0 for i in range(len(configs))]

    tune_with(monkeypatch, fastest)
    g = build({"x": (shape(B, T, 24), "f32"), "w": (shape(40, 24), "f32")}, normed_projection)
    check(g, {"x": rand(3, 7, 24), "w": rand(40, 24) / 24 ** 0.5}, {"B": 3, "T": 7, "P": 0},
          tmp_path)


# ---- the command line ----------------------------------------------------------------------

class Compiled(Exception):
    """Raised by a stand-in compile, with what it was given."""


@pytest.mark.parametrize("command", ["run", "chat"])
def test_no_autotune_reaches_the_session(command: str) -> None:
    from archc.commands.common import Run

    class Model:
        def compile(self, backend: str, **options: Any) -> Any:
            raise Compiled(backend, options)

    for flags, want in (([], None), (["--no-autotune"], False)):
        args = build_parser().parse_args([command, "tiny-llama3", "--backend", "triton",
                                          "--device", "cpu", *flags])
        with pytest.raises(Compiled) as got:
            Run(args).compile(Model())
        assert got.value.args[1].get("autotune") is want
    # the eager backend has nothing to tune: the flag is not passed on
    args = build_parser().parse_args([command, "tiny-llama3", "--no-autotune", "--device", "cpu"])
    with pytest.raises(Compiled) as got:
        Run(args).compile(Model())
    assert "autotune" not in got.value.args[1]


def test_no_autotune_reaches_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    import archc.runtime.validation as validation
    from archc.cli import main

    def stand_in(model: Any, **kw: Any) -> Any:
        raise Compiled(kw)

    monkeypatch.setattr(validation, "validate", stand_in)
    for flags, want in (([], None), (["--no-autotune"], False)):   # None: the default
        with pytest.raises(Compiled) as got:
            main(["validate", "tiny-llama3", "--device", "cpu", *flags])
        assert got.value.args[0]["autotune"] is want


def test_no_autotune_reaches_bench() -> None:
    from archc.commands.bench import config_of
    for flags, want in (([], True), (["--no-autotune"], False)):
        args = build_parser().parse_args(["bench", "tiny-llama3", "--dry-run", *flags])
        assert config_of(args).autotune is want


def test_compile_takes_autotune(kernel_dir: Path) -> None:
    import archc
    compiled = archc.load("tiny-llama3").compile("triton", autotune=False,
                                                 cache_dir=kernel_dir)
    assert compiled.session.options.autotune is False
    assert compiled.session.tuning_stats()["enabled"] is False


def test_the_kernel_cache_counts_and_clears_tuning(tmp_path: Path) -> None:
    from archc import kernel_cache
    entry = tmp_path / "0123456789abcdef01234567"
    entry.mkdir()
    (entry / "model.py").write_text("KERNELS = {}\n")
    TuningCache(entry, DIGEST, "NVIDIA H200").put("mm_kernel", bucket({"M": 64}), CONFIG)
    tuned = entry / "tuning" / "nvidia-h200.json"
    found, = kernel_cache.entries(tmp_path)
    assert found.models == ("model",)
    assert found.bytes == len("KERNELS = {}\n") + tuned.stat().st_size
    kernel_cache.trim(tmp_path, cap=0)
    assert not tuned.exists()


def test_a_candidate_that_fails_to_run_is_ruled_out(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    import triton.testing

    def bench(fn: Any, **kw: Any) -> float:
        fn()
        return 3.0                                  # milliseconds

    def run(config: dict[str, Any]) -> None:
        if config["BLOCK_M"] != 64:
            raise RuntimeError("out of shared memory")

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    configs = [dict(CONFIG, BLOCK_M=m) for m in (128, 64, 32)]
    assert tuning.time_configs("mm_kernel", configs, run) == [float("inf"), 3e-3, float("inf")]
    tuner = Tuner({"mm_kernel"}, TuningCache(tmp_path, DIGEST, "NVIDIA H200"))
    assert tuner.choose("mm_kernel", bucket({"M": 64}), configs, run)["BLOCK_M"] == 64
    # none runs: the heuristic
    tuner = Tuner({"mm_kernel"}, TuningCache(tmp_path / "b", DIGEST, "NVIDIA H200"))
    assert tuner.choose("mm_kernel", bucket({"M": 64}), configs[::2], run) == configs[0]
