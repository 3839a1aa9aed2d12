"""The MoE routing kernel and the down projection that sums each token's pairs itself.

- Routing: the table of (token, slot) pairs sorted by expert and padded per expert to BLOCK_M, and
  each block's expert, equal those of a plain torch version (below) on gates with ties and exact
  zeros, experts no token picks, top-1 to top-8, expert counts that are not powers of two, and
  enough tokens to span many chunks of the routing's token loop — by the routing kernel (gates
  from an input) and by a router's last program (gates from the router, over several programs).
- The down projection: its last arriving program per (token, column tile) adds the token's
  partials and runs the epilogue; the result agrees with eager, and the arrival counters are back
  to zero after the run (a second run of the same plan gives the same output).
- Whole models: tiny-mixtral and tiny-jamba, prefill then token-by-token decode, agree with eager
  at 1e-4 (f32), with the expert weight tiles from pointer loads and from tensor descriptors
  (TMA), the latter with column tiles of 128 weight rows that run past an expert's last row.
- The gated up projection: the passes stack each expert's gate and up rows interleaved (exactly
  the permuted stack) and the kernel's one accumulator, split in registers, agrees with eager
  over gate-first rows on both load paths, with column tiles that end inside an expert.
Without a GPU the kernels run under Triton's interpreter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import archc
from archc.codegen import blocks
from archc.ir.attrs import Call
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.ops.core import selected_experts
from archc.ir.paramexpr import PARAM_FNS
from archc.ir.shapes import B, T, shape
from archc.passes import optimize
from archc.runtime.eager import EagerContext, KVCache, run_graph
from archc.runtime.launch import LaunchPlan
from archc.runtime.triton_backend import TritonOptions, TritonSession
from archc.runtime.weights import materialize
from archc.spec import load_spec
from archc.spec.load import layer_ffns
from tests.test_triton_kernels import build
from tests.triton_graph import run_graph_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4                                   # f32, relative to the output's largest magnitude


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def reference_routing(gates: torch.Tensor, top_k: int, block_m: int, blocks_: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing in plain torch ops: (table, block expert) for `blocks_` blocks of `block_m`
    slots — pairs p = token·k + slot sorted by expert (stable), each expert's run padded to
    `block_m` with −1, and the expert of each block (−1 past the end)."""
    n_experts = gates.shape[-1]
    chosen = selected_experts(gates.reshape(-1, n_experts), top_k)  # (M, k), ascending experts
    experts = chosen.reshape(-1)                                     # pair p = token·k + slot
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=n_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    start = ends - padded                                            # each expert's first slot
    first = torch.cumsum(counts, 0) - counts                         # its first sorted pair
    sorted_experts = experts[order]
    dest = start[sorted_experts] + torch.arange(experts.numel()) - first[sorted_experts]
    table = torch.full((blocks_ * block_m,), -1, dtype=torch.int32)
    table[dest] = order.to(torch.int32)
    owner = torch.searchsorted(ends, torch.arange(blocks_) * block_m, right=True)
    return table, torch.where(owner < n_experts, owner, -1).to(torch.int32)


def tied_gates(tokens: int, n_experts: int, idle: int, seed: int) -> torch.Tensor:
    """Gates in quarters from 0 to 1 (ties and exact zeros everywhere); the last `idle` experts
    below every other gate, so no token picks them; one row all equal."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randint(0, 5, (1, tokens, n_experts), generator=gen).float() / 4
    g[..., n_experts - idle:] = -1.0
    g[0, tokens // 2] = 0.5
    return g


def moe_session(n_experts: int, top_k: int, *, router: bool, d: int = 8, f: int = 16,
                kernel_dir: Path | None = None) -> tuple[TritonSession, Any]:
    """A session over x → up (SiLU) → down (+ x). The gates are an input (tests choose them:
    the routing kernel routes), or with `router` come from x through a router (its last
    program routes)."""
    def fn(b: Any, i: dict[str, int]) -> int:
        gates = (b.emit(Op.ROUTER, i["x"], i["wr"], top_k=top_k, normalize=True) if router
                 else i["gates"])
        h = b.emit(Op.MOE_LINEAR, i["x"], gates, i["up"], stage="up", top_k=top_k,
                   epilogue=(Call("act", (), (("fn", "silu"),)),))
        return b.emit(Op.MOE_LINEAR, h, gates, i["down"], i["x"], stage="down",
                      top_k=top_k, epilogue=(Call("residual"),))

    gates = {"wr": (shape(n_experts, d), "f32")} if router else \
        {"gates": (shape(B, T, n_experts), "f32")}
    g = build({"x": (shape(B, T, d), "f32"), **gates, "up": (shape(n_experts, f, d), "f32"),
               "down": (shape(n_experts, d, f), "f32")}, fn)
    s = TritonSession(Program(g.name, (g,)), {}, max_seq_len=8, device=DEVICE,
                      options=TritonOptions(passes=None, cache_dir=kernel_dir))
    return s, g


Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]   # gates, table, blocks, BLOCK_P


def _tables(args: tuple[Any, ...], block_p: int) -> tuple[int, int] | None:
    """Where a routing launch's table and block experts are among its arguments: the first
    two consecutive i32 tensors of which the second has a block for every BLOCK_P slots of the
    first (a parallel routing's chunk counts come before them)."""
    for i in range(len(args) - 1):
        a, b = args[i], args[i + 1]
        if all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 for t in (a, b)) and \
                b.numel() * block_p == a.numel():
            return i, i + 1
    return None


