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

A prefix cache outlives its requests: every full block of a sequence (prompt or generated
tokens) is indexed by a chained hash, of the hash of the block before it and its own token ids,
so a block's hash names the whole prefix it ends. A later prompt that starts with the same full
blocks holds those blocks and its prefill computes only the tokens after them (a chat's second
turn prefills only the new turn). A block keeps its hash when its last holder is released: it is
idle, still cached, and counted free; the pool takes idle blocks back, least recently released
first, only when it has no block that never held a cached prefix. A held block (its refcount
above 0) is never taken. A sequence writes only at positions past its own length, so a shared
full block is never written; ``fork`` gives a new sequence the full blocks of a running one and
a copy of its last, partial block (the only one either may still write).

    engine.prefill(7, ids, total, chunk=512)   # the first 512 tokens; None: more to come
    while (logits := engine.resume(7, chunk=512)) is None: ...
    engine.fork(7, 8)                          # sequence 8: 7's prompt, its blocks shared

A prefill with ``every=True`` (scoring a prompt: each token's log-probability given those
before it) returns the logits of every prompt token it computed, [tokens, vocab], chunk by chunk
(``pending`` says when the prompt is done), and so reuses no cached block: a token served from
the cache was never computed here, and has no logits. Its blocks are cached as any others.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
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
from archc.runtime.eager import EagerContext, EagerSession, PagedPool, RecurrentState, run_graph
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
    ids: list[int]          # its tokens: those in the cache, then the prompt's still to prefill
    hashes: list[bytes]     # the chained hash of each of its full blocks, in order
    every: bool = False     # its prefill returns the logits of every prompt token
    state: RecurrentState | None = None     # its state slot (a recurrent model's)


@dataclass
class PrefixStats:
    """What the prefix cache found, summed over prefills: prompt tokens and full prompt blocks
    looked up, and those found cached (not computed)."""

    query_tokens: int = 0
    hit_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of a full block: of the hash of the block before it (b"" for the
    first) and its token ids, so that it names every token of the prefix it ends."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def _whole(value: Any, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise EngineError(f"{what} must be an integer ≥ {least}, got {value!r}")
    return value


def recurrent_ops(program: Program) -> list[str]:
    """The recurrent mixers of a program (none for a pure-attention model)."""
    return sorted({n.op.value for g in program for n in g if n.op in RECURRENT})


class _SlotState(RecurrentState):
    """One sequence's state slot: its recurrent states, zeros until its first step."""

    def read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device, past: int) -> torch.Tensor:
        have = self.store.get((layer, kind))
        return torch.zeros(shape, dtype=dtype, device=device) if have is None else have


def _copy_state(state: RecurrentState | None) -> RecurrentState | None:
    """A slot of its own holding a copy of `state` (a forked sequence's)."""
    if state is None:
        return None
    copy = _SlotState()
    copy.store = {k: v.clone() for k, v in state.store.items()}
    return copy


def refuse_unservable(compiled: Compiled) -> None:
    """One clear error for a compiled model the paged engine cannot serve."""
    spec, name = compiled.spec, compiled.spec.name
    if spec.family != "decoder":
        raise EngineError(f"{name} is an {spec.family}: the paged engine serves decoder-only "
                          "models (it decodes token by token over a KV cache)")
    if (recurrent := recurrent_ops(compiled.program)) and compiled.backend != "eager":
        raise EngineError(f"{name} has recurrent mixers ({', '.join(recurrent)}): the paged "
                          "engine holds their state per sequence on the eager backend only")
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

    def run(self, inputs: Mapping[str, torch.Tensor], tokens: int, last: bool = False,
            state: RecurrentState | None = None) -> torch.Tensor:
        inputs = {k: x.to(self.device) for k, x in inputs.items()}
        ctx = EagerContext(dict(B=1, T=tokens, P=0, S=0), None,
                           _SlotState() if state is None else state, paged=self.pool)
        return run_graph(self.last if last else self.graph, self.params, inputs, ctx)["logits"]

    def copy_block(self, src: int, dst: int) -> None:
        for pool in self.pool.store.values():       # [blocks, H_kv, block_size, D]
            pool[dst] = pool[src]


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

    def copy_block(self, src: int, dst: int) -> None:
        self.session.cache.ensure(self.blocks)
        for pool in self.session.cache.store.values():     # [blocks, H_kv, block_size, D]
            pool[dst] = pool[src]


