"""Reading a Hugging Face ``config.json`` so that no field goes unnoticed.

Every field an architecture mapper reads is recorded. What is left when the mapper is done must be
on a list of fields known not to change the function (dropout rates, initializer ranges, generation
defaults...); anything else is refused by name, so a model never runs with a setting archc did not
understand. The helpers here translate the settings several model types share: activations, RoPE
(``rope_parameters`` of transformers 5 and the older ``rope_theta``/``rope_scaling``), tied
embeddings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from archc.errors import SpecError

# Fields of every transformers config that do not change what the network computes: bookkeeping,
# training-only knobs, generation defaults, label maps of task heads archc does not run.
COMMON_INERT = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "auto_map", "use_cache", "initializer_range", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "id2label", "label2id",
    "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "output_attentions", "output_hidden_states", "return_dict",
    "torchscript", "use_return_dict", "gradient_checkpointing", "chunk_size_feed_forward",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_experts_implementation", "tie_encoder_decoder", "is_decoder", "base_model_tp_plan",
    "base_model_pp_plan", "keys_to_ignore_at_inference", "_commit_hash", "layerdrop",
    "is_encoder_decoder", "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16",
    "pruned_heads",  # checked to be empty below
    # bookkeeping written by fine-tuning and conversion tools: special-token ids the tokenizer
    # owns, where the weights came from
    "unk_token_id", "cls_token_id", "mask_token_id", "_model_name_or_path",
    # generation defaults (the sampler's settings, not the model's function)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "max_new_tokens",
    # dropout of every spelling: inactive at inference
    "attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
    "classifier_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob", "dropout_rate",
    "emb_pdrop", "activation_dropout",
})

# HF activation names (``ACT2FN``) → archc activations. gelu_new, gelu_fast and
# gelu_pytorch_tanh are all the tanh approximation; gelu and gelu_python the exact erf form.
ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu",
    "sigmoid": "sigmoid",
}

_MISSING = object()


class HFConfig:
    """A config.json mapping that records which fields were read."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data = dict(data)
        self.source = source
        self.model_type = str(self.data.get("model_type", ""))
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value (`default` when absent or null), marking it understood."""
        self.used.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def first(self, keys: Iterable[str], default: Any = _MISSING) -> Any:
        """The first of several spellings of one field that is present (GPT-2 style `n_embd`
        and Llama style `hidden_size`); all of them count as read."""
        keys = list(keys)
        self.used.update(keys)
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        if default is _MISSING:
            raise self.error(keys[0], "is missing", allowed="a value")
        return default

    def number(self, key: str, default: Any = _MISSING, *, kind: type = int) -> Any:
        value = self.get(key, None)
        if value is None:
            if default is _MISSING:
                raise self.error(key, "is missing", allowed=f"a {kind.__name__}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and not float(value).is_integer()):
            raise self.error(key, f"{value!r} is not a {'whole ' if kind is int else ''}number")
        return kind(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"{value!r} is not true/false")
        return value

    def expect(self, key: str, allowed: Collection[Any], default: Any = None) -> Any:
        """Read a field whose only values archc can honour are `allowed` (absent = `default`)."""
        value = self.get(key, default)
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise self.refuse(key, value, f"archc implements only {shown}")
        return value

    def error(self, key: str, problem: str, allowed: str | None = None) -> SpecError:
        return SpecError(key, problem, source=self.source, allowed=allowed)

    def refuse(self, key: str, value: Any, why: str) -> SpecError:
        """A field whose value archc cannot honour."""
        return SpecError(key, f"{value!r} cannot be honoured for model_type "
                         f"{self.model_type!r}: {why}", source=self.source)

    def check_all_understood(self, inert: Collection[str]) -> None:
        """Refuse the fields no mapper read and no list calls inert."""
        if self.data.get("pruned_heads"):
            raise self.refuse("pruned_heads", self.data["pruned_heads"], "pruned attention "
                              "heads leave layers with different head counts")
        unknown = sorted(k for k in self.data if k not in self.used and k not in COMMON_INERT
                         and k not in inert)
        if unknown:
            key = unknown[0]
            more = f" (also: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
            raise SpecError(key, f"{self.data[key]!r} is a field archc does not know for "
                            f"model_type {self.model_type!r}, so it cannot promise to honour "
                            f"it{more}", source=self.source,
                            allowed="remove the field if it does not change the model")


def activation(cfg: HFConfig, keys: Iterable[str], default: str) -> str:
    keys = list(keys)
    name = cfg.first(keys, default)
    if name not in ACTIVATIONS:
        raise cfg.refuse(keys[0], name, "archc's activations are "
                         + ", ".join(sorted(ACTIVATIONS)))
    return ACTIVATIONS[name]


# ---- RoPE -----------------------------------------------------------------------------------

def rope_position(cfg: HFConfig, *, max_seq_len: int, theta_keys: Iterable[str] = ("rope_theta",),
                  default_theta: float = 10000.0, fraction_keys: Iterable[str] = (
                      "partial_rotary_factor",), default_fraction: float = 1.0,
                  interleaved: bool = False) -> dict[str, Any]:
    """The spec's `position` section for a RoPE model, from `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` + a partial-rotary field (transformers 4). Returns the section
    and may change `max_seq_len` (see dynamic scaling) through the returned `_max_seq_len`."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise cfg.refuse("rope_parameters", params, "a mapping of one RoPE setting is expected "
                         "(per-layer-type RoPE is not supported)")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise cfg.refuse("rope_parameters", params, "per-layer-type RoPE settings are not "
                         "supported")
    theta = params.get("rope_theta")
    if theta is None:
        theta = cfg.first(theta_keys, default_theta)
    else:
        cfg.used.update(theta_keys)
    fraction = params.get("partial_rotary_factor")
    if fraction is None:
        fraction = cfg.first(fraction_keys, default_fraction)
    else:
        cfg.used.update(fraction_keys)
    scaling = cfg.get("rope_scaling") or {}
    if scaling and not isinstance(scaling, Mapping):
        raise cfg.refuse("rope_scaling", scaling, "a mapping is expected")
    merged = {**scaling, **{k: v for k, v in params.items()
                            if k not in ("rope_theta", "partial_rotary_factor")}}
    where = "rope_parameters" if params else "rope_scaling"
    kind = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    out: dict[str, Any] = {"kind": "rope", "theta": float(theta), "fraction": float(fraction)}
    if interleaved:
        out["interleaved"] = True
    original = merged.pop("original_max_position_embeddings", None) or cfg.get(
        "original_max_position_embeddings") or max_seq_len
    factor = merged.pop("factor", None)

    def leftover(allowed: Collection[str], defaults: Mapping[str, Any] | None = None) -> None:
        for key, value in merged.items():
            if key in allowed:
                continue
            if defaults and key in defaults and value == defaults[key]:
                continue
            raise cfg.refuse(f"{where}.{key}", value, f"not part of archc's {kind!r} RoPE")

    if kind == "default":
        leftover((), {"factor": 1.0})
        if factor not in (None, 1, 1.0):
            raise cfg.refuse(f"{where}.factor", factor, "a factor needs a rope_type")
        return out
    if factor is None:
        raise cfg.refuse(f"{where}.factor", None, f"{kind!r} RoPE scaling needs a factor")
    if kind == "linear":
        leftover(())
        out["scaling"] = {"kind": "linear", "factor": float(factor)}
    elif kind == "dynamic":
        # Dynamic NTK rescales the frequencies from the current length once it passes the
        # trained context, which transformers takes to be max_position_embeddings (whatever
        # original_max_position_embeddings says). The factor is how far past it the model is
        # meant to go: the KV cache is sized for that.
        leftover(())
        out["scaling"] = {"kind": "dynamic", "factor": float(factor),
                          "original_max_seq_len": int(max_seq_len)}
        out["_max_seq_len"] = max(int(max_seq_len), math.ceil(max_seq_len * float(factor)))
    elif kind == "llama3":
        low = merged.pop("low_freq_factor", 1.0)
        high = merged.pop("high_freq_factor", 4.0)
        leftover(())
        out["scaling"] = {"kind": "llama3", "factor": float(factor),
                          "original_max_seq_len": int(original),
                          "low_freq_factor": float(low), "high_freq_factor": float(high)}
    elif kind == "yarn":
        sc: dict[str, Any] = {"kind": "yarn", "factor": float(factor),
                              "original_max_seq_len": int(original)}
        for key, field in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"),
                           ("attention_factor", "attention_factor")):
            value = merged.pop(key, None)
            if value is not None:
                sc[field] = float(value)
        truncate = merged.pop("truncate", True)
        if truncate is not True:
            raise cfg.refuse(f"{where}.truncate", truncate, "archc's YaRN rounds the "
                             "correction range (truncate: true)")
        leftover((), {"mscale": None, "mscale_all_dim": None})
        out["scaling"] = sc
    else:
        raise cfg.refuse(f"{where}.rope_type", kind, "archc implements default, linear, "
                         "dynamic, llama3 and yarn RoPE")
    return out


# ---- naming ---------------------------------------------------------------------------------

def spec_name(*candidates: str) -> str:
    """A valid spec name from the first usable candidate (a hub id's last part, a folder)."""
    for text in candidates:
        text = (text or "").rstrip("/").rsplit("/", 1)[-1]
        text = re.sub(r"[^A-Za-z0-9_.\-]+", "-", text).strip("-._")[:64]
        if text:
            return text
    return "model"


def dtype_name(cfg: HFConfig) -> str:
    text = str(cfg.first(("dtype", "torch_dtype"), "float32"))
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(text, "f32")

