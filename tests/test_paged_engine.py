"""The paged batch engine (`CompiledModel.engine`, ``archc.runtime.batch.BatchEngine``): sequences
of different prompt lengths, prefilled between batched decode steps, each give the greedy tokens
`generate` gives on that prompt alone, token for token, and logits that agree with it; the pool
is accounted block for block; what it cannot serve is refused in one message."""

from __future__ import annotations

import pytest
import torch

import archc
from archc.errors import ArchcError
from archc.runtime.batch import BatchEngine, PoolExhausted
from tests.test_gguf_smollm2 import smollm2_gguf
from tests.test_paged import relative_error


def greedy_reference(compiled: archc.CompiledModel, prompt: list[int], steps: int
                     ) -> tuple[list[int], list[torch.Tensor]]:
    """`generate`'s greedy tokens after `prompt`, and the logits each was chosen from (what its
    session's steps returned)."""
    session, seen = compiled.session, []
    step = session.step

    def recorded(*args: object, **kw: object) -> torch.Tensor:
        seen.append(step(*args, **kw)[0, -1])
        return seen[-1][None, None]
    session.step = recorded      # type: ignore[method-assign]
    try:
        out = compiled.generate(torch.tensor([prompt]), steps, eos_token_id=())
    finally:
        del session.step
    return out[0, len(prompt):].tolist(), seen


def interleaved(engine: BatchEngine, prompts: list[list[int]], steps: int, first: int = 0
                ) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
    """Sequence first + i starts on prompts[i] after i decode steps of those already running;
    then all decode together until each has `steps` tokens: tokens and logits by sequence."""
    tokens: dict[int, list[int]] = {}
    logits: dict[int, list[torch.Tensor]] = {}

    def decode() -> None:
        live = [s for s in tokens if len(tokens[s]) < steps]
        if not live:
            return
        out = engine.decode(live, [tokens[s][-1] for s in live])
        for row, s in enumerate(live):
            logits[s].append(out[row])
            tokens[s].append(int(out[row].argmax()))

    for i, prompt in enumerate(prompts):
        seq = first + i
        got = engine.prefill(seq, prompt, total_tokens=len(prompt) + steps)
        tokens[seq], logits[seq] = [int(got.argmax())], [got]
        decode()
    while any(len(t) < steps for t in tokens.values()):
        decode()
    return tokens, logits


def check_engine(compiled: archc.CompiledModel, engine: BatchEngine, prompts: list[list[int]],
                 steps: int, first: int = 0) -> None:
    tokens, logits = interleaved(engine, prompts, steps, first)
    for i, prompt in enumerate(prompts):
        want_tokens, want_logits = greedy_reference(compiled, prompt, steps)
        assert tokens[first + i] == want_tokens, (i, tokens[first + i], want_tokens)
        for k, (got, want) in enumerate(zip(logits[first + i], want_logits)):
            assert relative_error(got, want) < 1e-5, (i, k)


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_engine_matches_generate_on_a_tiny_spec(backend: str) -> None:
    compiled = archc.load("tiny-llama3").compile(backend, dtype="f32")
    engine = compiled.engine(block_size=4, blocks=15, max_batch=4)
    # prompts ending inside a block, at a block edge, and of one token
    check_engine(compiled, engine, prompts_of([6, 8, 1], 97), steps=4)
    assert engine.blocks_free() == 15 - (3 + 3 + 2)   # still held: nothing was released


def test_engine_runs_the_program_as_lowered() -> None:
    """passes="none": attention chains and repeat_kv, which paged_kv collapses first."""
    compiled = archc.load("tiny-llama3").compile("eager", passes="none")
    check_engine(compiled, compiled.engine(block_size=4, blocks=8), prompts_of([5, 2], 97), 3)


def test_engine_matches_generate_on_smollm2_kept_quantized() -> None:
    model = archc.load(smollm2_gguf())
    compiled = model.compile("eager", dtype="f32")
    engine = compiled.engine(block_size=16, blocks=9, max_batch=4)
    prompts = [model.tokenizer.encode(text) for text in (
        "The capital of France is", "Once upon a time, in a land far away, there lived a")]
    check_engine(compiled, engine, prompts + [prompts[0][:2]], steps=3)


