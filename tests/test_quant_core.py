"""Quantized weights in the IR and on eager: the planar layout holds every code exactly, row
functions keep a weight quantized and equal the same functions on its values, the IR prints,
parses and verifies quantized params, and the default pipeline keeps the function of every tiny
spec whose linear weights are quantized (fold-norms then scales activations, not weights).

Tolerance for the pipeline: 1e-5 of the output scale in f32, as in test_translation (the same
sums, reordered); a gain applied twice or not at all shows at 1e-2 and more."""

from __future__ import annotations

import pytest
import torch

from archc.dtypes import TORCH_DTYPES
from archc.errors import IRError, WeightsError
from archc.ir.attrs import Attrs
from archc.ir.graph import GraphBuilder, Node
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.paramexpr import PARAM_FNS, ROW_FNS
from archc.ir.shapes import shape
from archc.ir.text import format_program, parse_program
from archc.ir.verify import verify, verify_graph
from archc.passes import run_pipeline
from archc.quant import SCHEMES, QTensor
from archc.quant.pack import pack_codes, quantize
from archc.runtime.eager import EagerSession
from archc.runtime.weights import quant_schemes, quantizable, random_weights
from archc.spec import load_spec
from tests.conftest import TINY_SPECS


def random_qtensor(name: str, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    """Random codes and scales of scheme `name` (scales small and positive, offsets signed)."""
    s = SCHEMES[name]
    gen = torch.Generator().manual_seed(seed)
    low, high = (-128, 128) if s.bits == 8 else (0, 1 << s.bits)
    codes = torch.randint(low, high, shape, generator=gen)
    parts = pack_codes(s, codes)
    for part, ((rows, cols), dtype) in s.part_shapes(shape[-2], shape[-1]).items():
        if part in parts:
            continue
        dims = (*shape[:-2], rows, cols)
        if dtype in ("u8", "i8"):
            value = torch.randint(1 if dtype == "u8" else -32, 64, dims, generator=gen)
        else:
            value = torch.rand(dims, generator=gen) * 0.02 + (0.001 if part != "min" else -0.01)
        parts[part] = value.to(TORCH_DTYPES[dtype])
    return QTensor(s, shape, parts)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("k", [32, 77, 256, 300])
def test_codes_round_trip_through_the_planar_layout(name: str, k: int) -> None:
    s = SCHEMES[name]
    low, high = (-128, 128) if s.bits == 8 else (0, 1 << s.bits)
    codes = torch.randint(low, high, (2, 3, k), generator=torch.Generator().manual_seed(k))
    q = random_qtensor(name, (2, 3, k))
    q = QTensor(s, (2, 3, k), {**q.parts, **pack_codes(s, codes)})
    assert torch.equal(q.codes(), codes.to(torch.int32))
    assert q.nbytes == sum(p.numel() * p.element_size() for p in q.parts.values())


def test_a_scheme_value_is_its_formula() -> None:
    """q4_k: (d·sc)·c − dmin·mn per element, computed independently here."""
    q = random_qtensor("q4_k", (2, 512), seed=3)
    c = q.codes().float()
    d = q.parts["d"].float().repeat_interleave(256, -1)
    sc = q.parts["sc"].float().repeat_interleave(32, -1)
    dmin = q.parts["dmin"].float().repeat_interleave(256, -1)
    mn = q.parts["mn"].float().repeat_interleave(32, -1)
    assert torch.equal(q.dequantize(), (d * sc) * c - dmin * mn)


@pytest.mark.parametrize("fn,kw", [("interleave", {}), ("rows", {"start": 2, "stop": 6}),
                                   ("rope_pairs", {"heads": 2, "head_dim": 4, "rotary_dim": 2,
                                                   "interleaved": False})])
def test_row_functions_keep_a_weight_quantized_and_its_values(fn: str, kw: dict) -> None:
    q = random_qtensor("q6_k", (8, 256))
    out = ROW_FNS[fn](q, **kw)
    assert isinstance(out, QTensor)
    assert torch.equal(out.dequantize(), PARAM_FNS[fn](q.dequantize(), **kw))


def test_join_along_k_needs_whole_groups() -> None:
    a, b = random_qtensor("int4_g32", (4, 64)), random_qtensor("int4_g32", (4, 40), seed=1)
    assert torch.equal(QTensor.cat([a, b], dim=1).dequantize(),
                       torch.cat([a.dequantize(), b.dequantize()], dim=1))
    with pytest.raises(WeightsError, match="multiples of 32"):
        QTensor.cat([b, a], dim=1)
    with pytest.raises(WeightsError, match="different schemes"):
        QTensor.cat([a, random_qtensor("int4_g64", (4, 64))], dim=0)


def test_round_to_nearest_error_is_half_a_step() -> None:
    w = torch.randn(6, 200, generator=torch.Generator().manual_seed(0))
    for kind, group in (("int8", 128), ("int4", 32), ("int4", 64), ("int4", 128)):
        q = quantize(w, kind, group)
        step = q.parts["scale"].float().repeat_interleave(
            200 if kind == "int8" else group, -1)[:, :200]
        assert bool(((q.dequantize() - w).abs() <= step / 2 * (1 + 1e-3) + 1e-7).all()), kind


def _quantized(name: str, mixed: bool = True) -> tuple[object, dict]:
    """A tiny spec's random weights with its linear weights quantized: in two schemes by turns
    (`mixed`: merges of Q/K/V, gate/up must refuse them), or all int4 (merges apply)."""
    spec = load_spec(name)
    weights = random_weights(lower(spec))
    for i, k in enumerate(quantizable(lower(spec))):
        weights[k] = quantize(weights[k], "int4" if i % 2 or not mixed else "int8", 32)
    return spec, weights


def test_quantized_params_print_parse_and_verify() -> None:
    spec, weights = _quantized("tiny-llama3")
    program = lower(spec, quant=quant_schemes(weights))
    assert {n.dtype for g in program for n in g if n.name == "layers.0.attn.q.weight"} \
        == {"int8_ch"}
    text = format_program(program)
    assert "int8_ch[" in text and "int4_g32[" in text
    again = parse_program(text)
    verify(again)
    assert format_program(again) == text


def test_a_quantized_param_is_read_only_as_a_weight() -> None:
    b = GraphBuilder("g")
    x = b.input("x", shape(4, 64), "f32")
    w = b.param("w", shape(4, 64), "int4_g32")
    b.nodes.append(Node(Op.ADD, (x, w), Attrs({}), shape(4, 64), "f32"))
    b.output("y", len(b.nodes) - 1)
    with pytest.raises(IRError, match="reads a quantized weight only as"):
        verify_graph(b.build())
    b = GraphBuilder("g")
    t = b.param("t", shape(10, 64), "q8_0")
    ids = b.input("ids", shape(4), "i64")
    with pytest.raises(IRError, match="quantized table needs dtype"):
        b.emit(Op.EMBEDDING, t, ids)
    y = b.emit(Op.EMBEDDING, t, ids, dtype="f16")
    assert b.nodes[y].dtype == "f16"


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "int4"])
@pytest.mark.parametrize("name", TINY_SPECS)
def test_the_pipeline_keeps_the_function_of_quantized_models(name: str, mixed: bool) -> None:
    spec, weights = _quantized(name, mixed)
    unfused = lower(spec, quant=quant_schemes(weights))
    run = run_pipeline(unfused)
    ids = torch.randint(0, spec.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    outs = []
    for program in (unfused, run.program):
        s = EagerSession(program, weights, max_seq_len=spec.max_seq_len)
        if spec.family == "decoder":
            outs.append(torch.cat([s.step(ids), s.step(ids[:, :1])], 1))
        elif spec.family == "encoder":
            outs.append(s.encode(ids))
        else:
            outs.append(s.step(ids[:, :3], encoder_hidden=s.encode(ids)))
    err = (outs[0] - outs[1]).abs().max() / outs[0].abs().max()
    assert err <= 1e-5, f"{name}: {err:.2e}"
    kept = [n.name for g in run.program for n in g if n.op.value == "param"
            and n.dtype in SCHEMES]
    assert kept, "no weight stayed quantized through the pipeline"
    folds = [d for d in run.decisions() if d.rule.startswith("fold-") and d.verdict == "applied"
             and "norm" in d.rule]
    assert all("scales the activations" in d.reason for d in folds)


def test_explain_says_why_a_gain_scales_activations(capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    assert main(["explain", "tiny-llama3", "--quantize", "int4", "--group", "32"]) == 0
    out = capsys.readouterr().out
    assert "fold-rmsnorm ×5: the gain scales the activations instead of the int4_g32 weights, " \
        "whose stored values cannot change" in " ".join(out.split())
    assert main(["explain", "tiny-llama3"]) == 0
    assert "scales the activations" not in capsys.readouterr().out
