"""What llama.cpp's converter writes for each model type (`general.architecture`): the metadata
of the `{arch}.` namespace as spec sections, and where its tensors are (``GGUF_ARCHES``).

- ``llama`` (Llama, Mistral, Mixtral, SmolLM…): the rows of each head of Q and K are stored
  permuted for llama.cpp's interleaved RoPE and put back here (archc rotates halves, as the
  original checkpoint does); Llama 3.1's RoPE scaling is stored as per-frequency divisors
  (`rope_freqs.weight`).
- ``qwen3``: Llama's block with an RMSNorm over each head of q and k (`attn_q_norm`,
  `attn_k_norm`), head_dim from `attention.key_length`; Q and K stored as the checkpoint holds
  them (llama.cpp rotates halves for it).
- ``gemma3``: sandwich norms (`attn_norm`, `post_attention_norm`, `ffn_norm`, `post_ffw_norm`)
  whose gains the converter stores as 1 + w — so they are read as plain gains, with no unit
  offset — GeGLU, embeddings scaled by sqrt(d_model), a tied head, a per-head QK-norm (also
  1 + w), and sliding-window layers between global ones. What the file does not say is
  llama.cpp's rule: one global layer in 6 unless `attention.sliding_window_pattern` says, θ = 10⁴
  on the sliding layers unless `rope.freq_base_swa` says, and the score scale 1/sqrt(head_dim)
  — 1/sqrt(d_model/heads) for the 62-layer model (Gemma 3 27B) — unless `attention.scale` says.
  `rope.freq_base` and any `rope.scaling` are the global layers'.
- ``qwen3moe`` (Qwen3-MoE): qwen3's attention, and every layer routes over experts of
  `expert_feed_forward_length` columns with a softmax router whose top k weights llama.cpp
  renormalizes.
- ``olmo2``: norms on each sublayer's output only (`post_attention_norm`, `post_ffw_norm`), q and
  k each normalized over the whole projection (`attn_q_norm` [H·D], `attn_k_norm` [Hkv·D]).
- ``deepseek2`` (DeepSeek-V2/V3, Kimi-K2): multi-head latent attention (the spec's
  `attention.latent`) — queries through `attn_q_a`, its norm and `attn_q_b` where
  `attention.q_lora_rank` is given (else one `attn_q`); `attn_kv_a_mqa` the latent's
  `kv_lora_rank` rows, then the RoPE key's `rope.dimension_count`; RoPE on adjacent pairs
  (llama.cpp's normal RoPE, transformers' interleaved). Newer files (`key_length_mla`,
  `value_length_mla`) store kv_b as `attn_k_b` [H, kv_rank, nope] and `attn_v_b` [H, v, kv_rank]
  for llama.cpp's absorbed attention, and give as `key_length`/`value_length` the widths it
  caches (kv_rank + rope, kv_rank) over one KV head; older ones store `attn_kv_b` whole with each
  head's widths. The latents' norms take `layer_norm_rms_epsilon`, as llama.cpp's graph does.
  YaRN's `yarn_log_multiplier` is 0.1·mscale_all_dim, and llama.cpp takes mscale to be
  mscale_all_dim: cos and sin unscaled, the scores by m(mscale_all_dim)²; without it, a YaRN
  file's scores take m(1)² on top of cos and sin's m(1), as llama.cpp's graph computes. Biases,
  which llama.cpp's graph has none of, are read where the file holds them. The first
  `leading_dense_block_count` layers are dense, the rest route over experts as llama.cpp's
  build_moe_ffn does (``deepseek2_routing``), with shared experts (`ffn_*_shexp`).

A metadata field archc does not read is refused by name, as config.json fields are.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from archc.errors import SpecError
from archc.ir.paramexpr import rope_inv_freq
from archc.quant.tensor import QTensor
from archc.sources.gguf_reader import Metadata
from archc.sources.hf_config import HFConfig, spec_name, typed_layers
from archc.sources.tensor_map import Layout, Part, Span, TensorMap, TensorSource, each


class GGUFSource(TensorSource, Protocol):
    """What an architecture reads of a GGUF file (``archc.sources.gguf.GGUFFile``)."""

    path: Path
    fields: Metadata


def f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999975e-06)."""
    return float(f"{value:.7g}")


