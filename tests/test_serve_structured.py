"""Structured output: `response_format` json_schema and json_object through the official client
on SmolLM2 — answers that parse and follow the schema, streamed or not, sampled or greedy; rows
without a grammar in the same batch answer as if alone; a schema the server cannot follow, or a
malformed response_format, is a 400 naming the field."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from archc.serve.grammar import apply_masks
from tests.serving import Running, client, serving
from tests.test_gguf_smollm2 import smollm2_gguf

openai = pytest.importorskip("openai", reason="needs the openai client (pip install 'archc[test]')")
pytest.importorskip("llguidance", reason="needs llguidance (pip install 'archc[serve]')")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK = [{"role": "user", "content": "Give one person's name and age as JSON."}]


def person_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def assert_person(text: str) -> None:
    """`text` is one JSON object that PERSON admits (checked here by hand, field by field)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "age"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 10, value
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool), value
    assert 0 <= value["age"] <= 120, value


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Running]:
    with serving(str(smollm2_gguf()), max_batch=4) as running:
        yield running


def test_json_schema_answers_parse_and_follow_the_schema(smollm2: Running) -> None:
    api = client(smollm2, timeout=120)
    greedy = api.chat.completions.create(model=smollm2.name, messages=ASK, max_tokens=40,
                                         temperature=0, response_format=person_format())
    assert greedy.choices[0].finish_reason == "stop"
    assert_person(greedy.choices[0].message.content)
    sampled = api.chat.completions.create(  # at a temperature where free text would wander
        model=smollm2.name, messages=ASK, max_tokens=40, temperature=1.5, seed=1,
        response_format=person_format())
    assert_person(sampled.choices[0].message.content)
    chunks = api.chat.completions.create(model=smollm2.name, messages=ASK, max_tokens=40,
                                         temperature=0, response_format=person_format(),
                                         stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == greedy.choices[0].message.content


def test_json_object_on_completions(smollm2: Running) -> None:
    api = client(smollm2, timeout=120)
    out = api.completions.create(model=smollm2.name, prompt="A JSON object:", max_tokens=30,
                                 temperature=0,
                                 extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_rows_without_a_grammar_answer_as_alone(smollm2: Running) -> None:
    """A constrained and a free request decode in one batch: the free one's greedy answer is
    generate's, token for token."""
    api = client(smollm2, timeout=120)
    prompt = smollm2.model.tokenizer.encode("The capital of France is")
    answers: dict[str, Any] = {}

    def constrained() -> None:
        answers["json"] = api.chat.completions.create(
            model=smollm2.name, messages=ASK, max_tokens=40, temperature=0,
            response_format=person_format())

    thread = threading.Thread(target=constrained)
    thread.start()
    answers["free"] = api.completions.create(model=smollm2.name, prompt=prompt, max_tokens=12,
                                             temperature=0)
    thread.join()
    _, text = smollm2.expected(prompt, 12)
    assert answers["free"].choices[0].text == text
    assert_person(answers["json"].choices[0].message.content)
    assert smollm2.metrics()["archc_batch_size_max"] >= 2


@pytest.mark.parametrize(("response_format", "param", "message"), [
    ({"type": "xml"}, "response_format", "type is one of text, json_object, json_schema"),
    ("json", "response_format", "must be an object"),
    ({"type": "json_schema"}, "response_format.json_schema", "with a name and a schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
     "response_format.json_schema.schema", "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
     "response_format.json_schema.schema", "not a schema this server can follow"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}}}},
     "response_format.json_schema.schema", "Unknown format: bogus"),
])
def test_bad_response_formats_are_refused_by_field(smollm2: Running, response_format: Any,
                                                   param: str, message: str) -> None:
    api = client(smollm2)
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=smollm2.name, messages=ASK, max_tokens=4,
                                    response_format=response_format)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error


class Allow:
    """A stand-in constraint that allows a fixed set of tokens."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def fill(self, words: torch.Tensor) -> None:
        words.zero_()
        for t in self.tokens:     # bit t % 32 of word t // 32, as llguidance's masks
            words[t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)


def test_masks_apply_row_by_row_past_a_word_boundary() -> None:
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(0))
    out = apply_masks(logits, [Allow([0, 31, 32, 69]), None, Allow([63])])  # type: ignore[list-item]
    assert torch.equal(out[1], logits[1])
    for row, allowed in ((0, [0, 31, 32, 69]), (2, [63])):
        kept = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert kept == allowed
        assert torch.equal(out[row, allowed], logits[row, allowed])


def test_logprobs_under_a_grammar_are_the_models_own(smollm2: Running) -> None:
    """The first token of a JSON answer is scored by the model's log-softmax before the
    grammar's mask (docs/serve.md): its alternatives are the model's likeliest tokens, whatever
    the grammar allows, and its logprob is the model's, not renormalized over the allowed."""
    out = client(smollm2, timeout=120).chat.completions.create(
        model=smollm2.name, messages=ASK, max_tokens=1, temperature=0, logprobs=True,
        top_logprobs=5, response_format={"type": "json_object"})
    first = out.choices[0].logprobs.content[0]
    tokenizer = smollm2.model.tokenizer
    ids = tokenizer.encode_chat(ASK)
    session = smollm2.reference.session
    session.reset()
    expected = session.step(torch.tensor([ids]))[0, -1].float().log_softmax(dim=-1)
    token = tokenizer.encode(first.token, add_special_tokens=False)
    assert len(token) == 1 and first.token.lstrip().startswith("{")
    assert abs(first.logprob - float(expected[token[0]])) < 1e-4
    best = expected.topk(5).values
    assert torch.allclose(torch.tensor([t.logprob for t in first.top_logprobs]), best,
                          atol=1e-4, rtol=0)
