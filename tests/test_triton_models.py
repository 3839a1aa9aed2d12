"""Whole models on the generated kernels agree with the eager interpreter.

Every tiny zoo spec, compiled with
`model.compile("triton")` (the default passes, then codegen), against `model.compile("eager")` on
the same weights: a full forward at T = 1 and at an odd T
longer than the sliding windows (8), prefill then token-by-token decode over the KV cache, greedy
generation, and for encoders a batch with padding. Without a GPU the kernels run under Triton's
interpreter in f32 (f16 for a few specs); on a GPU the same tests run in f32, f16 and bf16.

Tolerances, relative to the largest logit (or hidden state):
- f32 (1e-4): both sides accumulate in f32; passes reassociate (folded norms, merged
  projections) and kernels sum in other orders, errors compounding over the layers to ~1e-6;
  1e-4 keeps a margin while any wrong kernel (errors of order 1) fails.
- f16 (1e-2): eager rounds every op's output to f16, the kernels keep fused intermediates in f32;
  measured 0.6–3e-3 between the two on these specs, the same size as f16 eager vs f32 eager.
- bf16 (6e-2): 8 mantissa bits against f16's 11, so the same reasoning ×8.
Greedy tokens must be identical in f32; in f16/bf16 a differing argmax is accepted only where the
eager logits had a near tie (top-2 gap within the tolerance).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import archc
from archc.spec import load_spec
from tests.conftest import KERNEL_SPECS

TOL = {"f32": 1e-4, "f16": 1e-2, "bf16": 6e-2}
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = ["f32", "f16", "bf16"] if CUDA else ["f32"]
DECODERS = [n for n in KERNEL_SPECS if load_spec(n).family == "decoder"]
ENCODERS = [n for n in KERNEL_SPECS if load_spec(n).family == "encoder"]
SEQ2SEQ = [n for n in KERNEL_SPECS if load_spec(n).family == "encoder-decoder"]


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def pair(name: str, dtype: str, kernel_dir: Path) -> tuple[archc.CompiledModel,
                                                            archc.CompiledModel]:
    model = archc.load(name, seed=3)
    return (model.compile("eager", dtype=dtype, device=DEVICE),
            model.compile("triton", dtype=dtype, device=DEVICE, cache_dir=kernel_dir))


def close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    assert got.shape == want.shape
    scale = want.float().abs().max()
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} at scale {scale:.3g}"


def ids(batch: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", DECODERS + SEQ2SEQ)
@pytest.mark.parametrize("t", [1, 13])
def test_forward(name: str, t: int, dtype: str, kernel_dir: Path) -> None:
    eager, triton = pair(name, dtype, kernel_dir)
    x = ids(2, t)
    kw = {"decoder_input_ids": ids(2, max(1, t - 4), seed=1)} if name in SEQ2SEQ else {}
    close(triton(x, **kw), eager(x, **kw), dtype)


@pytest.mark.parametrize("name", DECODERS + SEQ2SEQ)
def test_forward_through_tensor_descriptors(name: str, kernel_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's prefill load path on the interpreter (which runs tensor descriptors too): every
    launch that can read its tiles through TMA descriptors does, and the model still agrees with
    eager at 1e-4."""
    from archc.codegen import blocks
    real, forced = blocks.launch_config, set()

    def config(family: str, target: str, **sizes: int) -> dict:
        cfg = real(family, target, **sizes)
        if "TMA" in cfg:
            cfg["TMA"] = 1
            forced.add(family)
        return cfg

    monkeypatch.setattr(blocks, "launch_config", config)
    eager, triton = pair(name, "f32", kernel_dir)
    x = ids(2, 13)
    kw = {"decoder_input_ids": ids(2, 9, seed=1)} if name in SEQ2SEQ else {}
    close(triton(x, **kw), eager(x, **kw), "f32")
    assert "matmul" in forced


