"""`archc quantize`: the quantized file it writes, read back exactly by every command, refused
with one line when it is not one; and quantized bytes in show and roofline, by hand."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import archc
from archc.cli import main
from archc.gpus import GPUS
from archc.ir import cost
from archc.ir.lower import lower
from archc.perf.roofline import decode_floor
from archc.quant import SCHEMES, QTensor
from archc.runtime.eager import EagerSession
from archc.runtime.weights import quant_schemes, quantizable
from archc.sources import describe
from archc.sources.quantized import FORMAT_KEY, QUANT_KEY, read_header
from archc.spec import load_spec
from tests.model_files import tiny_gguf  # noqa: F401  (a fixture)
from tests.test_sources_cli import INSPECTION


def _quantize(tmp_path: Path, *flags: str, source: str = "tiny-llama3") -> Path:
    out = tmp_path / "model.safetensors"
    assert main(["quantize", source, "-o", str(out), "--quiet", *flags]) == 0
    return out


def _logits(model: archc.Model) -> torch.Tensor:
    ids = torch.randint(0, model.spec.vocab_size, (1, 6),
                        generator=torch.Generator().manual_seed(3))
    s = EagerSession(lower(model.spec, quant=model.quant), model.weights,
                     max_seq_len=model.spec.max_seq_len)
    return s.step(ids)


@pytest.mark.parametrize("flags", [("--quantize", "int8"), ("--quantize", "int4", "--group", "32")])
def test_a_quantized_file_reads_back_exactly(flags: tuple[str, ...], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = _quantize(tmp_path, *flags)
    line = capsys.readouterr().out
    want = archc.load("tiny-llama3", quantize=flags[1], group=int(flags[-1]) if
                      flags[1] == "int4" else 128)
    got = archc.load(path)
    assert set(got.weights) == set(want.weights)
    assert got.quant == want.quant and set(want.quant) == set(quantizable(want.graph))
    for name, w in want.weights.items():
        g = got.weights[name]
        if isinstance(w, QTensor):
            assert isinstance(g, QTensor) and g.scheme == w.scheme and g.shape == w.shape
            assert set(g.parts) == set(w.parts)
            assert all(torch.equal(g.parts[k], w.parts[k]) for k in w.parts), name
        else:
            assert torch.equal(g, w), name
    assert torch.equal(_logits(got), _logits(want))
    # the summary: tensors written, bytes before (the float model) and after (the file's data)
    before = sum(w.numel() * w.element_size() for w in archc.load("tiny-llama3").weights.values())
    after = sum(t.numel() * t.element_size() for t in load_file(str(path)).values())
    assert f"{len(want.weights)} tensors" in line
    from archc.ui import nbytes
    assert f"{nbytes(before)} → {nbytes(after)}" in line
    # describe reads the spec and schemes from the metadata alone
    src = describe(path)
    assert src.spec == want.spec and src.quant == want.quant


def test_the_metadata_is_what_the_format_documents(tmp_path: Path) -> None:
    path = _quantize(tmp_path, "--quantize", "int4", "--group", "64")
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta[FORMAT_KEY] == "1"
    quant = json.loads(meta[QUANT_KEY])
    name = "layers.0.ffn.down.weight"
    assert quant[name]["scheme"] == "int4_g64"
    spec = load_spec("tiny-llama3")
    assert quant[name]["shape"] == [spec.d_model, spec.ffn.d_ff]
    assert {f"{name}.q", f"{name}.scale"} <= keys and name not in keys
    assert load_spec("tiny-llama3") == read_header(path)[0]


def test_a_float_source_is_written_as_it_is(tmp_path: Path) -> None:
    path = _quantize(tmp_path)
    got, want = archc.load(path), archc.load("tiny-llama3")
    assert got.quant == {}
    assert all(torch.equal(got.weights[k], w) for k, w in want.weights.items())


def _corrupt_part(path: Path, out: Path) -> None:
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    key = "layers.0.attn.q.weight.scale"
    tensors[key] = tensors[key][:, :-1].contiguous()      # one group's scales short
    save_file(tensors, str(out), metadata=meta)


@pytest.mark.parametrize("case, message", [
    ("missing -o", r"required: -o/--output"),
    ("-o a directory", r"is a directory"),
    ("-o not .safetensors", r"name the file \*\.safetensors"),
    ("--group without int4", r"--group sets int4 groups"),
    ("not safetensors", r"not a readable safetensors file"),
    ("missing file", r"not a readable safetensors file"),
    ("foreign safetensors", r"without archc's metadata"),
    ("corrupted part", r"part 'scale' of a int8_ch"),
    ("bad scheme", r"has scheme 'q9_9'"),
])
def test_bad_input_is_one_line(case: str, message: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    good = _quantize(tmp_path, "--quantize", "int8")
    bad = tmp_path / "bad.safetensors"
    argv = ["show", str(bad)]
    if case == "missing -o":
        argv = ["quantize", "tiny-llama3"]
    elif case == "-o a directory":
        argv = ["quantize", "tiny-llama3", "-o", str(tmp_path)]
    elif case == "-o not .safetensors":
        argv = ["quantize", "tiny-llama3", "-o", str(tmp_path / "x.bin")]
    elif case == "--group without int4":
        argv = ["quantize", "tiny-llama3", "-o", str(bad), "--group", "32"]
    elif case == "not safetensors":
        bad.write_text("not a safetensors file")
    elif case == "foreign safetensors":
        save_file({"w": torch.zeros(2, 2)}, str(bad))
    elif case == "corrupted part":
        _corrupt_part(good, bad)
        argv = ["run", str(bad), "--backend", "eager", "--prompt-len", "2", "--new-tokens", "1"]
    elif case == "bad scheme":
        from safetensors import safe_open
        with safe_open(str(good), "pt") as f:
            meta = f.metadata()
        meta[QUANT_KEY] = meta[QUANT_KEY].replace("int8_ch", "q9_9")
        save_file(load_file(str(good)), str(bad), metadata=meta)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


# ---- quantized bytes in the reports --------------------------------------------------------

def _by_hand(spec_name: str, scheme: str | None) -> int:
    """Σ over checkpoint parameters of elements × bytes per element of their dtype, with the
    linear weights in `scheme` (bytes per element from ``Scheme.bytes_per_element``)."""
    spec = load_spec(spec_name)
    program = lower(spec, spec.dtype)
    linear = set(quantizable(program))
    float_bytes = {"bf16": 2, "f16": 2, "f32": 4}[spec.dtype]
    total = Fraction(0)
    seen = set()
    for g in program:
        for n in g:
            if n.op.value != "param" or n.name in seen or (n.attr("expr") is not None and
                                                           n.name not in linear):
                continue
            seen.add(n.name)
            elements = math.prod(int(d) for d in n.shape)
            if scheme == "int8_ch" and n.name in linear:   # a byte a code, an f32 scale a row
                total += elements + 4 * int(n.shape[0])
                continue
            per = SCHEMES[scheme].bytes_per_element if scheme and n.name in linear \
                else float_bytes
            total += elements * per
    return math.ceil(total)


@pytest.mark.parametrize("flags, scheme", [((), None), (("--quantize", "int8"), "int8_ch"),
                                           (("--quantize", "int4"), "int4_g128"),
                                           (("--quantize", "int4", "--group", "32"),
                                            "int4_g32")])
def test_weight_bytes_by_hand(flags: tuple[str, ...], scheme: str | None) -> None:
    spec = load_spec("llama3-8b")
    quant = {} if scheme is None else {t: scheme for t in quantizable(lower(spec))}
    program = lower(spec, spec.dtype, quant)
    assert cost.parameter_bytes(program) == _by_hand("llama3-8b", scheme)


def test_show_says_the_schemes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _quantize(tmp_path, "--quantize", "int4", "--group", "32")
    capsys.readouterr()
    assert main(["show", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "weights" in x)
    from archc.ui import nbytes
    model = archc.load(path)
    held = sum(w.nbytes if isinstance(w, QTensor) else w.numel() * w.element_size()
               for w in model.weights.values())
    n_q = sum(isinstance(w, QTensor) for w in model.weights.values())
    assert f"{nbytes(held)} (int4_g32 ×{n_q} tensors, f32 ×{len(model.weights) - n_q})" in line


def _floor_line(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    capsys.readouterr()
    assert main(["roofline", "llama3-8b", "--prompt-len", "64", "--new-tokens", "1",
                 *flags]) == 0
    return " ".join(capsys.readouterr().out.split())    # lines wrapped at 120 columns joined


def test_roofline_quantize_buys_the_expected_decode_floor(
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = load_spec("llama3-8b")
    linear = quantizable(lower(spec))
    g = GPUS["h200"]
    out = _floor_line(capsys, "--quantize", "int4", "--passes", "none")
    floors = {}
    for scheme in (None, "int4_g128", "int8_ch"):
        program = lower(spec, spec.dtype, {} if scheme is None else dict.fromkeys(linear,
                                                                                 scheme))
        floors[scheme] = decode_floor(program, g, 1, 64)
    # by hand: every weight read once; the embedding table only the one row looked up
    d, vocab = spec.d_model, spec.vocab_size
    for scheme, floor in floors.items():
        want = _by_hand("llama3-8b", scheme) - (vocab - 1) * d * 2
        assert abs(floor.weight_bytes - want) <= 1, scheme
    kv = floors[None].kv_bytes
    assert floors["int4_g128"].kv_bytes == kv
    ratio = (floors[None].weight_bytes + kv) / (floors["int4_g128"].weight_bytes + kv)
    assert f"→ {ratio:.2f}× faster" in out
    assert "int4_g128 ×225" in out


def test_quantize_is_refused_on_a_quantized_source(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _quantize(tmp_path, "--quantize", "int8")
    capsys.readouterr()
    assert main(["roofline", str(path), "--quantize", "int4"]) == 2
    assert "already quantized (int8_ch)" in capsys.readouterr().err
    assert main(["run", str(path), "--quantize", "int4", "--new-tokens", "1"]) == 2
    assert "already quantized (int8_ch); quantize a float checkpoint" in " ".join(
        capsys.readouterr().err.split())
    for argv in (["run", "tiny-llama3", "--group", "32"],
                 ["show", "tiny-llama3", "--quantize", "int8", "--group", "64"]):
        assert main(argv) == 2, argv
        assert "--group sets int4 groups: give it with --quantize int4" in \
            capsys.readouterr().err
    for argv, said in (
            (["run", "tiny-llama3", "--dequantize"], "--dequantize reads a GGUF file's"),
            (["run", "tiny-llama3", "--backend", "triton", "--kv-cache", "fp8"],
             "--kv-cache fp8 with the triton backend needs a GPU of compute capability 8.9")):
        assert main(argv) == 2, argv
        assert said in " ".join(capsys.readouterr().err.split()), argv


def test_inspection_commands_take_quantize(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["passes", "tiny-llama3"], ["ir", "tiny-llama3"], ["explain", "tiny-llama3"],
                 ["diff", "tiny-llama3", "tiny-llama3"]):
        assert main([*argv, "--quantize", "int4", "--group", "32"]) == 0, argv
    assert main(["ir", "tiny-llama3", "--quantize", "int8"]) == 0
    assert "int8_ch[" in capsys.readouterr().out


def test_quant_schemes_of_a_loaded_file_match_the_header(tmp_path: Path) -> None:
    path = _quantize(tmp_path, "--quantize", "int4", "--group", "32")
    assert quant_schemes(archc.load(path).weights) == \
        {k: s for k, (s, _) in read_header(path)[1].items()}


def test_bench_prices_the_quantized_model_beside_the_dense_one() -> None:
    from archc.cli import build_parser
    from archc.commands.bench import config_of
    from archc.perf.bench import decode_steps_floor, quantized, random_checkpoint
    from archc.perf.summary import quant_line
    args = build_parser().parse_args(["bench", "tiny-llama3", "--dry-run", "--quantize", "int4",
                                      "--group", "32"])
    cfg = config_of(args)
    assert cfg.quant == "int4_g32"
    dense = lower(cfg.spec, cfg.dtype)
    program, checkpoint = quantized(cfg, dense, random_checkpoint(dense, cfg.device, 0))
    names = quantizable(dense)
    assert quant_schemes(checkpoint) == dict.fromkeys(names, "int4_g32")
    assert {n.dtype for g in program for n in g if n.name in names} == {"int4_g32"}
    q, d = (decode_steps_floor(cfg, p, cfg.prompt) for p in (program, dense))
    assert q["weight_bytes"] < d["weight_bytes"] and q["kv_bytes_mean"] == d["kv_bytes_mean"]
    line = quant_line(cfg.quant, cfg.dtype, q, d)
    assert f"{d['floor_seconds'] / q['floor_seconds']:.2f}×" in line


def test_bench_without_a_gpu_refuses_quantize_as_it_refuses_any_run(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert main(["bench", "llama3-8b", "--quantize", "int4"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


# compile generates kernels (the triton backend's part); modernize converts float weights
@pytest.mark.parametrize("command", [c for c in INSPECTION if c not in ("compile", "modernize")])
def test_inspection_commands_read_a_quantized_file(command: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _quantize(tmp_path, "--quantize", "int4", "--group", "32")
    capsys.readouterr()
    assert main([command, str(path), *INSPECTION[command]]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "error" not in err


def test_run_reads_a_quantized_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _quantize(tmp_path, "--quantize", "int8")
    capsys.readouterr()
    argv = ["--backend", "eager", "--prompt-len", "3", "--new-tokens", "2", "--quiet"]
    assert main(["run", str(path), *argv]) == 0
    from_file = capsys.readouterr().out
    assert main(["run", "tiny-llama3", "--quantize", "int8", *argv]) == 0
    from_spec = capsys.readouterr().out
    # the same numbers and tokens; only the title line says where the weights came from
    assert " ".join(from_file.split()).split("tokens", 1)[1] == \
        " ".join(from_spec.split()).split("tokens", 1)[1]
    assert "weights from" in from_file


def test_a_gguf_file_is_written_as_it_loads(tiny_gguf: Path, tmp_path: Path) -> None:  # noqa: F811
    path = _quantize(tmp_path, source=str(tiny_gguf))
    want, got = archc.load(tiny_gguf), archc.load(path)
    assert got.quant == want.quant and got.spec == want.spec
    for name, w in want.weights.items():
        g = got.weights[name]
        if isinstance(w, QTensor):
            assert all(torch.equal(g.parts[k], w.parts[k]) for k in w.parts), name
        else:
            assert torch.equal(g, w), name
