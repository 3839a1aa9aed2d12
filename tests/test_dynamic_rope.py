"""Dynamic NTK RoPE scaling (transformers' rope_type "dynamic"): once the sequence passes the
trained context, the rotation base grows with its length L,
base' = base·(factor·L/original − (factor − 1))^(d/(d−2)), and keys keep the rotation they were
written with.

Checked at each layer: the rope op against that formula written out (new base, new
frequencies); the projection's rope epilogue against the rope op; the matmul template against
eager past the trained context, over a past and in a decode step, interleaved and partial;
a tiny transformers Llama with dynamic RoPE against archc past its trained context, on a full
forward and step by step through the KV cache, on the eager and the triton backend.

Tolerances: 1e-5 of the output scale where both sides compute the same f32 sums in another
order; against transformers 1e-4 as in test_hf_crosscheck (it computes the new base in f32,
archc in f64, and the angles pos·θ of a few dozen radians carry that difference).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import archc
from archc.ir.attrs import Call
from archc.ir.graph import GraphBuilder
from archc.ir.ops import Op
from archc.ir.ops.attention import rope
from archc.ir.paramexpr import rope_cos_sin, rope_inv_freq
from archc.ir.shapes import B, T, shape
from archc.runtime.eager import EagerContext, run_graph
from tests.test_triton_kernels import build, check, rand

TOL = 1e-5


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def ntk(factor: float, original: int) -> Call:
    return Call("ntk", (), (("factor", factor), ("original_max_seq_len", original)))


def rotate_with_new_base(x: torch.Tensor, positions: torch.Tensor, theta: float, dim: int,
                         factor: float, original: int) -> torch.Tensor:
    """The formula as written: the base for length L = last position + 1, then half-split RoPE
    of the first `dim` dims at that base, in f64."""
    length = int(positions[-1]) + 1
    if length > original:
        theta = theta * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :dim // 2].double(), x[..., dim // 2:dim].double()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dim:].double()], dim=-1)
    return out.float()


@pytest.mark.parametrize("start,t", [(0, 5), (0, 20), (19, 1), (40, 3)])
@pytest.mark.parametrize("rot", [16, 12])
def test_rope_op_rescales_the_base_past_the_trained_context(start: int, t: int,
                                                            rot: int) -> None:
    theta, factor, original, hd = 10000.0, 4.0, 16, 16
    x = rand(2, 3, t, hd)
    pos = torch.arange(start, start + t)
    freq = rope_inv_freq(dim=rot, theta=theta)
    got = rope(x, pos, freq, rot, False, ntk(factor, original))
    want = rotate_with_new_base(x, pos, theta, rot, factor, original)
    assert (got - want).abs().max() <= TOL * want.abs().max()
    plain = rope(x, pos, rope_cos_sin(freq, rows=start + t), rot, False)
    assert torch.equal(got, plain) == (start + t <= original)


def test_epilogue_rope_equals_the_rope_op() -> None:
    """q and k rotated in the projection's epilogue, with dynamic scaling, equal the separate
    projections and rope ops — past the trained context and over a past of 30 positions."""
    heads, hd, rot, d, t, past = 3, 16, 12, 24, 5, 30
    dynamic = ntk(2.0, 8)
    values = {"x": rand(2, t, d), "w": rand(heads * hd, d), "pos": torch.arange(past, past + t),
              "freq": rope_inv_freq(dim=rot, theta=500.0)}
    inputs = {"x": (shape(B, T, d), "f32"), "w": (shape(heads * hd, d), "f32"),
              "pos": (shape(T), "i64"), "freq": (shape(rot // 2), "f32")}

    def unfused(b: GraphBuilder, i: dict[str, int]) -> int:
        h = b.emit(Op.SPLIT_HEADS, b.emit(Op.MATMUL, i["x"], i["w"]), heads=heads)
        h = b.emit(Op.ROPE, h, i["pos"], i["freq"], rotary_dim=rot, interleaved=False,
                   dynamic=dynamic)
        return b.emit(Op.MERGE_HEADS, h)

    def fused(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["pos"], i["freq"], epilogue=(
            Call("rope", (), (("dynamic", dynamic), ("head_dim", hd), ("heads", heads),
                              ("interleaved", False), ("rotary_dim", rot))),))

    outs = []
    for fn in (unfused, fused):
        outs.append(run_graph(build(inputs, fn, "g"), {}, values,
                              EagerContext({"B": 2, "T": t, "P": past}))["y"])
    assert (outs[0] - outs[1]).abs().max() <= TOL * outs[0].abs().max()


@pytest.mark.parametrize("interleaved,rot,hd,t,past", [(False, 16, 16, 13, 0),
                                                       (True, 8, 16, 3, 21),
                                                       (False, 8, 20, 1, 40)])
def test_matmul_template_dynamic_rope(kernel_dir: Path, interleaved: bool, rot: int, hd: int,
                                      t: int, past: int) -> None:
    """The kernel reads L from the last position it is given, so one compiled kernel serves
    every length: a prompt past the trained context of 8, a chunk over a past, a decode step."""
    heads, kv_heads, d = 4, 2, 24
    width = (heads + 2 * kv_heads) * hd

    def fn(b: GraphBuilder, i: dict[str, int]) -> int:
        return b.emit(Op.FUSED_LINEAR, i["x"], i["w"], i["pos"], i["freq"], epilogue=(
            Call("rope", (), (("dynamic", ntk(3.0, 8)), ("head_dim", hd),
                              ("heads", heads + kv_heads), ("interleaved", interleaved),
                              ("rotary_dim", rot))),
            Call("kv_write", (), (("head_dim", hd), ("k_start", heads * hd),
                                  ("kv_heads", kv_heads), ("layer", 0),
                                  ("v_start", (heads + kv_heads) * hd)))))

    g = build({"x": (shape(B, T, d), "f32"), "w": (shape(width, d), "f32"),
               "pos": (shape(T), "i64"), "freq": (shape(rot // 2), "f32")}, fn)
    check(g, {"x": rand(2, t, d), "w": rand(width, d), "pos": torch.arange(past, past + t),
              "freq": rope_inv_freq(dim=rot, theta=10000.0)}, {"B": 2, "T": t, "P": past},
          kernel_dir, past_kv={(0, "k"): rand(2, kv_heads, past, hd, seed=1),
                               (0, "v"): rand(2, kv_heads, past, hd, seed=2)} if past else None)


# ---- against transformers --------------------------------------------------------------------

transformers = pytest.importorskip("transformers", reason="needs transformers")
TRAINED = 12


def hf_dynamic_llama(directory: Path) -> torch.nn.Module:
    from tests.test_hf_crosscheck import randomize
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TRAINED, vocab_size=97,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, 0)
    model.save_pretrained(directory)
    return model


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_loader_reads_dynamic_rope(tmp_path: Path) -> None:
    hf_dynamic_llama(tmp_path)
    spec = archc.load(tmp_path).spec
    sc = spec.position.scaling
    assert (sc.kind, sc.factor, sc.original_max_seq_len) == ("dynamic", 3.0, TRAINED)
    assert spec.max_seq_len == math.ceil(TRAINED * 3.0)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_matches_transformers_past_the_trained_context(tmp_path: Path, backend: str) -> None:
    """A fresh transformers model each time (it keeps the longest length seen between calls).
    A forward of 29 tokens (> 12) at once; then a prompt of 9 decoded one token at a time to
    30: the frequencies change at every step past 12, and the cached keys keep theirs."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 97, (2, 29), generator=gen)
    hf_dynamic_llama(tmp_path / "model")

    def fresh() -> torch.nn.Module:
        return transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model").eval()

    model = archc.load(tmp_path / "model")
    options = {"cache_dir": tmp_path / "kernels"} if backend == "triton" else {}
    compiled = model.compile(backend, **options)
    with torch.no_grad():
        want = fresh()(ids).logits
    got = compiled(ids)
    assert rel_error(got, want) <= 1e-4

    hf = fresh()
    session = compiled.session
    session.reset()
    x = ids[:, :9]
    cache = None
    with torch.no_grad():
        for step in range(21):
            out = hf(x, cache=cache, use_cache=True)
            cache = out.cache
            want = out.logits[:, -1]
            got = session.step(x)[:, -1]
            assert rel_error(got, want) <= 1e-4, f"step {step} (length {session.past})"
            x = want.argmax(-1)[:, None]


def test_cached_keys_keep_their_rotation() -> None:
    """Up to the trained context (8 here) a prefill then decode steps equal one full pass.
    Past it they differ on purpose: keys cached at length 9 keep that rotation, while one pass
    over 12 tokens rotates every key at length 12 (transformers does the same)."""
    session = archc.load("tiny-longctx", seed=3).compile("eager").session
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))

    def split(n: int, first: int) -> torch.Tensor:
        session.reset()
        parts = [session.step(ids[:, :first])]
        parts += [session.step(ids[:, t:t + 1]) for t in range(first, n)]
        return torch.cat(parts, dim=1)

    def full(n: int) -> torch.Tensor:
        session.reset()
        return session.step(ids[:, :n])

    within, past = (split(8, 5), full(8)), (split(12, 9), full(12))
    assert rel_error(*within) <= 1e-5
    assert rel_error(past[0][:, :9], past[1][:, :9]) > 1e-3
