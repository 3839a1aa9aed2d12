"""Translation validation: every exact pass keeps the function of every tiny zoo model.

For each tiny spec, the eager interpreter runs the program before and after a pass on the same
random weights (biases and gains random, never constant, so a pass that mishandles one changes
the output visibly) over shapes hypothesis draws: batch 1 or 2, a prefill of T = 1, odd T, or
T > the tiny sliding window of 8, then decode steps through the KV cache; encoders get padding
masks, the encoder-decoder a padded source. Checked: each step of the default pipeline (before
vs after, where the pass changed something), each exact pass alone on the unfused program, and
the whole default pipeline — and the same for QK-norm variants of three specs and for a spec of
layer types.

Tolerance: max|after − before| ≤ 1e-5 · max|before|, in f32. A pass reorders sums (a gain folded
into the weight, 1/rms applied after the dot product, E[x²] − E[x]² for the variance, a sum of two
matmuls as one over concatenated K), which moves each value by a few ulps (ε = 1.2e-7); through
2–4 layers that stays around 1e-6 of the output scale. 1e-5 leaves a margin of ten, while a
bias, gain or mask handled wrongly shows at 1e-2 and more.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.passes import PASSES, run_pipeline
from archc.passes.manager import PipelineRun, run_pass
from archc.runtime.eager import EagerSession
from archc.runtime.weights import random_weights
from archc.spec import from_dict, load_spec, to_dict
from archc.spec.schema import Spec
from tests.conftest import TINY_SPECS
from tests.test_layer_types import LAYER_TYPES

TOL = 1e-5
EXACT = [name for name, p in PASSES.items() if p.kind == "exact"]


@dataclass(frozen=True)
class Shapes:
    batch: int
    prefill: int       # T of the first call
    decode: int        # single-token calls after it
    source: int        # encoder length (encoder-decoder)
    seed: int


SHAPES = st.builds(Shapes, batch=st.integers(1, 2),
                   prefill=st.sampled_from([1, 2, 3, 5, 7, 9, 11, 13]),
                   decode=st.integers(0, 3), source=st.sampled_from([1, 4, 9, 12]),
                   seed=st.integers(0, 2**16))
# T = 1 then decode; odd T past the window of 8 with decode; a padded batch
T1 = Shapes(batch=1, prefill=1, decode=2, source=4, seed=0)
LONG = Shapes(batch=2, prefill=11, decode=2, source=9, seed=1)


# Variants the zoo does not hold but the spec language and `archc modernize` produce:
# QK-norm over RMSNorm (llama3), LayerNorm with biases (phi-2) and Gemma's 1 + w; and layer
# types differing in RoPE θ and scaling, NoPE, window and dense or MoE FFN (test_layer_types).
# The spec features of the 2025–26 model types, each on a tiny spec: Granite's multipliers
# (embeddings, scores, each sublayer's output, logits); OLMo 2's norms on the sublayer outputs
# with QK-norm over the whole projections; Phi-3's LongRoPE, trained on 8 positions so that
# prefills and decode steps cross to the long factors; Cohere 2's logit scale on a parallel
# block with one bias-free LayerNorm.
FEATURES: dict[str, dict] = {
    "tiny-llama3+multipliers": {"embedding": {"scale": 3.0}, "attention": {"scale": 0.09},
                                "block": {"residual_scale": 0.4},
                                "output": {"logit_scale": 0.3}},
    "tiny-qwen3+output-norms": {"attention": {"qk_norm_over": "projection"},
                                "norm": {"placement": "output"}},
    "tiny-phi3+longrope": {"position": {"scaling": {
        "kind": "longrope", "factor": 8.0, "original_max_seq_len": 8,
        "short_factor": [1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.7, 2.0],
        "long_factor": [1.0, 1.5, 2.2, 3.0, 4.5, 6.0, 9.0, 12.0]}}},
    "tiny-phi2+logit-scale": {"norm": {"bias": False}, "output": {"logit_scale": 0.3}},
}
VARIANTS = ["tiny-llama3+qk_norm", "tiny-phi2+qk_norm", "tiny-gemma2+qk_norm", "layer-types",
            *FEATURES]


def _merge(base: dict, over: dict) -> dict:
    return {**base, **{k: _merge(base[k], v) if isinstance(v, dict) and isinstance(
        base.get(k), dict) else v for k, v in over.items()}}


@functools.cache
def model(name: str) -> tuple[Spec, Program, dict[str, torch.Tensor], PipelineRun]:
    base, _, variant = name.partition("+")
    spec = from_dict(LAYER_TYPES) if name == "layer-types" else load_spec(base)
    if name in FEATURES:
        spec = from_dict(_merge(to_dict(spec), FEATURES[name]))
    if variant == "qk_norm":
        spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention,
                                                                       qk_norm=True))
    program = lower(spec)
    return spec, program, random_weights(program, seed=7), run_pipeline(program)


def padding(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """1 = a real token; the second row is padded at the end, never entirely."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1 and length > 1:
        mask[1, int(torch.randint(1, length, (1,), generator=gen)):] = 0
    return mask


