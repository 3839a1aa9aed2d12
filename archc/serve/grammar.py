"""Structured output: a request's ``response_format`` as a grammar that masks the logits.

``json_object`` is any JSON object; ``json_schema`` is the schema it names. Both compile, through
llguidance, to a matcher per request that says, before each token, which tokens of the
vocabulary may come next. llguidance is the grammar library because it needs no precomputation
per schema (an Earley parser over a lexer, masks computed as tokens come, in well under a
millisecond per step at a 50k vocabulary) and installs as one self-contained wheel with no Python
dependencies; xgrammar, the other maintained choice, pulls in a compiler runtime, pydantic,
transformers and triton.

The masks of a batch's rows are computed on the host, as 32 tokens per int32 word
(``Masks``), and applied to the logits where they are, on the device, before the one copy of
the step's logits to the host: a row without a grammar keeps every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from archc.serve.errors import bad_field

WORD = 32                                   # tokens per word of a mask
FORMATS = ("text", "json_object", "json_schema")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise bad_field("response_format", "structured output needs the `llguidance` package "
                        "(pip install 'archc[serve]')", code="unsupported_parameter") from None
    return llguidance


def read_grammar(body: dict[str, Any]) -> str | None:
    """The grammar `body`'s ``response_format`` asks for (None: free text), or a 400 naming
    what is wrong with it."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        raise bad_field("response_format", "must be an object whose type is one of "
                        f"{', '.join(FORMATS)}, got {json.dumps(value)[:200]}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                not spec["name"]:
            raise bad_field("response_format.json_schema", "must be an object with a name "
                            "and a schema", code="missing_required_parameter")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_field("response_format.json_schema.schema", "must be a JSON Schema "
                            "object")
    llguidance = _llguidance()
    try:
        # one canonical layout: no whitespace between tokens, so the model spends no tokens
        # (and no freedom) on it
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
    except ValueError as err:
        raise bad_field("response_format.json_schema.schema", f"not a schema this server can "
                        f"follow: {err}") from None


@dataclass
class Grammars:
    """The served model's vocabulary as llguidance sees it (built once, on the first request
    with a grammar), and each request's matcher."""

    tokenizer: Any                          # archc.tokenizer.Tokenizer, or None
    vocab_size: int
    eos: tuple[int, ...]
    _vocabulary: Any = field(default=None, init=False, repr=False)

    def vocabulary(self) -> Any:
        if self._vocabulary is None:
            if self.tokenizer is None:
                raise bad_field("response_format", "this model has no tokenizer to follow a "
                                "grammar with", code="unsupported_parameter")
            self._vocabulary = _llguidance().LLTokenizer(
                self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=list(self.eos) or None)
        return self._vocabulary

    def constraint(self, grammar: str) -> Constraint:
        """A request's matcher for `grammar`, refused (400) when llguidance finds it wrong."""
        llguidance, vocabulary = _llguidance(), self.vocabulary()
        problem = llguidance.LLMatcher.validate_grammar(grammar, vocabulary)
        if problem:
            raise bad_field("response_format.json_schema.schema", f"not a schema this server "
                            f"can follow: {problem}")
        return Constraint(llguidance.LLMatcher(vocabulary, grammar), self.vocab_size)


@dataclass(eq=False)
class Constraint:
    """One request's grammar as it generates: the tokens allowed next, and the tokens taken."""

    matcher: Any
    vocab_size: int

    def fill(self, words: torch.Tensor) -> None:
        """Write the allowed-token bits into `words`, one contiguous int32 row on the host."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def copy(self) -> Constraint:
        """Another sample's matcher, at the same point of the grammar."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size)

    def take(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: "
                               f"{self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the grammar admits nothing more: the answer is complete."""
        return bool(self.matcher.is_stopped())


def words_for(vocab: int) -> int:
    return (vocab + WORD - 1) // WORD


def apply_masks(logits: torch.Tensor, rows: list[Constraint | None]) -> torch.Tensor:
    """`logits` [B, vocab] with each constrained row's disallowed tokens at −inf, on the
    logits' device; rows without a constraint unchanged. The bits are computed on the host and
    moved once for the whole batch."""
    if all(c is None for c in rows):
        return logits
    vocab = logits.shape[-1]
    words = torch.full((len(rows), words_for(vocab)), -1, dtype=torch.int32)
    for row, constraint in enumerate(rows):
        if constraint is not None:
            constraint.fill(words[row])
    bits = torch.arange(WORD, dtype=torch.int32, device=logits.device)
    allowed = (words.to(logits.device)[:, :, None] >> bits) & 1
    return logits.masked_fill(allowed.flatten(1)[:, :vocab] == 0, float("-inf"))
