"""Generation: greedy and seeded sampling (temperature, top-k, top-p), stopping at any EOS id,
tokens streamed as text as they come; tokenizers and chat templates from model files (rendered
in a sandbox); `archc run --prompt/--chat` end to end on a small Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import archc
from archc.cli import main
from archc.errors import ArchcError
from archc.runtime.generate import Sampler, Sampling

tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (pip install "
                                 "'archc[hf]')")

from archc.tokenizer import TextStream, Tokenizer, TokenizerError, load_hf_tokenizer  # noqa: E402

CORPUS = ["the cat sat on the mat", "hello world, the end", "café crème brûlée"] * 10


# ---- sampling ------------------------------------------------------------------------------

def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    assert Sampler(Sampling())(logits).tolist() == [1, 0]


def test_sampling_is_reproducible_with_a_seed_and_varies_without_one_seed() -> None:
    logits = torch.zeros(1, 50)
    draw = lambda seed: [int(Sampler(Sampling(1.0, seed=seed))(logits)) for _ in range(1)] + [
        int(t) for t in Sampler(Sampling(1.0, seed=seed))(logits.expand(20, 50))]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_and_top_p_keep_only_the_likeliest_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(400, 4)
    top_k = Sampler(Sampling(1.0, top_k=2, seed=0))(logits)
    assert set(top_k.tolist()) == {0, 1}
    top_p = Sampler(Sampling(1.0, top_p=0.9, seed=0))(logits)   # 0.5 + 0.3 < 0.9 ≤ + 0.15
    assert set(top_p.tolist()) == {0, 1, 2}
    cold = Sampler(Sampling(0.05, seed=0))(logits)               # low temperature ≈ greedy
    assert set(cold.tolist()) == {0}


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0),
                                 dict(top_p=1.5)])
def test_bad_sampling_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ArchcError):
        Sampling(**bad)  # type: ignore[arg-type]


def test_generation_stops_at_any_eos_id_and_streams_each_token() -> None:
    compiled = archc.load("tiny-llama3", seed=1).compile()
    prompt = torch.tensor([[5, 6, 7]])
    free = compiled.generate(prompt, 10)[0, 3:].tolist()
    seen: list[int] = []
    stop = [free[3], 96]
    out = compiled.generate(prompt, 10, eos_token_id=stop, on_token=lambda t: seen.extend(
        t.tolist()))
    assert out[0, 3:].tolist() == free[:free.index(free[3]) + 1]
    assert seen == out[0, 3:].tolist()


def test_sampled_generation_is_reproducible() -> None:
    compiled = archc.load("tiny-llama3", seed=1).compile()
    prompt = torch.tensor([[5, 6, 7]])
    a = compiled.generate(prompt, 8, temperature=0.9, top_k=20, top_p=0.95, seed=3)
    b = compiled.generate(prompt, 8, temperature=0.9, top_k=20, top_p=0.95, seed=3)
    assert torch.equal(a, b)


# ---- tokenizers and chat templates ---------------------------------------------------------

def trained_tokenizer(vocab_size: int = 120) -> tokenizers.Tokenizer:
    """A small byte-level BPE; every byte of the corpus is in its alphabet."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=["<pad>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    return tok


TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def write_tokenizer(directory: Path, template: str = TEMPLATE) -> tokenizers.Tokenizer:
    tok = trained_tokenizer()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}))
    return tok


def test_hf_tokenizer_round_trips_and_renders_its_chat_template(tmp_path: Path) -> None:
    original = write_tokenizer(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    assert tok is not None and tok.eos_token_ids == (2,)
    for text in CORPUS[:3]:
        assert tok.encode(text) == original.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "the cat"}]
    assert tok.render_chat(messages) == "<s>user\nthe cat</s>\n<s>assistant\n"
    ids = tok.encode_chat(messages)
    assert ids.count(1) == 2 and ids.count(2) == 1  # special tokens whole, not spelled out


