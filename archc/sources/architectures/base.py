"""What one Hugging Face architecture tells the loader: how its config becomes a spec, how its
checkpoint tensors become archc's, which config fields are known not to matter, and which
checkpoint tensors lie outside the function archc runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from archc.sources.hf_config import HFConfig
from archc.sources.tensor_map import TensorMap, TensorSource
from archc.spec.schema import Spec

SpecFn = Callable[[HFConfig, "Checkpoint"], dict[str, Any]]
TensorsFn = Callable[[Spec, TensorMap, "Checkpoint"], None]


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    spec: SpecFn            # config (+ checkpoint names, for tying and prefixes) → spec mapping
    tensors: TensorsFn      # adds the rules mapping checkpoint tensors to archc's
    inert: frozenset[str] = frozenset()   # config fields known not to change the function
    skip: tuple[str, ...] = ()            # checkpoint tensors outside the function (regexes)
    prefixes: tuple[str, ...] = ()        # what task classes put before base-model names


class Checkpoint:
    """Checkpoint tensor names, with the prefix a task class adds (``model.``, ``bert.``)
    resolved, so mappers name tensors as the base model does."""

    def __init__(self, source: TensorSource, prefixes: Sequence[str] = ()) -> None:
        self.source = source
        self.names = set(source.names())
        self.prefix = ""
        for p in prefixes:
            if any(n.startswith(p) for n in self.names):
                self.prefix = p
                break

    def __call__(self, name: str) -> str:
        """The full checkpoint name of base-model tensor `name`."""
        return self.prefix + name

    def has(self, name: str, *, base: bool = True) -> bool:
        return (self.prefix + name if base else name) in self.names

    def tensor(self, name: str) -> torch.Tensor:
        return self.source.load(name)

    def head_is_tied(self, cfg: HFConfig, head: str, embed: str, *, default: bool) -> bool:
        """Does the output head reuse the token embedding? As transformers decides: the config's
        `tie_word_embeddings`, unless the checkpoint holds a head that differs from the
        embedding (then the stored head is used)."""
        tied = cfg.flag("tie_word_embeddings", default)
        if not (tied and head in self.names and embed in self.names):
            return tied
        if self.source.shape(head) != self.source.shape(embed):
            return False
        return bool(torch.equal(self.source.load(head), self.source.load(embed)))


def output_head(s: Spec, t: TensorMap, ckpt: Checkpoint, head: str = "lm_head.weight") -> None:
    """The output head: its own tensor when untied; when tied, a stored copy of the embedding
    (some exporters write one) maps onto the embedding, which the tensor map checks equal."""
    if not s.embedding.tied:
        t.rename(head, "head.weight")
    elif ckpt.has(head, base=False):
        t.duplicate(head, "embed.weight")


def layer_pattern(kinds: Sequence[str]) -> list[str]:
    """The shortest prefix of per-layer kinds that repeats to all of them (spec's
    `attention.pattern` repeats over the layers)."""
    n = len(kinds)
    for period in range(1, n + 1):
        if all(kinds[i] == kinds[i % period] for i in range(n)):
            return list(kinds[:period])
    return list(kinds)
