"""The recurrent kernels — causal_conv, ssm_scan, linear_attention — agree with the eager ops over
a whole sequence: a prefill at P = 0, single-token decode steps, and a chunk of several tokens at
P > 0, the layer state carried from call to call on each side and compared after every call.

The inputs are views, as the passes leave them: the conv input and the gate z are column slices
of one [B, T, 2C] tensor, B and C of an x-projection, q, k and v heads of one QKV tensor. Sizes
are odd (40 channels, d_state 12, 6 query heads over 2 KV heads, head dims 12 and 20). Each case
runs twice: with the interpreter's tiles (one program and one time tile per sequence) and with
small tiles that split the channels over programs and the tokens over tiles — the conv window and
the linear-attention sums then cross tile boundaries, as on a GPU.

Tolerances as in test_triton_kernels: f32 1e-5 of the output scale (both sides accumulate in f32
in different orders), f16 2e-3 (inputs, outputs and the conv state rounded to f16 on both sides).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from archc.codegen import blocks
from archc.ir.graph import Graph, GraphBuilder
from archc.ir.ops import Op
from archc.ir.shapes import B, T, shape
from archc.ir.verify import verify_graph
from archc.runtime.eager import EagerContext, RecurrentState, run_graph
from tests.triton_graph import run_graph_triton

TOL = {"f32": 1e-5, "f16": 2e-3}
TORCH = {"f32": torch.float32, "f16": torch.float16}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CALLS = (13, 1, 2, 5)         # a prefill, two decode steps, then a chunk that continues at P = 15
CHANNELS, WIDTH, STATES, RANK = 40, 4, 12, 3
HEADS, KV_HEADS, HEAD_DIM, VALUE_DIM = 6, 2, 12, 20

# Tiles smaller than the problem: 3 channel programs, time tiles of 4 tokens (shorter than the
# conv window plus a call), 16-token linear-attention chunks.
SMALL = {"causal_conv": dict(BLOCK_T=4, BLOCK_C=16), "ssm_scan": dict(BLOCK_D=16, BLOCK_N=16),
         "linear_attention": dict(BLOCK_T=16)}


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(params=["interpreter tiles", "small tiles"])
def tiles(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "small tiles":
        chosen = blocks.launch_config

        def small(family: str, target: str, **sizes: int) -> dict[str, Any]:
            cfg = chosen(family, target, **sizes)
            return {**cfg, **SMALL.get(family, {})}
        monkeypatch.setattr(blocks, "launch_config", small)
    yield request.param


def rand(*dims: int, seed: int) -> torch.Tensor:
    return torch.randn(*dims, generator=torch.Generator().manual_seed(seed))


def graph(fn: Any, inputs: dict[str, tuple[tuple, str]]) -> Graph:
    b = GraphBuilder("decoder")
    ids = {k: b.input(k, s, d) for k, (s, d) in inputs.items()}
    b.output("y", fn(b, ids))
    g = b.build()
    verify_graph(g)
    return g


def run_sequence(g: Graph, values: Any, dtype: str, kernel_dir: Path,
                 calls: tuple[int, ...] = CALLS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every call of `calls` (tokens per call) on both sides, states carried; checks outputs
    and states after each call and returns the (triton, eager) outputs."""
    state = RecurrentState()
    carried: dict[tuple[int, str], torch.Tensor] | None = None
    past, outs = 0, []
    for k, t in enumerate(calls):
        dims = {"B": 2, "T": t, "P": past}
        xs = {name: (v.to(TORCH[dtype]) if v.is_floating_point() else v)
              for name, v in values(t, k).items()}
        want = run_graph(g, {}, xs, EagerContext(dims, None, state))["y"]
        run = run_graph_triton(g, {}, xs, dims, past_state=carried, device=DEVICE,
                               cache_dir=kernel_dir)
        got = run.outputs["y"].cpu()
        assert got.dtype == want.dtype
        scale = want.float().abs().max()
        err = (got.float() - want.float()).abs().max()
        assert err <= TOL[dtype] * scale, f"call {k} (T={t}, P={past}): error {err:.3g} at " \
                                          f"scale {scale:.3g}"
        assert run.states is not None
        carried = {key: t_.clone() for key, t_ in run.states.store.items()}
        assert set(carried) == set(state.store)
        for key, ref in state.store.items():
            serr = (carried[key].cpu().float() - ref.float()).abs().max()
            assert serr <= TOL[dtype] * ref.float().abs().max(), f"call {k}: {key} state " \
                                                                 f"error {serr:.3g}"
        outs.append((got, want))
        past += t
    return outs


# ---- causal_conv -----------------------------------------------------------------------------

def _conv_sequence(kernel_dir: Path, dtype: str, act: str, bias: bool) -> None:
    c, k = CHANNELS, WIDTH

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        x = b.emit(Op.SLICE, i["xz"], start=0, stop=c)       # in_proj's first half
        return b.emit(Op.CAUSAL_CONV, x, i["w"], *([i["bias"]] if bias else []), layer=3,
                      act=act, bias=bias)

    inputs = {"xz": (shape(B, T, 2 * c), dtype), "w": (shape(c, k), dtype)}
    if bias:
        inputs["bias"] = (shape(c), dtype)
    g = graph(fn, inputs)
    fixed = {"w": rand(c, k, seed=1) / k, "bias": rand(c, seed=2)}

    def values(t: int, call: int) -> dict[str, torch.Tensor]:
        return {"xz": rand(2, t, 2 * c, seed=10 + call), **{n: fixed[n] for n in inputs
                                                              if n in fixed}}
    run_sequence(g, values, dtype, kernel_dir)


