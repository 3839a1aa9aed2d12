"""Ring attention (context parallel): the sequence split zig-zag across cp ranks, K/V blocks
passed round the ring, partials merged by the online-softmax rescale. Checked against the same
program on one rank: the attention op alone (every mask and bias, GQA, uneven splits), whole
tiny specs in simulated ranks (logits and greedy tokens through decode steps), and the op in
two real gloo processes."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import archc
from archc.errors import ArchcError, RunError
from archc.ir.attrs import Call
from archc.ir.graph import GraphBuilder, Program
from archc.ir.lower import lower
from archc.ir.ops import OP_TABLE, Op
from archc.ir.shapes import B, T, shape
from archc.ir.shapes import P as PAST
from archc.model import EAGER_PIPELINE
from archc.passes import optimize
from archc.passes.context import ContextError, context_parallel, zigzag
from archc.runtime.comm import SimulatedComm, SimulatedWorld, TorchComm, run_simulated
from archc.runtime.eager import EagerContext, EagerSession, run_graph
from archc.spec import load_spec
from tests.conftest import TINY_SPECS

RTOL = 1e-5     # relative to the largest value: f32 sums in another order
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= RTOL * want.abs().max())


# ---- the op alone --------------------------------------------------------------------------

def attention_program(attrs: dict[str, Any]) -> Program:
    """One attention of q [B, 4, T, 8] over k, v [B, 2, T, 8] (GQA), with the mask operands
    and bias table `attrs` ask for."""
    b = GraphBuilder("decoder")
    q = b.input("q", shape(B, HEADS, T, HEAD_DIM), "f32")
    k = b.input("k", shape(B, KV_HEADS, T, HEAD_DIM), "f32")
    v = b.input("v", shape(B, KV_HEADS, T, HEAD_DIM), "f32")
    extra = []
    if attrs.get("padding"):
        extra.append(b.input("padding", shape(B, T), "i64"))
    if attrs.get("prefix"):
        extra.append(b.input("prefix_len", (), "i64"))
    bias = attrs.get("bias")
    if bias is not None:
        extra.append(b.param("slopes", shape(HEADS), "f32") if bias.fn == "alibi" else
                     b.param("table", shape(16, HEADS), "f32"))
    b.output("o", b.emit(Op.ATTENTION, q, k, v, *extra, scale=0.3, **attrs))
    return Program("m", (b.build(),))


CASES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=8),
    "bidirectional": {},
    "padding": dict(padding=True),
    "bidirectional-window": dict(window=4, global_tokens=2, padding=True),
    "causal-global": dict(causal=True, window=5, global_tokens=2),
    "prefix": dict(causal=True, prefix=True),
    "alibi": dict(causal=True, bias=Call("alibi")),
    "t5": dict(bias=Call("t5", (), (("bidirectional", True), ("max_distance", 16))), padding=True),
    "softcap": dict(causal=True, softcap=2.0, window=8),
}


def one_rank_and_ring(attrs: dict[str, Any], cp: int, length: int,
                      ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The attention on one rank, each of cp ranks' output of its zig-zag tokens, and those
    tokens' positions."""
    program = attention_program(attrs)
    ring = context_parallel(program, cp)
    gen = torch.Generator().manual_seed(length)
    x = {n: torch.randn(3, h, length, HEAD_DIM, generator=gen)
         for n, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    x["padding"] = torch.ones(3, length, dtype=torch.long)
    x["padding"][1, length - 5:] = 0                 # the second sequence ends early
    x["padding"][2] = 0                              # and the third is all padding
    x["prefix_len"] = torch.tensor(6)
    params = {"slopes": torch.rand(HEADS, generator=gen), "table": torch.randn(16, HEADS)}
    dims = {"B": 3, "P": 0, "S": 0}
    whole = run_graph(program.graphs[0], params, {**x, "positions": torch.arange(length)},
                      EagerContext({**dims, "T": length}))["o"]
    parts, world = zigzag(length, cp), SimulatedWorld(cp)

    def rank(r: int) -> torch.Tensor:
        mine = parts[r]
        inputs = {"q": x["q"][:, :, mine], "k": x["k"][:, :, mine], "v": x["v"][:, :, mine],
                  "padding": x["padding"][:, mine], "prefix_len": x["prefix_len"],
                  "positions": mine}
        ctx = EagerContext({**dims, "T": len(mine)}, comms={"cp": SimulatedComm(world, r)})
        return run_graph(ring.graphs[0], params, inputs, ctx)["o"]

    return whole, run_simulated(cp, rank), parts


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cp,length", [(2, 20), (3, 23), (4, 29)])   # uneven: 23, 29
def test_ring_attention_equals_one_rank(case: str, cp: int, length: int) -> None:
    whole, ranks, parts = one_rank_and_ring(CASES[case], cp, length)
    for got, mine in zip(ranks, parts):
        assert close(got, whole[:, mine]), case


def test_a_broken_merge_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rescale matters: blocks merged without rescaling the running sums by e^(m − m′)
    are visibly wrong."""
    from dataclasses import replace

    from archc.ir.modifiers import normalizers as nz

    def no_rescale(n: Call, state: nz.State, s: torch.Tensor, v: torch.Tensor) -> nz.State:
        m, total, acc = state
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        return m_new, total + p.sum(-1), acc + p @ v
    monkeypatch.setitem(nz.ONLINE, "softmax", replace(nz.ONLINE["softmax"], step=no_rescale))
    whole, ranks, parts = one_rank_and_ring(CASES["causal"], 2, 20)
    assert not all(close(got, whole[:, mine]) for got, mine in zip(ranks, parts))


def test_zigzag_split() -> None:
    assert [p.tolist() for p in zigzag(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # 11 tokens, 6 chunks: the first 11 mod 6 = 5 chunks hold 2 tokens, the last one 1
    assert [p.tolist() for p in zigzag(11, 3)] == [[0, 1, 10], [2, 3, 8, 9], [4, 5, 6, 7]]
    with pytest.raises(ContextError, match="4 chunks; 3 tokens are too few"):
        zigzag(3, 2)


def test_a_ring_needs_its_group() -> None:
    program = context_parallel(attention_program(CASES["causal"]), 2)
    x = torch.randn(1, HEADS, 6, HEAD_DIM)
    kv = torch.randn(1, KV_HEADS, 6, HEAD_DIM)
    world = SimulatedWorld(3)

    def rank(r: int) -> torch.Tensor:
        ctx = EagerContext({"B": 1, "T": 6, "P": 0, "S": 0}, comms={"cp": SimulatedComm(world, r)})
        return run_graph(program.graphs[0], {}, {"q": x, "k": kv, "v": kv,
                                                 "positions": torch.arange(6)}, ctx)["o"]

    with pytest.raises(RunError, match="a ring over 2 cp ranks; this run has 3"):
        run_simulated(3, rank)


# ---- whole programs in simulated ranks -------------------------------------------------------

def recurrent(name: str) -> bool:
    return any(m != "attention" for m in load_spec(name).all_mixers)


def latent(name: str) -> bool:
    return load_spec(name).attention.latent is not None


def splittable(name: str) -> bool:
    scaling = load_spec(name).position.scaling
    return not recurrent(name) and not latent(name) and (
        scaling is None or scaling.kind != "dynamic")


def eager_program(model: archc.Model, kv_cache: str | None = None) -> Program:
    program = model.graph if kv_cache is None else lower(model.spec, "f32", kv_cache=kv_cache)
    return optimize(program, EAGER_PIPELINE)


def run(model: archc.Model, program: Program, ids: torch.Tensor, decode: int,
        ) -> Callable[[EagerSession], list[torch.Tensor]]:
    """What a session computes: an encoder's hidden states (the second sequence padded), or a
    decoder's prefill logits and those of `decode` greedy steps."""
    def go(session: EagerSession) -> list[torch.Tensor]:
        if model.spec.family == "encoder":
            mask = torch.ones_like(ids)
            mask[1, -4:] = 0
            return [session.encode(ids, mask)]
        enc = {}
        if model.spec.family == "encoder-decoder":
            enc = {"encoder_hidden": session.encode(ids[:, :10])}
        out = [session.step(ids, **enc)]
        for _ in range(decode):
            out.append(session.step(out[-1][:, -1:].argmax(-1), **enc))
        return out
    return go


def check_spec(name: str, cp: int, length: int, kv_cache: str | None = None) -> None:
    model = archc.load(name, seed=5)
    program = eager_program(model, kv_cache)
    ring = context_parallel(program, cp)
    ids = torch.randint(0, model.spec.vocab_size, (2, length),
                        generator=torch.Generator().manual_seed(cp))
    go = run(model, program, ids, decode=3)
    want = go(EagerSession(program, model.weights, max_seq_len=model.spec.max_seq_len))
    world = SimulatedWorld(cp)
    ranks = run_simulated(cp, lambda r: go(EagerSession(
        ring, model.weights, max_seq_len=model.spec.max_seq_len,
        comms={"cp": SimulatedComm(world, r)})))
    for got in ranks:                                # every rank returns the whole sequence's
        for g, w in zip(got, want):
            assert close(g, w), name
        # greedy tokens: the prefill's and each decode step's
        assert [g.argmax(-1).tolist() for g in got] == [w.argmax(-1).tolist() for w in want]


@pytest.mark.parametrize("name", [n for n in TINY_SPECS if splittable(n)])
def test_tiny_spec_cp2_equals_one_rank(name: str) -> None:
    check_spec(name, 2, 19)         # 19 tokens: uneven chunks; past the window of 8


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-bert"])
def test_cp3(name: str) -> None:
    check_spec(name, 3, 22)


def test_quantized_kv_cache_is_gathered() -> None:
    """An int8 cache: the codes and scales each rank wrote, gathered for the decode steps."""
    check_spec("tiny-llama3", 2, 16, kv_cache="int8")


def test_a_short_prefill_runs_whole_on_every_rank() -> None:
    check_spec("tiny-gemma2", 2, 3)      # fewer tokens than 2·cp chunks


@pytest.mark.parametrize("name", sorted(n for n in TINY_SPECS if not splittable(n)))
def test_unsplittable_specs_are_refused_by_name(name: str) -> None:
    program = eager_program(archc.load(name))
    want = "carries a state along the sequence" if recurrent(name) else \
        "caches latent attention's latents" if latent(name) else "dynamic NTK"
    with pytest.raises(ContextError, match=want):
        context_parallel(program, 2)


def test_cp_values() -> None:
    program = eager_program(archc.load("tiny-llama3"))
    assert context_parallel(program, 1) is program
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ArchcError, match="not a whole number ≥ 1"):
            context_parallel(program, bad)  # type: ignore[arg-type]
    # the unfused program: its attention chains are collapsed first
    unfused = context_parallel(archc.load("tiny-llama3").graph, 2)
    assert [n.attr("ring") for n in unfused.graphs[0] if n.op == Op.ATTENTION] == [2, 2]


