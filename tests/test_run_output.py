"""What `archc run` reports: the time of each phase after every run, on one line of standard
error however narrow the pipe; nothing with --quiet; everything as JSON with --json; and on Ctrl-C
the text so far, a trailing newline and the statistics of what was done."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
import archc.devices
from archc.api import CompiledModel
from archc.cli import main
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(["run", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_every_run_ends_with_the_time_of_each_phase_on_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "tiny-llama3", "--new-tokens", "3")
    assert status == 0
    lines = err.splitlines()
    assert lines[0].startswith("note: tiny-llama3 is a spec, not a checkpoint: its weights are "
                               "random (seed 0)")
    timing = lines[-1]
    assert len(lines) == 2 and len(timing) > 80          # longer than a pipe's 80 columns
    for part in ("load ", " · compile ", " · prefill 8 tokens in ", " · decode 2 tokens in ",
                 "tokens/s", " · peak memory "):
        assert part in timing, timing


def test_quiet_prints_nothing_on_standard_error(tiny_gguf: Path,  # noqa: F811
                                                capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, str(tiny_gguf), "--prompt", "the cat", "--new-tokens", "3",
                           "--quiet")
    assert status == 0 and err == "" and out.startswith("the cat") and out.endswith("\n")


def status_bytes(field: str) -> int:
    """A field of Linux's /proc/self/status in bytes (VmRSS: resident now, VmHWM: the most)."""
    status = Path("/proc/self/status")
    if not status.is_file():
        pytest.skip("reads resident memory from Linux's /proc/self/status")
    return int(next(line.split()[1] for line in status.read_text().splitlines()
                    if line.startswith(f"{field}:"))) * 1024


def resident_now() -> int:
    return status_bytes("VmRSS")


def high_water() -> int:
    return status_bytes("VmHWM")


def test_json_of_a_logits_summary(capsys: pytest.CaptureFixture[str]) -> None:
    before = resident_now()
    status, out, err = run(capsys, "tiny-llama3", "--new-tokens", "3", "--json", "--quiet")
    data = json.loads(out)
    # the process's high-water mark when the run reported: at least what it held before the
    # run, at most the mark read after it
    assert before <= data["timings"]["peak_memory_bytes"] <= high_water()
    assert status == 0 and data["random_weights"] and data["model"] == "tiny-llama3"
    assert data["output_shape"] == [1, 8, 97] and len(data["greedy_continuation"]) == 3
    assert [t["token"] for t in data["top5"]][0] == data["greedy_continuation"][0]
    assert set(data["timings"]["seconds"]) == {"load", "compile", "prefill", "decode"}
    assert data["timings"]["generated_tokens"] == 3


def test_json_of_generated_text_is_what_the_api_generates(
        tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    status, out, err = run(capsys, str(tiny_gguf), "--prompt", "the cat", "--new-tokens", "5",
                           "--json", "--ignore-eos")
    data = json.loads(out)
    model = archc.load(tiny_gguf)
    want = model.compile().generate("the cat", 5, eos_token_id=())
    assert status == 0 and data["text"] == want and data["prompt"] == "the cat"
    assert data["timings"]["stop"] == "length" and data["timings"]["generated_tokens"] == 5
    assert "tokens/s" not in err          # the JSON holds the timings


def test_ctrl_c_keeps_the_text_ends_the_line_and_reports(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    real = CompiledModel.generate

    def interrupted(self: CompiledModel, *args: Any, **kwargs: Any) -> Any:
        seen = kwargs["on_token"]

        def two_then_ctrl_c(column: torch.Tensor) -> None:
            seen(column)
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
        calls: list[int] = []
        return real(self, *args, **{**kwargs, "on_token": two_then_ctrl_c})

    monkeypatch.setattr(CompiledModel, "generate", interrupted)
    status, out, err = run(capsys, str(tiny_gguf), "--prompt", "the cat", "--new-tokens", "9")
    assert status == 130
    assert out.startswith("the cat") and out.endswith("\n")
    assert "prefill" in err and "decode 1 token in" in err and err.rstrip().endswith("interrupted")


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded before the refusal")
    monkeypatch.setattr(archc, "load", forbidden)


def test_text_from_a_spec_is_refused_saying_its_weights_would_be_random(
        no_weights: None, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "smollm2-135m", "--chat", "hi")
    assert status == 2 and err.count("\n") == 1
    assert "smollm2-135m is a spec, not a checkpoint: its weights would be random" in err


def test_weights_that_cannot_fit_are_refused_in_the_words_of_the_command_line(
        no_weights: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("archc.memory.host_available", lambda: 300 << 20)
    status, out, err = run(capsys, "smollm2-135m")
    assert status == 2 and err.count("\n") == 1
    assert "300.00 MiB of memory is available" in err
    assert "--dtype bf16 or --dtype f16" in err and "dtype=" not in err
    # validation keeps the checkpoint beside the eager and the kernels' copies: priced too
    monkeypatch.setattr("archc.memory.host_available", lambda: 600 << 20)
    capsys.readouterr()
    assert main(["validate", "smollm2-135m"]) == 2
    assert "its weights and 2 compiled copies need" in capsys.readouterr().err
