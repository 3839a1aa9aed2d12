"""`archc bench` on the CPU: the dry run of the whole harness, its refusals, the torch baseline
program and the per-kernel PyTorch counterparts.

The dry run launches the generated kernels under Triton's interpreter and times with the host
clock: its numbers mean nothing, but every section must run, every counterpart must compute what
its kernel computes (f32: 1e-4 of the output scale, as in validation), and the report must hold
every field the GPU run fills.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

import archc
from archc.cli import main
from archc.ir.graph import CROSS_KV
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.passes import optimize
from archc.perf.baselines import Counterpart, Unavailable, counterparts, scratch_caches
from archc.perf.bench import TOLERANCE, run_bench
from archc.runtime.eager import (
    EagerContext,
    EagerSession,
    KVCache,
    RecurrentState,
    Trace,
    run_graph,
)
from archc.runtime.weights import materialize
from tests.conftest import TINY_SPECS

# The dry run chooses Triton's interpreter, for the rest of the process: not beside GPU tests.
# On a GPU, bench/gpu_check.sh runs `archc bench` itself.
CONTEXTS = (12, 20)      # the dry run's --contexts: past lengths beyond its prompt of 8

cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="the dry run is the CPU stand-in for archc bench")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    path = out / "tiny.json"
    rc = main(["bench", "tiny-llama3", "--dry-run", "--compile-modes", "default",
               "--contexts", *map(str, CONTEXTS), "-o", str(path),
               "--cache-dir", str(out / "kernels")])
    assert rc == 0
    return json.loads(path.read_text())


@cpu_only
def test_dry_run_completes_every_section(dry_run: dict) -> None:
    assert dry_run["schema"] == "archc-bench/1" and dry_run["dry_run"]
    assert dry_run["errors"] == []
    assert set(dry_run["status"].values()) == {"done"}
    sections = set(dry_run["status"])
    for runner in ("torch eager", "archc", "torch.compile default"):
        assert {f"model:{runner}:prefill", f"model:{runner}:decode"} <= sections
        assert {f"model:{runner}:decode@{c}" for c in CONTEXTS} <= sections
    assert {"setup", "ceilings", "kernels:prefill", "kernels:decode"} <= sections
    assert {f"kernels:decode@{c}" for c in CONTEXTS} <= sections


@cpu_only
def test_dry_run_checks_recurrent_kernels_from_the_state_they_read(tmp_path: Path) -> None:
    """Each timed launch of a recurrent kernel advances its state; the launch whose output is
    checked starts again from the state the run left (zeros at the prefill), as its torch
    counterpart does: they agree at the prefill and at a decode step."""
    path = tmp_path / "mamba.json"
    assert main(["bench", "tiny-mamba", "--dry-run", "--compile-modes", "default", "-o",
                 str(path), "--cache-dir", str(tmp_path / "kernels")]) == 0
    data = json.loads(path.read_text())
    assert data["errors"] == [] and set(data["status"].values()) == {"done"}
    rows = [r for r in data["kernels"] if r["op"] in ("causal_conv", "ssm_scan")]
    assert {(r["phase"], r["op"]) for r in rows} == {
        (phase, op) for phase in ("prefill", "decode") for op in ("causal_conv", "ssm_scan")}
    assert all(b["agrees"] for r in rows for b in r["baselines"])
    assert data["model"]["decode"]["state_bytes"] > 0


@cpu_only
def test_dry_run_times_every_unique_kernel_once_per_phase(dry_run: dict) -> None:
    for phase in ("prefill", "decode"):
        rows = [r for r in dry_run["kernels"] if r["phase"] == phase]
        assert len(rows) == dry_run["unique_kernels"]
        assert sum(r["launches"] for r in rows) == dry_run["launches_per_pass"]["decoder"]
        for r in rows:
            assert r["error"] is None and r["archc_seconds"] > 0
            assert r["roofline_fraction"] == pytest.approx(r["roofline_seconds"] /
                                                           r["archc_seconds"])


@cpu_only
def test_dry_run_counterparts_compute_what_the_kernels_compute(dry_run: dict) -> None:
    checked = 0
    for r in dry_run["kernels"]:
        names = {b["name"] for b in r["baselines"]}
        if r["op"] == "fused_linear":
            assert {"torch.matmul", "unfused"} <= names
        if r["op"] == "attention":
            assert {"sdpa", "unfused"} <= names
        for b in r["baselines"]:
            assert b["seconds"] > 0
            assert b["archc_speedup"] == pytest.approx(b["seconds"] / r["archc_seconds"])
            if "max_rel_error" in b:
                assert b["agrees"], (r["kernel"], b)
                checked += 1
    assert checked >= 12  # unfused and sdpa, both phases


@cpu_only
def test_dry_run_whole_model_numbers(dry_run: dict) -> None:
    pre, dec = dry_run["model"]["prefill"], dry_run["model"]["decode"]
    names = [r["name"] for r in pre["runs"]]
    assert names == ["torch eager", "archc", "torch.compile default"]
    for r in pre["runs"]:
        assert r["seconds"] > 0 and r["peak_fraction"] < 1
        # same weights, same tokens: every runner's logits agree with eager's
        if r["name"] != "torch eager":
            assert r["max_rel_error_vs_eager"] < TOLERANCE["f32"]
    archc_run = next(r for r in dec["runs"] if r["name"] == "archc")
    assert archc_run["archc_speedup"] == 1.0
    for r in dec["runs"]:
        assert r["tokens_per_second"] == pytest.approx(1 / r["step_seconds"])
        assert r["floor_fraction"] == pytest.approx(dec["floor_seconds"] / r["step_seconds"])
    # the decode floor averages the first and last step: weights once, the KV cache grows
    assert dec["bytes_per_step"] == pytest.approx(dec["weight_bytes"] + dec["kv_bytes_mean"])


@cpu_only
def test_dry_run_decodes_at_each_context(dry_run: dict) -> None:
    """Each context: every runner decoded after a prefill of that many tokens, against the
    floor at that length (the same weights, a KV cache as long as the context)."""
    spec = archc.load("tiny-llama3").spec
    main_decode = dry_run["model"]["decode"]
    entries = dry_run["model"]["contexts"]
    assert [e["context"] for e in entries] == list(CONTEXTS) == dry_run["shapes"]["contexts"]
    m = dry_run["shapes"]["decode"]
    heads, hd = spec.attention.kv_heads, spec.d_model // spec.attention.heads
    for e in entries:
        c = e["context"]
        assert (e["past_first"], e["past_last"], e["steps"]) == (c, c + m - 1, m)
        assert e["weight_bytes"] == main_decode["weight_bytes"]
        # K and V of every layer over c + 1 … c + m keys, f32: the mean step's
        keys = (c + 1 + c + m) / 2
        assert e["kv_bytes_mean"] == pytest.approx(2 * spec.layers * heads * hd * keys * 4)
        assert e["bytes_per_step"] == pytest.approx(e["weight_bytes"] + e["kv_bytes_mean"])
        assert e["floor_seconds"] == pytest.approx(e["bytes_per_step"] /
                                                   dry_run["gpu_model"]["bandwidth"])
        assert [r["name"] for r in e["runs"]] == [r["name"] for r in main_decode["runs"]]
        archc_run = next(r for r in e["runs"] if r["name"] == "archc")
        for r in e["runs"]:
            assert r["step_seconds"] > 0
            assert r["tokens_per_second"] == pytest.approx(1 / r["step_seconds"])
            assert r["floor_fraction"] == pytest.approx(e["floor_seconds"] / r["step_seconds"])
            assert r["bandwidth"] == pytest.approx(e["bytes_per_step"] / r["step_seconds"])
            assert r["archc_speedup"] == pytest.approx(r["step_seconds"] /
                                                       archc_run["step_seconds"])
    assert entries[1]["kv_bytes_mean"] > entries[0]["kv_bytes_mean"]


@cpu_only
def test_dry_run_times_decode_attention_at_each_context_beside_a_copy(dry_run: dict) -> None:
    """The attention kernel runs at the context's past length: sdpa over the cache's first
    P + 1 keys computes what it computed, and the copy moved the bytes of those keys."""
    spec = archc.load("tiny-llama3").spec
    unique = {r["kernel"] for r in dry_run["kernels"] if r["op"] == "attention"}
    heads, hd = spec.attention.kv_heads, spec.d_model // spec.attention.heads
    for e in dry_run["model"]["contexts"]:
        c, rows = e["context"], e["attention"]
        assert {r["kernel"] for r in rows} == unique and len(rows) == len(unique)
        for r in rows:
            assert r["phase"] == f"decode@{c}" and r["error"] is None
            assert r["sizes"]["T"] == 1 and r["sizes"]["L"] == c + 1
            assert r["kv_bytes"] == 2 * heads * (c + 1) * hd * 4
            assert r["copy_bandwidth"] == pytest.approx(2 * r["kv_bytes"] / r["copy_seconds"])
            assert r["copy_fraction"] == pytest.approx(r["achieved_bandwidth"] /
                                                       r["copy_bandwidth"])
            sdpa = next(b for b in r["baselines"] if b["name"] == "sdpa")
            assert sdpa["agrees"], sdpa
    # the kernels section's decode attention gets the same copy beside it
    for r in dry_run["kernels"]:
        if r["phase"] == "decode" and r["op"] == "attention":
            assert r["copy_fraction"] == pytest.approx(r["achieved_bandwidth"] /
                                                       r["copy_bandwidth"])


@cpu_only
def test_the_context_floor_is_of_the_layers_kept(tmp_path: Path) -> None:
    """--layers 1: the floor counts one block's matrices, the head and one embedding row —
    counted here from the spec's sizes. Without the kernel section no attention is timed."""
    path = tmp_path / "one.json"
    assert main(["bench", "tiny-llama3", "--dry-run", "--layers", "1", "--no-kernels",
                 "--compile-modes", "none", "--contexts", "16", "-o", str(path),
                 "--cache-dir", str(tmp_path / "kernels")]) == 0
    data = json.loads(path.read_text())
    spec = archc.load("tiny-llama3").spec
    d, hd = spec.d_model, spec.d_model // spec.attention.heads
    qkvo = d * hd * (2 * spec.attention.heads + 2 * spec.attention.kv_heads)
    block = qkvo + 3 * d * spec.ffn.d_ff
    (entry,) = data["model"]["contexts"]
    assert data["layers"] == 1 and data["spec_layers"] == 2
    assert entry["weight_bytes"] == 4 * (block + spec.vocab_size * d + d)
    assert entry["attention"] == [] and "kernels:decode@16" not in data["status"]
    assert [r["name"] for r in entry["runs"]] == ["torch eager", "archc"]
    assert set(data["status"].values()) == {"done"}


