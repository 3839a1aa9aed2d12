"""OpenAI's API, read and written: a request body checked field by field into a ``Job`` (a
bad field is a 400 naming it, an unknown model a 404, a prompt past the context a 400
``context_length_exceeded``), and an ``Answer`` in OpenAI's shapes — whole, or as the chunks of
a stream."""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from archc.runtime.generate import Sampling
from archc.serve.errors import APIError, bad_field
from archc.serve.grammar import Constraint, Grammars, read_grammar
from archc.serve.metrics import Metrics
from archc.serve.scheduler import Event, Scheduler

DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default max_tokens for /v1/completions
MAX_STOP_STRINGS = 4                # as OpenAI allows
# fields of OpenAI's requests this server does not implement: a value other than the default
# (the second item) is refused rather than silently ignored
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None,), "echo": (None, False),
               "suffix": (None,), "best_of": (None, 1), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "tools": (None, []), "functions": (None, [])}
ROLES = ("system", "developer", "user", "assistant")


@dataclass
class Served:
    """What the app serves: the scheduler (None for an encoder, which only embeds), the model's
    name, family and tokenizer, its vocabulary, and the embedder of an encoder
    (``archc.serve.embeddings.Embedder``)."""

    scheduler: Scheduler | None
    name: str
    tokenizer: Any
    vocab_size: int
    eos: tuple[int, ...]
    seed: int = 0               # where the seeds of requests that give none come from
    created: int = field(default_factory=lambda: int(time.time()))
    family: str = "decoder"     # the spec's: decoder, encoder or encoder-decoder
    embedder: Any = None
    seeds: random.Random = field(init=False)
    grammars: Grammars = field(init=False)
    own_metrics: Metrics = field(init=False)     # a server without a scheduler counts here

    def __post_init__(self) -> None:
        self.seeds = random.Random(self.seed)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos)
        self.own_metrics = Metrics()

    @property
    def metrics(self) -> Metrics:
        return self.own_metrics if self.scheduler is None else self.scheduler.metrics

    @property
    def kind(self) -> str:
        """The model's kind, as messages say it: "a decoder model", "an encoder model"."""
        return ("an " if self.family[:1] in tuple("aeiou") else "a ") + f"{self.family} model"

    @property
    def max_model_len(self) -> int:
        if self.scheduler is not None:
            return self.scheduler.max_seq_len
        return int(self.embedder.max_tokens) if self.embedder is not None else 0

    def generating(self) -> Scheduler:
        """The scheduler, or a 400 naming the model's kind when it cannot generate."""
        if self.scheduler is None:
            raise APIError(400, f"{self.name} is {self.kind}: it has no output head "
                           "to generate text with; it answers POST /v1/embeddings",
                           param="model", code="model_not_supported")
        return self.scheduler


# ---- reading a request ---------------------------------------------------------------------

def _whole(body: dict[str, Any], name: str, lo: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"must be a whole number, got {json.dumps(value)}")
    if value < lo:
        raise bad_field(name, f"must be ≥ {lo}, got {value}")
    return value


