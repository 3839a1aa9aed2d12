"""Checkpoint tensors → archc's parameter names, with every tensor accounted for.

A `Layout` (a table of module names) and the tensors the archc program wants give the rules: which
checkpoint tensors each reads and which archc tensors they become (renamed, transposed, split out
of a fused Q/K/V, stacked over experts). All are checked before any is read: a tensor missing,
misshaped or read by no rule is an error naming it and its shapes, unless a source skips it as
outside the function archc runs (causal-mask buffers, cached RoPE frequencies, BERT's pooler).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from archc.devices import check_fits
from archc.errors import WeightsError
from archc.ir.lower import lower
from archc.model import Progress
from archc.passes.slices import rank_slices, rank_span, take_slice
from archc.quant.tensor import QTensor
from archc.runtime.weights import TORCH_DTYPES, checkpoint_shapes
from archc.spec.schema import Spec

Shape = tuple[int, ...]
Span = tuple[int, int, int]   # (dim, start, stop): elements [start, stop) of dim
Convert = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Module = str | Callable[[Spec], str]   # a checkpoint module, or the spec's choice of one
LAYER = re.compile(r"((?:encoder|decoder)\.)?layers\.(\d+)\.(.+)")
QKV = ("attn.q", "attn.k", "attn.v")
ROWS_COMPARED = 1 << 22   # elements of two tables compared at a time (`Checkpoint.differ`)


class TensorSource(Protocol):
    tensors: Mapping[str, Any]   # name → where it is stored
    def shape(self, name: str) -> Shape: ...
    def load(self, name: str) -> torch.Tensor: ...
    # the elements `span` of a tensor, reading no more of the file than they need: exactly
    # load(name) narrowed to `span` (a copy)
    def load_slice(self, name: str, span: Span) -> torch.Tensor: ...


# TensorFlow-era names, as transformers renames them on load
LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


class SafetensorsFiles:
    """Safetensors files as a TensorSource: name → (file, stored name), shapes from the headers,
    a slice read as the bytes that hold it (`get_slice`). Names are those transformers gives on
    load: TensorFlow-era `LayerNorm.gamma` is `LayerNorm.weight`."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.handles: dict[Path, Any] = {}
        self.metadata: dict[str, str] = {}      # the files' string → string metadata
        stored: dict[str, Path] = {}
        for path in files:
            try:
                self.handles[path] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise WeightsError(f"{path}: not a readable safetensors file "
                                   f"({str(err).strip() or type(err).__name__}); "
                                   "is it truncated or still downloading?") from None
            self.metadata.update(self.handles[path].metadata() or {})
            names = self.handles[path].keys()   # a safe_open handle is not a mapping
            for name in names:
                if name in stored:
                    raise WeightsError(f"checkpoint tensor {name!r} is in both "
                                       f"{stored[name].name} and {path.name}")
                stored[name] = path
        self.tensors: dict[str, tuple[Path, str]] = {}
        for name, path in stored.items():
            new = next((name[: -len(o)] + n for o, n in LEGACY.items() if name.endswith(o)), name)
            self.tensors[name if new in stored else new] = (path, name)

    def shape(self, name: str) -> Shape:
        path, stored = self.tensors[name]
        return tuple(self.handles[path].get_slice(stored).get_shape())

    def load(self, name: str) -> torch.Tensor:
        return self._read(name, lambda f, stored: f.get_tensor(stored))

    def load_slice(self, name: str, span: Span) -> torch.Tensor:
        dim, start, stop = span
        return self._read(name, lambda f, stored: f.get_slice(stored)[
            (slice(None),) * dim + (slice(start, stop),)])

    def _read(self, name: str, read: Callable[[Any, str], torch.Tensor]) -> torch.Tensor:
        path, stored = self.tensors[name]
        try:
            return read(self.handles[path], stored)
        except Exception as err:
            raise WeightsError(f"{path}: cannot read tensor {stored!r} "
                               f"({str(err).strip() or type(err).__name__}); "
                               "is the file truncated?") from None


@dataclass(frozen=True)
class Part:
    """What a tensor-parallel rank reads for one rule: each checkpoint tensor read and the span
    read of it (None: whole), and the convert of what was read into the rank's slice of each
    target."""

    reads: tuple[tuple[str, Span | None], ...]
    convert: Convert