def test_torch_compile_decodes_a_new_context_without_recompiling() -> None:
    """A context's prefill runs the eager program (no compiled prefill per length); the
    compiled decode then continues from that cache without a recompile."""
    from torch._dynamo.testing import CompileCounter
    model = archc.load("tiny-llama3")
    plain = EagerSession(lower(model.spec, "f32"), model.weights, max_seq_len=64, checks=False)
    ids = torch.randint(0, model.spec.vocab_size, (1, 20), generator=torch.Generator()
                        .manual_seed(0))
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(plain.logits, backend=counter)
    compiled(ids[:, :9], 0)
    for past in range(9, 12):       # tokens of their own, as the argmax makes them
        compiled(ids[:, past:past + 1].clone(), past)
    assert counter.frame_count == 2     # the prefill, and the decode with P symbolic
    plain.logits(ids[:, :16], 0)
    reference = EagerSession(lower(model.spec, "f32"), model.weights, max_seq_len=64)
    reference.step(ids[:, :16])
    for past in range(16, 19):
        token = ids[:, past - 15:past - 14].clone()
        assert torch.allclose(compiled(token, past), reference.step(token), atol=1e-5, rtol=0)
    assert counter.frame_count == 2
    torch._dynamo.reset()


def _fabricated(archc_ms: dict[int, float], compile_ms: dict[int, tuple[float, float]],
                floor_fraction: dict[int, float], copy: dict[int, float]) -> dict:
    """A report's data with made-up decode numbers at each context: archc's step time and
    fraction of the floor, two torch.compile modes' step times, attention's copy fraction."""
    def runs(c: int) -> list[dict]:
        modes = zip(("default", "max-autotune-no-cudagraphs"), compile_ms[c])
        return [{"name": "torch eager", "step_seconds": 9e-3},
                {"name": "archc (CUDA graphs)", "step_seconds": archc_ms[c] * 1e-3,
                 "floor_fraction": floor_fraction[c]},
                *({"name": f"torch.compile {m}", "step_seconds": t * 1e-3} for m, t in modes)]
    return {"kernels": [], "ceilings": None,
            "model": {"prefill": {"runs": []},
                      "decode": {"past_first": max(archc_ms), "runs": runs(max(archc_ms))},
                      "contexts": [{"context": c, "runs": runs(c),
                                    "attention": [{"copy_fraction": copy[c]}]}
                                   for c in archc_ms]}}