# ---- the llama architecture's RoPE: scaling divisors, permuted Q/K rows ----------------------

def llama3_scaling(f: GGUFSource, theta: float, rotary_dim: int) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling from the per-frequency divisors llama.cpp stores instead of its
    parameters (`rope_freqs.weight`, θ_j / f_j).

    The llama3 rule keeps short wavelengths (f = 1), divides long ones by `factor` (f = factor)
    and between them blends: 1/f = (1 − s)/factor + s with s = (L/λ − low)/(high − low), which
    is linear in 1/λ. The middle band's points give that line; its slope L/(high − low) and
    intercept −low/(high − low) fix the rule up to one common scale of L, low and high, so
    low = 1 is taken. The parameters are accepted only if archc's llama3 frequencies computed
    from them reproduce θ_j / f_j (to f32 rounding); anything else is refused."""
    where = "rope_freqs.weight"
    factors = f.load(where).double().flatten()
    if factors.numel() != rotary_dim // 2 or not bool((factors >= 1.0 - 1e-6).all()):
        raise SpecError(where, f"{factors.numel()} factors, expected {rotary_dim // 2} of ≥ 1 "
                        "(one divisor per rotary pair)", source=str(f.path))
    base = rope_inv_freq(rotary_dim, theta).double()
    factor = float(factors.max())
    medium = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1.0 + 1e-6 and int(medium.sum()) >= 2:
        inv_wavelen = base[medium] / (2 * math.pi)
        blend = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        design = torch.stack([inv_wavelen, torch.ones_like(inv_wavelen)], dim=1)
        slope, intercept = (float(v) for v in torch.linalg.lstsq(design, blend[:, None]).solution)
        if intercept < 0 and slope > 0:
            params = {"factor": f32(factor), "original_max_seq_len": round(-slope / intercept),
                      "low_freq_factor": 1.0, "high_freq_factor": f32(1.0 - 1.0 / intercept)}
            got = rope_inv_freq(rotary_dim, theta, **params, kind="llama3").double()
            if torch.allclose(got, (base / factors).float().double(), rtol=1e-5, atol=0.0):
                return {"kind": "llama3", **params}
    raise SpecError(where, "per-frequency RoPE factors that do not follow Llama 3's scaling rule "
                    "(factors > 1, at least two of them blended)", source=str(f.path))


def unpermute_rope_rows(w: torch.Tensor | QTensor, heads: int) -> torch.Tensor | QTensor:
    """Undo llama.cpp's reordering of Q/K rows: within each head it stores rows as interleaved
    pairs (0, d/2, 1, d/2+1, ...) of the original half-split order. Whole rows move, so a
    quantized weight stays quantized."""
    # row order (heads, D/2, 2) → (heads, 2, D/2)
    rows = torch.arange(w.shape[0]).reshape(heads, -1, 2).transpose(1, 2).reshape(-1)
    return w.index_select(0, rows).contiguous() if isinstance(w, torch.Tensor) else \
        w.index_select(0, rows)


def _rope_rows(t: TensorMap) -> None:
    """Q and K, weights and biases, with their rows put back in half-split order."""
    for target in t.want:
        if m := re.fullmatch(r"layers\.\d+\.attn\.([qk])\.(weight|bias)", target):
            heads = t.spec.attention.heads if m[1] == "q" else t.spec.attention.kv_heads
            name, rows = t.name(target), t.want[target][0]
            t.add([name], [t.want[target]], [target],
                  lambda xs, h=heads: [unpermute_rope_rows(xs[0], h)],
                  lambda spans, n=name, x=target, h=heads, r=rows:
                  _narrow_rope_rows(n, spans[x], h, r))


def _narrow_rope_rows(name: str, span: Span, heads: int, rows: int) -> Part | None:
    """A rank's slice of Q or K (`rows` rows over `heads` heads) read from the file: the
    un-permutation moves rows within each head, so a span of whole heads is the same rows of
    the file, put back head by head, and a span of columns commutes with it. A span that
    splits a head (which the shard pass, cutting whole heads, never makes) is read whole."""
    dim, start, stop = span
    if dim != 0:
        return Part(((name, span),), lambda xs: [unpermute_rope_rows(xs[0], heads)])
    per_head = rows // heads
    if start % per_head or stop % per_head:
        return None
    return Part(((name, span),),
                lambda xs: [unpermute_rope_rows(xs[0], (stop - start) // per_head)])


# ---- metadata → spec ---------------------------------------------------------------------------

def header(f: GGUFSource, meta: HFConfig) -> dict[str, Any]:
    """The spec fields every architecture here reads alike: name, sizes, context, RMSNorm and
    whether the head is tied (no `output.weight`)."""
    embed_rows = f.shape("token_embd.weight")[0] if "token_embd.weight" in f.tensors else None
    return {
        "name": spec_name(f.path.stem, str(f.fields.get("general.name") or "")),
        "description": f"{f.fields.get('general.name') or f.path.stem} from {f.path.name}",
        "vocab_size": meta.number("vocab_size", embed_rows or
                                  f.fields.size("tokenizer.ggml.tokens")),
        "d_model": meta.number("embedding_length"), "layers": meta.number("block_count"),
        "max_seq_len": meta.number("context_length", 2048), "dtype": "f32",
        "norm": {"kind": "rmsnorm", "eps": f32(
            meta.number("attention.layer_norm_rms_epsilon", 1e-5, kind=float))},
        "embedding": {"tied": "output.weight" not in f.tensors}}


def rope_scaling(meta: HFConfig, max_seq: int) -> dict[str, Any] | None:
    """`rope.scaling.*`: linear, or YaRN with its original context and, where given, the
    blend's rotation bounds (`yarn_beta_fast`, `yarn_beta_slow`; llama.cpp's defaults 32 and 1
    are archc's)."""
    scaling = meta.expect("rope.scaling.type", ("none", "linear", "yarn"))
    factor = meta.number("rope.scaling.factor", 1.0, kind=float)
    if scaling == "linear" and factor != 1.0:
        return {"kind": "linear", "factor": f32(factor)}
    if scaling != "yarn":
        return None
    out = {"kind": "yarn", "factor": f32(factor), "original_max_seq_len":
           meta.number("rope.scaling.original_context_length", max_seq)}
    for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if (value := meta.number(f"rope.scaling.{key}", None, kind=float)) is not None:
            out[field] = f32(value)
    return out


