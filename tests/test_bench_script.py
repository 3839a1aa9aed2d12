"""bench/gpu_check.sh: shellcheck-clean, and its stage logic — a failing stage, a stage out of
time, a bench report summarized, everything copied to $OUT — exercised in seconds with a stand-in
interpreter that answers like pytest and `archc bench` would. (The script's real dry run,
`bench/gpu_check.sh --dry-run`, runs the actual tests and benches; it takes minutes.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SCRIPTS = (SCRIPT, ROOT / "bench" / "rehearse.sh")

FAKE_PYTHON = """#!/usr/bin/env bash
# Answers as the GPU check's stages expect: pytest fails one test, the tiny bench hangs, the
# big bench writes a report; anything else goes to the real interpreter.
args="$*"
case "$args" in
    *"-m pytest"*)
        echo "$args" >> "$FAKE_ARGS"
        echo "[gw0] [ 50%] PASSED tests/test_x.py::test_a"
        echo "[gw0] [100%] FAILED tests/test_x.py::test_b"
        echo "FAILED tests/test_x.py::test_b - AssertionError: boom"
        echo "========== 1 failed, 1 passed in 0.12s =========="
        exit 1 ;;
    *"bench tiny-llama3"*) echo $$ > "$FAKE_PIDFILE"; exec sleep 60 ;;
    *"bench tiny-mistral"*)
        echo "$args" >> "$FAKE_ARGS"
        json="${@: -1}"
        cp "$FAKE_REPORT" "$json"
        echo "bench tables"
        exit 0 ;;
    *"serve_load.py"*) echo "$args" >> "$FAKE_ARGS"; echo "serving tables"; exit 0 ;;
    *"import xdist"* | *"import pytest_timeout"*) exit 1 ;;
    *"import importlib"*) echo "software: triton (stand-in)"; echo "python (stand-in)"
        exit 0 ;;
