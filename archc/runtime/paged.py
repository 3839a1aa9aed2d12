"""The paged batch engine: many sequences over one pool of KV-cache blocks (``BatchEngine``).

    engine = archc.load("tiny-llama3").compile("eager").engine(block_size=16)
    logits = engine.prefill(7, prompt_ids, total_tokens=len(prompt_ids) + 32)   # [vocab]
    logits = engine.decode([7, 9], [next_7, next_9])                            # [2, vocab]
    engine.release(7)

It runs the compiled model's program after ``archc.passes.paged.paged_kv``: a step's rows are
tokens, each with its own position and block table, so a prefill is one sequence's prompt and a
decode step is one token of each live sequence, whatever their lengths. A sequence reserves, at
its prefill, every block its `total_tokens` may fill, and holds them until it is released: a
running sequence never waits for memory.

Prompts share prefixes: a full block of prompt tokens that a live sequence holds (the same
tokens after the same earlier blocks) is held by a new sequence with that prefix too, and its
tokens are not computed again. Only full prompt blocks are shared, and a sequence writes only at
positions past its own length, so a shared block is never written (no copy on write); a block
returns to the pool with its last holder.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from archc.errors import ArchcError
from archc.ir.graph import LAST_TOKEN, Program
from archc.ir.ops import Op
from archc.ir.ops.base import RECURRENT
from archc.ir.shapes import DTYPE_BYTES
from archc.memory import free_bytes
from archc.passes.logits import last_token_graph
from archc.passes.paged import max_blocks, paged_kv
from archc.runtime.batch import PoolExhausted
from archc.runtime.eager import EagerContext, EagerSession, PagedPool, run_graph
from archc.runtime.launch import MAX_PLANS
from archc.spec.load import longrope_switch
from archc.spec.schema import Spec
from archc.ui import nbytes

if TYPE_CHECKING:
    from archc.runtime.triton_backend import TritonSession
    from archc.spec.schema import Spec


class EngineError(ArchcError):
    """A model the paged engine cannot serve, or a call it refuses."""


class Compiled(Protocol):
    """What the engine reads of a compiled model (``archc.model.CompiledModel``)."""

    spec: Spec
    program: Program
    session: Any           # an EagerSession or a TritonSession
    backend: str           # "eager" or "triton"


@dataclass
class _Sequence:
    blocks: list[int]       # the blocks it holds: its block table, in order
    length: int             # tokens in the cache
    total: int              # tokens it reserved blocks for


def _whole(value: Any, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise EngineError(f"{what} must be an integer ≥ {least}, got {value!r}")
    return value


def refuse_unservable(compiled: Compiled) -> None:
    """One clear error for a compiled model the paged engine cannot serve."""
    spec, name = compiled.spec, compiled.spec.name
    if spec.family != "decoder":
        raise EngineError(f"{name} is an {spec.family}: the paged engine serves decoder-only "
                          "models (it decodes token by token over a KV cache)")
    recurrent = sorted({n.op.value for g in compiled.program for n in g if n.op in RECURRENT})
    if recurrent:
        raise EngineError(f"{name} has recurrent mixers ({', '.join(recurrent)}): they keep a "
                          "state per sequence, not a KV cache, and the paged engine pages only "
                          "a KV cache")
    comms = getattr(compiled.session, "comms", {}) or {}
    parallel = {k: c.size for k, c in comms.items() if c.size > 1}
    if parallel:
        sizes = ", ".join(f"{k}={v}" for k, v in sorted(parallel.items()))
        raise EngineError(f"{name} is compiled to run over several ranks ({sizes}); the paged "
                          "engine runs a model on one device (tp=1, cp=1)")
    if compiled.backend not in ("eager", "triton"):
        raise EngineError(f"the paged engine runs the eager and triton backends, not "
                          f"{compiled.backend!r}")


def served_length(spec: Spec) -> tuple[int, str | None]:
    """The most tokens one sequence of the paged engine may reach, and why when that is less
    than max_seq_len. LongRoPE rotates every position of a sequence past its trained context by
    the long factors (transformers computes the sequence again when it crosses), and the rows of
    one batched step belong to sequences of different lengths: the engine serves such a model
    on its short factors, up to the trained context."""
    switch = longrope_switch(spec)
    if switch is None or switch >= spec.max_seq_len:
        return spec.max_seq_len, None
    return switch, (f"{spec.name}'s LongRoPE switches to its long factors past "
                    f"{switch} tokens (original_max_seq_len), rotating the whole sequence "
                    "again; the paged engine batches sequences of different lengths, so it "
                    f"serves sequences of at most {switch} tokens")


def block_bytes(program: Program, block_size: int) -> int:
    """Bytes one block takes over every layer's k and v pools: block_size rows of each KV
    head's head_dim values, in the dtype the attention reads."""
    return sum(2 * n.attr("kv_heads") * int(g.nodes[n.inputs[0]].shape[3]) * block_size *
               DTYPE_BYTES[n.dtype] for g in program for n in g
               if n.op == Op.ATTENTION and n.attr("paged") is not None)


