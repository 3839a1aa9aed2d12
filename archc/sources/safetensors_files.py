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

from archc.errors import WeightsError

INDEX = "model.safetensors.index.json"


class SafetensorsFiles:
    """Tensor name → file, shapes from the headers, tensors on demand."""

    def __init__(self, directory: Path) -> None:
        try:
            from safetensors import safe_open
        except ImportError:  # pragma: no cover - an optional dependency
            raise WeightsError("reading safetensors needs the `safetensors` package "
                               "(pip install 'archc[hf]')") from None
        self._safe_open = safe_open
        self.directory = directory
        self.files = self._list_files(directory)
        self._open: dict[Path, Any] = {}
        self.where: dict[str, Path] = {}
        for path in self.files:
            names = self._handle(path).keys()
            for name in names:
                if name in self.where:
                    raise WeightsError(f"checkpoint tensor {name!r} is in both "
                                       f"{self.where[name].name} and {path.name}")
                self.where[name] = path

    @staticmethod
    def _list_files(directory: Path) -> list[Path]:
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise WeightsError(f"{index}: not a readable shard index ({err})") from None
            files = [directory / n for n in names]
            for f in files:
                if not f.is_file():
                    raise WeightsError(f"{index} lists {f.name}, which is not in {directory}")
            return files
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(
                p.name for p in directory.glob("*.pt"))
            hint = (f"; {', '.join(pickles)} is a pickle, which archc never loads — convert it "
                    "with `save_pretrained(..., safe_serialization=True)`" if pickles else "")
            raise WeightsError(f"{directory} has no *.safetensors weights{hint}")
        return files

    def _handle(self, path: Path) -> Any:
        handle = self._open.get(path)
        if handle is None:
            try:
                handle = self._safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise WeightsError(f"{path}: not a readable safetensors file "
                                   f"({str(err).strip() or type(err).__name__}); "
                                   "is it truncated or still downloading?") from None
            self._open[path] = handle
        return handle

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.where[name]).get_slice(name).get_shape())

    def load(self, name: str) -> torch.Tensor:
        path = self.where[name]
        try:
            return self._handle(path).get_tensor(name)
        except Exception as err:
            raise WeightsError(f"{path}: cannot read tensor {name!r} "
                               f"({str(err).strip() or type(err).__name__}); "
                               "is the file truncated?") from None
