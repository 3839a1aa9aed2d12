"""GGUF files: a tiny random Llama written the way llama.cpp's converter writes it (Q/K rows
permuted for its RoPE, every quantisation archc promises), loaded with `archc.load` and compared
with transformers running the same dequantised weights; the tokenizer stored in the file; bad
files refused with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import archc
from archc.errors import SpecError, WeightsError
from archc.sources.gguf import unpermute_rope_rows

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
transformers = pytest.importorskip("transformers", reason="needs transformers "
                                   "(pip install 'archc[hf]')")
tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers")

Q = gguf.GGMLQuantizationType
RTOL = 1e-4   # fp32: the same weights through differently ordered sums (see test_hf_crosscheck)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def random_k_quant(rows: int, cols: int, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of a K-quant (which the gguf package can read but not write): random quants
    and sub-scales, with the f16 block scales set to small finite values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype == Q.Q4_K:      # d, dmin, scales[12], qs[128]
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:                    # Q6_K: ql[128], qh[64], scales[16] (int8), d
        raw[..., 192:208] = rng.integers(-8, 8, size=(rows, cols // block, 16)).astype(np.int8)\
            .view(np.uint8)
        raw[..., 208:210] = scale
    return raw.reshape(rows, cols // block * size)


def hf_llama(d: int, ff: int, seed: int = 0, rope: dict[str, Any] | None = None) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=d, intermediate_size=ff, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_parameters=rope or {"rope_type": "default", "rope_theta": 5000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else noise / p.shape[-1] ** 0.5)
    return model


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *module, kind = hf.split(".")
    return f"blk.{layer}.{LAYER_NAMES['.'.join(module)]}.{kind}"


def add_tokenizer(w: Any, vocab_size: int) -> tokenizers.Tokenizer:
    """A small byte-level BPE trained here, stored as llama.cpp stores one; returns the
    `tokenizers` original to compare with."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "hello world, the end"] * 10, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    assert merges and len(tokens) <= vocab_size
    types = [3 if t in ("<pad>", "<s>", "</s>") else 1 for t in tokens]
    unused = vocab_size - len(tokens)   # fill the embedding's rows, as real vocabularies do
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens + [f"<unused{i}>" for i in range(unused)])
    w.add_token_types(types + [5] * unused)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    return tok


def write_gguf(model: Any, path: Path, qtype: Any, *, arch: str = "llama",
               extra: dict[str, Any] | None = None,
               rope_factors: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """`model` as llama.cpp would write it, 2-D weights in `qtype`. Returns the weights in HF
    names and layout as the file holds them (after quantisation)."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    add_tokenizer(w, cfg.vocab_size)
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    stored: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        x = p.numpy().astype(np.float32)
        if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
            # Mixtral, f32: the router, and each expert projection as one 3-D tensor
            # [experts, rows, cols] (transformers fuses gate and up; llama.cpp keeps them apart)
            assert qtype == Q.F32
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                ff = x.shape[1] // 2
                w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", x[:, :ff].copy())
                w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", x[:, ff:].copy())
            else:
                w.add_tensor(f"blk.{layer}." + ("ffn_down_exps.weight" if "down" in name
                                                else "ffn_gate_inp.weight"), x)
            stored[name] = torch.from_numpy(x)
            continue
        permute = {"self_attn.q_proj": heads, "self_attn.k_proj": kv}
        rows_heads = next((h for m, h in permute.items() if m in name), None)
        if rows_heads:
            x = llama_cpp_permute(x, rows_heads)
        if x.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), x)
            back = x
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), x.astype(np.float16))
            back = x.astype(np.float16).astype(np.float32)
        elif qtype in (Q.Q4_K, Q.Q6_K):
            raw = random_k_quant(*x.shape, qtype, rng)
            w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
            back = gguf.quants.dequantize(raw, qtype)
        else:
            raw = gguf.quants.quantize(x, qtype)
            w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
            back = gguf.quants.dequantize(raw, qtype)
        back = torch.from_numpy(np.array(back, dtype=np.float32))
        stored[name] = unpermute_rope_rows(back, rows_heads) if rows_heads else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K",
                                   "Q6_K"])
def test_gguf_llama_matches_transformers_on_the_same_weights(qtype: str,
                                                             tmp_path: Path) -> None:
    k_quant = qtype in ("Q4_K", "Q6_K")
    d, ff = (256, 512) if k_quant else (64, 96)   # rows must fill whole quant blocks
    hf = hf_llama(d, ff)
    path = tmp_path / f"tiny-{qtype}.gguf"
    stored = write_gguf(hf, path, Q[qtype])
    hf.load_state_dict(stored)  # transformers runs exactly what the file holds
    model = archc.load(path)
    assert model.spec.attention.kv_heads == 2 and not model.spec.embedding.tied
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
    got = model.compile()(ids)
    assert float((got - want).abs().max() / want.abs().max()) <= RTOL


def test_q_and_k_rows_are_put_back_in_half_split_order() -> None:
    """Without undoing llama.cpp's permutation the rotation pairs the wrong dims: the check that
    the loader's fix is the exact inverse, for MHA and GQA row counts."""
    for heads in (4, 2, 1):
        w = torch.randn(heads * 16, 8)
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rope_rows(permuted, heads), w)


