"""Logprobs, echo, prompt lists and the tokenizer routes of `archc serve`, through the official
OpenAI client: every logprob (streamed and not, completions and chat, a prompt's own under
echo) is the eager model's log-softmax at that position; a prompt whose blocks the prefix cache
holds is still scored whole, over prefill chunks; prompt i's sample j is choice i·n + j;
/tokenize and /detokenize round-trip; bad values get OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from archc.tokenizer import from_gguf_vocab
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)
from tests.serving import Running, client, serving

pytest.importorskip("openai", reason="needs the openai client (pip install 'archc[test]')")

# f32 on both sides, the same program run paged and contiguous: they differ by rounding only
TOLERANCE = 1e-4
PROMPT = "the cat sat on the mat and the end"


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> Iterator[Running]:  # noqa: F811
    # blocks of 4 tokens and prefill chunks of 5: a scored prompt spans chunks, and its full
    # blocks are in the prefix cache once any request has prefilled it
    with serving(str(tiny_gguf), block_size=4, prefill_chunk=5) as running:
        yield running


def reference(running: Running, ids: Sequence[int]) -> torch.Tensor:
    """The eager model's log-softmax at every position of `ids`, [T, vocab]: row t scores the
    token after position t."""
    session = running.reference.session
    session.reset()
    logits = session.step(torch.tensor([list(ids)]))[0]
    return logits.float().log_softmax(dim=-1)


def check_scores(expected: torch.Tensor, tokens: Sequence[int], got: Sequence[float],
                 tops: Sequence[Sequence[float]]) -> None:
    """got[t] is the logprob of tokens[t] in row t of `expected`; tops[t] that row's likeliest
    logprobs, likeliest first."""
    assert len(got) == len(tokens) == len(tops)
    for t, (token, value, top) in enumerate(zip(tokens, got, tops)):
        assert abs(value - float(expected[t, token])) < TOLERANCE, t
        best = expected[t].topk(len(top)).values
        assert torch.allclose(torch.tensor(list(top)), best, atol=TOLERANCE, rtol=0), t


def completion_values(logprobs: Any, k: int) -> tuple[list[float], list[list[float]]]:
    """token_logprobs, and each position's k likeliest logprobs (the chosen token's may be
    listed beside them)."""
    tops = [sorted(top.values(), reverse=True)[:k] for top in logprobs.top_logprobs]
    return list(logprobs.token_logprobs), tops


def greedy_ids(running: Running, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    ids = running.model.tokenizer.encode(prompt)
    return ids, running.expected(ids, max_tokens)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_models_log_softmax(tiny: Running, stream: bool) -> None:
    ids, new = greedy_ids(tiny, "the cat sat", 6)
    expected = reference(tiny, ids + new)[len(ids) - 1:]
    out = client(tiny).completions.create(model=tiny.name, prompt="the cat sat", max_tokens=6,
                                          temperature=0, logprobs=3, stream=stream)
    if stream:
        chunks = [c.choices[0] for c in out if c.choices]
        text = "".join(c.text for c in chunks)
        parts = [c.logprobs for c in chunks if c.logprobs is not None]
        tokens = [t for p in parts for t in p.tokens]
        got = [v for p in parts for v in p.token_logprobs]
        tops = [sorted(d.values(), reverse=True)[:3] for p in parts for d in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
    else:
        choice = out.choices[0]
        text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
        got, tops = completion_values(choice.logprobs, 3)
    check_scores(expected, new, got, tops)
    assert len(tokens) == len(new)
    # each token's text starts where the tokens before it end
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    eos = set(tiny.model.eos_token_ids)
    assert text == tiny.model.tokenizer.decode([t for t in new if t not in eos])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_models_log_softmax(tiny: Running, stream: bool) -> None:
    messages = [{"role": "user", "content": "the cat"}]
    ids = tiny.model.tokenizer.encode_chat(messages)
    new = tiny.expected(ids, 5)[0]
    expected = reference(tiny, ids + new)[len(ids) - 1:]
    out = client(tiny).chat.completions.create(model=tiny.name, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=5, temperature=0, logprobs=True,
                                               top_logprobs=4, stream=stream)
    if stream:
        content = [e for c in out if c.choices and c.choices[0].logprobs is not None
                   for e in c.choices[0].logprobs.content]
    else:
        content = out.choices[0].logprobs.content
    check_scores(expected, new, [e.logprob for e in content],
                 [[t.logprob for t in e.top_logprobs] for e in content])
    for e in content:
        assert e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].logprob >= e.logprob - TOLERANCE


def test_chat_without_logprobs_has_none(tiny: Running) -> None:
    out = client(tiny).chat.completions.create(
        model=tiny.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt(tiny: Running, stream: bool) -> None:
    """What lm-evaluation-harness asks: the prompt's own logprobs, the first token's null, and
    nothing generated; right even though an earlier request left the prompt's blocks in the
    prefix cache (a scored prompt is prefilled whole, in chunks of 5)."""
    api = client(tiny)
    api.completions.create(model=tiny.name, prompt=PROMPT, max_tokens=1)   # caches its blocks
    ids = tiny.model.tokenizer.encode(PROMPT)
    assert len(ids) > 8     # more than one prefill chunk, and full blocks to find cached
    expected = reference(tiny, ids)
    out = api.completions.create(model=tiny.name, prompt=PROMPT, max_tokens=0, echo=True,
                                 logprobs=2, stream=stream)
    if stream:
        chunks = [c for c in out if c.choices]
        logprobs = chunks[0].choices[0].logprobs
        text = "".join(c.choices[0].text for c in chunks)
        assert all(c.choices[0].logprobs is None or not c.choices[0].logprobs.tokens
                   for c in chunks[1:])
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        logprobs, text = out.choices[0].logprobs, out.choices[0].text
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
        assert out.choices[0].finish_reason == "length"
    assert text == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == PROMPT and len(logprobs.tokens) == len(ids)
    got, tops = completion_values(
        logprobs.model_copy(update={"top_logprobs": logprobs.top_logprobs[1:]}), 2)
    check_scores(expected[:-1], ids[1:], got[1:], tops)
    assert tiny.wait_idle()["archc_kv_blocks_free"] == tiny.served.scheduler.engine.blocks_total


def test_echo_then_generation_continues_the_scores(tiny: Running) -> None:
    """lm-evaluation-harness's own request (echo, logprobs 1, max_tokens 1): the prompt's
    scores, then the token generated after it."""
    ids, new = greedy_ids(tiny, "the cat sat", 1)
    expected = reference(tiny, ids + new)
    out = client(tiny).completions.create(model=tiny.name, prompt=[ids], max_tokens=1,
                                          echo=True, logprobs=1, temperature=0)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1
    got, tops = completion_values(
        logprobs.model_copy(update={"top_logprobs": logprobs.top_logprobs[1:]}), 1)
    check_scores(expected, (ids + new)[1:], got[1:], tops)
    assert out.choices[0].text == "the cat sat" + tiny.expected(ids, 1)[1]


@pytest.mark.parametrize("prompt", [["the cat", "hello world", "sat on"],
                                    [[20, 31], [5, 6, 7]], [20, 31, 40]])
def test_a_list_of_prompts_is_n_choices_each_in_order(tiny: Running, prompt: Any) -> None:
    tokenizer = tiny.model.tokenizer
    prompts = prompt if isinstance(prompt[0], list | str) else [prompt]
    ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    out = client(tiny).completions.create(model=tiny.name, prompt=prompt, max_tokens=4,
                                          temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(2 * len(prompts)))
    for c in out.choices:
        assert c.text == tiny.expected(ids[c.index // 2], 4)[1], c.index
    assert out.usage.prompt_tokens == sum(len(i) for i in ids)


def test_tokenize_and_detokenize_round_trip(tiny: Running) -> None:
    tokenizer = tiny.model.tokenizer
    r = httpx.post(f"{tiny.url}/tokenize", json={"model": tiny.name, "prompt": PROMPT,
                                                "return_token_strs": True}, timeout=10).json()
    assert r["tokens"] == tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 64 and len(r["token_strs"]) == r["count"]
    back = httpx.post(f"{tiny.url}/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert back["prompt"] == tokenizer.decode(r["tokens"], skip_special_tokens=False)
    assert back["prompt"].endswith(PROMPT)
    plain = httpx.post(f"{tiny.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens":
                                                     False}, timeout=10).json()
    assert plain["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{tiny.url}/tokenize", json={"messages": messages}, timeout=10).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    info = httpx.get(f"{tiny.url}/tokenizer_info", timeout=10).json()
    assert (info["eos_token"], info["bos_token"]) == (tokenizer.eos_token, tokenizer.bos_token)
    assert info["chat_template"] == tokenizer.chat_template


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "MODEL", "prompt": "the cat", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], **fields}


# (path, body, param, words the message has)
BAD = [
    ("v1/chat/completions", chat(top_logprobs=2), "top_logprobs", "only with logprobs: true"),
    ("v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs", "≤ 20"),
    ("v1/chat/completions", chat(logprobs=True, top_logprobs=-1), "top_logprobs", "≥ 0"),
    ("v1/chat/completions", chat(logprobs=3), "logprobs", "true or false"),
    ("v1/chat/completions", chat(echo=True), "echo", "of /v1/completions"),
    ("v1/completions", completion(logprobs=21), "logprobs", "≤ 20"),
    ("v1/completions", completion(logprobs=True), "logprobs", "whole number"),
    ("v1/completions", completion(top_logprobs=2), "top_logprobs", "a field of chat"),
    ("v1/completions", completion(max_tokens=0), "max_tokens", "≥ 1"),
    ("v1/completions", completion(echo="yes"), "echo", "true or false"),
    ("v1/completions", completion(prompt=["the", []]), "prompt[1]", "empty"),
    ("v1/completions", completion(prompt=[[1], [2, 500]]), "prompt[1]", "token id 500"),
    ("v1/completions", completion(prompt=["a", 3]), "prompt", "a list of either"),
    ("tokenize", {"prompt": 3}, "prompt", "must be a string"),
    ("tokenize", {}, "prompt", "required"),
    ("tokenize", {"model": "gpt-4", "prompt": "x"}, "model", "does not exist"),
    ("detokenize", {"tokens": [1, 96]}, "tokens", "token id 96 is outside"),
    ("detokenize", {"tokens": "abc"}, "tokens", "list of token ids"),
]


@pytest.mark.parametrize("path,body,param,words", BAD,
                         ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_get_openais_error_shape(tiny: Running, path: str, body: dict[str, Any],
                                            param: str, words: str) -> None:
    if body.get("model") == "MODEL":
        body["model"] = tiny.name
    r = httpx.post(f"{tiny.url}/{path}", json=body, timeout=10)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_raises_on_top_logprobs_alone(tiny: Running) -> None:
    import openai
    with pytest.raises(openai.BadRequestError) as bad:
        client(tiny).chat.completions.create(
            model=tiny.name, messages=[{"role": "user", "content": "hi"}], top_logprobs=3)
    assert bad.value.param == "top_logprobs"


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_the_bytes_of_a_split_character_join_into_it(kind: str) -> None:
    """A character split over tokens: the first token's text is U+FFFD, but each token's bytes
    are its own, and the tokens' bytes joined are the text's UTF-8."""
    import tokenizers

    from archc.serve.logprobs import Pieces
    from tests.test_gguf_tokenizer import spm
    if kind == "byte-level":        # one token per byte, tokenizers' own byte alphabet
        alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tokenizer: Any = from_gguf_vocab(
            model="gpt2", tokens=alphabet, token_types=None, merges=[], scores=None, pre=None,
            bos_id=None, eos_ids=[], add_bos=False, add_space_prefix=None, chat_template=None,
            source="test.gguf")
    else:                           # "é" is not a piece: it falls back to byte tokens
        tokenizer = spm()
    text = "aé"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = Pieces(tokenizer)
    joined = [b for i in ids for b in pieces.bytes(i, pieces(i, None))]
    assert bytes(joined) == text.encode()
    assert pieces(ids[-2], ids[-3]) == "\ufffd"     # the first half of "é"
