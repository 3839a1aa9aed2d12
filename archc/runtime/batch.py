"""Many sequences decoding together: what a server's scheduler drives.

    engine = archc.load("tiny-llama3").compile("eager").engine(block_size=16)
    logits = engine.prefill(7, prompt_ids, total_tokens=len(prompt_ids) + 32)   # [vocab]
    logits = engine.decode([7, 9], [next_7, next_9])                            # [2, vocab]
    engine.release(7)

Sequences are named by the caller's integer ids. Each holds blocks of ``block_size`` tokens of
the KV cache, from one pool of ``blocks_total`` blocks; a sequence reserves, when it starts, the
blocks it can ever need (``total_tokens``), so a running sequence never waits for memory. The
rows of one ``decode`` call may have any past lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from archc.errors import ArchcError


class PoolExhausted(ArchcError):
    """The KV-cache pool has too few free blocks for a sequence: wait for others to finish."""


class BatchEngine(Protocol):
    """A compiled model running many sequences over one pool of KV-cache blocks."""

    block_size: int          # tokens per block
    blocks_total: int        # blocks in the pool
    max_batch: int           # rows one decode call may hold
    max_seq_len: int         # tokens one sequence may reach
    shorter_context: str | None   # why max_seq_len is below the model's (None: it is not)

    def blocks_free(self) -> int:
        """Blocks neither held nor reserved by a live sequence."""
        ...

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens holds."""
        ...

    def prefill(self, seq: int, tokens: Sequence[int], total_tokens: int,
                chunk: int | None = None, every: bool = False) -> torch.Tensor | None:
        """Start sequence `seq` on its prompt `tokens`, reserving the blocks of `total_tokens`
        tokens (prompt and every token it may generate): the logits of its last token, [vocab].
        With `chunk`, at most `chunk` prompt tokens are computed, and None says more are left
        (``resume``). With `every`, the prompt is computed whole (no cached prefix reused) and
        this and each ``resume`` return the logits of every token they computed,
        [tokens, vocab], whether or not more are left (``pending`` says). Raises PoolExhausted
        when the pool cannot reserve them, ArchcError for a known `seq` or a `total_tokens` past
        max_seq_len."""
        ...

    def resume(self, seq: int, chunk: int | None = None) -> torch.Tensor | None:
        """Prefill up to `chunk` more tokens of `seq`'s prompt (None: all): its last token's
        logits [vocab] once the prompt is all in the cache, else None."""
        ...

    def pending(self, seq: int) -> int:
        """Prompt tokens of `seq` not yet prefilled."""
        ...

    def fork(self, parent: int, child: int) -> None:
        """Start `child` where the prefilled `parent` stands, sharing its KV blocks (a copy of
        the last, partial one), with the blocks of the parent's total_tokens reserved."""
        ...

    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One step of each live sequence in `seqs`, fed its next token (`tokens`, in the same
        order): logits [len(seqs), vocab]. The rows may have any past lengths."""
        ...

    def release(self, seq: int) -> None:
        """Sequence `seq` is done (finished or cancelled): its blocks go back to the pool."""
        ...
