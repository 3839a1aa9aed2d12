"""The served model's tokenizer over HTTP, in the shapes vLLM serves (lm-evaluation-harness's
``RemoteTokenizer`` reads them, so a harness needs no copy of the tokenizer):

    GET  /tokenizer_info   {tokenizer_class, bos_token, eos_token, pad_token, chat_template,
                            model_max_length, vocab_size}
    POST /tokenize         {prompt, add_special_tokens?: true, return_token_strs?: false}, or
                           {messages, add_generation_prompt?: true}
                           → {count, max_model_len, tokens, token_strs}
    POST /detokenize       {tokens} → {prompt}

A `model` field, when given, must name the model served.
"""

from __future__ import annotations

from typing import Any

from archc.serve.errors import APIError, bad_field
from archc.serve.protocol import Served, chat_ids, check_model, flag, token_ids


def _tokenizer(served: Served) -> Any:
    if served.tokenizer is None:
        raise APIError(400, f"{served.name} has no tokenizer: it takes and gives token ids",
                       code="no_tokenizer")
    return served.tokenizer


def _model(body: dict[str, Any], served: Served) -> None:
    if body.get("model") is not None:
        check_model(body, served)


def info(served: Served) -> dict[str, Any]:
    tokenizer = _tokenizer(served)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "pad_token": None,
            "chat_template": tokenizer.chat_template, "model_max_length": served.max_model_len,
            "vocab_size": served.vocab_size}


def tokenize(body: dict[str, Any], served: Served) -> dict[str, Any]:
    _model(body, served)
    tokenizer = _tokenizer(served)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad_field("prompt", "give a prompt or messages, not both")
        if body.get("add_generation_prompt") not in (None, True):
            raise bad_field("add_generation_prompt", "the chat template is rendered with the "
                            "generation prompt, as the chat route renders it")
        ids = chat_ids(body, served)
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_field("prompt", "required (or messages)", code="missing_required_parameter")
        if not isinstance(prompt, str):
            raise bad_field("prompt", "must be a string")
        special = body.get("add_special_tokens")
        ids = tokenizer.encode(prompt, add_special_tokens=special is None or
                               flag(body, "add_special_tokens"))
    strs = None
    if flag(body, "return_token_strs"):
        strs = [tokenizer.backend.id_to_token(i) for i in ids]
    return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(body: dict[str, Any], served: Served) -> dict[str, Any]:
    _model(body, served)
    tokenizer = _tokenizer(served)
    tokens = body.get("tokens")
    if tokens is None:
        raise bad_field("tokens", "required", code="missing_required_parameter")
    ids = token_ids(tokens, served, "tokens")
    if ids is None:
        raise bad_field("tokens", "must be a list of token ids")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
