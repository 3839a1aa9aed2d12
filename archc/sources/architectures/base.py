"""What one Hugging Face architecture tells the loader: how its config becomes a spec, where its
checkpoint keeps each archc tensor, which config fields are known not to matter, and which
checkpoint tensors lie outside the function archc runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from archc.sources.hf_config import HFConfig, dtype_name
from archc.sources.tensor_map import Checkpoint, Layout


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    # config (and checkpoint) → spec sections; a None value is a field left to its default
    spec: Callable[[HFConfig, Checkpoint], dict[str, Any]]
    layout: Layout
    tied: bool | None = False       # tie_word_embeddings' default; None: `spec` decides
    # config fields with the only values archc honours (absent: the first)
    only: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    inert: frozenset[str] = frozenset()   # config fields known not to change the function
    skip: tuple[str, ...] = ()            # checkpoint tensors outside the function (regexes)
    prefixes: tuple[str, ...] = ()        # what task classes put before base-model names


def spec_data(arch: Architecture, cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    """The spec mapping of an HF config. The head is tied as transformers decides: by the
    config's `tie_word_embeddings`, unless the checkpoint holds a head that differs from the
    embedding (then the stored head is used)."""
    for key, allowed in arch.only.items():
        cfg.expect(key, allowed)
    data = {"vocab_size": cfg.number("vocab_size"), "dtype": dtype_name(cfg),
            **arch.spec(cfg, ckpt)}
    if arch.tied is not None:
        head = f"{arch.layout.head_name(ckpt)}.weight"
        embed = ckpt(f"{arch.layout.names['embed']}.weight")
        tied = cfg.flag("tie_word_embeddings", arch.tied) and not ckpt.differ(head, embed)
        data.setdefault("embedding", {})["tied"] = tied
    return _given(data)


def _given(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _given(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def layer_pattern(kinds: Sequence[str]) -> list[str]:
    """The shortest prefix of per-layer kinds that repeats to all of them (spec's
    `attention.pattern` repeats over the layers)."""
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
    return list(kinds[:period])
