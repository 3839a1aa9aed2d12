"""The public API: ``archc.load`` and ``archc.from_spec`` make a ``Model`` (``archc.model``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

import archc.sources as sources
import archc.sources.native as native
import archc.sources.quantized as quantized_file
from archc.devices import dtype_name
from archc.dist import parallel_sizes
from archc.errors import ArchcError
from archc.memory import release_freed
from archc.model import CompiledModel, Model, Progress
from archc.spec import load_spec
from archc.spec.schema import Spec

__all__ = ["CompiledModel", "Model", "from_spec", "load"]

# (does this path hold it?, loader(path, progress=callback_or_None, dtype=name_or_None)): the
# first that holds a path loads it, pricing its weights with ``archc.devices.check_fits`` first;
# anything else is a zoo name or a spec YAML
SOURCES: list[tuple[Callable[[Path], bool], Callable[..., Model]]] = [
    (native.is_native, native.load),
    (sources.is_gguf, sources.load_gguf),
    (sources.is_hf_dir, sources.load_hf),
    (quantized_file.is_quantized_file, quantized_file.load_model),
]


def from_spec(spec: Spec, *, seed: int = 0, dtype: str | torch.dtype = "f32") -> Model:
    """A model of `spec` with seeded random weights, held in `dtype`."""
    return Model(spec, seed=seed, source=spec.name, weights_dtype=dtype_name(dtype))


def load(source: str | Path, *, seed: int = 0, dtype: str | torch.dtype | None = None,
         progress: Progress | None = None, quantize: str | None = None, group: int = 128,
         dequantize: bool = False, tp: int = 1, rank: int = 0) -> Model:
    """A zoo name, spec YAML, HF directory, GGUF file, archc checkpoint directory or archc
    quantized file (`archc quantize`) → a Model
    (random weights for specs). `dtype`: hold the weights in this dtype (default: f32 for
    random and dequantised GGUF weights, the stored dtype for safetensors). `progress(done,
    total)` is called as weights load. A GGUF file's quantized tensors stay quantized unless
    `dequantize`; `quantize` ("int8" or "int4", in groups of `group`) quantizes the weights of
    linear layers and experts of a float checkpoint (``Model.quantized``).

    `tp` > 1 with `rank`: hold only tensor-parallel rank `rank`'s slices of the weights the model
    sharded over tp ranks reads in parts (the rest whole) — for ``compile(tp=tp)`` in that rank's
    process. Of a checkpoint (GGUF file, Hugging Face directory, archc checkpoint directory or
    quantized file) only the rank's slices are read from the file, so no rank holds the whole
    checkpoint, or any whole tensor it cuts (but a checkpoint quantized at load to int8 is read
    whole, quantized, then cut).

    A spec that names a checkpoint (`weights: PATH`) is that checkpoint's tensors run by the
    spec's program: every tensor's shape is checked against the program before any is read."""
    name = None if dtype is None else dtype_name(dtype)
    if not isinstance(source, (str, Path)):
        raise ArchcError(f"source must be a zoo name or a path, got {type(source).__name__}")
    if quantize not in (None, "int8", "int4"):
        raise ArchcError(f"quantize={quantize!r}: use 'int8' or 'int4'")
    if group not in (32, 64, 128):
        raise ArchcError(f"group={group!r}: int4 groups are 32, 64 or 128 elements")
    tp, _ = parallel_sizes(tp, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ArchcError(f"rank must be a whole number in [0, {tp}), got {rank!r}")
    shard = (tp, rank) if tp > 1 else None
    path, model, borrower = Path(source), None, None
    if not any(matches(path) for matches, _ in SOURCES):   # a zoo name or a spec YAML
        spec = load_spec(source)
        if spec.weights is None:
            model = from_spec(spec, seed=seed, dtype=name or "f32")
        else:   # its shapes checked before any tensor is read
            borrower, path = sources.borrowed(spec).spec, Path(spec.weights)
    if dequantize and not sources.is_gguf(path):
        raise ArchcError(f"dequantize=True is for GGUF files; {source} holds no quantized "
                         "tensors")
    for matches, loader in SOURCES if model is None else ():
        if matches(path):
            extra: dict = {"dequantize": True} if dequantize else {}
            # cut as read. A model quantized at load to int8 is quantized whole, then cut: an
            # int8 row's one scale is its whole row's, which a rank's part does not know; int4
            # groups lie within the cuts (the shard pass cuts K on whole groups)
            if shard is not None and quantize != "int8":
                extra["shard"] = shard
            model = loader(path, progress=progress, dtype=name, **extra)
            break
    assert model is not None
    if borrower is not None:   # the spec's program over the checkpoint's tensors
        model = dataclasses.replace(model, spec=dataclasses.replace(borrower, weights=None),
                                    notes=model.notes + (f"{borrower.name} runs the weights of "
                                                         f"{path}",))
    if quantize is not None:
        model = model.quantized(quantize, group)
    model = model if shard is None or model.shard is not None else model.sliced(*shard)
    release_freed()     # what reading the checkpoint freed goes back to the system
    return model
