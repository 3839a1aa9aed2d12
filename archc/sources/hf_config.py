"""Reading a Hugging Face ``config.json`` so that no field goes unnoticed: the fields left unread
must be known not to change the function (dropout rates, generation defaults...), or they are
refused by name. The helpers translate what several model types share: activations, RoPE
(transformers 5's ``rope_parameters``, the older ``rope_theta``/``rope_scaling``), layer patterns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from archc.errors import SpecError
from archc.sources.tensor_map import Checkpoint, Layout
from archc.spec.schema import GATED_ACTIVATION

# Fields of every transformers config that do not change what the network computes: bookkeeping,
# training-only knobs, generation defaults, label maps of task heads archc does not run.
COMMON_INERT = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "auto_map", "use_cache", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "id2label", "label2id", "num_labels", "problem_type",
    "finetuning_task", "tokenizer_class", "prefix", "task_specific_params", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "use_return_dict",
    "gradient_checkpointing", "chunk_size_feed_forward", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "_experts_implementation",
    "tie_encoder_decoder", "is_decoder", "base_model_tp_plan", "base_model_pp_plan",
    "keys_to_ignore_at_inference", "_commit_hash", "layerdrop", "is_encoder_decoder",
    "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16",
    # bookkeeping of fine-tuning and conversion tools: token ids the tokenizer owns, weight origin
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
    "emb_pdrop", "activation_dropout"})

# HF activation names (``ACT2FN``) → archc activations. gelu_new, gelu_fast and
# gelu_pytorch_tanh are all the tanh approximation; gelu and gelu_python the exact erf form.
ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}
GATED = {act: kind for kind, act in GATED_ACTIVATION.items()}   # activation → gated FFN kind

# The parameters of each RoPE scaling kind that the spec takes under the same names (absent ones
# keep the spec's defaults, which are transformers' too).
ROPE_SCALING = {"linear": (), "dynamic": (), "llama3": ("low_freq_factor", "high_freq_factor"),
                "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"),
                "longrope": ("attention_factor",)}

_MISSING = object()
Keys = str | Sequence[str]   # one field, or its spellings (GPT-2's `n_embd`, Llama's `hidden_size`)


class HFConfig:
    """A config.json mapping that records which fields were read. A nested mapping (MPT's
    `attn_config`) or GGUF metadata is one too, its fields named with `prefix` in errors."""

    def __init__(self, data: Mapping[str, Any], source: str, *, model_type: str | None = None,
                 prefix: str = "") -> None:
        self.data = dict(data)
        self.source = source
        self.model_type = model_type or str(self.data.get("model_type") or "")
        self.prefix = prefix
        self.used: set[str] = set()

    def get(self, keys: Keys, default: Any = None) -> Any:
        """The first present (not null) of a field's spellings, else `default`; every spelling
        counts as read."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        self.used.update(keys)
        return next((self.data[k] for k in keys if self.data.get(k) is not None), default)

    def number(self, keys: Keys, default: Any = _MISSING, *, kind: type = int) -> Any:
        value = self.get(keys)
        if value is None:
            if default is _MISSING:
                raise self.error(keys, "is missing", allowed=f"a {kind.__name__}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and not float(value).is_integer()):
            raise self.error(keys, f"{value!r} is not a {'whole ' if kind is int else ''}number")
        return kind(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"{value!r} is not true/false")
        return value

    def expect(self, key: str, allowed: Sequence[Any], why: str | None = None) -> Any:
        """A field whose only values archc can honour are `allowed` (absent: the first)."""
        value = self.get(key, allowed[0])
        if value not in allowed:
            raise self.refuse(key, value, why or "archc implements only "
                              + ", ".join(repr(a) for a in allowed))
        return value

    def error(self, keys: Keys, problem: str, allowed: str | None = None) -> SpecError:
        """An error naming the field (its first spelling)."""
        key = keys if isinstance(keys, str) else keys[0]
        return SpecError(self.prefix + key, problem, source=self.source, allowed=allowed)

    def refuse(self, key: Keys, value: Any, why: str) -> SpecError:
        return self.error(key, f"{value!r} cannot be honoured for model_type "
                          f"{self.model_type!r}: {why}")

    def check_all_understood(self, inert: Collection[str] = ()) -> None:
        """Refuse the fields nothing read and no list calls inert."""
        self.expect("pruned_heads", ({},), "pruned attention heads leave layers with different "
                    "head counts")
        unknown = sorted(set(self.data) - self.used - COMMON_INERT - set(inert))
        if unknown:
            more = f" (also: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
            raise self.error(unknown[0], f"{self.data[unknown[0]]!r} is a field archc does not "
                             f"know for model_type {self.model_type!r}, so it cannot promise to "
                             f"honour it{more}",
                             allowed="remove the field if it does not change the model")


@dataclass(frozen=True)
class Architecture:
    """How a model type's config becomes a spec, where its checkpoint keeps each archc tensor,
    which config fields do not matter and which checkpoint tensors lie outside the function."""

    model_types: tuple[str, ...]
    # config (and checkpoint) → spec sections; a None value is a field left to its default
    spec: Callable[[HFConfig, Checkpoint], dict[str, Any]]
    layout: Layout
    tied: bool | None = False       # tie_word_embeddings' default; None: `spec` decides
    # config fields with the only values archc honours (absent: the first)
    only: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    inert: frozenset[str] = frozenset()   # config fields known not to change the function
    skip: tuple[str, ...] = ()            # checkpoint tensors outside the function (regexes)


def layer_pattern(kinds: Sequence[str]) -> list[str]:
    """The shortest prefix of per-layer kinds that repeats to all of them (spec's
    `attention.pattern` repeats over the layers)."""
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
    return list(kinds[:period])


# transformers 5's attention layer types → archc's local (sliding-window) and global kinds
HF_LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}


