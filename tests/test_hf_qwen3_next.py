"""archc against transformers on Qwen3-Next: Gated DeltaNet layers (fused q/k/v/z and b/a
projections, a SiLU conv over q, k and v, L2-normalized q and k, the gated delta rule, a gated
RMSNorm per value head) between gated softmax attention layers (a σ gate from the query
projection, per-head QK-norm, partial rotary), (1 + w) RMSNorms, and routed experts with a
σ-gated shared expert beside a dense layer (`mlp_only_layers`).

One tiny random model, saved with `save_pretrained`, read with `archc.load`, held to
transformers' logits and greedy tokens on the eager backend. Awkward on purpose: key heads 2 of
dims 8, value heads 4 of dims 6, a conv of 3, and a chunk of 8 so a 19-token prompt spans three
chunks, the last short. A_log, dt_bias, the norm gains and the gates are random. Tolerance,
fp32: 1e-4 of the largest logit, as test_hf_crosscheck.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.cli import main
from archc.errors import SpecError
from archc.ir.ops import Op
from archc.sources.hf import hf_spec
from archc.spec.load import layer_spec
from tests.test_hf_crosscheck import randomize, rel_error

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install "
                                   "'archc[hf]')")
pytest.importorskip("safetensors", reason="needs safetensors (pip install 'archc[hf]')")

RTOL = 1e-4
VOCAB = 97


def config() -> Any:
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=20, mlp_only_layers=[2],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build(directory: Path, seed: int = 0, **changes: Any) -> torch.nn.Module:
    """A random transformers model of the test config with `changes`, saved to `directory`."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3NextConfig(**{**config().to_dict(), **changes}) if changes else \
        config()
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):          # decays exp(−A·softplus(·)) well inside (0, 1)
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):   # a decisive router
                p.mul_(3.0)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, archc.Model]:
    directory = tmp_path_factory.mktemp("qwen3_next")
    hf = build(directory)
    # a chunk of 8, so that prompts span several chunks
    return hf, with_deltanet(archc.load(directory), chunk=8)


def prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_spec_reads_the_config(pair: tuple[Any, archc.Model]) -> None:
    _, model = pair
    s = model.spec
    assert s.layer_mixers() == ("gated_deltanet", "attention") * 2
    assert s.attention.output_gate and s.norm.unit_offset and s.rotary_dim == 6
    assert s.ffn.moe.shared_expert_gate and s.ffn.moe.shared_expert_d_ff == 20
    assert s.mixer.deltanet.chunk == 8
    ops = [n.op for g in model.compile("eager").session.program for n in g]
    assert ops.count(Op.DELTA_RULE) == 2 and ops.count(Op.CAUSAL_CONV) == 2


def with_deltanet(model: archc.Model, **changes: Any) -> archc.Model:
    """`model` with its mixer.deltanet fields changed."""
    mixer = model.spec.mixer
    dn = dataclasses.replace(mixer.deltanet, **changes)
    return archc.Model(dataclasses.replace(model.spec, mixer=dataclasses.replace(
        mixer, deltanet=dn)), model.weights)


def test_logits_match_transformers(pair: tuple[Any, archc.Model]) -> None:
    """19 tokens in chunks of 8 (the last of 3), and token by token (the recurrent form)."""
    hf, model = pair
    ids = prompt(2, 19, seed=1)
    with torch.no_grad():
        want = hf(ids).logits
    for form in (model, with_deltanet(model, algorithm="recurrent")):
        got = form.compile("eager")(ids)
        err = rel_error(got, want)
        assert err <= RTOL, f"{form.spec.mixer.deltanet.algorithm}: max error {err:.2e}"


def test_greedy_tokens_match_transformers(pair: tuple[Any, archc.Model]) -> None:
    """A 19-token prefill, then decode steps that read the conv and delta-rule states and the
    KV cache."""
    hf, model = pair
    ids = prompt(1, 19, seed=2)
    settings = transformers.GenerationConfig(max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                             eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(ids, generation_config=settings)
    got = model.compile("eager").generate(ids, max_new_tokens=6, eos_token_id=())
    assert got.tolist() == want.tolist()


def test_decode_logits_match_a_full_pass(pair: tuple[Any, archc.Model]) -> None:
    """Prefill 11 tokens, then one at a time: each step's logits equal transformers' over the
    whole sequence so far."""
    hf, model = pair
    ids = prompt(2, 15, seed=3)
    session = model.compile("eager").session
    session.reset()
    session.step(ids[:, :11])
    with torch.no_grad():
        want = hf(ids).logits
    for i in range(11, 15):
        got = session.step(ids[:, i:i + 1])
        err = rel_error(got[:, -1], want[:, i])
        assert err <= RTOL, f"token {i}: max error {err:.2e}"


def test_kernels_refuse_gated_deltanet_in_one_line(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    """No Triton kernels run the delta rule yet: compiling or running on them says so, by the
    spec field, before any pass runs."""
    build(tmp_path)
    capsys.readouterr()   # save_pretrained's progress
    for argv in (["compile", str(tmp_path), "-o", str(tmp_path / "kernels")],
                 ["run", str(tmp_path), "--backend", "triton", "--new-tokens", "1"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Gated DeltaNet mixer (mixer.kind gated_deltanet) has no " \
            "Triton kernels" in err[0], err


def spec_of(tmp_path: Path, **changes: Any) -> Any:
    """The spec of the test config with `changes`, from its config.json alone."""
    data = {**config().to_dict(), **changes}
    (tmp_path / "config.json").write_text(json.dumps(data))
    return hf_spec(tmp_path)


def test_layer_types_default_to_every_fourth_full(tmp_path: Path) -> None:
    """Without layer_types, transformers makes every full_attention_interval-th layer full;
    with no experts every layer is the dense FFN."""
    data = {k: v for k, v in config().to_dict().items() if k != "layer_types"}
    (tmp_path / "config.json").write_text(json.dumps(
        {**data, "num_hidden_layers": 6, "full_attention_interval": 3, "num_experts": 0}))
    s = hf_spec(tmp_path)
    assert s.layer_mixers() == ("gated_deltanet", "gated_deltanet", "attention") * 2
    assert s.ffn.kind == "swiglu" and s.ffn.d_ff == 40


def test_decoder_sparse_step_and_mlp_only_layers(tmp_path: Path) -> None:
    s = spec_of(tmp_path, decoder_sparse_step=2, mlp_only_layers=[3])
    ffns = [layer_spec(s, i).ffn.kind for i in range(4)]
    assert ffns == ["swiglu", "moe", "swiglu", "swiglu"]


def test_bad_layer_types_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"layer_types.*linear_attention or full_attention per "
                       r"layer \(4\)"):
        spec_of(tmp_path, layer_types=["linear_attention", "sliding_attention"] * 2)


@pytest.mark.parametrize("changes", [
    {"attention_bias": True, "norm_topk_prob": False},     # q/gate biases split per head too
    {"layer_types": ["linear_attention"] * 4, "num_experts": 0},   # no attention, no experts
], ids=["biases", "deltanet-only"])
def test_variants_match_transformers(changes: dict[str, Any], tmp_path: Path) -> None:
    hf = build(tmp_path, **changes)
    ids = prompt(2, 13, seed=5)
    with torch.no_grad():   # transformers' cache needs an attention layer
        want = hf(ids, use_cache=False).logits
    err = rel_error(archc.load(tmp_path).compile("eager")(ids), want)
    assert err <= RTOL, f"{changes}: max error {err:.2e}"
