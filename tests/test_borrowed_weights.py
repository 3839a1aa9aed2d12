"""A spec that borrows a checkpoint's weights (`weights: PATH`): `archc export-spec` of a tiny
Llama (GGUF file, Hugging Face directory), edited to change what it computes but not its shapes
(a sliding window of 4), runs that checkpoint: on a prompt the window does not cut, its logits
are the checkpoint's own; on a longer one they differ. A spec whose shapes do not fit is refused
naming the tensor and both shapes before any tensor is read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import archc
import archc.sources.gguf
import archc.sources.hf
from archc.cli import main
from archc.errors import SpecError, WeightsError
from archc.sources import describe
from tests.model_files import tiny_gguf, tiny_hf_dir  # noqa: F401  (fixtures)

WINDOW = 4


def variant(checkpoint: Path, directory: Path, edit: dict[str, Any]) -> Path:
    """`archc export-spec` of `checkpoint`, its attention section updated with `edit`, borrowing
    the checkpoint by a path relative to the spec file (written in a directory of its own)."""
    directory.mkdir()
    exported = directory / "exported.yaml"
    assert main(["export-spec", str(checkpoint), "-o", str(exported)]) == 0
    data = yaml.safe_load(exported.read_text())
    data["attention"].update(edit.get("attention", {}))
    data["ffn"].update(edit.get("ffn", {}))
    data["weights"] = os.path.relpath(checkpoint, directory)
    path = directory / "variant.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(params=["gguf", "hf"])
def checkpoint(request: pytest.FixtureRequest, tiny_gguf: Path,  # noqa: F811
               tiny_hf_dir: Path) -> Path:  # noqa: F811
    return tiny_gguf if request.param == "gguf" else tiny_hf_dir


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_an_edited_export_runs_the_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    spec_file = variant(checkpoint, tmp_path / "edit", {"attention": {"window": WINDOW}})
    assert not Path(yaml.safe_load(spec_file.read_text())["weights"]).is_absolute()
    original = archc.load(checkpoint)
    borrowed = archc.load(spec_file)
    assert borrowed.spec.attention.window == WINDOW and original.spec.attention.window is None
    assert borrowed.random_weights is False
    assert any(str(checkpoint) in note for note in borrowed.notes)
    assert (borrowed.tokenizer is None) == (original.tokenizer is None)
    a, b = original.compile("eager"), borrowed.compile("eager")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    # a prompt the window hides nothing of: the same function of the same weights, computed
    # with the window's mask — equal to f32 rounding (measured: exactly equal)
    assert relative_error(b(ids[:, :WINDOW]), a(ids[:, :WINDOW])) <= 1e-6
    # longer: the window hides keys, and the logits move far past rounding
    assert relative_error(b(ids), a(ids)) > 1e-2
    source = describe(spec_file)
    assert (source.kind, source.spec.attention.window) == (
        "gguf" if checkpoint.suffix == ".gguf" else "hf", WINDOW)


def test_a_spec_that_does_not_fit_is_refused_before_any_tensor_is_read(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    spec_file = variant(checkpoint, tmp_path / "edit", {"ffn": {"d_ff": 128}})

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor was read before the shapes were checked")
    for reader in (archc.sources.gguf.GGUFFile, archc.sources.hf.SafetensorsFiles):
        monkeypatch.setattr(reader, "load", forbidden)
        monkeypatch.setattr(reader, "load_slice", forbidden)
    with pytest.raises(WeightsError) as info:
        archc.load(spec_file)
    message = str(info.value)
    assert "checkpoint tensor 'layers.0.ffn.gate.weight' has shape [96, 64], expected " \
        "[128, 64]" in message and str(checkpoint) in message
    assert main(["show", str(spec_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'layers.0.ffn.gate.weight' has shape [96, 64]" in err[0]


def test_weights_that_are_not_a_checkpoint_are_refused(tmp_path: Path) -> None:
    base = {"name": "m", "vocab_size": 11, "d_model": 16, "layers": 1,
            "attention": {"heads": 2}}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(base))
    for weights, says in (("nowhere.gguf", "does not exist"),
                          ("other.yaml", "is a spec, not a checkpoint")):
        path = tmp_path / "m.yaml"
        path.write_text(yaml.safe_dump({**base, "weights": weights}))
        with pytest.raises(SpecError, match=f"weights: '.*{weights}' {says}"):
            archc.load(path)
