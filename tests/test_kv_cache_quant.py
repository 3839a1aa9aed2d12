"""A quantized KV cache (`kv_cache="int8"` or `"fp8"`): one-byte codes and an f32 scale per
(token, KV head) = max|x|/QMAX over the head's values, read back as code·scale.

Checked: the eager cache and attention against a reference written out here (quantize each row,
dequantize, attend); the Triton kernels (interpreter, f32) against eager with the same cache over
a prefill and decode steps, on tiny-llama3, on tiny-mistral (GQA, a sliding window the
sequence outgrows) and on tiny-olmo2 (its cache written from the QK-norm kernel's rows), at 1e-4
of the logits' scale; SmolLM2-135M-Instruct (the Q4_1 GGUF) answering a chat question with the
same greedy tokens as with an f32 cache, its logits' error printed; the bytes per token against
the spec by hand; bad formats refused; fp8 on the eager backend.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import archc
from archc.cli import main
from archc.errors import ArchcError
from archc.ir import cost
from archc.ir.lower import lower
from archc.ir.ops import OP_TABLE, Op, canonical, full_attrs
from archc.ir.text import format_program, parse_program
from archc.runtime.eager import EagerContext, KVCache

TOL = 1e-4
HAS_FP8 = hasattr(torch, "float8_e4m3fn")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def reference_int8(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] as an int8 cache should hold them: codes round(x·127/max|x|), back times
    max|x|/127 (written independently of archc's kv_quantize)."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / 127
    codes = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale)))
    assert codes.abs().max() <= 127
    return codes * scale


def attrs(op: Op, **given: object) -> object:
    """An op's attributes as eager semantics read them (defaults filled in)."""
    return full_attrs(op, canonical(op, given))