def outputs(spec: Spec, program: Program, checkpoint: dict[str, torch.Tensor],
            s: Shapes) -> list[torch.Tensor]:
    """Every output the program gives for the drawn shapes: prefill, then each decode step."""
    gen = torch.Generator().manual_seed(s.seed)
    session = EagerSession(program, checkpoint, max_seq_len=spec.max_seq_len)
    vocab = spec.vocab_size
    if spec.family == "encoder":
        ids = torch.randint(0, vocab, (s.batch, s.prefill), generator=gen)
        types = torch.randint(0, 2, (s.batch, s.prefill), generator=gen)
        return [session.encode(ids, padding(s.batch, s.prefill, gen), types)]
    extra = {}
    if spec.family == "encoder-decoder":
        src = torch.randint(0, vocab, (s.batch, s.source), generator=gen)
        mask = padding(s.batch, s.source, gen)
        extra = {"encoder_hidden": session.encode(src, mask), "encoder_mask": mask}
    ids = torch.randint(0, vocab, (s.batch, s.prefill + s.decode), generator=gen)
    out = [session.step(ids[:, :s.prefill], **extra)]
    for t in range(s.prefill, s.prefill + s.decode):
        out.append(session.step(ids[:, t:t + 1], **extra))
    return out


def assert_same_function(name: str, before: Program, after: Program, s: Shapes) -> None:
    spec, _, checkpoint, _ = model(name)
    want = outputs(spec, before, checkpoint, s)
    got = outputs(spec, after, checkpoint, s)
    for k, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape
        err = float((a - b).abs().max())
        scale = float(a.abs().max())
        assert err <= TOL * scale, f"call {k} of {s}: max error {err:.3g} at output scale " \
                                   f"{scale:.3g}"


def _steps() -> list[tuple[str, str]]:
    return [(name, step.name) for name in TINY_SPECS + VARIANTS
            for step in model(name)[3].steps if step.changed]


def _alone() -> list[tuple[str, str]]:
    out = []
    for name in TINY_SPECS:
        program = model(name)[1]
        out += [(name, p) for p in EXACT if run_pass(program, p).changed]
    return out


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", TINY_SPECS + VARIANTS)
@settings(max_examples=4, **SETTINGS)
@given(s=SHAPES)
@example(s=T1)
@example(s=LONG)
def test_default_pipeline_keeps_the_function(name: str, s: Shapes) -> None:
    _, program, _, run = model(name)
    assert_same_function(name, program, run.program, s)


@pytest.mark.parametrize(("name", "pass_name"), _steps())
@settings(max_examples=1, **SETTINGS)
@given(s=SHAPES)
@example(s=T1)
@example(s=LONG)
def test_each_step_of_the_pipeline_keeps_the_function(name: str, pass_name: str,
                                                      s: Shapes) -> None:
    step = model(name)[3].step(pass_name)
    assert_same_function(name, step.before, step.after, s)


@pytest.mark.parametrize(("name", "pass_name"), _alone())
@settings(max_examples=1, **SETTINGS)
@given(s=SHAPES)
@example(s=LONG)
def test_each_pass_alone_keeps_the_function(name: str, pass_name: str, s: Shapes) -> None:
    program = model(name)[1]
    assert_same_function(name, program, run_pass(program, pass_name).after, s)
