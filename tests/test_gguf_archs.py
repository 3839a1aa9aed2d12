"""GGUF files of the architectures llama.cpp writes for the 2025–26 model types: a tiny random
transformers model written the way llama.cpp's converter writes it — its metadata keys, its
tensor names, Gemma's norm gains stored as 1 + w (the converter's `norm_shift`), 2-D weights in
the file's type — loaded with `archc.load` and held to transformers running what the file holds.

Table-driven, one row per (architecture, tensor type): awkward shapes as in test_hf_2025 (GQA 6/2
and 9/3, head_dim apart from d_model/heads, a window shorter than the prompt, RoPE with another θ
and a linear scaling on global layers), and Q8_0 rows (K a multiple of its 32-value blocks)
whose weights stay quantized. Gemma 3's layer types are given per layer where they are not
llama.cpp's default (one global layer in 6), and left to that default in the Q8_0 row.

Tolerance, fp32: 1e-4 of the largest logit, as test_hf_crosscheck: both sides compute with the
same stored values in different orders.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import archc
from archc.errors import SpecError
from archc.quant.tensor import QTensor
from archc.spec.load import layer_spec
from tests.test_hf_crosscheck import randomize, rel_error

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
transformers = pytest.importorskip("transformers", reason="needs transformers "
                                   "(pip install 'archc[hf]')")

RTOL = 1e-4
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
Q = gguf.GGMLQuantizationType


def qwen3(d: int, heads: int, kv: int, head_dim: int, ff: int, bias: bool) -> Any:
    return transformers.Qwen3Config(
        hidden_size=d, intermediate_size=ff, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=64,
        attention_bias=bias, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        **SMALL)


def gemma3(d: int, heads: int, kv: int, head_dim: int, ff: int, **kw: Any) -> Any:
    # the score scale 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), as llama.cpp takes it
    return transformers.Gemma3TextConfig(
        hidden_size=d, intermediate_size=ff, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, max_position_embeddings=64, sliding_window=4,
        query_pre_attn_scalar=head_dim, **kw, **SMALL)


def olmo2(d: int, heads: int, kv: int, ff: int) -> Any:
    return transformers.Olmo2Config(
        hidden_size=d, intermediate_size=ff, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=64, **SMALL)


# row → (architecture, config factory, model class, tensor type of the 2-D weights)
CASES: dict[str, tuple[str, Callable[[], Any], str, Any]] = {
    # head_dim 24 (not 60/6), GQA 6/2, q/k/v biases
    "qwen3": ("qwen3", lambda: qwen3(60, 6, 2, 24, 80, True), "Qwen3ForCausalLM", Q.F32),
    "qwen3-q8_0": ("qwen3", lambda: qwen3(64, 4, 2, 32, 96, False), "Qwen3ForCausalLM", Q.Q8_0),
    # 9/3 heads of 16 (≠ 54/9); a global layer between sliding ones: θ 10⁶ and linear ×4 there,
    # 10⁴ on the sliding layers (window 4)
    "gemma3": ("gemma3", lambda: gemma3(
        54, 9, 3, 16, 64, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}}),
        "Gemma3ForCausalLM", Q.F32),
    # six layers: llama.cpp's default pattern (the sixth global) — nothing in the file says it
    "gemma3-q8_0": ("gemma3", lambda: gemma3(64, 4, 2, 32, 96, num_hidden_layers=6),
                    "Gemma3ForCausalLM", Q.Q8_0),
    # q and k normalized over the whole projection; norms on the sublayer outputs
    "olmo2": ("olmo2", lambda: olmo2(60, 6, 2, 80), "Olmo2ForCausalLM", Q.F32),
}

# transformers' module → llama.cpp's tensor, per architecture (gguf's tensor names)
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
# a pre-norm model's post_attention_layernorm is its FFN's input norm; Gemma's and OLMo 2's is
# on the attention's output
POST_ATTENTION = {"qwen3": "ffn_norm", "gemma3": "post_attention_norm",
                  "olmo2": "post_attention_norm"}


def gguf_name(arch: str, hf: str) -> str:
    module, kind = hf.rsplit(".", 1)
    if module in TOP:
        return f"{TOP[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    table = {**LAYER, "post_attention_layernorm": POST_ATTENTION[arch]}
    return f"blk.{layer}.{table[rest]}.{kind}"


def layer_types(cfg: Any) -> list[str]:
    return list(getattr(cfg, "layer_types", None) or [])


def write_gguf(arch: str, model: Any, path: Path, qtype: Any,
               extra: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """`model` as llama.cpp's converter writes it for `arch`, 2-D weights in `qtype` (and the
    f32 metadata `extra`). Returns the weights as the file holds them, in transformers' names
    and conventions (Gemma's gains back to w), for transformers to run."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch == "gemma3":   # θ and scaling of the global layers; the window of the sliding ones
        rope = rope["full_attention"]
        w.add_sliding_window(cfg.sliding_window)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        kinds = [t == "sliding_attention" for t in layer_types(cfg)]
        default = [i % 6 < 5 for i in range(cfg.num_hidden_layers)]
        if kinds != default:   # not llama.cpp's rule: one flag per layer
            w.add_sliding_window_pattern(kinds)
    w.add_rope_freq_base(rope["rope_theta"])
    if getattr(cfg, "head_dim", None) is not None and arch != "olmo2":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    shift = 1.0 if arch == "gemma3" else 0.0   # Gemma3RMSNorm's 1 + w, stored as the gain
    stored: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue   # a tied head is not in the checkpoint
        x = p.numpy().astype(np.float32)
        norm = name.endswith("norm.weight")
        if norm:
            x = x + np.float32(shift)
        if x.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(arch, name), x)
            back = x
        else:
            raw = gguf.quants.quantize(x, qtype)
            w.add_tensor(gguf_name(arch, name), raw, raw_dtype=qtype)
            back = gguf.quants.dequantize(raw, qtype)
        back = torch.from_numpy(np.array(back, dtype=np.float32))
        stored[name] = back - shift if norm else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def build(case: str, path: Path) -> torch.nn.Module:
    arch, make_config, cls, qtype = CASES[case]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(make_config()).eval()
    randomize(hf, 0)
    stored = write_gguf(arch, hf, path, qtype)
    missing, unexpected = hf.load_state_dict(stored, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()   # transformers runs exactly what the file holds
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Any, archc.Model]:
    case = request.param
    path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
    hf = build(case, path)
    return case, hf, archc.load(path)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


