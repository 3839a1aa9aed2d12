"""Sharded programs on the triton backend (Triton's interpreter, f32): tp ranks as threads of one
process (archc.runtime.comm.run_simulated) running the kernels a sharded program compiles to,
with the collectives as host steps between launches, give the one-rank run's logits to 1e-5
relative — a vocabulary-parallel embedding (each rank's kernel masks the ids outside its part of
the table) and a vocabulary-parallel head (its logits all_gathered)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

import archc
from archc.codegen.aot import compile_module
from archc.codegen.build import CodegenOptions
from archc.codegen.render import generate, write_module
from archc.errors import ArchcError
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.passes import optimize
from archc.passes.shard import shard_program
from archc.quant.pack import quantize
from archc.runtime.comm import Comm, SimulatedComm, SimulatedWorld, TorchComm, run_simulated
from archc.runtime.triton_backend import TritonOptions, TritonSession
from archc.runtime.weights import random_weights
from archc.spec import load_spec
from archc.spec.schema import Spec
from tests.conftest import KERNEL_SPECS
from tests.test_ring_attention import run, splittable
from tests.test_ring_triton import on_ring
from tests.test_shard import refusal
from tests.test_tp_runtime import spawn

TOL = 1e-5
PREFILL, DECODE, BATCH = 4, 2, 2


@functools.cache
def model(name: str, vocab: int | None = None) -> tuple[Spec, Program, dict]:
    """A tiny spec (its vocabulary made `vocab`), its unsharded program, a seeded checkpoint."""
    spec = load_spec(name)
    if vocab is not None:
        spec = dataclasses.replace(spec, vocab_size=vocab)
    program = lower(spec)
    return spec, program, random_weights(program, seed=5)


def session(spec: Spec, program: Program, checkpoint: dict, cache_dir: Path,
            comms: dict[str, Comm] | None = None) -> TritonSession:
    """A rank's session. Made in the test's thread: ranks share one generated module, written
    and loaded once."""
    return TritonSession(program, checkpoint, max_seq_len=spec.max_seq_len,
                         options=TritonOptions(autotune=False, cache_dir=str(cache_dir)),
                         comms=comms)


def outputs(spec: Spec, s: TritonSession) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill, then DECODE greedy steps on one rank: the logits of each step, and the tokens."""
    ids = torch.randint(0, spec.vocab_size, (BATCH, PREFILL),
                        generator=torch.Generator().manual_seed(11))
    logits = [s.step(ids)]
    tokens: list[int] = []
    for _ in range(DECODE):
        nxt = logits[-1][:, -1].argmax(-1, keepdim=True)
        tokens += nxt.flatten().tolist()
        logits.append(s.step(nxt))
    return logits, tokens


def on_ranks(spec: Spec, program: Program, checkpoint: dict, cache_dir: Path, size: int,
             group: str = "tp") -> list[tuple[list[torch.Tensor], list[int]]]:
    """outputs() of `size` simulated ranks of `group` running `program`'s kernels."""
    world = SimulatedWorld(size)
    sessions = [session(spec, program, checkpoint, cache_dir, {group: SimulatedComm(world, r)})
                for r in range(size)]
    return run_simulated(size, lambda r: outputs(spec, sessions[r]))


def assert_same(want: tuple[list[torch.Tensor], list[int]],
                ranks: list[tuple[list[torch.Tensor], list[int]]]) -> None:
    for rank, (logits, tokens) in enumerate(ranks):
        assert tokens == want[1], f"rank {rank}'s greedy tokens differ"
        for step, (a, b) in enumerate(zip(logits, want[0], strict=True)):
            assert a.shape == b.shape
            err = float((a - b).abs().max() / b.abs().max())
            assert err <= TOL, f"rank {rank}, step {step}: relative error {err:.2e}"


def test_vocabulary_parallel_embedding_and_head_on_triton(tmp_path: Path) -> None:
    spec, program, checkpoint = model("tiny-llama3", vocab=96)
    sharded = shard_program(program, 2)
    g = sharded.graph("decoder")
    embedding = g.nodes[g.ids(Op.EMBEDDING)[0]]
    assert embedding.attr("parts") == 2 and len(g.ids(Op.ALL_GATHER)) == 1   # both are split
    want = outputs(spec, session(spec, program, checkpoint, tmp_path))
    assert_same(want, on_ranks(spec, sharded, checkpoint, tmp_path, 2))


def gloo_rank(name: str, vocab: int, tp: int, cache_dir: str
              ) -> tuple[list[torch.Tensor], list[int]]:
    """outputs() of this process's rank (a spawned gloo process) of the tp-sharded program."""
    spec, program, checkpoint = model(name, vocab)
    sharded = shard_program(program, tp)
    comm = TorchComm()   # a cache directory per rank: processes never read a half-written module
    return outputs(spec, session(spec, sharded, checkpoint, Path(cache_dir) / str(comm.rank),
                                 {"tp": comm}))


def test_vocabulary_parallel_embedding_in_gloo_processes(tmp_path: Path) -> None:
    """The same, each rank a process of its own (a torch.distributed gloo group)."""
    spec, program, checkpoint = model("tiny-llama3", vocab=96)
    want = outputs(spec, session(spec, program, checkpoint, tmp_path))
    assert_same(want, spawn(2, gloo_rank, "tiny-llama3", 96, 2, str(tmp_path)))