def default_blocks(engine: PagedEngine, device: torch.device) -> int:
    """blocks=None: enough for max_batch sequences of max_seq_len each, when they take at most
    half of the memory free on `device` (the rest is for activations and the host's own); else
    as many as that half holds — fewer sequences at once, or shorter ones than max_seq_len (a
    sequence the pool cannot hold is refused when it starts). Refused when that half holds not
    one block."""
    want = engine.max_batch * engine.table_width
    free = free_bytes(device)
    if free is None or engine.block_bytes == 0 or want * engine.block_bytes <= free // 2:
        return want
    fits = free // 2 // engine.block_bytes
    if fits < 1:
        raise EngineError(f"one KV-cache block of {engine.block_size} tokens needs "
                          f"{nbytes(engine.block_bytes)}; half of the {nbytes(free)} free is "
                          f"{nbytes(free // 2)}")
    return fits


class _EagerSteps:
    """Paged steps on the eager interpreter, with the eager session's parameters."""

    def __init__(self, session: EagerSession, program: Program, blocks: int,
                 block_size: int) -> None:
        self.graph = program.graph("decoder")
        # a prefill's variant: the LM head over the prompt's last token (archc.passes.logits)
        self.last = last_token_graph(program) or self.graph
        self.params = session.params["decoder"]
        self.device = session.device
        self.pool = PagedPool(blocks, block_size)

    def run(self, inputs: Mapping[str, torch.Tensor], tokens: int, last: bool = False
            ) -> torch.Tensor:
        inputs = {k: x.to(self.device) for k, x in inputs.items()}
        ctx = EagerContext(dict(B=1, T=tokens, P=0, S=0), None, paged=self.pool)
        return run_graph(self.last if last else self.graph, self.params, inputs, ctx)["logits"]


class _TritonSteps:
    """Paged steps on the paged program's generated kernels; the compiled session's
    parameters are shared, not evaluated again."""

    def __init__(self, session: TritonSession, program: Program, blocks: int,
                 max_batch: int) -> None:
        from archc.runtime.triton_backend import TritonSession

        held = {g.name: {n.name: session.runners[g.name].params[i]
                         for i, n in enumerate(g.nodes) if n.op == Op.PARAM}
                for g in session.program}

        class _Paged(TritonSession):
            def _parameters(self, graph: Any, checkpoint: Any) -> dict[str, torch.Tensor]:
                return held[graph.name]

        # a decode step's row count changes from step to step: no captured CUDA graphs
        options = replace(session.options, passes=None, cuda_graphs=False, autotune=False)
        self.session = _Paged(program, {}, max_seq_len=session.max_seq_len, dtype=session.dtype,
                              device=session.device, options=options)
        # a plan per decode batch size (1 … max_batch rows) stays, beside a few prompt lengths
        self.session.runners["decoder"].max_plans = max_batch + MAX_PLANS
        self.blocks = blocks

    def run(self, inputs: Mapping[str, torch.Tensor], tokens: int, last: bool = False
            ) -> torch.Tensor:
        s = self.session
        s.cache.ensure(self.blocks)          # the pools: [blocks, H_kv, block_size, D]
        # a prefill's LM head over its last token: the variant's runner, its own plans
        runner = s.runners[LAST_TOKEN if last and LAST_TOKEN in s.runners else "decoder"]
        plan = runner.plan(s.ctx, 1, tokens, 0, 0, tokens)
        runner.feed(plan, {k: x.to(s.device) for k, x in inputs.items()})
        runner.execute(plan, s.ctx, 0)
        return plan.outputs["logits"].clone()


