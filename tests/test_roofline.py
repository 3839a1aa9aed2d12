"""Roofline numbers against hand formulas."""

from __future__ import annotations

import pytest

from archc.gpus import GPUS, gpu
from archc.ir.graph import GraphBuilder, Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.shapes import B, T, shape
from archc.perf.roofline import decode_floor, kernels
from archc.spec import load_spec

H200 = GPUS["h200"]


def _single(build) -> Program:  # noqa: ANN001
    b = GraphBuilder("decoder")
    b.output("y", build(b))
    return Program("t", (b.build(),))


def test_matmul_roofline_by_hand() -> None:
    m_tokens, n, k = 4096, 14336, 4096
    program = _single(lambda b: b.emit(Op.MATMUL, b.input("x", shape(B, T, k), "bf16"),
                                       b.param("w", shape(n, k), "bf16")))
    (kern,) = kernels(program, {"B": 1, "T": m_tokens, "P": 0})
    flops = 2 * m_tokens * n * k
    nbytes = 2 * (m_tokens * k + n * k + m_tokens * n)
    assert (kern.flops, kern.bytes) == (flops, nbytes)
    assert kern.time(H200) == pytest.approx(max(flops / 989e12, nbytes / 4.8e12))
    assert kern.bound(H200) == "compute"  # AI ≈ 1.4k FLOP/B, far above the ridge (~206)


def test_causal_attention_counts_half_the_pairs() -> None:
    heads, hd, t = 32, 128, 2048

    def build(b: GraphBuilder) -> int:
        q = b.input("q", shape(B, heads, T, hd), "bf16")
        k = b.input("k", shape(B, heads, T, hd), "bf16")
        return b.emit(Op.ATTENTION, q, k, k, scale=hd ** -0.5, causal=True, padding=False,
                      prefix=False)

    def build_full(b: GraphBuilder) -> int:
        q = b.input("q", shape(B, heads, T, hd), "bf16")
        k = b.input("k", shape(B, heads, T, hd), "bf16")
        return b.emit(Op.ATTENTION, q, k, k, scale=hd ** -0.5, causal=False, padding=False,
                      prefix=False)

    (causal,) = kernels(_single(build), {"B": 1, "T": t, "P": 0})
    (full,) = kernels(_single(build_full), {"B": 1, "T": t, "P": 0})
    pairs = t * (t + 1) // 2
    assert causal.flops == heads * pairs * (4 * hd + 5)  # QKᵀ and PV: 2·2·D per pair
    assert full.flops == heads * t * t * (4 * hd + 5)


def test_llama2_7b_decode_floor() -> None:
    """13.5 GB of bf16 weights read once per token → about 2.8 ms on an H200 at 4.8 TB/s."""
    spec = load_spec("llama2-7b")
    floor = decode_floor(lower(spec, "bf16"), H200, batch=1, past=0)
    params, vocab, d = 6_738_415_616, spec.vocab_size, spec.d_model
    # the embedding gather reads one row, not the table
    assert floor.weight_bytes == 2 * (params - vocab * d) + 2 * d
    assert floor.kv_bytes == 2 * 32 * 32 * 128 * 1 * 2  # K and V of one position, 32 layers
    assert 2.7e-3 < floor.seconds < 2.85e-3
    assert floor.tokens_per_second == pytest.approx(1 / floor.seconds)


def test_gqa_cuts_decode_kv_traffic() -> None:
    llama2, llama3 = load_spec("llama2-7b"), load_spec("llama3-8b")
    kv2 = decode_floor(lower(llama2, "bf16"), H200, 1, 4095).kv_bytes
    kv3 = decode_floor(lower(llama3, "bf16"), H200, 1, 4095).kv_bytes
    assert kv2 == 4 * kv3  # 32 KV heads vs 8, same layers and head_dim


def test_sliding_window_bounds_kv_traffic() -> None:
    spec = load_spec("mistral-7b")
    floor = decode_floor(lower(spec, "bf16"), H200, 1, past=20000)
    assert floor.kv_bytes == 2 * 32 * 8 * 128 * 4096 * 2


