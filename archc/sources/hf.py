"""Hugging Face directories: ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json``) → Model.

The config becomes a spec through ``archc.spec.from_dict``, meeting the validation a YAML spec
meets; every config field is honoured, known not to matter, or refused by name. The tensors, read
lazily from one file or the shards ``model.safetensors.index.json`` lists, map to archc's names
with shape checks (``tensor_map``). A ``pytorch_model.bin`` is a pickle, and unpickling runs code
from the file, so archc refuses it, saying how to convert it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archc.errors import SpecError, WeightsError
from archc.model import Model, Progress
from archc.sources.architectures.cohere2 import COHERE2
from archc.sources.architectures.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from archc.sources.architectures.encoders import BERT, T5
from archc.sources.architectures.gemma3 import GEMMA3
from archc.sources.architectures.glm4 import GLM4
from archc.sources.architectures.gpt import BLOOM, FALCON, GPT2, GPTJ, MPT, NEOX, OPT, PHI
from archc.sources.architectures.llama import GEMMA, LLAMA
from archc.sources.architectures.llama_variants import (
    EXAONE4,
    GRANITE,
    OLMO2,
    QWEN3,
    SMOLLM3,
)
from archc.sources.architectures.mamba import JAMBA, MAMBA
from archc.sources.architectures.moe import GPT_OSS, LLAMA4_TEXT, QWEN3_MOE
from archc.sources.architectures.phi3 import PHI3
from archc.sources.architectures.qwen3_next import QWEN3_NEXT
from archc.sources.architectures.starcoder2 import STARCODER2
from archc.sources.hf_config import Architecture, HFConfig, spec_name
from archc.sources.tensor_map import Checkpoint, SafetensorsFiles, read_checkpoint
from archc.spec import from_dict
from archc.spec.schema import Spec
from archc.tokenizer import load_hf_tokenizer

ARCHITECTURES = (LLAMA, GEMMA, GPT2, GPTJ, NEOX, FALCON, BLOOM, MPT, OPT, PHI, BERT, T5, MAMBA,
                 JAMBA, QWEN3, GEMMA3, OLMO2, SMOLLM3, GRANITE, STARCODER2,
                 PHI3, GLM4, COHERE2, EXAONE4, QWEN3_MOE, QWEN3_NEXT, GPT_OSS,
                 LLAMA4_TEXT, DEEPSEEK_V2, DEEPSEEK_V3)
CONFIG = "config.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: the shards its index lists, else all."""
    index = directory / "model.safetensors.index.json"
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
        pickles = sorted(p.name for g in ("*.bin", "*.pt") for p in directory.glob(g))
        hint = (f"; {', '.join(pickles)} is a pickle, which archc never loads — convert it "
                "with `save_pretrained(..., safe_serialization=True)`" if pickles else "")
        raise WeightsError(f"{directory} has no *.safetensors weights{hint}")
    return files


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


def _given(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _given(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def _read(directory: Path, weights: bool) -> tuple[HFConfig, Architecture, Checkpoint, Spec]:
    """The config, architecture, checkpoint (without weights: none) and spec of a directory.
    The head is tied as transformers decides: by the config's `tie_word_embeddings`, unless the
    checkpoint holds a head that differs from the embedding (then the stored head is used)."""
    cfg = read_config(directory)
    arch = next((a for a in ARCHITECTURES if cfg.model_type in a.model_types), None)
    if arch is None:
        shown = f"{cfg.model_type!r} is not supported" if cfg.model_type else "missing"
        raise SpecError("model_type", shown, source=cfg.source, allowed=", ".join(
            sorted(t for a in ARCHITECTURES for t in a.model_types)))
    embed = arch.layout.names["embed"]
    ckpt = Checkpoint(SafetensorsFiles(safetensors_files(directory)) if weights else None, embed)
    for key, allowed in arch.only.items():
        cfg.expect(key, allowed)
    dtype = str(cfg.get(("dtype", "torch_dtype")))
    data = {"name": spec_name(str(cfg.data.get("_name_or_path") or ""), directory.resolve().name),
            "description": f"{cfg.model_type} from {directory}",
            "vocab_size": cfg.number("vocab_size"),
            "dtype": {"float16": "f16", "bfloat16": "bf16"}.get(dtype, "f32"),
            **arch.spec(cfg, ckpt)}
    if arch.tied is not None:
        head = f"{arch.layout.head_name(ckpt)}.weight"
        tied = cfg.flag("tie_word_embeddings", arch.tied) and not ckpt.differ(
            head, ckpt(f"{embed}.weight"))
        data.setdefault("embedding", {})["tied"] = tied
    cfg.check_all_understood(arch.inert)
    return cfg, arch, ckpt, from_dict(_given(data), source=cfg.source)


def hf_spec(directory: Path) -> Spec:
    """The spec of an HF directory (safetensors headers, if any, say if the head is tied)."""
    return _read(directory, any(directory.glob("*.safetensors")))[3]


def load_hf(directory: Path, *, progress: Progress | None = None,
            dtype: str | None = None, shard: tuple[int, int] | None = None) -> Model:
    """An HF directory's Model: weights (in their stored dtype, or `dtype`), tokenizer, EOS ids."""
    cfg, arch, ckpt, spec = _read(directory, True)
    weights, skipped = read_checkpoint(spec, ckpt, arch.layout, skip=arch.skip,
                                       progress=progress, dtype=dtype, shard=shard)
    tokenizer = load_hf_tokenizer(directory)
    return Model(spec, weights, tokenizer=tokenizer, shard=shard,
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
    if found is None:   # a null field is an absent one
        found = cfg.get("eos_token_id", list(tokenizer.eos_token_ids) if tokenizer else None)
    ids = found if isinstance(found, list) else [found]
    return tuple(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))