# the spans a rank keeps of a rule's targets (a target absent: kept whole) → what to read for
# them; None where the cut cannot be mapped back through the rule's convert
Narrow = Callable[[Mapping[str, Span]], Part | None]


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]       # checkpoint tensors read
    shapes: tuple[Shape, ...]      # the shape each must have
    targets: tuple[str, ...]       # archc tensors produced
    convert: Convert               # sources → targets, in order
    # how a rank reads only its slices. None: the sources are read whole, converted and then
    # cut — the rules a special layout adds without one: Mamba's depthwise conv (squeezed)
    # and Jamba's fused expert gate_up, both of models the shard pass refuses (recurrent
    # mixers), so never cut
    narrow: Narrow | None = None


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
                sources = [name.format(e=e) for e in range(experts)]
                self.add(sources, [tuple(shape)] * experts, [target], _stack,
                         narrow=lambda spans, s=sources, t=target: _narrow_stack(s, t, spans))
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
            convert: Convert, narrow: Narrow | None = None) -> None:
        self.rules.append(Rule(tuple(sources), tuple(shapes), tuple(targets), convert, narrow))

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
        self.add([source], [full[::-1] if transpose else full], targets,
                 _fused(parts, rest, groups, transpose),
                 lambda spans: _narrow_fused(source, targets, parts, rest, groups, transpose,
                                             spans))

    def name(self, target: str) -> str:
        """Where the checkpoint keeps archc tensor `target`: its longest dotted prefix, less the
        layer, replaced by its module in `layout.names` (`attn.q` → `self_attn.q_proj`: so
        `layers.3.attn.q.bias` is `model.layers.3.self_attn.q_proj.bias`). T5's layer names keep
        their stack (`decoder.ffn_norm`), since its two stacks differ. A tensor no module names
        is kept under its own name (`OWN_NAMES` names none)."""
        layer = LAYER.fullmatch(target)
        stack, i, rest = layer.groups("") if layer else ("", "", target)
        key = stack + rest
        names = self.layout.names
        module = max((m for m in names if key == m or key.startswith(m + ".")), key=len,
                     default=None)
        if module is None:          # kept under archc's own name
            return self.ckpt(target)
        value = names[module]
        within = self.layout.layer.format(stack=stack, i=i) if layer else ""
        return self.ckpt(within + (value if isinstance(value, str) else value(self.spec))
                         + key[len(module):])


def _stack(xs: list[Any]) -> list[Any]:
    """Experts' tensors → one [experts, ...] (a quantized weight stays quantized)."""
    return [QTensor.stack(xs) if isinstance(xs[0], QTensor) else torch.stack(xs)]


def _narrow_stack(sources: Sequence[str], target: str, spans: Mapping[str, Span]) -> Part:
    """A rank's slice of experts stacked from one tensor each: a cut of the experts is the
    tensors of those experts, a cut within them the same span of each (one dim down)."""
    dim, start, stop = spans[target]
    if dim == 0:
        return Part(tuple((s, None) for s in sources[start:stop]), _stack)
    return Part(tuple((s, (dim - 1, start, stop)) for s in sources), _stack)


