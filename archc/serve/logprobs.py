"""Log-probabilities: scored from logits, and written in OpenAI's two shapes.

A token's log-probability is ``log_softmax`` of the logits the model gave for its position, in
f32: the logits before temperature, top-k and top-p (OpenAI documents its logprobs so) and
before a structured-output grammar's mask (vLLM's default, ``raw_logprobs``): what the model
thinks of the token, whatever the sampler was allowed to choose. A token the model gives no
probability reads -9999.0, as OpenAI writes it (JSON has no −∞).

    /v1/completions       choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}
                          top_logprobs[t] a {token text: logprob} of the `logprobs` likeliest
                          tokens and the one chosen (as vLLM); with echo the prompt's tokens
                          come first, the first of them scored null (nothing comes before it)
    /v1/chat/completions  choices[].logprobs = {content: [{token, logprob, bytes,
                          top_logprobs: [{token, logprob, bytes}, …]}]}

A token's text is what it adds to the text before it (decoded after the token before it, so a
SentencePiece word's leading space is kept); a token that ends inside a UTF-8 character reads
U+FFFD (and the token that completes the character only what follows it). Its `bytes` are its
own, so that the bytes of the tokens of a split character join into it: a byte-level BPE
token's characters mapped back to the bytes they stand for (GPT-2's table), a SentencePiece
byte token's byte; other tokens, their text's UTF-8. ``text_offset`` counts characters into the
choice's text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_TOP = 20            # the most alternatives a token's top_logprobs may list (as OpenAI's chat)
UNLIKELY = -9999.0      # a logprob of −∞, as OpenAI writes it


@dataclass(frozen=True)
class Scored:
    """One token's log-probability, and the `k` likeliest tokens of its position with theirs,
    likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def score(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[Scored]:
    """tokens[t] scored by row t of `logits` [T, vocab] (raw, on any device), with each row's
    `top` likeliest tokens."""
    if not tokens:
        return []
    logprobs = logits.float().log_softmax(dim=-1)                      # [T, vocab]
    index = torch.tensor(list(tokens), device=logprobs.device)[:, None]
    chosen = logprobs.gather(-1, index)[:, 0].cpu().tolist()
    if top:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        best = [tuple(zip(i, v)) for i, v in zip(ids.cpu().tolist(), values.cpu().tolist())]
    else:
        best = [()] * len(tokens)
    return [Scored(t, c, b) for t, c, b in zip(tokens, chosen, best)]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte (the printable ones
    for themselves, the others for 256 + their rank among them), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_LEVEL = _byte_level_chars()
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")    # a SentencePiece byte-fallback piece


class Pieces:
    """Each token's text as it reads after the token before it, and its bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"

    def bytes(self, token: int, text: str) -> list[int]:
        """The bytes of `token`, whose text (``__call__``) is `text`."""
        piece = self.tokenizer.backend.id_to_token(token) if self.tokenizer is not None else None
        if piece is not None:
            if self.byte_level and all(c in BYTE_LEVEL for c in piece):
                return [BYTE_LEVEL[c] for c in piece]
            byte = BYTE_TOKEN.fullmatch(piece)
            if byte is not None:
                return [int(byte.group(1), 16)]
        return list(text.encode())

    def __call__(self, token: int, before: int | None) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        decode = self.tokenizer.decode
        if before is None:
            return decode([token], skip_special_tokens=False)
        context = decode([before], skip_special_tokens=False)
        return decode([before, token], skip_special_tokens=False)[len(context):]


def completion_shape(pieces: Pieces, scored: Sequence[Scored | None], tokens: Sequence[int],
                     before: int | None, offset: int) -> dict[str, Any]:
    """The completions shape of `tokens` (scored[t] None: a token nothing predicts, the
    prompt's first), `before` the token before the first, `offset` the characters of the
    choice's text before it."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for token, s in zip(tokens, scored):
        text = pieces(token, before)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        if s is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(_finite(s.logprob))
            top = {pieces(t, before): _finite(v) for t, v in s.top}
            top.setdefault(text, _finite(s.logprob))
            out["top_logprobs"].append(top)
        offset += len(text)
        before = token
    return out


def chat_shape(pieces: Pieces, scored: Sequence[Scored], before: int | None
               ) -> list[dict[str, Any]]:
    """The chat shape's `content` entries of `scored`, `before` the token before the first."""
    content = []
    for s in scored:
        text = pieces(s.token, before)
        tops = []
        for t, v in s.top:
            alt = pieces(t, before)
            tops.append({"token": alt, "logprob": _finite(v), "bytes": pieces.bytes(t, alt)})
        content.append({"token": text, "logprob": _finite(s.logprob),
                        "bytes": pieces.bytes(s.token, text), "top_logprobs": tops})
        before = s.token
    return content