def test_unknown_gpu_is_refused() -> None:
    from archc.errors import ArchcError
    with pytest.raises(ArchcError, match="known: a100, h100, h200"):
        gpu("v100")


def test_roofline_cli_runs_and_refuses_too_long(capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    assert main(["roofline", "tiny-llama3", "--prompt-len", "16", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "decode step: " in out and "roofline" in out and "floor" in out
    assert "µs" in out  # a tiny model's times are microseconds, not 0.000 ms
    assert main(["roofline", "tiny-llama3", "--prompt-len", "60", "--new-tokens", "10"]) == 2
    assert "exceed max_seq_len" in capsys.readouterr().err


def test_a_mamba_decode_floor_reads_and_writes_its_state_at_any_context() -> None:
    """mamba-130m keeps, per layer, a conv window [1536, 3] in bf16 and an SSM state [1536, 16]
    in f32: read and written once per step, the same at context 1 and 2000, and no KV cache."""
    program = lower(load_spec("mamba-130m"), "bf16")
    state = 2 * 24 * (1536 * 3 * 2 + 1536 * 16 * 4)
    for past in (0, 1999):
        floor = decode_floor(program, H200, batch=1, past=past)
        assert (floor.kv_bytes, floor.state_bytes) == (0, state)
    assert floor.seconds == pytest.approx((floor.weight_bytes + state) / 4.8e12)


def test_ssm_scan_cost_by_hand() -> None:
    """Per token and channel: 8 FLOPs per state dim for the recurrence and readout, 12 for the
    skip and the gate; bytes: every input once, the output once, the f32 state in and out."""
    c, n = 64, 16

    def build(b: GraphBuilder) -> int:
        x, dt, z = (b.input(k, shape(B, T, c), "bf16") for k in ("x", "dt", "z"))
        bm, cm = (b.input(k, shape(B, T, n), "bf16") for k in ("bm", "cm"))
        return b.emit(Op.SSM_SCAN, x, dt, b.param("a", shape(c, n), "f32"), bm, cm,
                      b.param("d", shape(c), "bf16"), z, layer=0, gate=True)

    (kern,) = kernels(_single(build), {"B": 2, "T": 5, "P": 0})
    tokens = 2 * 5
    assert kern.flops == tokens * c * (8 * n + 12)
    io = 2 * (4 * tokens * c + 2 * tokens * n + c) + 4 * c * n      # x, dt, z, out; B, C; D; A
    assert kern.bytes == io + 2 * (2 * c * n * 4)


def test_roofline_cli_shows_the_recurrent_state(capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    assert main(["roofline", "tiny-jamba", "--prompt-len", "16", "--new-tokens", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())       # the console wraps long lines
    assert "ssm_scan" in out and "causal_conv" in out
    assert "KV cache" in out and "recurrent state" in out


def test_b200_in_the_gpu_table() -> None:
    """B200: HGX B200 datasheet figures per GPU (2.25 PFLOP/s dense BF16, 8 TB/s), 148 SMs of
    compute capability 10.0, the GPU an sm_100a report models by default."""
    from archc.gpus import GPU_TARGETS, default_gpu
    b200 = gpu("b200")
    assert GPUS["b200"] is b200 and gpu("B200-SXM") is b200
    assert (b200.peak_flops, b200.bandwidth, b200.sms, b200.target.name) == (
        2.25e15, 8e12, 148, "sm_100a")
    assert b200.ridge == pytest.approx(281.25)        # 2.25e15 / 8e12 FLOP per byte
    assert default_gpu("sm_100a") == "b200" and b200.target is GPU_TARGETS["sm_100a"]
    # its SM holds what a Hopper SM does: 8 programs of 8 warps at 32 registers a thread
    assert GPU_TARGETS["sm_100a"].sm.resident(32, 8, 0) == 8


def test_roofline_cli_on_b200(capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    assert main(["roofline", "tiny-llama3", "--gpu", "b200", "--prompt-len", "16",
                 "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "on B200 SXM" in out and "decode step: " in out