def routings(plan: LaunchPlan) -> list[Routing]:
    """What the plan's routing writes, once per table: the launches with a BLOCK_P (a routing
    kernel, the two launches of a parallel routing, or a router whose last program routes)
    read the gates (their first argument) and write the table and block experts."""
    found: dict[int, Routing] = {}
    for _, args, kw in plan.launches:
        if "BLOCK_P" in kw and (at := _tables(args, kw["BLOCK_P"])) is not None:
            table, block_expert = args[at[0]], args[at[1]]
            found.setdefault(id(table), (args[0], table, block_expert, kw["BLOCK_P"]))
    return list(found.values())


def parallel_routings(plan: LaunchPlan) -> int:
    """Launches of a parallel routing (chunk counts, then placement): their chunk counts come
    just before the table."""
    return sum(1 for _, args, kw in plan.launches if "BLOCK_P" in kw and
               (at := _tables(args, kw["BLOCK_P"])) is not None and at[0] == 2)


def counters(plan: LaunchPlan, past: torch.Tensor) -> list[torch.Tensor]:
    """The i32 tensors the plan's launches take besides the routing's tables, its chunk counts
    and P: the arrival counters."""
    known = {id(past)} | {id(t) for _, *tables, _ in routings(plan) for t in tables}
    known |= {id(args[1]) for _, args, kw in plan.launches if "BLOCK_P" in kw and
              (at := _tables(args, kw["BLOCK_P"])) is not None and at[0] == 2}
    return [a for _, args, _ in plan.launches for a in args
            if isinstance(a, torch.Tensor) and a.dtype == torch.int32 and id(a) not in known]


def rand(*dims: int, seed: int) -> torch.Tensor:
    return torch.randn(*dims, generator=torch.Generator().manual_seed(seed))


def small_blocks(monkeypatch: pytest.MonkeyPatch, route_last: bool = True) -> None:
    """Routing loops over chunks of 16 tokens (table slots, blocks), and routers over programs
    of 16 tokens: a few dozen tokens span several of each. More than 16 tokens of gates from
    anywhere are routed chunk by chunk in parallel; a router's last program routes them all
    (`route_last`) or they are routed in parallel after it."""
    config = blocks.launch_config

    def small(family: str, target: str, **sizes: int) -> dict[str, Any]:
        cfg = config(family, target, **sizes)
        if "BLOCK_R" in cfg and family in ("moe_routing", "router"):
            cfg["BLOCK_R"] = 16
        if family == "router":
            cfg["BLOCK_M"] = 16
        if "ROUTE_LAST" in cfg:
            cfg["ROUTE_LAST"] = int(route_last or sizes["M"] <= 16)
        return cfg

    monkeypatch.setattr(blocks, "launch_config", small)


def run_moe(n_experts: int, top_k: int, tokens: int, gates: torch.Tensor | None,
            kernel_dir: Path, *, parallel: bool) -> None:
    """Route and run x → up → down on the kernels — routed in parallel, or by one program — the
    table equals the torch version from the gates the kernels read, the output eager's, and the
    counters are back to zero."""
    s, g = moe_session(n_experts, top_k, router=gates is None, kernel_dir=kernel_dir)
    runner = s.runners[g.name]
    s.cache.ensure(1)
    s.states.ensure(1)
    plan = runner.plan(s.ctx, B=1, T=tokens, P=0, S=0, kv_len_max=tokens)
    d, f = 8, 16
    inputs = {"x": rand(1, tokens, d, seed=1), "up": rand(n_experts, f, d, seed=2) / d ** 0.5,
              "down": rand(n_experts, d, f, seed=3) / f ** 0.5,
              **({"wr": rand(n_experts, d, seed=4)} if gates is None else {"gates": gates})}
    runner.feed(plan, inputs)
    runner.execute(plan, s.ctx, 0)
    [(read, table, block_expert, block_p)] = routings(plan)   # one routing for both stages
    assert parallel_routings(plan) == (2 if parallel else 0)
    want_table, want_blocks = reference_routing(read.cpu(), top_k, block_p, block_expert.numel())
    assert torch.equal(table.cpu(), want_table)
    assert torch.equal(block_expert.cpu(), want_blocks)

    # the down projection's sum of pairs agrees with eager, and leaves its counters at zero
    want = run_graph(g, {}, inputs, EagerContext({"B": 1, "T": tokens, "P": 0}, KVCache(8)))["y"]
    first = plan.outputs["y"].cpu().clone()
    assert (first - want).abs().max() <= TOL * want.abs().max()
    arrived = counters(plan, s.ctx.past)
    assert arrived and all(int(c.abs().sum()) == 0 for c in arrived)
    runner.execute(plan, s.ctx, 0)               # the same plan again: the counters were reset
    assert torch.equal(plan.outputs["y"].cpu(), first)


