"""The Python API as people use it: text in and out when the model has a tokenizer, torch dtypes
beside their names, generation that stops at the checkpoint's end-of-sequence ids unless told
otherwise, weights priced before they are allocated, and errors that are archc's own and speak
of keyword arguments, not command-line flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import archc
import archc.devices
from archc.errors import ArchcError
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)

GiB = 1 << 30


def greedy_without_stops(model: archc.Model, ids: torch.Tensor, n: int) -> list[int]:
    return model.compile().generate(ids, n, eos_token_id=())[0, ids.shape[1]:].tolist()


def test_generate_stops_at_the_checkpoints_end_of_sequence_by_default() -> None:
    base = archc.load("tiny-llama3")
    ids = torch.tensor([[5, 6, 7]])
    free_run = greedy_without_stops(base, ids, 12)
    stop = free_run[3]
    first = free_run.index(stop)
    model = archc.Model(base.spec, base.weights, eos_token_ids=(stop,))
    out = model.compile().generate(ids, 12)
    assert out[0, 3:].tolist() == free_run[:first + 1]          # up to and with the stop id
    # overridden: never stop, or stop at another id
    assert model.compile().generate(ids, 12, eos_token_id=())[0, 3:].tolist() == free_run
    other = free_run[0]
    assert model.compile().generate(ids, 12, eos_token_id=other)[0, 3:].tolist() == \
        free_run[:free_run.index(other) + 1]


def test_text_in_text_out(tiny_gguf: Path) -> None:  # noqa: F811
    model = archc.load(tiny_gguf)
    compiled = model.compile()
    text = compiled.generate("the cat", 6, eos_token_id=())
    ids = torch.tensor([model.tokenizer.encode("the cat")])
    want = compiled.generate(ids, 6, eos_token_id=())[0, ids.shape[1]:].tolist()
    assert isinstance(text, str) and text == model.tokenizer.decode(want)
    assert torch.equal(compiled("the cat"), compiled(ids))


def test_text_without_a_tokenizer_says_why() -> None:
    compiled = archc.load("tiny-llama3").compile()
    with pytest.raises(ArchcError, match=r"no tokenizer \(it is a spec: its weights are random\)"):
        compiled.generate("hello")
    with pytest.raises(ArchcError, match="input_ids must be integer token ids"):
        compiled(3.5)   # type: ignore[arg-type]


@pytest.mark.parametrize("dtype,name", [(torch.float16, "f16"), (torch.float32, "f32"),
                                        ("float16", "f16"), ("bf16", "bf16")])
def test_dtypes_by_torch_dtype_or_name(dtype: object, name: str) -> None:
    compiled = archc.load("tiny-llama3").compile(dtype=dtype)  # type: ignore[arg-type]
    assert {n.dtype for n in compiled.program.graph("decoder").nodes if n.op.value == "matmul"} \
        == {name}


def test_api_errors_name_arguments_not_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    model = archc.load("tiny-llama3")
    for call, pattern in ((lambda: model.compile(dtype=torch.int8), r"dtype=torch.int8"),
                          (lambda: model.compile(dtype="f64"), r"dtype='f64'"),
                          (lambda: model.compile("fast"), r"backend='fast'"),
                          (lambda: model.compile(device="tpu"), r"device='tpu'"),
                          (lambda: model.compile("triton", dtype="bf16"),
                           r"use dtype='f32' or dtype='f16', or device='cuda'")):
        with pytest.raises(ArchcError, match=pattern) as err:
            call()
        assert "--" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ArchcError, match=r"device='cuda', but torch sees no CUDA GPU"):
        model.compile(device="cuda")


def test_random_weights_are_said_to_be_random() -> None:
    model = archc.load("tiny-llama3", seed=3)
    assert model.random_weights
    assert any("weights are random (seed 3)" in note for note in model.notes)


def test_checkpoints_weights_are_not_random(tiny_gguf: Path) -> None:  # noqa: F811
    model = archc.load(tiny_gguf)
    assert not model.random_weights and model.eos_token_ids == (2,)


def test_weights_that_cannot_fit_are_refused_before_they_are_allocated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # smollm2-135m's parameters, counted from its published sizes: a tied 49152 × 576
    # embedding, 30 blocks of Q/O 576², K/V 576 × 192, SwiGLU 3 × 576 × 1536 and two norms,
    # and a final norm
    params = 49152 * 576 + 30 * (2 * 576 ** 2 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
    monkeypatch.setattr("archc.memory.host_available", lambda: 300 << 20)
    allocated: list[str] = []
    monkeypatch.setattr(archc.model, "random_weights",
                        lambda *a, **k: allocated.append("yes") or {})
    with pytest.raises(ArchcError) as err:
        archc.load("smollm2-135m")
    message = str(err.value)
    assert f"need {params * 4 / 2 ** 20:.2f} MiB ({params:,} random weights in f32)" in message
    assert "300.00 MiB of memory is available" in message and "tiny-llama3" in message
    assert f"dtype='bf16' or dtype='f16' ({params * 2 / 2 ** 20:.2f} MiB)" in message
    assert not allocated
    monkeypatch.setattr("archc.memory.host_available", lambda: 100 << 20)
    with pytest.raises(ArchcError) as err:
        archc.load("smollm2-135m", dtype=torch.bfloat16)
    assert "dtype=" not in str(err.value)     # nothing smaller fits: not offered


def test_bf16_random_weights_are_the_f32_draws_rounded() -> None:
    f32 = archc.load("tiny-llama3").weights
    bf16 = archc.load("tiny-llama3", dtype="bf16").weights
    assert f32 is not None and bf16 is not None
    for name, w in f32.items():
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], w.to(torch.bfloat16)), name


def test_the_compiled_copy_is_priced_too(monkeypatch: pytest.MonkeyPatch) -> None:
    model = archc.load("tiny-llama3")
    monkeypatch.setattr("archc.memory.host_available", lambda: 1000)
    model.compile()      # the eager backend runs the checkpoint's own f32 tensors: no copy
    with pytest.raises(ArchcError, match="the compiled copy of its weights need"):
        model.compile(dtype="f16")
    # handed over, each f32 tensor goes as its f16 copy is made: no second copy to price
    model.compile(dtype="f16", keep_weights=False)
    assert model.weights == {}


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_weights_handed_over_compute_the_same(backend: str) -> None:
    """A model compiled with keep_weights=False gives its tensors to the backend as it takes
    them (merged Q/K/V and gate/up for the kernels): the same logits as one that keeps them."""
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    kept = archc.load("tiny-qwen2").compile(backend)(ids)
    model = archc.load("tiny-qwen2")
    got = model.compile(backend, keep_weights=False)(ids)
    assert model.weights == {} and torch.equal(got, kept)
