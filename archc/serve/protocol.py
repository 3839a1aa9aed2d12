"""OpenAI's API, read and written: a request body checked field by field into a ``Job`` (a
bad field is a 400 naming it, an unknown model a 404, a prompt past the context a 400
``context_length_exceeded``), and an ``Answer`` in OpenAI's shapes — whole, or as the chunks of
a stream, with logprobs in each route's shape (``archc.serve.logprobs``) and, under echo, the
prompt before its completion. A completion's prompt may be a list: prompt i's n samples are
choices i·n … i·n + n − 1."""

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
from archc.serve.logprobs import MAX_TOP, Pieces, Scored, chat_shape, completion_shape
from archc.serve.metrics import Metrics
from archc.serve.scheduler import Event, Scheduler

DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default max_tokens for /v1/completions
MAX_STOP_STRINGS = 4                # as OpenAI allows
# fields of OpenAI's requests this server does not implement: a value other than the default
# (the second item) is refused rather than silently ignored
UNSUPPORTED = {"suffix": (None,), "best_of": (None, 1), "logit_bias": (None, {}),
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


def flag(body: dict[str, Any], name: str) -> bool:
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
    return flag(options, "include_usage")


def token_ids(value: Any, served: Served, param: str) -> list[int] | None:
    """`value` as a prompt of token ids (None when it is not a list of integers)."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                              for v in value):
        return None
    wrong = [v for v in value if not 0 <= v < served.vocab_size]
    if wrong:
        raise bad_field(param, f"token id {wrong[0]} is outside the vocabulary "
                        f"(0 … {served.vocab_size - 1})")
    return list(value)


def _prompts(body: dict[str, Any], served: Served) -> list[tuple[list[int], str | None]]:
    """The prompts of a completion, each its token ids and its text (None: given as ids):
    text, token ids, or a list of either; each prompt its own choices."""
    value = body.get("prompt")
    if value is None:
        raise bad_field("prompt", "required", code="missing_required_parameter")
    ids = token_ids(value, served, "prompt")
    if isinstance(value, str) or (ids is not None and value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        items = value
    else:
        raise bad_field("prompt", "must be a string, a list of token ids, or a list of either"
                        if value != [] else "the prompt is empty (no tokens)")
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if served.tokenizer is None:
                raise bad_field("prompt", "this model has no tokenizer: give token ids")
            prompt, text = served.tokenizer.encode(item), item
        else:
            prompt, text = token_ids(item, served, param), None
            if prompt is None:
                raise bad_field(param, "must be a string or a list of token ids")
        if not prompt:
            raise bad_field(param, "the prompt is empty (no tokens)")
        prompts.append((prompt, text))
    return prompts


def _message_text(i: int, content: Any) -> str:
    """A message's content: a string, or text parts ``[{"type": "text", "text": …}]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_field(f"messages[{i}].content", "must be a string or a list of text parts")


def chat_ids(body: dict[str, Any], served: Served) -> list[int]:
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
    prompts: list[list[int]]    # each prompt's n samples are choices i·n … i·n + n − 1
    max_tokens: int             # 0: the prompt only scored (echo)
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1                  # samples of each prompt, each a choice
    constraint: Constraint | None = None    # response_format's grammar
    logprobs: int | None = None     # each token scored with this many alternatives (None: not)
    echo: bool = False          # the prompt comes back before its completion (and, with
                                # logprobs, scored)
    texts: list[str | None] = field(default_factory=list)    # each prompt's text, if given so


def _read_logprobs(kind: str, body: dict[str, Any]) -> tuple[int | None, bool]:
    """How many alternatives each token's logprobs lists (None: no logprobs), and echo.
    Completions take `logprobs` as that count (OpenAI allows 0 … 5; this server up to
    MAX_TOP) and `echo`; chat takes `logprobs: true` and `top_logprobs` (0 … 20)."""
    if kind == "chat":
        if body.get("echo") not in (None, False):
            raise bad_field("echo", "a field of /v1/completions, not of chat")
        on = flag(body, "logprobs")
        top = _whole(body, "top_logprobs", 0, None)
        if top is not None and top > MAX_TOP:
            raise bad_field("top_logprobs", f"must be ≤ {MAX_TOP}, got {top}")
        if top is not None and not on:
            raise bad_field("top_logprobs", "only with logprobs: true")
        return (top or 0) if on else None, False
    if body.get("top_logprobs") is not None:
        raise bad_field("top_logprobs", "a field of chat; /v1/completions takes "
                        "logprobs: <how many alternatives>")
    top = _whole(body, "logprobs", 0, None)
    if top is not None and top > MAX_TOP:
        raise bad_field("logprobs", f"must be ≤ {MAX_TOP}, got {top}")
    return top, flag(body, "echo")


def read_job(kind: str, body: dict[str, Any], served: Served) -> Job:
    n = _common(body, served)
    scheduler = served.generating()
    stream = flag(body, "stream")
    include_usage = _stream_options(body, stream)
    sampling, stop = _sampling(body, served), _stop(body)
    if stop and served.tokenizer is None:
        raise bad_field("stop", "this model has no tokenizer to read text with")
    logprobs, echo = _read_logprobs(kind, body)
    if kind == "chat":
        prompts, param = [(chat_ids(body, served), None)], "messages"
        room = scheduler.room(len(prompts[0][0]), n)
        asked = _whole(body, "max_completion_tokens", 1, None)
        max_tokens = _whole(body, "max_tokens", 1, asked if asked is not None else room)
    else:
        prompts, param = _prompts(body, served), "prompt"
        room = min(scheduler.room(len(p), n) for p, _ in prompts)
        # max_tokens 0 generates nothing: with echo, it scores the prompt
        max_tokens = _whole(body, "max_tokens", 0 if echo else 1,
                            min(DEFAULT_COMPLETION_TOKENS, room))
    assert max_tokens is not None
    for i, (prompt, _) in enumerate(prompts):
        scheduler.check(len(prompt), max(max_tokens, 1), n=n,
                        prompt_param=param if len(prompts) == 1 else f"{param}[{i}]")
    grammar = read_grammar(body)
    constraint = served.grammars.constraint(grammar) if grammar is not None else None
    return Job(kind, [p for p, _ in prompts], max_tokens, sampling, stop, stream, include_usage,
               n, constraint, logprobs, echo, [t for _, t in prompts])


# ---- answering -------------------------------------------------------------------------------

class Answer:
    """One request's answer, in OpenAI's shapes: chunks as it streams, or the whole response.
    Choice i·n + j is sample j of prompt i."""

    def __init__(self, job: Job, served: Served) -> None:
        self.job, self.served = job, served
        chat = job.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        choices = len(job.prompts) * job.n
        self.text: list[list[str]] = [[] for _ in range(choices)]      # by choice index
        self.finish: dict[int, str] = {}
        self.completion_tokens = 0
        self.pieces = Pieces(served.tokenizer)
        self.scored: list[list[Scored]] = [[] for _ in range(choices)]  # tokens chosen
        self.prompt_scored: dict[int, tuple[Scored, ...]] = {}          # by prompt
        self.sent = [0] * choices           # of `scored`, those already streamed
        self.offset = [0] * choices         # characters of each choice's text streamed
        self.last: list[int | None] = [None] * choices    # the token streamed last

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.served.name}

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.job.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def take(self, event: Event) -> None:
        self.text[event.index].append(event.text)
        self.completion_tokens += event.token is not None
        if event.logprob is not None:
            self.scored[event.index].append(event.logprob)
        if event.prompt is not None:
            self.prompt_scored[event.index // self.job.n] = event.prompt
        if event.finish is not None:
            self.finish[event.index] = event.finish

    def echo_text(self, index: int) -> str:
        """The prompt of choice `index` as echo returns it: as given, or its ids decoded."""
        i = index // self.job.n
        text = self.job.texts[i] if i < len(self.job.texts) else None
        if text is None:
            tokenizer = self.served.tokenizer
            text = tokenizer.decode(self.job.prompts[i]) if tokenizer is not None else ""
        return text

    def _prompt_logprobs(self, index: int) -> dict[str, Any]:
        """The echoed prompt's tokens, scored (the first by nothing)."""
        prompt = self.job.prompts[index // self.job.n]
        scored = [None, *self.prompt_scored.get(index // self.job.n, ())]
        return completion_shape(self.pieces, scored, prompt, None, 0)

    def _logprobs(self, scored: list[Scored], before: int | None, offset: int
                  ) -> dict[str, Any] | None:
        """The logprobs of tokens chosen, in the route's shape (None when not asked): `before`
        the token before the first, `offset` the characters of the choice's text before it."""
        if self.job.logprobs is None:
            return None
        if self.job.kind == "chat":
            return {"content": chat_shape(self.pieces, scored, before)}
        return completion_shape(self.pieces, scored, [s.token for s in scored], before, offset)

    def choice(self, text: str, finish: str | None, *, delta: bool, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.job.kind == "completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = ({"content": text} if text else {}) if delta else \
            {"role": "assistant", "content": text}
        return {"index": index, key: body, "logprobs": logprobs, "finish_reason": finish}

    def _streamed_logprobs(self, index: int) -> dict[str, Any] | None:
        """The logprobs of choice `index`'s tokens not yet streamed."""
        new = self.scored[index][self.sent[index]:]
        logprobs = self._logprobs(new, self.last[index], self.offset[index])
        self.sent[index] += len(new)
        if new:
            self.last[index] = new[-1].token
        if logprobs is not None and self.job.kind == "completion":
            self.offset[index] += sum(len(t) for t in logprobs["tokens"])
        return logprobs

    def chunk(self, event: Event) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [self.choice(
            event.text, event.finish, delta=True, index=event.index,
            logprobs=self._streamed_logprobs(event.index))]}

    def echo_chunk(self, index: int) -> dict[str, Any]:
        """A completions stream with echo opens each choice with its prompt (scored, with
        logprobs): sent once the prompt's scores are in, when logprobs are asked."""
        logprobs = None
        if self.job.logprobs is not None:
            logprobs = self._prompt_logprobs(index)
            self.offset[index] = sum(len(t) for t in logprobs["tokens"])
            self.last[index] = self.job.prompts[index // self.job.n][-1]
        return {**self._head("text_completion"), "choices": [self.choice(
            self.echo_text(index), None, delta=True, index=index, logprobs=logprobs)]}

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        """A chat stream opens with the assistant's role, as OpenAI's does (per choice)."""
        return {**self._head("chat.completion.chunk"), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}

    def _whole_choice(self, index: int, finish: str) -> dict[str, Any]:
        text = "".join(self.text[index])
        scored = self.scored[index]
        if not self.job.echo:
            return self.choice(text, self.finish.get(index, finish), delta=False, index=index,
                               logprobs=self._logprobs(scored, None, 0))
        echoed = self.echo_text(index)
        logprobs = None
        if self.job.logprobs is not None:
            logprobs = self._prompt_logprobs(index)
            prompt = self.job.prompts[index // self.job.n]
            more = completion_shape(self.pieces, scored, [s.token for s in scored],
                                    prompt[-1], sum(len(t) for t in logprobs["tokens"]))
            logprobs = {k: logprobs[k] + more[k] for k in logprobs}
        return self.choice(echoed + text, self.finish.get(index, finish), delta=False,
                           index=index, logprobs=logprobs)

    def whole(self, finish: str) -> dict[str, Any]:
        return {**self._head(self.object),
                "choices": [self._whole_choice(i, finish) for i in range(len(self.text))],
                "usage": self.usage()}


def sse(data: dict[str, Any] | str) -> str:
    return "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"
