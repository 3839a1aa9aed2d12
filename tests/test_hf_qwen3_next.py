"""archc against transformers on Qwen3-Next: Gated DeltaNet layers (fused q/k/v/z and b/a
projections, a SiLU conv over q, k and v, L2-normalized q and k, the gated delta rule, a gated
RMSNorm per value head) between gated softmax attention layers (a σ gate from the query
projection, per-head QK-norm, partial rotary), (1 + w) RMSNorms, and routed experts with a
σ-gated shared expert beside a dense layer (`mlp_only_layers`).

One tiny random model, saved with `save_pretrained`, read with `archc.load`, held to
transformers' logits and greedy tokens on the eager backend and on the generated Triton kernels
(the chunked delta-rule kernel for a prefill of a chunk or more, the recurrent one for fewer
tokens). Awkward on purpose: key heads 2 of
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
from archc.codegen.build import CodegenOptions
from archc.codegen.layout import CodegenError
from archc.codegen.render import generate
from archc.errors import SpecError
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.passes import optimize
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


@pytest.fixture(scope="module")
def reference(pair: tuple[Any, archc.Model]) -> tuple[torch.Tensor, torch.Tensor]:
    """19 tokens (in chunks of 8: the last of 3 short) and transformers' logits over them."""
    hf, _ = pair
    ids = prompt(2, 19, seed=1)
    with torch.no_grad():
        return ids, hf(ids).logits


@pytest.fixture(scope="module")
def greedy_reference(pair: tuple[Any, archc.Model]) -> tuple[torch.Tensor, list[list[int]]]:
    """A 19-token prompt and transformers' greedy continuation of 6 tokens."""
    hf, _ = pair
    ids = prompt(1, 19, seed=2)
    settings = transformers.GenerationConfig(max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                             eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return ids, hf.generate(ids, generation_config=settings).tolist()


@pytest.fixture(scope="module")
def kernels(pair: tuple[Any, archc.Model],
            tmp_path_factory: pytest.TempPathFactory) -> archc.CompiledModel:
    """The tiny model on the generated Triton kernels (fp32)."""
    return pair[1].compile("triton", cache_dir=tmp_path_factory.mktemp("kernels"))


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


def test_logits_match_transformers(pair: tuple[Any, archc.Model],
                                   reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    """19 tokens in chunks of 8 (the last of 3), and token by token (the recurrent form)."""
    _, model = pair
    ids, want = reference
    for form in (model, with_deltanet(model, algorithm="recurrent")):
        got = form.compile("eager")(ids)
        err = rel_error(got, want)
        assert err <= RTOL, f"{form.spec.mixer.deltanet.algorithm}: max error {err:.2e}"


def test_greedy_tokens_match_transformers(
        pair: tuple[Any, archc.Model], greedy_reference: tuple[torch.Tensor, list[list[int]]],
        kernels: archc.CompiledModel) -> None:
    """A 19-token prefill, then decode steps that read the conv and delta-rule states and the
    KV cache: on eager, and on the kernels (a chunked prefill, recurrent decode steps)."""
    _, model = pair
    ids, want = greedy_reference
    for backend, compiled in (("eager", model.compile("eager")), ("triton", kernels)):
        got = compiled.generate(ids, max_new_tokens=6, eos_token_id=())
        assert got.tolist() == want, backend


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_decode_logits_match_a_full_pass(pair: tuple[Any, archc.Model],
                                         reference: tuple[torch.Tensor, torch.Tensor],
                                         kernels: archc.CompiledModel, backend: str) -> None:
    """Prefill 11 tokens (a chunk and 3), then 3 tokens in one step (fewer than a chunk: the
    recurrent kernel), then one at a time: each step's logits equal transformers' over the
    whole sequence so far."""
    _, model = pair
    ids, want = reference
    session = (model.compile("eager") if backend == "eager" else kernels).session
    session.reset()
    session.step(ids[:, :11])
    for start, stop in ((11, 14), (14, 15), (15, 16)):
        got = session.step(ids[:, start:stop])
        err = rel_error(got, want[:, start:stop])
        assert err <= RTOL, f"tokens [{start}, {stop}): max error {err:.2e}"


def test_logits_on_the_kernels_match_transformers(
        reference: tuple[torch.Tensor, torch.Tensor], kernels: archc.CompiledModel) -> None:
    """The 19-token prompt on the generated kernels: three chunks of the chunked delta-rule
    kernel (the last short), the conv and recurrent states read from the cache at zero."""
    ids, want = reference
    err = rel_error(kernels(ids), want)
    assert err <= RTOL, f"max error {err:.2e}"


def test_the_recurrent_algorithm_on_the_kernels_matches_transformers(
        pair: tuple[Any, archc.Model], reference: tuple[torch.Tensor, torch.Tensor],
        tmp_path: Path) -> None:
    """algorithm: recurrent binds the recurrent kernel alone, for the prefill too."""
    _, model = pair
    ids, want = reference
    compiled = with_deltanet(model, algorithm="recurrent").compile("triton", cache_dir=tmp_path)
    units = [u for u in compiled.session.generated.units if u.family == "delta_rule"]
    assert [k.family for u in units for k in u.kernels] == ["delta_rule_recurrent"]
    err = rel_error(compiled(ids), want)
    assert err <= RTOL, f"max error {err:.2e}"


def test_a_gpu_module_refuses_a_chunk_below_a_tensor_core_tile(
        pair: tuple[Any, archc.Model]) -> None:
    """The chunked kernel's products are tl.dot tiles, at least 16 a side on a GPU: a chunk of 8
    is refused by the node, in one line; 16 renders."""
    _, model = pair
    for chunk, refused in ((8, True), (16, False)):
        program = optimize(lower(with_deltanet(model, chunk=chunk).spec))
        if refused:
            with pytest.raises(CodegenError, match=r"delta_rule\(.*power-of-two chunk \(at "
                               r"least 16 on a GPU.*not 8$"):
                generate(program, CodegenOptions(target="gpu"))
        else:
            generate(program, CodegenOptions(target="gpu"))


def test_the_module_binds_both_delta_rule_kernels(kernels: archc.CompiledModel) -> None:
    """One delta-rule unit for both layers, with its chunked and recurrent kernels, and the
    recurrent state S [B, H, Dk, Dv] f32 of each DeltaNet layer stored beside the conv state."""
    generated = kernels.session.generated
    units = [u for u in generated.units if u.family == "delta_rule"]
    assert len(units) == 1
    texts = [text for _, _, text in units[0].uses]
    assert all(any(f"layer={layer}" in t for t in texts) for layer in (0, 2))
    assert {k.family for k in units[0].kernels} == {"delta_rule_chunked", "delta_rule_recurrent"}
    states = generated.stores["state"]
    for layer in (0, 2):
        assert states[(layer, "S")] == ((4, 8, 6), "f32") and (layer, "conv") in states


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
