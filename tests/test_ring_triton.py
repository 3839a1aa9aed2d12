"""Ring attention (context parallel) on the triton backend (Triton's interpreter, f32): cp ranks
as threads of one process (archc.runtime.comm.run_simulated), each running the kernels of the
ring program on its zig-zag slice of the prompt — each attention one launch per K/V block, the
blocks passed round the ring between launches — give the one-rank run's output to 1e-5
relative, and the decode steps after the prefill (every rank then holding the whole cache)
its greedy tokens. Every tiny spec that splits runs at cp = 2 in tests/test_tp_triton.py,
beside tensor parallelism on the same reference run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import archc
from archc.codegen.aot import compile_module, kernel_table
from archc.codegen.build import CodegenOptions
from archc.codegen.render import generate, write_module
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.passes import optimize
from archc.passes.context import context_parallel
from archc.runtime import launch
from archc.runtime.comm import SimulatedComm, SimulatedWorld, run_simulated
from archc.runtime.triton_backend import TritonOptions, TritonSession
from archc.spec import load_spec
from tests.test_ring_attention import close, run


def session(model: archc.Model, program: Program, cache_dir: Path,
            comms: dict | None = None) -> TritonSession:
    return TritonSession(program, model.weights, max_seq_len=model.spec.max_seq_len,
                         options=TritonOptions(autotune=False, cache_dir=str(cache_dir)),
                         comms=comms)


def on_ring(model: archc.Model, program: Program, go: Callable[[TritonSession], list],
            cp: int, cache_dir: Path) -> tuple[list[list[torch.Tensor]], list[int]]:
    """go() on cp simulated ranks of `program` made a ring: each rank's outputs, and the block
    rows of every ring attention launched (a prefill that ran whole launches none)."""
    ring = context_parallel(program, cp)
    world = SimulatedWorld(cp)
    sessions = [session(model, ring, cache_dir, {"cp": SimulatedComm(world, r)})
                for r in range(cp)]
    blocks: list[int] = []
    record = launch.LaunchContext.ring

    def counted(self: launch.LaunchContext, *args: object, **kw: object) -> None:
        blocks.append(self.ring_keys)
        record(self, *args, **kw)

    launch.LaunchContext.ring = counted   # type: ignore[method-assign]
    try:
        return run_simulated(cp, lambda r: go(sessions[r])), blocks
    finally:
        launch.LaunchContext.ring = record   # type: ignore[method-assign]


def check_spec(name: str, cp: int, length: int, tmp_path: Path, kv_cache: str | None = None,
               decode: int = 2) -> list[int]:
    """The ring program of `name` on cp simulated ranks against the one-rank program, both on
    the triton backend; returns each ring attention's block rows, as launched."""
    model = archc.load(name, seed=5)
    program = model.graph if kv_cache is None else lower(model.spec, "f32", kv_cache=kv_cache)
    ids = torch.randint(0, model.spec.vocab_size, (1, length),
                        generator=torch.Generator().manual_seed(cp))
    go = run(model, program, ids, decode=decode)
    want = go(session(model, program, tmp_path))
    ranks, blocks = on_ring(model, program, go, cp, tmp_path)
    for got in ranks:                                # every rank returns the whole sequence's
        for g, w in zip(got, want, strict=True):
            assert close(g, w), name
        assert [g.argmax(-1).tolist() for g in got] == [w.argmax(-1).tolist() for w in want]
    return blocks


def test_cp3_uneven(tmp_path: Path) -> None:
    # 20 tokens in 6 chunks (4, 4, 3, 3, 3, 3): ranks of 7, 7 and 6 tokens; past the window of 8
    assert set(check_spec("tiny-mistral", 3, 20, tmp_path, decode=1)) == {7}


def test_quantized_kv_cache(tmp_path: Path) -> None:
    """An int8 cache: each block carries the codes and their scales round the ring; the codes
    and scales each rank wrote are gathered for the decode steps."""
    assert check_spec("tiny-llama3", 2, 16, tmp_path, kv_cache="int8")


@pytest.mark.parametrize("name", ["llama3-8b", "gemma2-9b"])
def test_ring_kernel_uses_tensor_cores_without_spills_on_sm90a(name: str, tmp_path: Path
                                                                ) -> None:
    """At full size, in bf16, the ring kernel compiles for Hopper with wgmma and no spill."""
    spec = load_spec(name)
    program = optimize(context_parallel(lower(spec, "bf16"), 2), "default")
    path = write_module(generate(program, CodegenOptions(target="gpu", max_seq_len=8192)),
                        tmp_path)
    rings = [n for n in kernel_table(path) if n.endswith("_ring")]
    assert rings
    for r in compile_module(path, "sm_90a", jobs=1, kernels=rings):
        assert r.ok, r.error
        assert r.spill_bytes == 0 and r.wgmma, (r.kernel, r.config, r.spill_bytes, r.wgmma)
