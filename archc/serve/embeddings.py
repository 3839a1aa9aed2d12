"""``POST /v1/embeddings`` for encoder checkpoints: OpenAI's request read and checked, the
encoder's hidden states pooled and normalized as the checkpoint declares, the answer in
OpenAI's shape.

A sentence-transformers directory declares what follows the transformer in ``modules.json``:
a ``Pooling`` module (its ``config.json`` says CLS, mean, max or mean/√length) and optionally a
``Normalize`` module (unit L2 norm); ``sentence_bert_config.json``'s ``max_seq_length`` is the
longest input it was trained for. A checkpoint without them is mean-pooled and not normalized,
as sentence-transformers treats a plain transformer. Any other module (``Dense`` …) is refused
when the server starts, rather than answered with different vectors.

An input is a string (tokenized whole, the tokenizer's special tokens added), a list of token
ids (taken as given), or a list of either; an input longer than the model takes is refused,
never cut. ``encoding_format`` ``base64`` gives each vector as the base64 of its little-endian
float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from archc.errors import ArchcError
from archc.serve.errors import APIError, bad_field
from archc.serve.protocol import Served, check_model

MAX_INPUTS = 2048                    # inputs in one request, as OpenAI allows
ENCODING_FORMATS = ("float", "base64")
# 1_Pooling/config.json's flags → archc's pooling; the others are refused
POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}
UNSUPPORTED_FLAGS = ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
ST_MODULES = "sentence_transformers.models."     # the prefix of modules.json's types


@dataclass(frozen=True)
class Pooling:
    """How hidden states [B, T, d] become one vector per input, as the checkpoint declares."""

    mode: str = "mean"                  # cls | mean | max | mean_sqrt_len
    normalize: bool = False             # to unit L2 norm
    max_tokens: int | None = None       # sentence_bert_config.json's max_seq_length
    declared: str = "no sentence-transformers modules: mean pooling"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ArchcError(f"{path}: not readable JSON ({err})") from None


def _pooling_mode(path: Path) -> str:
    config = _json(path)
    if not isinstance(config, dict):
        raise ArchcError(f"{path}: expected a JSON object")
    named = config.get("pooling_mode")          # newer sentence-transformers also write this
    modes = [mode for flag, mode in POOLING_FLAGS.items() if config.get(flag) is True]
    if isinstance(named, str) and not modes:
        modes = [{"mean_sqrt_len_tokens": "mean_sqrt_len"}.get(named, named)]
    odd = [flag for flag in UNSUPPORTED_FLAGS if config.get(flag) is True]
    if odd or len(modes) != 1 or modes[0] not in POOLING_FLAGS.values():
        raise ArchcError(f"{path}: pooling {', '.join(odd + modes) or 'none'} is not one archc "
                         "serves; exactly one of CLS, mean, max or mean/√length is")
    return modes[0]


def read_pooling(directory: Path) -> Pooling:
    """The pooling, normalization and longest input `directory` (a checkpoint) declares."""
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return Pooling()
    modules = _json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ArchcError(f"{modules_path}: expected a list of modules")
    mode, normalize, kinds = "mean", False, []
    for m in modules:
        kind = str(m.get("type", "")).removeprefix(ST_MODULES)
        kinds.append(kind)
        if kind == "Pooling":
            mode = _pooling_mode(directory / str(m.get("path", "")) / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ArchcError(f"{modules_path}: the module {m.get('type')!r} is not one archc "
                             "serves (Transformer, Pooling, Normalize)")
    config_path = directory / "sentence_bert_config.json"
    longest = _json(config_path).get("max_seq_length") if config_path.is_file() else None
    return Pooling(mode, normalize, longest if isinstance(longest, int) and longest > 0 else None,
                   f"modules.json: {' → '.join(kinds)}, {mode} pooling")


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One vector per row of `hidden` [B, T, d] over its real tokens (`mask` [B, T], 1 where
    real), in f32: [B, d]."""
    hidden, real = hidden.float(), mask.to(hidden.device).bool()[..., None]   # (B, T, 1)
    if pooling.mode == "cls":
        out = hidden[:, 0]
    elif pooling.mode == "max":
        out = hidden.masked_fill(~real, -math.inf).amax(dim=1)
    else:
        total = (hidden * real).sum(dim=1)                          # (B, d)
        count = real.sum(dim=1).clamp(min=1).float()                # (B, 1)
        out = total / (count.sqrt() if pooling.mode == "mean_sqrt_len" else count)
    return torch.nn.functional.normalize(out, dim=-1) if pooling.normalize else out


