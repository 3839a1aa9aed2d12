"""The eager interpreter against independent, plainly written PyTorch models (reference_models).

Both run the same random checkpoint (``archc.load(name, seed=...).weights``): the full forward,
prefill then token-by-token decode through each side's own KV cache, and greedy generation token
for token. A last table perturbs the reference on purpose and checks that the comparison then
fails, so a pass here means something.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import archc
from tests import reference_models as ref
from tests.reference_models import (
    GPT,
    Bert,
    BertConfig,
    GPTConfig,
    KVCache,
    Llama,
    LlamaConfig,
)

# fp32 on both sides. The two compute the same function with differently ordered sums (F.linear
# against nn.Linear, fused against written-out GELU and norms, −inf against finfo.min masking),
# so they differ by rounding: a few ulps (2⁻²³ ≈ 1.2e-7) of the activations, grown a little by
# two layers — measured at 3e-7 to 5e-7 of the largest output here. 1e-5 of the largest |output|
# leaves 20× room for that, and a real semantic slip moves the output far more (a dropped 0.1
# bias or a swapped rotary pair by 1e-2 or more, even erf GELU for tanh GELU by 7e-5: see the
# perturbation tests at the end).
RTOL = {"f32": 1e-5}

# What each reference needs beyond the checkpoint's shapes, written from the tiny specs' YAML
# rather than from archc's resolved Spec, so a loader slip cannot hide on both sides.
DECODERS: dict[str, Callable[[dict[str, torch.Tensor]], nn.Module]] = {
    "tiny-gpt1": lambda w: GPT(GPTConfig(heads=4, eps=1e-5, activation="gelu", post_norm=True,
                                         final_norm=False), w),
    "tiny-gpt2": lambda w: GPT(GPTConfig(heads=4, eps=1e-5, activation="gelu_tanh",
                                         post_norm=False, final_norm=True), w),
    "tiny-llama2": lambda w: Llama(LlamaConfig(heads=4, kv_heads=4, eps=1e-5, theta=10000.0), w),
    "tiny-llama3": lambda w: Llama(LlamaConfig(heads=4, kv_heads=2, eps=1e-5, theta=500000.0),
                                   w),
}
BERT = BertConfig(heads=4, eps=1e-12)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want|."""
    assert got.shape == want.shape, f"shapes differ: {list(got.shape)} vs {list(want.shape)}"
    return float((got - want).abs().max() / want.abs().max())


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = relative_error(got, want)
    assert err <= RTOL["f32"], f"{what}: max abs error is {err:.2e} of max |output|"


