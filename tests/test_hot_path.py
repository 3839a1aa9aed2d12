"""The hot path: a step replays a launch plan built once per dims, does no symbolic work, and
`archc bench --host-time` measures what is left of it on the CPU.

Most tests run a `HostSession` — the GPU target's launch code with no-op kernels and zero-stride
weights — so plans are built and replayed exactly as on a GPU at no cost; the logits tests run
the interpreted kernels.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sympy
import torch

import archc
from archc.cli import main
from archc.codegen.layout import layouts
from archc.codegen.printer import dim_function
from archc.ir.lower import lower
from archc.ir.shapes import DIMS, evaluate
from archc.passes import optimize
from archc.perf.host import HostSession
from archc.runtime.launch import LaunchPlan
from archc.spec import load_spec

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="interpreted kernels: the CPU's stand-in for CUDA graphs")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def host_session(name: str, kernel_dir: Path) -> HostSession:
    spec = load_spec(name)
    return HostSession(lower(spec, "f32"), max_seq_len=spec.max_seq_len, dtype="f32",
                       cache_dir=kernel_dir)


def ids(batch: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, t), generator=torch.Generator().manual_seed(seed))


def holds(plan: LaunchPlan, tensor: torch.Tensor) -> bool:
    """Does one of the plan's launches take `tensor` as an argument?"""
    return any(a is tensor for _, args, _ in plan.launches for a in args)


# ---- nothing symbolic per step ------------------------------------------------------------

