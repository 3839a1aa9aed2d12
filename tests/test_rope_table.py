"""RoPE from the cos/sin table computed once at load (``rope.cos_sin``).

The table must hold, bitwise, what the rope op computed per position before it existed: the
formula is written out here as it stood (positions to f32, times the f32 inverse frequencies,
cos and sin, times YaRN's attention scale) and compared with ``torch.equal`` for every position
of the table, one at a time as a decode step sees them and as one prefill chunk — for the
default frequencies, linear, llama3 and yarn scalings (yarn with its derived and with a given
attention scale), partial rotary (phi-2, GPT-NeoX) and interleaved pairs (GPT-J). The rope op
reading the table equals that formula's rotation bitwise too. Dynamic NTK keeps computing its
angles from the frequencies. The table is a param like any other: the verifier holds it to
its expression's shape and to rotary_dim, it is not counted as a checkpoint weight, and a
rope reads only the rows at its positions. Sequences longer than the table are refused by the
session (decoder steps, encoder inputs, on eager and on the generated kernels), and a rope run
alone past it fails naming its node.

No tolerances: eager and kernels read the same table values, and the table equals the old
values exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

import archc
from archc.errors import IRError, RunError
from archc.ir import cost
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder, Node, Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.ops.attention import rope
from archc.ir.paramexpr import evaluate, rope_cos_sin, rope_inv_freq
from archc.ir.shapes import T, shape
from archc.ir.verify import verify
from archc.runtime.eager import EagerContext, EagerSession, run_graph
from archc.spec import from_dict, load_spec
from archc.spec.load import to_dict
from archc.spec.schema import Spec
from tests.test_triton_kernels import build


def variant(base: str, max_seq_len: int | None = None, **position: object) -> Spec:
    """Zoo spec `base` with position fields replaced (and another max_seq_len)."""
    data = to_dict(load_spec(base))
    data["position"] = {**data.get("position", {}), **position}
    if max_seq_len is not None:
        data["max_seq_len"] = max_seq_len
    return from_dict(data)


def old_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor,
                mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rope op's per-call formula before the table: (T, R/2) cos and sin."""
    angles = pos.to(torch.float32)[:, None] * inv_freq.float()[None, :]
    return angles.cos() * mscale, angles.sin() * mscale


def old_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int,
             interleaved: bool, mscale: float) -> torch.Tensor:
    """The rope op's rotation before the table, as it was written."""
    cos, sin = old_cos_sin(pos, inv_freq, mscale)
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :rotary_dim // 2], rot[..., rotary_dim // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def the_param(program: Program, name: str) -> Node | None:
    return next((n for g in program for n in g if n.op == Op.PARAM and n.name == name), None)


