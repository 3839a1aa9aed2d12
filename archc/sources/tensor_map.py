"""Checkpoint tensors → archc's parameter names, with every tensor accounted for.

An architecture describes its checkpoint as a list of rules: which checkpoint tensors it reads and
which archc tensors they become (renamed, transposed, split out of a fused Q/K/V, stacked over
experts). Applying the rules checks each tensor before converting it: a missing tensor, a tensor
of the wrong shape, or a tensor no rule reads is an error naming it with the expected and found
shapes. A few tensors are known to lie outside the function archc runs (causal-mask buffers,
cached RoPE frequencies, task heads such as BERT's pooler); an architecture lists them as patterns
to skip, and the loader reports what it skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from archc.errors import WeightsError
from archc.runtime.weights import TORCH_DTYPES

Shape = tuple[int, ...]
Convert = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Progress = Callable[[int, int], None]


class TensorSource(Protocol):
    def names(self) -> list[str]: ...

    def shape(self, name: str) -> Shape: ...

    def load(self, name: str) -> torch.Tensor: ...


class LegacyNames:
    """A source under the names transformers gives old checkpoints on load: TensorFlow-era
    `LayerNorm.gamma` / `LayerNorm.beta` are `LayerNorm.weight` / `LayerNorm.bias`."""

    RENAMES = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        stored = source.names()
        present = set(stored)
        self.original: dict[str, str] = {}
        for name in stored:
            new = name
            for old, replacement in self.RENAMES:
                if name.endswith(old):
                    new = name[: -len(old)] + replacement
            self.original[new if new not in present else name] = name

    def names(self) -> list[str]:
        return list(self.original)

    def shape(self, name: str) -> Shape:
        return self.source.shape(self.original[name])

    def load(self, name: str) -> torch.Tensor:
        return self.source.load(self.original[name])


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]       # checkpoint tensors read
    shapes: tuple[Shape, ...]      # the shape each must have
    targets: tuple[str, ...]       # archc tensors produced
    convert: Convert               # sources → targets, in order


class TensorMap:
    """Builds the rules of one checkpoint against the shapes the archc program expects."""

    def __init__(self, want: Mapping[str, Shape]) -> None:
        self.want = dict(want)
        self.rules: list[Rule] = []

    def _shape(self, target: str) -> Shape:
        if target not in self.want:  # a mapper bug: it names a tensor the program lacks
            raise KeyError(f"the archc program has no tensor {target!r}")
        return self.want[target]

    def rename(self, source: str, target: str) -> None:
        """Same layout, new name."""
        self.rules.append(Rule((source,), (self._shape(target),), (target,), lambda xs: xs))

    def transposed(self, source: str, target: str) -> None:
        """Stored [in, out] (GPT-2's Conv1D); archc keeps matmul weights [out, in]."""
        shape = self._shape(target)
        self.rules.append(Rule((source,), (shape[::-1],), (target,),
                               lambda xs: [xs[0].t().contiguous()]))

    def fused(self, source: str, targets: Sequence[str], *, groups: int = 1,
              transpose: bool = False) -> None:
        """One tensor holding several along dim 0 (after `transpose`), in `groups` repeats of
        [part of target 0 | part of target 1 | ...] — a fused Q/K/V projection. groups = 1 is a
        plain concatenation (GPT-2, MPT); groups = heads interleaves per head (BLOOM, GPT-NeoX);
        groups = KV heads puts a GQA group's queries before its key and value (Falcon)."""
        shapes = [self._shape(t) for t in targets]
        rest = shapes[0][1:]
        if any(s[1:] != rest or s[0] % groups for s in shapes):
            raise ValueError(f"cannot fuse {list(targets)} in {groups} groups")
        parts = [s[0] // groups for s in shapes]
        full: Shape = (sum(s[0] for s in shapes), *rest)

        def split(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            x = xs[0].t() if transpose else xs[0]
            x = x.reshape(groups, sum(parts), *rest)                # (groups, Σ parts, ...)
            return [p.reshape(groups * n, *rest).contiguous()
                    for p, n in zip(x.split(parts, dim=1), parts)]

        self.rules.append(Rule((source,), (full[::-1] if transpose else full,), tuple(targets),
                               split))

    def stacked(self, sources: Sequence[str], target: str) -> None:
        """One tensor per expert → archc's [experts, ...] tensor."""
        shape = self._shape(target)
        if len(sources) != shape[0]:
            raise ValueError(f"{len(sources)} tensors for {target} of shape {shape}")
        self.rules.append(Rule(tuple(sources), (shape[1:],) * len(sources), (target,),
                               lambda xs: [torch.stack(xs)]))

    def duplicate(self, source: str, of: str) -> None:
        """A stored copy of archc tensor `of` (a tied head saved next to the embedding): checked,
        not read."""
        self.rules.append(Rule((source,), (self._shape(of),), (), lambda xs: []))

    def custom(self, sources: Sequence[str], shapes: Sequence[Shape], targets: Sequence[str],
               convert: Convert) -> None:
        self.rules.append(Rule(tuple(sources), tuple(shapes), tuple(targets), convert))


def _show(shape: Iterable[int]) -> str:
    return str(list(shape))


def apply_rules(source: TensorSource, tmap: TensorMap, *, skip: Sequence[str] = (),
                progress: Progress | None = None,
                dtype: str | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Read and convert every tensor the rules name (cast to `dtype`, if given, as each is
    read). Returns archc's checkpoint and the names of the checkpoint tensors skipped (matched
    by a `skip` pattern)."""
    present = set(source.names())
    read: set[str] = set()
    for rule in tmap.rules:  # check everything before reading anything
        for name, shape in zip(rule.sources, rule.shapes):
            if name not in present:
                raise WeightsError(f"checkpoint tensor {name!r} is missing (expected shape "
                                   f"{_show(shape)}, for archc's {', '.join(rule.targets)})")
            found = source.shape(name)
            if found != shape:
                raise WeightsError(f"checkpoint tensor {name!r} has shape {_show(found)}, "
                                   f"expected {_show(shape)}")
            read.add(name)
    patterns = [re.compile(p) for p in skip]
    skipped = sorted(n for n in present - read if any(p.fullmatch(n) for p in patterns))
    unexpected = sorted(present - read - set(skipped))
    if unexpected:
        shown = ", ".join(f"{n!r} {_show(source.shape(n))}" for n in unexpected[:3])
        more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
        raise WeightsError(f"checkpoint has tensors the model does not use: {shown}{more}")
    out: dict[str, torch.Tensor] = {}
    for done, rule in enumerate(tmap.rules):
        values = rule.convert([source.load(n) for n in rule.sources]) if rule.targets else []
        for target, value in zip(rule.targets, values):
            want = tmap.want[target]
            if tuple(value.shape) != want:  # a rule bug, not a user error
                raise AssertionError(f"{rule.sources} gave {target} shape {list(value.shape)}, "
                                     f"expected {list(want)}")
            out[target] = value if dtype is None else value.to(TORCH_DTYPES[dtype])
        if progress is not None:
            progress(done + 1, len(tmap.rules))
    return out, skipped
