"""`archc chat` through a pipe against the SmolLM2 GGUF file: a conversation with history, `/reset`,
`/exit`, an answer per line read; and the conversation's bookkeeping on a tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import archc
from archc.cli import main
from archc.commands.chat import Conversation
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)
from tests.test_gguf_smollm2 import smollm2_gguf


def chat(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "archc.cli", "chat", *args], input=stdin,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_chat_through_a_pipe_keeps_history_resets_and_exits() -> None:
    path = str(smollm2_gguf())
    done = chat(path, "--new-tokens", "24", "--system", "Answer in one short sentence.",
                stdin="And of Italy?\n/reset\nWhat is the capital of France?\nAnd of Italy?\n"
                      "/reset\nAnd of Italy?\n/exit\nWhat is the capital of Spain?\n")
    assert done.returncode == 0, done.stderr
    fresh, france, italy, after_reset = done.stdout.splitlines()   # nothing after /exit
    assert "Paris" in france
    assert "Rome" in italy and italy != fresh      # "And of Italy?" read with the history…
    assert after_reset == fresh                    # … which /reset cleared
    err = done.stderr.splitlines()
    assert err[0].startswith("load ") and "compile" in err[0]
    turns = [line for line in err if line.startswith("prefill ")]
    assert len(turns) == 4 and all("tokens/s" in t for t in turns)
    # each turn prefills only what the cache does not hold: after a /reset the system prompt
    # is still there; with the history, the whole of the last turn
    cached = [int(m.group(1)) if (m := re.search(r"\((\d+) cached\)", t)) else 0
              for t in turns]
    assert cached[0] == 0 and 0 < cached[1] == cached[3] < cached[2], turns
    assert done.stderr.count("a new conversation") == 2


@pytest.mark.slow
def test_chat_json_prints_a_line_per_turn() -> None:
    done = chat(str(smollm2_gguf()), "--json", "--quiet", "--new-tokens", "16",
                stdin="What is the capital of France?\n")
    assert done.returncode == 0 and done.stderr == ""
    (line,) = done.stdout.splitlines()
    turn = json.loads(line)
    assert turn["user"] == "What is the capital of France?" and "Paris" in turn["assistant"]
    assert turn["timings"]["stop"] == "eos" and turn["timings"]["prompt_tokens"] > 10


def test_chat_refuses_what_cannot_chat(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "tiny-llama3"]) == 2
    err = capsys.readouterr().err
    assert "is a spec, not a checkpoint" in err and err.count("\n") == 1


def test_the_oldest_turns_go_when_the_conversation_outgrows_the_context(
        tiny_gguf: Path) -> None:  # noqa: F811
    tok = archc.load(tiny_gguf).tokenizer
    one_turn = len(tok.encode_chat([{"role": "user", "content": "the cat sat on the mat"}]))
    talk = Conversation(tok, max_tokens=4 * one_turn, system=None)
    for _ in range(6):
        ids, dropped = talk.prompt("the cat sat on the mat", room=one_turn)
        assert len(ids) + one_turn <= 4 * one_turn
        talk.turns.append(("the cat sat on the mat", "the end"))
    assert dropped >= 1 and 1 <= len(talk.turns) < 6
    talk.turns.clear()
    ids, dropped = talk.prompt("hello", room=1)
    assert dropped == 0 and ids == tok.encode_chat([{"role": "user", "content": "hello"}])


@pytest.mark.parametrize(("name", "mixers"), [("tiny-llama3", "attention"),
                                              ("tiny-jamba", "recurrent")])
def test_keep_cache_prefills_only_what_is_new_and_answers_the_same(name: str,
                                                                   mixers: str) -> None:
    """A next turn that extends the last generate's tokens prefills only its new ones; one that
    departs from them cuts an attention cache back to the common prefix, where a recurrent
    state (Jamba's Mamba layers), which cannot be cut back, starts again. The tokens are those
    of a fresh generate every time."""
    compiled = archc.load(name).compile("eager")
    fresh = archc.load(name).compile("eager")
    first = torch.tensor([[5, 9, 2, 33, 41, 7]])
    out = compiled.generate(first, 4, eos_token_id=(), keep_cache=True)
    assert compiled.cached == out[0, :-1].tolist()          # the last token was never fed
    extended = torch.cat([out, torch.tensor([[11, 12]])], dim=1)
    departed = torch.cat([first[:, :4], torch.tensor([[60, 61, 62]])], dim=1)
    expect = {"extended": extended.shape[1] - 3, "departed": 4 if mixers == "attention" else 0}
    for label, prompt in (("extended", extended), ("departed", departed)):
        reused = compiled.reusable(prompt, None)
        assert reused == expect[label], label
        got = compiled.generate(prompt, 4, eos_token_id=(), keep_cache=True)
        assert got.tolist() == fresh.generate(prompt, 4, eos_token_id=()).tolist(), label
    compiled(first)                     # a forward of its own: the cache no longer holds it
    assert compiled.reusable(extended, None) == 0
