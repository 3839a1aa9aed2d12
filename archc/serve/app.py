"""The HTTP surface: OpenAI's completions and chat completions over the scheduler.

    GET  /v1/models             the one model served
    POST /v1/completions        a prompt (text or token ids) continued
    POST /v1/chat/completions   messages, through the checkpoint's chat template
    POST /v1/embeddings         vectors of an encoder's inputs (``archc.serve.embeddings``)
    GET  /tokenizer_info        the tokenizer's special tokens and chat template
    POST /tokenize              text (or messages) → token ids  (``archc.serve.tokenization``)
    POST /detokenize            token ids → text
    GET  /health                200 while the scheduler runs
    GET  /metrics               Prometheus text (``archc.serve.metrics``)

Every request body is checked (``archc.serve.protocol``) before it reaches the scheduler; every
error, a route or method that does not exist included, is in OpenAI's error shape. With
``stream: true`` the answer comes as server-sent events in OpenAI's chunk format, ending
``data: [DONE]``; a client that goes away, streamed or not, cancels its request. An encoder is
served without a scheduler: it answers only the embeddings route, a decoder every route but it;
either refuses the other's with a 400 that names the model's kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from archc.serve import embeddings, tokenization
from archc.serve.errors import APIError
from archc.serve.protocol import Answer, Job, Served, read_job, sse
from archc.serve.scheduler import Event, Request

DISCONNECT_POLL_S = 0.25            # how often a request not streamed asks if its client left


def _failure(event: Event) -> APIError:
    return APIError(500, f"generation failed: {event.error}", code="engine_error")


class Submitted:
    """A job queued in the scheduler, a request per prompt, their events gathered on the event
    loop of the handler that submitted it, each event's index its choice's (prompt i's sample
    j: i·n + j)."""

    def __init__(self, served: Served, job: Job) -> None:
        loop = asyncio.get_running_loop()
        self.served = served
        self.events: asyncio.Queue[Event] = asyncio.Queue()

        def emitter(first: int) -> Callable[[Event], None]:
            return lambda e: loop.call_soon_threadsafe(
                self.events.put_nowait, replace(e, index=first + e.index))
        self.requests = [Request(prompt, job.max_tokens, emitter(i * job.n), job.sampling,
                                 job.stop, served.eos, n=job.n, constraint=job.constraint and
                                 (job.constraint if i == 0 else job.constraint.copy()),
                                 logprobs=job.logprobs,
                                 prompt_logprobs=job.logprobs if job.echo else None)
                         for i, prompt in enumerate(job.prompts)]
        scheduler = served.generating()
        try:        # refused here, before any response starts
            for request in self.requests:
                scheduler.submit(request)
        except APIError:
            for request in self.requests:
                scheduler.cancel(request)
            raise

    async def each(self, is_gone: Callable[[], Any]) -> AsyncIterator[Event]:
        """The events as they come; the request is cancelled when the consumer stops early (a
        closed stream) or `is_gone` says the client has disconnected."""
        checked, ended = time.monotonic(), 0
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.events.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    event = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:   # tokens may never pause
                    if await is_gone():
                        return
                    checked = time.monotonic()
                if event is None:
                    continue
                yield event
                ended += event.finish is not None
                if ended == sum(r.n for r in self.requests):     # every sample has ended
                    return
        finally:
            for request in self.requests:
                self.served.generating().cancel(request)


async def _never() -> bool:
    return False

def build_app(served: Served) -> FastAPI:
    """The FastAPI application serving `served`; its scheduler runs while the app does."""
    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        scheduler = served.scheduler
        if scheduler is not None and scheduler.thread is None:
            scheduler.start()
        yield
        if scheduler is not None:
            scheduler.stop()

    app = FastAPI(title="archc", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error(err: APIError) -> JSONResponse:
        served.metrics.add("archc_requests_rejected_total", status=str(err.status))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        return error(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, err: HTTPException) -> JSONResponse:
        what = {404: f"no route {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}
        return error(APIError(err.status_code, what.get(err.status_code, str(err.detail)),
                              code="not_found" if err.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def internal(_: HTTPRequest, err: Exception) -> JSONResponse:
        return error(APIError(500, f"internal error: {type(err).__name__}: {err}",
                              code="internal_error"))

    async def body_of(request: HTTPRequest) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise APIError(400, "the request body is not valid JSON",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    async def generate(kind: str, request: HTTPRequest) -> Any:
        job = read_job(kind, await body_of(request), served)
        answer, submitted = Answer(job, served), Submitted(served, job)
        if job.stream:
            return EventStream(_stream(job, answer, submitted), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        finish = "cancelled"
        async for event in submitted.each(request.is_disconnected):
            if event.finish == "error":
                raise _failure(event)
            answer.take(event)
            finish = event.finish or finish
        return JSONResponse(answer.whole(finish))

    async def _stream(job: Job, answer: Answer, submitted: Submitted) -> AsyncIterator[str]:
        choices = len(job.prompts) * job.n
        if job.kind == "chat":
            for index in range(choices):
                yield sse(answer.first_chunk(index))
        if job.echo and job.logprobs is None:       # else once the prompt is scored
            for index in range(choices):
                yield sse(answer.echo_chunk(index))
        # the response itself listens for the client going away (EventStream)
        async for event in submitted.each(_never):
            if event.finish == "error":
                yield sse(_failure(event).body())
                break
            answer.take(event)
            if event.prompt is not None and job.echo:
                for index in range(event.index, event.index + job.n):
                    yield sse(answer.echo_chunk(index))
            elif event.text or event.finish is not None:
                yield sse(answer.chunk(event))
        if job.include_usage:
            yield sse(answer.usage_chunk())
        yield sse("[DONE]")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Any:
        return await generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Any:
        return await generate("chat", request)

    @app.post("/v1/embeddings")
    async def embed(request: HTTPRequest) -> Any:
        inputs, fmt = embeddings.read_request(await body_of(request), served)
        vectors = await asyncio.to_thread(served.embedder.embed, inputs)
        served.metrics.add("archc_prompt_tokens_total", sum(len(ids) for ids in inputs))
        served.metrics.add("archc_embedding_requests_total")
        return JSONResponse(embeddings.response(vectors, inputs, fmt, served))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        return tokenization.info(served)

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest) -> Any:
        return tokenization.tokenize(await body_of(request), served)

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest) -> Any:
        return tokenization.detokenize(await body_of(request), served)

    def model_card() -> dict[str, Any]:
        return {"id": served.name, "object": "model", "created": served.created,
                "owned_by": "archc", "max_model_len": served.max_model_len}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Any:
        if name != served.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{served.name!r}", param="model", code="model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> Any:
        if served.scheduler is None:       # an encoder: nothing runs between requests
            return {"status": "ok"}
        thread = served.scheduler.thread
        if thread is None or not thread.is_alive():
            raise APIError(503, "the scheduler is not running", code="unhealthy")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(served.metrics.text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    class EventStream(StreamingResponse):
        """A stream whose generator is always closed when the response ends, however it ends
        (finished, or the client gone), so that its request is cancelled at once."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()   # type: ignore[attr-defined]

    return app
