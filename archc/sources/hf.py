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
from archc.model import Model, Progress
from archc.sources.architectures import ARCHITECTURES
from archc.sources.architectures.base import Architecture, spec_data
from archc.sources.hf_config import HFConfig, spec_name
from archc.sources.safetensors_files import SafetensorsFiles
from archc.sources.tensor_map import Checkpoint, read_checkpoint
from archc.spec import from_dict
from archc.spec.schema import Spec
from archc.tokenizer import load_hf_tokenizer

CONFIG = "config.json"


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


def _read(directory: Path, weights: bool) -> tuple[HFConfig, Architecture, Checkpoint, Spec]:
    """The config, architecture, checkpoint (without weights: none) and spec of a directory."""
    cfg = read_config(directory)
    arch = next((a for a in ARCHITECTURES if cfg.model_type in a.model_types), None)
    if arch is None:
        shown = f"{cfg.model_type!r} is not supported" if cfg.model_type else "missing"
        raise SpecError("model_type", shown, source=cfg.source, allowed=", ".join(
            sorted(t for a in ARCHITECTURES for t in a.model_types)))
    ckpt = Checkpoint(SafetensorsFiles(directory) if weights else None, arch.prefixes)
    data = spec_data(arch, cfg, ckpt)
    cfg.check_all_understood(arch.inert)
    name = spec_name(str(cfg.data.get("_name_or_path") or ""), directory.resolve().name)
    spec = from_dict({"name": name, "description": f"{cfg.model_type} from {directory}", **data},
                     source=cfg.source)
    return cfg, arch, ckpt, spec


def hf_spec(directory: Path) -> Spec:
    """The spec of an HF directory (its safetensors headers are read, if present, to see
    whether the head is tied)."""
    return _read(directory, any(directory.glob("*.safetensors")))[3]


def load_hf(directory: Path, *, progress: Progress | None = None,
            dtype: str | None = None) -> Model:
    """An HF directory → archc Model with its weights (in their stored dtype, or `dtype`),
    tokenizer and EOS ids."""
    cfg, arch, ckpt, spec = _read(directory, True)
    weights, skipped = read_checkpoint(spec, ckpt, arch.layout, skip=arch.skip,
                                       progress=progress, dtype=dtype)
    tokenizer = load_hf_tokenizer(directory)
    return Model(spec, weights, tokenizer=tokenizer,
                 chat_template=tokenizer.chat_template if tokenizer else None,
                 source=str(directory), eos_token_ids=_eos_ids(directory, cfg, tokenizer),
                 notes=(f"not part of the computed function, skipped: {', '.join(skipped)}",)
                 if skipped else ())


def _eos_ids(directory: Path, cfg: HFConfig, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json, else config.json, else the tokenizer's."""
    try:
        found = json.loads((directory / "generation_config.json").read_text(encoding="utf-8"))\
            .get("eos_token_id")
    except (OSError, ValueError, AttributeError):   # absent or unreadable
        found = None
    if found is None:
        found = cfg.data.get("eos_token_id")
    if found is None and tokenizer is not None:
        found = list(tokenizer.eos_token_ids)
    ids = found if isinstance(found, list) else [found]
    return tuple(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))
