"""Tensor parallelism across processes (gloo on the CPU): ranks spawned as real processes, each
joining a torch.distributed group, compiling the same model with `tp`, and returning what the
single-process run returns — logits to 1e-5 relative, greedy tokens identical — on the eager and
triton backends; the command line's `--tp` (its own launcher, and torchrun's environment); a
rank's resident weight bytes; and a rank that dies."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import archc
from archc.commands.launch import free_port
from archc.errors import ArchcError
from archc.ir.ops import Op
from archc.ir.paramexpr import calls
from archc.ir.shapes import DTYPE_BYTES, numel
from archc.passes.shard import ShardError, shard_program
from archc.quant import tensor_bytes
from tests.model_files import tiny_hf_dir  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[5, 17, 3, 42, 8, 11]]
NEW_TOKENS = 4


# ---- spawning ranks -------------------------------------------------------------------------

def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
               results: Any) -> None:
    """One spawned rank: join the gloo group as torchrun's environment would say, run fn."""
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo")
        # by value: a tensor put on the queue as it is would be shared through this process,
        # which may have exited by the time the test reads it
        results.put((rank, pickle.dumps(fn(*args)), None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 90) -> list[Any]:
    """fn(*args) in `world` spawned processes, one rank each; the results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value, error = results.get(timeout=timeout)
            assert error is None, f"rank {rank} failed:\n{error}"
            got[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


# ---- what a rank runs -----------------------------------------------------------------------

def run_tp(source: str, backend: str, tp: int, cp: int = 1) -> dict[str, Any]:
    """tp × cp-way logits and greedy tokens of `source` (1 × 1: a plain single-process
    compile), and the bytes of the rank's parameters."""
    options = {"autotune": False} if backend == "triton" else {}
    # a rank loads its slices (tp-major: its tp rank is its global rank mod tp)
    model = archc.load(source, tp=tp, rank=torch.distributed.get_rank() % tp if tp > 1 else 0)
    compiled = model.compile(backend, tp=tp, cp=cp, dtype="f32", **options)
    ids = torch.tensor(PROMPT)
    logits = compiled(ids)
    tokens = compiled.generate(ids, NEW_TOKENS, eos_token_id=())
    params = compiled.session.params if backend == "eager" else {
        g: dict(zip((n.name for n in compiled.session.runners[g].graph.nodes),
                    compiled.session.runners[g].params)) for g in compiled.session.runners}
    resident = sum(tensor_bytes(w) for ps in params.values() for w in ps.values()
                   if w is not None)
    return {"logits": logits, "tokens": tokens, "resident": resident,
            "loaded": sum(tensor_bytes(w) for w in model.weights.values())}


def expect_same(single: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    for r, got in enumerate(ranks):
        scale = single["logits"].abs().max()
        err = (got["logits"] - single["logits"]).abs().max()
        assert err <= 1e-5 * scale, f"rank {r}: logits differ by {err} (scale {scale})"
        assert torch.equal(got["tokens"], single["tokens"]), f"rank {r}"


@pytest.mark.parametrize(("source", "tp", "cp"), [("tiny-llama3", 4, 1), ("tiny-qwen2", 2, 1),
                                                  ("tiny-llama3", 2, 2)])
def test_eager_tp_equals_one_process(source: str, tp: int, cp: int) -> None:
    """tp ranks alone, and tp × cp ranks laid out tp-major (ring attention across the cp
    groups)."""
    single = run_tp(source, "eager", 1)
    expect_same(single, spawn(tp * cp, run_tp, source, "eager", tp, cp))


@pytest.mark.parametrize(("source", "tp", "cp"), [("tiny-llama3", 2, 1), ("tiny-llama3", 2, 2)])
def test_triton_tp_equals_one_process(source: str, tp: int, cp: int) -> None:
    """On the kernels too: tp ranks, and tp × cp ranks whose prefill runs the ring kernel, the
    K/V blocks passed between processes by gloo."""
    single = run_tp(source, "triton", 1)
    expect_same(single, spawn(tp * cp, run_tp, source, "triton", tp, cp))


# multi-head latent attention split by heads (the latent and its RoPE key replicated on every
# rank), DeepSeek's routing over sharded experts: σ scores, a choice bias, 2 of 4 groups, ×2.5,
# a shared expert; a dense first layer
LATENT_MOE = """\
name: tiny-latent-moe
vocab_size: 97
d_model: 48
layers: 3
max_seq_len: 64
norm: {kind: rmsnorm}
attention: {heads: 4, head_dim: 24, latent: {kv_rank: 20, rope_dims: 8, q_rank: 12, v_dim: 10}}
ffn: {kind: swiglu, d_ff: 40}
layer_types:
  dense: {}
  moe:
    ffn:
      kind: moe
      d_ff: 16
      moe: {experts: 8, top_k: 2, router: sigmoid, choice_bias: true, groups: 4, top_groups: 2,
            scale: 2.5, shared_expert_d_ff: 16}
layer_pattern: [dense, moe, moe]
"""


def test_eager_tp_latent_attention_and_deepseek_routing(tmp_path: Path) -> None:
    spec = tmp_path / "tiny-latent-moe.yaml"
    spec.write_text(LATENT_MOE)
    single = run_tp(str(spec), "eager", 1)
    ranks = spawn(2, run_tp, str(spec), "eager", 2)
    expect_same(single, ranks)
    assert all(r["resident"] < single["resident"] for r in ranks)


def test_eager_tp_2_and_a_ranks_slices_of_the_weights() -> None:
    """tp = 2 gives one process's logits and tokens, and a rank's parameters are half of the
    sharded weights plus the replicated ones (each priced from the sharded program's own
    params, not from the run)."""
    whole = run_tp("tiny-llama3", "eager", 1)
    ranks = spawn(2, run_tp, "tiny-llama3", "eager", 2)
    expect_same(whole, ranks)
    single = whole["resident"]
    program = shard_program(archc.load("tiny-llama3").graph, 2)
    split = replicated = 0
    for g in program:
        for n in g.nodes:
            if n.op == Op.PARAM:
                size = int(numel(n.shape)) * DTYPE_BYTES[n.dtype]
                if any(c.fn == "shard" for c in calls(n.attr("expr"))):
                    split += size
                else:
                    replicated += size
    assert split > 0 and replicated > 0
    assert split * 2 + replicated == single     # the whole model, once
    loaded = run_tp("tiny-llama3", "eager", 1)["loaded"]
    for got in ranks:
        assert got["resident"] == split + replicated < 0.75 * single
        assert got["loaded"] < 0.75 * loaded      # archc.load(…, tp=2, rank=r): its slices


# ---- the command line ------------------------------------------------------------------------

RUN = ["run", "tiny-llama3", "--quiet", "--new-tokens", "3"]


def archc_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120
              ) -> subprocess.CompletedProcess[str]:
    """`python -m archc ARGS` in a new process, this checkout's archc first on the path."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or name not in env:
            environ.pop(name, None)
    return subprocess.run([sys.executable, "-m", "archc", *args], capture_output=True,
                          text=True, env=environ, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def one_process_output() -> str:
    done = archc_cli(RUN)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_run_tp_2_prints_what_one_process_prints(one_process_output: str) -> None:
    done = archc_cli([*RUN, "--tp", "2"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == one_process_output
    assert "greedy continuation" in done.stdout


def test_run_cp_2_on_triton_prints_what_one_process_prints() -> None:
    """`archc run --cp 2 --backend triton`: two processes, the prompt's attention a ring of
    Triton kernels over gloo, print what one process prints."""
    args = [*RUN, "--backend", "triton", "--dtype", "f32"]
    one, ring = archc_cli(args), archc_cli([*args, "--cp", "2"])
    assert one.returncode == 0 and ring.returncode == 0, ring.stderr
    assert ring.stdout == one.stdout
    assert "greedy continuation" in ring.stdout


def torchrun_style(args: list[str], world: int, env: dict[str, str] | None = None
                   ) -> tuple[list[int], list[tuple[str, str]]]:
    """`python -m archc ARGS` in `world` processes given RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT as torchrun gives them: their exit statuses and (stdout, stderr)."""
    port = str(free_port())
    common = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": str(world),
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-m", "archc", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**common, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    return [p.returncode for p in procs], outs


def test_ranks_started_as_torchrun_starts_them(one_process_output: str) -> None:
    """Each process given torchrun's environment runs as that rank: rank 0 prints the run,
    rank 1 nothing."""
    codes, outs = torchrun_style([*RUN, "--tp", "2"], 2)
    assert codes == [0, 0], [e for _, e in outs]
    assert outs[0][0] == one_process_output
    assert outs[1][0] == ""


def test_a_rank_that_dies_stops_the_run_with_an_error() -> None:
    start = time.monotonic()
    done = archc_cli([*RUN, "--tp", "2", "--timeout", "30"], env={"ARCHC_TEST_EXIT_RANK": "1"})
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(
        "archc run: error: rank 1 exited with status 3; the other ranks were stopped after")
    assert "Traceback" not in done.stderr
    assert elapsed < 30 + 15      # the timeout, and the time to start the processes


def test_a_rank_that_dies_under_torchrun_fails_the_collective_waiting_on_it() -> None:
    start = time.monotonic()
    codes, outs = torchrun_style([*RUN, "--tp", "2", "--timeout", "20"], 2,
                                 {"ARCHC_TEST_EXIT_RANK": "1"})
    assert time.monotonic() - start < 20 + 15
    assert codes[1] == 3 and codes[0] == 1
    assert outs[0][1].startswith("archc run: error: while running %")
    assert "rank 0: all_reduce failed — another rank stopped or did not answer within the " \
        "timeout" in outs[0][1]


def test_a_model_that_does_not_shard_is_refused_before_any_rank_starts() -> None:
    start = time.monotonic()
    done = archc_cli([*RUN, "--tp", "3"])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "archc run: error: cannot shard tiny-llama3 over tp=3: attention.heads = 4 does not "
        "divide by tp; tp values that work: 1, 2, 4"]
    assert time.monotonic() - start < 15     # no rank was started


def test_tp_without_a_process_group_is_refused() -> None:
    with pytest.raises(ArchcError, match="initialize a torch.distributed process group of 2"):
        archc.load("tiny-llama3").compile("eager", tp=2)
    with pytest.raises(ArchcError, match="tp must be a whole number"):
        archc.load("tiny-llama3").compile("eager", tp=0)


# ---- a real checkpoint -----------------------------------------------------------------------

def chat_answer(path: str, tp: int) -> tuple[list[int], int]:
    """SmolLM2's greedy answer (eager) and the bytes of the weights this rank loaded (its
    slices, cut from the file one tensor at a time)."""
    model = archc.load(path, tp=tp, rank=torch.distributed.get_rank() if tp > 1 else 0)
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of "
                                        "France?"}])
    loaded = sum(tensor_bytes(w) for w in model.weights.values())
    return model.compile("eager", tp=tp).generate(ids, 8)[0].tolist(), loaded


def test_smollm2_answers_alike_on_3_ranks() -> None:
    """9 heads and 3 KV heads split over 3 ranks; 2 does not divide them, and is refused
    before any process group is needed, naming the spec field."""
    from tests.test_gguf_smollm2 import smollm2_gguf
    path = str(smollm2_gguf())
    with pytest.raises(ShardError, match="heads"):
        archc.load(path).compile("eager", tp=2)
    single, whole = chat_answer(path, 1)
    ranks = spawn(3, chat_answer, path, 3, timeout=120)
    assert [answer for answer, _ in ranks] == [single] * 3
    # the embedding and head (49152 rows split 3 ways) and every layer's projections are cut
    for _, loaded in ranks:
        assert whole / 3 < loaded < 0.45 * whole


def test_a_rank_reads_its_slices_of_a_hf_directory(tiny_hf_dir: Path) -> None:  # noqa: F811
    """Cut as each tensor is read: the same tensors as the whole checkpoint cut afterwards,
    and about half its bytes (the sharded projections halved, norms whole)."""
    whole = archc.load(tiny_hf_dir)
    total = sum(tensor_bytes(w) for w in whole.weights.values())
    for rank in range(2):
        got = archc.load(tiny_hf_dir, tp=2, rank=rank)
        want = whole.sliced(2, rank)
        assert got.shard == want.shard == (2, rank)
        assert got.weights.keys() == want.weights.keys()
        for name, w in want.weights.items():
            assert torch.equal(got.weights[name], w), name
        assert sum(tensor_bytes(w) for w in got.weights.values()) < 0.6 * total
    with pytest.raises(ArchcError, match="compile it with tp=2"):
        got.compile("eager")


@pytest.mark.parametrize("name,tp", [("tiny-llama3", 2), ("tiny-llama3", 4), ("tiny-mixtral", 2)])
def test_a_rank_is_priced_at_its_slices(name: str, tp: int) -> None:
    """What memory checks price a rank at: the elements of the params it materializes."""
    from archc.devices import weight_sizes
    from archc.ir.lower import lower
    from archc.ir.paramexpr import leaf, leaves
    from archc.runtime.weights import materialize, random_weights
    from archc.spec import load_spec
    program = lower(load_spec(name))
    sharded = shard_program(program, tp)
    weights = random_weights(program)
    held = 0
    for g in sharded:
        params = materialize(g, weights, rank=tp - 1)
        held += sum(params[n.name].numel() for n in g.nodes if n.op == Op.PARAM
                    and leaves(n.attr("expr") or leaf(n.name)))
    assert weight_sizes(program, tp=tp) == (held, 0)
    assert held < weight_sizes(program)[0]
