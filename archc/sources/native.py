"""archc's own checkpoint directory: `spec.yaml` plus `model.safetensors` in archc's tensor names,
as `archc modernize SOURCE --steps gqa:4 -o DIR` writes a converted checkpoint and
`archc.load(DIR)` reads it back."""

from __future__ import annotations

from pathlib import Path

import torch

from archc.errors import ArchcError
from archc.model import Model, Progress
from archc.sources.tensor_map import OWN_NAMES, Checkpoint, SafetensorsFiles, read_checkpoint
from archc.spec.load import dump_yaml, load_yaml
from archc.spec.schema import Spec

SPEC_FILE = "spec.yaml"
WEIGHTS_FILE = "model.safetensors"


def is_native(path: Path) -> bool:
    return path.is_dir() and (path / SPEC_FILE).is_file()


def save(directory: Path, spec: Spec, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / SPEC_FILE).write_text(dump_yaml(spec), encoding="utf-8")
        save_file({k: v.contiguous() for k, v in weights.items()},
                  str(directory / WEIGHTS_FILE))
    except OSError as err:
        raise ArchcError(f"cannot write {directory}: {err.strerror}") from None


def load(directory: Path, progress: Progress | None = None, dtype: str | None = None,
         shard: tuple[int, int] | None = None) -> Model:
    """The model of a checkpoint directory, read as every checkpoint is (``read_checkpoint``).
    `shard` (tp, rank): of each tensor the program sharded over tp ranks reads in parts, only
    rank `rank`'s slice is read from the file."""
    spec = load_yaml(directory / SPEC_FILE)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        return Model(spec, source=str(directory), weights_dtype=dtype or "f32")
    weights, _ = read_checkpoint(spec, Checkpoint(SafetensorsFiles([path])), OWN_NAMES,
                                 progress=progress, dtype=dtype, shard=shard)
    return Model(spec, weights, source=str(directory), shard=shard)
