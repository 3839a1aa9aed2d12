"""Linear attention on the eager interpreter against a plainly written PyTorch model.

The reference (``reference_linear_attention``) sums φ(q_i)·φ(k_j) over every pair j ≤ i and keeps
past φ(k), v to decode; archc carries the running sums S and z instead. Both run the same random
checkpoint of tiny-linear-attention (GQA 4/2, head_dim 12): the full forward, prefill then
token-by-token decode, and greedy generation token for token. The last tests break the reference
on purpose and check that the comparison then fails.

fp32. The two orders of summation (pairwise products against running sums, chunked) differ by
rounding only — measured at ~1e-7 of the largest logit; 1e-5 leaves a wide margin while a wrong
feature map, mask or head grouping moves the output by 1e-3 and more.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import archc
from tests import reference_linear_attention as ref
from tests.reference_linear_attention import Config, FeatureCache, LinearTransformer
from tests.reference_models import prefill_then_decode

RTOL = 1e-5
NAME = "tiny-linear-attention"
CONFIG = Config(heads=4, kv_heads=2, eps=1e-5)   # from the spec's YAML, not archc's Spec


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    return float((got - want).abs().max() / want.abs().max())


def _tokens(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


def _pair(seed: int = 1) -> tuple[archc.CompiledModel, LinearTransformer]:
    model = archc.load(NAME, seed=seed)
    assert model.weights is not None
    return model.compile("eager"), LinearTransformer(CONFIG, dict(model.weights))


@torch.no_grad()
def test_full_forward_matches_reference() -> None:
    compiled, reference = _pair()
    ids = _tokens((2, 70), seed=0)           # past one eager chunk of 64 tokens
    assert relative_error(compiled(ids), reference(ids)) <= RTOL


@pytest.mark.parametrize("split", [1, 6])
@torch.no_grad()
def test_prefill_then_decode_matches_reference(split: int) -> None:
    compiled, reference = _pair()
    ids = _tokens((2, 12), seed=split)
    got, incremental = prefill_then_decode(compiled.session, reference, ids, split,
                                           FeatureCache())
    assert relative_error(incremental, reference(ids)) <= RTOL   # the reference's own decode
    assert relative_error(got, incremental) <= RTOL


@torch.no_grad()
def test_greedy_generation_matches_reference() -> None:
    compiled, reference = _pair()
    prompt = _tokens((2, 5), seed=9)
    got = compiled.generate(prompt, max_new_tokens=12)
    cache = FeatureCache()
    logits = reference(prompt, cache)
    want = [prompt]
    for _ in range(12):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        want.append(nxt)
        logits = reference(nxt, cache)
    assert got.tolist() == torch.cat(want, dim=1).tolist()


def _elu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.elu(x)


def _wide_mask(t: int, past: int) -> torch.Tensor:
    return torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past + 1)


def _tiled(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat(1, groups, 1, 1)   # query head h reads KV head h % H_kv: the wrong grouping


PERTURBATIONS: list[tuple[str, Callable[[pytest.MonkeyPatch], None]]] = [
    ("elu without the + 1", lambda mp: mp.setattr(ref, "phi", _elu)),
    ("a query sees the next token", lambda mp: mp.setattr(ref, "causal_mask", _wide_mask)),
    ("KV heads tiled instead of repeated", lambda mp: mp.setattr(ref, "repeat_kv", _tiled)),
]


@pytest.mark.parametrize("what,patch", PERTURBATIONS, ids=[p[0] for p in PERTURBATIONS])
@torch.no_grad()
def test_perturbed_reference_fails_the_comparison(
        what: str, patch: Callable[[pytest.MonkeyPatch], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    compiled, reference = _pair()
    patch(monkeypatch)
    ids = _tokens((2, 11), seed=0)
    err = relative_error(compiled(ids), reference(ids))
    assert err > RTOL, f"{what}: went unnoticed (error {err:.2e})"
