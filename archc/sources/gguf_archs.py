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

def block(f: GGUFSource, meta: HFConfig, *, theta: float | None = None,
          rope_freqs: bool = False) -> dict[str, Any]:
    """The spec sections every architecture here shares: sizes, heads (head_dim from
    `attention.key_length`, RoPE over whole heads), RoPE θ and scaling, a SwiGLU (or MoE) FFN,
    RMSNorm, biases and a tied head as the tensors say. `theta`: the default θ; `rope_freqs`:
    per-frequency divisors (`rope_freqs.weight`) may give the scaling."""
    d = meta.number("embedding_length")
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
    max_seq = meta.number("context_length", 2048)
    position: dict[str, Any] = {"kind": "rope", "theta": f32(meta.number(
        "rope.freq_base", 10000.0 if theta is None else theta, kind=float))}
    scaling = meta.expect("rope.scaling.type", ("none", "linear", "yarn"))
    factor = meta.number("rope.scaling.factor", 1.0, kind=float)
    if scaling == "linear" and factor != 1.0:
        position["scaling"] = {"kind": "linear", "factor": factor}
    elif scaling == "yarn":
        position["scaling"] = {"kind": "yarn", "factor": factor, "original_max_seq_len":
                               meta.number("rope.scaling.original_context_length", max_seq)}
    if rope_freqs and "rope_freqs.weight" in f.tensors:
        if "scaling" in position:
            raise meta.refuse("rope.scaling.type", scaling, "the file also holds per-frequency "
                              "factors (rope_freqs.weight): one scaling at a time")
        position["scaling"] = llama3_scaling(f, position["theta"], head_dim)
    ffn: dict[str, Any] = {"kind": "swiglu", "d_ff": meta.number("feed_forward_length")}
    if experts := meta.number("expert_count", 0):
        ffn |= {"kind": "moe", "moe": {"experts": experts,
                                       "top_k": meta.number("expert_used_count", 2)}}
    embed_rows = f.shape("token_embd.weight")[0] if "token_embd.weight" in f.tensors else None
    return {
        "name": spec_name(f.path.stem, str(f.fields.get("general.name") or "")),
        "description": f"{f.fields.get('general.name') or f.path.stem} from {f.path.name}",
        "vocab_size": meta.number("vocab_size", embed_rows or
                                  f.fields.size("tokenizer.ggml.tokens")),
        "d_model": d, "layers": meta.number("block_count"), "max_seq_len": max_seq, "dtype": "f32",
        "attention": {"heads": heads, "kv_heads": kv, "head_dim": head_dim, "bias": {
            p[0]: f"blk.0.attn_{p}.bias" in f.tensors for p in ("q", "k", "v", "output")}},
        "ffn": ffn, "position": position, "norm": {"kind": "rmsnorm", "eps": f32(
            meta.number("attention.layer_norm_rms_epsilon", 1e-5, kind=float))},
        "embedding": {"tied": "output.weight" not in f.tensors}}


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


# ---- tensor names ------------------------------------------------------------------------------

NAMES = {
    "embed": "token_embd", "final_norm": "output_norm", "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm", **each("attn.*", "attn_*", "q k v"), "attn.o": "attn_output",
    **each("attn.*_norm", "attn_*_norm", "q k"), "attn_post_norm": "post_attention_norm",
    "ffn_post_norm": "post_ffw_norm",
    **each("ffn.*", "ffn_*", "gate up down"), "ffn.router": "ffn_gate_inp",
    **each("ffn.experts.*", "ffn_*_exps", "gate up down")}
LAYOUT = Layout(NAMES, layer="blk.{i}.", head=("output",), special=_rope_rows)


@dataclass(frozen=True)
class GGUFArch:
    """One `general.architecture`: its metadata as spec sections, where its tensors are, and
    the tensors that are not weights (read into the spec, or unused)."""

    spec: Callable[[GGUFSource, HFConfig], dict[str, Any]]
    layout: Layout
    skip: tuple[str, ...] = ()


GGUF_ARCHES: dict[str, GGUFArch] = {
    # rope_freqs.weight, when there, was read into the spec's RoPE scaling
    "llama": GGUFArch(llama, LAYOUT, skip=(r"rope_freqs\.weight",)),
    "qwen3": GGUFArch(qwen3, Layout(NAMES, layer="blk.{i}.", head=("output",))),
    "qwen3moe": GGUFArch(qwen3moe, Layout(NAMES, layer="blk.{i}.", head=("output",))),
    "gemma3": GGUFArch(gemma3, Layout(NAMES, layer="blk.{i}.", head=("output",))),
    "olmo2": GGUFArch(olmo2, Layout(NAMES, layer="blk.{i}.", head=("output",))),
}
