"""lm-evaluation-harness against `archc serve`: a small multiple-choice task, written here from
local data, run through the harness's `local-completions` model (echo + logprobs requests, the
server's own tokenizer over /tokenize) on SmolLM2-135M-Instruct's GGUF file, scores every
choice of every example as the harness's `hf` model does on the same weights (transformers'
own reading of the GGUF file, the tokenizer the server uses)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.serving import Running, serving
from tests.test_gguf_smollm2 import smollm2_gguf

lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval (pip install "
                              "'lm-eval[hf,api]==0.4.13'; make setup does)")

# the two sides run the same f32 weights (Q4_1 dequantized) through different programs:
# log-likelihoods of a few tokens agree to f32 rounding summed over the continuation
TOLERANCE = 1e-4
EXAMPLES = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a cheese"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" green", " blue", " loud"],
     "answer": 1},
]
TASK = """task: archc_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def task_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    (tmp_path / "archc_mc.yaml").write_text(TASK.format(data=data))
    return tmp_path


def loglikelihoods(lm: Any, tasks: Path) -> dict[int, list[float]]:
    """Each example's log-likelihood of each choice, as the harness scored them."""
    from lm_eval.tasks import TaskManager
    # only the task written here: indexing the harness's own thousands of tasks takes seconds
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["archc_mc"], log_samples=True,
                                  task_manager=manager, batch_size=1)
    assert out is not None
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]]
            for s in out["samples"]["archc_mc"]}


@pytest.mark.slow
def test_local_completions_scores_as_the_hf_model(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks, path = task_dir(tmp_path), smollm2_gguf()
    running: Running
    with serving(str(path)) as running:
        served = LocalCompletionsAPI(base_url=f"{running.url}/v1/completions",
                                     model=running.name, tokenizer_backend="remote",
                                     max_retries=1)
        got = loglikelihoods(served, tasks)
        tokenizer = running.model.tokenizer
    assert sorted(got) == list(range(len(EXAMPLES)))
    assert [len(got[i]) for i in range(len(EXAMPLES))] == [len(e["choices"]) for e in EXAMPLES]
    # transformers builds gguf's tensor-name table, a function of (architecture, layers) alone,
    # once per module of the model: 397 times, 63 s of the 183 s its load took under cProfile
    # on 2 shared cores
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype="float32")
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token)
    want = loglikelihoods(HFLM(pretrained=model, tokenizer=hf_tokenizer, batch_size=1), tasks)
    for doc in range(len(EXAMPLES)):
        for choice, (a, b) in enumerate(zip(got[doc], want[doc])):
            assert abs(a - b) < TOLERANCE, (doc, choice, a, b)