def _decode_goals(cfg: object, data: dict) -> dict[str, dict]:
    """The three decode goals of `data` after a save (the speed-ups from the step times, then
    the goals), by what they hold against: bound, torch.compile, copy."""
    from archc.perf.bench import Report
    Report(cfg, data).save()            # type: ignore[arg-type]
    keys = {"bandwidth bound": "bound", "torch.compile": "compile", "a device-to-device copy":
            "copy"}
    return {key: g for g in data["goals"] for text, key in keys.items() if text in g["goal"]}


def test_decode_goals_are_evaluated_on_the_worst_context() -> None:
    """Fabricated numbers: each decode goal takes the worst context (and the slowest
    torch.compile mode) and says whether it reaches its target; a dry run or a batch other
    than 1 makes them not apply; without contexts the main decode run is judged."""
    import dataclasses

    from archc.cli import build_parser
    from archc.commands.bench import config_of
    cfg = dataclasses.replace(config_of(build_parser().parse_args(
        ["bench", "llama3-8b", "--dry-run", "--dtype", "f16", "--layers", "4",
         "--contexts", "512", "2048"])), dry_run=False)
    goals = _decode_goals(cfg, _fabricated(
        {512: 1.0, 2048: 2.0}, {512: (1.5, 1.3), 2048: (2.5, 2.38)},
        {512: 0.85, 2048: 0.78}, {512: 0.95, 2048: 0.92}))
    bound, compiled, copy = goals["bound"], goals["compile"], goals["copy"]
    assert (bound["measured"], bound["target"], bound["met"]) == (0.78, 0.80, False)
    assert "context 512: 85%" in bound["note"] and "context 2048: 78%" in bound["note"]
    assert compiled["measured"] == pytest.approx(1.19)
    assert (compiled["target"], compiled["met"]) == (1.2, False)
    assert (copy["measured"], copy["target"], copy["met"]) == (0.92, 0.9, True)
    assert all(g["applies"] for g in goals.values())

    goals = _decode_goals(cfg, _fabricated(
        {512: 1.0, 2048: 2.0}, {512: (1.5, 1.3), 2048: (2.5, 2.4)},
        {512: 0.85, 2048: 0.80}, {512: 0.89, 2048: 0.92}))
    assert {k: g["met"] for k, g in goals.items()} == {"bound": True, "compile": True,
                                                        "copy": False}

    # no contexts: the main decode run is judged; no attention was timed beside a copy
    data = _fabricated({2048: 2.0}, {2048: (2.6, 2.5)}, {2048: 0.81}, {2048: 0.95})
    data["model"]["contexts"] = []
    goals = _decode_goals(cfg, data)
    assert goals["bound"]["measured"] == 0.81 and goals["bound"]["met"]
    assert goals["compile"]["measured"] == pytest.approx(1.25) and goals["compile"]["met"]
    assert goals["copy"]["measured"] is None and goals["copy"]["met"] is None

    for other in (dataclasses.replace(cfg, dry_run=True), dataclasses.replace(cfg, batch=2)):
        goals = _decode_goals(other, _fabricated({512: 1.0}, {512: (1.5, 1.3)}, {512: 0.85},
                                                 {512: 0.95}))
        assert not goals["bound"]["applies"] and goals["bound"]["met"] is None
        assert not goals["compile"]["applies"] and goals["compile"]["met"] is None
        assert goals["copy"]["applies"] == (not other.dry_run)