# every row on eager; the quantized rows on the generated kernels too (their dequantizing
# matmuls over the weights as the file holds them; the float models' kernels are held to
# transformers in test_hf_2025)
BACKENDS = [(case, "eager") for case in CASES] + [
    (case, "triton") for case, (_, _, _, qtype) in CASES.items() if qtype != Q.F32]


@pytest.mark.parametrize(("pair", "backend"), BACKENDS, indirect=["pair"],
                         ids=[f"{c}-{b}" for c, b in BACKENDS])
def test_logits_match_transformers(pair: tuple[str, Any, archc.Model], backend: str,
                                   kernel_dir: Path) -> None:
    case, hf, model = pair
    ids = torch.randint(3, VOCAB, (2 if backend == "eager" else 1, 11),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    compiled = model.compile(backend, **({"cache_dir": kernel_dir} if backend == "triton" else {}))
    got = compiled(ids)
    assert got.shape == want.shape
    err = rel_error(got, want)
    assert err <= RTOL, f"{case}: max error {err:.2e} of the largest logit"


def test_the_spec_is_what_the_file_says(pair: tuple[str, Any, archc.Model]) -> None:
    """The structure the file's metadata and tensors give, and quantized weights kept so."""
    case, hf, model = pair
    arch, _, _, qtype = CASES[case]
    s, cfg = model.spec, hf.config
    att = s.attention
    assert (att.heads, att.kv_heads, att.qk_norm) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, True)
    assert att.qk_norm_over == ("projection" if arch == "olmo2" else "head")
    assert s.norm.placement == {"qwen3": "pre", "gemma3": "sandwich", "olmo2": "output"}[arch]
    assert not s.norm.unit_offset      # Gemma's gains are stored as 1 + w
    if arch == "gemma3":
        windows = [layer_spec(s, i).attention.window for i in range(s.layers)]
        assert windows == [4 if t == "sliding_attention" else None for t in layer_types(cfg)]
    quantized = isinstance(model.weights["layers.0.attn.q.weight"], QTensor)
    assert quantized == (qtype != Q.F32)


def gemma3_file(path: Path, extra: dict[str, float] | None = None) -> Path:
    hf = transformers.Gemma3ForCausalLM(gemma3(64, 4, 2, 32, 96, num_hidden_layers=6))
    write_gguf("gemma3", hf, path, Q.F32, extra)
    return path


def test_gemma3_score_scale_and_local_theta_from_the_file(tmp_path: Path) -> None:
    """llama.cpp's defaults where the file is silent — 1/sqrt(head_dim), θ = 10⁴ on sliding
    layers — and `attention.scale` and `rope.freq_base_swa` where it gives them."""
    plain = archc.load(gemma3_file(tmp_path / "plain.gguf")).spec
    assert plain.attention.scale == pytest.approx(32 ** -0.5)
    assert [layer_spec(plain, i).position.theta for i in range(6)] == [1e4] * 5 + [1e6]
    given = archc.load(gemma3_file(tmp_path / "given.gguf", {
        "gemma3.attention.scale": 0.125, "gemma3.rope.freq_base_swa": 5000.0})).spec
    assert given.attention.scale == 0.125
    assert [layer_spec(given, i).position.theta for i in range(6)] == [5000.0] * 5 + [1e6]


def test_unknown_gemma3_metadata_is_refused_by_name(tmp_path: Path) -> None:
    path = gemma3_file(tmp_path / "odd.gguf", {"gemma3.attn_logit_softcapping": 50.0})
    with pytest.raises(SpecError, match=r"gemma3\.attn_logit_softcapping: 50\.0 is a field "
                       r"archc does not know"):
        archc.load(path)