@pytest.mark.parametrize("n_experts,top_k,tokens,idle", [
    (5, 2, 50, 1),      # several chunks of 16 tokens, an expert no token picks
    (12, 1, 37, 4),     # top-1, E not a power of two, four idle experts
    (3, 3, 9, 0),       # every expert for every token: one chunk, one program
    (256, 8, 21, 200),  # the widest expert tile
    (8, 2, 640, 2),     # a prefill: 40 chunks of tokens, 88 blocks of pairs
])
def test_routing_kernel_equals_torch(n_experts: int, top_k: int, tokens: int, idle: int,
                                     kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gates from an input: more than a chunk of tokens routed chunk by chunk in parallel (the
    ragged loads of tied gates: some experts with a pair or two, idle ones with none), one
    chunk by one program."""
    small_blocks(monkeypatch)
    gates = tied_gates(tokens, n_experts, idle, seed=n_experts)
    used = set(reference_routing(gates, top_k, 16, -(-tokens * top_k // 16) + n_experts)[1]
               .tolist()) - {-1}
    assert len(used) > 1 and max(used) < n_experts - idle   # the idle experts have no block
    run_moe(n_experts, top_k, tokens, gates, kernel_dir, parallel=tokens > 16)


@pytest.mark.parametrize("n_experts,top_k,tokens", [(6, 2, 45), (4, 1, 5)])
def test_router_last_program_routes(n_experts: int, top_k: int, tokens: int, kernel_dir: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's last program routes from the gates all programs stored (three programs of
    16 tokens, or one): the expert matmuls launch no routing of their own."""
    small_blocks(monkeypatch)
    run_moe(n_experts, top_k, tokens, None, kernel_dir, parallel=False)


@pytest.mark.parametrize("n_experts,top_k,tokens", [(6, 2, 45), (5, 1, 70)])
def test_router_then_parallel_routing(n_experts: int, top_k: int, tokens: int,
                                      kernel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill past one chunk: the router stores its gates and the chunks are routed in
    parallel after it (two launches), to the same table."""
    small_blocks(monkeypatch, route_last=False)
    run_moe(n_experts, top_k, tokens, None, kernel_dir, parallel=True)


def expert_loads(monkeypatch: pytest.MonkeyPatch, path: str, max_block_n: int | None = None
                 ) -> None:
    """Expert matmuls load their weight tiles by `path` ("pointer" or "tma": the interpreter
    runs tensor descriptors too), with at most `max_block_n` weight rows per tile if given."""
    config = blocks.launch_config

    def forced(family: str, target: str, **sizes: int) -> dict[str, Any]:
        cfg = config(family, target, **sizes)
        if family == "moe":
            assert "TMA" in cfg          # the weights here are contiguous rows of 16-byte multiples
            cfg["TMA"] = int(path == "tma")
            if max_block_n is not None:
                cfg["BLOCK_N"] = min(cfg["BLOCK_N"], max_block_n)
        return cfg

    monkeypatch.setattr(blocks, "launch_config", forced)


def expert_paths(plan: LaunchPlan) -> set[int]:
    """The TMA constexprs the plan's expert matmul launches run with (theirs: a K loop, no
    GROUP_M — the dense matmuls and prefill attention take a TMA constexpr too)."""
    return {kw["TMA"] for _, _, kw in plan.launches
            if "TMA" in kw and "BLOCK_K" in kw and "GROUP_M" not in kw}


@pytest.mark.parametrize("path", ["pointer", "tma"])
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-jamba"])
def test_moe_models_prefill_and_decode_match_eager(name: str, path: str, kernel_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A 6-token prefill of two sequences, then token by token: MoE layers route on the device
    and their down projections sum their own pairs; logits agree with eager at 1e-4. Through
    tensor descriptors, 128-row weight tiles: the gate+up tile past row 128 of an expert's 192
    and the down tile over 64 rows read rows of the next expert (or zeros after the last)."""
    expert_loads(monkeypatch, path, 128 if path == "tma" else None)
    model = archc.load(name, seed=3)
    eager = model.compile("eager", dtype="f32", device=DEVICE)
    triton = model.compile("triton", dtype="f32", device=DEVICE, cache_dir=kernel_dir)
    sessions = (eager.session, triton.session)
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    for s in sessions:
        s.reset()
    with np.errstate(over="ignore", under="ignore"):
        for _ in range(4):
            want, got = (s.step(x)[:, -1] for s in sessions)
            assert (got - want).abs().max() <= TOL * want.abs().max()
            x = want.argmax(-1)[:, None]
    plan = triton.session.runners["decoder"].last
    assert expert_paths(plan) == {int(path == "tma")}
    moe_layers = sum(kind == "moe" for kind in layer_ffns(model.spec))
    assert len(routings(plan)) == moe_layers >= 1    # one routing per MoE layer: the router's
    arrived = counters(plan, triton.session.ctx.past)
    assert arrived and all(int(c.abs().sum()) == 0 for c in arrived)


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-jamba"])
def test_gate_up_expert_weight_is_the_interleaved_stack(name: str) -> None:
    """The gated up projection's weight after the passes: expert e's row 2n is its gate row n
    and row 2n + 1 its up row n, exactly; its glu says the rows are interleaved."""
    model = archc.load(name, seed=3)
    graph = optimize(lower(load_spec(name))).graphs[0]
    ups = [n for n in graph if n.op == Op.MOE_LINEAR and n.attr("stage") == "up"]
    assert ups
    params = materialize(graph, model.weights)
    for n in ups:
        [glu] = n.attr("epilogue")
        assert glu.fn == "glu" and glu.kw("interleaved") is True
        weight = graph.nodes[n.inputs[2]].name
        base = weight.removesuffix("gate+up.weight")
        gate, up = model.weights[base + "gate.weight"], model.weights[base + "up.weight"]
        w = params[weight]
        assert w.shape == (gate.shape[0], 2 * gate.shape[1], gate.shape[2])
        assert torch.equal(w[:, 0::2], gate) and torch.equal(w[:, 1::2], up)
        assert not torch.equal(w, torch.cat([gate, up], dim=1))   # a permutation, not the stack


@pytest.mark.parametrize("path", ["pointer", "tma"])
def test_interleaved_gated_experts_match_gate_first_rows(path: str, kernel_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel over interleaved gate/up rows (one accumulator split in registers), and eager's
    glu over them, against eager over the same weights stacked gate rows first: 20 outputs per
    expert in tiles of 8 (16 weight rows), so an expert's last tile runs past its 40 rows;
    K = 24 in steps of 32."""
    n_experts, top_k, d, f, tokens = 5, 2, 24, 20, 11
    expert_loads(monkeypatch, path, 16)

    def graph(interleaved: bool) -> Any:
        glu = (("fn", "silu"), ("interleaved", True)) if interleaved else (("fn", "silu"),)

        def fn(b: Any, i: dict[str, int]) -> int:
            return b.emit(Op.MOE_LINEAR, i["x"], i["gates"], i["gu"], stage="up", top_k=top_k,
                          epilogue=(Call("glu", (), glu),))

        return build({"x": (shape(B, T, d), "f32"), "gates": (shape(B, T, n_experts), "f32"),
                      "gu": (shape(n_experts, 2 * f, d), "f32")}, fn)

    gate, up = rand(n_experts, f, d, seed=2) / d ** 0.5, rand(n_experts, f, d, seed=3) / d ** 0.5
    x, gates = rand(1, tokens, d, seed=1), tied_gates(tokens, n_experts, 1, seed=7)
    stacked = torch.cat([gate, up], dim=1)
    dims = {"B": 1, "T": tokens, "P": 0}
    want = run_graph(graph(False), {}, {"x": x, "gates": gates, "gu": stacked},
                     EagerContext(dims, KVCache(8)))["y"]
    paired = {"x": x, "gates": gates, "gu": PARAM_FNS["interleave"](stacked, dim=1)}
    run = run_graph_triton(graph(True), {}, paired, dims, max_seq_len=8, device=DEVICE,
                           cache_dir=kernel_dir)
    # eager's glu over interleaved rows, and the kernel's, against gate-first rows
    eager = run_graph(graph(True), {}, paired, EagerContext(dims, KVCache(8)))["y"]
    for got in (eager, run.outputs["y"].cpu()):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= TOL * want.abs().max()
