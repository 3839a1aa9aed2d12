"""`archc serve` through the official OpenAI client: completions and chat, streamed and not,
each greedy answer the tokens `CompiledModel.generate` gives the same prompt; stop strings,
seeded sampling, text streamed without splitting a character; on a tiny Llama GGUF file and on
SmolLM2-135M-Instruct."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from archc.serve.metrics import parse
from archc.serve.scheduler import StopText
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)
from tests.serving import Running, client, serving
from tests.test_gguf_smollm2 import smollm2_gguf

pytest.importorskip("openai", reason="needs the openai client (pip install 'archc[test]')")

PROMPTS = ["the cat sat", "hello world", "the end of the mat", "sat on"]


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> Iterator[Running]:  # noqa: F811
    with serving(str(tiny_gguf)) as running:
        yield running


def finish_of(new: list[int], running: Running) -> str:
    return "stop" if new and new[-1] in running.model.eos_token_ids else "length"


def streamed(stream: Any, chat: bool) -> tuple[str, str | None, list[Any]]:
    """The text of a stream's chunks, its finish reason, and the chunks."""
    chunks = list(stream)
    texts = [(c.choices[0].delta.content or "") if chat else c.choices[0].text
             for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert all(f is None for f in finish[:-1])
    return "".join(texts), finish[-1], chunks


@pytest.mark.parametrize("max_tokens", [1, 9, 24])
def test_completions_are_what_generate_gives(tiny: Running, max_tokens: int) -> None:
    api = client(tiny)
    for prompt in PROMPTS:
        ids = tiny.model.tokenizer.encode(prompt)
        new, text = tiny.expected(ids, max_tokens)
        out = api.completions.create(model=tiny.name, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0)
        assert out.choices[0].text == text
        assert out.choices[0].finish_reason == finish_of(new, tiny)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(new))
        assert out.usage.total_tokens == len(ids) + len(new)
        assert out.object == "text_completion" and out.model == tiny.name
        got, finish, chunks = streamed(api.completions.create(
            model=tiny.name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}), chat=False)
        assert (got, finish) == (text, finish_of(new, tiny))
        assert chunks[-1].usage.completion_tokens == len(new)


def test_the_kernels_serve_requests_together_as_generate_answers(
        tiny_gguf: Path) -> None:  # noqa: F811
    """The server over the paged engine on the triton backend (its kernels under Triton's
    interpreter, f32): four requests at once share decode steps, and each greedy answer is
    eager `generate`'s."""
    with serving(str(tiny_gguf), backend="triton") as running:
        api = client(running)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: api.completions.create(
                model=running.name, prompt=p, max_tokens=8, temperature=0), PROMPTS))
        for prompt, out in zip(PROMPTS, outs):
            new, text = running.expected(running.model.tokenizer.encode(prompt), 8)
            assert out.choices[0].text == text, prompt
        assert running.metrics()["archc_batch_size_max"] > 1


def test_a_prompt_of_token_ids(tiny: Running) -> None:
    ids = [5, 17, 33, 8, 40]
    new, text = tiny.expected(ids, 12)
    out = client(tiny).completions.create(model=tiny.name, prompt=ids, max_tokens=12,
                                          temperature=0)
    assert (out.choices[0].text, out.usage.completion_tokens) == (text, len(new))


def test_chat_is_what_generate_gives_on_the_template(tiny: Running) -> None:
    api = client(tiny)
    for question in PROMPTS:
        messages = [{"role": "system", "content": "answer in a word"},
                    {"role": "user", "content": question}]
        ids = tiny.model.tokenizer.encode_chat(messages)
        new, text = tiny.expected(ids, 20)
        out = api.chat.completions.create(model=tiny.name, messages=messages, max_tokens=20,
                                          temperature=0)
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].message.content == text
        assert out.choices[0].finish_reason == finish_of(new, tiny)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(new))
        got, finish, chunks = streamed(api.chat.completions.create(
            model=tiny.name, messages=messages, max_tokens=20, temperature=0, stream=True),
            chat=True)
        assert (got, finish) == (text, finish_of(new, tiny))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_a_chat_without_max_tokens_may_fill_the_context(tiny: Running) -> None:
    messages = [{"role": "user", "content": "the cat"}]
    ids = tiny.model.tokenizer.encode_chat(messages)
    room = tiny.model.spec.max_seq_len - len(ids)
    new, text = tiny.expected(ids, room)
    out = client(tiny).chat.completions.create(model=tiny.name, messages=messages,
                                               temperature=0)
    assert (out.choices[0].message.content, out.usage.completion_tokens) == (text, len(new))


