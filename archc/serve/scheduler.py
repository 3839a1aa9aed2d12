"""Continuous batching: one loop drives the batch engine for every live request.

Each turn of the loop (a thread of its own, so the HTTP event loop never waits on the model):

1. cancelled requests leave: a queued one is dropped, a running one's blocks go back to the
   pool (``engine.release``);
2. queued requests are admitted in arrival order while the batch has a free row and the pool
   holds every block the request can ever need (``engine.blocks_for(prompt + max_tokens)``): each
   is prefilled and its first token chosen, and it joins the decode batch;
3. one decode step runs every running request together, whatever their past lengths, and each
   row's next token is chosen with that request's own sampler.

A long prompt is prefilled in chunks (`prefill_chunk` tokens a turn, over every prompt being
prefilled): between two chunks the running batch takes its decode step, so one long prompt does
not stall the streams already running. Prompt tokens found in the engine's prefix cache are not
computed at all. A request for `n` samples is prefilled once; its samples then fork the
prompt's KV blocks (``engine.fork``) and decode as rows of the same batch, each with its own
generator, derived from the request's seed and the sample's index. A request that asks for
logprobs has each token chosen scored from the logits before any grammar mask
(``archc.serve.logprobs``); one that asks for its prompt scored (echo) is prefilled with the
logits of every prompt token (``engine.prefill(every=True)``, no cached prefix reused), each
chunk scored as it comes, and hears the scores in one event before its first token; with
max_tokens 0 it then ends. `log` keeps the last steps
the loop ran, ("prefill", sequence, tokens computed) and ("decode", sequences), in order.

A request that finishes (an end-of-sequence id, a stop string, max_tokens) leaves at once. As a
request reserves its blocks when it is admitted, none ever waits for memory mid-stream: a
request that does not fit waits in the queue, and the one at its head is never overtaken (so a
long request is not starved by short ones).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from archc.runtime.batch import BatchEngine, PoolExhausted
from archc.runtime.generate import Sampler, Sampling
from archc.serve.errors import APIError
from archc.serve.grammar import Constraint, apply_masks
from archc.serve.logprobs import Scored, score
from archc.serve.metrics import Metrics
from archc.tokenizer import TextStream


@dataclass(frozen=True)
class Event:
    """What a request's consumer hears: each token chosen, the text it makes final, and on the
    last event how the request ended."""

    text: str = ""                  # text that became final with this token ("" while held back)
    token: int | None = None        # the token chosen (None when no token came with the event)
    finish: str | None = None       # stop | length | cancelled | error, on the last event only
    error: str | None = None        # what went wrong, when finish is "error"
    index: int = 0                  # which of the request's n samples
    logprob: Scored | None = None   # the token's, when the request asks for logprobs
    prompt: tuple[Scored, ...] | None = None    # the prompt's tokens after the first, scored:
                                    # once, before any token, when the request asks


@dataclass(eq=False)
class Request:
    """One generation: a prompt, how to sample, when to stop, and `emit`, called (from the
    scheduler's thread) with each Event."""

    prompt: Sequence[int]
    max_tokens: int
    emit: Callable[[Event], None]
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()           # stop strings (need the scheduler's tokenizer)
    eos: tuple[int, ...] = ()            # end-of-sequence ids
    n: int = 1                           # samples of the prompt, each its own stream
    arrived: float = field(default_factory=time.perf_counter)
    constraint: Constraint | None = None  # the grammar its tokens follow (response_format)
    logprobs: int | None = None          # each token chosen scored, with this many likeliest
                                         # alternatives (None: not scored)
    prompt_logprobs: int | None = None   # the prompt scored so (None: not); its prefill then
                                         # computes every prompt token, none from the cache
    generated: int = 0                   # tokens chosen so far (all samples), an end-of-sequence
                                         # id included
    finish: str | None = None            # set when its last sample has ended
    cancelled: bool = False
    ended: int = 0                       # samples that have ended

    @property
    def total_tokens(self) -> int:
        """The most tokens one sample's sequence can reach: what it reserves when admitted."""
        return len(self.prompt) + self.max_tokens


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's sample `index`: the request's own for the first, and for the
    others one derived from it and the index (so each sample draws apart, and reproducibly)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class StopText:
    """A request's text as it streams: tokens decoded incrementally (never splitting a UTF-8
    character), and held back while they might be the start of a stop string, so that a stop
    string is never sent and the text before it always is."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.stream = TextStream(tokenizer) if tokenizer is not None else None
        self.stop = tuple(stop)
        self.text = ""      # every final character so far
        self.sent = 0       # characters of it already released

    def push(self, token: int) -> tuple[str, bool]:
        """The text `token` releases, and whether a stop string now ends the request."""
        if self.stream is not None:
            self.text += self.stream.push([token])
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held when the request ends (no stop string reached)."""
        if self.stream is not None:
            self.text += self.stream.flush()
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        else:
            end, stopped = len(self.text) - (0 if final else self._held()), False
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, stopped

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:n])), default=0)


