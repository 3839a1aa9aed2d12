"""Collective ops and communicators: what a rank gets from each collective, in simulated ranks
(threads of one process) and through the eager interpreter, and a weight's tensor-parallel
slice (`shard()`), plain or quantized. Exact: the sums are of the same values in rank order."""

from __future__ import annotations

import pytest
import torch

from archc.errors import RunError
from archc.ir.graph import GraphBuilder
from archc.ir.ops import Op
from archc.ir.paramexpr import shard
from archc.ir.shapes import B, T, shape
from archc.ir.verify import verify_graph
from archc.runtime.comm import LocalComm, SimulatedComm, SimulatedWorld, run_simulated
from archc.runtime.eager import EagerContext, run_graph
from tests.test_quant_core import random_qtensor


def values(n: int) -> list[torch.Tensor]:
    return [torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(r)) for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_simulated_collectives(n: int) -> None:
    xs, world = values(n), SimulatedWorld(n)

    def rank(r: int) -> dict[str, torch.Tensor]:
        c = SimulatedComm(world, r)
        return {"sum": c.all_reduce(xs[r]), "gather": c.all_gather(xs[r], 1),
                "scatter": c.reduce_scatter(xs[r], -1) if 8 % n == 0 else xs[r],
                "ring": c.ring_pass([xs[r]])[0]}

    out = run_simulated(n, rank)
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    for r, got in enumerate(out):
        assert torch.equal(got["sum"], total)
        assert torch.equal(got["gather"], torch.cat(xs, 1))
        if 8 % n == 0:
            assert torch.equal(got["scatter"], total.chunk(n, -1)[r])
        assert torch.equal(got["ring"], xs[(r - 1) % n])


def test_a_failing_rank_stops_the_others() -> None:
    world = SimulatedWorld(3, timeout=30)

    def rank(r: int) -> torch.Tensor:
        if r == 1:
            world.barrier.abort()
            raise ValueError("rank 1 failed")
        return SimulatedComm(world, r).all_reduce(torch.ones(2))

    with pytest.raises((ValueError, RunError)):
        run_simulated(3, rank)


def test_collective_ops_run_on_eager_in_simulated_ranks() -> None:
    b = GraphBuilder("g")
    x = b.input("x", shape(B, T, 8), "f32")
    s = b.emit(Op.ALL_REDUCE, x, group="tp", ranks=2)
    g = b.emit(Op.ALL_GATHER, s, group="tp", ranks=2)
    y = b.emit(Op.REDUCE_SCATTER, g, group="tp", ranks=2)
    b.output("y", b.emit(Op.RING_PASS, y, group="tp", ranks=2))
    graph = b.build()
    verify_graph(graph)
    assert tuple(graph.nodes[g].shape) == (B, T, 16)
    xs, world = values(2), SimulatedWorld(2)

    def rank(r: int) -> torch.Tensor:
        ctx = EagerContext({"B": 2, "T": 3, "P": 0, "S": 0}, comms={"tp": SimulatedComm(world, r)})
        return run_graph(graph, {}, {"x": xs[r]}, ctx)["y"]

    out = run_simulated(2, rank)
    total = xs[0] + xs[1]
    # gather then scatter of the sum: each rank's slice of 2·total, then passed round the ring
    for r in range(2):
        assert torch.equal(out[r], (torch.cat([total, total], -1) * 2).chunk(2, -1)[(r - 1) % 2])
    with pytest.raises(RunError, match="sharded over 2 tp ranks; this run has 1"):
        run_graph(graph, {}, {"x": xs[0]}, EagerContext({"B": 2, "T": 3, "P": 0, "S": 0}))
    assert torch.equal(LocalComm().all_reduce(xs[0]), xs[0])


@pytest.mark.parametrize("name", ["f32", "q4_k", "int4_g32", "int8_ch", "q6_k"])
def test_shard_takes_a_ranks_slice(name: str) -> None:
    w = torch.randn(6, 1024) if name == "f32" else random_qtensor(name, (6, 1024))
    dense = w if name == "f32" else w.dequantize()
    for rank in range(4):
        cols = shard(w, 1, 4, rank=rank)
        assert torch.equal(cols if name == "f32" else cols.dequantize(),
                           dense[:, rank * 256:(rank + 1) * 256])
        rows = shard(w, 0, 2, every=2, rank=rank)     # ranks 0, 1 share part 0; 2, 3 part 1
        assert torch.equal(rows if name == "f32" else rows.dequantize(),
                           dense[(rank // 2) * 3:(rank // 2) * 3 + 3])