def _llama_cfg(*flags: str) -> object:
    """llama3-8b's bench configuration at a 2048-token prompt, as a GPU run (not dry)."""
    import dataclasses

    from archc.cli import build_parser
    from archc.commands.bench import config_of
    return dataclasses.replace(config_of(build_parser().parse_args(
        ["bench", "llama3-8b", "--dry-run", "--dtype", "f16", "--layers", "4",
         "--prompt-len", "2048", *flags])), dry_run=False, dtype="bf16")


def _prefill_data(device: str, matmuls: dict[str, tuple[float, float]], sdpa: float,
                  attention_tflops: float, head_dim: int = 128, tokens: int = 2048) -> dict:
    """A report's data with made-up prefill kernels: each matmul's speed-ups over torch.matmul
    and the unfused sequence, attention's over sdpa and its TFLOP/s (FlashAttention's count)."""
    from archc.perf.bench import flash_attention_flops

    def matmul(name: str, ratios: tuple[float, float]) -> dict:
        return {"phase": "prefill", "op": "fused_linear", "kernel": name, "prologue": None,
                "epilogue": [], "baselines": [
                    {"name": b, "seconds": 1e-3 * r, "archc_speedup": r}
                    for b, r in zip(("torch.matmul", "unfused"), ratios)]}
    sizes = {"B": 1, "H": 32, "H_kv": 8, "T": tokens, "L": tokens, "D": head_dim}
    flops = flash_attention_flops(sizes, True)
    attention = {"phase": "prefill", "op": "attention", "kernel": "attention_0", "sizes": sizes,
                 "causal": True, "fa_flops": flops, "archc_seconds": flops / attention_tflops,
                 "fa_flops_per_second": attention_tflops,
                 "baselines": [{"name": "sdpa", "seconds": 1e-3, "archc_speedup": sdpa}]}
    return {"kernels": [*(matmul(k, r) for k, r in matmuls.items()), attention],
            "environment": {"device_name": device}, "ceilings": None,
            "model": {"prefill": {"runs": []}, "decode": {"runs": []}, "contexts": []}}


def _prefill_goals(cfg: object, data: dict) -> dict[str, dict]:
    from archc.perf.bench import Report
    Report(cfg, data).save()            # type: ignore[arg-type]
    return {g["key"]: g for g in data["goals"] if g["key"].startswith("prefill_")}


def test_flash_attention_flops_count_the_two_products() -> None:
    from archc.perf.bench import flash_attention_flops
    sizes = {"B": 2, "H": 4, "T": 64, "L": 64, "D": 128}
    assert flash_attention_flops(sizes, False) == 4 * 2 * 4 * 64 * 64 * 128
    assert flash_attention_flops(sizes, True) == 2 * 2 * 4 * 64 * 64 * 128
    # queries after a past: a causal mask hides part of the keys, not half of them
    assert flash_attention_flops({**sizes, "T": 1, "L": 65}, True) == 4 * 2 * 4 * 65 * 128