class PagedEngine:
    """A compiled decoder running many sequences over one pool of KV-cache blocks: implements
    ``archc.runtime.batch.BatchEngine``."""

    def __init__(self, compiled: Compiled, block_size: int = 16, blocks: int | None = None,
                 max_batch: int = 16) -> None:
        refuse_unservable(compiled)
        self.block_size = _whole(block_size, "block_size", 1)
        self.max_batch = _whole(max_batch, "max_batch", 1)
        self.max_seq_len, self.shorter_context = served_length(compiled.spec)
        self.table_width = max_blocks(self.max_seq_len, self.block_size)
        session = compiled.session
        self.program = paged_kv(session.program, self.block_size, self.max_seq_len)
        self.block_bytes = block_bytes(self.program, self.block_size)
        self.blocks_total = default_blocks(self, session.device) if blocks is None else \
            _whole(blocks, "blocks", 1)
        if compiled.backend == "eager":
            self.steps: _EagerSteps | _TritonSteps = _EagerSteps(
                session, self.program, self.blocks_total, self.block_size)
        else:
            self.steps = _TritonSteps(session, self.program, self.blocks_total, self.max_batch)
        self.vocab = compiled.spec.vocab_size
        # blocks handed out lowest first: a fresh engine's first sequence holds blocks 0, 1, …
        self._free = list(range(self.blocks_total - 1, -1, -1))
        self._seqs: dict[int, _Sequence] = {}
        # shared prompt prefixes: a full block of prompt tokens is found by (the block before
        # it, or −1, and its tokens) while a live sequence holds it; `_holders` counts them
        self._prefix: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._holders: dict[int, int] = {}

    # ---- the pool -------------------------------------------------------------------------

    def blocks_free(self) -> int:
        """Blocks neither held nor reserved by a live sequence."""
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens holds."""
        return math.ceil(_whole(tokens, "tokens", 0) / self.block_size)

    def release(self, seq: int) -> None:
        """Sequence `seq` is done (finished or cancelled): its blocks go back to the pool."""
        held = self._seqs.pop(self._known(seq), None)
        assert held is not None
        for block in reversed(held.blocks):
            self._holders[block] -= 1
            if self._holders[block] == 0:      # its last holder: the block is free again
                del self._holders[block]
                key = self._key_of.pop(block, None)
                if key is not None:
                    del self._prefix[key]
                self._free.append(block)

    def _shared_prefix(self, ids: list[int]) -> list[int]:
        """The blocks of live sequences that hold the same first full blocks of prompt tokens
        as `ids`, in order; at least the last token is left to compute (its logits)."""
        shared: list[int] = []
        for i in range((len(ids) - 1) // self.block_size):
            key = (shared[-1] if shared else -1,
                   tuple(ids[i * self.block_size:(i + 1) * self.block_size]))
            block = self._prefix.get(key)
            if block is None:
                break
            shared.append(block)
        return shared

    def _offer_prefix(self, held: _Sequence, ids: list[int]) -> None:
        """After a prefill: the full blocks of its prompt may be shared by later prompts."""
        for i in range(len(ids) // self.block_size):
            key = (held.blocks[i - 1] if i else -1,
                   tuple(ids[i * self.block_size:(i + 1) * self.block_size]))
            if key not in self._prefix and held.blocks[i] not in self._key_of:
                self._prefix[key] = held.blocks[i]
                self._key_of[held.blocks[i]] = key

    # ---- steps ----------------------------------------------------------------------------

    def prefill(self, seq: int, tokens: Sequence[int], total_tokens: int) -> torch.Tensor:
        """Start `seq` on its prompt, reserving the blocks of `total_tokens` tokens: the logits
        of its last token, [vocab]."""
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise EngineError(f"a sequence id is an integer, got {seq!r}")
        if seq in self._seqs:
            raise EngineError(f"sequence {seq} is already running; release it first")
        ids = self._ids(tokens, "the prompt")
        if not ids:
            raise EngineError(f"sequence {seq}: the prompt is empty")
        total = _whole(total_tokens, "total_tokens", 1)
        if total < len(ids):
            raise EngineError(f"sequence {seq}: total_tokens={total} is shorter than its "
                              f"{len(ids)}-token prompt")
        if total > self.max_seq_len:
            raise EngineError(f"sequence {seq}: total_tokens={total} exceeds "
                              + (f"max_seq_len = {self.max_seq_len}"
                                 if self.shorter_context is None else
                                 f"{self.max_seq_len}: {self.shorter_context}"))
        # full blocks of a prompt prefix that a live sequence holds are shared, not computed
        # again: a sequence never writes below its length, so they stay as they are
        shared = self._shared_prefix(ids)
        need = self.blocks_for(total) - len(shared)
        if need > len(self._free):
            raise PoolExhausted(f"sequence {seq} needs {need} blocks of {self.block_size} "
                                f"tokens; {len(self._free)} of {self.blocks_total} are free")
        held = _Sequence(shared + [self._free.pop() for _ in range(need)], 0, total)
        for block in held.blocks:
            self._holders[block] = self._holders.get(block, 0) + 1
        self._seqs[seq] = held
        start = len(shared) * self.block_size
        try:    # the logits of the prompt's last token only
            logits = self._step([held] * (len(ids) - start), list(range(start, len(ids))),
                                ids[start:], last=True)
        except BaseException:
            self.release(seq)
            raise
        held.length = len(ids)
        self._offer_prefix(held, ids)
        return logits[-1]

    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One step of each live sequence in `seqs`, fed its next token: logits
        [len(seqs), vocab]. The rows may have any past lengths."""
        seqs, ids = list(seqs), self._ids(tokens, "the tokens")
        if len(seqs) != len(ids):
            raise EngineError(f"decode got {len(seqs)} sequences and {len(ids)} tokens")
        if not seqs:
            raise EngineError("decode needs at least one sequence")
        if len(seqs) > self.max_batch:
            raise EngineError(f"decode of {len(seqs)} sequences exceeds max_batch = "
                              f"{self.max_batch}")
        if len(set(seqs)) != len(seqs):
            raise EngineError(f"decode names a sequence twice: {seqs}")
        held = [self._seqs[self._known(s)] for s in seqs]
        for s, h in zip(seqs, held):
            if h.length >= h.total:
                raise EngineError(f"sequence {s} has reached the {h.total} tokens it reserved "
                                  "(total_tokens at its prefill)")
        logits = self._step(held, [h.length for h in held], ids)
        for h in held:
            h.length += 1
        return logits

    def _step(self, rows: list[_Sequence], positions: list[int], ids: list[int], *,
              last: bool = False) -> torch.Tensor:
        """Logits [T, vocab] of T tokens, token t of sequence rows[t] at positions[t]; with
        `last` (a prefill: one sequence's tokens), of the last token only, [1, vocab]."""
        table = torch.zeros(len(rows), self.table_width, dtype=torch.int32)
        for t, r in enumerate(rows):
            table[t, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        inputs = {"tokens": torch.tensor([ids]), "positions": torch.tensor(positions),
                  "block_table": table}
        return self.steps.run(inputs, len(ids), last)[0]

    def _known(self, seq: int) -> int:
        if seq not in self._seqs:
            raise EngineError(f"sequence {seq!r} is not running (never prefilled, or released)")
        return seq

    def _ids(self, tokens: Sequence[int], what: str) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        ids = list(tokens)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise EngineError(f"{what} must be integer token ids")
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise EngineError(f"{what} hold ids outside the vocabulary [0, {self.vocab}): "
                              f"{bad[:5]}")
        return ids
