"""Hugging Face directories: ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json``) → Model.

The config becomes a spec through ``archc.spec.from_dict``, so it meets the same validation as a
YAML spec; every config field is either honoured, known not to matter, or refused by name. The
checkpoint's tensors are mapped to archc's parameter names with shape checks (see
``tensor_map``). ``hf_spec`` stops after the spec, for ``archc export-spec``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archc.errors import SpecError
from archc.model import Model
from archc.sources.architectures import ARCHITECTURES
from archc.sources.architectures.base import Architecture, Checkpoint
from archc.sources.hf_config import HFConfig, spec_name
from archc.sources.safetensors_files import SafetensorsFiles
from archc.sources.tensor_map import LegacyNames, Progress, TensorMap, apply_rules
from archc.spec import from_dict
from archc.spec.schema import Spec

CONFIG = "config.json"


class _NoTensors:
    """A checkpoint with no tensors: a spec from the config alone."""

    def names(self) -> list[str]:
        return []

    def shape(self, name: str) -> tuple[int, ...]:
        raise KeyError(name)

    def load(self, name: str) -> Any:
        raise KeyError(name)


def is_hf_dir(path: Path) -> bool:
    """Any directory but archc's own checkpoint directories (a `spec.yaml` beside weights)."""
    return path.is_dir() and not (path / "spec.yaml").is_file()


def read_config(directory: Path) -> HFConfig:
    path = directory / CONFIG
    if not path.is_file():
        raise SpecError("", f"has no {CONFIG}; a Hugging Face model directory holds {CONFIG} "
                        "and *.safetensors", source=str(directory))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError("", f"cannot read the file: {err}", source=str(path)) from None
    except json.JSONDecodeError as err:
        raise SpecError("", f"is not valid JSON at line {err.lineno}, column {err.colno}: "
                        f"{err.msg}", source=str(path)) from None
    if not isinstance(data, dict):
        raise SpecError("", "is not a JSON object", source=str(path))
    return HFConfig(data, str(path))


def architecture_of(cfg: HFConfig) -> Architecture:
    mt = cfg.data.get("model_type")
    for arch in ARCHITECTURES:
        if mt in arch.model_types:
            return arch
    supported = sorted(t for a in ARCHITECTURES for t in a.model_types)
    shown = "missing" if mt is None else f"{mt!r} is not supported"
    raise SpecError("model_type", shown, source=cfg.source, allowed=", ".join(supported))


def _spec(directory: Path, cfg: HFConfig, arch: Architecture, ckpt: Checkpoint) -> Spec:
    data = arch.spec(cfg, ckpt)
    cfg.check_all_understood(arch.inert)
    data = {"name": spec_name(str(cfg.data.get("_name_or_path") or ""), directory.resolve().name),
            "description": f"{cfg.model_type} from {directory}", **data}
    return from_dict(data, source=cfg.source)


def hf_spec(directory: Path) -> Spec:
    """The spec of an HF directory (its safetensors headers are read, if present, to see
    whether the head is tied)."""
    cfg = read_config(directory)
    arch = architecture_of(cfg)
    has_weights = any(directory.glob("*.safetensors"))
    source = LegacyNames(SafetensorsFiles(directory)) if has_weights else _NoTensors()
    return _spec(directory, cfg, arch, Checkpoint(source, arch.prefixes))


def load_hf(directory: Path, *, progress: Progress | None = None,
            dtype: str | None = None) -> Any:
    """An HF directory → archc Model with its weights (in their stored dtype, or `dtype`),
    tokenizer and EOS ids."""
    from archc.devices import check_fits, checkpoint_elements
    from archc.ir.lower import lower
    from archc.runtime.weights import checkpoint_shapes
    from archc.tokenizer import load_hf_tokenizer

    cfg = read_config(directory)
    arch = architecture_of(cfg)
    files = LegacyNames(SafetensorsFiles(directory))
    ckpt = Checkpoint(files, arch.prefixes)
    spec = _spec(directory, cfg, arch, ckpt)
    program = lower(spec)
    check_fits(spec.name, "its weights", checkpoint_elements(program), dtype or spec.dtype,
               spec.family)
    tmap = TensorMap(checkpoint_shapes(program))
    arch.tensors(spec, tmap, ckpt)
    weights, skipped = apply_rules(files, tmap, skip=arch.skip, progress=progress, dtype=dtype)
    notes = [f"not part of the computed function, skipped: {', '.join(skipped)}"] if skipped \
        else []
    tokenizer = load_hf_tokenizer(directory)
    eos = _eos_ids(directory, cfg, tokenizer)
    return Model(spec, weights, tokenizer=tokenizer,
                 chat_template=tokenizer.chat_template if tokenizer else None,
                 source=str(directory), eos_token_ids=eos, notes=tuple(notes))


def _eos_ids(directory: Path, cfg: HFConfig, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json, else config.json, else the tokenizer's."""
    found: Any = None
    gen = directory / "generation_config.json"
    if gen.is_file():
        try:
            found = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            found = None
    if found is None:
        found = cfg.data.get("eos_token_id")
    if found is None and tokenizer is not None:
        found = list(tokenizer.eos_token_ids)
    ids = found if isinstance(found, list) else [found]
    return tuple(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))
