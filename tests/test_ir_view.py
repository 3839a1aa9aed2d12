"""The networkx view of a graph: topological order, liveness, DOT export."""

from __future__ import annotations

import networkx as nx
import pytest

from archc.ir import Op, lower
from archc.ir.view import live_ranges, to_dot, to_networkx, topological_order
from archc.spec import load_spec


@pytest.fixture(scope="module")
def program():  # noqa: ANN201
    return lower(load_spec("tiny-t5"))


def test_networkx_view_has_every_node_and_edge(program) -> None:  # noqa: ANN001
    for g in program:
        dg = to_networkx(g)
        assert dg.number_of_nodes() == len(g.nodes)
        assert dg.number_of_edges() == sum(len(n.inputs) for n in g.nodes)
        assert nx.is_directed_acyclic_graph(dg)
        for i, n in enumerate(g.nodes):
            assert [dg.edges[j, i]["slot"] for j in n.inputs] == list(range(len(n.inputs))) \
                or len(set(n.inputs)) < len(n.inputs)


def test_topological_order_respects_every_edge(program) -> None:  # noqa: ANN001
    for g in program:
        order = topological_order(g)
        position = {i: k for k, i in enumerate(order)}
        assert sorted(order) == list(range(len(g.nodes)))
        assert all(position[j] < position[i] for i, n in enumerate(g.nodes) for j in n.inputs)


def test_live_ranges_follow_views_to_their_root() -> None:
    g = lower(load_spec("tiny-llama3")).graphs[0]
    ranges = live_ranges(g)
    for i, n in enumerate(g.nodes):
        for j in n.inputs:
            assert ranges[j][0] == j and ranges[j][1] >= i
    # a view's reader keeps the viewed node alive when views are mapped to their root
    split = g.ids(Op.SPLIT_HEADS)[0]
    root = list(range(len(g.nodes)))
    root[split] = g.nodes[split].inputs[0]
    readers = [i for i, n in enumerate(g.nodes) if split in n.inputs]
    mapped = live_ranges(g, root)
    assert mapped[root[split]][1] >= max(readers)
    out = g.ids(Op.OUTPUT)[0]
    assert mapped[out][1] == len(g.nodes)


def test_dot_export_draws_compute_nodes_and_hides_params(program) -> None:  # noqa: ANN001
    dot = to_dot(program)
    assert dot.startswith('digraph "tiny-t5" {') and dot.rstrip().endswith("}")
    for g in program:
        assert f'subgraph "cluster_{g.name}"' in dot
        for i, n in enumerate(g.nodes):
            drawn = f'"{g.name}.{i}" [label="%{i} {n.op.value}' in dot
            assert drawn == (n.op != Op.PARAM)
    with_params = to_dot(program, params=True)
    assert with_params.count("[label=") == sum(len(g.nodes) for g in program)


def test_cli_prints_dot(capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    assert main(["ir", "tiny-gpt2", "--dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("digraph") and "->" in out
