"""What the server's tests share: a server on a free loopback port around a loaded model, its
`/metrics` read back, and the reference answer of `CompiledModel.generate`.

``ScaffoldEngine`` stands in for the paged batch engine (``CompiledModel.engine``) where this
branch has none: one eager session whose per-sequence KV cache is swapped in and out, the rows of
a decode step run one at a time, blocks only counted. ``scaffold_engine()`` installs it for as
long as it is entered, and does nothing where the real engine exists."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

import archc
from archc.errors import ArchcError
from archc.model import CompiledModel
from archc.runtime.batch import PoolExhausted
from archc.serve.app import build_app
from archc.serve.engine import engine_for
from archc.serve.metrics import parse
from archc.serve.protocol import Served
from archc.serve.scheduler import Scheduler
from archc.serve.server import Server, listen


class ScaffoldEngine:
    """A BatchEngine over one EagerSession: each sequence keeps its own KV cache and recurrent
    state, swapped into the session for its turn."""

    def __init__(self, compiled: CompiledModel, block_size: int = 16, blocks: int | None = None,
                 max_batch: int = 16) -> None:
        assert compiled.backend == "eager", "the scaffold runs the eager session only"
        self.session = compiled.session
        self.block_size, self.max_batch = block_size, max_batch
        self.max_seq_len = compiled.spec.max_seq_len
        self.blocks_total = blocks if blocks is not None else \
            max_batch * self.blocks_for(self.max_seq_len)
        self.seqs: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()    # the scheduler calls from one thread; say so if not

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_free(self) -> int:
        return self.blocks_total - sum(s["blocks"] for s in self.seqs.values())

    def prefill(self, seq: int, tokens: Sequence[int], total_tokens: int) -> torch.Tensor:
        if seq in self.seqs:
            raise ArchcError(f"sequence {seq} is already live")
        if total_tokens > self.max_seq_len:
            raise ArchcError(f"{total_tokens} tokens exceed max_seq_len = {self.max_seq_len}")
        need = self.blocks_for(total_tokens)
        if need > self.blocks_free():
            raise PoolExhausted(f"{need} blocks wanted, {self.blocks_free()} free")
        with self.lock:
            self.session.reset()
            logits = self.session.step(torch.tensor([list(tokens)]))[0, -1]
            self.seqs[seq] = {"blocks": need, "total": total_tokens, **self._save()}
        return logits

    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        assert len(seqs) <= self.max_batch, f"{len(seqs)} rows > max_batch {self.max_batch}"
        rows = []
        with self.lock:
            for seq, token in zip(seqs, tokens):
                held = self.seqs[seq]
                assert held["past"] < held["total"], f"sequence {seq} outgrew its reservation"
                for k in ("cache", "state", "past", "prefix_len"):
                    setattr(self.session, k, held[k])
                rows.append(self.session.step(torch.tensor([[token]]))[0, -1])
                held.update(self._save())
        return torch.stack(rows)

    def release(self, seq: int) -> None:
        del self.seqs[seq]

    def _save(self) -> dict[str, Any]:
        s = self.session
        return {"cache": s.cache, "state": s.state, "past": s.past, "prefix_len": s.prefix_len}


@contextlib.contextmanager
def scaffold_engine() -> Iterator[None]:
    """`CompiledModel.engine` as the scaffold, unless the real one exists."""
    if hasattr(CompiledModel, "engine"):
        yield
        return

    def engine(self: CompiledModel, block_size: int = 16, blocks: int | None = None,
               max_batch: int = 16) -> ScaffoldEngine:
        return ScaffoldEngine(self, block_size, blocks, max_batch)

    CompiledModel.engine = engine   # type: ignore[attr-defined]
    try:
        yield
    finally:
        del CompiledModel.engine    # type: ignore[attr-defined]


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
            max_tokens_in_flight: int | None = None, dtype: str = "f32") -> Iterator[Running]:
    """A server for `source` on a free loopback port, for as long as it is entered."""
    torch.manual_seed(0)
    model = archc.load(source, dtype=dtype)
    with scaffold_engine():
        engine = engine_for(model.compile("eager", dtype=dtype), max_batch=max_batch,
                            blocks=blocks)
        scheduler = Scheduler(engine, tokenizer=model.tokenizer,
                              max_tokens_in_flight=max_tokens_in_flight,
                              max_seq_len=model.spec.max_seq_len)
        served = Served(scheduler, model.spec.name, model.tokenizer, model.spec.vocab_size,
                        tuple(model.eos_token_ids))
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