def attention_kinds(cfg: HFConfig, layers: int, period_keys: Keys, period: int) -> list[str]:
    """Each layer's kind, local or global: from `layer_types`, else (transformers 4 configs)
    every `period`-th layer global, the period given by `period_keys` if present."""
    every = cfg.number(period_keys, period)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else
                                       "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(
            t not in HF_LAYER_TYPES for t in types):
        raise cfg.refuse("layer_types", types, f"one of {', '.join(HF_LAYER_TYPES)} per layer "
                         f"({layers}) is expected")
    return [HF_LAYER_TYPES[t] for t in types]


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Spec sections `base` with `over` set into them, mapping by mapping; a section whose
    `kind` changes is `over`'s alone (the old kind's fields do not apply)."""
    if "kind" in over and over["kind"] != base.get("kind", over["kind"]):
        return dict(over)
    out = dict(base)
    for key, value in over.items():
        inner = out.get(key)
        out[key] = merge(inner, value) if isinstance(inner, Mapping) and \
            isinstance(value, Mapping) else value
    return out


def typed_layers(spec: Mapping[str, Any], kinds: Sequence[str],
                 sections: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The spec sections `spec` with layer i of kind `kinds[i]`, each kind setting its
    `sections` (per-layer sections: attention, position…): the spec's `layer_types` and the
    shortest `layer_pattern` that repeats to the layers, or, with one kind, its sections set on
    the model."""
    pattern = layer_pattern(kinds)
    used = list(dict.fromkeys(pattern))
    if len(used) == 1:
        return merge(spec, sections[used[0]])
    return {**spec, "layer_types": {k: dict(sections[k]) for k in used},
            "layer_pattern": pattern}


def activation(cfg: HFConfig, keys: Keys, default: str, *, gated: bool = False) -> str:
    """archc's activation for the HF one field `keys` names; `gated`: the gated FFN kind of it."""
    name = cfg.get(keys, default)
    if name not in ACTIVATIONS:
        raise cfg.refuse(keys, name, "archc's activations are " + ", ".join(sorted(ACTIVATIONS)))
    if gated and ACTIVATIONS[name] not in GATED:
        raise cfg.refuse(keys, name, "a gated FFN with exact (erf) GELU has no spec kind; "
                         "archc's GEGLU uses the tanh GELU")
    return GATED[ACTIVATIONS[name]] if gated else ACTIVATIONS[name]


