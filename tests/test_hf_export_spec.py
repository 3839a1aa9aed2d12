"""`archc export-spec`: the YAML spec of a Hugging Face directory reads back to the same spec, and
compiles with the directory's weights to the same model — so a user can edit it and recompile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import archc
from archc.cli import main
from archc.spec import load_yaml

pytest.importorskip("transformers", reason="needs transformers (pip install 'archc[hf]')")

from tests.test_hf_crosscheck import build  # noqa: E402

CASES = ["llama-llama3-rope", "qwen2-upper-window", "gemma2", "falcon-alibi-serial",
         "opt-post-norm", "bert", "t5-v1.1-gated"]


@pytest.mark.parametrize("case", CASES)
def test_exported_spec_reads_back_and_recompiles(case: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "hf"
    build(case, directory)
    capsys.readouterr()
    assert main(["export-spec", str(directory)]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    model = archc.load(directory)
    assert load_yaml(path) == model.spec
    again = archc.Model(load_yaml(path), model.weights)
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    kw = {"decoder_input_ids": ids[:, :4]} if model.spec.family == "encoder-decoder" else {}
    assert torch.equal(again.compile()(ids, **kw), model.compile()(ids, **kw))


def test_export_spec_writes_a_file_and_full_lists_every_field(tmp_path: Path) -> None:
    build("gpt2", tmp_path / "hf")
    out = tmp_path / "gpt2.yaml"
    assert main(["export-spec", str(tmp_path / "hf"), "--full", "-o", str(out)]) == 0
    text = out.read_text()
    assert "offset: 0" in text and "family: decoder" in text
    assert load_yaml(out) == archc.load(tmp_path / "hf").spec