@pytest.mark.parametrize("act,bias", [("silu", True), ("identity", False)])
def test_causal_conv_over_a_sequence(kernel_dir: Path, tiles: str, act: str, bias: bool) -> None:
    _conv_sequence(kernel_dir, "f32", act, bias)


def test_causal_conv_keeps_an_f16_state(kernel_dir: Path) -> None:
    """The conv state has the activations' dtype: f16 in, f16 kept, f32 sums."""
    _conv_sequence(kernel_dir, "f16", "silu", True)


# ---- ssm_scan --------------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [False, True])
def test_ssm_scan_over_a_sequence(kernel_dir: Path, tiles: str, norm: bool) -> None:
    c, n, r = CHANNELS, STATES, RANK

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        bm = b.emit(Op.SLICE, i["proj"], start=r, stop=r + n)        # x_proj's B columns
        cm = b.emit(Op.SLICE, i["proj"], start=r + n, stop=r + 2 * n)
        z = b.emit(Op.SLICE, i["xz"], start=c, stop=2 * c)          # in_proj's second half
        gains = [i["b_gain"], i["c_gain"]] if norm else []
        return b.emit(Op.SSM_SCAN, i["x"], i["dt"], i["a"], bm, cm, i["d"], z, *gains, layer=1,
                      gate=True, norm_eps=1e-6 if norm else None)

    inputs = {"x": (shape(B, T, c), "f32"), "dt": (shape(B, T, c), "f32"),
              "a": (shape(c, n), "f32"), "proj": (shape(B, T, r + 2 * n), "f32"),
              "d": (shape(c), "f32"), "xz": (shape(B, T, 2 * c), "f32")}
    if norm:
        inputs.update(b_gain=(shape(n), "f32"), c_gain=(shape(n), "f32"))
    g = graph(fn, inputs)
    fixed = {"a": -torch.exp(rand(c, n, seed=3)), "d": rand(c, seed=4),
             "b_gain": 1 + rand(n, seed=5) / 4, "c_gain": 1 + rand(n, seed=6) / 4}

    def values(t: int, call: int) -> dict[str, torch.Tensor]:
        s = 20 + 5 * call
        return {"x": rand(2, t, c, seed=s), "dt": F.softplus(rand(2, t, c, seed=s + 1) - 1),
                "proj": rand(2, t, r + 2 * n, seed=s + 2), "xz": rand(2, t, 2 * c, seed=s + 3),
                **{k: v for k, v in fixed.items() if k in inputs}}
    run_sequence(g, values, "f32", kernel_dir)


# ---- linear_attention ------------------------------------------------------------------------

def _linear_attention_graph() -> Graph:
    h, kv, d, dv = HEADS, KV_HEADS, HEAD_DIM, VALUE_DIM
    width = h * d + kv * d + kv * dv

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        cols = [(0, h * d, h), (h * d, (h + kv) * d, kv), ((h + kv) * d, width, kv)]
        q, k, v = (b.emit(Op.SPLIT_HEADS, b.emit(Op.SLICE, i["qkv"], start=lo, stop=hi),
                          heads=heads) for lo, hi, heads in cols)
        return b.emit(Op.LINEAR_ATTENTION, q, k, v, layer=2, feature="elu_plus_one")

    return graph(fn, {"qkv": (shape(B, T, width), "f32")})


def _qkv(t: int, call: int) -> dict[str, torch.Tensor]:
    width = HEADS * HEAD_DIM + KV_HEADS * (HEAD_DIM + VALUE_DIM)
    return {"qkv": rand(2, t, width, seed=40 + call)}


@pytest.mark.parametrize("prefill", [13, 37])
def test_linear_attention_over_a_sequence(kernel_dir: Path, tiles: str, prefill: int) -> None:
    # 37 tokens: three 16-token chunks with small tiles, one 64-token chunk otherwise
    run_sequence(_linear_attention_graph(), _qkv, "f32", kernel_dir, (prefill, 1, 2, 5))


# ---- the state is what carries the sequence ----------------------------------------------------

def test_a_decode_step_from_a_zero_state_differs(kernel_dir: Path) -> None:
    """The agreement above is not that of two kernels ignoring the state: a decode step started
    from zeros instead of the prefill's state gives another answer."""
    g = _linear_attention_graph()
    outs = run_sequence(g, _qkv, "f32", kernel_dir)
    step = run_graph_triton(g, {}, _qkv(1, 1), {"B": 2, "T": 1, "P": CALLS[0]}, device=DEVICE,
                            cache_dir=kernel_dir).outputs["y"].cpu()
    right = outs[1][1]
    assert (step - right).abs().max() > 1e-2 * right.abs().max()