def _tokens(vocab: int, shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _decoder(name: str, seed: int = 1) -> tuple[archc.CompiledModel, nn.Module]:
    model = archc.load(name, seed=seed)
    assert model.weights is not None
    reference = DECODERS[name]({k: v.clone() for k, v in model.weights.items()})
    return model.compile("eager"), reference


@torch.no_grad()
def _bert(attention_mask: torch.Tensor,
          weights_edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
          reference_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of archc and of the reference for one padded batch of tiny-bert."""
    model = archc.load("tiny-bert", seed=2)
    assert model.weights is not None
    weights = {k: v.clone() for k, v in model.weights.items()}
    if weights_edit is not None:
        weights_edit(weights)
    b, t = attention_mask.shape
    ids = _tokens(model.spec.vocab_size, (b, t), seed=5)
    types = _tokens(2, (b, t), seed=6)
    got = model.compile("eager")(ids, attention_mask=attention_mask, token_type_ids=types)
    mask = attention_mask if reference_mask is None else reference_mask
    want = Bert(BERT, weights)(ids, types, mask)
    return got, want


# Batch of 2, the second row padded after 5 of its 9 tokens.
PADDED = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])


@pytest.mark.parametrize("name", list(DECODERS))
@torch.no_grad()
def test_full_forward_matches_reference(name: str) -> None:
    compiled, reference = _decoder(name)
    ids = _tokens(compiled.spec.vocab_size, (2, 11), seed=0)
    assert_close(compiled(ids), reference(ids), f"{name} full forward")


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("split", [1, 6])
@torch.no_grad()
def test_prefill_then_decode_matches_reference(name: str, split: int) -> None:
    compiled, reference = _decoder(name)
    ids = _tokens(compiled.spec.vocab_size, (2, 10), seed=split)
    session, cache = compiled.session, KVCache()
    got, incremental = ref.prefill_then_decode(session, reference, ids, split, cache)
    assert cache.length == session.past == ids.shape[1]
    # the reference's own cache first: its decode must equal its full forward
    assert_close(incremental, reference(ids), f"{name} reference decode vs its full forward")
    assert_close(got, incremental, f"{name} prefill {split} then decode")


@pytest.mark.parametrize("name", list(DECODERS))
@torch.no_grad()
def test_greedy_generation_matches_reference(name: str) -> None:
    compiled, reference = _decoder(name)
    prompt = _tokens(compiled.spec.vocab_size, (2, 5), seed=9)
    got = compiled.generate(prompt, max_new_tokens=12)
    want = ref.greedy_generate(reference, prompt, max_new_tokens=12)
    assert got.tolist() == want.tolist()


def test_bert_with_padding_matches_reference() -> None:
    got, want = _bert(PADDED)
    # every position, padded ones included: both let a padded query attend to the real keys
    assert_close(got, want, "tiny-bert with a padded row")


def test_bert_padding_changes_the_padded_row_only() -> None:
    padded, _ = _bert(PADDED)
    full, _ = _bert(torch.ones_like(PADDED))
    assert_close(padded[0], full[0], "unpadded row")
    assert relative_error(padded[1, :5], full[1, :5]) > 100 * RTOL["f32"]


# ---- the comparison has teeth ------------------------------------------------------------------

def _tile_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat(1, groups, 1, 1)  # query head h reads KV head h % H_kv: the wrong grouping


def _sees_next_token(t: int, past: int) -> torch.Tensor:
    return torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past + 1)


def _zero(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(weights: dict[str, torch.Tensor]) -> None:
        weights[name] = torch.zeros_like(weights[name])
    return edit


# (spec, what is wrong, patch of the reference module, edit of the reference's weights)
Perturbation = tuple[str, str, Callable[[pytest.MonkeyPatch], None] | None,
                     Callable[[dict[str, torch.Tensor]], None] | None]
PERTURBATIONS: list[Perturbation] = [
    ("tiny-llama3", "interleaved RoPE pairs instead of half-split",
     lambda mp: mp.setattr(ref, "rope_half_split", ref.rope_interleaved), None),
    ("tiny-llama3", "KV heads tiled instead of repeated per group",
     lambda mp: mp.setattr(ref, "repeat_kv", _tile_kv), None),
    ("tiny-llama2", "causal mask one token too wide",
     lambda mp: mp.setattr(ref, "causal_mask", _sees_next_token), None),
    ("tiny-gpt2", "erf GELU instead of tanh GELU",
     lambda mp: mp.setitem(ref.GELU, "gelu_tanh", ref.gelu_erf), None),
    ("tiny-gpt2", "value bias of layer 1 dropped", None, _zero("layers.1.attn.v.bias")),
    ("tiny-gpt1", "final LayerNorm shift dropped", None, _zero("layers.1.ffn_norm.bias")),
]


@pytest.mark.parametrize("name,what,patch,edit", PERTURBATIONS,
                         ids=[p[1] for p in PERTURBATIONS])
@torch.no_grad()
def test_perturbed_reference_fails_the_comparison(
        name: str, what: str, patch: Callable[[pytest.MonkeyPatch], None] | None,
        edit: Callable[[dict[str, torch.Tensor]], None] | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = archc.load(name, seed=1)
    assert model.weights is not None
    weights = {k: v.clone() for k, v in model.weights.items()}
    if patch is not None:
        patch(monkeypatch)
    if edit is not None:
        edit(weights)
    ids = _tokens(model.spec.vocab_size, (2, 11), seed=0)
    err = relative_error(model.compile("eager")(ids), DECODERS[name](weights)(ids))
    assert err > RTOL["f32"], f"{what}: went unnoticed (error {err:.2e})"


def test_bert_reference_without_padding_mask_fails_the_comparison() -> None:
    got, want = _bert(PADDED, reference_mask=torch.ones_like(PADDED))
    assert relative_error(got, want) > RTOL["f32"]


def test_bert_reference_without_token_type_embedding_fails_the_comparison() -> None:
    got, want = _bert(PADDED, weights_edit=_zero("type_embed.weight"))
    assert relative_error(got, want) > RTOL["f32"]