# ---- two processes over gloo --------------------------------------------------------------

def _gloo_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        program = context_parallel(attention_program(CASES["window"]), 2)
        gen = torch.Generator().manual_seed(0)
        x = {n: torch.randn(1, h, 21, HEAD_DIM, generator=gen)
             for n, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        mine = zigzag(21, 2)[rank]
        ctx = EagerContext({"B": 1, "T": len(mine), "P": 0, "S": 0}, comms={"cp": TorchComm()})
        o = run_graph(program.graphs[0], {}, {**{n: v[:, :, mine] for n, v in x.items()},
                                              "positions": mine}, ctx)["o"]
        torch.save({"o": o, "x": x}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ring_over_two_gloo_processes(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    plain = attention_program(CASES["window"]).graphs[0]
    for rank, mine in enumerate(zigzag(21, 2)):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        whole = run_graph(plain, {}, {**got["x"], "positions": torch.arange(21)},
                          EagerContext({"B": 1, "T": 21, "P": 0, "S": 0}))["o"]
        assert close(got["o"], whole[:, mine])


def test_ring_costs_are_a_ranks_share() -> None:
    """A rank's FLOPs are 1/cp of the whole sequence's; it reads all cp K/V blocks."""
    plain, ring = attention_program(CASES["causal"]), context_parallel(
        attention_program(CASES["causal"]), 2)
    n_plain, n_ring = (p.graphs[0].ids(Op.ATTENTION)[0] for p in (plain, ring))
    cost = OP_TABLE[Op.ATTENTION]
    at = {B: 1, T: 16, PAST: 0}
    whole_flops = cost.flops(plain.graphs[0].sig(n_plain)).subs(at)
    whole_bytes = cost.bytes(plain.graphs[0].sig(n_plain)).subs(at)
    half = {B: 1, T: 8, PAST: 0}
    assert cost.flops(ring.graphs[0].sig(n_ring)).subs(half) * 2 == whole_flops
    # q in and out for half the tokens, the same k and v rows as one rank reads
    q_bytes = 2 * HEADS * 16 * HEAD_DIM * 4
    assert cost.bytes(ring.graphs[0].sig(n_ring)).subs(half) == whole_bytes - q_bytes // 2


def test_ring_program_prints_and_parses_back() -> None:
    from archc.ir.text import format_program, parse_program
    ring = context_parallel(eager_program(archc.load("tiny-bloom")), 2)   # positions added
    assert "positions" in ring.graphs[0].inputs
    text = format_program(ring)
    assert "ring=2" in text and format_program(parse_program(text)) == text


def test_a_cp_group_needs_ring_attention() -> None:
    model = archc.load("tiny-llama3")
    world = SimulatedWorld(2)
    session = EagerSession(eager_program(model), model.weights, max_seq_len=64,
                           comms={"cp": SimulatedComm(world, 0)})
    with pytest.raises(RunError, match=r"apply context_parallel\(program, 2\) first"):
        session.step(torch.zeros(1, 8, dtype=torch.long))
