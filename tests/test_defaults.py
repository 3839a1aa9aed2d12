"""Every command run with no options but its source works on every valid model: defaults sized
for a real model (a 512-token prompt, 128 new tokens, 16-token KV blocks) that do not fit a
model's context are fitted to it and said on standard error; a value the user gives that does
not fit is still refused, in one line.

The table runs each command on every tiny spec (max_seq_len 64, some 128) and on two checkpoints
with a short context: a Hugging Face Llama directory of max_position_embeddings 256 (shorter
than 512 + 128) and a GGUF file with a tokenizer and a chat template of context 6 (shorter than
even validate's 7 + 1, the logits summary's 8 + 4 and a KV block of 16). Commands that run
kernels under Triton's interpreter cover each spec family once instead of every spec:
`validate` a decoder, an encoder and an encoder-decoder; `bench --dry-run` the GGUF file
(bench measures decoders).
`compile --occupancy` compiles nothing here (its ahead-of-time compiles stand in, as in
test_occupancy: the contexts it reports on are under test). A command that does not apply to a
model (chat without a tokenizer, bench or an occupancy report of an encoder) must refuse it in one
line."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from archc.cli import main
from archc.codegen import aot
from archc.spec import load_spec
from tests.conftest import TINY_SPECS as TINY

pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'archc[hf]')")

from tests.test_gguf import Q, hf_llama, write_gguf  # noqa: E402  (after the skips)
from tests.test_occupancy import fake_compile  # noqa: E402

HF_CONTEXT, GGUF_CONTEXT = 256, 6
TINY_SPECS = tuple(TINY)


def short_llama(context: int) -> Any:
    model = hf_llama(64, 96)
    model.config.max_position_embeddings = context
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Source label → what the command line names: the short-context checkpoints by path."""
    root = tmp_path_factory.mktemp("short")
    short_llama(HF_CONTEXT).save_pretrained(root / "hf")
    write_gguf(short_llama(GGUF_CONTEXT), root / "short.gguf", Q.Q8_0)
    return {"hf-256": str(root / "hf"), "gguf-6": str(root / "short.gguf"),
            **{name: name for name in TINY_SPECS}}


FAMILIES = ("tiny-llama3", "tiny-bert", "tiny-t5")
CONTEXTS = {"hf-256": HF_CONTEXT, "gguf-6": GGUF_CONTEXT}
CHECKPOINTS = ("hf-256", "gguf-6")

# command → (its arguments after the source, the sources it runs on)
COMMANDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "show": ((), TINY_SPECS + CHECKPOINTS),
    "ir": ((), TINY_SPECS + CHECKPOINTS),
    "passes": ((), TINY_SPECS + CHECKPOINTS),
    "explain": ((), TINY_SPECS + CHECKPOINTS),
    "diff": (("SOURCE",), TINY_SPECS + CHECKPOINTS),        # the model against itself
    "compile": ((), TINY_SPECS + CHECKPOINTS),
    "roofline": ((), TINY_SPECS + CHECKPOINTS),
    "report": (("--json",), TINY_SPECS + CHECKPOINTS),
    "modernize": ((), TINY_SPECS + CHECKPOINTS),
    "export-spec": ((), TINY_SPECS + CHECKPOINTS),
    "run": ((), TINY_SPECS + CHECKPOINTS),
    "bench --host-time": ((), TINY_SPECS + CHECKPOINTS),
    "validate": ((), FAMILIES + CHECKPOINTS),
    "bench --dry-run": ((), ("gguf-6",)),
    "compile --target sm_90a --occupancy": ((), TINY_SPECS + CHECKPOINTS),
    "chat": ((), ("tiny-llama3", "gguf-6")),
}


def refusal(command: str, source: str) -> str | None:
    """What a command that does not apply to a model says instead (None: it applies)."""
    if source in TINY_SPECS:
        family = load_spec(source).family
        if (command.startswith("bench") or "--occupancy" in command) and family != "decoder":
            return "decoder-only models"
        if command == "chat":
            return "is a spec, not a checkpoint"
    return None