class Embedder:
    """An encoder's embeddings: inputs of token ids run in batches of up to `max_batch` (padded
    to the longest, masked), pooled. One request's forward runs at a time."""

    def __init__(self, compiled: Any, pooling: Pooling, *, max_batch: int = 16) -> None:
        self.compiled, self.pooling, self.max_batch = compiled, pooling, max_batch
        spec = compiled.spec
        self.family, self.dimensions = spec.family, spec.d_model
        self.max_tokens = min(spec.max_seq_len, pooling.max_tokens or spec.max_seq_len)
        self.lock = threading.Lock()

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """The vectors of `inputs` (lists of token ids), [N, d] f32 on the CPU."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))   # less padding
        out = torch.empty(len(inputs), self.dimensions)
        for start in range(0, len(order), self.max_batch):
            rows = order[start:start + self.max_batch]
            longest = max(len(inputs[i]) for i in rows)
            ids = torch.zeros(len(rows), longest, dtype=torch.long)
            mask = torch.zeros(len(rows), longest, dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, :len(inputs[i])] = torch.tensor(inputs[i])
                mask[r, :len(inputs[i])] = 1
            with self.lock, torch.inference_mode():
                hidden = self.compiled(ids, attention_mask=mask)
            out[rows] = pool(hidden, mask, self.pooling).cpu()
        return out


def embedder_for(model: Any, compiled: Any, *, max_batch: int = 16) -> Embedder:
    """The embedder of an encoder `model` (``archc.Model``) compiled as `compiled`, with the
    pooling its checkpoint directory declares."""
    if model.spec.family != "encoder":
        raise ArchcError(f"{model.spec.name} is an {model.spec.family} model: only encoders "
                         "serve embeddings")
    source = Path(model.source) if model.source else None
    pooling = read_pooling(source) if source is not None and source.is_dir() else Pooling()
    return Embedder(compiled, pooling, max_batch=max_batch)


# ---- a request ---------------------------------------------------------------------------------

def _token_ids(value: list[Any], param: str, vocab_size: int) -> list[int] | None:
    """`value` as token ids, or None when it is not a list of whole numbers."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    wrong = [v for v in value if not 0 <= v < vocab_size]
    if wrong:
        raise bad_field(param, f"token id {wrong[0]} is outside the vocabulary "
                        f"(0 … {vocab_size - 1})")
    return list(value)


def read_inputs(body: dict[str, Any], served: Served) -> list[list[int]]:
    """The request's `input` as lists of token ids, each checked against the model."""
    value = body.get("input")
    if value is None:
        raise bad_field("input", "required: a string, a list of strings, or token ids",
                        code="missing_required_parameter")
    if isinstance(value, str) or (isinstance(value, list) and value and
                                  all(isinstance(v, int) for v in value)):
        value = [value]                          # one input: text, or one list of token ids
    if not isinstance(value, list):
        raise bad_field("input", f"must be a string, a list of strings, or token ids, got "
                        f"{type(value).__name__}")
    if not value:
        raise bad_field("input", "the list of inputs is empty")
    if len(value) > MAX_INPUTS:
        raise bad_field("input", f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
    limit = served.embedder.max_tokens
    inputs = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_field(param, "an input must not be an empty string")
            if served.tokenizer is None:
                raise bad_field(param, "this model has no tokenizer: give token ids")
            ids: list[int] | None = served.tokenizer.encode(item)
        elif isinstance(item, list) and item:
            ids = _token_ids(item, param, served.vocab_size)
            if ids is None:
                raise bad_field(param, "a list of token ids must hold whole numbers only")
        elif isinstance(item, list):
            raise bad_field(param, "an input must not be an empty list of token ids")
        else:
            raise bad_field(param, f"must be a string or a list of token ids, got "
                            f"{json.dumps(item)[:40]}")
        assert ids is not None
        if len(ids) > limit:
            raise APIError(400, f"{param}: the input is {len(ids)} tokens; {served.name} takes "
                           f"at most {limit}", param="input", code="context_length_exceeded")
        inputs.append(ids)
    return inputs


def read_format(body: dict[str, Any], served: Served) -> str:
    """The answer's encoding (float unless asked); `dimensions`, when given, must be the
    model's own: an encoder's vectors cannot be shortened."""
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or dims != served.embedder.dimensions):
        raise bad_field("dimensions", f"{served.name}'s vectors have "
                        f"{served.embedder.dimensions} dimensions and cannot be shortened, got "
                        f"{json.dumps(dims)}", code="unsupported_parameter")
    fmt = body.get("encoding_format")
    if fmt is None:
        return "float"
    if fmt not in ENCODING_FORMATS:
        raise bad_field("encoding_format", f"must be one of {', '.join(ENCODING_FORMATS)}, got "
                        f"{json.dumps(fmt)}")
    return str(fmt)


def encoded(vector: torch.Tensor, fmt: str) -> list[float] | str:
    """A vector as OpenAI writes it: floats, or the base64 of its little-endian float32 bytes."""
    if fmt == "float":
        return vector.tolist()
    data = vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return base64.b64encode(data).decode("ascii")


def read_request(body: dict[str, Any], served: Served) -> tuple[list[list[int]], str]:
    """The checked request: its inputs as token ids and the encoding of the answer; a 400 naming
    the model's kind when it does not embed."""
    check_model(body, served)
    if served.embedder is None:
        raise APIError(400, f"{served.name} is {served.kind}: it generates text and "
                       "has no embeddings; it answers POST /v1/completions and "
                       "/v1/chat/completions", param="model", code="model_not_supported")
    fmt = read_format(body, served)
    return read_inputs(body, served), fmt


def response(vectors: torch.Tensor, inputs: list[list[int]], fmt: str,
             served: Served) -> dict[str, Any]:
    tokens = sum(len(ids) for ids in inputs)
    return {"object": "list", "model": served.name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v, fmt)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
