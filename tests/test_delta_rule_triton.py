"""The gated delta rule's Triton kernels (both forms) against a float64 loop over the tokens,
under Triton's interpreter in f32 (and f16): odd value dims (masks), T not a multiple of the
chunk, an initial state, and decode after a chunked prefill."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from archc.codegen.delta_rule import DeltaRuleKernels, launch_constexprs, render  # noqa: E402
from archc.codegen.layout import CodegenError  # noqa: E402
from archc.codegen.render import ENV  # noqa: E402
from archc.errors import ArchcError  # noqa: E402
from archc.runtime.delta_rule import gated_delta_rule  # noqa: E402

# f32 kernels against a float64 loop: the chunked form's triangular solve and its exp(γ_i − γ_j)
# differences round differently from a step-by-step loop; 1e-4 is ~100 f32 ulps at |o| ≈ 1
TOL = dict(rtol=1e-4, atol=1e-4)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one token at a time, in float64."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    s = torch.zeros(b, h, dk, dv, dtype=torch.float64) if state is None else state.double()
    o = torch.zeros(b, t, h, dv, dtype=torch.float64)
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        kt = k[:, i]                                              # [B, H, Dk]
        delta = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", s, kt))
        s = s + kt[..., :, None] * delta[..., None, :]
        o[:, i] = torch.einsum("bhkv,bhk->bhv", s, scale * q[:, i])
    return o, s


def inputs(b: int, t: int, h: int, dk: int, dv: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    # log decays from ~0 to ~−2 (Qwen3-Next's −exp(A)·softplus(a + dt_bias) spans that)
    g = -2.0 * torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def state(b: int, h: int, dk: int, dv: int) -> torch.Tensor:
    return torch.randn(b, h, dk, dv, generator=torch.Generator().manual_seed(7))


CASES = [  # b, t, h, dk, dv, form, chunk, initial state
    (1, 13, 2, 8, 8, "recurrent", 8, False),
    (2, 9, 2, 16, 6, "recurrent", 8, True),
    (1, 16, 2, 8, 8, "chunked", 8, False),
    (2, 37, 2, 16, 6, "chunked", 16, True),       # 37 = 2·16 + 5: a partial last chunk
    (1, 21, 2, 8, 6, "chunked", 8, True),
]


@pytest.mark.parametrize("b,t,h,dk,dv,form,chunk,initial", CASES)
def test_gated_delta_rule_matches_a_float64_loop(b: int, t: int, h: int, dk: int, dv: int,
                                                 form: str, chunk: int, initial: bool) -> None:
    x = inputs(b, t, h, dk, dv)
    s0 = state(b, h, dk, dv) if initial else None
    scale = dk ** -0.5
    o, s = gated_delta_rule(**x, initial_state=s0, scale=scale, form=form, chunk=chunk)
    want_o, want_s = reference(**x, state=s0, scale=scale)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(s.double(), want_s, **TOL)


# f16 inputs: the recurrent form computes in f32 from them (the f32 tolerance holds); the chunked
# form rounds its tensor-core operands — S, 𝒯, δ — to f16 each chunk (2⁻¹¹ ≈ 5e-4 relative), so
# 2e-3 is ~4 f16 ulps at |S| ≈ 1
F16_TOL = {"recurrent": TOL, "chunked": dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_f16_inputs_give_f16_outputs_and_an_f32_state(form: str) -> None:
    x = {n: a.half() for n, a in inputs(2, 37, 2, 16, 6, seed=5).items()}
    s0 = state(2, 2, 16, 6)
    o, s = gated_delta_rule(**x, initial_state=s0, scale=0.25, form=form, chunk=16)
    want_o, want_s = reference(**x, state=s0, scale=0.25)
    assert o.dtype == torch.float16 and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, **F16_TOL[form])
    torch.testing.assert_close(s.double(), want_s, **F16_TOL[form])


def test_decode_after_a_chunked_prefill_continues_the_recurrence() -> None:
    """A chunked prefill of 19 tokens, then 2 decode steps (T = 1, recurrent, each from the
    state before it), give the outputs and state of one recurrent run over all 21."""
    b, t, h, dk, dv = 2, 21, 2, 16, 8
    x = inputs(b, t, h, dk, dv, seed=3)
    s0 = state(b, h, dk, dv)
    scale = dk ** -0.5
    whole_o, whole_s = gated_delta_rule(**x, initial_state=s0, scale=scale, form="recurrent",
                                        chunk=16)
    prefix = {n: a[:, :19] for n, a in x.items()}
    o, s = gated_delta_rule(**prefix, initial_state=s0, scale=scale, form="chunked", chunk=16)
    outs = [o]
    for i in (19, 20):
        step = {n: a[:, i:i + 1] for n, a in x.items()}
        o, s = gated_delta_rule(**step, initial_state=s, scale=scale, form="recurrent", chunk=16)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole_o, **TOL)
    torch.testing.assert_close(s, whole_s, **TOL)
    torch.testing.assert_close(whole_o.double(), reference(**x, state=s0, scale=scale)[0], **TOL)


@pytest.mark.parametrize("make,message", [
    (lambda: DeltaRuleKernels(0, 8, 8), "heads must be a positive integer"),
    (lambda: DeltaRuleKernels(2, 8, True), "dv must be a positive integer"),
    (lambda: DeltaRuleKernels(2, 8, 8, "f64"), "dtype must be one of"),
    (lambda: render(DeltaRuleKernels(2, 8, 8), chunk=24), "chunk must be a power of two"),
    (lambda: launch_constexprs(DeltaRuleKernels(2, 8, 8), "scan", "interpret", chunk=16,
                               initial=False), "form must be one of"),
    (lambda: launch_constexprs(DeltaRuleKernels(2, 8, 8), "chunked", "gpu", chunk=8,
                               initial=False), "chunk must be at least 16 on a GPU"),
    (lambda: ENV.get_template("delta_rule.py.j2").render(forms=["scan"]),
     "form must be recurrent or chunked, not 'scan'"),
])
def test_bad_template_parameters_are_one_line(make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(CodegenError, match=message):
        make()


def test_mismatched_inputs_are_one_line() -> None:
    x = inputs(1, 4, 2, 8, 8)
    x["beta"] = x["beta"][:, :3]
    with pytest.raises(ArchcError, match=r"beta is \[1, 3, 2\], expected \[1, 4, 2\]"):
        gated_delta_rule(**x, initial_state=None, scale=1.0, form="chunked", chunk=8)
    x = inputs(1, 4, 2, 8, 8)
    with pytest.raises(ArchcError, match="initial_state must be float32"):
        gated_delta_rule(**x, initial_state=state(1, 2, 8, 8).half(), scale=1.0,
                         form="recurrent", chunk=8)


def test_no_tokens_pass_the_state_through() -> None:
    x = inputs(1, 0, 2, 8, 6)
    s0 = state(1, 2, 8, 6)
    o, s = gated_delta_rule(**x, initial_state=s0, scale=1.0, form="chunked", chunk=8)
    assert o.shape == (1, 0, 2, 6)
    assert torch.equal(s, s0)
