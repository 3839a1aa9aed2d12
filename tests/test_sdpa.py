"""The eager `attention` op through PyTorch's fused attention equals the decomposed attention
lowering emits — scores, scale, soft-cap, position bias, mask, softmax, value sum, each run by
its own op's eager semantics — for every mask kind: causal (a prefill, a chunk after a past, a
decode step), bidirectional, sliding window either way, Longformer global tokens either way,
prefix-LM, padding (a fully padded row included), ALiBi, T5 buckets either way, soft-capping (not
expressible as an additive mask: the op computes those scores itself); GQA 9/3 and odd sizes
throughout.
Then whole models: the eager backend (attention nodes, fused attention) against the program as
lowered, prefill and decode, for every tiny spec.

Tolerance (f32): 2e-6 of the output's largest magnitude. Both sides compute in f32; the fused
kernel sums the softmax online in blocks, the decomposed form over the whole row, so results
differ in the last bits (about 1e-7 here); a wrong mask or bias moves outputs by 1e-2 and more.
f16 inputs: the op computes in f32 whatever its inputs; both sides round the same f32 result to
f16, so they agree to f16's 2^-11 of the scale.
Whole models: 1e-5 of the logits' scale, as validation allows f32 kernels (the last-bit
differences compound through the layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import archc
import archc.ir.expr as E
from archc.ir.attrs import Attrs, Call
from archc.ir.ops import OP_TABLE, Op
from archc.ir.ops.base import bind, full_attrs
from archc.runtime.eager import EagerContext
from tests.conftest import TINY_SPECS

TOL = {torch.float32: 2e-6, torch.float16: 2 ** -11}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    t: int               # new queries
    length: int          # keys (the last T are the queries' own positions)
    causal: bool
    window: int | None = None
    global_tokens: int | None = None
    prefix: int | None = None
    padding: bool = False
    bias: str | None = None          # alibi, t5, t5-bidirectional
    softcap: float | None = None


CASES = [
    Case("causal prefill", 2, 37, 37, True),
    Case("causal chunk after a past", 2, 5, 23, True),
    Case("causal decode step", 3, 1, 23, True),
    Case("bidirectional", 2, 19, 19, False),
    Case("sliding window", 2, 21, 21, True, window=4),
    Case("sliding window after a past", 1, 3, 30, True, window=8),
    Case("bidirectional window", 2, 17, 17, False, window=3),
    Case("global tokens, causal", 2, 25, 25, True, window=4, global_tokens=3),
    Case("global tokens, bidirectional", 2, 25, 25, False, window=4, global_tokens=3),
    Case("prefix-LM", 2, 15, 15, True, prefix=6),
    Case("padding, one row fully padded", 3, 11, 11, False, padding=True),
    Case("padding, causal", 2, 11, 11, True, padding=True),
    Case("alibi", 2, 13, 13, True, bias="alibi"),
    Case("alibi after a past", 1, 4, 20, True, bias="alibi"),
    Case("t5, causal", 2, 12, 12, True, bias="t5"),
    Case("t5, bidirectional with padding", 2, 12, 12, False, bias="t5-bidirectional",
         padding=True),
    Case("soft-cap", 2, 9, 9, True, softcap=5.0),
]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 24
CTX = EagerContext({})


def run_op(op: Op, xs: Sequence[torch.Tensor], **attrs: Any) -> torch.Tensor:
    full = full_attrs(op, Attrs({k: v for k, v in attrs.items() if v is not None}))
    return OP_TABLE[op].eager(CTX, bind(op, full, list(xs)), full)


def inputs(case: Case, dtype: torch.dtype) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(len(case.name))
    q = torch.randn(case.batch, HEADS, case.t, HEAD_DIM, generator=gen) * 2
    k = torch.randn(case.batch, KV_HEADS, case.length, HEAD_DIM, generator=gen) * 2
    v = torch.randn(case.batch, KV_HEADS, case.length, HEAD_DIM, generator=gen)
    out: dict[str, Any] = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype)}
    if case.padding:
        pad = torch.ones(case.batch, case.length, dtype=torch.long)
        pad[0, : case.length // 3] = 0            # left padding
        pad[-1] = 0                               # nothing to see at all
        out["padding"] = pad
    if case.prefix is not None:
        out["prefix_len"] = torch.tensor(case.prefix)
    if case.bias == "alibi":
        out["bias_input"] = torch.tensor([2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)])
    elif case.bias is not None:
        out["bias_input"] = torch.randn(32, HEADS, generator=gen)   # [buckets, H]
    return out


def attrs_of(case: Case) -> dict[str, Any]:
    bias = None
    if case.bias == "alibi":
        bias = Call("alibi")
    elif case.bias is not None:
        bias = Call("t5", (), (("bidirectional", case.bias == "t5-bidirectional"),
                               ("max_distance", 64)))
    return {"scale": HEAD_DIM ** -0.5, "causal": case.causal, "window": case.window,
            "global_tokens": case.global_tokens, "softcap": case.softcap, "bias": bias,
            "padding": case.padding, "prefix": case.prefix is not None}


def decomposed(case: Case, x: dict[str, Any]) -> torch.Tensor:
    """Attention as lowering emits it, one unfused op at a time."""
    s = run_op(Op.SCORES, [x["q"], x["k"]])
    s = run_op(Op.POINTWISE, [s], expr=E.call("scale", E.x(0), by=HEAD_DIM ** -0.5))
    if case.softcap is not None:
        s = run_op(Op.POINTWISE, [s], expr=E.call("softcap", E.x(0), cap=case.softcap))
    if case.bias == "alibi":
        s = run_op(Op.ALIBI, [s, x["bias_input"]])
    elif case.bias is not None:
        s = run_op(Op.REL_BIAS, [s, x["bias_input"]],
                   bidirectional=case.bias == "t5-bidirectional", max_distance=64)
    extra = [x[k] for k in ("padding", "prefix_len") if k in x]
    s = run_op(Op.MASK, [s, *extra], causal=case.causal, padding=case.padding,
               prefix=case.prefix is not None, window=case.window,
               global_tokens=case.global_tokens)
    p = run_op(Op.SOFTMAX, [s])
    return run_op(Op.MERGE_HEADS, [run_op(Op.WEIGHTED_SUM, [p, x["v"]])])


def fused(case: Case, x: dict[str, Any]) -> torch.Tensor:
    """The attention op: q, k, v, then padding, prefix_len and the bias table if present."""
    extra = [x[k] for k in ("padding", "prefix_len", "bias_input") if k in x]
    return run_op(Op.ATTENTION, [x["q"], x["k"], x["v"], *extra], **attrs_of(case))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_attention_equals_the_decomposed_ops(case: Case, dtype: torch.dtype) -> None:
    x = inputs(case, dtype)
    got = fused(case, x)
    # the attention op computes in f32 whatever its inputs (the unfused ops would round the
    # scores and probabilities of f16 inputs to f16 on the way)
    want = decomposed(case, {k: v.float() if v.is_floating_point() else v
                             for k, v in x.items()}).to(dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert relative_error(got, want) <= TOL[dtype], case.name


def test_a_fully_padded_row_gets_uniform_weights_as_decomposed_not_nan() -> None:
    case = next(c for c in CASES if c.name == "padding, one row fully padded")
    x = inputs(case, torch.float32)
    got = fused(case, x)
    assert not got.isnan().any()
    mean_v = x["v"][-1].repeat_interleave(HEADS // KV_HEADS, 0).mean(dim=1)   # (H, D)
    assert torch.allclose(got[-1, 0], mean_v.reshape(-1), atol=1e-6)


def test_each_mask_kind_changes_the_result() -> None:
    """The cases are not vacuous: each mask or bias moves the output far beyond TOL."""
    plain = inputs(Case("x", 2, 21, 21, True), torch.float32)
    base = decomposed(Case("x", 2, 21, 21, True), plain)
    for case in (Case("w", 2, 21, 21, True, window=4), Case("a", 2, 21, 21, True, bias="alibi"),
                 Case("p", 2, 21, 21, True, prefix=6), Case("b", 2, 21, 21, False)):
        x = dict(plain) | {k: v for k, v in inputs(case, torch.float32).items()
                           if k not in ("q", "k", "v")}
        assert relative_error(decomposed(case, x), base) > 1e-2, case.name


@pytest.mark.parametrize("name", TINY_SPECS)
def test_eager_backend_equals_the_program_as_lowered(name: str) -> None:
    """Prefill, then two decode steps (an encoder: one padded forward)."""
    model = archc.load(name, seed=1)
    fast, reference = model.compile("eager"), model.compile("eager", passes="none")
    spec = model.spec
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    if spec.family == "encoder":
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
        pairs = [(fast(ids, attention_mask=mask), reference(ids, attention_mask=mask))]
    elif spec.family == "encoder-decoder":
        pairs = [(fast(ids, decoder_input_ids=ids[:, :4]),
                  reference(ids, decoder_input_ids=ids[:, :4]))]
    else:
        pairs = [(fast.session.step(ids), reference.session.step(ids))]
        for k in range(2):
            step = ids[:, k:k + 1]
            pairs.append((fast.session.step(step), reference.session.step(step)))
    for got, want in pairs:
        assert relative_error(got, want) <= 1e-5, name