def _real(body: dict[str, Any], name: str, lo: float, hi: float, default: float | None,
          *, open_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_field(name, f"must be a number, got {json.dumps(value)}")
    if value > hi or value < lo or (open_low and value == lo):
        interval = f"({lo:g}, {hi:g}]" if open_low else f"[{lo:g}, {hi:g}]"
        raise bad_field(name, f"must be in {interval}, got {value:g}")
    return float(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"must be true or false, got {json.dumps(value)}")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise bad_field("stop", "must be a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    if any(s == "" for s in strings):
        raise bad_field("stop", "a stop string must not be empty")
    return tuple(strings)


def check_model(body: dict[str, Any], served: Served) -> None:
    """The request's `model` is the one served (400 when missing, 404 when another)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", "required: the name of the model (GET /v1/models)",
                        code="missing_required_parameter" if model is None else "invalid_value")
    if model != served.name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served.name!r}", param="model", code="model_not_found")


def _common(body: dict[str, Any], served: Served) -> int:
    """The checks every generation request shares: the model, what is not implemented; n, the
    samples asked for (best_of may only repeat it: every sample is returned)."""
    check_model(body, served)
    n = _whole(body, "n", 1, 1)
    assert n is not None
    best_of = _whole(body, "best_of", 1, None)
    if best_of is not None and best_of != n:
        raise bad_field("best_of", f"this server returns every sample it draws: best_of must "
                        f"equal n ({n}), got {best_of}", code="unsupported_parameter")
    for name, defaults in UNSUPPORTED.items():
        if name in body and body[name] not in defaults and name != "best_of":
            raise bad_field(name, "not supported by this server", code="unsupported_parameter")
    return n


def _sampling(body: dict[str, Any], served: Served) -> Sampling:
    """How to choose tokens; a request without a seed gets the next of the server's seeds, so
    that two such requests do not sample alike."""
    temperature = _real(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _real(body, "top_p", 0.0, 1.0, None, open_low=True)
    seed = _whole(body, "seed", 0, None)
    if seed is None:
        seed = served.seeds.randrange(2 ** 63)
    top_k = _whole(body, "top_k", 1, None)          # not OpenAI's, as vLLM and llama.cpp take it
    return Sampling(temperature or 0.0, top_k, None if top_p == 1.0 else top_p, seed)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_field("stream_options", "only with stream: true")
    if not isinstance(options, dict):
        raise bad_field("stream_options", "must be an object")
    return _flag(options, "include_usage")


def _prompt_ids(body: dict[str, Any], served: Served) -> list[int]:
    """The prompt of a completion: text, token ids, or a list of one of either."""
    value = body.get("prompt")
    if value is None:
        raise bad_field("prompt", "required", code="missing_required_parameter")
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        if len(value) != 1:
            raise bad_field("prompt", f"one prompt per request, got {len(value)}")
        value = value[0]
    if isinstance(value, str):
        if served.tokenizer is None:
            raise bad_field("prompt", "this model has no tokenizer: give token ids")
        ids = served.tokenizer.encode(value)
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                         for v in value):
        ids = list(value)
        wrong = [v for v in ids if not 0 <= v < served.vocab_size]
        if wrong:
            raise bad_field("prompt", f"token id {wrong[0]} is outside the vocabulary "
                            f"(0 … {served.vocab_size - 1})")
    else:
        raise bad_field("prompt", "must be a string, a list of token ids, or a list of one of "
                        "either")
    if not ids:
        raise bad_field("prompt", "the prompt is empty (no tokens)")
    return ids


def _message_text(i: int, content: Any) -> str:
    """A message's content: a string, or text parts ``[{"type": "text", "text": …}]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_field(f"messages[{i}].content", "must be a string or a list of text parts")


def _chat_ids(body: dict[str, Any], served: Served) -> list[int]:
    from archc.tokenizer import TokenizerError
    messages = body.get("messages")
    if messages is None:
        raise bad_field("messages", "required", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list of messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_field(f"messages[{i}]", "must be an object with a role and a content")
        if m.get("role") not in ROLES:
            raise bad_field(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got "
                            f"{json.dumps(m.get('role'))}")
        plain.append({"role": m["role"], "content": _message_text(i, m.get("content"))})
    if served.tokenizer is None or not served.tokenizer.chat_template:
        raise APIError(400, "messages: this model has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    try:
        return served.tokenizer.encode_chat(plain)
    except TokenizerError as err:
        raise bad_field("messages", str(err)) from None


@dataclass
class Job:
    """A checked request: what to generate and how to answer."""

    kind: str                   # "completion" | "chat"
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1                  # samples, each a choice
    constraint: Constraint | None = None    # response_format's grammar


def read_job(kind: str, body: dict[str, Any], served: Served) -> Job:
    n = _common(body, served)
    scheduler = served.generating()
    stream = _flag(body, "stream")
    include_usage = _stream_options(body, stream)
    sampling, stop = _sampling(body, served), _stop(body)
    if stop and served.tokenizer is None:
        raise bad_field("stop", "this model has no tokenizer to read text with")
    if kind == "chat":
        prompt, param = _chat_ids(body, served), "messages"
        room = scheduler.room(len(prompt), n)
        asked = _whole(body, "max_completion_tokens", 1, None)
        max_tokens = _whole(body, "max_tokens", 1, asked if asked is not None else room)
    else:
        prompt, param = _prompt_ids(body, served), "prompt"
        room = scheduler.room(len(prompt), n)
        max_tokens = _whole(body, "max_tokens", 1, min(DEFAULT_COMPLETION_TOKENS, room))
    assert max_tokens is not None
    scheduler.check(len(prompt), max(max_tokens, 1), prompt_param=param, n=n)
    grammar = read_grammar(body)
    constraint = served.grammars.constraint(grammar) if grammar is not None else None
    return Job(kind, prompt, max_tokens, sampling, stop, stream, include_usage, n, constraint)


# ---- answering -------------------------------------------------------------------------------

class Answer:
    """One request's answer, in OpenAI's shapes: chunks as it streams, or the whole response."""

    def __init__(self, job: Job, served: Served) -> None:
        self.job, self.served = job, served
        chat = job.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.text: list[list[str]] = [[] for _ in range(job.n)]      # by choice index
        self.finish: dict[int, str] = {}
        self.completion_tokens = 0

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.served.name}

    def usage(self) -> dict[str, int]:
        prompt = len(self.job.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def take(self, event: Event) -> None:
        self.text[event.index].append(event.text)
        self.completion_tokens += event.token is not None
        if event.finish is not None:
            self.finish[event.index] = event.finish

    def choice(self, text: str, finish: str | None, *, delta: bool, index: int = 0
               ) -> dict[str, Any]:
        if self.job.kind == "completion":
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = ({"content": text} if text else {}) if delta else \
            {"role": "assistant", "content": text}
        return {"index": index, key: body, "logprobs": None, "finish_reason": finish}

    def chunk(self, event: Event) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [self.choice(event.text, event.finish,
                                                           delta=True, index=event.index)]}

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        """A chat stream opens with the assistant's role, as OpenAI's does (per choice)."""
        return {**self._head("chat.completion.chunk"), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}

    def whole(self, finish: str) -> dict[str, Any]:
        return {**self._head(self.object),
                "choices": [self.choice("".join(text), self.finish.get(i, finish),
                                        delta=False, index=i)
                            for i, text in enumerate(self.text)],
                "usage": self.usage()}


def sse(data: dict[str, Any] | str) -> str:
    return "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"
