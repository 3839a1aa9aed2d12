"""archc's quantized checkpoint file: one safetensors file that holds a model's spec and its
weights, quantized ones kept in their stored parts (``docs/quantized-format.md``).

A quantized tensor NAME of scheme S is stored as one safetensors tensor per part of S's planar
layout (``archc.quant.schemes``): ``NAME.q``, ``NAME.qh``, ``NAME.scale``, ``NAME.d``,
``NAME.sc``, ``NAME.min``, ``NAME.dmin``, ``NAME.mn`` — those S has. Float tensors are stored
under their own names, as they are. The safetensors metadata (string → string) holds:

- ``archc.format``: the format version, ``FORMAT_VERSION``;
- ``archc.spec``: the model's spec, as YAML text;
- ``archc.quant``: JSON, quantized tensor name → {"scheme": S, "shape": [..., N, K]};
- ``archc.source``: what the file was made from (informational).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from archc.errors import ArchcError, WeightsError
from archc.model import Model, Progress
from archc.quant.schemes import SCHEMES
from archc.quant.tensor import QTensor, Weight, part_spans
from archc.sources.tensor_map import (
    OWN_NAMES,
    Checkpoint,
    SafetensorsFiles,
    Span,
    read_checkpoint,
)
from archc.spec.load import dump_yaml, from_dict
from archc.spec.schema import Spec

FORMAT_KEY = "archc.format"
SPEC_KEY = "archc.spec"
QUANT_KEY = "archc.quant"
SOURCE_KEY = "archc.source"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"


def is_quantized_file(path: Path) -> bool:
    """Is `path` one archc reads as its quantized format? Any ``.safetensors`` path is claimed,
    so that a foreign or missing file is refused with a reason (``read_header``) rather than
    read as a spec."""
    return path.suffix.lower() == SUFFIX


def save(path: Path, spec: Spec, weights: Mapping[str, Weight], source: str = "") -> int:
    """Write `weights` (floats and QTensors) with `spec` to `path`; return the bytes of tensor
    data written."""
    from safetensors.torch import save_file
    tensors: dict[str, torch.Tensor] = {}
    quant: dict[str, dict[str, Any]] = {}
    for name, w in weights.items():
        if isinstance(w, QTensor):
            quant[name] = {"scheme": w.scheme.name, "shape": list(w.shape)}
            tensors.update({f"{name}.{p}": t.contiguous() for p, t in w.parts.items()})
    for name, w in weights.items():
        if not isinstance(w, QTensor):
            if name in tensors:    # a float tensor named like a part of a quantized one
                raise WeightsError(f"tensor {name!r} clashes with a part of quantized tensor "
                                   f"{name.rsplit('.', 1)[0]!r}")
            tensors[name] = w.contiguous()
    metadata = {FORMAT_KEY: FORMAT_VERSION, SPEC_KEY: dump_yaml(spec),
                QUANT_KEY: json.dumps(quant, sort_keys=True), SOURCE_KEY: source}
    try:
        save_file(tensors, str(path), metadata=metadata)
    except OSError as err:
        raise ArchcError(f"cannot write {path}: {err.strerror}") from None
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_header(path: Path, file: SafetensorsFiles | None = None
                ) -> tuple[Spec, dict[str, tuple[str, tuple[int, ...]]]]:
    """The spec and quantized tensors (name → (scheme, shape)) of a file (open as `file`), read
    from its metadata alone; a file that is not archc's quantized format is refused naming
    why."""
    metadata = (file or SafetensorsFiles([path])).metadata
    if FORMAT_KEY not in metadata:
        raise WeightsError(f"{path}: a safetensors file without archc's metadata (no "
                           f"{FORMAT_KEY!r} key); archc reads the files `archc quantize` "
                           "writes, or a checkpoint directory with its spec")
    if metadata[FORMAT_KEY] != FORMAT_VERSION:
        raise WeightsError(f"{path}: format version {metadata[FORMAT_KEY]!r}; this archc "
                           f"reads version {FORMAT_VERSION}")
    return _spec(path, metadata.get(SPEC_KEY)), _quant(path, metadata.get(QUANT_KEY))


def _spec(path: Path, text: str | None) -> Spec:
    if not text:
        raise WeightsError(f"{path}: metadata {SPEC_KEY!r} (the model's spec) is missing")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise WeightsError(f"{path}: metadata {SPEC_KEY!r} is not valid YAML") from None
    try:
        return from_dict(data)
    except ArchcError as err:
        raise WeightsError(f"{path}: metadata {SPEC_KEY!r}: {err}") from None


def _quant(path: Path, text: str | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The quantized tensors the metadata declares, each entry checked."""
    where = f"{path}: metadata {QUANT_KEY!r}"
    try:
        data = json.loads(text if text is not None else "")
    except json.JSONDecodeError:
        raise WeightsError(f"{where} is missing or not JSON") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{where} is not a JSON object")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in data.items():
        scheme = entry.get("scheme") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if scheme not in SCHEMES:
            raise WeightsError(f"{where}: tensor {name!r} has scheme {scheme!r} (known: "
                               f"{', '.join(SCHEMES)})")
        if not (isinstance(shape, list) and len(shape) >= 2 and all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise WeightsError(f"{where}: tensor {name!r} has shape {shape!r}; expected a list "
                               "of at least two positive whole numbers")
        out[name] = (scheme, tuple(shape))
    return out


class QuantizedFile:
    """A quantized file as a TensorSource, in archc's names: a quantized tensor is a QTensor of
    its parts, exactly as written, and a slice of it the spans of its parts that hold the slice
    (``part_spans``); a float tensor is read as stored."""

    def __init__(self, path: Path) -> None:
        self.path, self.file = path, SafetensorsFiles([path])
        self.spec, self.quant = read_header(path, self.file)
        self.parts: dict[str, list[str]] = {name: [] for name in self.quant}
        for owner, _, part in (key.rpartition(".") for key in self.file.tensors):
            if owner in self.quant:
                self.parts[owner].append(part)
        self.tensors = {**{k: None for k in self.file.tensors
                           if k.rpartition(".")[0] not in self.quant}, **self.quant}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.quant[name][1] if name in self.quant else self.file.shape(name)

    def load(self, name: str) -> Weight:
        if name not in self.quant:
            return self.file.load(name)
        return self._qtensor(name, self.quant[name][1],
                             {p: self.file.load(f"{name}.{p}") for p in self.parts[name]})

    def load_slice(self, name: str, span: Span) -> Weight:
        if name not in self.quant:
            return self.file.load_slice(name, span)
        scheme, shape = self.quant[name]
        dim, start, stop = span
        # a part the scheme does not have is read whole, for QTensor to refuse by name
        spans = part_spans(SCHEMES[scheme], shape, dim, start, stop - start)
        parts = {p: self.file.load(f"{name}.{p}") if p not in spans else
                 self.file.load_slice(f"{name}.{p}", spans[p]) for p in self.parts[name]}
        return self._qtensor(name, (*shape[:dim], stop - start, *shape[dim + 1:]), parts)

    def _qtensor(self, name: str, shape: tuple[int, ...], parts: dict[str, torch.Tensor]
                 ) -> QTensor:
        try:
            return QTensor(self.quant[name][0], shape, parts)
        except WeightsError as err:
            raise WeightsError(f"{self.path}: quantized tensor {name!r}: {err}") from None


def load_model(path: Path, *, progress: Progress | None = None, dtype: str | None = None,
               shard: tuple[int, int] | None = None) -> Model:
    """The ``archc.Model`` of a quantized file (an ``archc.api.SOURCES`` loader), its weights
    read as every checkpoint's are (``read_checkpoint``): QTensors for quantized tensors, exactly
    as written; float tensors in `dtype` if given, else as stored. `shard` (tp, rank): of each
    tensor the program sharded over tp ranks reads in parts, only rank `rank`'s slice is read
    (of a quantized one, the spans of its parts that hold it)."""
    source = QuantizedFile(path)
    weights, _ = read_checkpoint(source.spec, Checkpoint(source), OWN_NAMES, progress=progress,
                                 dtype=dtype, shard=shard,
                                 quant={name: s for name, (s, _) in source.quant.items()})
    return Model(source.spec, weights, source=str(path), shard=shard)
