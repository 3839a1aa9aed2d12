"""archc against transformers on DeepSeek-V2 and V3: multi-head latent attention (a low-rank query
path or one projection, keys and values projected up per head from a normalized latent, a RoPE
key shared by the heads, a value dim of its own), YaRN with DeepSeek's score correction, routed
and shared experts after dense layers. One tiny random model of each case, saved with
`save_pretrained`, read with `archc.load`, and held to transformers' logits and greedy tokens on
the eager backend and on the Triton kernels; the absorbed form (`absorb-mla`) to the expanded one
at every decode step; the KV cache to the latent's size.

Shapes are awkward on purpose: 3 heads, no-RoPE dims 16 ≠ RoPE dims 8 ≠ value dims 10, a latent
of 20, a query rank of 12. Biases and norm gains are random (``randomize``). Tolerance, fp32:
1e-4 of the largest logit, as test_hf_crosscheck.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.cli import main
from archc.errors import SpecError
from archc.ir import cost
from archc.report.facts import expanded_kv_bytes_per_token
from archc.spec import from_dict
from tests.test_hf_crosscheck import randomize, rel_error

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install "
                                   "'archc[hf]')")
pytest.importorskip("safetensors", reason="needs safetensors (pip install 'archc[hf]')")

RTOL = 1e-4
VOCAB = 97
LATENT = dict(hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
              num_key_value_heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=10, attention_bias=True, max_position_embeddings=64,
              vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DENSE = dict(first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16)

# name → (config factory, model class name)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    # queries through a rank-12 latent; RoPE on interleaved pairs (rope_interleave); biases on
    # q_a, kv_a and o
    "v3": (lambda: transformers.DeepseekV3Config(q_lora_rank=12, n_group=1, topk_group=1,
                                                 **DENSE, **LATENT), "DeepseekV3ForCausalLM"),
    # YaRN over 16 trained positions, factor 4, with mscale ≠ mscale_all_dim: the cos/sin scale
    # m(0.7)/m(1.0) and the scores' m(1.0)²
    "v3-yarn": (lambda: transformers.DeepseekV3Config(
        q_lora_rank=12, n_group=1, topk_group=1, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
            "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16}, **DENSE, **LATENT),
        "DeepseekV3ForCausalLM"),
    # one query projection (q_lora_rank none, so no query bias); RoPE on complex pairs
    "v2": (lambda: transformers.DeepseekV2Config(q_lora_rank=None, **DENSE, **LATENT),
           "DeepseekV2ForCausalLM"),
    # layer 0 dense, layers 1-2 routed: σ router, a random correction bias choosing, 8 experts
    # in 4 groups (scored by their two best), 2 groups kept, top 3, renormalized, ×2.5; a
    # shared expert of 2 × 16
    "v3-moe": (lambda: transformers.DeepseekV3Config(
        q_lora_rank=12, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=2,
        first_k_dense_replace=1, moe_intermediate_size=16,
        **{**LATENT, "num_hidden_layers": 3}), "DeepseekV3ForCausalLM"),
    # softmax router, top 3 within the 2 best of 4 groups by their best expert, not
    # renormalized, ×1.5; one shared expert
    "v2-moe": (lambda: transformers.DeepseekV2Config(
        q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, n_shared_experts=1,
        first_k_dense_replace=1, moe_intermediate_size=16,
        **{**LATENT, "num_hidden_layers": 2}), "DeepseekV2ForCausalLM"),
}
ABSORBED = ("absorb-mla", "share-kv-heads", "flash-attention")


def build(case: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    make_config, cls = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(make_config()).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # routers decisive (logits of spread ~3), correction biases that
        for name, p in model.named_parameters():     # change choices
            if name.endswith("mlp.gate.weight"):
                p.mul_(3.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Any, archc.Model]:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, directory), archc.load(directory)


def prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


LOGITS_IDS, GREEDY_IDS, NEW_TOKENS = prompt(2, 11, seed=1), prompt(1, 9, seed=2), 6
_REFERENCE: dict[str, tuple[torch.Tensor, list[list[int]]]] = {}


def reference(case: str, hf: Any) -> tuple[torch.Tensor, list[list[int]]]:
    """transformers' logits of LOGITS_IDS and greedy tokens after GREEDY_IDS, run once per case
    for the eager and the Triton tests."""
    if case not in _REFERENCE:
        settings = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS,
                                                 min_new_tokens=NEW_TOKENS, do_sample=False,
                                                 eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            _REFERENCE[case] = (hf(LOGITS_IDS).logits,
                                hf.generate(GREEDY_IDS, generation_config=settings).tolist())
    return _REFERENCE[case]


def test_logits_match_transformers(pair: tuple[str, Any, archc.Model]) -> None:
    case, hf, model = pair
    want, _ = reference(case, hf)
    for passes in (None, ABSORBED):
        got = model.compile("eager", **({"passes": passes} if passes else {}))(LOGITS_IDS)
        err = rel_error(got, want)
        assert err <= RTOL, f"{case} ({passes or 'expanded'}): max error {err:.2e}"


def test_greedy_tokens_match_transformers(pair: tuple[str, Any, archc.Model]) -> None:
    case, hf, model = pair
    _, want = reference(case, hf)
    got = model.compile("eager").generate(GREEDY_IDS, max_new_tokens=NEW_TOKENS, eos_token_id=())
    assert got.tolist() == want, case


def test_triton_logits_and_greedy_tokens_match_transformers(
        pair: tuple[str, Any, archc.Model], tmp_path_factory: pytest.TempPathFactory) -> None:
    """The Triton kernels (the interpreter on a CPU), fp32: the absorbed form — attention over
    the cached rows [latent ‖ RoPE key] with q·c + q_rope·k_rope as its score and the latent its
    values, the per-head up-projections as head_linear kernels — equals transformers' logits
    on a prefill and its greedy tokens through prefill and decode steps."""
    case, hf, model = pair
    want_logits, want_tokens = reference(case, hf)
    compiled = model.compile("triton", cache_dir=tmp_path_factory.mktemp("kernels"))
    program = compiled.session.program
    ops = [(n.op.value, n.attrs) for g in program for n in g]
    assert any(op == "head_linear" for op, _ in ops), case
    assert any(op == "attention" and a.get("second_score") and a.get("cache_layer") is not None
               for op, a in ops), case
    assert not any(op == "kv_cache" for op, _ in ops), case
    err = rel_error(compiled(LOGITS_IDS), want_logits)
    assert err <= RTOL, f"{case} on Triton: max error {err:.2e}"
    got = compiled.generate(GREEDY_IDS, max_new_tokens=NEW_TOKENS, eos_token_id=())
    assert got.tolist() == want_tokens, case


def test_absorbed_decode_equals_expanded_at_every_step(
        pair: tuple[str, Any, archc.Model]) -> None:
    """Prefill, then token by token: the absorbed program's logits (attention over the cached
    latent, the up-projections on the query and output sides) equal the expanded one's."""
    case, _, model = pair
    expanded = model.compile("eager").session
    absorbed = model.compile("eager", passes=ABSORBED)
    assert any(n.op.value == "head_linear" for g in absorbed.session.program for n in g)
    absorbed = absorbed.session
    ids = prompt(2, 7, seed=3)
    expect_same_steps(expanded, absorbed, ids, 5, case)