class PagedEngine:
    """A compiled decoder running many sequences over one pool of KV-cache blocks: implements
    ``archc.runtime.batch.BatchEngine``."""

    def __init__(self, compiled: Compiled, block_size: int = 16, blocks: int | None = None,
                 max_batch: int = 16, prefix_cache: bool = True) -> None:
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
        # a recurrent model's state is not blockwise: each sequence holds a state slot, and a
        # prefix of cached blocks cannot stand for the state after it, so no prefix is reused
        self.recurrent = bool(recurrent_ops(self.program))
        prefix_cache = prefix_cache and not self.recurrent
        # blocks handed out lowest first: a fresh engine's first sequence holds blocks 0, 1, …
        self._free = list(range(self.blocks_total - 1, -1, -1))
        self._seqs: dict[int, _Sequence] = {}
        # the prefix cache: a full block by its chained hash, held or idle; `_refs` counts the
        # live sequences holding each block; idle cached blocks in the order they were released
        self.prefix_cache = prefix_cache
        self.prefix_stats = PrefixStats()
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()

    # ---- the pool -------------------------------------------------------------------------

    def blocks_free(self) -> int:
        """Blocks neither held nor reserved by a live sequence (idle cached blocks included:
        the pool takes them back when it needs them)."""
        return len(self._free) + len(self._idle)

    def blocks_cached(self) -> int:
        """Blocks that hold a cached full block, held or idle."""
        return len(self._hash_of)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens holds."""
        return math.ceil(_whole(tokens, "tokens", 0) / self.block_size)

    def release(self, seq: int) -> None:
        """Sequence `seq` is done (finished or cancelled): its blocks go back to the pool; a
        cached one stays cached, idle, until the pool needs it."""
        held = self._seqs.pop(self._known(seq), None)
        assert held is not None
        # its last block first: of one sequence's blocks, the pool takes the tail first
        for block in reversed(held.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:      # its last holder
                del self._refs[block]
                if block in self._hash_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def _take(self) -> int:
        """A block for a sequence to write: a never-cached one, else the idle cached block
        released longest ago (its hash forgotten)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def _hold(self, block: int) -> None:
        self._idle.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def _lookup(self, ids: list[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks that hold the first full blocks of `ids`, and their hashes; at
        least the last token is left to compute (its logits)."""
        blocks: list[int] = []
        hashes: list[bytes] = []
        if not self.prefix_cache:
            return blocks, hashes
        for i in range((len(ids) - 1) // self.block_size):
            h = block_hash(hashes[-1] if hashes else b"",
                           ids[i * self.block_size:(i + 1) * self.block_size])
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
        return blocks, hashes

    def _index(self, held: _Sequence) -> None:
        """Its blocks filled since it was last indexed enter the prefix cache."""
        for i in range(len(held.hashes), held.length // self.block_size):
            h = block_hash(held.hashes[-1] if held.hashes else b"",
                           held.ids[i * self.block_size:(i + 1) * self.block_size])
            held.hashes.append(h)
            block = held.blocks[i]
            if self.prefix_cache and h not in self._cached and block not in self._hash_of:
                self._cached[h] = block
                self._hash_of[block] = h

    # ---- steps ----------------------------------------------------------------------------

    def prefill(self, seq: int, tokens: Sequence[int], total_tokens: int,
                chunk: int | None = None, every: bool = False) -> torch.Tensor | None:
        """Start `seq` on its prompt, reserving the blocks of `total_tokens` tokens: the logits
        of its last token, [vocab]. With `chunk`, only its first `chunk` tokens not cached are
        computed, and None says there are more (``resume``). With `every`, no cached block is
        reused and this and each ``resume`` return the logits of every token they computed,
        [tokens, vocab], more to come or not (``pending``)."""
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise EngineError(f"a sequence id is an integer, got {seq!r}")
        if seq in self._seqs:
            raise EngineError(f"sequence {seq} is already running; release it first")
        ids = self._ids(tokens, "the prompt")
        if not ids:
            raise EngineError(f"sequence {seq}: the prompt is empty")
        total = _whole(total_tokens, "total_tokens", 1)
        if chunk is not None:
            _whole(chunk, "chunk", 1)
        if total < len(ids):
            raise EngineError(f"sequence {seq}: total_tokens={total} is shorter than its "
                              f"{len(ids)}-token prompt")
        if total > self.max_seq_len:
            raise EngineError(f"sequence {seq}: total_tokens={total} exceeds "
                              + (f"max_seq_len = {self.max_seq_len}"
                                 if self.shorter_context is None else
                                 f"{self.max_seq_len}: {self.shorter_context}"))
        # cached full blocks of the prompt's prefix are held, not computed again: a sequence
        # never writes below its length, so they stay as they are
        shared, hashes = ([], []) if every else self._lookup(ids)
        need = self.blocks_for(total) - len(shared)
        if need > self.blocks_free() - sum(b in self._idle for b in shared):
            raise PoolExhausted(f"sequence {seq} needs {need} blocks of {self.block_size} "
                                f"tokens; {self.blocks_free()} of {self.blocks_total} are free")
        stats = self.prefix_stats
        if not every:       # a prompt scored whole is not looked up
            stats.query_tokens += len(ids)
            stats.query_blocks += (len(ids) - 1) // self.block_size
        stats.hit_blocks += len(shared)
        stats.hit_tokens += len(shared) * self.block_size
        for block in shared:
            self._hold(block)
        held = _Sequence(shared + [self._take() for _ in range(need)],
                         len(shared) * self.block_size, total, ids, hashes, every,
                         _SlotState() if self.recurrent else None)
        self._seqs[seq] = held
        return self.resume(seq, chunk)

    def resume(self, seq: int, chunk: int | None = None) -> torch.Tensor | None:
        """Prefill up to `chunk` more of `seq`'s prompt (None: all of it): the logits of the
        prompt's last token, [vocab], once it is all in the cache, else None; for a sequence
        prefilled with `every`, the logits of every token computed, [tokens, vocab]."""
        held = self._seqs[self._known(seq)]
        start = held.length
        if start >= len(held.ids):
            raise EngineError(f"sequence {seq} has no prompt left to prefill")
        end = len(held.ids) if chunk is None else min(len(held.ids),
                                                      start + _whole(chunk, "chunk", 1))
        try:    # the logits of the chunk's last token only, unless every token's are asked
            logits = self._step([held] * (end - start), list(range(start, end)),
                                held.ids[start:end], last=not held.every)
        except BaseException:
            self.release(seq)
            raise
        held.length = end
        self._index(held)
        if held.every:
            return logits
        return logits[-1] if end == len(held.ids) else None

    def pending(self, seq: int) -> int:
        """Prompt tokens of `seq` not yet prefilled."""
        held = self._seqs[self._known(seq)]
        return len(held.ids) - held.length

    def fork(self, parent: int, child: int) -> None:
        """Start `child` where `parent` (prefilled) stands: it holds the parent's full blocks,
        a copy of its last, partial block, and reserves the blocks of the parent's
        total_tokens. Both then decode on their own."""
        if isinstance(child, bool) or not isinstance(child, int):
            raise EngineError(f"a sequence id is an integer, got {child!r}")
        if child in self._seqs:
            raise EngineError(f"sequence {child} is already running; release it first")
        src = self._seqs[self._known(parent)]
        if src.length < len(src.ids):
            raise EngineError(f"sequence {parent} is still prefilling; fork it once it is done")
        full = src.length // self.block_size
        need = self.blocks_for(src.total) - full
        if need > self.blocks_free():
            raise PoolExhausted(f"sequence {child} needs {need} blocks of {self.block_size} "
                                f"tokens; {self.blocks_free()} of {self.blocks_total} are free")
        for block in src.blocks[:full]:
            self._hold(block)
        fresh = [self._take() for _ in range(need)]
        if src.length % self.block_size:        # the partial block: the one both will write
            self.steps.copy_block(src.blocks[full], fresh[0])
        self._seqs[child] = _Sequence(src.blocks[:full] + fresh, src.length, src.total,
                                      list(src.ids), list(src.hashes),
                                      state=_copy_state(src.state))

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
        for s, h in zip(seqs, held):
            if h.length < len(h.ids):
                raise EngineError(f"sequence {s} is still prefilling its prompt")
        logits = self._step(held, [h.length for h in held], ids)
        for h, token in zip(held, ids):
            h.ids.append(token)
            h.length += 1
            if h.length % self.block_size == 0:
                self._index(h)
        return logits

    def _step(self, rows: list[_Sequence], positions: list[int], ids: list[int], *,
              last: bool = False) -> torch.Tensor:
        """Logits [T, vocab] of T tokens, token t of sequence rows[t] at positions[t]; with
        `last` (a prefill: one sequence's tokens), of the last token only, [1, vocab]."""
        if self.recurrent:      # one sequence per step: a state runs along a step's rows
            out, start = [], 0
            for t in range(1, len(rows) + 1):
                if t == len(rows) or rows[t] is not rows[start]:
                    out.append(self._rows(rows[start:t], positions[start:t], ids[start:t],
                                          last))
                    start = t
            return torch.cat(out)
        return self._rows(rows, positions, ids, last)

    def _rows(self, rows: list[_Sequence], positions: list[int], ids: list[int],
              last: bool) -> torch.Tensor:
        table = torch.zeros(len(rows), self.table_width, dtype=torch.int32)
        for t, r in enumerate(rows):
            table[t, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        inputs = {"tokens": torch.tensor([ids]), "positions": torch.tensor(positions),
                  "block_table": table}
        if rows[0].state is None:
            return self.steps.run(inputs, len(ids), last)[0]
        return self.steps.run(inputs, len(ids), last, rows[0].state)[0]

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