def test_prefill_goals_are_evaluated_on_the_slowest_kernel() -> None:
    """Fabricated numbers: every prefill fused matmul (a plain one too) is held against
    torch.matmul on the same GEMM, the slowest named first; attention against sdpa and, in
    TFLOP/s, against FlashAttention-3's published 625 TFLOP/s at length 2k, head dim 128
    (arXiv:2407.08608, Fig. 5) — judged on an H100 or H200 only, at a comparable shape."""
    cfg = _llama_cfg()
    goals = _prefill_goals(cfg, _prefill_data(
        "NVIDIA H100 80GB HBM3", {"fused_linear_0": (0.97, 1.4), "fused_linear_2": (0.93, 1.1)},
        1.3, 500e12))
    torch_mm, unfused = goals["prefill_matmul_vs_torch_matmul"], goals["prefill_matmul_vs_unfused"]
    assert (torch_mm["measured"], torch_mm["target"], torch_mm["met"]) == (0.93, 0.95, False)
    assert torch_mm["note"] == ("2 kernels, slowest first: fused_linear_2: 0.93×, "
                                "fused_linear_0: 0.97×")
    assert (unfused["measured"], unfused["met"]) == (1.1, True)
    sdpa, fa3 = goals["prefill_attention_vs_sdpa"], goals["prefill_attention_vs_fa3"]
    assert (sdpa["measured"], sdpa["met"]) == (1.3, True)
    assert fa3["measured"] == pytest.approx(500 / 625) and fa3["target"] == 0.75
    assert fa3["applies"] and fa3["met"] is True
    assert "500 TFLOP/s vs 625 at length 2048" in fa3["note"] and "2407.08608" in fa3["note"]

    # an H200 is judged too, against the H100's figure; slower than 0.75× is not met
    goals = _prefill_goals(cfg, _prefill_data("NVIDIA H200", {"fused_linear_0": (0.96, 1.2)},
                                              1.1, 450e12))
    fa3 = goals["prefill_attention_vs_fa3"]
    assert fa3["applies"] and fa3["measured"] == pytest.approx(0.72) and fa3["met"] is False
    assert goals["prefill_matmul_vs_torch_matmul"]["met"] is True
    assert goals["prefill_attention_vs_sdpa"]["met"] is False

    # another GPU, a 32-bit run or a dry run: measured, not judged; a head dim or length the
    # figure does not cover: nothing to compare
    import dataclasses
    for other, device in ((cfg, "NVIDIA A100-SXM4-80GB"), (dataclasses.replace(cfg, dtype="f32"),
                          "NVIDIA H100"), (dataclasses.replace(cfg, dry_run=True), "NVIDIA H100")):
        fa3 = _prefill_goals(other, _prefill_data(device, {}, 1.3, 500e12))[
            "prefill_attention_vs_fa3"]
        assert fa3["measured"] == pytest.approx(0.8)
        assert not fa3["applies"] and fa3["met"] is None
    for head_dim, tokens in ((64, 2048), (128, 256)):
        fa3 = _prefill_goals(cfg, _prefill_data("NVIDIA H100", {}, 1.3, 500e12, head_dim,
                                                tokens))["prefill_attention_vs_fa3"]
        assert fa3["measured"] is None and not fa3["applies"] and fa3["met"] is None
    # between published lengths: the figure at the longest length not above the prompt
    fa3 = _prefill_goals(cfg, _prefill_data("NVIDIA H100", {}, 1.3, 500e12, 128, 3000))[
        "prefill_attention_vs_fa3"]
    assert fa3["measured"] == pytest.approx(500 / 625)


class _FakeSession:
    """A session whose tuning cache is one file under its kernel cache directory: the first
    prefill tunes (slowly) and writes it, a later session finds it."""

    def __init__(self, cache_dir: Path, autotune: bool, stats: bool) -> None:
        assert autotune
        self.cached = (cache_dir / "tuning.json").exists()
        self.cache_dir = cache_dir
        if not stats:
            self.tuning_stats = None        # type: ignore[assignment]

    def step(self, tokens: torch.Tensor) -> None:
        if not self.cached:
            import time
            time.sleep(0.2)
            (self.cache_dir / "tuning.json").write_text("{}")

    def tuning_stats(self) -> dict:
        hit = int(self.cached)
        return {"seconds": 0.0 if hit else 0.2, "kernels_tuned": 1 - hit, "cache_hits": hit,
                "cache_misses": 1 - hit}


def test_autotune_first_run_cost_is_measured_on_an_empty_cache() -> None:
    """Two sessions on one fresh kernel cache directory: the first finds it empty and tunes,
    the second reads what the first chose; both timed, with the sessions' tuning statistics
    (or a note that the session has none). The summary shows it."""
    import dataclasses

    from archc.perf.bench import autotune_entry, measure_autotune
    from archc.perf.summary import autotune_headline
    cfg = _llama_cfg()
    assert autotune_entry(dataclasses.replace(cfg, dry_run=True))["applicable"] is False
    gpu = dataclasses.replace(cfg, device=torch.device("cuda"))
    off = autotune_entry(dataclasses.replace(gpu, autotune=False))
    assert not off["applicable"] and "autotuning is off" in off["reason"]
    assert autotune_entry(dataclasses.replace(gpu, autotune=True))["applicable"] is True

    dirs: list[Path] = []

    def make(stats: bool):  # noqa: ANN202
        def session(cache_dir: Path, autotune: bool) -> _FakeSession:
            if not dirs:
                assert not any(cache_dir.iterdir())     # the first run's cache is empty
            dirs.append(cache_dir)
            return _FakeSession(cache_dir, autotune, stats)
        return session
    entry = {"applicable": True, "runs": [], "tuning_stats": None}
    measure_autotune(cfg, make(True), torch.zeros(1, 4, dtype=torch.long), entry)
    first, second = entry["runs"]
    assert dirs[0] == dirs[1] and not dirs[0].exists()      # one directory, removed after
    assert first["tuning"] == {"seconds": 0.2, "kernels_tuned": 1, "cache_hits": 0,
                               "cache_misses": 1}
    assert second["tuning"]["cache_hits"] == 1 and second["tuning"]["kernels_tuned"] == 0
    assert first["prefill_seconds"] >= 0.2 > second["prefill_seconds"]
    for r in (first, second):
        assert r["seconds"] == pytest.approx(r["build_seconds"] + r["prefill_seconds"])
    assert entry["first_run_extra_seconds"] == first["seconds"] - second["seconds"]
    assert entry["tuning_stats"] == "available"
    (line,) = autotune_headline(entry)
    assert line.startswith(f"  autotune first run: {first['seconds']:.1f} s to build and "
                           "prefill (tuning 0.2 s, 1 kernels tuned, cache 0 hits / 1 misses); "
                           f"second run {second['seconds']:.1f} s (tuning 0.0 s, 0 kernels")

    dirs.clear()
    entry = {"applicable": True, "runs": [], "tuning_stats": None}
    measure_autotune(cfg, make(False), torch.zeros(1, 4, dtype=torch.long), entry)
    assert [r["tuning"] for r in entry["runs"]] == [None, None]
    assert entry["tuning_stats"].startswith("unavailable")
    assert autotune_headline(entry)[0].endswith("unavailable: this archc's session has no "
                                                "tuning_stats()")
    assert autotune_headline(off) == [f"  autotune: {off['reason']}"]