YARN = dict(kind="yarn", factor=4.0, original_max_seq_len=512)
CASES = {
    # name: (spec, the frequencies as the scaling defines them, the cos/sin scale)
    "default": (variant("tiny-llama3", 1024), dict(theta=500000.0), 1.0),
    "linear": (variant("tiny-llama2", 1024, scaling=dict(kind="linear", factor=2.0)),
               dict(theta=10000.0, kind="linear", factor=2.0), 1.0),
    "llama3": (variant("tiny-llama3", 4096, scaling=dict(
        kind="llama3", factor=8.0, original_max_seq_len=512, low_freq_factor=1.0,
        high_freq_factor=4.0)), dict(theta=500000.0, kind="llama3", factor=8.0,
                                     original_max_seq_len=512, low_freq_factor=1.0,
                                     high_freq_factor=4.0), 1.0),
    "yarn": (variant("tiny-llama2", 2048, scaling=YARN),
             dict(theta=10000.0, beta_fast=32.0, beta_slow=1.0, **YARN),
             0.1 * math.log(4.0) + 1.0),
    "yarn-attention-factor": (variant("tiny-llama2", 2048, scaling=dict(
        attention_factor=1.25, **YARN)), dict(theta=10000.0, beta_fast=32.0, beta_slow=1.0,
                                              **YARN), 1.25),
    "phi2-partial": (variant("tiny-phi2"), dict(theta=10000.0), 1.0),
    "neox-partial": (variant("tiny-neox"), dict(theta=10000.0), 1.0),
    "gptj-interleaved": (variant("tiny-gptj"), dict(theta=10000.0), 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_table_equals_the_per_position_formula_bitwise(case: str) -> None:
    spec, freq_kw, mscale = CASES[case]
    node = the_param(lower(spec, "f32"), "rope.cos_sin")
    assert node is not None and the_param(lower(spec, "f32"), "rope.inv_freq") is None
    rot = spec.rotary_dim
    assert tuple(int(d) for d in node.shape) == (spec.max_seq_len, 2, rot // 2)
    assert node.dtype == "f32"
    table = evaluate(node.attr("expr"), {})
    assert table.dtype == torch.float32 and table.shape == (spec.max_seq_len, 2, rot // 2)
    inv_freq = rope_inv_freq(dim=rot, **freq_kw)   # the frequencies, independently of lowering
    for p in range(spec.max_seq_len):              # a decode step: one position per call
        cos, sin = old_cos_sin(torch.tensor([p]), inv_freq, mscale)
        assert torch.equal(table[p, 0], cos[0]) and torch.equal(table[p, 1], sin[0]), p
    pos = torch.arange(3, spec.max_seq_len)        # a prefill chunk over a past of 3
    cos, sin = old_cos_sin(pos, inv_freq, mscale)
    assert torch.equal(table[pos, 0], cos) and torch.equal(table[pos, 1], sin)


@pytest.mark.parametrize("case", ["default", "yarn", "phi2-partial", "gptj-interleaved"])
def test_rope_op_reading_the_table_equals_the_old_rotation_bitwise(case: str) -> None:
    spec, freq_kw, mscale = CASES[case]
    rot, hd = spec.rotary_dim, spec.attention.head_dim
    inv_freq = rope_inv_freq(dim=rot, **freq_kw)
    table = rope_cos_sin(inv_freq, rows=spec.max_seq_len, mscale=mscale)
    x = torch.randn(2, 3, 7, hd, generator=torch.Generator().manual_seed(0))
    for pos in (torch.arange(0, 7), torch.arange(spec.max_seq_len - 7, spec.max_seq_len)):
        interleaved = spec.position.interleaved
        got = rope(x, pos, table, rot, interleaved)
        assert torch.equal(got, old_rope(x, pos, inv_freq, rot, interleaved, mscale))


def test_dynamic_ntk_keeps_the_frequencies() -> None:
    """Dynamic NTK's frequencies depend on the sequence length: no table, the rope ops read
    the inverse frequencies and carry `dynamic`."""
    program = lower(load_spec("tiny-longctx"), "f32")
    assert the_param(program, "rope.cos_sin") is None
    freq = the_param(program, "rope.inv_freq")
    assert freq is not None and tuple(int(d) for d in freq.shape) == (8,)
    ropes = [n for g in program for n in g if n.op == Op.ROPE]
    assert ropes and all(n.attr("dynamic") is not None for n in ropes)


def replaced(program: Program, i_of: str, node: Node) -> Program:
    """The program with the named param replaced by `node`."""
    g = program.graphs[0]
    i = next(k for k, n in enumerate(g.nodes) if n.name == i_of)
    nodes = list(g.nodes)
    nodes[i] = node
    return Program(program.model, (Graph(g.name, tuple(nodes)), *program.graphs[1:]))


def test_verifier_holds_the_table_to_its_expression_and_rotary_dim() -> None:
    program = lower(load_spec("tiny-llama3"), "f32")
    verify(program)
    node = the_param(program, "rope.cos_sin")
    assert node is not None
    # rows other than the expression's (max_seq_len = 64)
    short = node.replace(shape=shape(32, 2, 8))
    with pytest.raises(IRError, match=r"rope.cos_sin.*shape should be \[64, 2, 8\]"):
        verify(replaced(program, "rope.cos_sin", short))
    # a table made for another rotary_dim: the param agrees with its expression, the rope
    # ops (rotary_dim 16) do not take it
    other = Call("rope_cos_sin", (Call("rope_inv_freq", (), (("dim", 8), ("theta", 1.0))),),
                 (("rows", 64),))
    wrong = node.replace(shape=shape(64, 2, 4), attrs=node.attrs.replace(expr=other))
    with pytest.raises(IRError, match=r"cos/sin table \[64, 2, 4\] must be "
                                      r"\[max_seq_len, 2, 8\]"):
        verify(replaced(program, "rope.cos_sin", wrong))


def test_the_table_is_a_buffer_not_a_weight_and_a_rope_reads_its_rows() -> None:
    spec = load_spec("tiny-llama3")
    program = lower(spec, "f32")
    weights = archc.load("tiny-llama3").weights
    assert cost.parameter_count(program) == sum(t.numel() for t in weights.values())
    g = program.graphs[0]
    i = g.ids(Op.ROPE)[0]
    x = g.nodes[g.nodes[i].inputs[0]].shape       # [B, H, T, D]
    n_x = int(x[1]) * 5 * int(x[3])               # B = 1, T = 5
    rows = 5 * 2 * (spec.rotary_dim // 2)         # the 5 rows it reads, not max_seq_len
    assert cost.node_cost(g, i).at({"B": 1, "T": 5, "P": 0, "S": 0})[1] == \
        2 * n_x * 4 + 5 * 8 + rows * 4


def test_a_position_past_the_table_is_refused_naming_the_rope_node() -> None:
    """Run on its own (no session to check the length first), the rope op's gather refuses a
    row past the table, and the interpreter names the node."""
    table = rope_cos_sin(rope_inv_freq(dim=8, theta=10000.0), rows=16)

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.ROPE, i["x"], i["pos"], i["table"], rotary_dim=8, interleaved=False)

    g = build({"x": (shape(1, 2, T, 8), "f32"), "pos": (shape(T), "i64"),
               "table": (shape(16, 2, 4), "f32")}, fn)
    values = {"x": torch.zeros(1, 2, 3, 8), "table": table}
    run_graph(g, {}, {**values, "pos": torch.arange(13, 16)}, EagerContext({"T": 3, "P": 0}))
    with pytest.raises(RunError, match=r"while running %3 : .* = rope\(%0, %1, %2\) .*: "
                                      r"IndexError: index 16 is out of bounds"):
        run_graph(g, {}, {**values, "pos": torch.arange(15, 18)}, EagerContext({"T": 3, "P": 0}))


def test_a_session_longer_than_the_table_is_refused() -> None:
    """A session sized past the model's max_seq_len: the KV cache has room, the table not."""
    model = archc.load("tiny-llama3", seed=1)
    program = lower(model.spec, "f32")
    session = EagerSession(program, model.weights, max_seq_len=2 * model.spec.max_seq_len)
    session.step(torch.zeros(1, model.spec.max_seq_len, dtype=torch.long))
    with pytest.raises(RunError, match=r"65 tokens is longer than the RoPE table's 64"):
        session.step(torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_an_encoder_input_longer_than_the_table_is_refused(tmp_path: Path, backend: str) -> None:
    """An encoder has no KV cache to bound its positions: its input length is checked."""
    data = to_dict(load_spec("tiny-bert"))
    data["position"] = {"kind": "rope", "theta": 10000.0}
    data["name"] = "tiny-bert-rope"
    path = tmp_path / "tiny-bert-rope.yaml"
    path.write_text(yaml.safe_dump(data))
    model = archc.load(path, seed=1)
    rows = model.spec.max_seq_len
    compiled = model.compile(backend, dtype="f32", cache_dir=tmp_path / "kernels") \
        if backend == "triton" else model.compile(backend, dtype="f32")
    ok = compiled(torch.zeros(1, 3, dtype=torch.long))
    assert ok.shape[1] == 3
    with pytest.raises(RunError, match=rf"{rows + 1} tokens is longer than the RoPE table's "
                                       rf"{rows} positions"):
        compiled(torch.zeros(1, rows + 1, dtype=torch.long))
