"""Continuous batching under load: sixteen streams at once, of different prompt and output
lengths, each the answer `generate` gives alone and none lost; the decode batch really holds
several; streams closed halfway are cancelled and give their KV blocks back; and a pool too small
for everyone makes requests wait their turn rather than fail."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)
from tests.serving import Running, client, serving

pytest.importorskip("openai", reason="needs the openai client (pip install 'archc[test]')")

CLIENTS = 16


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> Iterator[Running]:  # noqa: F811
    with serving(str(tiny_gguf), max_batch=CLIENTS) as running:
        yield running


def requests(running: Running) -> list[dict[str, Any]]:
    """Sixteen prompts of token ids, 2 … 7 tokens, asking for 6 … 51 tokens; with the tokens
    and text greedy `generate` gives each."""
    out = []
    for i in range(CLIENTS):
        prompt = [(7 * i + 5 * j) % 90 + 3 for j in range(2 + i % 6)]
        max_tokens = 6 + 3 * i
        new, text = running.expected(prompt, max_tokens)
        out.append({"prompt": prompt, "max_tokens": max_tokens, "new": new, "text": text,
                    "finish": "stop" if new[-1] in running.model.eos_token_ids else "length"})
    return out


def stream(running: Running, want: dict[str, Any], start: threading.Barrier,
           close_after: int | None = None) -> tuple[str, str | None]:
    """One client's stream: its text and finish reason; closed after `close_after` chunks."""
    api = client(running)
    start.wait()
    chunks = api.completions.create(model=running.name, prompt=want["prompt"],
                                    max_tokens=want["max_tokens"], temperature=0, stream=True)
    text, finish = "", None
    for n, chunk in enumerate(chunks, 1):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason
        if close_after is not None and n == close_after:
            chunks.close()      # the client goes away mid-stream
            break
    return text, finish


def test_sixteen_streams_at_once_each_complete_and_correct(tiny: Running) -> None:
    wants = requests(tiny)
    before = tiny.wait_idle()
    start = threading.Barrier(CLIENTS)
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda w: stream(tiny, w, start), wants))
    for want, (text, finish) in zip(wants, results):
        assert (text, finish) == (want["text"], want["finish"]), want["prompt"]
    after = tiny.wait_idle()
    assert after["archc_batch_size_max"] > 1
    steps = after["archc_decode_batch_size_count"] - before["archc_decode_batch_size_count"]
    single = after['archc_decode_batch_size_bucket{le="1"}'] - \
        before['archc_decode_batch_size_bucket{le="1"}']
    assert single < steps          # some decode steps ran several rows
    assert after["archc_requests_received_total"] - \
        before["archc_requests_received_total"] == CLIENTS
    finished = sum(after.get(f'archc_requests_finished_total{{reason="{r}"}}', 0) -
                   before.get(f'archc_requests_finished_total{{reason="{r}"}}', 0)
                   for r in ("stop", "length"))
    assert finished == CLIENTS
    assert after["archc_generation_tokens_total"] - before["archc_generation_tokens_total"] == \
        sum(len(w["new"]) for w in wants)


def test_closing_half_the_streams_cancels_them_and_frees_their_blocks(tiny: Running) -> None:
    wants = requests(tiny)
    # the eight that would run longest are closed after two chunks: well before their end
    longest = sorted(range(CLIENTS), key=lambda i: -len(wants[i]["new"]))[:CLIENTS // 2]
    assert min(len(wants[i]["new"]) for i in longest) >= 20
    before = tiny.wait_idle()
    start = threading.Barrier(CLIENTS)
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda i: stream(tiny, wants[i], start,
                                                 2 if i in longest else None), range(CLIENTS)))
    for i, (want, (text, finish)) in enumerate(zip(wants, results)):
        if i in longest:
            assert want["text"].startswith(text) and finish is None
        else:
            assert (text, finish) == (want["text"], want["finish"])
    after = tiny.wait_idle()    # every block back in the pool, nothing running or queued
    assert after["archc_kv_blocks_free"] == after["archc_kv_blocks_total"] > 0
    cancelled = 'archc_requests_finished_total{reason="cancelled"}'
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == CLIENTS // 2
    generated = after["archc_generation_tokens_total"] - before["archc_generation_tokens_total"]
    assert generated < sum(len(w["new"]) for w in wants)


@pytest.mark.parametrize("limits", [{"blocks": 4}, {"max_tokens_in_flight": 64}])
def test_a_small_pool_makes_requests_wait_never_fail(tiny_gguf: Path,  # noqa: F811
                                                     limits: dict[str, int]) -> None:
    """Blocks of 16 tokens, each request up to 32 tokens: two fit at a time."""
    with serving(str(tiny_gguf), **limits) as small:
        wants = [{**w, "max_tokens": 32 - len(w["prompt"])} for w in requests(small)[:6]]
        for want in wants:
            want["new"], want["text"] = small.expected(want["prompt"], want["max_tokens"])
            want["finish"] = "stop" if want["new"][-1] in small.model.eos_token_ids else "length"
        start = threading.Barrier(len(wants))
        with ThreadPoolExecutor(len(wants)) as pool:
            results = list(pool.map(lambda w: stream(small, w, start), wants))
        for want, (text, finish) in zip(wants, results):
            assert (text, finish) == (want["text"], want["finish"])
        m = small.wait_idle()
        assert m["archc_batch_size_max"] == 2
        assert m.get('archc_requests_finished_total{reason="stop"}', 0) + \
            m.get('archc_requests_finished_total{reason="length"}', 0) == len(wants)


@contextlib.contextmanager
def slowed(running: Running, seconds: float) -> Iterator[None]:
    """Each decode step of the server's engine takes `seconds` longer."""
    engine = running.served.scheduler.engine
    decode = engine.decode

    def slow(*args: Any) -> Any:
        time.sleep(seconds)
        return decode(*args)

    engine.decode = slow
    try:
        yield
    finally:
        del engine.decode


def test_a_client_that_stops_waiting_cancels_its_request(tiny: Running) -> None:
    """Not streamed: the client gives up (a read timeout closes its connection) long before
    the 50 tokens it asked for, and the server cancels the request."""
    before = tiny.wait_idle()
    cancelled = 'archc_requests_finished_total{reason="cancelled"}'
    body = {"model": tiny.name, "prompt": [10, 15, 20], "max_tokens": 50, "temperature": 0}
    assert len(tiny.expected(body["prompt"], 50)[0]) == 50     # no end-of-sequence on the way
    with slowed(tiny, 0.05):
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{tiny.url}/v1/completions", json=body, timeout=0.5)
        after = tiny.wait_idle()
        assert time.monotonic() - start < 50 * 0.05     # it did not run to its end
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1
    assert after["archc_kv_blocks_free"] == after["archc_kv_blocks_total"]


def test_without_max_tokens_a_chat_asks_for_what_the_pool_holds(tiny_gguf: Path,  # noqa: F811
                                                               ) -> None:
    """The context is 64 tokens; a pool of 2 blocks of 16 holds 32."""
    with serving(str(tiny_gguf), blocks=2) as small:
        messages = [{"role": "user", "content": "the cat"}]
        ids = small.model.tokenizer.encode_chat(messages)
        new, text = small.expected(ids, 32 - len(ids))
        out = client(small).chat.completions.create(model=small.name, messages=messages,
                                                    temperature=0)
        assert (out.choices[0].message.content, out.usage.completion_tokens) == (text, len(new))
