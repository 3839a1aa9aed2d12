"""Serve a model over HTTP with OpenAI's API, batching every request together.

`POST /v1/completions` and `POST /v1/chat/completions` (the checkpoint's chat template) answer
as OpenAI's do, streamed as server-sent events with `"stream": true`; `GET /v1/models` names the
model, `GET /health` says the server is up and `GET /metrics` gives Prometheus counters
(requests, tokens, queue depth, batch size, time to first token, inter-token latency, KV-cache
blocks). One scheduler runs every live request in one batch (continuous batching): a new request
is prefilled and joins the next decode step, a finished or cancelled one leaves at once. A
request waits in the queue until the batch has a row free and the KV-cache pool holds every block
it can need, so none ever stops mid-stream for lack of memory. Any OpenAI client talks to it:
`OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")`.

An encoder checkpoint (BERT, MiniLM …) is served on `POST /v1/embeddings` instead, pooled and
normalized as its sentence-transformers files declare (`archc.serve.embeddings`)."""

from __future__ import annotations

import argparse
from typing import Any

from archc.commands.chat import load_for_text
from archc.commands.defaults import fitted, note
from archc.commands.vocabulary import add, number, positive_int
from archc.ui import err_console

port_number = number(int, 0, None)
BLOCK_SIZE = 16     # tokens per KV-cache block
PREFILL_CHUNK = 512     # prompt tokens a scheduler turn
chunk_size = number(int, 0, None)


def _port(text: str) -> int:
    value = port_number(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (0 … 65535)")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", detail="a checkpoint with a tokenizer (chat needs its chat template); "
        "an encoder's serves embeddings")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                   help="the address to listen on (default 127.0.0.1: this machine only; "
                        "0.0.0.0 for every interface)")
    p.add_argument("--port", type=_port, default=8000, metavar="PORT",
                   help="the TCP port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--max-batch", type=positive_int, default=16, metavar="N",
                   help="sequences one decode step runs together, at most (an encoder: inputs one "
                        "forward pass embeds; default 16)")
    p.add_argument("--max-tokens-in-flight", type=positive_int, metavar="N",
                   help="tokens (prompt and max_tokens) the running requests may reserve "
                        "together; a request waits in the queue beyond it (default: as many "
                        "as the KV-cache pool holds)")
    p.add_argument("--block-size", type=positive_int, metavar="N",
                   help=f"tokens per KV-cache block (default {BLOCK_SIZE}, or max_seq_len "
                        "where that is shorter)")
    p.add_argument("--blocks", type=positive_int, metavar="N",
                   help="KV-cache blocks in the pool (default: enough for --max-batch sequences "
                        "of max_seq_len tokens, or as many as half the free memory holds)")
    p.add_argument("--prefill-chunk", type=chunk_size, default=PREFILL_CHUNK, metavar="N",
                   help="prompt tokens prefilled a scheduler turn, between the running batch's "
                        f"decode steps, so a long prompt does not stall running streams "
                        f"(default {PREFILL_CHUNK}; 0: a whole prompt at once)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="forget a request's KV blocks when it ends (by default full blocks "
                        "stay cached, and a later prompt with the same prefix, such as a chat's "
                        "next turn, prefills only what follows it)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model's name in the API (default: the spec's name)")
    add(p, "backend", default="eager")
    add(p, "device", "dtype", "threads", "cache_dir", "quiet")
    add(p, "seed", default=0, detail="requests that give no seed draw theirs from a generator "
        "seeded with it")
    add(p, "quantize", "group", "dequantize")   # no --kv-cache: a paged pool holds the model dtype
    add(p, "no_autotune", detail="with --backend triton")


def run(args: argparse.Namespace) -> int:
    from archc.serve.app import build_app
    from archc.serve.engine import engine_for
    from archc.serve.protocol import Served
    from archc.serve.scheduler import Scheduler
    from archc.serve.server import Server, listen
    _check_installed()
    sock = listen(args.host, args.port)     # an address in use is refused before loading
    try:
        run_, model = load_for_text(args, "archc serve", chat=False, encoder=True)
        compiled = run_.compile(model)
        spec = model.spec
        if spec.family == "encoder":
            return _serve_embeddings(args, sock, run_, model, compiled)
        block_size = args.block_size or fitted(
            "--block-size", None, BLOCK_SIZE, spec.max_seq_len,
            f"{spec.name}'s max_seq_len = {spec.max_seq_len}", quiet=args.quiet)
        engine = engine_for(compiled, max_batch=args.max_batch, block_size=block_size,
                            blocks=args.blocks, prefix_cache=not args.no_prefix_cache)
        # a default pool holds what half the free memory does: fewer sequences of max_seq_len
        # at once, or, when not even one, a shorter context
        context = min(engine.max_seq_len, engine.blocks_total * engine.block_size)
        if engine.shorter_context is not None:
            note(engine.shorter_context, args.quiet)
        if args.blocks is None and \
                engine.blocks_total < engine.max_batch * engine.blocks_for(engine.max_seq_len):
            note(f"--blocks {engine.blocks_total}: the default pool ({engine.max_batch} "
                 f"sequences of {engine.max_seq_len} tokens) exceeds half the free memory"
                 + (f"; the context served is {context} tokens"
                    if context < engine.max_seq_len else ""), args.quiet)
        scheduler = Scheduler(engine, tokenizer=model.tokenizer,
                              max_tokens_in_flight=args.max_tokens_in_flight,
                              max_seq_len=context, prefill_chunk=args.prefill_chunk or None)
        name = args.model_name or model.spec.name
        served = Served(scheduler, name, model.tokenizer, model.spec.vocab_size,
                        tuple(model.eos_token_ids), seed=args.seed, family=spec.family)
        run_.timings.report(args.quiet)
        if not args.quiet:
            host, port = sock.getsockname()[:2]
            err_console.print(
                f"serving {name} at http://{host}:{port}/v1 · batches of up to "
                f"{engine.max_batch} · {engine.blocks_total} KV-cache blocks of "
                f"{engine.block_size} tokens · context {scheduler.max_seq_len} tokens",
                soft_wrap=True, highlight=False, markup=False)
        Server(build_app(served), sock, log_level="warning" if args.quiet else "info").run()
    finally:
        sock.close()
    return 0


def _serve_embeddings(args: argparse.Namespace, sock: Any, run_: Any, model: Any,
                      compiled: Any) -> int:
    from archc.serve.app import build_app
    from archc.serve.embeddings import embedder_for
    from archc.serve.protocol import Served
    from archc.serve.server import Server
    embedder = embedder_for(model, compiled, max_batch=args.max_batch)
    name = args.model_name or model.spec.name
    served = Served(None, name, model.tokenizer, model.spec.vocab_size, (), seed=args.seed,
                    family="encoder", embedder=embedder)
    run_.timings.report(args.quiet)
    if not args.quiet:
        host, port = sock.getsockname()[:2]
        pooling = embedder.pooling
        err_console.print(
            f"serving {name} embeddings at http://{host}:{port}/v1 · {embedder.dimensions} "
            f"dimensions · {pooling.mode} pooling{', normalized' * pooling.normalize} · inputs "
            f"of up to {embedder.max_tokens} tokens, {embedder.max_batch} a batch",
            soft_wrap=True, highlight=False, markup=False)
    Server(build_app(served), sock, log_level="warning" if args.quiet else "info").run()
    return 0


def _check_installed() -> None:
    from archc.errors import ArchcError
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ArchcError(f"archc serve needs {err.name}: pip install 'archc[serve]'") from None