def near_tie(logits: torch.Tensor, dtype: str) -> bool:
    top = logits.float().topk(2).values
    return bool(top[0] - top[1] <= TOL[dtype] * logits.float().abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", DECODERS + SEQ2SEQ)
def test_prefill_then_greedy_decode(name: str, dtype: str, kernel_dir: Path) -> None:
    """Prefill a prompt, then decode token by token over the KV cache (the split-KV decode
    kernels), each step fed eager's greedy token: the logits agree at every step and so does
    the argmax — greedy generation is identical."""
    eager, triton = pair(name, dtype, kernel_dir)
    sessions = (eager.session, triton.session)
    x = ids(2, 5, seed=2)
    extra: dict[object, dict[str, torch.Tensor]] = {s: {} for s in sessions}
    if name in SEQ2SEQ:
        extra = {s: {"encoder_hidden": s.encode(x)} for s in sessions}
        x = torch.zeros(2, 1, dtype=torch.long)  # the decoder start token
    for s in sessions:
        s.reset()
    for _ in range(4):
        want, got = (s.step(x, **extra[s])[:, -1] for s in sessions)
        close(got, want, dtype)
        nxt = want.argmax(-1)
        for row in range(2):
            assert got[row].argmax() == nxt[row] or (dtype != "f32" and near_tie(want[row],
                                                                                 dtype))
        x = nxt[:, None]


@pytest.mark.parametrize("name", DECODERS)
def test_one_decode_plan_serves_every_step_and_batch(name: str, kernel_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode as on a GPU: every plan's grids cover the whole cache (what a captured CUDA graph
    replays), so one decode plan per batch size serves every past length — split-KV attention,
    split-K projections and MoE routing all find their work from the live length on the device.
    The logits agree with eager at every step, across batch-size changes both ways."""
    from archc.runtime.triton_backend import TritonSession
    monkeypatch.setattr(TritonSession, "kv_len", lambda self, past, t: self.max_seq_len)
    eager, triton = pair(name, "f32", kernel_dir)
    sessions = (eager.session, triton.session)
    decoder = triton.session.runners["decoder"]
    for batch in (2, 1, 3):
        x = ids(batch, 5, seed=batch)
        for s in sessions:
            s.reset()
        for _ in range(3):
            want, got = (s.step(x)[:, -1] for s in sessions)
            close(got, want, "f32")
            x = want.argmax(-1)[:, None]
        decode_plans = [k for k in decoder.plans if k[:2] == (batch, 1)]
        assert len(decode_plans) == 1, decode_plans


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gemma2", "tiny-mixtral", "tiny-t5",
                                  "tiny-mamba", "tiny-jamba"])
def test_generate_matches_eager(name: str, kernel_dir: Path) -> None:
    """The public generate() on the triton backend returns eager's tokens."""
    eager, triton = pair(name, "f32", kernel_dir)
    prompt = ids(2, 4, seed=4)
    assert torch.equal(triton.generate(prompt, 3), eager.generate(prompt, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("t", [1, 11])
def test_encoder_batch_with_padding(name: str, t: int, dtype: str, kernel_dir: Path) -> None:
    eager, triton = pair(name, dtype, kernel_dir)
    x = ids(3, t, seed=5)
    mask = torch.ones(3, t, dtype=torch.long)
    mask[1, t // 2 + 1:] = 0      # padded at the end
    mask[2, :t // 3] = 0          # and at the start (t = 1: unpadded)
    types = torch.randint(0, 2, (3, t), generator=torch.Generator().manual_seed(6))
    got = triton(x, attention_mask=mask, token_type_ids=types)
    want = eager(x, attention_mask=mask, token_type_ids=types)
    keep = mask.bool().to(got.device)  # padded positions are not defined outputs
    close(got[keep], want[keep], dtype)


def test_unique_kernels_are_shared_across_layers(kernel_dir: Path) -> None:
    _, triton = pair("tiny-llama3", "f32", kernel_dir)
    gen = triton.session.generated
    layers = load_spec("tiny-llama3").layers
    assert gen.launches == 2 + 5 * layers   # embedding, head; per layer qkv, attention, o, up, down
    # the two layers share every per-layer kernel, and the o and down projections one kernel
    # (they differ only in K); the last-token variant (archc.passes.logits) adds its head over
    # one row
    assert len(gen.units) == 6 + 1
    assert all(sum(run == "decoder" for run, _, _ in u.uses) == layers
               for u in gen.units if u.family == "attention")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gemma2", "tiny-mixtral"])
def test_cuda_graph_decode_matches_launches(name: str, kernel_dir: Path) -> None:
    """Decode replayed from a captured CUDA graph gives the logits of plain launches, step after
    step (P changes on the device only), and again after a batch-size change."""
    model = archc.load(name, seed=3)
    plain = model.compile("triton", device=DEVICE, cuda_graphs=False, cache_dir=kernel_dir)
    graphs = model.compile("triton", device=DEVICE, cuda_graphs=True, cache_dir=kernel_dir)
    for batch in (2, 1, 2):
        x = ids(batch, 5, seed=batch)
        for s in (plain.session, graphs.session):
            s.reset()
        for _ in range(4):
            want, got = (s.step(x)[:, -1] for s in (plain.session, graphs.session))
            close(got, want, "f32")
            x = want.argmax(-1)[:, None]


def test_ids_are_checked_on_the_host_at_every_step(kernel_dir: Path) -> None:
    """Ids given on the host are refused before they reach the device, at decode too."""
    from archc.errors import RunError
    _, triton = pair("tiny-llama3", "f32", kernel_dir)
    s = triton.session
    s.reset()
    s.step(ids(1, 3))
    with pytest.raises(RunError, match=r"tokens holds ids outside \[0, 97\)"):
        s.step(torch.tensor([[97]]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="host synchronisation is a GPU matter")
def test_decode_steps_do_not_wait_on_the_gpu(kernel_dir: Path) -> None:
    """After a warm-up step (kernels compiled), a decode step fed the device's own tokens makes
    no host-device synchronisation: ids are not read back, positions are made on the device."""
    model = archc.load("tiny-llama3", seed=3)
    s = model.compile("triton", device=DEVICE, cuda_graphs=False, cache_dir=kernel_dir).session
    s.reset()
    x = s.step(ids(1, 5).to(DEVICE))[:, -1].argmax(-1)[:, None]
    x = s.step(x)[:, -1].argmax(-1)[:, None]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            x = s.step(x)[:, -1].argmax(-1)[:, None]
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", ["tiny-mamba", "tiny-linear-attention"])
def test_a_new_sequence_starts_from_a_zero_state(name: str, kernel_dir: Path) -> None:
    """The recurrent state lives in tensors the kernels update in place: after a reset the next
    prefill must read zeros, not what the last sequence left — the same prompt gives the same
    logits, bit for bit."""
    _, triton = pair(name, "f32", kernel_dir)
    s = triton.session
    prompt = ids(2, 5, seed=7)
    s.reset()
    first = s.step(prompt)
    s.step(ids(2, 3, seed=8))
    s.reset()
    assert torch.equal(s.step(prompt), first)
    assert s.states.bytes() > 0 and s.cache.bytes() == 0   # a state, and no KV cache