@cpu_only
def test_dry_run_records_goals_without_judging_them(dry_run: dict) -> None:
    from archc.perf.summary import summarize
    goals = dry_run["goals"]
    # prefill attention ×2 (sdpa, FlashAttention-3), fused matmuls ×2 per phase, decode ×3
    assert [g["key"] for g in goals] == [
        "prefill_attention_vs_sdpa", "prefill_attention_vs_fa3", "prefill_matmul_vs_torch_matmul",
        "prefill_matmul_vs_unfused", "decode_matmul_vs_torch_matmul", "decode_matmul_vs_unfused",
        "decode_attention_vs_copy", "decode_vs_bound", "decode_vs_torch_compile"]
    assert all(not g["applies"] and g["met"] is None for g in goals)
    # tiny-llama3's head dim of 16 has no published FlashAttention-3 figure to compare with
    fa3 = goals[1]
    assert fa3["measured"] is None and "no comparable kernel" in fa3["note"]
    # the summary: the versions that made the numbers, then the headline — decode at each
    # context, the prefill kernels, autotuning (not in a dry run), and the goals left unjudged
    lines = summarize(dry_run)
    assert lines[1].startswith("  software: triton ")
    assert f"torch {torch.__version__}, python {platform.python_version()}" in lines[1]
    assert [line.split(":")[0].strip() for line in lines[2:8]] == [
        *(f"decode at context {c}" for c in CONTEXTS), "prefill matmuls, the slowest",
        "prefill attention (attention_0)", "autotune", "goals"]
    assert " torch.matmul (fused_linear_" in lines[4] and " the unfused sequence (" in lines[4]
    assert " sdpa, " in lines[5] and " TFLOP/s" in lines[5]
    assert lines[6] == ("  autotune: not applicable: a dry run launches the kernels under "
                        "Triton's interpreter, which never autotunes")
    assert lines[7] == "  goals: not judged in a dry run"
    assert not any(line.startswith("  goal ") for line in lines)


@cpu_only
def test_dry_run_counts_attention_flops_as_flash_attention_does(dry_run: dict) -> None:
    """Prefill attention's TFLOP/s are FlashAttention's count, 4·B·H·T·L·D halved when causal,
    so they compare with its published figures; the autotune entry says it does not apply."""
    (att,) = [r for r in dry_run["kernels"] if r["phase"] == "prefill" and r["op"] == "attention"]
    s = att["sizes"]
    assert att["causal"] is True and s["T"] == s["L"] == dry_run["shapes"]["prompt"]
    assert att["fa_flops"] == 4 * s["B"] * s["H"] * s["T"] * s["L"] * s["D"] // 2
    assert att["fa_flops_per_second"] == pytest.approx(att["fa_flops"] / att["archc_seconds"])
    assert dry_run["autotune"]["applicable"] is False


