"""archc's own checkpoint directory: `spec.yaml` plus `model.safetensors` in archc's tensor names,
as `archc modernize SOURCE --steps gqa:4 -o DIR` writes a converted checkpoint and
`archc.load(DIR)` reads it back."""

from __future__ import annotations

from pathlib import Path

import torch

from archc.errors import ArchcError, WeightsError
from archc.model import Model
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


def load(directory: Path, progress: object = None, dtype: str | None = None) -> Model:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from archc.devices import check_fits, checkpoint_elements
    from archc.ir.lower import lower
    from archc.runtime.weights import TORCH_DTYPES
    spec = load_yaml(directory / SPEC_FILE)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        return Model(spec, source=str(directory), weights_dtype=dtype or "f32")
    check_fits(spec.name, "its weights", checkpoint_elements(lower(spec)), dtype or spec.dtype,
               spec.family)
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{path}: not a readable safetensors file ({err})") from None
    if dtype is not None:
        weights = {k: v.to(TORCH_DTYPES[dtype]) for k, v in weights.items()}
    return Model(spec, weights, source=str(directory))