def test_release_returns_every_block_and_reuse_stays_right() -> None:
    compiled = archc.load("tiny-mistral").compile("eager", dtype="f32")
    engine = compiled.engine(block_size=4, blocks=9, max_batch=3)
    assert (engine.blocks_total, engine.blocks_free(), engine.blocks_for(9)) == (9, 9, 3)
    first = prompts_of([7, 5], 97, seed=1)
    interleaved(engine, first, steps=5)
    assert engine.blocks_free() == 9 - 3 - 3
    engine.release(0)
    engine.release(1)
    assert engine.blocks_free() == 9
    # a new sequence takes the released blocks, which still hold the old sequences' keys
    check_engine(compiled, engine, prompts_of([9, 2], 97, seed=2), steps=3, first=10)
    engine.release(10)
    engine.release(11)
    assert engine.blocks_free() == 9


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_prompts_share_the_full_blocks_of_a_common_prefix(backend: str) -> None:
    # a sliding window (8) shorter than the prompts: which shared block holds which positions
    # matters, not only what keys the blocks hold
    compiled = archc.load("tiny-mistral").compile(backend, dtype="f32")
    engine = compiled.engine(block_size=4, blocks=12, max_batch=3)
    prefix = prompts_of([9], 97, seed=3)[0]
    # 11 + 3 tokens: 4 blocks; 10 + 3: 4 blocks, the prefix's 2 full ones shared; 8 + 3 (the
    # prefix's first two blocks exactly, its last token computed): 3 blocks, 1 shared
    check_engine(compiled, engine, [prefix + [5, 6], prefix + [7], prefix[:8]], steps=3)
    assert engine.blocks_free() == 12 - 4 - 2 - 2
    engine.release(0)           # its prefix blocks stay with the others
    assert engine.blocks_free() == 12 - 2 - 2 - 2
    engine.release(1)
    assert engine.blocks_free() == 12 - 3
    engine.release(2)
    assert engine.blocks_free() == 12
    # nothing is held any more, but the prefix's full blocks stay cached: a new prompt holds
    # them again
    check_engine(compiled, engine, [prefix + [1]], steps=2, first=5)
    assert engine.blocks_free() == 12 - 3


def test_prefill_raises_pool_exhausted_and_reserves_nothing() -> None:
    engine = archc.load("tiny-llama3").compile("eager").engine(block_size=4, blocks=5,
                                                               max_batch=2)
    engine.prefill(1, [1, 2, 3], total_tokens=12)          # 3 blocks reserved
    assert engine.blocks_free() == 2
    with pytest.raises(PoolExhausted, match="needs 3 blocks of 4 tokens; 2 of 5 are free"):
        engine.prefill(2, [4, 5], total_tokens=9)
    assert engine.blocks_free() == 2
    engine.prefill(2, [4, 5], total_tokens=8)               # 2 blocks: fits
    assert engine.blocks_free() == 0
    engine.release(1)
    assert engine.blocks_free() == 3