def block(f: GGUFSource, meta: HFConfig, *, theta: float | None = None,
          rope_freqs: bool = False) -> dict[str, Any]:
    """The spec sections every architecture here shares: sizes, heads (head_dim from
    `attention.key_length`, RoPE over whole heads), RoPE θ and scaling, a SwiGLU (or MoE) FFN,
    RMSNorm, biases and a tied head as the tensors say. `theta`: the default θ; `rope_freqs`:
    per-frequency divisors (`rope_freqs.weight`) may give the scaling."""
    out = header(f, meta)
    d = out["d_model"]
    heads = meta.number("attention.head_count")
    kv = meta.get("attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer counts: only a uniform list is a spec
        if len(set(kv)) != 1:
            raise meta.refuse("attention.head_count_kv", kv, "every layer must have the same "
                              "number of KV heads")
        kv = kv[0]
    head_dim = meta.number("attention.key_length", d // heads)
    meta.expect("attention.value_length", (head_dim,), f"keys and values of different widths "
                f"({head_dim})")
    meta.expect("rope.dimension_count", (head_dim,), f"{meta.model_type} rotates the whole head "
                f"({head_dim} dims)")
    position: dict[str, Any] = {"kind": "rope", "theta": f32(meta.number(
        "rope.freq_base", 10000.0 if theta is None else theta, kind=float))}
    if scaling := rope_scaling(meta, out["max_seq_len"]):
        position["scaling"] = scaling
    if rope_freqs and "rope_freqs.weight" in f.tensors:
        if "scaling" in position:
            raise meta.refuse("rope.scaling.type", scaling["kind"], "the file also holds "
                              "per-frequency factors (rope_freqs.weight): one scaling at a time")
        position["scaling"] = llama3_scaling(f, position["theta"], head_dim)
    ffn: dict[str, Any] = {"kind": "swiglu", "d_ff": meta.number("feed_forward_length")}
    if experts := meta.number("expert_count", 0):
        ffn |= {"kind": "moe", "moe": {"experts": experts,
                                       "top_k": meta.number("expert_used_count", 2)}}
    return {**out,
            "attention": {"heads": heads, "kv_heads": kv, "head_dim": head_dim, "bias": {
                p[0]: f"blk.0.attn_{p}.bias" in f.tensors for p in ("q", "k", "v", "output")}},
            "ffn": ffn, "position": position}


def llama(f: GGUFSource, meta: HFConfig) -> dict[str, Any]:
    return block(f, meta, rope_freqs=True)


def qwen3(f: GGUFSource, meta: HFConfig) -> dict[str, Any]:
    out = block(f, meta)
    out["attention"]["qk_norm"] = True
    return out


def qwen3moe(f: GGUFSource, meta: HFConfig) -> dict[str, Any]:
    out = qwen3(f, meta)
    out["ffn"] = {"kind": "moe", "d_ff": meta.number("expert_feed_forward_length"),
                  "moe": {"experts": meta.number("expert_count"),
                          "top_k": meta.number("expert_used_count"), "normalize_top_k": True}}
    return out


def olmo2(f: GGUFSource, meta: HFConfig) -> dict[str, Any]:
    out = block(f, meta)
    out["attention"] |= {"qk_norm": True, "qk_norm_over": "projection"}
    out["norm"]["placement"] = "output"
    return out


# Gemma 3 in llama.cpp (llama-model.cpp): a global layer every 6th, θ 10⁴ on the others
GEMMA3_PERIOD, GEMMA3_LOCAL_THETA, GEMMA3_27B_LAYERS = 6, 10000.0, 62


def gemma3(f: GGUFSource, meta: HFConfig) -> dict[str, Any]:
    out = block(f, meta, theta=1e6)
    layers, att = out["layers"], out["attention"]
    pattern = meta.get("attention.sliding_window_pattern", GEMMA3_PERIOD)
    if isinstance(pattern, list):   # a flag per layer: does it slide?
        if len(pattern) != layers or any(not isinstance(p, bool) for p in pattern):
            raise meta.refuse("attention.sliding_window_pattern", pattern,
                              f"one true/false per layer ({layers}) is expected")
        kinds = ["local" if p else "global" for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        # llama.cpp's set_swa_pattern(n): the last layer of every n is global
        kinds = ["local" if i % pattern < pattern - 1 else "global" for i in range(layers)]
    else:
        raise meta.refuse("attention.sliding_window_pattern", pattern,
                          "a period ≥ 1 or a true/false per layer is expected")
    width = math.sqrt(out["d_model"] / att["heads"]) if layers == GEMMA3_27B_LAYERS else \
        math.sqrt(att["head_dim"])
    att |= {"qk_norm": True, "scale": f32(meta.number("attention.scale", 1.0 / width,
                                                      kind=float))}
    out["ffn"]["kind"] = "geglu"
    out["norm"] = {**out["norm"], "eps": f32(meta.number("attention.layer_norm_rms_epsilon", 1e-6,
                                                         kind=float)),
                   "placement": "sandwich"}   # the gains stored as 1 + w: no unit offset
    out["embedding"] |= {"scale": "sqrt_d_model"}
    softcap = meta.number("final_logit_softcapping", None, kind=float)
    out["output"] = {"softcap": f32(softcap) if softcap else None}
    position = out.pop("position")
    local = {"kind": "rope", "theta": f32(meta.number("rope.freq_base_swa", GEMMA3_LOCAL_THETA,
                                                      kind=float))}
    sections = {"global": {"position": position},
                "local": {"position": local,
                          "attention": {"window": meta.number("attention.sliding_window")}}}
    return typed_layers(out, kinds, sections)


# llama.cpp's converter stores YaRN's mscale_all_dim times this (`rope.scaling.yarn_log_multiplier`)
YARN_LOG_MUL_STORED = 0.1


def deepseek2(f: GGUFSource, meta: HFConfig) -> dict[str, Any]:
    out = header(f, meta)
    layers, heads = out["layers"], meta.number("attention.head_count")
    kv_rank, rope_dims = meta.number("attention.kv_lora_rank"), meta.number("rope.dimension_count")
    if meta.get(("attention.key_length_mla", "attention.value_length_mla")) is not None:
        # kv_b split in two; the sizes llama.cpp's absorbed attention caches: one head of the
        # latent and the RoPE key, its values the latent
        head_dim = meta.number("attention.key_length_mla")
        v_dim = meta.number("attention.value_length_mla")
        meta.expect("attention.key_length", (kv_rank + rope_dims,), f"with key_length_mla, the "
                    f"cached key is the latent and the RoPE key ({kv_rank} + {rope_dims})")
        meta.expect("attention.value_length", (kv_rank,), f"with value_length_mla, the cached "
                    f"value is the latent ({kv_rank})")
        meta.expect("attention.head_count_kv", (1,), "with key_length_mla, one head of latents "
                    "is cached")
    else:   # files written before the split: kv_b whole, each head's own sizes
        head_dim = meta.number("attention.key_length")
        v_dim = meta.number("attention.value_length")
        meta.expect("attention.head_count_kv", (heads,), f"latent attention gives each of the "
                    f"{heads} heads its keys and values")
    latent: dict[str, Any] = {"kv_rank": kv_rank, "rope_dims": rope_dims, "v_dim": v_dim}
    if q_rank := meta.number("attention.q_lora_rank", 0):
        latent["q_rank"] = q_rank
    q = "attn_q_a" if q_rank else "attn_q"
    attention: dict[str, Any] = {"heads": heads, "head_dim": head_dim, "latent": latent, "bias": {
        "q": f"blk.0.{q}.bias" in f.tensors, "k": "blk.0.attn_kv_a_mqa.bias" in f.tensors,
        "o": "blk.0.attn_output.bias" in f.tensors}}
    position: dict[str, Any] = {"kind": "rope", "interleaved": True, "theta": f32(meta.number(
        "rope.freq_base", 10000.0, kind=float))}
    if scaling := rope_scaling(meta, out["max_seq_len"]):
        position["scaling"] = scaling
    log_mul = meta.number("rope.scaling.yarn_log_multiplier", 0.0, kind=float)
    if scaling and scaling["kind"] == "yarn":
        if log_mul:   # llama.cpp takes mscale = mscale_all_dim: cos and sin unscaled
            mscale = f32(log_mul / YARN_LOG_MUL_STORED)
            scaling |= {"mscale": mscale, "mscale_all_dim": mscale}
        elif scaling["factor"] > 1:   # llama.cpp's scores then take m(1)² on top of cos/sin's m(1)
            attention["scale"] = (0.1 * math.log(scaling["factor"]) + 1) ** 2 / math.sqrt(head_dim)
    elif log_mul:
        raise meta.refuse("rope.scaling.yarn_log_multiplier", log_mul, "it scales YaRN's "
                          "attention, and the file's RoPE is not YaRN")
    # the first leading_dense_block_count layers dense, the rest routed
    dense = {"kind": "swiglu", "d_ff": meta.number("feed_forward_length")}
    leading = meta.number("leading_dense_block_count", 0)
    if leading >= layers:   # the experts' fields describe no layer
        meta.get(("expert_count", *ROUTING))
        return {**out, "attention": attention, "position": position, "ffn": dense}
    spec = {**out, "attention": attention, "position": position,
            "ffn": {"kind": "moe", "d_ff": meta.number("expert_feed_forward_length"),
                    "moe": deepseek2_routing(f, meta, leading)}}
    return typed_layers(spec, ["dense" if i < leading else "moe" for i in range(layers)],
                        {"dense": {"ffn": dense}, "moe": {}})


# `expert_gating_func`: llama.cpp's gating functions archc has (absent: softmax, as llama.cpp
# reads DeepSeek-V2 files written before the field)
GATING = {1: "softmax", 2: "sigmoid"}
ROUTING = ("expert_used_count", "expert_feed_forward_length", "expert_shared_count",
           "expert_weights_scale", "expert_weights_norm", "expert_gating_func",
           "expert_group_count", "expert_group_used_count")


def deepseek2_routing(f: GGUFSource, meta: HFConfig, first: int) -> dict[str, Any]:
    """The spec's moe section of a deepseek2 file's routed layers (the first is `first`), as
    llama.cpp's build_moe_ffn routes: weights by the gating function; the choice by the
    weights plus `exp_probs_b` where the file holds it, within the `expert_group_used_count`
    best of `expert_group_count` groups, each scored by its two best (llama.cpp scores V2's
    groups so too); the chosen weights renormalized if `expert_weights_norm`, then times
    `expert_weights_scale` (llama.cpp floors the sum it renormalizes by at 2⁻¹⁴, archc adds
    1e-20: the same unless k weights sum below 6e-5); `expert_shared_count` shared experts as
    one FFN of that many widths."""
    experts = meta.number("expert_count")
    gating = meta.number("expert_gating_func", 1)
    if gating not in GATING:
        raise meta.refuse("expert_gating_func", gating, "archc's routers are "
                          + ", ".join(f"{k} ({v})" for k, v in GATING.items()))
    moe: dict[str, Any] = {
        "experts": experts, "top_k": meta.number("expert_used_count"), "router": GATING[gating],
        "normalize_top_k": meta.flag("expert_weights_norm", False),
        "choice_bias": f"blk.{first}.exp_probs_b.bias" in f.tensors,
        "scale": f32(meta.number("expert_weights_scale", 1.0, kind=float))}
    if (groups := meta.number("expert_group_count", 1)) > 1:
        moe |= {"groups": groups, "group_score": "top2",
                "top_groups": meta.number("expert_group_used_count", groups)}
    else:
        meta.get("expert_group_used_count")   # one group: all of it kept
    if shared := meta.number("expert_shared_count", 0):
        moe["shared_expert_d_ff"] = shared * meta.number("expert_feed_forward_length")
    return moe


# ---- tensor names ------------------------------------------------------------------------------

NAMES = {
    "embed": "token_embd", "final_norm": "output_norm", "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm", **each("attn.*", "attn_*", "q k v"), "attn.o": "attn_output",
    **each("attn.*_norm", "attn_*_norm", "q k"), "attn_post_norm": "post_attention_norm",
    "ffn_post_norm": "post_ffw_norm",
    **each("ffn.*", "ffn_*", "gate up down"), "ffn.router": "ffn_gate_inp",
    **each("ffn.experts.*", "ffn_*_exps", "gate up down")}
LAYOUT = Layout(NAMES, layer="blk.{i}.", head=("output",), special=_rope_rows)


def _split_kv_b(t: TensorMap) -> None:
    """kv_b [H·(nope + v), kv_rank] from the two halves newer files store it as: `attn_k_b`
    [H, kv_rank, nope] (each head's key half, transposed) and `attn_v_b` [H, v, kv_rank]. The
    key half's blocks run along nope, so the whole is read as floats (``GGUFArch.dequantized``);
    a span of whole heads reads those heads of each half."""
    att = t.spec.attention
    lat = att.latent
    if lat is None:
        return
    heads, nope, v = att.heads, att.head_dim - lat.rope_dims, lat.v_dim
    for target in t.want:
        if not (m := re.fullmatch(r"layers\.(\d+)\.attn\.kv_b\.weight", target)):
            continue
        k_b, v_b = f"blk.{m[1]}.attn_k_b.weight", f"blk.{m[1]}.attn_v_b.weight"
        if k_b not in t.ckpt.names and v_b not in t.ckpt.names:
            continue   # stored whole: the table's attn_kv_b
        t.add([k_b, v_b], [(heads, lat.kv_rank, nope), (heads, v, lat.kv_rank)], [target],
              _join_kv_b, lambda spans, x=target, k=k_b, w=v_b, n=nope + v:
              _narrow_kv_b(k, w, spans[x], n))


def _floats(x: torch.Tensor | QTensor) -> torch.Tensor:
    return x.dequantize() if isinstance(x, QTensor) else x


def _join_kv_b(xs: list[Any]) -> list[torch.Tensor]:
    k_b, v_b = (_floats(x) for x in xs)
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)    # (H, nope + v, kv_rank)
    return [kv.reshape(-1, kv.shape[-1]).contiguous()]


def _narrow_kv_b(k_b: str, v_b: str, span: Span, per_head: int) -> Part | None:
    """A rank's rows of kv_b: whole heads are the same heads of both halves."""
    dim, start, stop = span
    if dim != 0 or start % per_head or stop % per_head:
        return None
    heads = (0, start // per_head, stop // per_head)
    return Part(((k_b, heads), (v_b, heads)), _join_kv_b)

# DeepSeek-V2's latent attention: queries through q_a and q_b (or one attn_q), the joint
# latent and RoPE key projection, and kv_b whole or split (``_split_kv_b``); the shared experts
# and the routed ones' choice bias
NAMES_MLA = {**NAMES, **each("attn.*", "attn_*", "q_a q_b kv_b"), "attn.kv_a": "attn_kv_a_mqa",
             **each("attn.*_norm", "attn_*_norm", "q_a kv_a"),
             **each("ffn.shared.*", "ffn_*_shexp", "gate up down"),
             "ffn.router.choice_bias": "exp_probs_b.bias"}


@dataclass(frozen=True)
class GGUFArch:
    """One `general.architecture`: its metadata as spec sections, where its tensors are, and
    the tensors that are not weights (read into the spec, or unused)."""

    spec: Callable[[GGUFSource, HFConfig], dict[str, Any]]
    layout: Layout
    skip: tuple[str, ...] = ()
    # file tensors read as floats whatever type they are stored as: their convert moves values
    # across the blocks of a quantized type (regexes)
    dequantized: tuple[str, ...] = ()


GGUF_ARCHES: dict[str, GGUFArch] = {
    # rope_freqs.weight, when there, was read into the spec's RoPE scaling
    "llama": GGUFArch(llama, LAYOUT, skip=(r"rope_freqs\.weight",)),
    "qwen3": GGUFArch(qwen3, Layout(NAMES, layer="blk.{i}.", head=("output",))),
    "qwen3moe": GGUFArch(qwen3moe, Layout(NAMES, layer="blk.{i}.", head=("output",))),
    "gemma3": GGUFArch(gemma3, Layout(NAMES, layer="blk.{i}.", head=("output",))),
    "olmo2": GGUFArch(olmo2, Layout(NAMES, layer="blk.{i}.", head=("output",))),
    "deepseek2": GGUFArch(deepseek2, Layout(NAMES_MLA, layer="blk.{i}.", head=("output",),
                                            special=_split_kv_b),
                          dequantized=(r"blk\.\d+\.attn_[kv]_b\.weight",)),
}
