"""Bad requests get OpenAI-shaped errors — the right status, the field at fault named, never a
traceback or a connection left hanging — and the server goes on serving. A bad `archc serve`
command line is one line and a non-zero exit before any model is read or port held."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from archc.cli import main
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)
from tests.serving import Running, client, serving

openai = pytest.importorskip("openai", reason="needs the openai client (pip install "
                             "'archc[test]')")


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> Iterator[Running]:  # noqa: F811
    with serving(str(tiny_gguf)) as running:
        yield running


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "MODEL", "prompt": "the cat", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], **fields}


# (path, body, status, param, words the message has)
BAD = [
    ("completions", completion(model="gpt-4"), 404, "model", "'gpt-4' does not exist"),
    ("completions", completion(model=None), 400, "model", "required"),
    ("completions", completion(n=0), 400, "n", "≥ 1"),
    ("completions", completion(n=2, best_of=3), 400, "best_of", "must equal n (2)"),
    ("completions", completion(n=17), 400, "n", "exceed the server's --max-batch of 16"),
    ("completions", completion(n="1"), 400, "n", "whole number"),
    ("completions", completion(max_tokens=0), 400, "max_tokens", "≥ 1"),
    ("completions", completion(max_tokens=2.5), 400, "max_tokens", "whole number"),
    ("completions", completion(max_tokens=63), 400, "max_tokens", "exceed this model's context"
     " of 64 tokens"),
    ("completions", completion(prompt=list(range(3, 67))), 400, "prompt", "leaves no room"),
    ("completions", completion(prompt=[1, 2, 500]), 400, "prompt", "token id 500 is outside"),
    ("completions", completion(prompt=["a", ""]), 400, "prompt[1]", "empty"),
    ("completions", completion(prompt=""), 400, "prompt", "empty"),
    ("completions", completion(prompt={"text": "x"}), 400, "prompt", "must be a string"),
    ("completions", completion(prompt=None), 400, "prompt", "required"),
    ("completions", completion(temperature=3), 400, "temperature", "[0, 2]"),
    ("completions", completion(temperature="hot"), 400, "temperature", "must be a number"),
    ("completions", completion(top_p=0), 400, "top_p", "(0, 1]"),
    ("completions", completion(seed=-1), 400, "seed", "≥ 0"),
    ("completions", completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    ("completions", completion(stop=[""]), 400, "stop", "must not be empty"),
    ("completions", completion(stop=3), 400, "stop", "string or a list of strings"),
    ("completions", completion(stream="yes"), 400, "stream", "true or false"),
    ("completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options", "only with stream"),
    ("completions", completion(logprobs=21), 400, "logprobs", "≤ 20"),
    ("completions", completion(suffix="x"), 400, "suffix", "not supported"),
    ("chat/completions", chat(messages=[]), 400, "messages", "non-empty list"),
    ("chat/completions", chat(messages=None), 400, "messages", "required"),
    ("chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role", "must be one of"),
    ("chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "string or a list of text parts"),
    ("chat/completions", chat(messages=["hi"]), 400, "messages[0]", "an object"),
    ("chat/completions", chat(max_tokens=-4), 400, "max_tokens", "≥ 1"),
    ("chat/completions", chat(messages=[{"role": "user", "content": "the cat " * 40}]), 400,
     "messages", "leaves no room"),
    ("chat/completions", chat(stream=True, n=3, best_of=1), 400, "best_of", "must equal n"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD,
                         ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_names_its_field(tiny: Running, path: str, body: dict[str, Any],
                                       status: int, param: str, words: str) -> None:
    if body.get("model") == "MODEL":
        body["model"] = tiny.name
    r = httpx.post(f"{tiny.url}/v1/{path}", json=body, timeout=10)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in r.text


@pytest.mark.parametrize("method,path,content,status,words", [
    ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("POST", "/v1/images/generations", b"{}", 404, "no route POST /v1/images/generations"),
    ("GET", "/v1/completions", None, 405, "GET is not allowed"),
    ("GET", "/v1/models/gpt-4", None, 404, "'gpt-4' does not exist"),
])
def test_a_request_that_is_no_api_call_gets_an_error_too(tiny: Running, method: str, path: str,
                                                         content: bytes | None, status: int,
                                                         words: str) -> None:
    r = httpx.request(method, f"{tiny.url}{path}", content=content, timeout=10)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]


def test_the_openai_client_raises_its_own_errors(tiny: Running) -> None:
    api = client(tiny)
    with pytest.raises(openai.NotFoundError) as found:
        api.completions.create(model="nope", prompt="x", max_tokens=2)
    assert found.value.code == "model_not_found" and "'nope' does not exist" in str(found.value)
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=tiny.name, max_tokens=100,
                                    messages=[{"role": "user", "content": "the cat"}])
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as bad:     # refused before a stream starts
        api.completions.create(model=tiny.name, prompt="the cat", max_tokens=2, n=0,
                               stream=True)
    assert bad.value.param == "n"
    # and the server still answers
    out = api.completions.create(model=tiny.name, prompt="the cat", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    assert tiny.wait_idle()["archc_requests_rejected_total{status=\"400\"}"] >= 2


def test_a_server_without_room_for_a_request_refuses_it(tiny_gguf: Path) -> None:  # noqa: F811
    with serving(str(tiny_gguf), blocks=2, max_tokens_in_flight=24) as small:
        too_big = {"model": small.name, "prompt": "the cat", "max_tokens": 40}
        error = httpx.post(f"{small.url}/v1/completions", json=too_big).json()["error"]
        assert "need 3 KV-cache blocks; the server's pool holds 2" in error["message"]
        too_big["max_tokens"] = 30       # 2 blocks, 32 tokens
        error = httpx.post(f"{small.url}/v1/completions", json=too_big).json()["error"]
        assert "exceed the server's --max-tokens-in-flight of 24" in error["message"]


@pytest.mark.parametrize("argv,message", [
    ("serve tiny-llama3 --port 70000", "--port: 70000 is not a TCP port"),
    ("serve tiny-llama3 --port http", "--port: 'http' is not a whole number"),
    ("serve tiny-llama3 --max-batch 0", "--max-batch: 0 must be ≥ 1"),
    ("serve tiny-llama3 --max-tokens-in-flight -5", "--max-tokens-in-flight: -5 must be ≥ 1"),
    ("serve tiny-llama3 --block-size x", "--block-size: 'x' is not a whole number"),
    ("serve tiny-llama3 --backend fast", "--backend: invalid choice: 'fast'"),
    ("serve tiny-llama3 --host no.such.host.invalid --port 0",
     "--host no.such.host.invalid: not an address"),
])
def test_a_bad_command_line_is_one_line_before_anything_loads(
        argv: str, message: str, nothing_loads: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_port_in_use_is_said_before_the_model_loads(nothing_loads: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "tiny-llama3", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("source,message", [
    ("no-such-model", "no-such-model"),
    ("tiny-llama3", "is a spec, not a checkpoint"),
])
def test_a_source_that_cannot_be_served_is_one_line(source: str, message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", source, "--port", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_an_engine_failure_ends_its_requests_with_an_error_and_the_server_goes_on(
        tiny: Running) -> None:
    engine = tiny.served.scheduler.engine

    def broken(*args: Any) -> Any:
        raise RuntimeError("device lost")

    engine.decode = broken
    try:
        r = httpx.post(f"{tiny.url}/v1/completions", timeout=10, json=completion(
            model=tiny.name, prompt=[10, 15, 20], max_tokens=8))
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "generation failed: RuntimeError: device lost"
        with httpx.stream("POST", f"{tiny.url}/v1/chat/completions", timeout=10, json=chat(
                model=tiny.name, max_tokens=8, stream=True)) as r:
            events = [line for line in r.iter_lines() if line]
        assert "device lost" in events[-2] and events[-1] == "data: [DONE]"
    finally:
        del engine.decode
    m = tiny.wait_idle()
    assert m['archc_requests_finished_total{reason="error"}'] == 2
    out = client(tiny).completions.create(model=tiny.name, prompt=[10, 15, 20], max_tokens=8,
                                          temperature=0)
    assert out.usage.completion_tokens == 8
