"""Checkpoint tensors → archc's parameter names, with every tensor accounted for.

A `Layout` (a table of module names) and the tensors the archc program wants give the rules: which
checkpoint tensors each reads and which archc tensors they become (renamed, transposed, split out
of a fused Q/K/V, stacked over experts). All are checked before any is read: a tensor missing,
misshaped or read by no rule is an error naming it and its shapes, unless a source skips it as
outside the function archc runs (causal-mask buffers, cached RoPE frequencies, BERT's pooler).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from archc.devices import check_fits, checkpoint_elements, quantized_bytes
from archc.errors import WeightsError
from archc.ir.lower import lower
from archc.model import Progress
from archc.quant.tensor import QTensor
from archc.runtime.weights import TORCH_DTYPES, checkpoint_shapes
from archc.spec.schema import Spec

Shape = tuple[int, ...]
Convert = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Module = str | Callable[[Spec], str]   # a checkpoint module, or the spec's choice of one
LAYER = re.compile(r"((?:encoder|decoder)\.)?layers\.(\d+)\.(.+)")
QKV = ("attn.q", "attn.k", "attn.v")


class TensorSource(Protocol):
    tensors: Mapping[str, Any]   # name → where it is stored
    def shape(self, name: str) -> Shape: ...
    def load(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]       # checkpoint tensors read
    shapes: tuple[Shape, ...]      # the shape each must have
    targets: tuple[str, ...]       # archc tensors produced
    convert: Convert               # sources → targets, in order


class TensorMap:
    """The rules that read checkpoint `ckpt`, laid out by `layout`, into the tensors the program
    of `spec` wants (`want`: name → shape): one for each. Several tensors under one checkpoint
    name are a fused Q/K/V; `{e}` in a name numbers one tensor per expert. The head is outside the
    base model; a tied one may be stored all the same, as a copy."""

    def __init__(self, layout: Layout, spec: Spec, ckpt: Checkpoint,
                 want: dict[str, Shape]) -> None:
        self.layout, self.spec, self.ckpt, self.want = layout, spec, ckpt, want
        self.rules: list[Rule] = []
        if layout.special is not None:
            layout.special(self)
        done = {target for rule in self.rules for target in rule.targets}
        head = layout.head_name(ckpt)
        fused: dict[str, list[str]] = {}
        for target in [x for x in want if x not in done]:
            name = head + target[4:] if target in ("head.weight", "head.bias") else \
                self.name(target)
            if "{e}" in name:   # one tensor per expert → archc's [experts, ...]
                experts, *shape = want[target]
                self.add([name.format(e=e) for e in range(experts)], [tuple(shape)] * experts,
                         [target], lambda xs: [QTensor.stack(xs) if isinstance(xs[0], QTensor)
                                               else torch.stack(xs)])
            else:
                fused.setdefault(name, []).append(target)
        for name, targets in fused.items():
            self.split(name, targets, groups=layout.groups(spec) if len(targets) > 1 else 1,
                       transpose=layout.conv1d and bool(LAYER.fullmatch(targets[0]))
                       and len(want[targets[0]]) == 2)
        for name in layout.copies + ((f"{head}.weight",) if spec.embedding.tied else ()):
            if name in ckpt.names:   # checked, not read
                self.add([name], [want["embed.weight"]], [], lambda xs: [])

    def add(self, sources: Sequence[str], shapes: Sequence[Shape], targets: Sequence[str],
            convert: Convert) -> None:
        self.rules.append(Rule(tuple(sources), tuple(shapes), tuple(targets), convert))

    def split(self, source: str, targets: Sequence[str], *, groups: int = 1,
              transpose: bool = False) -> None:
        """One tensor holding `targets` along dim 0 (after `transpose`: GPT-2's Conv1D stores
        [in, out], archc [out, in]) in `groups` repeats of [part of target 0 | part of target 1
        | ...]. One target is a plain rename; several are a fused Q/K/V: groups = 1 is a plain
        concatenation (GPT-2, MPT), groups = heads interleaves per head (BLOOM, GPT-NeoX),
        groups = KV heads puts a GQA group's queries before its key and value (Falcon)."""
        rest = self.want[targets[0]][1:]
        parts = [self.want[t][0] // groups for t in targets]
        full = (sum(parts) * groups, *rest)

        def convert(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            if isinstance(xs[0], QTensor) and len(targets) == 1 and not transpose:
                return xs   # a rename: a quantized weight moves as it is
            x = (xs[0].t() if transpose else xs[0]).reshape(groups, sum(parts), *rest)
            return [p.reshape(groups * n, *rest).contiguous()    # (groups, Σ parts, ...)
                    for p, n in zip(x.split(parts, dim=1), parts)]

        self.add([source], [full[::-1] if transpose else full], targets, convert)

    def name(self, target: str) -> str:
        """Where the checkpoint keeps archc tensor `target`: its longest dotted prefix, less the
        layer, replaced by its module in `layout.names` (`attn.q` → `self_attn.q_proj`: so
        `layers.3.attn.q.bias` is `model.layers.3.self_attn.q_proj.bias`). T5's layer names keep
        their stack (`decoder.ffn_norm`), since its two stacks differ."""
        layer = LAYER.fullmatch(target)
        stack, i, rest = layer.groups("") if layer else ("", "", target)
        key = stack + rest
        names = self.layout.names
        module = max((m for m in names if key == m or key.startswith(m + ".")), key=len)
        value = names[module]
        within = self.layout.layer.format(stack=stack, i=i) if layer else ""
        return self.ckpt(within + (value if isinstance(value, str) else value(self.spec))
                         + key[len(module):])


class Checkpoint:
    """Checkpoint tensor names, with the prefix a task class adds (``model.``, ``bert.``), read off
    the token embedding's name `embed`, that base-model names take. No source: no weights."""

    def __init__(self, source: TensorSource | None, embed: str = "") -> None:
        self.source = source
        self.names = set(source.tensors) if source else set()
        tail = f"{embed}.weight"
        self.prefix = min((n[: -len(tail)] for n in self.names if n.endswith("." + tail)),
                          default="")

    def __call__(self, name: str) -> str:   # base-model name → checkpoint name
        return self.prefix + name

    def differ(self, a: str, b: str) -> bool:
        """Does the checkpoint hold both tensors, and are they different?"""
        if self.source is None or a not in self.names or b not in self.names:
            return False
        return self.source.shape(a) != self.source.shape(b) or not torch.equal(
            self.source.load(a), self.source.load(b))


def each(mine: str, theirs: str, parts: str) -> dict[str, str]:
    """Table entries for several parts alike: each("attn.*", "self_attn.*_proj", "q k v")."""
    return {mine.replace("*", p): theirs.replace("*", p) for p in parts.split()}


@dataclass(frozen=True)
class Layout:
    """Where a checkpoint keeps each archc tensor (see `TensorMap.name`)."""

    names: Mapping[str, Module]           # archc module → checkpoint module
    layer: str = "layers.{i}."            # layer i's modules ({stack}: T5's encoder./decoder.)
    head: tuple[str, ...] = ("lm_head",)  # the output head's spellings, the first found is read
    groups: Callable[[Spec], int] = lambda s: 1   # the repeats of a fused Q/K/V (`split`)
    conv1d: bool = False                  # layer weights stored [in, out] (GPT-2's Conv1D)
    copies: tuple[str, ...] = ()          # stored copies of the token embedding, checked
    # rules for the tensors a table cannot describe, added before the table maps the rest
    special: Callable[[TensorMap], None] | None = None

    def head_name(self, ckpt: Checkpoint) -> str:
        return next((h for h in self.head if f"{h}.weight" in ckpt.names), self.head[0])


def read_checkpoint(spec: Spec, ckpt: Checkpoint, layout: Layout, *, skip: Sequence[str] = (),
                    progress: Progress | None = None,
                    dtype: str | None = None, quant: dict[str, str] | None = None,
                    shard: tuple[int, int] | None = None,
                    ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The archc checkpoint of `spec`, read by the rules of `layout`, each tensor cast to `dtype`
    (if given) as it is read, except those the source reads quantized (`quant`: archc tensor →
    scheme, which prices them at their scheme's bytes); its bytes are priced against the memory
    free first. Returns it and the names of the checkpoint tensors skipped (matched by `skip`).
    `shard` (tp, rank): keep only tensor-parallel rank `rank`'s slice of each tensor the program
    sharded over tp ranks reads through ``shard()`` (``archc.dist.rank_slices``), each tensor
    read, cut and let go in turn, so the whole checkpoint is never held."""
    program = lower(spec)
    tp = shard[0] if shard is not None else 1      # a rank prices only its slices
    check_fits(spec.name, "its weights" if tp == 1 else f"its weights' slices for 1 of {tp} ranks",
               checkpoint_elements(program, quant, tp), dtype or spec.dtype, spec.family,
               quantized=quantized_bytes(program, quant or {}, tp))
    tmap = TensorMap(layout, spec, ckpt, checkpoint_shapes(program))
    source, present = ckpt.source, ckpt.names
    for rule in tmap.rules:  # check everything before reading anything
        for name, shape in zip(rule.sources, rule.shapes):
            if name not in present:
                raise WeightsError(f"checkpoint tensor {name!r} is missing (expected shape "
                                   f"{list(shape)}, for archc's {', '.join(rule.targets)})")
            if source.shape(name) != shape:
                raise WeightsError(f"checkpoint tensor {name!r} has shape "
                                   f"{list(source.shape(name))}, expected {list(shape)}")
    read = {name for rule in tmap.rules for name in rule.sources}
    skipped = sorted(n for n in present - read if any(re.fullmatch(p, n) for p in skip))
    unexpected = sorted(present - read - set(skipped))
    if unexpected:
        shown = ", ".join(f"{n!r} {list(source.shape(n))}" for n in unexpected[:3])
        more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
        raise WeightsError(f"checkpoint has tensors the model does not use: {shown}{more}")
    cuts: dict[str, tuple[int, int, int]] = {}
    if shard is not None:
        from archc.dist import rank_slices
        from archc.passes.shard import shard_program
        cuts = rank_slices(shard_program(program, shard[0]))
    out: dict[str, torch.Tensor] = {}
    for done, rule in enumerate(tmap.rules):
        values = rule.convert([source.load(n) for n in rule.sources]) if rule.targets else []
        for target, value in zip(rule.targets, values):
            if target in cuts:   # the rank's part, kept; the whole tensor is let go
                from archc.dist import take_slice
                value = take_slice(value, cuts[target], shard[1])  # type: ignore[index]
            keep = dtype is None or isinstance(value, QTensor)   # quantized: as stored
            out[target] = value if keep else value.to(TORCH_DTYPES[dtype])
        if progress is not None:
            progress(done + 1, len(tmap.rules))
    return out, skipped
