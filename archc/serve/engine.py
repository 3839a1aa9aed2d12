"""Where the server gets its batch engine: the one function every caller (the command, the
benchmark, the tests) goes through."""

from __future__ import annotations

from typing import Any

from archc.errors import ArchcError
from archc.runtime.batch import BatchEngine


def engine_for(compiled: Any, *, max_batch: int = 16, block_size: int = 16,
               blocks: int | None = None, prefix_cache: bool = True) -> BatchEngine:
    """The batch engine of `compiled` (a ``CompiledModel``): up to `max_batch` rows a decode step,
    KV-cache blocks of `block_size` tokens, a pool of `blocks` blocks (None: the engine's
    default); prefix_cache: full KV blocks of finished requests stay cached for later
    prompts."""
    make = getattr(compiled, "engine", None)
    if make is None:
        raise ArchcError(f"the {compiled.backend} backend has no batch engine, so "
                         f"{compiled.spec.name} cannot be served")
    return make(block_size=block_size, blocks=blocks, max_batch=max_batch,
                prefix_cache=prefix_cache)