CASES = [pytest.param(command, source, id=f"{command}:{source}")
         for command, (_, on) in COMMANDS.items() for source in on]


@pytest.mark.parametrize("command, source", CASES)
def test_a_command_with_its_defaults_runs_on_every_model(
        command: str, source: str, sources: dict[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)                   # report writes MODEL-report.html here
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))   # chat: the conversation ends at once
    monkeypatch.setattr(aot, "compile_configs", fake_compile())
    name, *flags = command.split()
    extra = [sources[source] if a == "SOURCE" else a for a in COMMANDS[command][0]]
    status = main([name, sources[source], *flags, *extra])
    out, err = capsys.readouterr()
    refused = refusal(command, source)
    if refused is not None:
        assert status == 2 and refused in err and len(err.strip().splitlines()) == 1, err
        return
    assert status == 0, err
    # what the pricing commands price lies within the context (they would price any length)
    most = CONTEXTS.get(source) or load_spec(source).max_seq_len
    if command == "roofline":
        assert all(int(c) <= most for c in re.findall(r"decode step at context (\d+)", out))
        assert all(int(t) <= most for t in re.findall(r"prefill: (\d+) tokens", out))
    if command == "report":
        priced = json.loads(out)["roofline"]
        assert priced["prefill"]["dims"]["T"] <= most
        assert "decode" not in priced or priced["decode"]["dims"]["P"] + 1 <= most



