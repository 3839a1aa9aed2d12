"""The text form round-trips for every zoo spec, and the verifier refuses broken graphs."""

from __future__ import annotations

import dataclasses

import pytest
import sympy

from archc.errors import IRError
from archc.ir import Op, format_program, lower, parse_program, verify
from archc.ir.attrs import Attrs, Call, parse_value
from archc.ir.graph import Graph, Program
from archc.ir.shapes import P, T, parse_dim
from archc.spec import load_spec
from tests.conftest import ALL_SPECS


@pytest.mark.parametrize("name", ALL_SPECS)
def test_roundtrip_with_provenance(name: str) -> None:
    program = lower(load_spec(name))
    text = format_program(program, provenance=True)
    assert parse_program(text) == program
    verify(parse_program(text))


def test_roundtrip_without_provenance_drops_only_provenance() -> None:
    program = lower(load_spec("tiny-gemma2"))
    parsed = parse_program(format_program(program))
    stripped = Program(program.model, tuple(
        Graph(g.name, tuple(dataclasses.replace(n, origin="", passes=()) for n in g.nodes))
        for g in program.graphs))
    assert parsed == stripped


@pytest.mark.parametrize("text", ["P+T", "2*T", "576", "(P+T)*4", "B*T-1"])
def test_dims_parse_back(text: str) -> None:
    from archc.ir.shapes import format_dim
    d = parse_dim(text)
    assert parse_dim(format_dim(d)) == d


def test_dim_parser_refuses_python() -> None:
    with pytest.raises(ValueError):
        parse_dim("__import__('os')")
    with pytest.raises(ValueError):
        parse_dim("Q+1")
    assert parse_dim("P+T") == P + T


@pytest.mark.parametrize("value", [
    1, -3, 0.1, 1e-05, 1e20, "a \"quoted\" name", True, False, None, (), (1, 2.5, "x"),
    Call("cat", (Call("w", ("layers.0.q.weight",)), Call("w", ("k",))), (("dim", 0),)),
])
def test_attr_values_roundtrip(value: object) -> None:
    from archc.ir.attrs import format_value
    assert parse_value(format_value(value)) == value


def _mutate(program: Program, index: int, **changes: object) -> Program:
    g = program.graphs[0]
    nodes = list(g.nodes)
    nodes[index] = dataclasses.replace(nodes[index], **changes)
    return Program(program.model, (Graph(g.name, tuple(nodes)),))


def _first(program: Program, op: Op) -> int:
    return program.graphs[0].ids(op)[0]


def test_verifier_refuses_wrong_shape() -> None:
    program = lower(load_spec("tiny-llama3"))
    i = _first(program, Op.MATMUL)
    bad = _mutate(program, i, shape=(sympy.Integer(1), T, sympy.Integer(64)))
    with pytest.raises(IRError, match=rf"%{i} .*matmul.*shape should be"):
        verify(bad)


def test_verifier_refuses_forward_reference() -> None:
    program = lower(load_spec("tiny-llama3"))
    i = _first(program, Op.MATMUL)
    bad = _mutate(program, i, inputs=(i + 5, program.graphs[0].nodes[i].inputs[1]))
    with pytest.raises(IRError, match="not an earlier node"):
        verify(bad)


def test_verifier_refuses_unknown_attribute() -> None:
    program = lower(load_spec("tiny-llama3"))
    i = _first(program, Op.SOFTMAX)
    bad = _mutate(program, i, attrs=Attrs(dim=-1))
    with pytest.raises(IRError, match="unknown attribute dim"):
        verify(bad)


def test_verifier_refuses_wrong_dtype() -> None:
    program = lower(load_spec("tiny-llama3"))
    i = _first(program, Op.NORM)
    with pytest.raises(IRError, match="dtype should be f32"):
        verify(_mutate(program, i, dtype="f16"))


def test_verifier_refuses_duplicate_param_names() -> None:
    program = lower(load_spec("tiny-llama3"))
    params = program.graphs[0].ids(Op.PARAM)
    bad = _mutate(program, params[1], attrs=program.graphs[0].nodes[params[0]].attrs)
    with pytest.raises(IRError, match="already used"):
        verify(bad)


def test_parser_names_the_line() -> None:
    text = format_program(lower(load_spec("tiny-gpt2")))
    broken = text.replace("= softmax(", "= softmux(", 1)
    with pytest.raises(IRError, match=r"line \d+: unknown op 'softmux'"):
        parse_program(broken)


def test_ir_reference_is_current() -> None:
    """docs/ir-reference.md is generated from the op table; regenerate with
    `python -m archc.ir.reference > docs/ir-reference.md`."""
    from pathlib import Path

    from archc.ir.ops import OP_TABLE
    from archc.ir.reference import reference
    doc = Path(__file__).resolve().parents[1] / "docs" / "ir-reference.md"
    text = reference()
    assert all(f"| `{op.value}` |" in text for op in OP_TABLE)
    assert doc.read_text(encoding="utf-8") == text
