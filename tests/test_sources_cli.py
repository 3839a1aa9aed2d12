"""Every command that takes a model takes every source: a GGUF file, a Hugging Face directory, a
zoo name and a spec YAML. The GGUF file and the HF directory hold the same tiny Llama, so what the
commands compute from them must agree; the zoo name and the YAML are one spec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from archc.cli import main
from archc.spec import ZOO_DIR
from tests.model_files import tiny_gguf, tiny_hf_dir  # noqa: F401  (fixtures)

SOURCES = ("gguf", "hf", "zoo", "yaml")
INSPECTION = {
    "show": [],
    "ir": [],
    "passes": ["--prompt-len", "4"],
    "explain": [],
    "diff": ["tiny-llama3"],
    "compile": [],
    "roofline": ["--prompt-len", "16", "--new-tokens", "4", "--gpu", "a100"],
    "export-spec": [],
    "modernize": ["--steps", "gqa:1"],
}


@pytest.fixture
def source(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    kind = request.param
    if kind == "gguf":
        return str(request.getfixturevalue("tiny_gguf"))
    if kind == "hf":
        return str(request.getfixturevalue("tiny_hf_dir"))
    if kind == "zoo":
        return "tiny-llama3"
    return str(ZOO_DIR / "tiny-llama3.yaml")


@pytest.mark.parametrize("source", SOURCES, indirect=True)
@pytest.mark.parametrize("command", INSPECTION)
def test_inspection_commands_take_every_source(command: str, source: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    capsys.readouterr()
    status = main([command, source, *INSPECTION[command]])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out.strip() and "error" not in err


def _params(out: str) -> int:
    found = re.search(r"parameters\s+([\d,]+)", out)
    assert found, out
    return int(found.group(1).replace(",", ""))


def test_the_gguf_file_and_the_hf_directory_are_seen_as_one_model(
        tiny_gguf: Path, tiny_hf_dir: Path,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    seen = {}
    for name, path in (("gguf", tiny_gguf), ("hf", tiny_hf_dir)):
        assert main(["show", str(path)]) == 0
        show = capsys.readouterr().out
        assert main(["passes", str(path), "--prompt-len", "4"]) == 0
        table = capsys.readouterr().out.splitlines()[1:]       # the title names the source
        seen[name] = (_params(show), table)
    assert seen["gguf"] == seen["hf"]
    # hf_llama(64, 96): embedding and head 96 × 64, two blocks of Q/O 64², K/V 64 × 32,
    # SwiGLU 3 × 64 × 96 and two norms, and a final norm
    blocks = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64)
    assert seen["gguf"][0] == 2 * 96 * 64 + blocks + 64


@pytest.mark.parametrize("source", SOURCES, indirect=True)
def test_run_takes_every_source(source: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["run", source, "--prompt-len", "5", "--new-tokens", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    random = "random weights" in out
    assert random == (source.endswith(".yaml") or source == "tiny-llama3"), out
