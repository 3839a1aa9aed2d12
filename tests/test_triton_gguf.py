"""SmolLM2-135M-Instruct from its GGUF file answers the same on the generated kernels as on the
eager interpreter.

A real checkpoint through the default passes and the triton backend, its Q4_1 weights kept
quantized (the kernels dequantize them in their K loops; the float kernels of a checkpoint read
with dequantize=True are those every tiny spec runs on triton). Under
Triton's interpreter a decode step of this 30-layer model takes several seconds, so the check is
the prompt's prefill and the first decode steps: the logits agree (f32, 1e-4 of their scale: the
same bound as the tiny specs) and so do the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import archc
from tests.test_gguf_smollm2 import smollm2_gguf

pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
pytest.importorskip("tokenizers", reason="needs tokenizers (pip install 'archc[gguf]')")

TOL = 1e-4


@pytest.mark.slow
def test_smollm2_gguf_answers_the_same_on_triton(tmp_path: Path) -> None:
    model = archc.load(smollm2_gguf())
    assert model.quant
    prompt = torch.tensor([model.tokenizer.encode("The capital of France is")])
    # on a GPU when there is one: choosing the interpreter would hold for the whole worker
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sessions = [model.compile("eager", device=device).session,
                model.compile("triton", device=device, cache_dir=tmp_path).session]
    for s in sessions:
        s.reset()
    x = prompt
    answer = []
    for _ in range(2):  # prefill, then one decode step over the KV cache
        want, got = (s.step(x)[:, -1] for s in sessions)
        err = (got - want).abs().max()
        assert err <= TOL * want.abs().max(), f"max error {err:.3g}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        x = want.argmax(-1)[:, None]
        answer.append(int(x))
    assert "Paris" in model.tokenizer.decode(answer)
