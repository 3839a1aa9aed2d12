"""Tokenizers and chat templates. A ``Tokenizer`` wraps a ``tokenizers.Tokenizer``: from a Hugging
Face ``tokenizer.json``, or built from the vocabulary a GGUF file stores (byte-level BPE as GPT-2
and SmolLM2 use, or the SentencePiece BPE of Llama 2). Chat templates are Jinja2 read from model
files, so they render in an immutable sandbox: a template can format messages, not reach Python
objects."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from archc.errors import ArchcError


class TokenizerError(ArchcError):
    """A tokenizer or chat template that cannot be built or used."""


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ArchcError("tokenizing text needs the `tokenizers` package "
                         "(pip install 'archc[hf]')") from None
    return tokenizers


@dataclass
class Tokenizer:
    backend: Any
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    add_bos: bool = False          # prepend BOS when the backend's post-processor does not
    source: str = ""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        bos = self.backend.token_to_id(self.bos_token) if self.bos_token else None
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of a conversation, through the model's chat template: rendered in
        Jinja2's immutable sandbox, with the helpers transformers gives templates
        (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text)."""
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        if not self.chat_template:
            raise TokenizerError(f"{self.source or 'this model'} has no chat template, so it "
                                 "cannot take a conversation; give it plain text to continue")

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        def tojson(value: Any, indent: int | None = None, **options: Any) -> str:
            return json.dumps(value, indent=indent, **{"ensure_ascii": False, **options})

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=True,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as err:
            raise TokenizerError(f"chat template: {type(err).__name__}: {err}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        # the template writes any BOS itself, so special tokens are not added again
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class TextStream:
    """Turns tokens into text as they arrive. Text is emitted only once it is final: a token may
    end in the middle of a UTF-8 character, and some decoders treat a sequence's first token
    specially, so the newest tokens are decoded together with the ones before them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0      # start of the window decoded for context
        self.read = 0        # tokens before this are already emitted

    def push(self, ids: Iterable[int], final: bool = False) -> str:
        """The text the tokens since `read` add, once it is final (or `final` says it is)."""
        self.ids.extend(ids)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self.prefix = len(self.ids) if final else self.read
        self.read = len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        return self.push((), final=True)


def _token_text(value: Any) -> str | None:
    """A special token as the configs write it: its text, or {"content": text, …}."""
    value = value.get("content") if isinstance(value, Mapping) else value
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{path}: not readable JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def load_hf_tokenizer(directory: Path) -> Tokenizer | None:
    """The tokenizer of an HF directory (``tokenizer.json``), or None when it has none."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizers = _tokenizers()
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers package raises plain Exceptions
        raise TokenizerError(f"{path}: not a readable tokenizer ({err})") from None
    # a tokenizer.json may pad every text to a fixed length or cut it (sentence-transformers
    # saves MiniLM's padded and truncated to 128): each text is encoded whole, and whoever
    # batches pads with a mask
    backend.no_padding()
    backend.no_truncation()
    config = _read_json(directory / "tokenizer_config.json")
    special = _read_json(directory / "special_tokens_map.json")
    template: Any = config.get("chat_template")
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    bos = _token_text(config.get("bos_token")) or _token_text(special.get("bos_token"))
    eos = _token_text(config.get("eos_token")) or _token_text(special.get("eos_token"))
    eos_id = backend.token_to_id(eos) if eos else None
    return Tokenizer(backend, bos_token=bos, eos_token=eos, source=str(directory),
                     eos_token_ids=() if eos_id is None else (eos_id,),
                     chat_template=template if isinstance(template, str) else None)


# llama.cpp's pre-tokenizer regexes (``tokenizer.ggml.pre``), as `tokenizers` pre-tokenizers.
_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
                 r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                 r"\s+(?!\S)")
_PRE_REGEX = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX,
              "qwen2": _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}"), "smaug-bpe": _LLAMA3_REGEX}
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")

