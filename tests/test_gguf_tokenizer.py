"""Tokenizers rebuilt from GGUF vocabularies: llama.cpp's SentencePiece models keep pieces and
scores but no merges, so the merges are recovered from the scores; unknown characters fall back
to byte tokens; special tokens are never split."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers", reason="needs tokenizers (pip install 'archc[gguf]')")

from archc.tokenizer import (  # noqa: E402
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    TokenizerError,
    from_gguf_vocab,
)

PIECES = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)] + [
    (f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)] + [
    ("▁", -1.0, NORMAL), ("a", -2.0, NORMAL), ("b", -3.0, NORMAL), ("c", -4.0, NORMAL),
    ("ab", -5.0, NORMAL), ("▁a", -6.0, NORMAL), ("▁ab", -7.0, NORMAL), ("abc", -8.0, NORMAL),
    ("▁abc", -9.0, NORMAL)]


def spm(**overrides: object) -> object:
    settings: dict[str, object] = dict(
        model="llama", tokens=[p for p, _, _ in PIECES], token_types=[k for _, _, k in PIECES],
        merges=None, scores=[s for _, s, _ in PIECES], pre=None, bos_id=1, eos_ids=[2],
        add_bos=None, add_space_prefix=None, chat_template=None, source="test.gguf")
    settings.update(overrides)
    return from_gguf_vocab(**settings)  # type: ignore[arg-type]


def test_sentencepiece_merges_follow_the_scores() -> None:
    tok = spm()
    ids = tok.encode("ab abc")
    pieces = [PIECES[i][0] for i in ids]
    assert pieces == ["<s>", "▁ab", "▁abc"]      # BOS added, as llama's tokenizer does
    assert tok.decode(ids) == "ab abc"


def test_unknown_characters_fall_back_to_bytes() -> None:
    tok = spm()
    ids = tok.encode("aé", add_special_tokens=False)
    assert [PIECES[i][0] for i in ids] == ["▁a", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "aé"


def test_special_tokens_are_not_split_and_bos_can_be_turned_off() -> None:
    tok = spm(add_bos=False)
    ids = tok.encode("ab</s>", add_special_tokens=False)
    assert ids[-1] == 2
    assert tok.encode("ab")[0] != 1
    assert tok.eos_token_ids == (2,)


def test_unknown_tokenizer_model_is_refused_by_name() -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.model 'bert' is not supported"):
        spm(model="bert")
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.pre: 'mystery' is not a "
                       r"pre-tokenizer archc knows"):
        spm(model="gpt2", merges=["a b"], pre="mystery")