def test_gguf_tokenizer_and_chat_template(tmp_path: Path) -> None:
    hf = hf_llama(64, 96)
    path = tmp_path / "tok.gguf"
    write_gguf(hf, path, Q.F32)
    w = gguf.GGUFWriter(str(tmp_path / "scratch.gguf"), "llama")
    original = add_tokenizer(w, 96)
    model = archc.load(path)
    tok = model.tokenizer
    for text in ("the cat sat on the mat", "hello world, the end", "the mat"):
        ids = tok.encode(text)
        assert ids == original.encode(text).ids
        assert tok.decode(ids) == text
    assert model.eos_token_ids == (2,)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<s>user: hi\nassistant:"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1  # <s> from the template is one special token, not split


def test_gguf_of_another_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecError, match=r"general.architecture: 'gpt2' is not supported.*"
                       r"allowed: deepseek2, gemma3, llama, olmo2, qwen3"):
        archc.load(path)


def test_unknown_llama_metadata_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_gguf(hf_llama(64, 96), path, Q.F32, extra={"llama.attention.sliding_window": 8})
    with pytest.raises(SpecError, match=r"attention.sliding_window: 8 is a field archc does "
                       r"not know"):
        archc.load(path)


def test_truncated_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "whole.gguf"
    write_gguf(hf_llama(64, 96), path, Q.F32)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"cut.gguf"):
        archc.load(cut)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(WeightsError, match=r"not a readable GGUF file"):
        archc.load(not_gguf)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}


def llama3_rope_divisors(dim: int, theta: float, factor: float, low: float, high: float,
                         context: int) -> np.ndarray:
    """What llama.cpp stores for Llama 3.1 instead of the scaling parameters: per rotary pair,
    the divisor of its frequency — 1 for wavelengths under context/high, `factor` for those over
    context/low, and between them 1 / ((1 − s)/factor + s), s = (context/λ − low)/(high − low)."""
    out = []
    for j in range(dim // 2):
        wavelen = 2 * np.pi * theta ** (2 * j / dim)
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            s = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out)


def test_llama3_rope_divisors_become_its_scaling(tmp_path: Path) -> None:
    """A Llama 3.1-style file (rope_freqs.weight, no scaling metadata) runs as transformers runs
    the llama3 rope parameters it came from. Head dim 16, θ 5000, context 512: two of the eight
    pairs are in the blended band, the rest split between kept and divided."""
    hf = hf_llama(64, 96, rope=LLAMA3_ROPE)
    divisors = llama3_rope_divisors(16, 5000.0, 8.0, 1.0, 4.0, 512)
    assert ((divisors > 1) & (divisors < 8)).sum() == 2
    path = tmp_path / "llama31.gguf"
    hf.load_state_dict(write_gguf(hf, path, Q.F32, rope_factors=divisors))
    model = archc.load(path)
    scaling = model.spec.position.scaling
    assert scaling is not None and scaling.kind == "llama3" and scaling.factor == 8.0
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    positions_far = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for x in (ids, positions_far):
            want = hf(x).logits
            got = model.compile()(x)
            assert float((got - want).abs().max() / want.abs().max()) <= RTOL