@cpu_only
def test_report_is_saved_after_each_section_and_names_a_failure(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    import archc.perf.bench as bench
    from archc.cli import build_parser
    from archc.commands.bench import config_of

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no ceiling today")
    monkeypatch.setattr(bench, "measure_ceilings", broken)
    cfg = config_of(build_parser().parse_args(["bench", "tiny-llama3", "--dry-run",
                                                "--no-kernels", "--compile-modes", "none"]))
    path = tmp_path / "r.json"
    report = run_bench(cfg, path)
    saved = json.loads(path.read_text())
    assert saved["status"]["ceilings"] == "failed"
    assert saved["errors"][0]["section"] == "ceilings"
    assert "no ceiling today" in saved["errors"][0]["error"]
    assert report.failed == ["ceilings"]
    # later sections still ran
    assert saved["status"]["model:archc:decode"] == "done"


@cpu_only
def test_autotune_section_runs_real_sessions_last(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotune section with archc's own sessions (on the CPU they never tune): it runs
    after the model's sections, each run timed, and records the sessions' tuning statistics —
    or that the session has no such hook."""
    import archc.perf.bench as bench
    from archc.cli import build_parser
    from archc.commands.bench import config_of
    from archc.runtime.triton_backend import TritonSession
    monkeypatch.setattr(bench, "autotune_entry", lambda cfg: {"applicable": True, "runs": [],
                                                              "tuning_stats": None})
    cfg = config_of(build_parser().parse_args([
        "bench", "tiny-llama3", "--dry-run", "--layers", "1", "--no-kernels", "--compile-modes",
        "none", "--cache-dir", str(tmp_path / "kernels")]))
    saved = run_bench(cfg, tmp_path / "r.json").data
    assert saved["errors"] == [] and list(saved["status"])[-1] == "autotune"
    assert saved["status"]["autotune"] == "done"
    entry = saved["autotune"]
    assert len(entry["runs"]) == 2 and all(r["seconds"] > 0 for r in entry["runs"])
    if hasattr(TritonSession, "tuning_stats"):
        assert entry["tuning_stats"] == "available"
        assert all({"seconds", "kernels_tuned", "cache_hits", "cache_misses"} <= set(r["tuning"])
                   for r in entry["runs"])
    else:
        assert entry["tuning_stats"].startswith("unavailable")
        assert [r["tuning"] for r in entry["runs"]] == [None, None]


@pytest.mark.parametrize("argv, message", [
    (["bench", "tiny-llama3", "--prompt-len", "8", "--new-tokens", "4"], "no CUDA GPU here"),
    # a GPU run's defaults (512 + 64) fit tiny-llama3's 64 positions: only the GPU is missing
    (["bench", "tiny-llama3"], "no CUDA GPU here"),
    (["bench", "tiny-llama3", "--prompt-len", "512"], "--prompt-len 512 leaves no room"),
    (["bench", "tiny-llama3", "--dry-run", "--layers", "3"], "has 2 blocks"),
    (["bench", "tiny-bert", "--dry-run"], "decoder-only"),
    (["bench", "tiny-llama3", "--dry-run", "--dtype", "bf16"], "computes bfloat16 wrongly"),
    (["bench", "tiny-llama3", "--dry-run", "--prompt-len", "60", "--new-tokens", "8"],
     "max_seq_len"),
    (["bench", "tiny-llama3", "--dry-run", "--compile-modes", "fast"], "unknown torch.compile"),
    (["bench", "tiny-llama3", "--dry-run", "--contexts", "16", "61"], "--contexts 61"),
    (["bench", "tiny-llama3", "--dry-run", "--contexts", "16", "16"], "given twice"),
    (["bench", "tiny-llama3", "--dry-run", "--contexts", "0"], "--contexts"),
    (["bench", "tiny-llama3", "--dry-run", "--gpu", "v100"], "unknown GPU"),
    # a GPU run's arguments are checked before the GPU is looked for
    *((["bench", "tiny-llama3", "--prompt-len", "8", "--new-tokens", "4", *flags], message)
      for flags, message in ((["--layers", "3"], "has 2 blocks"),
                             (["--contexts", "61"], "--contexts 61"),
                             (["--gpu", "v100"], "unknown GPU"),
                             (["--compile-modes", "fast"], "unknown torch.compile"))),
])
def test_bench_refuses_bad_input(argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1


# ---- the torch baseline: the eager interpreter without its checks ------------------------------

@pytest.mark.parametrize("spec_name", ["tiny-llama3", "tiny-mistral", "tiny-bloom",
                                       "tiny-gemma2"])
def test_unchecked_logits_match_the_eager_interpreter(spec_name: str) -> None:
    """Prefill, then decode steps past the sliding window, P given: the same logits as the
    checked interpreter's steps."""
    model = archc.load(spec_name)
    program = lower(model.spec, "f32")
    plain = EagerSession(program, model.weights, max_seq_len=model.spec.max_seq_len,
                         checks=False)
    reference = EagerSession(program, model.weights, max_seq_len=model.spec.max_seq_len)
    ids = torch.randint(0, model.spec.vocab_size, (2, 9), generator=torch.Generator()
                        .manual_seed(0))
    assert torch.equal(plain.logits(ids, 0), reference.step(ids))
    for past in range(9, 21):
        token = ids[:, past % 9:past % 9 + 1]
        assert torch.equal(plain.logits(token, past), reference.step(token)), past


def test_unchecked_logits_decode_under_torch_compile_without_recompiling() -> None:
    from torch._dynamo.testing import CompileCounter
    model = archc.load("tiny-llama3")
    program = lower(model.spec, "f32")
    plain = EagerSession(program, model.weights, max_seq_len=64, checks=False)
    reference = EagerSession(program, model.weights, max_seq_len=64)
    ids = torch.randint(0, model.spec.vocab_size, (2, 9), generator=torch.Generator()
                        .manual_seed(0))
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(plain.logits, backend=counter)
    assert torch.allclose(compiled(ids, 0), reference.step(ids), atol=1e-5, rtol=0)
    token = ids[:, -1:]
    for past in range(9, 15):
        out = compiled(token, past)
        assert torch.allclose(out, reference.step(token), atol=1e-5, rtol=0)
    # the prefill, then one decode graph with P symbolic: no recompile per step
    assert counter.frame_count == 2
    torch._dynamo.reset()


def test_weights_are_drawn_where_parameter_expressions_can_use_them() -> None:
    from archc.perf.bench import _makes_tensors, random_checkpoint
    from archc.spec import load_spec
    llama, qwen = (lower(load_spec(n), "f32") for n in ("tiny-llama3", "tiny-qwen2"))
    assert not _makes_tensors(llama) and not _makes_tensors(optimize(llama))
    # a merged QKV bias built with zeros() for the missing parts: made on the CPU
    assert _makes_tensors(optimize(qwen))
    weights = random_checkpoint(qwen, torch.device("cpu"), 0, evaluated_by=(optimize(qwen),))
    assert all(w.device.type == "cpu" and torch.isfinite(w).all() for w in weights.values())


# ---- counterparts of every kernel of every tiny spec -------------------------------------------

class _RecordedState(RecurrentState):
    """The recurrent state, remembering what each (layer, kind) read in the current call: the
    state a kernel started from, which its counterpart must start from too."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[tuple[int, str], torch.Tensor] = {}

    def read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device, past: int) -> torch.Tensor:
        value = super().read(layer, kind, shape, dtype, device, past)
        self.reads[(layer, kind)] = value
        return value


def _kernel_values(spec_name: str) -> list[tuple]:
    """(graph, node, input values, output, dims, cache, state read) for every compute node of
    the kernel-level program, by the eager interpreter: a prefill, and one decode step (which
    continues the recurrent state of Mamba and linear-attention layers)."""
    model = archc.load(spec_name)
    program = optimize(lower(model.spec, "f32"))
    gen = torch.Generator().manual_seed(1)
    b, t = 2, 5
    ids = torch.randint(0, model.spec.vocab_size, (b, t), generator=gen)
    out = []
    state = _RecordedState()

    def run(g, inputs: dict, dims: dict, cache: KVCache) -> dict:  # noqa: ANN001
        params = materialize(g, model.weights)
        trace = Trace()
        state.reads = {}
        outputs = run_graph(g, params, inputs, EagerContext(dims, cache, state), trace=trace)
        for i in g.compute_ids():
            xs = [inputs[g.nodes[j].name] if g.nodes[j].op == Op.INPUT else
                  params[g.nodes[j].name] if g.nodes[j].op == Op.PARAM else trace.values[j]
                  for j in g.nodes[i].inputs]
            out.append((g, i, xs, trace.values[i], dict(dims), cache, dict(state.reads)))
        return outputs

    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, -2:] = 0
    enc = {"tokens": ids, "positions": torch.arange(t), "attention_mask": mask,
           "token_types": torch.zeros(b, t, dtype=torch.long)}
    hidden = None
    extra: dict = {}
    for g in program:   # encoder, then the cross-KV graph it feeds, then the decoder
        if g.name == "encoder":
            run(g, {k: v for k, v in enc.items() if k in g.inputs}, {"B": b, "T": t, "P": 0},
                KVCache(64))
            hidden = out[-1][3] if model.spec.family == "encoder-decoder" else None
            if hidden is not None:
                extra = {"encoder_hidden": hidden,
                         "encoder_mask": torch.ones(b, t, dtype=torch.long)}
            continue
        dims = {"B": b, "P": 0}
        if hidden is not None:
            dims["S"] = t
        if g.name == CROSS_KV:
            extra.update(run(g, {"encoder_hidden": hidden}, {**dims, "T": t}, KVCache(64)))
            continue
        cache = KVCache(64)
        for past, step in ((0, ids), (t, ids[:, -1:])):  # a prefill, then one decode step
            n = step.shape[1]
            inputs = {"tokens": step, "positions": torch.arange(past, past + n),
                      "prefix_len": torch.tensor(t), **extra}
            run(g, {k: v for k, v in inputs.items() if k in g.inputs},
                {**dims, "T": n, "P": past}, cache)
    return out


@pytest.mark.parametrize("spec_name", TINY_SPECS)
def test_counterparts_agree_with_the_kernel_level_ops(spec_name: str) -> None:
    kinds: set[str] = set()
    present: set[str] = set()
    for g, i, xs, want, dims, cache, states in _kernel_values(spec_name):
        n = g.nodes[i]
        present.add(n.op.value)
        scratch = scratch_caches(g, i, dims, torch.float32, torch.device("cpu"))
        for c in counterparts(g, i, xs, dims, cache.store, scratch, states):
            if isinstance(c, Unavailable):   # sdpa takes no soft-cap, expression or sinks
                assert c.name == "sdpa" and any(n.attr(k) is not None for k in (
                    "softcap", "score", "mask", "normalizer")), c
                continue
            assert isinstance(c, Counterpart)
            if c.result is None:       # torch.matmul on the same GEMM: not the same function
                continue
            got = c.result(c.run())
            scale = want.abs().max()
            err = (got.float() - want.float()).abs().max()
            assert err <= TOLERANCE["f32"] * scale, f"{c.name} of %{i} {n.op.value}: {err}"
            kinds.add(n.op.value)
    # every kind of kernel the model runs was checked against a counterpart
    assert kinds == present and "fused_linear" in kinds


def test_a_recurrent_counterpart_reads_the_state_the_kernel_read() -> None:
    """At a decode step the conv, scan and running sums continue from the prefill's state:
    a counterpart given zeros instead computes something else, so the agreement above is not
    the zero state's."""
    checked = 0
    for g, i, xs, want, dims, cache, states in _kernel_values("tiny-jamba"):
        n = g.nodes[i]
        if n.op not in (Op.CAUSAL_CONV, Op.SSM_SCAN) or dims["P"] == 0:
            continue
        assert (n.attr("layer"), "conv" if n.op == Op.CAUSAL_CONV else "ssm") in states
        fresh = {k: torch.zeros_like(v) for k, v in states.items()}
        (c,) = counterparts(g, i, xs, dims, cache.store, {}, fresh)
        assert isinstance(c, Counterpart) and c.result is not None
        err = (c.result(c.run()) - want).abs().max()
        assert err > 1e-3 * want.abs().max(), f"%{i} {n.op.value} ignores the state"
        checked += 1
    assert checked == 4      # two Mamba layers, a conv and a scan each