esac
exec "$REAL_PYTHON" "$@"
"""


def test_scripts_are_shellcheck_clean() -> None:
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True)
    # the test extra installs it beside the interpreter, which need not be on PATH
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    out = subprocess.run([shellcheck, *map(str, SCRIPTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def _stand_in(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable,
            "FAKE_PIDFILE": str(tmp_path / "pid"), "FAKE_REPORT": str(tmp_path / "report.json"),
            "FAKE_ARGS": str(tmp_path / "args"),
            "OUT": str(tmp_path / "out"), "ARCHC_GPU_CHECK_RESULTS": str(tmp_path / "results")}


def test_stages_fail_time_out_and_still_report(tmp_path: Path) -> None:
    report = {"schema": "archc-bench/1", "spec": "tiny-mistral", "layers": 1, "spec_layers": 2,
              "dtype": "f32", "dry_run": False, "shapes": {"batch": 1, "prompt": 8, "decode": 4},
              "environment": {"device_name": "CPU"},
              "status": {"setup": "done", "model:archc:decode": "running"}, "errors": [],
              "kernels": [
                  {"phase": "prefill", "op": "fused_linear", "kernel": "fused_linear_1",
                   "shape": "8×64×64", "archc_seconds": 1.6e-5, "baselines": [
                       {"name": "torch.matmul", "seconds": 1.5e-5, "archc_speedup": 0.9375},
                       {"name": "unfused", "seconds": 2.4e-5, "archc_speedup": 1.5}]},
                  {"phase": "prefill", "op": "attention", "kernel": "attention_0",
                   "shape": "8×8 4/2×16", "archc_seconds": 2e-5, "fa_flops_per_second": 5e14,
                   "baselines": [{"name": "sdpa", "seconds": 2.5e-5, "archc_speedup": 1.25}]}],
              "autotune": {"applicable": True, "tuning_stats": "available", "runs": [
                  {"seconds": 42.0, "tuning": {"seconds": 40.0, "kernels_tuned": 6,
                                               "cache_hits": 0, "cache_misses": 6}},
                  {"seconds": 2.5, "tuning": {"seconds": 0.0, "kernels_tuned": 0,
                                              "cache_hits": 6, "cache_misses": 0}}]},
              "goals": [{"goal": "batch-1 decode ≥ 80% of the bandwidth bound", "unit": "of bound",
                         "measured": 0.8125, "target": 0.8, "applies": True, "met": True,
                         "note": "context 12: 81%"},
                        {"key": "prefill_attention_vs_fa3", "goal": "prefill attention ≥ 0.75× "
                         "FlashAttention-3", "unit": "×", "measured": 0.8, "target": 0.75,
                         "applies": True, "met": True, "note": "attention_0: 500 vs 625"},
                        {"goal": "prefill attention ≥ 1.2× sdpa", "unit": "×", "measured": 2.0,
                         "target": 1.2, "applies": False, "met": None, "note": ""}],
              "model": {"prefill": {"runs": [{"name": "archc", "seconds": 0.002,
                                              "flops_per_second": 1e9, "peak_fraction": 0.1,
                                              "archc_speedup": 1.0}]},
                        "decode": {"runs": []},
                        "contexts": [
                            {"context": 12, "attention": [{"copy_fraction": 0.875}], "runs": [
                                {"name": "archc", "step_seconds": 0.004,
                                 "tokens_per_second": 250.0, "floor_fraction": 0.8125,
                                 "archc_speedup": 1.0},
                                {"name": "torch.compile default", "step_seconds": 0.005,
                                 "tokens_per_second": 200.0, "floor_fraction": 0.65,
                                 "archc_speedup": 1.25}]},
                            {"context": 20, "attention": [], "runs": [
                                {"name": "archc", "step_seconds": None}]}]}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    results, out = tmp_path / "results", tmp_path / "out"
    env = {**_stand_in(tmp_path), "ARCHC_GPU_CHECK_BUDGET_TINY": "2"}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    (summary,) = out.glob("*_summary.txt")
    text = summary.read_text()
    # the stages, in the order of what their numbers are worth
    ran = re.findall(r"^  (\S+) +(ok|FAILED|TIMED OUT)", text, re.M)
    assert [name for name, _ in ran] == ["env", "headline", "tests", "quantized", "autotune",
                                         "serve", "more-tests", "max-autotune", "tiny"]
    assert re.search(r"^  tests\s+FAILED \(exit 1\)", text, re.M)
    assert re.search(r"^  more-tests\s+FAILED \(exit 1\)", text, re.M)
    assert "1 failed, 1 passed" in text and "FAILED tests/test_x.py::test_b" in text
    assert re.search(r"^  tiny\s+TIMED OUT after 2s", text, re.M)
    assert re.search(r"^  headline\s+ok", text, re.M)
    assert re.search(r"^  serve\s+ok", text, re.M)
    assert "SOME STAGES DID NOT PASS" in text
    assert "software: triton (stand-in)" in text.splitlines()[2]
    # the short selection and the rest of it, apart
    pytest_calls = [c for c in (tmp_path / "args").read_text().splitlines() if "-m pytest" in c]
    assert len(pytest_calls) == 2
    assert "-m not slow -k cli" in pytest_calls[0] and "-k not (cli)" in pytest_calls[1]
    # each report is summarized under its file's name, in stage order, its unfinished section
    # named
    reports = re.findall(r"^\d{8}-\d{6}_cpu-dry-run_(\S+)\.json:$", text, re.M)
    assert reports == ["tiny-mistral", "tiny-mistral-int4", "tiny-mistral-int8",
                       "tiny-mistral-autotune", "tiny-mistral-max-autotune"]
    assert "tiny-mistral, first 1 of 2 blocks" in text
    assert "NOT DONE: model:archc:decode (running)" in text
    # the headline: decode at each context, the prefill kernels, the autotune first-run cost,
    # then the goals that apply, before the details
    headline = ["decode at context 12: archc 250.0 tokens/s, 81% of the bandwidth bound; archc "
                "speed-up 1.25× over torch.compile default; attention 0.88× a copy of its KV "
                "bytes", "decode at context 20: no archc result",
                "prefill matmuls, the slowest: 0.94× torch.matmul (fused_linear_1); 1.50× the "
                "unfused sequence (fused_linear_1)",
                "prefill attention (attention_0): 1.25× sdpa, 500.0 TFLOP/s, 0.80× "
                "FlashAttention-3's published figure",
                "autotune first run: 42.0 s to build and prefill (tuning 40.0 s, 6 kernels tuned, "
                "cache 0 hits / 6 misses); second run 2.5 s (tuning 0.0 s, 0 kernels tuned, "
                "cache 6 hits / 0 misses)",
                "goal met: batch-1 decode ≥ 80% of the bandwidth bound — 81% (context 12: 81%)",
                "goal met: prefill attention ≥ 0.75× FlashAttention-3 — 0.80× (attention_0: 500 "
                "vs 625)"]
    at = [text.index(line) for line in headline]
    assert at == sorted(at) and at[-1] < text.index("NOT DONE")
    assert "≥ 1.2× sdpa" not in text      # a goal that does not apply is left out
    # the dry run's bench measures decode at contexts too
    assert "--contexts 12 20" in (tmp_path / "args").read_text()
    assert "environment:" in text and "python (stand-in)" in text
    # what comes back from a device run: at most 8 plain files, safe names, one run's prefix —
    # the summary, first, and an archive holding every file of the run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    assert files[0] == summary.name
    with tarfile.open(next(out.glob("*_whole-run.tar.gz"))) as archive:
        held = sorted(archive.getnames())
    prefix = summary.name.removesuffix("_summary.txt")
    assert re.fullmatch(r"\d{8}-\d{6}_cpu-dry-run", prefix)
    assert {f.removeprefix(prefix) for f in files} == {"_summary.txt", "_whole-run.tar.gz"}
    assert {f.removeprefix(prefix) for f in held} == {
        "_summary.txt", "_tests.log", "_more-tests.log", "_tiny-llama3.log",
        "_tiny-mistral.json", "_tiny-mistral.log", "_quantized.log", "_tiny-mistral-int4.json",
        "_tiny-mistral-int8.json", "_tiny-mistral-autotune.json", "_tiny-mistral-autotune.log",
        "_tiny-mistral-max-autotune.json", "_tiny-mistral-max-autotune.log", "_serve.log"}
    # the quantized benches: int4 then int8, each its own report
    assert re.search(r"^  quantized\s+ok", text, re.M)
    calls = (tmp_path / "args").read_text().splitlines()
    assert [c.split("--quantize ")[1].split()[0] for c in calls if "--quantize" in c] == \
        ["int4", "int8"]
    assert sorted(p.name for p in results.iterdir()) == held


def test_an_interrupted_check_stops_its_stage_and_still_reports(tmp_path: Path) -> None:
    """While a stage runs, $OUT gets the summary so far every ARCHC_GPU_CHECK_PUBLISH_EVERY
    seconds (a run killed outright still brings back its part); a TERM stops the stage and
    writes the summary."""
    env = {**_stand_in(tmp_path), "ARCHC_GPU_CHECK_PUBLISH_EVERY": "1"}
    proc = subprocess.Popen(["bash", str(SCRIPT), "--dry-run"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pidfile, out = tmp_path / "pid", tmp_path / "out"
    deadline = time.monotonic() + 60

    def running() -> bool:     # the tiny bench hangs; $OUT's summary says it is running
        return any("tiny: running for" in f.read_text() for f in out.glob("*_summary.txt"))
    while not pidfile.exists() or not pidfile.read_text().strip() or not running():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout
    assert re.search(r"^  tiny\s+INTERRUPTED", stdout, re.M)
    # the stage's process is gone, not left running
    assert not Path(f"/proc/{int(pidfile.read_text())}").exists()
    (summary,) = out.glob("*_summary.txt")
    assert "INTERRUPTED" in summary.read_text()


def _plan(*args: str, **env: str) -> str:
    run = subprocess.run(["bash", str(SCRIPT), *args, "--plan"], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _stages(plan: str) -> list[tuple[str, int, int, str]]:
    """(stage, seconds, ends by, when it runs) of each row of a printed plan."""
    return [(m[1], int(m[2]), int(m[3]), m[4].strip()) for m in re.finditer(
        r"^  \d+ +(\S+) +(\d+)s +(\d+)s  (.{34})", plan, re.M)]


def test_the_plan_puts_the_headline_first_and_fits_the_lease() -> None:
    """The stage table a GPU run follows: the headline stages first, in at most 450 s with the
    summary's reserve; a stage of the rest runs only if its seconds are left. A dry run prints
    the same table."""
    plan = _plan()
    rows = _stages(plan)
    assert [r[0] for r in rows] == ["env", "headline", "tests", "quantized", "autotune",
                                    "serve", "more-tests", "max-autotune", "tiny"]
    total, reserve, grace = (int(x) for x in re.search(
        r"(\d+)s in all, (\d+)s of them kept for the summary and (\d+)s", plan).groups())
    assert total <= 450
    headline = [r for r in rows if r[3].startswith("always")]
    assert [r[0] for r in headline] == ["env", "headline", "tests"]
    assert headline[-1][2] <= total - reserve - grace      # the headline fits, every second
    assert all(b[2] == a[2] + b[1] for a, b in zip(rows, rows[1:]))
    for name, _, end, when in rows[3:]:
        assert when == ("if all its seconds are left" if end <= total - reserve - grace
                        else "if the stages before end early"), name
    assert _stages(_plan("--dry-run")) == rows
    # --rest: what a first run leaves out; a stage's seconds can be given
    rest = _stages(_plan("--rest", ARCHC_GPU_CHECK_BUDGET_AUTOTUNE="99"))
    assert [r[0] for r in rest] == ["env", "quantized", "autotune", "serve", "more-tests",
                                    "max-autotune", "tiny"]
    assert dict((r[0], r[1]) for r in rest)["autotune"] == 99


def test_a_stage_that_does_not_fit_is_left_for_a_later_run(tmp_path: Path) -> None:
    """Stages named in ARCHC_GPU_CHECK_STAGES run (env always); one of the rest whose seconds
    are not left is skipped, and the summary says how to run it later; an unknown stage is
    refused."""
    env = {**_stand_in(tmp_path), "ARCHC_GPU_CHECK_STAGES": "serve quantized",
           "ARCHC_GPU_CHECK_BUDGET_QUANTIZED": "100000"}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    (summary,) = (tmp_path / "out").glob("*_summary.txt")
    text = summary.read_text()
    assert re.findall(r"^  (\S+) +(?:ok|skipped)", text, re.M) == ["env", "quantized", "serve"]
    assert re.search(r"^  quantized\s+skipped \(needs 100000s, \d+s left\)", text, re.M)
    assert "every stage that ran passed" in text
    assert "left for a later run: quantized — ARCHC_GPU_CHECK_STAGES='quantized' " \
           "bench/gpu_check.sh" in text
    bad = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True,
                         env={**os.environ, "ARCHC_GPU_CHECK_STAGES": "headline nope"})
    assert bad.returncode == 2 and "no stage 'nope'" in bad.stderr


def test_the_gpu_runs_commands_pass_their_argument_checks(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """Every command a GPU run makes, as `gpu_check.sh --args` gives it, passes archc bench's
    argument checks (which come before it looks for a GPU) and serve_load.py's parse: a typo in
    the script fails here, not in a lease (bench/rehearse.py's `arguments` step)."""
    import importlib.util
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    args = tmp_path / "args.tsv"
    args.write_text(subprocess.run(["bash", str(SCRIPT), "--args"], capture_output=True,
                                   text=True, check=True, timeout=60).stdout)
    stages = [line.split("\t")[:2] for line in args.read_text().splitlines()]
    assert [s for s, _ in stages] == ["headline", "tests", "quantized", "quantized", "autotune",
                                      "serve", "more-tests", "max-autotune", "tiny"]
    spec = importlib.util.spec_from_file_location("rehearse", ROOT / "bench" / "rehearse.py")
    rehearse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rehearse)
    assert rehearse.arguments(str(args)) == []
    out = capsys.readouterr().out
    assert out.count("ok: archc bench: error: no CUDA GPU here") == 6     # bench lines
    # a wrong argument is caught
    args.write_text(args.read_text().replace("--contexts\t512\t2048", "--contexts\t512\t9000", 1))
    (failed,) = rehearse.arguments(str(args))
    assert failed.startswith("headline:") and "--contexts 9000" in failed
