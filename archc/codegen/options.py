"""What a compile depends on besides the graph: an options object, passed explicitly."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from archc.codegen.blocks import TARGETS


@dataclass(frozen=True)
class CodegenOptions:
    target: str = "interpret"        # "gpu" (compiled) or "interpret" (Triton's CPU interpreter)
    max_seq_len: int = 2048          # KV-cache length: static, baked into cache strides
    autotune: bool = False           # on a GPU: triton.autotune over blocks.autotune_configs

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r} (known: {', '.join(TARGETS)})")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {self.max_seq_len!r}")

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)