def test_blocks_default_to_max_batch_sequences_of_max_seq_len(
        monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = archc.load("tiny-llama3").compile("eager")
    engine = compiled.engine(block_size=16, max_batch=3)
    assert (engine.blocks_total, engine.max_seq_len, engine.max_batch) == (3 * 64 // 16, 64, 3)
    spec = compiled.spec
    head_dim = spec.d_model // spec.attention.heads
    # k and v of each layer: 16 rows of each KV head's head_dim f32 values
    assert engine.block_bytes == spec.layers * 2 * spec.attention.kv_heads * head_dim * 16 * 4
    # when they do not fit in half the free memory: what does
    monkeypatch.setattr("archc.memory.host_available", lambda: 2 * 5 * engine.block_bytes)
    assert compiled.engine(block_size=16, max_batch=3).blocks_total == 5
    # fewer than one sequence of max_seq_len (4 blocks): shorter sequences, the pool refusing
    # one that needs more blocks than it holds
    monkeypatch.setattr("archc.memory.host_available", lambda: 2 * 3 * engine.block_bytes)
    short = compiled.engine(block_size=16, max_batch=3)
    assert short.blocks_total == 3
    with pytest.raises(PoolExhausted):
        short.prefill(0, [1, 2, 3], total_tokens=64)
    monkeypatch.setattr("archc.memory.host_available", lambda: engine.block_bytes)
    with pytest.raises(ArchcError, match="one KV-cache block of 16 tokens needs 8.00 KiB"):
        compiled.engine(block_size=16, max_batch=3)


@pytest.mark.parametrize(("name", "options", "message"), [
    ("tiny-bert", {}, "tiny-bert is an encoder: the paged engine serves decoder-only models"),
    ("tiny-t5", {}, "tiny-t5 is an encoder-decoder: the paged engine serves decoder-only"),
    ("tiny-llama3", {"kv_cache": "int8"}, "holds an int8 cache; a paged pool holds the model"),
    ("tiny-longctx", {}, "dynamic NTK"),
])
def test_engine_refuses_what_it_cannot_serve(name: str, options: dict[str, str],
                                             message: str) -> None:
    compiled = archc.load(name).compile("eager", **options)
    with pytest.raises(ArchcError, match=message):
        compiled.engine()


def test_engine_refuses_a_model_over_several_ranks() -> None:
    class TwoRanks:     # what a tensor-parallel session holds: a communicator of 2 ranks
        size = 2

    compiled = archc.load("tiny-llama3").compile("eager")
    compiled.session.comms = {"tp": TwoRanks()}
    with pytest.raises(ArchcError, match=r"over several ranks \(tp=2\); the paged engine runs "
                       r"a model on one device"):
        compiled.engine()


def test_engine_refuses_bad_calls() -> None:
    engine = archc.load("tiny-llama3").compile("eager").engine(block_size=4, blocks=20,
                                                               max_batch=2)
    with pytest.raises(ArchcError, match="block_size must be an integer ≥ 1, got 0"):
        archc.load("tiny-llama3").compile("eager").engine(block_size=0)
    with pytest.raises(ArchcError, match="total_tokens=65 exceeds max_seq_len = 64"):
        engine.prefill(1, [1, 2], total_tokens=65)
    with pytest.raises(ArchcError, match="total_tokens=1 is shorter than its 2-token prompt"):
        engine.prefill(1, [1, 2], total_tokens=1)
    with pytest.raises(ArchcError, match=r"ids outside the vocabulary \[0, 97\)"):
        engine.prefill(1, [1, 200], total_tokens=4)
    engine.prefill(1, [1, 2], total_tokens=3)
    with pytest.raises(ArchcError, match="sequence 1 is already running"):
        engine.prefill(1, [1, 2], total_tokens=3)
    with pytest.raises(ArchcError, match="sequence 5 is not running"):
        engine.decode([5], [1])
    with pytest.raises(ArchcError, match="names a sequence twice"):
        engine.decode([1, 1], [1, 2])
    engine.decode([1], [3])
    with pytest.raises(ArchcError, match="reached the 3 tokens it reserved"):
        engine.decode([1], [3])
    engine.prefill(2, [1], total_tokens=2)
    engine.prefill(3, [1], total_tokens=2)
    with pytest.raises(ArchcError, match="exceeds max_batch = 2"):
        engine.decode([1, 2, 3], [1, 1, 1])
    assert engine.blocks_free() == 20 - 3
    assert sorted(engine._seqs) == [1, 2, 3]


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_a_prefill_of_every_token_gives_each_positions_logits(backend: str) -> None:
    """`every=True`, in chunks of 5, after another sequence left the prompt's full blocks in
    the prefix cache: the logits of every prompt position, as one contiguous step gives them;
    the cache is not used (nothing it holds has logits) and the sequence then decodes on."""
    compiled = archc.load("tiny-llama3").compile(backend, dtype="f32")
    engine = compiled.engine(block_size=4, blocks=12, max_batch=2)
    prompt = prompts_of([11], 97, seed=4)[0]
    engine.prefill(0, prompt, len(prompt) + 2)
    engine.release(0)
    hits = engine.prefix_stats.hit_tokens
    chunks = [engine.prefill(1, prompt, len(prompt) + 2, chunk=5, every=True)]
    while engine.pending(1):
        chunks.append(engine.resume(1, chunk=5))
    assert [c.shape[0] for c in chunks] == [5, 5, 1]
    assert engine.prefix_stats.hit_tokens == hits
    reference = archc.load("tiny-llama3").compile("eager", dtype="f32").session
    want = reference.step(torch.tensor([prompt]))[0]
    assert relative_error(torch.cat(chunks), want) < 1e-5
    tokens, logits = greedy_reference(compiled, prompt, 2)
    assert relative_error(engine.decode([1], [tokens[0]])[0], logits[1]) < 1e-5
