"""The paged engine's prefix cache, chunked prefill and fork: full blocks outlive the sequence
that wrote them (found by a chained hash of their tokens), idle blocks go back to the pool least
recently released first, a held block is never taken; with or without the cache, prefilled in
chunks or at once, forked or not, every sequence gives the greedy tokens and logits `generate`
gives on its tokens alone."""

from __future__ import annotations

import pytest
import torch

import archc
from archc.runtime.batch import PoolExhausted
from archc.runtime.paged import PagedEngine
from tests.test_paged import relative_error
from tests.test_paged_engine import greedy_reference, prompts_of

BLOCK = 4
VOCAB = 97


@pytest.fixture(scope="module")
def compiled() -> archc.CompiledModel:
    return archc.load("tiny-llama3").compile("eager", dtype="f32")


def run(engine: PagedEngine, seq: int, prompt: list[int], steps: int, chunk: int | None = None
        ) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill `prompt` (in chunks of `chunk`), then decode greedily alone: tokens, logits."""
    logits = engine.prefill(seq, prompt, total_tokens=len(prompt) + steps, chunk=chunk)
    while logits is None:
        logits = engine.resume(seq, chunk)
    seen, tokens = [logits], [int(logits.argmax())]
    while len(tokens) < steps:
        seen.append(engine.decode([seq], [tokens[-1]])[0])
        tokens.append(int(seen[-1].argmax()))
    return tokens, seen


def assert_generates(compiled: archc.CompiledModel, prompt: list[int], tokens: list[int],
                     logits: list[torch.Tensor]) -> None:
    want_tokens, want_logits = greedy_reference(compiled, prompt, len(tokens))
    assert tokens == want_tokens
    for k, (got, want) in enumerate(zip(logits, want_logits)):
        assert relative_error(got, want) < 1e-5, k


def test_a_finished_sequences_blocks_serve_a_later_prompt(compiled: archc.CompiledModel
                                                          ) -> None:
    engine = compiled.engine(block_size=BLOCK, blocks=12, max_batch=2)
    prompt = prompts_of([6], VOCAB, seed=4)[0]
    first, _ = run(engine, 0, prompt, steps=7)     # 6 + 6 tokens fed: 3 full blocks
    engine.release(0)
    assert engine.blocks_free() == 12 and engine.blocks_cached() == 3
    # the next turn: the first turn's prompt and answer, then new tokens; its generated
    # tokens' blocks are found too
    turn = prompt + first[:6] + [3, 1, 4]
    stats = engine.prefix_stats
    tokens, logits = run(engine, 1, turn, steps=4)
    assert (stats.hit_blocks, stats.hit_tokens) == (3, 12)
    assert (stats.query_blocks, stats.query_tokens) == (1 + 3, 6 + 15)
    assert_generates(compiled, turn, tokens, logits)


def test_the_hash_chains_every_block_before_it(compiled: archc.CompiledModel) -> None:
    engine = compiled.engine(block_size=BLOCK, blocks=12, max_batch=2)
    a, b = prompts_of([4, 4], VOCAB, seed=5)
    run(engine, 0, a + b + [7], steps=1)
    engine.release(0)
    # b's tokens again, but after another first block: not the same prefix, not found
    run(engine, 1, b + b + [7], steps=1)
    assert engine.prefix_stats.hit_blocks == 0
    engine.release(1)
    run(engine, 2, a + b + [9], steps=1)
    assert engine.prefix_stats.hit_blocks == 2


def test_idle_blocks_are_taken_least_recently_released_first(compiled: archc.CompiledModel
                                                             ) -> None:
    engine = compiled.engine(block_size=BLOCK, blocks=8, max_batch=2)
    a, b, c = prompts_of([9, 9, 16], VOCAB, seed=6)
    run(engine, 0, a, steps=1)      # 3 blocks, its first 2 full ones cached
    engine.release(0)
    run(engine, 1, b, steps=1)
    engine.release(1)
    assert (engine.blocks_free(), engine.blocks_cached()) == (8, 4)
    # 16 + 4 tokens, 5 blocks: the 4 never cached, then one of a's, its tail one first
    run(engine, 2, c, steps=4)
    engine.release(2)
    stats = engine.prefix_stats
    tokens, logits = run(engine, 3, b, steps=3)
    assert stats.hit_blocks == 2                    # b's two are still cached
    assert_generates(compiled, b, tokens, logits)
    engine.release(3)
    tokens, logits = run(engine, 4, a, steps=3)
    assert stats.hit_blocks == 2 + 1                # a's first one is
    assert_generates(compiled, a, tokens, logits)


def test_a_held_block_is_never_taken(compiled: archc.CompiledModel) -> None:
    engine = compiled.engine(block_size=BLOCK, blocks=8, max_batch=3)
    a = prompts_of([9], VOCAB, seed=7)[0]
    run(engine, 0, a, steps=1)                      # 3 blocks
    run(engine, 1, a, steps=1)                      # 2 of them shared, 1 more
    assert engine.blocks_free() == 8 - 4
    engine.release(0)                               # its 2 full blocks: still held by 1
    assert engine.blocks_free() == 8 - 3
    with pytest.raises(PoolExhausted, match="needs 6 blocks of 4 tokens; 5 of 8 are free"):
        engine.prefill(2, [5] * 20, total_tokens=24)
    tokens, logits = run(engine, 3, a + [2], steps=3)
    assert engine.prefix_stats.hit_blocks == 2 + 2
    assert_generates(compiled, a + [2], tokens, logits)


def test_answers_are_the_same_without_the_cache(compiled: archc.CompiledModel) -> None:
    prefix = prompts_of([10], VOCAB, seed=8)[0]
    prompts = [prefix + [1, 2], prefix[:8], prefix + [5, 6, 7, 8, 9, 10]]
    answers = {}
    for cache in (True, False):
        engine = compiled.engine(block_size=BLOCK, blocks=10, max_batch=2, prefix_cache=cache)
        answers[cache] = []
        for seq, prompt in enumerate(prompts):
            tokens, logits = run(engine, seq, prompt, steps=4)
            answers[cache].append((tokens, torch.stack(logits)))
            engine.release(seq)
        assert (engine.prefix_stats.hit_blocks > 0) == cache
    for (t1, l1), (t0, l0) in zip(answers[True], answers[False]):
        assert t1 == t0
        assert relative_error(l1, l0) < 1e-5
    assert_generates(compiled, prompts[2], answers[True][2][0], list(answers[True][2][1]))


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_a_prompt_prefilled_in_chunks(compiled: archc.CompiledModel, chunk: int) -> None:
    engine = compiled.engine(block_size=BLOCK, blocks=8, max_batch=2)
    prompt = prompts_of([11], VOCAB, seed=9)[0]
    assert engine.prefill(0, prompt, total_tokens=14, chunk=chunk) is None
    assert engine.pending(0) == 11 - chunk
    with pytest.raises(archc.ArchcError, match="sequence 0 is still prefilling"):
        engine.decode([0], [1])
    engine.release(0)
    tokens, logits = run(engine, 1, prompt, steps=3, chunk=chunk)
    assert_generates(compiled, prompt, tokens, logits)


def test_a_fork_shares_full_blocks_and_copies_the_partial_one(compiled: archc.CompiledModel
                                                              ) -> None:
    engine = compiled.engine(block_size=BLOCK, blocks=8, max_batch=2)
    prompt = prompts_of([6], VOCAB, seed=10)[0]
    first = engine.prefill(0, prompt, total_tokens=10)
    assert first is not None
    engine.fork(0, 1)                   # 1 full block shared; 2 new (the partial one copied)
    assert engine.blocks_free() == 8 - 3 - 2
    # each goes its own way from the prompt: the logits of prompt + its own tokens
    picks = {0: int(first.argmax()), 1: int(first.topk(2).indices[1])}
    seen = {0: [first], 1: [first]}
    for _ in range(3):
        out = engine.decode([0, 1], [picks[0], picks[1]])
        for row in (0, 1):
            seen[row].append(out[row])
        picks = {0: int(out[0].argmax()), 1: int(out[1].argmax())}
    second = prompt + [int(first.topk(2).indices[1])]
    want_tokens, want_logits = greedy_reference(compiled, second, 3)
    assert [int(x.argmax()) for x in seen[1][1:]] == want_tokens
    for got, want in zip(seen[1][1:], want_logits):
        assert relative_error(got, want) < 1e-5
    assert_generates(compiled, prompt, [int(x.argmax()) for x in seen[0]], seen[0])


def test_cache_chunks_and_fork_on_triton() -> None:
    """The generated kernels read the same pools: a cached prefix, a chunked prefill and a fork
    (its partial block copied in the Triton session's pools) give generate's tokens."""
    compiled = archc.load("tiny-llama3").compile("triton", dtype="f32")
    engine = compiled.engine(block_size=BLOCK, blocks=10, max_batch=2)
    prompt = prompts_of([6], VOCAB, seed=12)[0]
    run(engine, 0, prompt, steps=3)
    engine.release(0)                   # 6 + 2 tokens: 2 full blocks cached, the first is
    # the prompt's: a prompt that goes on otherwise finds that one
    tokens, logits = run(engine, 1, prompt + [4, 4, 2], steps=2, chunk=2)
    assert engine.prefix_stats.hit_blocks == 1
    assert_generates(compiled, prompt + [4, 4, 2], tokens, logits)
    engine.release(1)
    first = engine.prefill(2, prompt, total_tokens=9)
    assert first is not None
    engine.fork(2, 3)
    token = int(first.topk(2).indices[1])
    out = engine.decode([2, 3], [int(first.argmax()), token])
    want_tokens, want_logits = greedy_reference(compiled, prompt + [token], 1)
    assert relative_error(out[1], want_logits[0]) < 1e-5
