"""The eager interpreter: prefill then token-by-token decode equals one full forward pass."""

from __future__ import annotations

import pytest
import torch

import archc
from archc.errors import RunError
from archc.spec import load_spec
from tests.conftest import TINY_SPECS

# fp32 throughout: the same ops in a different split agree to a few ulps of the logit scale.
ATOL = {"f32": 1e-4}


def _split_invariant(name: str) -> bool:
    """Dynamic NTK RoPE rotates by the length at each call and cached keys keep the rotation
    they were written with, so past the trained context a split differs from one full pass by
    design (tests/test_dynamic_rope.py checks that against transformers)."""
    spec = load_spec(name)
    scaling = spec.position.scaling
    return spec.family != "encoder" and (scaling is None or scaling.kind != "dynamic")


@pytest.mark.parametrize("name", [n for n in TINY_SPECS if _split_invariant(n)])
@pytest.mark.parametrize("split", [1, 5, 12])
def test_prefill_then_decode_equals_full_forward(name: str, split: int) -> None:
    model = archc.load(name, seed=3)
    compiled = model.compile("eager")
    session = compiled.session
    gen = torch.Generator().manual_seed(split)
    ids = torch.randint(0, model.spec.vocab_size, (2, 17), generator=gen)
    enc = {}
    if model.spec.family == "encoder-decoder":
        enc = {"encoder_hidden": session.encode(ids[:, :9])}
    session.reset()
    full = session.step(ids, **enc)
    session.reset()
    parts = [session.step(ids[:, :split], **enc)]
    for t in range(split, ids.shape[1]):
        parts.append(session.step(ids[:, t:t + 1], **enc))
    incremental = torch.cat(parts, dim=1)
    scale = full.abs().max()
    assert (incremental - full).abs().max() <= ATOL["f32"] * scale


def test_sequence_past_max_seq_len_is_refused() -> None:
    model = archc.load("tiny-llama3")
    ids = torch.zeros(1, model.spec.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(RunError, match="exceeds the KV cache"):
        model.compile()(ids)


def test_failure_names_the_node() -> None:
    model = archc.load("tiny-llama3")
    compiled = model.compile()
    compiled.session.params["decoder"]["layers.0.attn.q.weight"] = torch.zeros(3, 3)
    with pytest.raises(RunError, match=r"while running %\d+ : f32\[64,64\] = param\(\) "
                       r"\{name=\"layers.0.attn.q.weight\"\}: produced torch.float32\[3, 3\]"):
        compiled(torch.zeros(1, 4, dtype=torch.long))


def test_out_of_range_token_names_the_embedding() -> None:
    compiled = archc.load("tiny-llama3").compile()
    with pytest.raises(RunError, match=r"while running %3 : f32\[B,T,64\] = embedding"):
        compiled(torch.tensor([[1, 2, 500]]))


def test_changing_batch_without_reset_is_refused() -> None:
    session = archc.load("tiny-llama3").compile().session
    session.step(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(RunError, match="reset before changing the batch"):
        session.step(torch.zeros(1, 1, dtype=torch.long))
