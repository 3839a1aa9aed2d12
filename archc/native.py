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


def load(directory: Path, progress: object = None, dtype: str | None = None,
         shard: tuple[int, int] | None = None) -> Model:
    """The model of a checkpoint directory. `shard` (tp, rank): of each tensor the program
    sharded over tp ranks reads in parts, only rank `rank`'s slice is read from the file."""
    from safetensors import SafetensorError, safe_open

    from archc.devices import check_fits, checkpoint_elements
    from archc.ir.lower import lower
    from archc.passes.slices import rank_slices, rank_span
    from archc.runtime.weights import TORCH_DTYPES
    spec = load_yaml(directory / SPEC_FILE)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        return Model(spec, source=str(directory), weights_dtype=dtype or "f32")
    tp, rank = shard if shard is not None else (1, 0)
    program = lower(spec)
    check_fits(spec.name, "its weights" if tp == 1 else
               f"its weights' slices for 1 of {tp} ranks",
               checkpoint_elements(program, tp=tp), dtype or spec.dtype, spec.family)
    cuts = rank_slices(program, tp)
    weights: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), "pt") as f:
            names = f.keys()    # a safe_open handle is not a mapping
            for name in names:
                if name in cuts:   # only the bytes of the rank's slice are read
                    dim, start, stop = rank_span(cuts[name],
                                                 f.get_slice(name).get_shape()[cuts[name][0]],
                                                 rank)
                    weights[name] = f.get_slice(name)[(slice(None),) * dim +
                                                      (slice(start, stop),)]
                else:
                    weights[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{path}: not a readable safetensors file ({err})") from None
    if dtype is not None:
        weights = {k: v.to(TORCH_DTYPES[dtype]) for k, v in weights.items()}
    return Model(spec, weights, source=str(directory), shard=shard)