# GGUF token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _byte_level_pre(tokenizers: Any, pre: str) -> Any:
    p = tokenizers.pre_tokenizers
    byte_level = p.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_REGEX)
    if pre in ("default", "gpt2", "gpt-2", ""):
        return byte_level
    if pre in _DIGITS_FIRST:
        return p.Sequence([p.Digits(individual_digits=True), byte_level])
    if pre not in _PRE_REGEX:
        known = ["default", "gpt2", *_PRE_REGEX, *_DIGITS_FIRST]
        raise TokenizerError(f"tokenizer.ggml.pre: {pre!r} is not a pre-tokenizer archc knows "
                             f"(known: {', '.join(known)})")
    return p.Sequence([p.Split(tokenizers.Regex(_PRE_REGEX[pre]), behavior="isolated"),
                       byte_level])


def _spm_merges(tokens: Sequence[str], scores: Sequence[float],
                vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps scores, not merges: a piece that splits into two pieces is the
    merge of the two, ranked by the piece's score (as transformers converts Llama's model)."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores):
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def from_gguf_vocab(*, model: str, tokens: Sequence[str], token_types: Sequence[int] | None,
                    merges: Sequence[str] | None, scores: Sequence[float] | None,
                    pre: str | None, bos_id: int | None, eos_ids: Sequence[int],
                    add_bos: bool | None, add_space_prefix: bool | None,
                    chat_template: str | None, source: str) -> Tokenizer:
    """A tokenizer from the vocabulary a GGUF file stores (`tokenizer.ggml.*`)."""
    tokenizers = _tokenizers()
    m, d, n = tokenizers.models, tokenizers.decoders, tokenizers.normalizers
    # a repeat keeps its first id (built without a list of pairs: a vocabulary is 10⁵ tokens)
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
    if model == "gpt2":
        if merges is None:
            raise TokenizerError(f"{source}: tokenizer.ggml.merges is missing for a BPE "
                                 "tokenizer")
        pairs = [tuple(x.split(" ", 1)) for x in merges]
        if any(len(p) != 2 for p in pairs):
            raise TokenizerError(f"{source}: tokenizer.ggml.merges has an entry that is not "
                                 "two tokens")
        backend = tokenizers.Tokenizer(m.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _byte_level_pre(tokenizers, pre or "default")
        backend.decoder = d.ByteLevel()
    elif model == "llama":
        if scores is None:
            raise TokenizerError(f"{source}: tokenizer.ggml.scores is missing for a "
                                 "SentencePiece tokenizer")
        unk = next((t for t, k in zip(tokens, token_types or ()) if k == UNKNOWN), None)
        backend = tokenizers.Tokenizer(m.BPE(vocab, _spm_merges(tokens, scores, vocab),
                                             unk_token=unk, fuse_unk=True, byte_fallback=True))
        prefix = add_space_prefix is not False      # "▁" before the text, stripped after
        backend.normalizer = n.Sequence([n.Prepend("▁")] * prefix + [n.Replace(" ", "▁")])
        backend.decoder = d.Sequence([d.Replace("▁", " "), d.ByteFallback(), d.Fuse()] +
                                     [d.Strip(" ", 1, 0)] * prefix)
    else:
        raise TokenizerError(f"{source}: tokenizer.ggml.model {model!r} is not supported "
                             "(archc builds gpt2 byte-level BPE and llama SentencePiece)")
    for kind, add in ((CONTROL, backend.add_special_tokens), (USER_DEFINED, backend.add_tokens)):
        add([tokenizers.AddedToken(tokens[i], special=kind == CONTROL, normalized=False)
             for i, k in enumerate(token_types or ()) if k == kind])
    eos_token = tokens[eos_ids[0]] if eos_ids and 0 <= eos_ids[0] < len(tokens) else None
    bos_token = tokens[bos_id] if bos_id is not None and 0 <= bos_id < len(tokens) else None
    return Tokenizer(backend, bos_token=bos_token, eos_token=eos_token,
                     eos_token_ids=tuple(eos_ids), chat_template=chat_template,
                     add_bos=model == "llama" if add_bos is None else add_bos, source=source)
