"""bench/serve_load.py runs end to end on a tiny spec in seconds: both runs generate every token
asked for, and the streams served together share decode steps."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "serve_load.py"


def test_the_serving_benchmark_measures_both_runs(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "tiny-llama3", "--streams", "4",
                                      "--prompt-len", "6", "--new-tokens", "5", "-o", str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    data = json.loads(out.read_text())
    for run in data["results"].values():
        assert run["tokens"] == 4 * 5
        assert run["latency_s"]["p50"] <= run["latency_s"]["p99"]
        assert 0 < run["ttft_s"]["p50"] <= run["latency_s"]["p99"]
    assert data["decode_batch_max"] > 1
    assert len(data["prompt_lengths"]) == 4 and all(3 <= n <= 9 for n in data["prompt_lengths"])
    text = capsys.readouterr().out
    assert "one at a time" in text and "together" in text


def test_the_chunked_prefill_benchmark_measures_both_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chunk.json"
    script = SCRIPT.parent / "serve_prefill_chunk.py"
    monkeypatch.setattr(sys, "argv", [
        "serve_prefill_chunk.py", "tiny-llama3", "--streams", "2", "--new-tokens", "12",
        "--long-prompt", "40", "--arrivals", "1", "--chunk", "8", "--max-seq-len", "128",
        "-o", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    data = json.loads(out.read_text())
    whole, chunked = data["results"]["whole"], data["results"]["chunks of 8"]
    # the warm-up's 1 short prompt and the run's 2 (16 tokens: 2 chunks of 8), a long one each
    # (40 tokens: 5 chunks)
    assert whole["prefill_steps"] == (1 + 1) + (2 + 1)
    assert chunked["prefill_steps"] == (2 + 5) + (2 * 2 + 5)
    for run in (whole, chunked):
        assert run["gaps"] > 0 and run["itl_s"]["p50"] <= run["itl_s"]["max"]
    assert "chunks of 8" in capsys.readouterr().out
