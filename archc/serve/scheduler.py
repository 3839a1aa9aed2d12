"""Continuous batching: one loop drives the batch engine for every live request.

Each turn of the loop (a thread of its own, so the HTTP event loop never waits on the model):

1. cancelled requests leave: a queued one is dropped, a running one's blocks go back to the
   pool (``engine.release``);
2. queued requests are admitted in arrival order while the batch has a free row and the pool
   holds every block the request can ever need (``engine.blocks_for(prompt + max_tokens)``): each
   is prefilled and its first token chosen, and it joins the decode batch;
3. one decode step runs every running request together, whatever their past lengths, and each
   row's next token is chosen with that request's own sampler.

A request that finishes (an end-of-sequence id, a stop string, max_tokens) leaves at once. As a
request reserves its blocks when it is admitted, none ever waits for memory mid-stream: a
request that does not fit waits in the queue, and the one at its head is never overtaken (so a
long request is not starved by short ones).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from archc.runtime.batch import BatchEngine, PoolExhausted
from archc.runtime.generate import Sampler, Sampling
from archc.serve.errors import APIError
from archc.serve.grammar import Constraint, apply_masks
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
    arrived: float = field(default_factory=time.perf_counter)
    constraint: Constraint | None = None  # the grammar its tokens follow (response_format)
    generated: int = 0                   # tokens chosen so far, an end-of-sequence id included
    finish: str | None = None
    cancelled: bool = False

    @property
    def total_tokens(self) -> int:
        """The most tokens the sequence can reach: what it reserves when admitted."""
        return len(self.prompt) + self.max_tokens


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
    last_token: int = -1
    last_time: float = 0.0


class Scheduler:
    """The loop that batches every request over one engine. `submit` and `cancel` may be called
    from any thread; only the loop's own thread touches the engine."""

    def __init__(self, engine: BatchEngine, *, tokenizer: Any = None,
                 metrics: Metrics | None = None, max_tokens_in_flight: int | None = None,
                 max_seq_len: int | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics(engine.blocks_total)
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_seq_len = min(engine.max_seq_len, max_seq_len or engine.max_seq_len)
        self.queue: deque[Request] = deque()
        self.running: dict[int, Live] = {}
        self.tokens_in_flight = 0           # total_tokens of the running requests
        self.cond = threading.Condition()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.metrics.set("archc_kv_blocks_total", engine.blocks_total)
        self.metrics.set("archc_kv_blocks_free", engine.blocks_free())

    # ---- any thread ---------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int, *, prompt_param: str = "prompt") -> None:
        """Refuse (400) a request that could never be admitted: past the context, or needing more
        KV blocks or tokens in flight than the server ever holds."""
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
        blocks, pool = self.engine.blocks_for(total), self.engine.blocks_total
        if blocks > pool:
            raise APIError(400, f"max_tokens: {total} tokens (prompt and max_tokens) need "
                           f"{blocks} KV-cache blocks; the server's pool holds {pool}",
                           param="max_tokens", code="context_length_exceeded")
        limit = self.max_tokens_in_flight
        if limit is not None and total > limit:
            raise APIError(400, f"max_tokens: {total} tokens (prompt and max_tokens) exceed the "
                           f"server's --max-tokens-in-flight of {limit}", param="max_tokens",
                           code="context_length_exceeded")

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may ask for: what the context, the pool
        and --max-tokens-in-flight leave (< 1: none)."""
        tokens = min(self.max_seq_len, self.engine.blocks_total * self.engine.block_size,
                     self.max_tokens_in_flight or self.max_seq_len)
        while tokens > prompt_tokens and self.engine.blocks_for(tokens) > self.engine.blocks_total:
            tokens -= 1
        return tokens - prompt_tokens

    def submit(self, request: Request) -> None:
        """Queue `request` (already checked); its events start once it is admitted."""
        self.check(len(request.prompt), request.max_tokens)
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
        for live in list(self.running.values()):
            self._finish(live, "cancelled", "")

    # ---- the loop's thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.queue or self.running):
                    self.cond.wait()
                if self.stopping:
                    return
            try:
                self._drop_cancelled()
                self._admit()
                if self.running:
                    self._step()
            except Exception as err:  # a bug must not leave clients waiting on a dead loop
                for live in list(self.running.values()):
                    self._finish(live, "error", "", f"{type(err).__name__}: {err}")
            self._gauges()
            if self.queue and not self.running:
                with self.cond:     # a queue the engine refused: wait for a change, not spin
                    self.cond.wait(timeout=0.05)

    def _gauges(self) -> None:
        self.metrics.set("archc_queue_depth", len(self.queue))
        self.metrics.set("archc_batch_size", len(self.running))
        self.metrics.set("archc_kv_blocks_free", self.engine.blocks_free())

    def _drop_cancelled(self) -> None:
        with self.cond:
            gone = [r for r in self.queue if r.cancelled]
            for request in gone:
                self.queue.remove(request)
        for request in gone:
            self._end_queued(request, "cancelled")
        for live in [v for v in self.running.values() if v.request.cancelled]:
            self._finish(live, "cancelled", "")

    def _admit(self) -> None:
        """Prefill queued requests, in order, while the head of the queue fits."""
        while True:
            with self.cond:
                if not self.queue:
                    return
                request = self.queue[0]
                total = request.total_tokens
                limit = self.max_tokens_in_flight
                if len(self.running) >= self.engine.max_batch or \
                        self.engine.blocks_for(total) > self.engine.blocks_free() or \
                        (limit is not None and self.tokens_in_flight + total > limit):
                    return
                self.queue.popleft()
            if not self._prefill(request):
                return

    def _prefill(self, request: Request) -> bool:
        """Start `request` in the engine and choose its first token; False when the pool turned
        out too small after all (it goes back to the head of the queue)."""
        seq = next(self.ids)
        try:
            logits = self.engine.prefill(seq, list(request.prompt), request.total_tokens)
        except PoolExhausted:
            with self.cond:
                self.queue.appendleft(request)
            return False
        except Exception as err:  # the engine failed: this request ends, the server goes on
            self._end_queued(request, "error", f"{type(err).__name__}: {err}")
            return True
        live = Live(request, seq, Sampler(request.sampling),
                    StopText(self.tokenizer, request.stop))
        self.running[seq] = live
        self.tokens_in_flight += request.total_tokens
        self.metrics.add("archc_prompt_tokens_total", len(request.prompt))
        self._accept(live, apply_masks(logits.reshape(1, -1), [request.constraint]))
        return True

    def _step(self) -> None:
        """One decode step of the whole running batch."""
        batch = list(self.running.values())
        self.metrics.set("archc_batch_size", len(batch))
        try:
            logits = self.engine.decode([v.seq for v in batch], [v.last_token for v in batch])
            self.metrics.observe("archc_decode_batch_size", logits.shape[0])
            self.metrics.peak("archc_batch_size_max", logits.shape[0])
        except Exception as err:  # the engine failed: every row of the step ends in error
            for live in batch:
                self._finish(live, "error", "", f"{type(err).__name__}: {err}")
            return
        logits = apply_masks(logits, [v.request.constraint for v in batch])   # on the device
        logits = logits.float().cpu()   # one copy to the host for the whole step
        for row, live in enumerate(batch):
            self._accept(live, logits[row:row + 1])

    def _accept(self, live: Live, logits: torch.Tensor) -> None:
        """Choose `live`'s next token from its logits [1, vocab] and tell its consumer."""
        request = live.request
        token = int(live.sampler(logits)[0])
        now = time.perf_counter()
        if request.generated == 0:
            self.metrics.observe("archc_time_to_first_token_seconds", now - request.arrived)
        else:
            self.metrics.observe("archc_inter_token_latency_seconds", now - live.last_time)
        live.last_token, live.last_time = token, now
        request.generated += 1
        self.metrics.add("archc_generation_tokens_total")
        if request.constraint is not None:
            request.constraint.take(token)
        if token in request.eos:
            self._finish(live, "stop", live.text.finish(), token=token)
            return
        text, stopped = live.text.push(token)
        if request.constraint is not None and request.constraint.done:   # the answer is whole
            self._finish(live, "stop", text + live.text.finish(), token=token)
        elif stopped:
            self._finish(live, "stop", text, token=token)
        elif request.generated >= request.max_tokens:
            self._finish(live, "length", text + live.text.finish(), token=token)
        else:
            _emit(request, Event(text, token))

    def _finish(self, live: Live, reason: str, text: str, error: str | None = None, *,
                token: int | None = None) -> None:
        """`live` leaves the batch, its blocks back in the pool; its last event says why."""
        del self.running[live.seq]
        self.tokens_in_flight -= live.request.total_tokens
        self.engine.release(live.seq)
        self._end(live.request, Event(text, token, reason, error))

    def _end_queued(self, request: Request, reason: str, error: str | None = None) -> None:
        self._end(request, Event("", None, reason, error))

    def _end(self, request: Request, event: Event) -> None:
        with self.cond:
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