def test_eager_int8_cache_is_quantize_then_dequantize() -> None:
    """Prefill 6 tokens, then 2 decode steps, through the kv_cache op: what it returns is the
    reference's rows; attention over the cache is softmax over those rows."""
    torch.manual_seed(0)
    b, h, d, heads = 2, 2, 16, 4
    cache = KVCache(16)
    at = attrs(Op.KV_CACHE, layer=0, kind="k", quant="int8")
    at_v = attrs(Op.KV_CACHE, layer=0, kind="v", quant="int8")
    written_k, written_v, past = [], [], 0
    for t in (6, 1, 1):
        k, v = torch.randn(b, h, t, d) * 3, torch.randn(b, h, t, d)
        written_k.append(k)
        written_v.append(v)
        ctx = EagerContext({"B": b, "T": t, "P": past, "S": 0}, cache)
        got_k = OP_TABLE[Op.KV_CACHE].eager(ctx, {"x": k}, at)
        got_v = OP_TABLE[Op.KV_CACHE].eager(ctx, {"x": v}, at_v)
        want_k = reference_int8(torch.cat(written_k, dim=2))
        want_v = reference_int8(torch.cat(written_v, dim=2))
        torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_v, want_v, atol=1e-6, rtol=0)
        assert (got_k - torch.cat(written_k, dim=2)).abs().max() > 1e-4   # it is quantized
        # the cache holds int8 codes and one f32 scale per (sequence, head, position)
        assert cache.store[(0, "k")].dtype == torch.int8
        assert cache.scales[(0, "k")].shape == (b, h, 16)
        # cached attention (GQA: 4 query heads over 2 KV heads) reads the stored rows
        q = torch.randn(b, heads, t, d)
        att = attrs(Op.ATTENTION, scale=d ** -0.5, causal=True, cache_layer=0, kv_heads=h,
                    kv_quant="int8")
        out = OP_TABLE[Op.ATTENTION].eager(ctx, {"q": q}, att)
        kk, vv = (x.repeat_interleave(heads // h, dim=1) for x in (want_k, want_v))
        length = past + t
        mask = torch.ones(t, length, dtype=torch.bool).tril(length - t)
        s = (q @ kk.transpose(-1, -2)) * d ** -0.5
        ref = torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ vv
        torch.testing.assert_close(out, ref.transpose(1, 2).reshape(b, t, heads * d),
                                   atol=1e-5, rtol=1e-5)
        past += t


def test_ir_carries_the_cache_format() -> None:
    """The unfused and the kernel-level program say int8 in their text, which round-trips."""
    model = archc.load("tiny-llama3")
    unfused = lower(model.spec, "f32", kv_cache="int8")
    text = format_program(unfused)
    assert text.count('quant="int8"') == 2 * model.spec.layers     # k and v per layer
    assert format_program(parse_program(text)) == text
    from archc.passes import optimize
    fused = optimize(unfused, "default")
    text = format_program(fused)
    assert 'quant="int8"' in text and 'kv_quant="int8"' in text
    assert format_program(parse_program(text)) == text


def greedy(session: object, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after `prompt` and the logits of each step."""
    session.reset()  # type: ignore[attr-defined]
    x, tokens, logits = prompt, [], []
    for _ in range(steps):
        last = session.step(x)[:, -1]  # type: ignore[attr-defined]
        logits.append(last)
        tokens.append(int(last.argmax()))
        x = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-mistral", "tiny-olmo2"])
def test_triton_int8_cache_matches_eager(name: str, kernel_dir: Path) -> None:
    """Prefill 11 tokens, then 5 decode steps (tiny-mistral's window of 8 slides past the
    prompt's first keys): the kernels' logits are eager's with the same int8 cache, and differ
    from an f32 cache's."""
    model = archc.load(name, seed=3)
    prompt = torch.randint(0, model.spec.vocab_size, (1, 11),
                           generator=torch.Generator().manual_seed(1))
    triton = model.compile("triton", dtype="f32", kv_cache="int8", cache_dir=kernel_dir,
                           autotune=False).session
    tokens, got = greedy(triton, prompt, 6)
    # every layer's k and v cache holds int8 codes, and an f32 scale per row
    for layer in range(model.spec.layers):
        for kind in "kv":
            assert triton.cache.get(layer, kind).dtype == torch.int8
            assert triton.cache.get(layer, f"{kind}_scale").dtype == torch.float32
    want_tokens, want = greedy(model.compile(kv_cache="int8").session, prompt, 6)
    plain = greedy(model.compile().session, prompt, 6)[1]
    scale = want.abs().max()
    assert tokens == want_tokens
    assert (got - want).abs().max() <= TOL * scale
    assert (plain - want).abs().max() > TOL * scale      # the int8 cache is not the f32 one


def test_bytes_per_token_by_hand() -> None:
    """tiny-llama3: 2 layers × k and v × 2 KV heads × 16 values: 4 bytes each in f32; a code
    and, per row of 16, a 4-byte scale in int8 — unfused and kernel-level alike."""
    from archc.passes import optimize
    model = archc.load("tiny-llama3")
    s, att = model.spec, model.spec.attention
    rows = s.layers * 2 * att.kv_heads
    assert cost.kv_cache_bytes_per_token(lower(s, "f32")) == rows * att.head_dim * 4
    for kv in ("int8", "fp8"):
        unfused = lower(s, "f32", kv_cache=kv)
        assert cost.kv_cache_bytes_per_token(unfused) == rows * (att.head_dim + 4)
        assert cost.kv_cache_bytes_per_token(optimize(unfused, "default")) == \
            rows * (att.head_dim + 4)


def test_show_reports_the_smaller_cache(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "smollm2-135m", "--kv-cache", "int8"]) == 0
    out = capsys.readouterr().out
    # 30 layers × k, v × 3 KV heads × (64 codes + a 4-byte scale) = 12,240 bytes
    assert "11.95 KiB per token" in out and "int8 codes" in out


def test_bad_formats_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    model = archc.load("tiny-llama3")
    for backend in ("eager", "triton"):
        with pytest.raises(ArchcError, match="'int8', 'fp8'"):
            model.compile(backend, kv_cache="int4")
    with pytest.raises(ArchcError, match="int8, fp8"):
        lower(model.spec, "f32", kv_cache="q8")
    for command in ("run", "show", "roofline"):
        assert main([command, "tiny-llama3", "--kv-cache", "int4"]) == 2
        err = capsys.readouterr().err
        assert "invalid choice: 'int4'" in err and "'int8', 'fp8'" in err


@pytest.mark.skipif(not HAS_FP8, reason="this torch has no float8_e4m3fn")
def test_fp8_cache_on_eager_and_refused_by_the_interpreter() -> None:
    """fp8 e4m3 codes on the eager backend: close to the f32 cache, not equal; the triton
    backend refuses it on the CPU, naming what works."""
    model = archc.load("tiny-llama3", seed=3)
    prompt = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    session = model.compile(kv_cache="fp8").session
    _, got = greedy(session, prompt, 3)
    assert session.cache.store[(0, "k")].dtype == torch.float8_e4m3fn
    _, want = greedy(model.compile().session, prompt, 3)
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.05
    with pytest.raises(ArchcError, match="compute capability 8.9.*kv_cache='int8'"):
        model.compile("triton", dtype="f32", kv_cache="fp8")


def test_smollm2_int8_cache_answers_with_the_same_tokens() -> None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) on the eager backend: the greedy answer to a chat
    question with an int8 cache is token for token the f32 cache's; the largest logits error
    over the answer is printed (pytest -s shows it)."""
    from tests.test_gguf_smollm2 import smollm2_gguf
    model = archc.load(str(smollm2_gguf()))
    ids = model.tokenizer.encode_chat([{"role": "user",
                                        "content": "What is the capital of France?"}])
    prompt = torch.tensor([ids])
    want_tokens, want = greedy(model.compile(dtype="f32").session, prompt, 8)
    tokens, got = greedy(model.compile(dtype="f32", kv_cache="int8").session, prompt, 8)
    answer = model.tokenizer.decode(tokens)
    error = (got - want).abs().max().item()
    print(f"\nSmolLM2 int8 KV cache: {answer!r}; max logits error {error:.4g} "
          f"(logits up to {want.abs().max().item():.4g})")
    assert tokens == want_tokens
    assert "Paris" in answer
    assert error > 0            # the cache really is int8
