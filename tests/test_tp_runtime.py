"""Tensor parallelism across processes (gloo on the CPU): ranks spawned as real processes, each
joining a torch.distributed group, compiling the same model with `tp`, and returning what the
single-process run returns — logits to 1e-5 relative, greedy tokens identical — on the eager and
triton backends; the command line's `--tp` (its own launcher, and torchrun's environment); a
rank's resident weight bytes; and a rank that dies."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import archc
from archc.quant import tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[5, 17, 3, 42, 8, 11]]
NEW_TOKENS = 4


# ---- spawning ranks -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
               results: Any) -> None:
    """One spawned rank: join the gloo group as torchrun's environment would say, run fn."""
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo")
        results.put((rank, fn(*args), None))
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
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


# ---- what a rank runs -----------------------------------------------------------------------

def run_tp(source: str, backend: str, tp: int) -> dict[str, Any]:
    """tp-way logits and greedy tokens of `source` (tp = 1: a plain single-process compile)."""
    options = {"autotune": False} if backend == "triton" else {}
    model = archc.load(source)
    compiled = model.compile(backend, tp=tp, dtype="f32", **options)
    ids = torch.tensor(PROMPT)
    logits = compiled(ids)
    tokens = compiled.generate(ids, NEW_TOKENS, eos_token_id=())
    params = compiled.session.params if backend == "eager" else {
        g: dict(zip((n.name for n in compiled.session.runners[g].graph.nodes),
                    compiled.session.runners[g].params)) for g in compiled.session.runners}
    resident = sum(tensor_bytes(w) for ps in params.values() for w in ps.values()
                   if w is not None)
    return {"logits": logits, "tokens": tokens, "resident": resident}


def expect_same(single: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    for r, got in enumerate(ranks):
        scale = single["logits"].abs().max()
        err = (got["logits"] - single["logits"]).abs().max()
        assert err <= 1e-5 * scale, f"rank {r}: logits differ by {err} (scale {scale})"
        assert torch.equal(got["tokens"], single["tokens"]), f"rank {r}"


@pytest.mark.parametrize(("source", "tp"), [("tiny-llama3", 2), ("tiny-llama3", 4),
                                            ("tiny-qwen2", 2)])
def test_eager_tp_equals_one_process(source: str, tp: int) -> None:
    single = run_tp(source, "eager", 1)
    expect_same(single, spawn(tp, run_tp, source, "eager", tp))


@pytest.mark.parametrize(("source", "tp"), [("tiny-llama3", 2)])
def test_triton_tp_equals_one_process(source: str, tp: int) -> None:
    single = run_tp(source, "triton", 1)
    expect_same(single, spawn(tp, run_tp, source, "triton", tp))