@dataclass(eq=False)
class Live:
    """A request in the running batch: its sequence id in the engine, sampler, text and the
    token it feeds to the next decode step."""

    request: Request
    seq: int
    sampler: Sampler
    text: StopText
    index: int = 0                  # which of the request's samples
    generated: int = 0              # tokens this sample has chosen
    constraint: Constraint | None = None    # this sample's own matcher of the request's grammar
    last_token: int = -1
    last_time: float = 0.0
    prompt_scores: list[Scored] = field(default_factory=list)  # scored so far (prompt_logprobs)
    prompt_seen: int = 0            # prompt positions whose logits the prefill gave


class Scheduler:
    """The loop that batches every request over one engine. `submit` and `cancel` may be called
    from any thread; only the loop's own thread touches the engine."""

    def __init__(self, engine: BatchEngine, *, tokenizer: Any = None,
                 metrics: Metrics | None = None, max_tokens_in_flight: int | None = None,
                 max_seq_len: int | None = None, prefill_chunk: int | None = 512) -> None:
        self.engine = engine
        self.prefill_chunk = prefill_chunk or None      # prompt tokens a turn; None: all
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics(engine.blocks_total)
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_seq_len = min(engine.max_seq_len, max_seq_len or engine.max_seq_len)
        self.queue: deque[Request] = deque()
        self.running: dict[int, Live] = {}
        self.prefilling: dict[int, Live] = {}     # admitted, prompt not all in the cache yet
        self.forks_reserved = 0             # blocks held back for the samples still to fork
        self.tokens_in_flight = 0           # total_tokens of each sample admitted
        self.log: deque[tuple[Any, ...]] = deque(maxlen=4096)
        self.cond = threading.Condition()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.metrics.set("archc_kv_blocks_total", engine.blocks_total)
        self.metrics.set("archc_kv_blocks_free", engine.blocks_free())

    # ---- any thread ---------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int, *, prompt_param: str = "prompt",
              n: int = 1) -> None:
        """Refuse (400) a request that could never be admitted: past the context, or needing more
        KV blocks or tokens in flight (over its `n` samples) than the server ever holds."""
        total, context = prompt_tokens + max_tokens, self.max_seq_len
        if prompt_tokens >= context:
            raise APIError(400, f"{prompt_param}: the prompt is {prompt_tokens} tokens; this "
                           f"model's context is {context} tokens, which leaves no room to "
                           "generate", param=prompt_param, code="context_length_exceeded")
        if total > context:
            raise APIError(400, f"max_tokens: {prompt_tokens} prompt tokens + {max_tokens} "
                           f"max_tokens = {total} exceed this model's context of {context} "
                           f"tokens; ask for at most {context - prompt_tokens}",
                           param="max_tokens", code="context_length_exceeded")
        blocks, pool = n * self.engine.blocks_for(total), self.engine.blocks_total
        samples = f" × n = {n}" if n > 1 else ""
        if blocks > pool:
            raise APIError(400, f"max_tokens: {total} tokens (prompt and max_tokens){samples} "
                           f"need {blocks} KV-cache blocks; the server's pool holds {pool}",
                           param="max_tokens", code="context_length_exceeded")
        if n > self.engine.max_batch:
            raise APIError(400, f"n: {n} samples exceed the server's --max-batch of "
                           f"{self.engine.max_batch} rows", param="n")
        limit = self.max_tokens_in_flight
        if limit is not None and n * total > limit:
            raise APIError(400, f"max_tokens: {total} tokens (prompt and max_tokens){samples} "
                           f"exceed the server's --max-tokens-in-flight of {limit}",
                           param="max_tokens",
                           code="context_length_exceeded")

    def room(self, prompt_tokens: int, n: int = 1) -> int:
        """The most tokens a request with this prompt (and `n` samples) may ask for: what the
        context, the pool and --max-tokens-in-flight leave (< 1: none)."""
        pool = self.engine.blocks_total // n
        tokens = min(self.max_seq_len, pool * self.engine.block_size,
                     (self.max_tokens_in_flight or n * self.max_seq_len) // n)
        while tokens > prompt_tokens and self.engine.blocks_for(tokens) > pool:
            tokens -= 1
        return tokens - prompt_tokens

    def submit(self, request: Request) -> None:
        """Queue `request` (already checked); its events start once it is admitted."""
        self.check(len(request.prompt), request.max_tokens, n=request.n)
        with self.cond:
            if self.stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            self.queue.append(request)
            self.metrics.add("archc_requests_received_total")
            self.metrics.set("archc_queue_depth", len(self.queue))
            self.cond.notify()

    def cancel(self, request: Request) -> None:
        """Stop `request` (its client has gone): it leaves the queue or the batch at the loop's
        next turn. Nothing happens to a request already finished."""
        with self.cond:
            if request.finish is None:
                request.cancelled = True
                self.cond.notify()

    def start(self) -> Scheduler:
        self.thread = threading.Thread(target=self._loop, name="archc-scheduler", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """End the loop: queued and running requests end as cancelled, their blocks released."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()
        for request in list(self.queue):
            self._end_queued(request, "cancelled")
        for live in self._lives():
            self._finish(live, "cancelled", "")

    # ---- the loop's thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.queue or self.running or self.prefilling):
                    self.cond.wait()
                if self.stopping:
                    return
            try:
                self._drop_cancelled()
                self._prefill_turn()
                if self.running:
                    self._step()
            except Exception as err:  # a bug must not leave clients waiting on a dead loop
                for live in self._lives():
                    self._finish(live, "error", "", f"{type(err).__name__}: {err}")
            self._gauges()
            if self.queue and not self.running and not self.prefilling:
                with self.cond:     # a queue the engine refused: wait for a change, not spin
                    self.cond.wait(timeout=0.05)

    def _lives(self) -> list[Live]:
        return list(self.prefilling.values()) + list(self.running.values())

    def _gauges(self) -> None:
        self.metrics.set("archc_queue_depth", len(self.queue))
        self.metrics.set("archc_batch_size", len(self.running))
        self.metrics.set("archc_kv_blocks_free", self.engine.blocks_free())
        cached = getattr(self.engine, "blocks_cached", None)
        if cached is not None:
            self.metrics.set("archc_kv_blocks_cached", cached())
        stats = getattr(self.engine, "prefix_stats", None)
        if stats is not None:
            for unit in ("tokens", "blocks"):
                self.metrics.set(f"archc_prefix_cache_queries_{unit}_total",
                                 getattr(stats, f"query_{unit}"))
                self.metrics.set(f"archc_prefix_cache_hits_{unit}_total",
                                 getattr(stats, f"hit_{unit}"))

    def _drop_cancelled(self) -> None:
        with self.cond:
            gone = [r for r in self.queue if r.cancelled]
            for request in gone:
                self.queue.remove(request)
        for request in gone:
            self._end_queued(request, "cancelled")
        for live in [v for v in self._lives() if v.request.cancelled]:
            self._finish(live, "cancelled", "")

    def _prefill_turn(self) -> None:
        """Prefill up to prefill_chunk prompt tokens (all, without a chunk size): first the
        prompts already started, in order, then queued requests while they fit."""
        budget = self.prefill_chunk
        for live in list(self.prefilling.values()):
            if budget is not None and budget <= 0:
                return
            budget = self._prefill(live, budget)
        while budget is None or budget > 0:
            request = self._next_admitted()
            if request is None:
                return
            live = Live(request, next(self.ids), Sampler(request.sampling),
                        StopText(self.tokenizer, request.stop))
            budget = self._prefill(live, budget)
            if budget == -1:
                return

    def _next_admitted(self) -> Request | None:
        """The head of the queue when the batch has its rows and the pool its blocks."""
        with self.cond:
            if not self.queue:
                return None
            request = self.queue[0]
            total, n = request.total_tokens, request.n
            limit = self.max_tokens_in_flight
            rows = len(self.running) + len(self.prefilling) + self.forks_reserved_rows()
            if rows + n > self.engine.max_batch or \
                    n * self.engine.blocks_for(total) > \
                    self.engine.blocks_free() - self.forks_reserved or \
                    (limit is not None and self.tokens_in_flight + n * total > limit):
                return None
            return self.queue.popleft()

    def forks_reserved_rows(self) -> int:
        """Rows held for the samples of requests still prefilling."""
        return sum(v.request.n - 1 for v in self.prefilling.values())

    def _prefill(self, live: Live, budget: int | None) -> int | None:
        """Prefill the next chunk of `live`'s prompt (starting it in the engine when new): the
        budget left, or -1 when the pool turned out too small after all (the request goes
        back to the head of the queue)."""
        request, new = live.request, live.seq not in self.prefilling
        stats = getattr(self.engine, "prefix_stats", None)
        hits = stats.hit_tokens if stats is not None else 0
        every = request.prompt_logprobs is not None
        try:
            if new:
                logits = self.engine.prefill(live.seq, list(request.prompt), request.total_tokens,
                                             chunk=budget, every=every)
            else:
                before = self.engine.pending(live.seq)
                logits = self.engine.resume(live.seq, chunk=budget)
        except PoolExhausted:
            with self.cond:
                self.queue.appendleft(request)
            return -1
        except Exception as err:  # the engine failed: this request ends, the server goes on
            if new:
                self._end_queued(request, "error", f"{type(err).__name__}: {err}")
            else:       # the engine has released the sequence already
                self._finish(live, "error", "", f"{type(err).__name__}: {err}", released=True)
            return budget
        if every:       # the logits of every token computed: scored, the last one kept
            logits = self._score_prompt(live, logits)
        if new:
            self.tokens_in_flight += request.n * request.total_tokens
            cached = (stats.hit_tokens if stats is not None else 0) - hits
            before = len(request.prompt) - cached
            self.metrics.add("archc_prompt_tokens_total", len(request.prompt))
        left = self.engine.pending(live.seq) if logits is None else 0
        computed = before - left
        self.log.append(("prefill", live.seq, computed))
        self.metrics.add("archc_prefill_chunks_total")
        if logits is None:
            self.prefilling[live.seq] = live
            self.forks_reserved += self._fork_blocks(request) if new else 0
        else:
            if not new:
                del self.prefilling[live.seq]
                self.forks_reserved -= self._fork_blocks(request)
            if every:
                _emit(request, Event(index=live.index, prompt=tuple(live.prompt_scores)))
            self._start_samples(live, logits.reshape(1, -1))
        return None if budget is None else budget - computed

    def _score_prompt(self, live: Live, logits: torch.Tensor) -> torch.Tensor | None:
        """Score the prompt tokens that the logits of a chunk's every token [tokens, vocab]
        predict: the last token's logits once the prompt is all prefilled, else None."""
        prompt, start = live.request.prompt, live.prompt_seen
        end = start + logits.shape[0]
        targets = list(prompt[start + 1:end + 1])    # row t predicts the token after it
        assert live.request.prompt_logprobs is not None
        live.prompt_scores += score(logits[:len(targets)], targets,
                                    live.request.prompt_logprobs)
        live.prompt_seen = end
        return logits[-1] if end == len(prompt) else None

    def _fork_blocks(self, request: Request) -> int:
        return (request.n - 1) * self.engine.blocks_for(request.total_tokens)

    def _start_samples(self, first: Live, logits: torch.Tensor) -> None:
        """The prompt is in the cache: its n samples join the batch, each choosing its first
        token from the prompt's last logits."""
        request = first.request
        if request.max_tokens == 0:     # a prompt only scored: every sample ends at once
            self.running[first.seq] = first
            self.tokens_in_flight -= (request.n - 1) * request.total_tokens
            for index in range(1, request.n):
                self._end(request, Event("", None, "length", index=index))
            self._finish(first, "length", "")
            return
        lives = [first]
        for index in range(1, request.n):
            seq = next(self.ids)
            self.engine.fork(first.seq, seq)
            sampling = replace(request.sampling, seed=sample_seed(request.sampling.seed, index))
            lives.append(Live(request, seq, Sampler(sampling),
                              StopText(self.tokenizer, request.stop), index,
                              constraint=request.constraint and request.constraint.copy()))
        first.constraint = request.constraint
        for live in lives:
            self.running[live.seq] = live
        for live in lives:
            if live.seq in self.running:
                self._accept(live, apply_masks(logits, [live.constraint]), logits)

    def _step(self) -> None:
        """One decode step of the whole running batch."""
        batch = list(self.running.values())
        self.metrics.set("archc_batch_size", len(batch))
        self.log.append(("decode", tuple(v.seq for v in batch)))
        try:
            logits = self.engine.decode([v.seq for v in batch], [v.last_token for v in batch])
            self.metrics.observe("archc_decode_batch_size", logits.shape[0])
            self.metrics.peak("archc_batch_size_max", logits.shape[0])
        except Exception as err:  # the engine failed: every row of the step ends in error
            for live in batch:
                self._finish(live, "error", "", f"{type(err).__name__}: {err}")
            return
        masked = apply_masks(logits, [v.constraint for v in batch])   # on the device
        # logprobs are of the logits before the grammar's masks (archc.serve.logprobs)
        scored = masked is not logits and any(v.request.logprobs is not None for v in batch)
        raw = logits.float().cpu() if scored else None
        logits = masked.float().cpu()   # one copy to the host for the whole step
        for row, live in enumerate(batch):
            self._accept(live, logits[row:row + 1], (raw if raw is not None else logits)
                         [row:row + 1])

    def _accept(self, live: Live, logits: torch.Tensor, raw: torch.Tensor) -> None:
        """Choose `live`'s next token from its logits [1, vocab] and tell its consumer (with
        its log-probability in `raw`, the logits before any mask, when asked)."""
        request = live.request
        token = int(live.sampler(logits)[0])
        scored = None if request.logprobs is None else \
            score(raw, [token], request.logprobs)[0]
        now = time.perf_counter()
        if live.generated == 0:
            if live.index == 0:
                self.metrics.observe("archc_time_to_first_token_seconds",
                                     now - request.arrived)
        else:
            self.metrics.observe("archc_inter_token_latency_seconds", now - live.last_time)
        live.last_token, live.last_time = token, now
        live.generated += 1
        request.generated += 1
        self.metrics.add("archc_generation_tokens_total")
        if live.constraint is not None:
            live.constraint.take(token)
        if token in request.eos:
            self._finish(live, "stop", live.text.finish(), token=token, scored=scored)
            return
        text, stopped = live.text.push(token)
        if live.constraint is not None and live.constraint.done:   # the answer is whole
            self._finish(live, "stop", text + live.text.finish(), token=token, scored=scored)
        elif stopped:
            self._finish(live, "stop", text, token=token, scored=scored)
        elif live.generated >= request.max_tokens:
            self._finish(live, "length", text + live.text.finish(), token=token, scored=scored)
        else:
            _emit(request, Event(text, token, index=live.index, logprob=scored))

    def _finish(self, live: Live, reason: str, text: str, error: str | None = None, *,
                token: int | None = None, released: bool = False,
                scored: Scored | None = None) -> None:
        """`live` leaves the batch, its blocks back in the pool; its last event says why. A
        sample still prefilling ends with the samples it was to fork."""
        request = live.request
        if self.prefilling.pop(live.seq, None) is not None:
            self.forks_reserved -= self._fork_blocks(request)
            self.tokens_in_flight -= (request.n - 1) * request.total_tokens
            for index in range(1, request.n):
                self._end(request, Event("", None, reason, error, index))
        else:
            del self.running[live.seq]
        self.tokens_in_flight -= request.total_tokens
        if not released:
            self.engine.release(live.seq)
        self._end(request, Event(text, token, reason, error, live.index, scored))

    def _end_queued(self, request: Request, reason: str, error: str | None = None) -> None:
        for index in range(request.n):
            self._end(request, Event("", None, reason, error, index))

    def _end(self, request: Request, event: Event) -> None:
        with self.cond:
            request.ended += 1
            if request.ended >= request.n:
                request.finish = event.finish
                self.metrics.add("archc_requests_finished_total", reason=str(event.finish))
        _emit(request, event)


def _emit(request: Request, event: Event) -> None:
    """Hand `event` to the request's consumer; one that cannot take it any more (its event loop
    closed) is cancelled rather than allowed to stop the loop."""
    try:
        request.emit(event)
    except RuntimeError:
        request.cancelled = True