def rope_position(cfg: HFConfig, max_seq_len: int, *, theta_keys: Keys = "rope_theta",
                  fraction_keys: Keys = "partial_rotary_factor", default_fraction: float = 1.0,
                  whole_heads: bool = False, layer_type: str | None = None,
                  scaled: bool = True) -> dict[str, Any]:
    """The spec's `position` and `max_seq_len` for a RoPE model, from `rope_parameters`
    (transformers 5) over `rope_theta` + `rope_scaling` + a partial-rotary field (transformers 4).
    `whole_heads`: the model type rotates whole heads, so a partial factor is refused.
    `layer_type`: the RoPE of the layers of that HF layer type, where `rope_parameters` holds
    one setting per layer type (Gemma 3); `scaled`: does a transformers-4 `rope_scaling` apply
    to them?"""
    params, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    where = "rope_parameters"
    if layer_type is not None and isinstance(params, Mapping) and \
            isinstance(params.get(layer_type), Mapping):
        params, where = params[layer_type], f"rope_parameters.{layer_type}"
    scaling = scaling if scaled else {}
    for key, given in ((where, params), ("rope_scaling", scaling)):
        if not isinstance(given, Mapping) or any(isinstance(v, Mapping) for v in given.values()):
            raise cfg.refuse(key, given, "a mapping of one RoPE setting is expected "
                             f"({cfg.model_type} has no per-layer-type RoPE)")
    where = where if params else "rope_scaling"
    rope = {"rope_theta": cfg.get(theta_keys, 10000.0),
            "partial_rotary_factor": cfg.get(fraction_keys, default_fraction)}
    for given in (scaling, params):   # a null parameter is an absent one
        rope.update((k, v) for k, v in given.items() if v is not None)
    fraction = float(rope.pop("partial_rotary_factor"))
    if whole_heads and fraction != 1.0:
        raise cfg.refuse((f"{where}." if params else "") + "partial_rotary_factor", fraction,
                         f"{cfg.model_type} rotates whole heads")
    out: dict[str, Any] = {"max_seq_len": max_seq_len, "position": {
        "kind": "rope", "theta": float(rope.pop("rope_theta")), "fraction": fraction}}
    kind = rope.pop("rope_type", None) or rope.get("type") or "default"
    kind = "longrope" if kind == "su" else kind   # Phi-3's first name for it
    rope.pop("type", None)
    top = cfg.get("original_max_position_embeddings")   # transformers 4 kept it outside
    original = rope.pop("original_max_position_embeddings", None) or top or max_seq_len
    factor = rope.pop("factor", None)
    if kind == "longrope" and factor is None:   # transformers: the context's extension
        factor = max(1.0, max_seq_len / int(original))
    if kind == "default" and factor not in (None, 1, 1.0):
        raise cfg.refuse(f"{where}.factor", factor, "a factor needs a rope_type")
    if kind != "default":
        if kind not in ROPE_SCALING:
            raise cfg.refuse(f"{where}.rope_type", kind, "archc implements default, linear, "
                             "dynamic, llama3, yarn and longrope RoPE")
        if factor is None:
            raise cfg.refuse(f"{where}.factor", None, f"{kind!r} RoPE scaling needs a factor")
        sc = out["position"]["scaling"] = {"kind": kind, "factor": float(factor)}
        sc.update({k: float(rope.pop(k)) for k in ROPE_SCALING[kind] if k in rope})
        if kind in ("llama3", "yarn", "longrope"):
            sc["original_max_seq_len"] = int(original)
        if kind == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = rope.pop(name, None)
                if not isinstance(factors, list) or not all(
                        isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
                    raise cfg.refuse(f"{where}.{name}", factors, "LongRoPE needs a list of "
                                     "numbers, one per rotary pair")
                sc[name] = [float(f) for f in factors]
        if kind == "dynamic":
            # Dynamic NTK rescales the frequencies from the current length once it passes the
            # trained context, which transformers takes to be max_position_embeddings (whatever
            # original_max_position_embeddings says). The factor is how far past it the model is
            # meant to go: the KV cache is sized for that.
            sc["original_max_seq_len"] = int(max_seq_len)
            out["max_seq_len"] = max(int(max_seq_len), math.ceil(max_seq_len * float(factor)))
        if kind == "yarn" and (truncate := rope.pop("truncate", True)) is not True:
            if truncate is not False:
                raise cfg.refuse(f"{where}.truncate", truncate, "true or false is expected")
            sc["truncate"] = False
    if rope:   # a parameter archc would ignore
        key = next(iter(rope))
        raise cfg.refuse(f"{where}.{key}", rope[key], f"not part of archc's {kind!r} RoPE")
    return out


def spec_name(*candidates: str) -> str:
    """A valid spec name from the first usable candidate (a hub id's last part, a folder)."""
    for text in candidates:
        text = (text or "").rstrip("/").rsplit("/", 1)[-1]
        text = re.sub(r"[^A-Za-z0-9_.\-]+", "-", text).strip("-._")[:64]
        if text:
            return text
    return "model"

