"""The server over the prefix cache, chunked prefill and n samples: a chat's second turn finds
its first turn's blocks (``/metrics``) and answers as without the cache; a long prompt's
prefill chunks let a running stream decode between them (the scheduler's step log); n samples
of one prompt, seeded, come back the same twice, greedy ones all as `generate` gives."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import archc
from archc.serve.scheduler import Event, Request, Scheduler
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)
from tests.serving import Running, client, serving
from tests.test_paged_engine import greedy_reference, prompts_of

pytest.importorskip("openai", reason="needs the openai client (pip install 'archc[test]')")


@pytest.fixture(scope="module")
def cached(tiny_gguf: Path) -> Iterator[Running]:  # noqa: F811
    with serving(str(tiny_gguf), block_size=4) as running:
        yield running


@pytest.fixture(scope="module")
def uncached(tiny_gguf: Path) -> Iterator[Running]:  # noqa: F811
    with serving(str(tiny_gguf), block_size=4, prefix_cache=False) as running:
        yield running


def common(a: list[int], b: list[int]) -> int:
    """How many first tokens a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def two_turns(server: Running) -> tuple[str, str, int]:
    """A chat's two turns, greedy: their answers (each checked against `generate`), and the
    tokens the second may find cached: the full blocks its prompt shares with what the first
    left in the cache (its prompt, and its answer but for the last token, never fed back)."""
    api = client(server)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "say it in a word"},
                                      {"role": "user", "content": "cat"}]
    ids = server.model.tokenizer.encode_chat(messages)
    new, text = server.expected(ids, 4)
    first = api.chat.completions.create(model=server.name, messages=messages, max_tokens=4,
                                        temperature=0).choices[0].message.content
    assert first == text
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "mat"}]
    turn = server.model.tokenizer.encode_chat(messages)
    second = api.chat.completions.create(model=server.name, messages=messages, max_tokens=4,
                                         temperature=0).choices[0].message.content
    assert second == server.expected(turn, 4)[1]
    shared = min(common(turn, ids + new[:-1]), len(turn) - 1)
    return first, second, shared // 4 * 4


def test_a_second_chat_turn_finds_the_first_in_the_cache(cached: Running, uncached: Running
                                                         ) -> None:
    before = cached.wait_idle()
    first, second, shared = two_turns(cached)
    after = cached.wait_idle()
    assert shared >= 8
    def grew(name: str) -> float:
        return after[name] - before[name]
    assert grew("archc_prefix_cache_hits_tokens_total") == shared
    assert grew("archc_prefix_cache_hits_blocks_total") == shared // 4
    assert grew("archc_prefix_cache_queries_tokens_total") > shared
    assert after["archc_kv_blocks_cached"] >= shared // 4
    assert two_turns(uncached)[:2] == (first, second)
    assert uncached.wait_idle()["archc_prefix_cache_hits_tokens_total"] == 0


def test_a_long_prompt_is_prefilled_between_decode_steps() -> None:
    compiled = archc.load("tiny-llama3").compile("eager", dtype="f32")
    scheduler = Scheduler(compiled.engine(block_size=4, blocks=24, max_batch=4),
                          prefill_chunk=8)
    events: dict[int, list[Event]] = {0: [], 1: []}
    short, long = prompts_of([5, 40], 97, seed=11)
    running = Request(short, 20, events[0].append)
    scheduler.submit(running)

    def turn() -> None:        # what the loop does each turn (scheduler._loop)
        scheduler._drop_cancelled()
        scheduler._prefill_turn()
        if scheduler.running:
            scheduler._step()
    turn()
    scheduler.submit(Request(long, 4, events[1].append))
    while scheduler.running or scheduler.prefilling or scheduler.queue:
        turn()
    log = list(scheduler.log)
    chunks = [i for i, step in enumerate(log) if step[0] == "prefill" and step[1] == 1]
    assert [log[i][2] for i in chunks] == [8, 8, 8, 8, 8]
    # the running stream (sequence 0) decoded between every two chunks of the long prompt
    for a, b in zip(chunks, chunks[1:]):
        assert any(step[0] == "decode" and 0 in step[1] for step in log[a:b])
    for request, prompt, steps in ((0, short, 20), (1, long, 4)):
        assert [e.token for e in events[request]] == greedy_reference(compiled, prompt, steps)[0]


def test_n_seeded_samples_are_reproducible(cached: Running) -> None:
    api = client(cached)
    ask = dict(model=cached.name, prompt="the cat", max_tokens=8, temperature=1.0, seed=5)
    first = api.completions.create(n=3, **ask)
    again = api.completions.create(n=3, **ask)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1                      # each sample draws on its own
    # the first sample is what n = 1 draws with the same seed
    assert api.completions.create(n=1, **ask).choices[0].text == texts[0]
    assert first.usage.completion_tokens == 3 * 8 or any(
        c.finish_reason == "stop" for c in first.choices)
    # streamed: the same choices, by index
    got = ["", "", ""]
    for chunk in api.completions.create(n=3, stream=True, **ask):
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == texts


def test_n_greedy_samples_are_all_what_generate_gives(cached: Running) -> None:
    api = client(cached)
    ids = cached.model.tokenizer.encode("hello world")
    new, text = cached.expected(ids, 9)
    out = api.completions.create(model=cached.name, prompt="hello world", n=3, max_tokens=9,
                                 temperature=0)
    assert [(c.index, c.text) for c in out.choices] == [(0, text), (1, text), (2, text)]
    assert out.usage.completion_tokens == 3 * len(new)
    messages = [{"role": "user", "content": "hello"}]
    chat = api.chat.completions.create(model=cached.name, messages=messages, n=3,
                                       max_tokens=6, temperature=0)
    want = cached.expected(cached.model.tokenizer.encode_chat(messages), 6)[1]
    assert [c.message.content for c in chat.choices] == [want] * 3
    cached.wait_idle()


def test_best_of_must_equal_n(cached: Running) -> None:
    body = {"model": cached.name, "prompt": "the cat", "max_tokens": 2, "n": 2}
    ok = httpx.post(f"{cached.url}/v1/completions", json={**body, "best_of": 2}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    bad = httpx.post(f"{cached.url}/v1/completions", json={**body, "best_of": 3}, timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "best_of"
    assert "best_of must equal n (2), got 3" in bad.json()["error"]["message"]


def test_a_chat_of_n_samples_without_max_tokens_fits_the_pool(tiny_gguf: Path  # noqa: F811
                                                              ) -> None:
    # a pool of 24 blocks of 4 tokens: one sample could take the context (64 tokens, 16
    # blocks), three share it, 8 blocks each
    with serving(str(tiny_gguf), block_size=4, blocks=24) as server:
        messages = [{"role": "user", "content": "cat"}]
        ids = server.model.tokenizer.encode_chat(messages)
        out = client(server).chat.completions.create(model=server.name, messages=messages,
                                                     n=3, temperature=0)
        new, text = server.expected(ids, 32 - len(ids))
        assert [c.message.content for c in out.choices] == [text] * 3
        assert out.usage.completion_tokens == 3 * len(new)