def test_rope_divisors_of_another_rule_are_refused(tmp_path: Path) -> None:
    divisors = llama3_rope_divisors(16, 5000.0, 8.0, 1.0, 4.0, 512)
    divisors[3] *= 1.5     # one blended pair off the rule
    path = tmp_path / "odd.gguf"
    write_gguf(hf_llama(64, 96), path, Q.F32, rope_factors=divisors)
    with pytest.raises(SpecError, match=r"rope_freqs.weight: per-frequency RoPE factors that do "
                       r"not follow Llama 3's scaling rule"):
        archc.load(path)


def test_gguf_mixtral_experts_match_transformers(tmp_path: Path) -> None:
    """Mixtral as llama.cpp writes it: llama architecture with expert_count, the router as
    ffn_gate_inp and the experts' gate, up and down projections as 3-D tensors."""
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else noise / p.shape[-1] ** 0.5)
    path = tmp_path / "mixtral.gguf"
    write_gguf(hf, path, Q.F32, extra={"llama.expert_count": 4, "llama.expert_used_count": 2})
    model = archc.load(path)
    assert model.spec.ffn.kind == "moe" and model.spec.ffn.moe.experts == 4
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
    got = model.compile()(ids)
    assert float((got - want).abs().max() / want.abs().max()) <= RTOL


def hf_qwen3_moe(seed: int = 0) -> Any:
    """A tiny Qwen3-MoE as llama.cpp runs one: every layer routed, top-k renormalized;
    head_dim 32 ≠ 64/4, GQA 4/2."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            scale = 3.0 if name.endswith("mlp.gate.weight") else 1.0   # a decisive routing
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else scale * noise / p.shape[-1] ** 0.5)
    return model


QWEN3MOE_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                  "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(model: Any, path: Path, qtype: Any) -> dict[str, torch.Tensor]:
    """`model` as llama.cpp's converter writes a Qwen3-MoE (Q and K rows as they are, experts
    as [experts, rows, cols] tensors, in `qtype`, the rest F32). Returns the weights in HF
    names as the file holds them."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    add_tokenizer(w, cfg.vocab_size)
    def experts(name: str, x: np.ndarray) -> np.ndarray:
        """[experts, rows, cols] in `qtype`; the values the file holds."""
        if qtype == Q.F32:
            w.add_tensor(name, x)
            return x
        raw = gguf.quants.quantize(x, qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
        return np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32)

    stored: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        x = p.numpy().astype(np.float32)
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("experts.gate_up_proj"):   # transformers' [E, 2F, d]: gate rows first
            ff = x.shape[1] // 2
            x = np.concatenate([experts(f"blk.{layer}.ffn_gate_exps.weight", x[:, :ff].copy()),
                                experts(f"blk.{layer}.ffn_up_exps.weight", x[:, ff:].copy())],
                               axis=1)
        elif name.endswith("experts.down_proj"):
            x = experts(f"blk.{layer}.ffn_down_exps.weight", x)
        elif name in GGUF_NAMES:
            w.add_tensor(GGUF_NAMES[name], x)
        else:
            module = ".".join(name.split(".")[3:-1])
            gname = QWEN3MOE_NAMES.get(module) or LAYER_NAMES[module]
            w.add_tensor(f"blk.{layer}.{gname}.{name.split('.')[-1]}", x)
        stored[name] = torch.from_numpy(x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_qwen3moe_matches_transformers(qtype: str, tmp_path: Path) -> None:
    """A qwen3moe file (llama.cpp's name for Qwen3-MoE): per-head QK-norm, GQA, head_dim apart
    from d_model/heads, experts stored [experts, rows, cols] — kept quantized (Q8_0) — against
    transformers on the values the file holds."""
    hf = hf_qwen3_moe()
    path = tmp_path / f"tiny-qwen3moe-{qtype}.gguf"
    hf.load_state_dict(write_qwen3moe_gguf(hf, path, Q[qtype]))
    model = archc.load(path)
    spec = model.spec
    assert spec.attention.qk_norm and spec.ffn.moe.experts == 5 and spec.ffn.moe.normalize_top_k
    quantized = {k for k, v in model.weights.items() if not isinstance(v, torch.Tensor)}
    assert quantized == (set() if qtype == "F32" else
                         {f"layers.{i}.ffn.experts.{p}.weight" for i in range(2)
                          for p in ("gate", "up", "down")})
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
    got = model.compile()(ids)
    assert float((got - want).abs().max() / want.abs().max()) <= RTOL
