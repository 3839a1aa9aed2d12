"""What the server's tests share: a server on a free loopback port around a loaded model, its
`/metrics` read back, and the reference answer of `CompiledModel.generate`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

import archc
from archc.model import CompiledModel
from archc.serve.app import build_app
from archc.serve.embeddings import embedder_for
from archc.serve.engine import engine_for
from archc.serve.metrics import parse
from archc.serve.protocol import Served
from archc.serve.scheduler import Scheduler
from archc.serve.server import Server, listen


@dataclass
class Running:
    """A server under test: where it listens, what it serves, and a reference to compare
    against (another compilation of the same model, so that it never shares a cache with the
    server's engine)."""

    url: str
    served: Served
    reference: CompiledModel
    model: archc.Model

    @property
    def name(self) -> str:
        return self.served.name

    def metrics(self) -> dict[str, float]:
        return parse(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def expected(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], str]:
        """Greedy `generate` on the prompt: the new tokens (an end-of-sequence id included)
        and their text (without it)."""
        out = self.reference.generate(torch.tensor([list(prompt)]), max_tokens)
        new = [int(t) for t in out[0, len(prompt):]]
        eos = set(self.model.eos_token_ids)
        return new, self.model.tokenizer.decode([t for t in new if t not in eos])

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """/metrics once nothing runs or waits and every block is back in the pool."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["archc_batch_size"] == 0 and m["archc_queue_depth"] == 0 and \
                    m["archc_kv_blocks_free"] == m["archc_kv_blocks_total"]:
                return m
            assert time.monotonic() < deadline, f"the server did not go idle: {m}"
            time.sleep(0.05)


@contextlib.contextmanager
def serving(source: str, *, max_batch: int = 16, blocks: int | None = None,
            max_tokens_in_flight: int | None = None, dtype: str = "f32",
            backend: str = "eager", prefix_cache: bool = True,
            prefill_chunk: int | None = 512, block_size: int = 16) -> Iterator[Running]:
    """A server for `source` on a free loopback port, for as long as it is entered; the
    reference answers are eager's, whatever the server's backend."""
    torch.manual_seed(0)
    model = archc.load(source, dtype=dtype)
    compiled = model.compile(backend, dtype=dtype)
    if model.spec.family == "encoder":      # embeddings only, as `archc serve` serves it
        served = Served(None, model.spec.name, model.tokenizer, model.spec.vocab_size, (),
                        family="encoder", embedder=embedder_for(model, compiled,
                                                                max_batch=max_batch))
    else:
        engine = engine_for(compiled, max_batch=max_batch, blocks=blocks,
                            prefix_cache=prefix_cache, block_size=block_size)
        scheduler = Scheduler(engine, tokenizer=model.tokenizer,
                              max_tokens_in_flight=max_tokens_in_flight,
                              max_seq_len=model.spec.max_seq_len, prefill_chunk=prefill_chunk)
        served = Served(scheduler, model.spec.name, model.tokenizer, model.spec.vocab_size,
                        tuple(model.eos_token_ids), family=model.spec.family)
    server = Server(build_app(served), listen("127.0.0.1", 0), log_level="warning").start()
    try:
        yield Running(f"http://127.0.0.1:{server.port}", served,
                      model.compile("eager", dtype=dtype), model)
    finally:
        server.stop()


def client(server: Running | str, **options: Any) -> Any:
    """The official OpenAI client, pointed at the server (or its URL)."""
    import openai
    url = server if isinstance(server, str) else server.url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                         timeout=options.pop("timeout", 60), **options)