def expect_same_steps(want_session: Any, got_session: Any, ids: torch.Tensor, steps: int,
                      case: str) -> None:
    """Both sessions from empty caches: the prefill of `ids`, then `steps` greedy decode steps
    (chosen by `want_session`), equal to RTOL of the largest logit at each."""
    want_session.reset()
    got_session.reset()
    want, got = want_session.step(ids), got_session.step(ids)
    for step in range(steps):
        err = rel_error(got, want)
        assert err <= RTOL, f"{case} step {step}: max error {err:.2e}"
        nxt = want[:, -1].argmax(-1, keepdim=True)
        want, got = want_session.step(nxt), got_session.step(nxt)


def test_the_cache_holds_the_latent(pair: tuple[str, Any, archc.Model]) -> None:
    """Per layer, the cache holds [B, 1, max_len, kv_rank] normalized latents and
    [B, 1, max_len, rope_dims] RoPE keys, nothing per head; per token that is
    layers · (kv_rank + rope_dims) values, against layers · heads · (qk + v dims) for keys and
    values."""
    case, _, model = pair
    cfg = CASES[case][0]()
    layers, r, rope = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    session = model.compile("eager").session
    session.reset()
    session.step(prompt(2, 5, seed=4))
    store = session.cache.store
    assert sorted(store) == sorted((i, k) for i in range(layers) for k in ("latent", "k_rope"))
    for i in range(layers):
        assert tuple(store[i, "latent"].shape) == (2, 1, model.spec.max_seq_len, r)
        assert tuple(store[i, "k_rope"].shape) == (2, 1, model.spec.max_seq_len, rope)
    assert cost.kv_cache_bytes_per_token(model.graph) == layers * (r + rope) * 4
    heads, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + rope
    assert expanded_kv_bytes_per_token(model.spec, "f32") == \
        layers * heads * (qk + cfg.v_head_dim) * 4