def _fused(parts: Sequence[int], rest: Shape, groups: int, transpose: bool) -> Convert:
    """One tensor [groups · Σ parts, *rest] (after `transpose`) → its targets, target i of
    [groups · parts[i], *rest]: see `TensorMap.split`."""
    def convert(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(xs[0], QTensor) and len(parts) == 1 and not transpose:
            return xs   # a rename: a quantized weight moves as it is
        x = (xs[0].t() if transpose else xs[0]).reshape(groups, sum(parts), *rest)
        return [p.reshape(groups * n, *rest).contiguous()    # (groups, Σ parts, ...)
                for p, n in zip(x.split(parts, dim=1), parts)]
    return convert


def _own(xs: list[torch.Tensor], transpose: bool) -> list[torch.Tensor]:
    """Tensors read apart, one per target: each its own contiguous copy, transposed as
    `TensorMap.split` transposes."""
    return [x if isinstance(x, QTensor) else (x.t() if transpose else x).contiguous()
            for x in xs]


def _narrow_fused(source: str, targets: Sequence[str], parts: Sequence[int], rest: Shape,
                  groups: int, transpose: bool, spans: Mapping[str, Span]) -> Part | None:
    """A rank's slices of the targets `TensorMap.split` cuts out of one tensor, mapped back to
    the rows of that tensor (its columns, when stored transposed).

    1. A plain rename: the target's span, on the stored dim it came from.
    2. Fused targets: target i's rows lie in `groups` runs of parts[i] rows, one in each
       repeat of [part 0 | part 1 | ...]. A span of target i's rows is read run by run — the
       part of each run it covers, a contiguous piece of the tensor — and the pieces joined
       in order: the rank reads its rows of each target and nothing else, however the span
       falls on the repeats (a KV group's queries split over ranks that share its K and V).
    A span along any other dim of a fused tensor (which the shard pass never makes) is read
    whole."""
    def stored(dim: int) -> int:    # the dim of the tensor as stored
        return 1 - dim if transpose else dim
    if len(targets) == 1 and groups == 1:
        dim, start, stop = spans[targets[0]]
        return Part(((source, (stored(dim), start, stop)),), lambda xs: _own(xs, transpose))
    rows = [spans.get(t, (0, 0, groups * n)) for t, n in zip(targets, parts)]
    if any(dim != 0 for dim, _, _ in rows):
        return None
    repeat = sum(parts)
    reads: list[tuple[str, Span | None]] = []
    pieces: list[int] = []   # how many pieces each target is read in
    for i, ((_, start, stop), n) in enumerate(zip(rows, parts)):
        offset = sum(parts[:i])
        runs = [(g * repeat + offset + max(start - g * n, 0),
                 g * repeat + offset + min(stop - g * n, n))
                for g in range(start // n, -(-stop // n))]   # the repeats the span touches
        reads += [(source, (stored(0), lo, hi)) for lo, hi in runs]
        pieces.append(len(runs))

    def convert(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        out, first = [], 0
        for count in pieces:
            got = _own(xs[first:first + count], transpose)
            join = QTensor.cat if isinstance(got[0], QTensor) else torch.cat
            out.append(got[0] if count == 1 else join(got))
            first += count
        return out
    return Part(tuple(reads), convert)


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
        shape = self.source.shape(a)
        if self.source.shape(b) != shape:
            return True
        # compared a run of rows at a time: a tensor-parallel rank holds no whole table
        step = max(1, ROWS_COMPARED // max(1, math.prod(shape[1:])))
        return any(not torch.equal(self.source.load_slice(a, span), self.source.load_slice(b, span))
                   for span in ((0, i, min(i + step, shape[0])) for i in range(0, shape[0], step)))


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


# archc's own tensor names: its checkpoint directories and quantized files
OWN_NAMES = Layout(names={}, head=("head",))


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
    sharded over tp ranks reads through ``shard()`` (``archc.passes.slices``), each tensor
    read, cut and let go in turn, so the whole checkpoint is never held. The cuts are those of
    the program with the weights the source holds quantized: a quantized weight that does not
    split along K on whole groups is refused by the shard pass, naming the field."""
    program = lower(spec, quant=quant or {})
    tp = shard[0] if shard is not None else 1      # a rank prices only its slices
    check_fits(spec, program, dtype or spec.dtype, quant=quant, tp=tp)
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
    cuts = rank_slices(program, shard[0]) if shard is not None else {}
    out: dict[str, torch.Tensor] = {}
    for done, rule in enumerate(tmap.rules):
        values = _read_rule(source, rule, cuts, tmap.want, shard[1] if shard else 0) \
            if rule.targets else []
        for target, value in zip(rule.targets, values):
            keep = dtype is None or isinstance(value, QTensor)   # quantized: as stored
            out[target] = value if keep else value.to(TORCH_DTYPES[dtype])
        if progress is not None:
            progress(done + 1, len(tmap.rules))
    return out, skipped


def _read_rule(source: TensorSource, rule: Rule, cuts: Mapping[str, tuple[int, int, int]],
               want: Mapping[str, Shape], rank: int) -> list[torch.Tensor]:
    """The targets of `rule`, each cut to tensor-parallel rank `rank`'s slice where `cuts`
    has one: read as slices of the sources where the rule maps the cut back through its
    convert, else read whole, converted and cut (the whole tensors let go in turn)."""
    spans = {t: rank_span(cuts[t], want[t][cuts[t][0]], rank)
             for t in rule.targets if t in cuts}
    part = rule.narrow(spans) if spans and rule.narrow is not None else None
    if part is None:
        values = rule.convert([source.load(n) for n in rule.sources])
        return [take_slice(v, cuts[t], rank) if t in cuts else v
                for t, v in zip(rule.targets, values)]
    return part.convert([source.load(n) if span is None else source.load_slice(n, span)
                         for n, span in part.reads])
