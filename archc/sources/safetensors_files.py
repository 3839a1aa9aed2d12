"""The tensors of a Hugging Face directory: one ``*.safetensors`` file, or shards listed by
``model.safetensors.index.json``. Tensors are read lazily, one at a time.

safetensors only: a ``pytorch_model.bin`` is a pickle, and unpickling runs code from the file, so
archc refuses it with a message saying how to convert it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from archc.errors import WeightsError

INDEX = "model.safetensors.index.json"
# TensorFlow-era names, which transformers renames on load
LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


class SafetensorsFiles:
    """Tensor name → (file, stored name), shapes from the headers, tensors on demand. Names are
    the ones transformers gives on load: `LayerNorm.gamma` is `LayerNorm.weight`."""

    def __init__(self, directory: Path) -> None:
        self.handles: dict[Path, Any] = {}
        stored: dict[str, Path] = {}
        for path in self._list_files(directory):
            try:
                self.handles[path] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise WeightsError(f"{path}: not a readable safetensors file "
                                   f"({str(err).strip() or type(err).__name__}); "
                                   "is it truncated or still downloading?") from None
            names = self.handles[path].keys()   # a safe_open handle is not a mapping
            for name in names:
                if name in stored:
                    raise WeightsError(f"checkpoint tensor {name!r} is in both "
                                       f"{stored[name].name} and {path.name}")
                stored[name] = path
        self.where: dict[str, tuple[Path, str]] = {}
        for name, path in stored.items():
            old = next((o for o in LEGACY if name.endswith(o)), None)
            new = name[: -len(old)] + LEGACY[old] if old else name
            self.where[name if new in stored else new] = (path, name)

    @staticmethod
    def _list_files(directory: Path) -> list[Path]:
        index = directory / INDEX
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                                   .values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise WeightsError(f"{index}: not a readable shard index ({err})") from None
            for name in names:
                if not (directory / name).is_file():
                    raise WeightsError(f"{index} lists {name}, which is not in {directory}")
            return [directory / n for n in names]
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(
                p.name for p in directory.glob("*.pt"))
            hint = (f"; {', '.join(pickles)} is a pickle, which archc never loads — convert it "
                    "with `save_pretrained(..., safe_serialization=True)`" if pickles else "")
            raise WeightsError(f"{directory} has no *.safetensors weights{hint}")
        return files

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        path, stored = self.where[name]
        return tuple(self.handles[path].get_slice(stored).get_shape())

    def load(self, name: str) -> torch.Tensor:
        path, stored = self.where[name]
        try:
            return self.handles[path].get_tensor(stored)
        except Exception as err:
            raise WeightsError(f"{path}: cannot read tensor {stored!r} "
                               f"({str(err).strip() or type(err).__name__}); "
                               "is the file truncated?") from None