def test_int8_latent_cache_stays_close() -> None:
    """The latent cache quantized to int8 rows (codes and a scale per token) on the absorbed
    and expanded forms: the two agree with each other exactly as far as float rounding, and
    with the float cache to the codes' resolution."""
    spec = from_dict({"name": "tiny-latent", "vocab_size": VOCAB, "d_model": 48, "layers": 2,
                      "max_seq_len": 32, "dtype": "f32", "norm": {"kind": "rmsnorm"},
                      "attention": {"heads": 3, "head_dim": 24, "latent": {
                          "kv_rank": 20, "rope_dims": 8, "q_rank": 12}},
                      "ffn": {"kind": "swiglu", "d_ff": 40}})
    model = archc.from_spec(spec)
    ids = prompt(1, 9, seed=5)
    floats = model.compile("eager")(ids)
    codes = model.compile("eager", kv_cache="int8")(ids)
    absorbed = model.compile("eager", kv_cache="int8", passes=ABSORBED)(ids)
    assert rel_error(absorbed, codes) <= RTOL
    assert 0 < rel_error(codes, floats) <= 2e-2


@pytest.mark.parametrize("latent, field", [
    ({"kv_rank": 20, "rope_dims": 7}, "attention.latent.rope_dims"),
    ({"kv_rank": 20, "rope_dims": 24}, "attention.latent.rope_dims"),
    ({"rope_dims": 8}, "attention.latent.kv_rank"),
])
def test_bad_latent_sections_are_refused(latent: dict[str, int], field: str) -> None:
    data = {"name": "bad", "vocab_size": 97, "d_model": 48, "layers": 1,
            "attention": {"heads": 3, "head_dim": 24, "latent": latent}}
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        from_dict(data)


def test_latent_attention_refuses_what_it_has_not() -> None:
    base = {"name": "bad", "vocab_size": 97, "d_model": 48, "layers": 1,
            "attention": {"heads": 3, "head_dim": 24,
                          "latent": {"kv_rank": 20, "rope_dims": 8}}}
    for change, field in (({"attention": {"kv_heads": 1}}, "attention.kv_heads"),
                          ({"attention": {"qk_norm": True}}, "attention.qk_norm"),
                          ({"position": {"kind": "alibi"}}, "attention.latent"),
                          ({"family": "encoder"}, "attention.latent")):
        data = {**base, **change}
        if "attention" in change:
            data["attention"] = {**base["attention"], **change["attention"]}
        with pytest.raises(SpecError, match=field.replace(".", r"\.")):
            from_dict(data)


def test_passes_show_absorb_mla_and_its_choice(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    build("v3", tmp_path)
    assert main(["explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "absorb-mla · absorb-mla ×2: a decode step at context 4096" in out
    assert "prefill" in out


@pytest.mark.parametrize(("fields", "refused"), [
    ({"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, None),
    ({"scoring_func": "softmax"}, r"scoring_func: 'softmax' cannot be honoured"),
    ({"topk_method": "greedy"}, r"topk_method: 'greedy' cannot be honoured")])
def test_v3_router_fields_of_the_published_config(fields: dict[str, str], refused: str | None,
                                                  tmp_path: Path) -> None:
    """DeepSeek-V3's published config.json names the router transformers runs; any other is
    refused by name rather than run as that one."""
    build("v3-moe", tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    if refused is None:
        assert archc.load(tmp_path).spec.ffn.moe.router == "sigmoid"
    else:
        with pytest.raises(SpecError, match=refused):
            archc.load(tmp_path)


def test_wide_latent_runs_in_row_and_value_tiles_on_triton() -> None:
    """A latent wider than 256 (264, as DeepSeek's 512 is): decode takes the 18 heads' rows in
    tiles of 16, prefill the value columns in tiles of 128, each a program of its own — on the
    Triton kernels equal to eager at the prefill and at each decode step (past 16 keys a step,
    so the splits merge). Eager is held to transformers above."""
    spec = from_dict({"name": "wide-latent", "vocab_size": VOCAB, "d_model": 32, "layers": 1,
                      "max_seq_len": 64, "dtype": "f32", "norm": {"kind": "rmsnorm"},
                      "attention": {"heads": 18, "head_dim": 24, "latent": {
                          "kv_rank": 264, "rope_dims": 8, "q_rank": 12, "v_dim": 6}},
                      "ffn": {"kind": "swiglu", "d_ff": 40}})
    model = archc.from_spec(spec)
    eager, kernels = model.compile("eager").session, model.compile("triton").session
    expect_same_steps(eager, kernels, prompt(1, 37, seed=6), 3, "wide-latent")