@pytest.fixture
def forbid_sympy(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to make every way of evaluating or printing a sympy expression raise."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("sympy evaluated an expression during a step")

    def arm() -> None:
        for owner, name in ((sympy.Basic, "subs"), (sympy.Basic, "xreplace"),
                            (sympy.core.evalf.EvalfMixin, "evalf"),
                            (sympy.printing.printer.Printer, "doprint")):
            monkeypatch.setattr(owner, name, refuse)
        monkeypatch.setattr(sympy, "lambdify", refuse)
    return arm


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-mixtral", "tiny-jamba"])
def test_host_steps_do_no_symbolic_work(name: str, kernel_dir: Path,
                                        forbid_sympy: Callable[[], None]) -> None:
    """After the first step at each shape, plain and CUDA-graph decode steps on the GPU target
    evaluate nothing with sympy: sizes were compiled, plans built, once."""
    s = host_session(name, kernel_dir)
    s.step(ids(2, 5))
    s.step(ids(2, 1))
    s.cuda_graphs = True
    s.step(ids(2, 1))                      # captures
    forbid_sympy()
    for graphs in (True, False, True):
        s.cuda_graphs = graphs
        assert s.step(ids(2, 1)).shape == (2, 1, 97)


@CPU_ONLY
def test_interpreted_steps_do_no_symbolic_work(kernel_dir: Path,
                                               forbid_sympy: Callable[[], None]) -> None:
    """Under the interpreter a decode plan is built at every past length (its attention grid
    covers only the keys so far): building one is sympy-free too."""
    s = archc.load("tiny-llama3", seed=3).compile("triton", cache_dir=kernel_dir).session
    s.step(ids(1, 4))
    s.step(ids(1, 1))
    forbid_sympy()
    before = len(s.runners["decoder"].plans)
    for _ in range(2):
        s.step(ids(1, 1))
    assert len(s.runners["decoder"].plans) > before   # new plans, built without sympy


def test_dim_functions_agree_with_sympy() -> None:
    """The compiled functions compute what sympy computes: every layout of a few kernel-level
    graphs, and floor division and Mod with negative operands (Python's semantics)."""
    exprs = [sympy.floor((DIMS["T"] + DIMS["P"] - 9) / 4), sympy.Mod(DIMS["P"] - 7, 4),
             DIMS["B"] * DIMS["T"] * 4096 + DIMS["S"], sympy.Integer(5)]
    for name in ("tiny-llama3", "tiny-t5", "tiny-jamba"):
        for g in optimize(lower(load_spec(name))):
            exprs += [e for lay in layouts(g) for e in (*lay.shape, *lay.strides, lay.offset)]
    fn = dim_function(exprs)
    for dims in ((1, 1, 0, 1), (3, 7, 11, 5), (2, 1, 40, 9)):
        want = tuple(evaluate(e, dict(zip("BTPS", dims))) for e in exprs)
        assert fn(*dims) == want


# ---- plans: built once per dims, rebuilt when what they hold changes -----------------------

def test_plans_are_reused_across_steps_and_rebuilt_when_dims_change(kernel_dir: Path) -> None:
    s = host_session("tiny-llama3", kernel_dir)
    runner = s.runners["decoder"]
    s.step(ids(1, 3))
    prefill = runner.last
    s.step(ids(1, 1))
    decode = runner.last
    s.step(ids(1, 1))
    assert runner.last is decode and decode is not prefill   # one plan for every past length
    s.reset()
    s.step(ids(1, 3))
    assert runner.last is prefill
    s.reset()
    s.step(ids(1, 4))                                          # T changes
    assert runner.last is not prefill and runner.last.key[:2] == (1, 4)
    first_cache = s.cache.get(0, "k")
    assert holds(prefill, first_cache)
    s.reset()
    s.step(ids(2, 3))                                          # B changes: a new cache
    assert runner.last.key[:2] == (2, 3) and holds(runner.last, s.cache.get(0, "k"))
    s.reset()
    s.step(ids(1, 3))                       # back to B = 1: the cache is allocated again
    assert runner.last is not prefill
    assert holds(runner.last, s.cache.get(0, "k")) and not holds(runner.last, first_cache)
    assert all(p is not prefill for p in runner.plans.values())


def test_the_plan_used_least_recently_is_the_one_dropped(kernel_dir: Path) -> None:
    """A plan kept hot (a decode step between prompts of many lengths) is never rebuilt; the
    oldest unused one goes when the runner holds max_plans."""
    s = host_session("tiny-llama3", kernel_dir)
    runner = s.runners["decoder"]
    runner.max_plans = 3
    s.step(ids(1, 3))
    s.step(ids(1, 1))
    decode = runner.last
    for prompt in (4, 5, 6):
        s.reset()
        first = runner.plans.get((1, prompt, 0, 0, prompt, 0))
        s.step(ids(1, prompt))
        assert first is None and runner.last.key[:2] == (1, prompt)
        s.step(ids(1, 1))
        assert runner.last is decode, f"the decode plan was rebuilt after a {prompt}-token prompt"
        assert len(runner.plans) <= 3


def test_plans_are_rebuilt_when_the_recurrent_state_is_reallocated(kernel_dir: Path) -> None:
    s = host_session("tiny-mamba", kernel_dir)
    runner = s.runners["decoder"]
    s.step(ids(1, 3))
    first = runner.last
    state = next(iter(s.states.store.values()))
    assert holds(first, state)
    s.reset()
    s.step(ids(2, 3))
    s.reset()
    s.step(ids(1, 3))
    assert runner.last is not first
    assert all(holds(runner.last, t) for t in s.states.store.values())
    assert not holds(runner.last, state)


def test_plans_follow_the_encoder_length(kernel_dir: Path) -> None:
    s = host_session("tiny-t5", kernel_dir)
    runner = s.runners["decoder"]
    plans = {}
    for length in (5, 7, 5):
        hidden = s.encode(ids(1, length))
        s.reset()
        s.step(ids(1, 1), encoder_hidden=hidden)
        assert runner.last.key[3] == length
        plans.setdefault(length, runner.last)
        assert runner.last is plans[length]
    assert plans[5] is not plans[7]


def test_moe_routing_is_one_launch_per_layer(kernel_dir: Path) -> None:
    """An MoE layer's up and down projections read the same gates: the plan routes once — the
    router's last program, no launch or host step of its own."""
    s = host_session("tiny-mixtral", kernel_dir)
    calls: list[tuple[str, dict[str, Any]]] = []
    s.ctx.bind = lambda kernel, grid: lambda *args, **meta: calls.append((kernel.__name__, meta))
    s.step(ids(1, 3))
    assert len(calls) == len(s.runners["decoder"].last.launches)   # every entry a launch
    routes = [name for name, meta in calls if "BLOCK_P" in meta]     # the table's block
    assert routes == ["router_0_kernel"] * load_spec("tiny-mixtral").layers


# ---- the replay path gives the logits of plain launches -------------------------------------

class PythonReplay:
    """Stands in for a CUDA graph on the CPU: replays the captured plan's launches."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with np.errstate(over="ignore", under="ignore"):
            self.plan.launch()


@CPU_ONLY
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-mixtral"])
def test_replayed_decode_matches_plain_launches(name: str, kernel_dir: Path) -> None:
    """Decode through the CUDA-graph path — inputs copied into the captured plan's buffers, P
    written to the device, the plan replayed — gives the logits of plain launches step after
    step, and again after a batch-size change. The replaying session sizes attention grids as
    on a GPU (the whole cache), so one plan serves every step."""
    model = archc.load(name, seed=3)
    plain = model.compile("triton", cuda_graphs=False, cache_dir=kernel_dir).session
    graphs = model.compile("triton", cuda_graphs=True, cache_dir=kernel_dir).session
    captured: list[PythonReplay] = []

    def capture(plan: LaunchPlan) -> PythonReplay:
        captured.append(PythonReplay(plan))
        return captured[-1]
    graphs.cuda_graphs = True
    graphs._capture = capture  # type: ignore[method-assign]
    graphs.kv_len = lambda past, t: graphs.max_seq_len  # type: ignore[method-assign]
    for batch in (2, 1):
        x = ids(batch, 5, seed=batch)
        for s in (plain, graphs):
            s.reset()
        for _ in range(3):
            want, got = (s.step(x)[:, -1] for s in (plain, graphs))
            scale = want.abs().max()
            assert (got - want).abs().max() <= 1e-4 * scale
            x = want.argmax(-1)[:, None]
    assert len(captured) == 2 and all(c.replays == 1 for c in captured)


# ---- archc bench --host-time --------------------------------------------------------------------

def test_bench_host_prints_its_report_with_the_overhead_last(kernel_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    assert main(["bench", "tiny-llama3", "--host-time", "--new-tokens", "20", "--dtype", "f32",
                 "--cache-dir", str(kernel_dir)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    text = "\n".join(lines)
    overhead = re.fullmatch(r"host overhead: (\d+\.\d) us/step", lines[-1])
    assert overhead, lines[-1]
    plain = re.search(r"plain launches: +(\d+\.\d) us/step", text)
    assert plain and plain.group(1) == overhead.group(1)
    assert re.search(r"CUDA-graph path: +\d+\.\d us/step", text)
    assert "median of 20 steps after 50 warm-up steps" in text
    # what a GPU decode step launches: every kernel-level node once (split-KV attention merges
    # its splits in the same launch)
    s = host_session("tiny-llama3", kernel_dir)
    launches = len(s.generated.steps["decoder"])
    assert f", {launches} launches per step" in text


def test_bench_host_times_quantized_weights(kernel_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Stand-in quantized weights (every part a zero-stride view) launch like real ones: the
    same launches per step as float weights, each passing its weight's parts."""
    assert main(["bench", "tiny-llama3", "--host-time", "--new-tokens", "5", "--dtype", "f32",
                 "--quantize", "int4", "--group", "32", "--cache-dir", str(kernel_dir)]) == 0
    text = capsys.readouterr().out
    launches = len(host_session("tiny-llama3", kernel_dir).generated.steps["decoder"])
    assert f", {launches} launches per step" in text
    assert re.search(r"host overhead: \d+\.\d us/step", text)
    # the kernels timed dequantize int4 weights
    assert any("int4_g32 weight tile" in f.read_text() for f in Path(kernel_dir).rglob("*.py"))


@pytest.mark.parametrize("argv, message", [
    (["tiny-llama3", "--host-time", "--prompt-len", "8"], "--prompt-len does not apply"),
    (["tiny-llama3", "--host-time", "--dry-run", "--json"], "--dry-run, --json do not"),
    (["tiny-bert", "--host-time"], "decoder-only models; tiny-bert is an encoder"),
    (["tiny-llama3", "--host-time", "--layers", "9"], "--layers 9: tiny-llama3 has 2 blocks"),
])
def test_bench_host_refuses_what_does_not_apply(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