def test_the_stream_is_server_sent_events_ending_done(tiny: Running) -> None:
    body = {"model": tiny.name, "prompt": "the cat", "max_tokens": 6, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1


def test_stop_strings_end_the_text_before_them(tiny: Running) -> None:
    api = client(tiny)
    prompt = "hello world"
    new, text = tiny.expected(tiny.model.tokenizer.encode(prompt), 40)
    assert len(text) >= 8, text
    stop = text[4:7]                 # found first at 4 or earlier
    cut = text[:text.find(stop)]
    out = api.completions.create(model=tiny.name, prompt=prompt, max_tokens=40, temperature=0,
                                 stop=[stop, "never in the text \u2603"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    assert out.usage.completion_tokens < len(new)
    got, finish, _ = streamed(api.completions.create(
        model=tiny.name, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True),
        chat=False)
    assert (got, finish) == (cut, "stop")


def test_seeded_sampling_is_generate_with_that_seed(tiny: Running) -> None:
    import torch
    api = client(tiny)
    ids = tiny.model.tokenizer.encode("the mat")
    answers = set()
    for seed in (1, 2, 3):
        out = tiny.reference.generate(torch.tensor([ids]), 16, temperature=0.9, top_p=0.95,
                                      top_k=40, seed=seed)
        new = [int(t) for t in out[0, len(ids):]]
        text = tiny.model.tokenizer.decode([t for t in new if t not in
                                            tiny.model.eos_token_ids])
        got = api.completions.create(model=tiny.name, prompt=ids, max_tokens=16,
                                     temperature=0.9, top_p=0.95, seed=seed,
                                     extra_body={"top_k": 40})
        assert (got.choices[0].text, got.usage.completion_tokens) == (text, len(new))
        answers.add(text)
    assert len(answers) > 1, "three seeds sampled alike"


def test_models_health_and_metrics(tiny: Running) -> None:
    models = client(tiny).models.list().data
    assert [m.id for m in models] == [tiny.name]
    assert httpx.get(f"{tiny.url}/health").json() == {"status": "ok"}
    page = httpx.get(f"{tiny.url}/metrics")
    assert page.headers["content-type"].startswith("text/plain")
    for name in ("archc_requests_received_total", "archc_queue_depth", "archc_batch_size",
                 "archc_time_to_first_token_seconds", "archc_inter_token_latency_seconds",
                 "archc_kv_blocks_free", "archc_kv_blocks_total"):
        assert f"# TYPE {name} " in page.text
    before = tiny.wait_idle()
    out = client(tiny).completions.create(model=tiny.name, prompt="the cat", max_tokens=5,
                                          temperature=0)
    after = tiny.wait_idle()
    assert after["archc_requests_received_total"] == before["archc_requests_received_total"] + 1
    assert after["archc_prompt_tokens_total"] - before["archc_prompt_tokens_total"] == \
        out.usage.prompt_tokens
    assert after["archc_generation_tokens_total"] - before["archc_generation_tokens_total"] == \
        out.usage.completion_tokens
    assert after["archc_time_to_first_token_seconds_count"] == \
        before["archc_time_to_first_token_seconds_count"] + 1
    assert after["archc_inter_token_latency_seconds_count"] - \
        before["archc_inter_token_latency_seconds_count"] == out.usage.completion_tokens - 1


class Letters:
    """A tokenizer whose tokens are single UTF-8 bytes, for StopText alone."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text,stops,want", [
    ("hello world", ["wor"], "hello "),
    ("hello world", ["xyz", "lo w"], "hel"),
    ("hello world", ["world", "o"], "hell"),
    ("aab", ["ab"], "a"),
    ("café ☃ ok", ["☃"], "café "),
    ("no stop here", ["zz"], "no stop here"),
])
def test_stop_text_holds_back_what_may_start_a_stop_string(text: str, stops: list[str],
                                                           want: str) -> None:
    stream = StopText(Letters(), stops)
    pieces, stopped = [], False
    for byte in text.encode():
        piece, stopped = stream.push(byte)
        assert "\ufffd" not in piece
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(stream.finish())
    assert "".join(pieces) == want


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Running]:
    with serving(str(smollm2_gguf()), max_batch=4) as running:
        yield running


def test_smollm2_answers_as_generate_does(smollm2: Running) -> None:
    api = client(smollm2, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2.model.tokenizer.encode_chat(messages)
    new, text = smollm2.expected(ids, 10)
    got, finish, _ = streamed(api.chat.completions.create(
        model=smollm2.name, messages=messages, max_tokens=10, temperature=0, stream=True),
        chat=True)
    assert (got, finish) == (text, finish_of(new, smollm2))
    assert "Paris" in got
    prompt = "Le café crème coûte"
    ids = smollm2.model.tokenizer.encode(prompt)
    new, text = smollm2.expected(ids, 8)
    out = api.completions.create(model=smollm2.name, prompt=prompt, max_tokens=8, temperature=0)
    assert (out.choices[0].text, out.usage.completion_tokens) == (text, len(new))


def test_smollm2_streams_whole_characters(smollm2: Running) -> None:
    """Emoji and accents span several byte-level tokens: each streamed piece is whole text."""
    tok = smollm2.model.tokenizer
    text = "Voilà: naïve café 🎉🇫🇷 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())
    stream = StopText(tok, ["🇷 o"])
    pieces = []
    for i in ids:
        piece, stopped = stream.push(i)
        assert "\ufffd" not in piece
        pieces.append(piece)
        if stopped:
            break
    assert stopped and "".join(pieces) == "Voilà: naïve café 🎉🇫"


def test_the_command_serves_a_checkpoint(tiny_gguf: Path,  # noqa: F811
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`archc serve FILE --port 0` as the command line runs it, stopped from the test."""
    import threading
    import time

    from archc.cli import main
    from archc.serve import server as served_by
    started: list[served_by.Server] = []
    run = served_by.Server.run

    def remembered(self: served_by.Server) -> None:
        started.append(self)
        run(self)

    monkeypatch.setattr(served_by.Server, "run", remembered)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(main(
        ["serve", str(tiny_gguf), "--port", "0", "--max-batch", "3", "--quiet",
         "--model-name", "tiny", "--max-tokens-in-flight", "40", "--prefill-chunk", "3",
         "--no-prefix-cache", "--block-size", "4"])))
    thread.start()
    deadline = time.monotonic() + 60
    while not (started and started[0].server.started):
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    server = started[0]
    url = f"http://127.0.0.1:{server.port}"
    try:
        api = client(url)
        assert [m.id for m in api.models.list().data] == ["tiny"]
        out = api.completions.create(model="tiny", prompt="the cat", max_tokens=5)
        assert out.usage.prompt_tokens == 2 and out.choices[0].finish_reason
        error = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": "the cat", "max_tokens": 39}).json()["error"]
        assert "--max-tokens-in-flight of 40" in error["message"]
        # prompts in chunks of 3 tokens; the same prompt twice, the second not found in a
        # cache that is off
        for _ in range(2):
            ids = api.completions.create(model="tiny", prompt="the cat sat on the mat",
                                         max_tokens=1).usage.prompt_tokens
        metrics = parse(httpx.get(f"{url}/metrics").text)
        assert metrics["archc_prefill_chunks_total"] >= 1 + 2 * -(-ids // 3)
        assert metrics["archc_prefix_cache_queries_tokens_total"] >= 2 * ids
        assert metrics["archc_prefix_cache_hits_tokens_total"] == 0
    finally:
        server.server.should_exit = True
        thread.join(30)
    assert status == [0]