def test_a_saved_padding_and_truncation_are_not_applied(tmp_path: Path) -> None:
    """sentence-transformers saves tokenizer.json padded and truncated to a fixed length; each
    text is encoded whole all the same."""
    tok = trained_tokenizer()
    plain = tok.encode(CORPUS[0]).ids
    assert len(plain) > 3
    tok.enable_padding(length=64, pad_id=0, pad_token="<pad>")
    tok.enable_truncation(max_length=3)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_hf_tokenizer(tmp_path)
    assert loaded is not None and loaded.encode(CORPUS[0]) == plain


def test_chat_template_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = load_hf_tokenizer(tmp_path)
    assert tok is not None and tok.render_chat([{"role": "user", "content": "hi"}]) == "hi!"


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",                     # reaching Python internals
    "{% set _ = messages.append(1) %}",                     # mutating the caller's data
    "{{ ''.__class__.__subclasses__() }}",
])
def test_chat_templates_run_in_a_sandbox(template: str, tmp_path: Path) -> None:
    write_tokenizer(tmp_path, template)
    tok = load_hf_tokenizer(tmp_path)
    assert tok is not None
    with pytest.raises(TokenizerError, match="chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_chat_template_can_refuse_a_conversation(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, "{{ raise_exception('roles must alternate') }}")
    tok = load_hf_tokenizer(tmp_path)
    assert tok is not None
    with pytest.raises(TokenizerError, match="chat template: roles must alternate"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_streamed_text_waits_for_whole_characters(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    assert isinstance(tok, Tokenizer)
    text = "café crème brûlée"
    byte_tokens = [tok.backend.token_to_id(c) for c in
                   tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
                   .pre_tokenize_str(text)[0][0]]  # one token per byte of "café"
    stream = TextStream(tok)
    pieces = [stream.push([t]) for t in byte_tokens]
    assert "".join(pieces) + stream.flush() == "café"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[-2] == ""  # the first byte of "é" alone is not text yet
    stream = TextStream(tok)
    ids = tok.encode(text)
    assert "".join(stream.push([t]) for t in ids) + stream.flush() == text


# ---- archc run -----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers", reason="needs transformers "
                                   "(pip install 'archc[hf]')")


@pytest.fixture(scope="module")
def gpt2_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gpt2-tok")
    tok = write_tokenizer(directory)
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=48,
                                  vocab_size=tok.get_vocab_size(), bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(directory)
    return directory


def test_run_prompt_streams_the_continuation_and_reports_speed(
        gpt2_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = archc.load(gpt2_with_tokenizer)
    tok = model.tokenizer
    ids = tok.encode("the cat")
    expected = model.compile().generate(torch.tensor([ids]), 6, eos_token_id=[2])
    text = tok.decode(expected[0, len(ids):].tolist())
    capsys.readouterr()
    status = main(["run", str(gpt2_with_tokenizer), "--prompt", "the cat", "--threads", "1",
                   "--new-tokens", "6"])
    out, err = capsys.readouterr()
    assert status == 0
    assert out == "the cat" + text + "\n"
    assert f"prefill {len(ids)} tokens in" in err
    if expected.shape[1] - len(ids) > 1:
        assert "tokens/s" in err


def test_run_chat_uses_the_template_and_samples_with_a_seed(
        gpt2_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", str(gpt2_with_tokenizer), "--chat", "hello", "--system", "be brief",
            "--new-tokens", "5", "--temperature", "0.8", "--seed", "4"]
    capsys.readouterr()
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first


def test_run_prompt_needs_a_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "tiny-llama3", "--prompt", "hi"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_load_reports_progress(gpt2_with_tokenizer: Path) -> None:
    calls: list[tuple[int, int]] = []
    archc.load(gpt2_with_tokenizer, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1]
    assert [d for d, _ in calls] == list(range(1, len(calls) + 1))
