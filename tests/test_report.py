"""`archc report`'s data: every pass, with the node and kernel counts `archc passes` prints; the
kernels codegen renders; the graph drawn (one period of blocks) counting as `archc passes` counts
that cut model; the roofline covering every launch; the page embedding exactly the --json data;
every source kind; bad input refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

import archc.codegen.aot as aot
from archc.cli import main
from archc.codegen.build import CodegenOptions
from archc.codegen.render import generate
from archc.ir.lower import lower
from archc.ir.ops import Op, is_compute
from archc.passes import DEFAULT_PIPELINE, optimize
from archc.sources import describe
from archc.spec import ZOO_DIR
from tests.model_files import tiny_gguf, tiny_hf_dir  # noqa: F401  (fixtures)
from tests.report_helpers import embedded, one_layer_yaml, passes_table, report_json


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """tiny-llama3's report: its --json data and the page written beside it (module-wide, so
    read from stdout here rather than through capsys)."""
    page = tmp_path_factory.mktemp("report") / "tiny.html"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", "tiny-llama3", "--json", "-o", str(page),
                     "--prompt-len", "16", "--new-tokens", "4"]) == 0
    return json.loads(out.getvalue()), page


def test_every_pass_is_there_with_archc_passes_counts(tiny_llama3: tuple[dict, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = tiny_llama3
    rows = data["pipeline"]["rows"]
    assert [r["name"] for r in rows] == ["lowered", *DEFAULT_PIPELINE]
    assert [(r["name"], r["stats"]["nodes"], r["stats"]["kernels"]) for r in rows] == \
        passes_table(capsys, "tiny-llama3")
    # the pipeline changes the graph: a table of equal rows would pass the check above too
    assert rows[0]["stats"]["nodes"] > rows[-1]["stats"]["nodes"]


def test_kernels_are_codegens(tiny_llama3: tuple[dict, Path]) -> None:
    data, _ = tiny_llama3
    spec = describe("tiny-llama3").spec
    gen = generate(optimize(lower(spec, spec.dtype)),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    assert [(k["name"], k["family"], k["launches"], k["source"]) for k in data["kernels"]] == \
        [(u.name, u.family, len(u.uses), u.source) for u in gen.units]
    assert data["launches"] == gen.launches == sum(k["launches"] for k in data["kernels"])
    assert [[(x["graph"], x["node"]) for x in k["uses"]] for k in data["kernels"]] == \
        [[(g, i) for g, i, _ in u.uses] for u in gen.units]


def test_drawn_graph_counts_as_archc_passes_counts_one_block(
        tiny_llama3: tuple[dict, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = tiny_llama3
    drawn = data["drawn"]
    assert (drawn["layers"], drawn["of"]) == (1, 2)
    table = passes_table(capsys, str(one_layer_yaml(tmp_path, "tiny-llama3")))
    assert [(s["name"], s["nodes"]) for s in drawn["steps"]] == [(p, n) for p, n, _ in table]
    for step in drawn["steps"]:     # a drawing holds the nodes it counts, each placed once
        shown = step if "graphs" in step else drawn["steps"][step["same_as"]]
        nodes = [n for g in shown["graphs"] for n in g["nodes"]]
        assert len(nodes) == step["nodes"]
        assert len({(n["x"], n["y"]) for n in nodes}) == len(nodes)


def test_each_kernel_is_beside_the_drawn_nodes_it_implements(
        tiny_llama3: tuple[dict, Path]) -> None:
    data, _ = tiny_llama3
    final = data["drawn"]["steps"][-1]
    nodes = [n for g in final["graphs"] for n in g["nodes"]]
    compute = [n for n in nodes if is_compute(Op(n["op"]))]
    # one block and the head: every kernel of the model is drawn, each compute node names one
    assert {n["kernel"] for n in compute} == {k["name"] for k in data["kernels"]}
    assert all(n["kernel"] is None for n in nodes if n not in compute)
    by_name = {k["name"]: k for k in data["kernels"]}
    for n in compute:   # the drawn node is the op its kernel implements in the whole model
        assert f"= {n['op']}(" in by_name[n["kernel"]]["uses"][0]["text"]


def test_provenance_is_the_ir_s(tiny_llama3: tuple[dict, Path]) -> None:
    data, _ = tiny_llama3
    lowered = data["drawn"]["steps"][0]["graphs"][0]["nodes"]
    assert all(n["origin"] for n in lowered)
    assert all(not n["passes"] for n in lowered)
    final = [n for g in data["drawn"]["steps"][-1]["graphs"] for n in g["nodes"]]
    fused = [n for n in final if n["op"] == "fused_linear"]
    assert fused and all(n["passes"] for n in fused)
    assert {p for n in final for p in n["passes"]} <= set(DEFAULT_PIPELINE)


def test_roofline_covers_every_launch(tiny_llama3: tuple[dict, Path]) -> None:
    data, _ = tiny_llama3
    roof = data["roofline"]
    names = {k["name"] for k in data["kernels"]}
    assert roof["prefill"]["dims"]["T"] == 16 and roof["decode"]["dims"]["P"] == 16 + 4 - 1
    assert sum(r["launches"] for r in roof["prefill"]["rows"]) == data["launches"]
    for phase in ("prefill", "decode"):
        assert all(r["kernels"] and set(r["kernels"]) <= names for r in roof[phase]["rows"])
    assert {k for r in roof["prefill"]["rows"] for k in r["kernels"]} == names


def test_the_page_embeds_the_json(tiny_llama3: tuple[dict, Path]) -> None:
    data, page = tiny_llama3
    assert embedded(page) == data
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html


def test_explain_data_is_per_pass(tiny_llama3: tuple[dict, Path]) -> None:
    data, _ = tiny_llama3
    rows = {r["name"]: r for r in data["pipeline"]["rows"]}
    assert rows["merge-qkv"]["explain"]["made"][0]["rule"] == "merge-qkv"
    assert all(not r["explain"]["made"] for r in data["pipeline"]["rows"]
               if r["changed"] == "not applied")


@pytest.mark.parametrize("kind", ["gguf", "hf", "zoo", "yaml"])
def test_every_source_kind(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    source = {"gguf": lambda: str(request.getfixturevalue("tiny_gguf")),
              "hf": lambda: str(request.getfixturevalue("tiny_hf_dir")),
              "zoo": lambda: "tiny-llama3",
              "yaml": lambda: str(ZOO_DIR / "tiny-llama3.yaml")}[kind]()
    page = tmp_path / "page.html"
    capsys.readouterr()
    assert main(["report", source, "-o", str(page), "--prompt-len", "8", "--new-tokens", "2"]) \
        == 0
    assert f"wrote {page}" in capsys.readouterr().out.replace("\n", "")
    data = embedded(page)
    assert data["model"] == describe(source).spec.name
    assert [r["name"] for r in data["pipeline"]["rows"]][1:] == list(DEFAULT_PIPELINE)


def test_encoder_decoder_draws_each_graph(capsys: pytest.CaptureFixture[str]) -> None:
    data = report_json(capsys, "tiny-t5", "--prompt-len", "8", "--new-tokens", "2")
    spec = describe("tiny-t5").spec
    graphs = [g.name for g in optimize(lower(spec, spec.dtype))]
    assert [g["name"] for g in data["drawn"]["steps"][-1]["graphs"]] == graphs
    assert data["drawn"]["layers"] == 2      # an encoder block and a decoder block


def test_a_layer_pattern_is_drawn_whole(capsys: pytest.CaptureFixture[str]) -> None:
    spec = describe("tiny-gemma2").spec
    data = report_json(capsys, "tiny-gemma2", "--prompt-len", "8", "--new-tokens", "2")
    assert data["drawn"]["layers"] == len(spec.attention.pattern) < spec.layers


def test_ahead_of_time_results_reach_the_data(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    """The compile itself is `archc compile --target`'s (slow: test_aot.py covers it); here,
    that each result lands beside its kernel."""
    compiled: list[str] = []

    def compile_module(path: Path, target: str, *, jobs: int = 2) -> list[aot.AotResult]:
        table = aot.kernel_table(path)
        compiled.extend(table)
        return [aot.AotResult(name, spec["unit"], spec["family"], target, registers=k + 1)
                for k, (name, spec) in enumerate(table.items())]
    monkeypatch.setattr(aot, "compile_module", compile_module)
    data = report_json(capsys, "tiny-llama3", "--target", "sm_90a", "--cache-dir",
                       str(tmp_path), "--prompt-len", "8", "--new-tokens", "2")
    assert data["aot"]["target"] == "sm_90a"
    assert [r["kernel"] for r in data["aot"]["results"]] == compiled
    assert {r["unit"] for r in data["aot"]["results"]} == {k["name"] for k in data["kernels"]}


@pytest.mark.parametrize("argv, message", [
    (["tiny-llama3", "-o", "/nonexistent-dir/page.html"], "does not exist"),
    (["tiny-llama3", "--device", "cpu"], "--device goes with --validate"),
    (["tiny-bert", "--new-tokens", "4"], "is an encoder: it does not decode"),
    (["tiny-llama3", "--prompt-len", "4000", "--new-tokens", "10"], "exceed max_seq_len"),
    (["tiny-llama3", "--prompt-len", "64"], "--prompt-len 64 leaves no room for a decode step "
     "within max_seq_len = 64"),
    (["tiny-bert", "--prompt-len", "4000"], "--prompt-len 4000 exceeds max_seq_len"),
    (["tiny-llama3", "--gpu", "toaster"], "unknown GPU"),
    (["no-such-model"], "no-such-model"),
])
def test_bad_input_is_one_line(argv: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_quantized_gguf_s_kernels_are_codegens(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF whose weights stay quantized: the page says which schemes, and its kernels are
    the ones codegen renders for the quantized program (dequantizing in their prologues)."""
    from tests.test_gguf import Q, hf_llama, write_gguf
    path = tmp_path / "q4_1.gguf"
    write_gguf(hf_llama(64, 96), path, Q.Q4_1)
    source = describe(str(path))
    assert source.quant, "the file's weights should stay quantized"
    data = report_json(capsys, str(path), "--prompt-len", "8", "--new-tokens", "2")
    schemes = sorted(set(source.quant.values()))
    assert sorted(data["quantized"]) == schemes
    assert data["quantized"] == {s: list(source.quant.values()).count(s) for s in schemes}
    spec = source.spec
    gen = generate(optimize(lower(spec, spec.dtype, dict(source.quant))),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    assert [(k["name"], k["source"]) for k in data["kernels"]] == \
        [(u.name, u.source) for u in gen.units]
    dense = generate(optimize(lower(spec, spec.dtype)),
                     CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    assert [k["source"] for k in data["kernels"]] != [u.source for u in dense.units]
