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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from archc.errors import ArchcError, WeightsError
from archc.quant.schemes import SCHEMES
from archc.quant.tensor import QTensor, Weight, part_spans
from archc.spec.load import dump_yaml, from_dict
from archc.spec.schema import Spec

FORMAT_KEY = "archc.format"
SPEC_KEY = "archc.spec"
QUANT_KEY = "archc.quant"
SOURCE_KEY = "archc.source"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"

Progress = Callable[[int, int], None]


def is_quantized_file(path: Path) -> bool:
    """Is `path` one archc reads as its quantized format? Any ``.safetensors`` path is claimed,
    so that a foreign or missing file is refused with a reason (``read_header``) rather than
    read as a spec."""
    return path.suffix.lower() == SUFFIX


def _part_names(name: str, q: QTensor) -> dict[str, str]:
    """File tensor name → part, for the parts of quantized tensor `name`."""
    return {f"{name}.{part}": part for part in q.parts}


def save(path: Path, spec: Spec, weights: Mapping[str, Weight], source: str = "") -> int:
    """Write `weights` (floats and QTensors) with `spec` to `path`; return the bytes of tensor
    data written."""
    from safetensors.torch import save_file
    tensors: dict[str, torch.Tensor] = {}
    quant: dict[str, dict[str, Any]] = {}
    for name, w in weights.items():
        if isinstance(w, QTensor):
            quant[name] = {"scheme": w.scheme.name, "shape": list(w.shape)}
            for key, part in _part_names(name, w).items():
                tensors[key] = w.parts[part].contiguous()
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


def read_header(path: Path) -> tuple[Spec, dict[str, tuple[str, tuple[int, ...]]]]:
    """The spec and quantized tensors (name → (scheme, shape)) of a file, read from its
    metadata alone; a file that is not archc's quantized format is refused naming why."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise WeightsError(f"{path}: not a readable safetensors file ({err})") from None
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


def load(path: Path, *, progress: Progress | None = None, dtype: str | None = None,
         shard: tuple[int, int] | None = None) -> tuple[Spec, dict[str, Weight]]:
    """The spec and weights of a quantized file: QTensors for quantized tensors, exactly as
    written; float tensors in `dtype` if given, else as stored. `shard` (tp, rank): of each
    tensor the program sharded over tp ranks reads in parts, only rank `rank`'s slice is read
    (of a quantized one, the spans of its parts that hold it)."""
    from safetensors import SafetensorError, safe_open

    from archc.runtime.weights import TORCH_DTYPES
    spec, quant = read_header(path)
    cuts = _cuts(spec, quant, shard[0]) if shard is not None else {}
    rank = shard[1] if shard is not None else 0
    weights: dict[str, Weight] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in quant}
    try:
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            for done, key in enumerate(keys, 1):
                owner, _, part = key.rpartition(".")
                if owner in quant:
                    parts[owner][part] = _read(f, key, _part_span(quant[owner], cuts.get(owner),
                                                                  part, rank))
                else:
                    span = _span(cuts[key], f.get_slice(key).get_shape(), rank) \
                        if key in cuts else None
                    t = _read(f, key, span)
                    weights[key] = t.to(TORCH_DTYPES[dtype]) \
                        if dtype is not None and t.is_floating_point() else t
                if progress is not None:
                    progress(done, len(keys))
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{path}: not a readable safetensors file ({err})") from None
    for name, (scheme, shape) in quant.items():
        if name in cuts:
            dim, start, stop = _span(cuts[name], shape, rank)
            shape = (*shape[:dim], stop - start, *shape[dim + 1:])
        try:
            weights[name] = QTensor(scheme, shape, parts[name])
        except WeightsError as err:
            raise WeightsError(f"{path}: quantized tensor {name!r}: {err}") from None
    return spec, weights


Cut = tuple[int, int, int]   # (dim, parts, every): how the shard pass cuts a tensor
Span = tuple[int, int, int]  # (dim, start, stop): the elements of dim a rank keeps


def _cuts(spec: Spec, quant: dict[str, tuple[str, tuple[int, ...]]], tp: int) -> dict[str, Cut]:
    """Tensor → its cut, for the tensors the program of `spec` (with the quantized tensors
    `quant`) sharded over tp ranks reads in parts."""
    from archc.ir.lower import lower
    from archc.passes.slices import rank_slices
    program = lower(spec, quant={name: scheme for name, (scheme, _) in quant.items()})
    return rank_slices(program, tp)


def _span(cut: Cut, shape: Sequence[int], rank: int) -> Span:
    from archc.passes.slices import rank_span
    return rank_span(cut, shape[cut[0]], rank)


def _part_span(entry: tuple[str, tuple[int, ...]], cut: Cut | None, part: str,
               rank: int) -> Span | None:
    """The span of part `part` of quantized tensor `entry` (scheme, shape) that holds rank
    `rank`'s slice of it (None: all of it, uncut or a part its scheme does not have, which
    `QTensor` then refuses by name)."""
    if cut is None:
        return None
    scheme, shape = entry
    dim, start, stop = _span(cut, shape, rank)
    return part_spans(SCHEMES[scheme], shape, dim, start, stop - start).get(part)


def _read(f: Any, key: str, span: Span | None) -> torch.Tensor:
    """Tensor `key` of an open safetensors file, whole or just the elements `span` (only the
    bytes that hold them are read)."""
    if span is None:
        return f.get_tensor(key)
    dim, start, stop = span
    return f.get_slice(key)[(slice(None),) * dim + (slice(start, stop),)]


def load_model(path: Path, *, progress: Progress | None = None, dtype: str | None = None,
               shard: tuple[int, int] | None = None) -> Any:
    """The ``archc.Model`` of a quantized file (an ``archc.api.SOURCES`` loader); `shard`
    (tp, rank): holding only that rank's slices (``load``)."""
    from archc.model import Model
    spec, weights = load(path, progress=progress, dtype=dtype, shard=shard)
    return Model(spec, weights, source=str(path), shard=shard)
