"""The paged engine over recurrent mixers (Mamba, Gated DeltaNet, linear attention): each
sequence holds a state slot, so sequences of different prompt lengths interleaved on the engine
give the greedy tokens and logits `generate` gives on each prompt alone; a chunked prefill
carries the state across its chunks; a fork gets a copy of the state; no prefix is reused."""

from __future__ import annotations

import pytest
import torch

import archc
import archc.errors
from tests.test_paged import relative_error
from tests.test_paged_engine import check_engine, greedy_reference, prompts_of

RECURRENT_SPECS = ["tiny-mamba", "tiny-jamba", "tiny-qwen3-next", "tiny-linear-attention"]


@pytest.mark.parametrize("name", RECURRENT_SPECS)
def test_engine_matches_generate_over_recurrent_mixers(name: str) -> None:
    compiled = archc.load(name).compile("eager", dtype="f32")
    vocab = compiled.spec.vocab_size
    engine = compiled.engine(block_size=4, blocks=15, max_batch=4)
    assert not engine.prefix_cache          # a state is not blockwise
    check_engine(compiled, engine, prompts_of([6, 8, 1], vocab), steps=4)


def test_chunked_prefill_carries_the_state() -> None:
    compiled = archc.load("tiny-qwen3-next").compile("eager", dtype="f32")
    prompt = prompts_of([11], compiled.spec.vocab_size, seed=3)[0]
    want_tokens, want_logits = greedy_reference(compiled, prompt, 1)
    engine = compiled.engine(block_size=4, blocks=8)
    assert engine.prefill(0, prompt, total_tokens=12, chunk=4) is None
    assert engine.pending(0) == 7
    while (got := engine.resume(0, chunk=3)) is None:
        pass
    assert int(got.argmax()) == want_tokens[0]
    assert relative_error(got, want_logits[0]) < 1e-5


def test_a_fork_decodes_on_its_own_copy_of_the_state() -> None:
    compiled = archc.load("tiny-jamba").compile("eager", dtype="f32")
    vocab = compiled.spec.vocab_size
    prompt = prompts_of([5], vocab, seed=4)[0]
    want_tokens, _ = greedy_reference(compiled, prompt, 3)
    engine = compiled.engine(block_size=4, blocks=12, max_batch=2)
    first = int(engine.prefill(0, prompt, total_tokens=8).argmax())
    engine.fork(0, 1)
    other = (first + 1) % vocab             # the fork takes another token
    out = engine.decode([0, 1], [first, other])
    alone = archc.load("tiny-jamba").compile("eager", dtype="f32")
    want_other, _ = greedy_reference(alone, prompt + [other], 1)
    assert int(out[0].argmax()) == want_tokens[1]
    assert int(out[1].argmax()) == want_other[0]
    out = engine.decode([0], [int(out[0].argmax())])
    assert int(out[0].argmax()) == want_tokens[2]
    assert torch.isfinite(out).all()


def test_triton_engine_refuses_recurrent_mixers() -> None:
    compiled = archc.load("tiny-mamba").compile("triton", dtype="f32")
    with pytest.raises(archc.errors.ArchcError, match=r"tiny-mamba has recurrent mixers "
                       r"\(.+\): the paged engine holds their state per sequence on the eager "
                       r"backend only"):
        compiled.engine()