def test_vocabulary_parallel_embedding_compiles_for_sm90a(tmp_path: Path) -> None:
    """The masked embedding kernel (its rank's first row a runtime argument) compiles ahead of
    time for Hopper without spills."""
    spec = load_spec("llama3-8b")          # no weights: only the kernels are compiled
    sharded = optimize(shard_program(lower(spec, "bf16"), 2))
    g = sharded.graph("decoder")
    assert g.nodes[g.ids(Op.EMBEDDING)[0]].attr("parts") == 2
    gen = generate(sharded, CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    results = compile_module(write_module(gen, tmp_path / "gen"), "sm_90a", jobs=1,
                             kernels=["embedding_0_kernel"])
    assert "ids = ids - LO" in gen.source       # the masked kernel, not the whole-table one
    assert len(results) == 1 and not results[0].error, results
    assert results[0].registers > 0 and results[0].spill_bytes == 0


def test_quantized_vocabulary_parallel_table_on_triton(tmp_path: Path) -> None:
    """A quantized table (int4 in groups of 32, as a GGUF file's may be) split by rows: each
    rank dequantizes only the rows of its part, the others give 0."""
    spec, _, checkpoint = model("tiny-llama3", vocab=96)
    checkpoint = {**checkpoint, "embed.weight": quantize(checkpoint["embed.weight"], "int4",
                                                         group=32)}
    program = lower(spec, quant={"embed.weight": "int4_g32"})
    sharded = shard_program(program, 2)
    g = sharded.graph("decoder")
    table = g.nodes[g.nodes[g.ids(Op.EMBEDDING)[0]].inputs[0]]
    assert table.dtype == "int4_g32" and table.shape[0] == 48
    want = outputs(spec, session(spec, program, checkpoint, tmp_path))
    assert_same(want, on_ranks(spec, sharded, checkpoint, tmp_path, 2))


# every tiny spec that shards over tp ranks or splits over cp ranks
PARALLEL = [name for name in KERNEL_SPECS if splittable(name)
            or any(refusal(load_spec(name), tp) is None for tp in (2, 4))]


def assert_ranks_match(what: str, ranks: list[list[torch.Tensor]],
                       want: list[torch.Tensor]) -> None:
    """Every rank's every call within TOL of the one-rank run's scale, greedy tokens identical."""
    for rank, got in enumerate(ranks):
        for call, (a, b) in enumerate(zip(got, want, strict=True)):
            err = float((a - b).abs().max() / b.abs().max())
            assert err <= TOL, f"{what}, rank {rank}, call {call}: relative error {err:.2e}"
            assert a.argmax(-1).tolist() == b.argmax(-1).tolist(), f"{what}, rank {rank}"


@pytest.mark.parametrize("name", PARALLEL)
def test_tiny_spec_on_tp_and_cp_ranks_equals_one_rank(name: str, tmp_path: Path) -> None:
    """Tiny specs on the kernels, against one rank's run: sharded over tp = 2 and 4 ranks where
    they shard (at 4, llama2-70b's 2 KV heads and falcon's one replicated, mixtral's experts
    split four ways), and their prefill a ring over cp = 2 ranks where they split. An encoder's
    padded encode; a decoder's (an encoder-decoder's, after its encoder) prefill and a greedy
    decode step."""
    model = archc.load(name, seed=5)
    # one sequence (two for an encoder: the second padded), to keep the interpreter's grids
    # small; 11 tokens in a ring of 2 are chunks of 3, 3, 3, 2: rank 0 holds chunks 0 and 3
    # (5 tokens and a filler row in its block), rank 1 chunks 1 and 2 (6 tokens)
    rows = 2 if model.spec.family == "encoder" else 1
    ids = torch.randint(0, model.spec.vocab_size, (rows, 11),
                        generator=torch.Generator().manual_seed(0))
    go = run(model, model.graph, ids, decode=1)
    want = go(session(model.spec, model.graph, model.weights, tmp_path))
    for tp in (2, 4):
        if refusal(model.spec, tp) is not None:
            continue
        sharded = shard_program(model.graph, tp)
        if model.spec.attention.qk_norm_over == "projection":
            # OLMo 2: each rank normalizes the gathered k of all heads, so no one kernel holds
            # the k and v its cache stores; refused by name (eager runs it: test_shard)
            with pytest.raises(ArchcError, match=r"the k of layer 0 \(%\d+\) from norm %\d+ "
                               r"\(attention\.qk_norm_over\) .* no one kernel computes both"):
                session(model.spec, sharded, model.weights, tmp_path)
            continue
        world = SimulatedWorld(tp)
        sessions = [session(model.spec, sharded, model.weights, tmp_path,
                            {"tp": SimulatedComm(world, r)}) for r in range(tp)]
        ranks = run_simulated(tp, lambda r, held=sessions: go(held[r]))
        assert_ranks_match(f"tp = {tp}", ranks, want)
    if splittable(name):
        ranks, blocks = on_ring(model, model.graph, go, 2, tmp_path)
        assert 6 in blocks, "the prefill did not run as a ring"
        assert_ranks_match("cp = 2", ranks, want)


def test_a_tp_run_the_triton_backend_refuses_is_refused_before_any_rank_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """tiny-olmo2 at tp = 2: q and k normalized over the whole projection are gathered, so k
    leaves its projection for a norm kernel while v does not, and no kernel writes the cache.
    `archc run --backend triton` says so in one line before launching any rank (each rank's
    triton session would refuse it after loading); the eager backend is not refused."""
    from archc.cli import main
    started: list[object] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("archc.commands.launch.launch", lambda *a, **kw: started.append(a) or 0)
        capsys.readouterr()
        assert main(["run", "tiny-olmo2", "--tp", "2", "--backend", "triton"]) == 2
        err = capsys.readouterr().err
        assert not started
        assert err.count("\n") == 1 and "the triton backend cannot run tiny-olmo2" in err and \
            "no one kernel computes both" in err, err
        assert main(["run", "tiny-olmo2", "--tp", "2"]) == 0 and len(started) == 1