@pytest.mark.parametrize("argv, fitted", [
    (["roofline", "tiny-llama3"], "--prompt-len 48 --new-tokens 16: the defaults 512 + 128 do "
     "not fit tiny-llama3's max_seq_len = 64"),
    (["roofline", "tiny-llama3", "--prompt-len", "60"], "--new-tokens 4: the default 128 "
     "does not fit"),
    (["roofline", "tiny-llama3", "--new-tokens", "4"], "--prompt-len 60: the default 512 does "
     "not fit"),
    (["roofline", "tiny-bert"], "--prompt-len 64: the default 512 exceeds max_seq_len = 64"),
    (["run", "gguf-6"], "--prompt-len 5 --new-tokens 1: the defaults 8 + 4 do not fit"),
    (["validate", "gguf-6"], "--prompt-len 5: the default 7 exceeds short's max_seq_len = 6 "
     "less a decode step"),
    (["bench", "gguf-6", "--dry-run", "--compile-modes", "none", "--no-kernels"],
     "--prompt-len 3 --new-tokens 1: the defaults 8 + 4 do not fit"),
    (["compile", "tiny-llama3", "--target", "sm_90a", "--occupancy"],
     "--context 64: the defaults 512 2048 8192 exceed tiny-llama3's max_seq_len = 64"),
    (["modernize", "tiny-llama3"], "prenorm left out of the default steps: tiny-llama3 is "
     "already pre-norm"),
])
def test_a_fitted_default_is_said(argv: list[str], fitted: str, sources: dict[str, str],
                                  monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(aot, "compile_configs", fake_compile())
    assert main([sources.get(a, a) for a in argv]) == 0
    assert f"note: {fitted}" in capsys.readouterr().err


def test_the_fitted_lengths_are_what_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """What the note says is what the roofline prices: 48 prompt tokens, then the step at
    context 64 (48 + 16), the last the model's context holds."""
    assert main(["roofline", "tiny-llama3"]) == 0
    out = capsys.readouterr().out
    assert "prefill: 48 tokens" in out and "one decode step at context 64" in out


@pytest.mark.parametrize("argv, message", [
    (["roofline", "tiny-llama3", "--prompt-len", "60", "--new-tokens", "10"],
     "--prompt-len 60 + --new-tokens 10 exceed max_seq_len = 64"),
    (["roofline", "tiny-llama3", "--prompt-len", "64"], "--prompt-len 64 leaves no room for a "
     "decode step within max_seq_len = 64"),
    (["roofline", "tiny-llama3", "--new-tokens", "64"], "--new-tokens 64 leaves no room for a "
     "prompt"),
    (["report", "tiny-llama3", "--prompt-len", "600"], "--prompt-len 600 leaves no room"),
    (["run", "tiny-llama3", "--prompt-len", "64"], "--prompt-len 64 leaves no room"),
    (["validate", "tiny-llama3", "--prompt-len", "64"], "64 prompt tokens + 1 new exceed "
     "tiny-llama3's max_seq_len = 64"),
    (["bench", "tiny-llama3", "--dry-run", "--prompt-len", "62"], "--prompt-len 62 leaves no "
     "room for 3 decode steps within max_seq_len = 64"),     # bench warms up 3 steps first
    (["bench", "tiny-llama3", "--dry-run", "--prompt-len", "60", "--new-tokens", "8"],
     "--prompt-len 60 + --new-tokens 8 exceed max_seq_len = 64"),
    (["bench", "tiny-llama3", "--host-time", "--batch", "0"], "must be ≥ 1"),
    (["compile", "tiny-llama3", "--target", "sm_90a", "--occupancy", "--context", "65"],
     "--context 65 exceeds tiny-llama3's max_seq_len = 64"),
    (["modernize", "tiny-llama3", "--context", "65"], "--context 65 exceeds max_seq_len = 64"),
    (["modernize", "tiny-llama3", "--steps", "prenorm"], "tiny-llama3 is already pre-norm"),
])
def test_a_given_value_that_does_not_fit_is_refused_in_one_line(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`archc serve` up to the point it would serve: the engine and scheduler it made."""
    import archc.serve.engine
    import archc.serve.scheduler
    from archc.serve.server import Server
    made: dict[str, Any] = {}
    make_engine, make_scheduler = archc.serve.engine.engine_for, archc.serve.scheduler.Scheduler

    def engine_for(*args: Any, **kwargs: Any) -> Any:
        made["engine"] = make_engine(*args, **kwargs)
        return made["engine"]

    def scheduler(*args: Any, **kwargs: Any) -> Any:
        made["scheduler"] = make_scheduler(*args, **kwargs)
        return made["scheduler"]

    monkeypatch.setattr(archc.serve.engine, "engine_for", engine_for)
    monkeypatch.setattr(archc.serve.scheduler, "Scheduler", scheduler)
    monkeypatch.setattr(Server, "run", lambda self: None)
    return made


def test_serve_fits_its_block_size_to_a_short_context(
        served: dict[str, Any], sources: dict[str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("fastapi")
    assert main(["serve", sources["gguf-6"], "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert "note: --block-size 6: the default 16 exceeds short's max_seq_len = 6" in err
    engine = served["engine"]
    assert engine.block_size == GGUF_CONTEXT and engine.blocks_total == 16  # 16 sequences
    assert "KV-cache blocks of 6 tokens · context 6 tokens" in err


def test_serve_fits_its_pool_to_half_the_free_memory(
        served: dict[str, Any], sources: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Half the free memory holds 3 blocks of 16 tokens of tiny Llama's KV cache (its context,
    64 tokens, needs 4): the pool is those 3 blocks, and the context served 48 tokens."""
    pytest.importorskip("fastapi")
    block = 2 * 2 * 2 * 16 * 16 * 4   # layers · k and v · KV heads · head_dim · tokens · f32
    # the memory free once the weights are in, as the engine sizing its pool reads it (the
    # weights were priced against the machine's own)
    monkeypatch.setattr("archc.runtime.paged.free_bytes", lambda device: 2 * 3 * block)
    path = Path(sources["hf-256"]).parent / "tiny.gguf"
    write_gguf(hf_llama(64, 96), path, Q.F32)
    assert main(["serve", str(path), "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert served["engine"].blocks_total == 3 and served["scheduler"].max_seq_len == 48
    assert "note: --blocks 3: the default pool (16 sequences of 64 tokens) exceeds half " \
        "the free memory; the context served is 48 tokens" in err
