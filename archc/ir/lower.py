"""Lowering: Spec → Program, faithful and unfused (separate Q/K/V projections, explicit bias adds,
decomposed attention, ``repeat_kv`` for GQA): the passes earn every speed-up, and each can be seen.

Every node records the spec field that made it (its ``origin``); parameters get HF-like names
(``layers.3.attn.q.weight``). A decoder graph reads and writes the KV cache at offset P, so one
graph serves prefill (P = 0) and decode (T = 1). Each block is lowered from what its layer runs
(``archc.spec.load.layer_spec``); the embeddings, final norm and head from the model's fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import archc.ir.expr as E
from archc.dtypes import KV_CODES
from archc.errors import ArchcError
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder, Program
from archc.ir.modifiers import leaves
from archc.ir.ops import Op
from archc.ir.ops.steps import step
from archc.ir.paramexpr import leaf
from archc.ir.shapes import QUANT_DTYPES, B, P, S, T, shape
from archc.ir.verify import verify
from archc.spec.expressions import expressions, head_count
from archc.spec.load import layer_spec
from archc.spec.schema import FFN, MoE, Norm, Spec


def expert_gate(moe: MoE, activation: str) -> Call:
    """An expert's activation of its gate projection g, as an elementwise expression of x(0):
    act(g), the gate clamped to ≤ clamp first, and a swish gate g·σ(β·g) for β ≠ 1."""
    g = E.x(0) if moe.clamp is None else E.call("clamp", E.x(0), hi=moe.clamp)
    if moe.swish_beta == 1.0:
        return E.call("act", g, fn=activation)
    return E.call("mul", g, E.call("act", E.call("scale", g, by=moe.swish_beta), fn="sigmoid"))


def expert_up(moe: MoE) -> Call:
    """A gated expert's up projection u as its product takes it: clamped to ±clamp, plus
    up_offset."""
    u = E.x(0) if moe.clamp is None else E.call("clamp", E.x(0), lo=-moe.clamp, hi=moe.clamp)
    return E.call("add", u, moe.up_offset) if moe.up_offset else u


def lower(spec: Spec, dtype: str = "f32", quant: Mapping[str, str] | None = None,
          kv_cache: str | None = None) -> Program:
    """The unfused program of `spec`, with activations and weights in `dtype` — but the weights
    `quant` names (checkpoint tensor → scheme), which stay quantized — and a decoder's KV cache
    held in `dtype`, or quantized per (token, head) with `kv_cache` int8 or fp8."""
    q = dict(quant or {})
    if kv_cache is not None and kv_cache not in KV_CODES:
        raise ArchcError(f"kv_cache={kv_cache!r} is not a KV-cache format (known: "
                         f"{', '.join(KV_CODES)}, or None for the model dtype)")
    if spec.family == "encoder-decoder":
        assert spec.decoder_layers is not None
        graphs = (_Stack(spec, dtype, "encoder", "encoder.", spec.layers, causal=False,
                         quant=q).build(),
                  _Stack(spec, dtype, "decoder", "decoder.", spec.decoder_layers, causal=True,
                         cross=True, quant=q, kv_cache=kv_cache).build())
    else:
        graphs = (_Stack(spec, dtype, spec.family, "", spec.layers,
                         causal=spec.family == "decoder", quant=q, kv_cache=kv_cache).build(),)
    program = Program(spec.name, graphs)
    verify(program)
    return program


class _Stack:
    """Builds one graph: embeddings, `layers` blocks, final norm, and head or hidden output."""

    def __init__(self, spec: Spec, dtype: str, name: str, prefix: str, layers: int, *,
                 causal: bool, cross: bool = False, quant: Mapping[str, str] | None = None,
                 kv_cache: str | None = None) -> None:
        self.s, self.dt, self.prefix, self.layers = spec, dtype, prefix, layers
        self.quant = quant or {}
        self.kv_cache = {} if kv_cache is None else {"quant": kv_cache}   # kv_cache's attrs
        self.causal = causal          # a decoder stack: causal self-attention over a KV cache
        self.cross = cross            # reads encoder states through cross-attention
        self.b = GraphBuilder(name)
        self.d = spec.d_model
        self.kinds = spec.layer_type_names(layers)            # the type of each layer
        self.specs = [layer_spec(spec, i) for i in range(layers)]   # and what it runs
        self._shared: dict[str, dict[object, str]] = {}

    @contextmanager
    def at(self, origin: str) -> Iterator[None]:
        """Nodes emitted inside come from spec field `origin` (a failed lowering is discarded)."""
        saved, self.b.origin = self.b.origin, origin
        yield
        self.b.origin = saved

    def param(self, name: str, *dims: int, shared: bool = False, dtype: str | None = None,
              expr: Call | None = None) -> int:
        full = name if shared else self.prefix + name
        return self.b.param(full, shape(*dims), dtype or self.quant.get(full, self.dt), expr=expr)

    def gather(self, table: int, ids: int) -> int:
        """Rows of `table` by `ids`; a quantized table's rows come out in the model dtype."""
        quantized = self.b.nodes[table].dtype in QUANT_DTYPES
        return self.b.emit(Op.EMBEDDING, table, ids, dtype=self.dt if quantized else None)

    def pointwise(self, x: int, origin: str, fn: str, **params: float) -> int:
        """fn(x) in the elementwise language (a scale, a soft-cap), from spec field `origin`."""
        return self.b.emit(Op.POINTWISE, x, origin=origin, expr=E.call(fn, E.x(0), **params))

    def shared(self, layer: int, name: str, key: Callable[[Spec], object]) -> str:
        """The name of a parameter computed at load that layers share (`rope.cos_sin`): `name`,
        or where this stack's layer types compute it differently (`key` of what a layer runs;
        None: the layer has none), the name of the first type that computes it as layer `layer`
        does: `rope.global.cos_sin`."""
        if name not in self._shared:
            found: dict[object, str] = {}
            for kind, ls in zip(self.kinds, self.specs):
                if (k := key(ls)) is not None:
                    found.setdefault(k, kind)
            self._shared[name] = found
        found = self._shared[name]
        head, _, tail = name.partition(".")
        return name if len(found) <= 1 else f"{head}.{found[key(self.specs[layer])]}.{tail}"

    def norm(self, x: int, name: str, origin: str = "norm.kind", norm: Norm | None = None,
             gain: bool = True) -> int:
        """A norm (the model's, or a layer's `norm`) over the last dim of x, with gain (and
        LayerNorm bias) params; without `gain`, a gain of ones made at load (no tensor)."""
        n, width = norm or self.s.norm, int(self.b.nodes[x].shape[-1])
        with self.at(origin):
            zeros = Call("zeros", (), (("shape", (width,)),))
            unit = zeros if n.unit_offset else Call("offset", (zeros,), (("by", 1.0),))
            w = self.param(f"{name}.weight", width, expr=None if gain else unit)
            if n.kind == "rmsnorm":
                return self.b.emit(Op.NORM, x, w, kind="rms", eps=n.eps, unit_offset=n.unit_offset)
            bias = [self.param(f"{name}.bias", width)] if n.bias else []
            return self.b.emit(Op.NORM, x, w, *bias, kind="layer", eps=n.eps,
                               epilogue=(step("bias"),) if n.bias else ())

    def linear(self, x: int, name: str, n_out: int, bias: bool, bias_origin: str) -> int:
        n_in = int(self.b.nodes[x].shape[-1])
        y = self.b.emit(Op.MATMUL, x, self.param(f"{name}.weight", n_out, n_in))
        if bias:
            with self.at(bias_origin):
                y = self.b.emit(Op.ADD, y, self.param(f"{name}.bias", n_out))
        return y

    def inputs(self) -> None:
        s, b, causal = self.s, self.b, self.causal
        softmax = [ls for ls in self.specs if ls.mixer.kind == "attention"]
        rope = any(ls.position.kind == "rope" for ls in softmax)
        self.tokens = b.input("tokens", shape(B, T), "i64", "family")
        self.positions = (b.input("positions", shape(T), "i64", "position.kind")
                          if s.position.kind in ("learned", "sinusoidal") or rope else None)
        self.padding = None if causal else b.input("attention_mask", shape(B, T), "i64", "family")
        self.prefix_len = (b.input("prefix_len", (), "i64", "attention.mask") if causal and any(
            ls.attention.mask == "prefix" for ls in softmax) else None)
        self.token_types = (b.input("token_types", shape(B, T), "i64", "embedding.token_types")
                            if s.embedding.token_types and not causal else None)
        # per-token inputs of the attention expressions, over every key position
        self.token_inputs = {i.name: b.input(i.name, shape(B, P + T) if causal else shape(B, T),
                                             "i32", "attention.inputs", default=i.default)
                             for ls in softmax for i in ls.attention.inputs or ()}
        if self.cross:
            self.enc = b.input("encoder_hidden", shape(B, S, self.d), self.dt, "family")
            self.enc_mask = b.input("encoder_mask", shape(B, S), "i64", "family")

    def embed(self) -> int:
        s, pos = self.s, self.s.position
        width = s.embedding.project_dim or self.d
        with self.at("vocab_size"):
            table = self.param("embed.weight", s.vocab_size, width, shared=True)
            x = self.gather(table, self.tokens)
        if s.embedding.scale is not None:
            x = self.pointwise(x, "embedding.scale", "scale", by=s.embedding.scale)
        if s.embedding.project_dim is not None:
            with self.at("embedding.project_dim"):
                project = self.param("embed.project_in.weight", self.d, width, shared=True)
                x = self.b.emit(Op.MATMUL, x, project)
        if pos.kind in ("learned", "sinusoidal"):
            with self.at("position.kind"):
                if pos.kind == "learned":
                    table = self.param("pos_embed.weight", s.max_seq_len + pos.offset, self.d)
                    if pos.offset:
                        with self.at("position.offset"):
                            rows = Call("rows", (leaf(self.prefix + "pos_embed.weight"),),
                                        (("start", pos.offset),))
                            table = self.param("pos_embed.rows", s.max_seq_len, self.d, expr=rows)
                else:
                    table = self.param("pos_embed.sinusoidal", s.max_seq_len, self.d,
                                       expr=Call("sinusoidal", (), (("rows", s.max_seq_len),
                                                                    ("dim", self.d))))
                x = self.b.emit(Op.ADD, x, self.gather(table, self.positions))
        if self.token_types is not None:
            with self.at("embedding.token_types"):
                table = self.param("type_embed.weight", s.embedding.token_types, self.d)
                x = self.b.emit(Op.ADD, x, self.gather(table, self.token_types))
        return self.norm(x, "embed_norm", "embedding.norm") if s.embedding.norm else x

    @staticmethod
    def rope_rotation(s: Spec) -> tuple[str, tuple[int, ...], Call, dict[str, object]]:
        """The rotation buffer the rope ops of a layer running `s` read — its name, dims and
        expression — and the attrs that depend on the scaling. Without dynamic NTK it is the
        cos/sin table [max_seq_len, 2, rotary_dim/2], computed once at load from the (scaled)
        frequencies with any attention scale (YaRN's mscale) applied, so kernels read cos and
        sin rather than compute them. Dynamic NTK's frequencies depend on the sequence length:
        its rope ops read the default inverse frequencies and rescale them as they run."""
        pos, sc = s.position, s.position.scaling
        kw: list[tuple[str, object]] = [("dim", s.rotary_dim), ("theta", pos.theta)]
        if sc is not None and sc.kind == "dynamic":
            dynamic = Call("ntk", (), (("factor", sc.factor),
                                       ("original_max_seq_len", sc.original_max_seq_len)))
            return "rope.inv_freq", (s.rotary_dim // 2,), Call("rope_inv_freq", (), tuple(kw)), \
                {"dynamic": dynamic}
        mscale = 1.0
        rows = s.max_seq_len    # positions run below it: the KV cache's length
        if sc is not None and sc.kind == "longrope":
            # two tables, one per set of factors, cos and sin scaled by the attention factor
            # (default sqrt(1 + ln(factor)/ln(original))); a call whose last position reaches
            # past original_max_seq_len reads the long one (rows + p), as transformers picks
            # the factors per call from its longest position
            original = sc.original_max_seq_len
            mscale = sc.attention_factor if sc.attention_factor is not None else math.sqrt(
                1 + math.log(sc.factor) / math.log(original)) if sc.factor > 1 else 1.0
            scaled = (("mscale", mscale),) if mscale != 1.0 else ()
            tables = tuple(Call("rope_cos_sin", (Call("rope_inv_freq", (), (
                *kw, ("kind", "longrope"), ("factors", factors))),), (("rows", rows), *scaled))
                for factors in (sc.short_factor, sc.long_factor))
            return "rope.cos_sin", (2 * rows, 2, s.rotary_dim // 2), \
                Call("cat", tables, (("dim", 0),)), \
                {"dynamic": Call("longrope", (), (("original_max_seq_len", original),))}
        if sc is not None:
            fields = {"llama3": ("original_max_seq_len", "low_freq_factor", "high_freq_factor"),
                      "yarn": ("original_max_seq_len", "beta_fast", "beta_slow")}
            kw += [(f, getattr(sc, f)) for f in ("kind", "factor", *fields.get(sc.kind, ()))]
            if sc.kind == "yarn" and not sc.truncate:
                kw.append(("truncate", False))
            if sc.kind == "yarn":   # cos and sin scaled by 0.1·ln(factor) + 1 unless given
                mscale = sc.yarn_attention_factor
        table = Call("rope_cos_sin", (Call("rope_inv_freq", (), tuple(kw)),),
                     (("rows", rows),) + ((("mscale", mscale),) if mscale != 1.0 else ()))
        return "rope.cos_sin", (rows, 2, s.rotary_dim // 2), table, {}

    def rope_params(self, layer: int) -> tuple[int, dict[str, object]]:
        """The rotation buffer layer `layer`'s rope ops read (``rope_rotation``), shared by the
        layers that rotate alike, and the rope attrs of its scaling."""
        ls = self.specs[layer]
        name, dims, expr, attrs = self.rope_rotation(ls)

        def key(other: Spec) -> object:   # the table (or frequencies) another layer reads
            if other.mixer.kind != "attention" or other.position.kind != "rope":
                return None
            other_name, _, other_expr, _ = self.rope_rotation(other)
            return other_expr if other_name == name else None
        with self.at("position.scaling" if ls.position.scaling else "position.theta"):
            return self.param(self.shared(layer, name, key), *dims, dtype="f32", shared=True,
                              expr=expr), attrs

    def qkv_heads(self, ls: Spec, x: int, src: int, base: str, *,
                  norm_projections: bool = False) -> tuple[int, int, int]:
        """q of x, k and v of src, split into heads: (B, H, T, D) and twice (B, Hkv, T|S, D).
        `norm_projections`: q and k are normalized whole (over H·D and Hkv·D) before the split."""
        att = ls.attention
        heads, kv_heads, hd, bias = att.heads, att.kv_heads, att.head_dim, att.bias
        with self.at("attention.heads"):
            q = self.linear(x, f"{base}.q", heads * hd, bias.q, "attention.bias.q")
        with self.at("attention.kv_heads"):
            k = self.linear(src, f"{base}.k", kv_heads * hd, bias.k, "attention.bias.k")
            v = self.linear(src, f"{base}.v", kv_heads * hd, bias.v, "attention.bias.v")
        if norm_projections:   # (B, T, H·D)
            q = self.norm(q, f"{base}.q_norm", "attention.qk_norm_over", ls.norm,
                          att.qk_norm_gain)
            k = self.norm(k, f"{base}.k_norm", "attention.qk_norm_over", ls.norm,
                          att.qk_norm_gain)
        q = self.b.emit(Op.SPLIT_HEADS, q, heads=heads, origin="attention.heads")
        with self.at("attention.kv_heads"):
            k, v = (self.b.emit(Op.SPLIT_HEADS, t, heads=kv_heads) for t in (k, v))
        return q, k, v

    def attention(self, x: int, layer: int, name: str, kv_source: int | None = None) -> int:
        """Multi-head attention of x over itself (through the KV cache in a decoder) or, for
        cross-attention, over `kv_source` (the encoder states), as layer `layer` runs it."""
        att = self.specs[layer].attention
        self_attn = kv_source is None
        base = f"layers.{layer}.{name}"
        if att.latent is not None:
            scores, v = self.latent_scores(x, layer, base)
        else:
            scores, v = self.scores(x, layer, base, kv_source)
        gate = None
        if att.output_gate and self_attn:
            with self.at("attention.output_gate"):   # σ of it scales the merged heads
                gate = self.linear(x, f"{base}.gate", att.heads * att.v_dim, att.bias.q,
                                   "attention.bias.q")
                gate = self.b.emit(Op.ACT, gate, fn="sigmoid")
        return self.attend(scores, v, layer, base, self_attn, gate)

    def scores(self, x: int, layer: int, base: str, kv_source: int | None) -> tuple[int, int]:
        """q·kᵀ (B, H, T, L) of x's queries over the keys of x (through the KV cache in a
        decoder) or of `kv_source`, and the values (B, H, L, D) they weigh."""
        s = self.specs[layer]
        att = s.attention
        self_attn = kv_source is None
        whole = att.qk_norm and att.qk_norm_over == "projection"
        q, k, v = self.qkv_heads(s, x, x if self_attn else kv_source, base,
                                 norm_projections=whole)
        if att.qk_norm and not whole:
            origin = "attention.qk_norm" if att.qk_norm_gain else "attention.qk_norm_gain"
            q = self.norm(q, f"{base}.q_norm", origin, s.norm, att.qk_norm_gain)
            k = self.norm(k, f"{base}.k_norm", origin, s.norm, att.qk_norm_gain)
        if s.position.kind == "rope" and self_attn:
            with self.at("position.kind"):
                freq, scaling = self.rope_params(layer)
                rope = dict(rotary_dim=s.rotary_dim, interleaved=s.position.interleaved, **scaling)
                q, k = (self.b.emit(Op.ROPE, t, self.positions, freq, **rope) for t in (q, k))
        if self.causal and self_attn:
            with self.at("family"):
                k = self.b.emit(Op.KV_CACHE, k, layer=layer, kind="k",   # (B, Hkv, P+T, D)
                                **self.kv_cache)
                v = self.b.emit(Op.KV_CACHE, v, layer=layer, kind="v", **self.kv_cache)
        if att.group_size > 1:
            with self.at("attention.kv_heads"):   # k, v: (B, H, L, D)
                k, v = (self.b.emit(Op.REPEAT_KV, t, groups=att.group_size) for t in (k, v))
        return self.b.emit(Op.SCORES, q, k, origin="attention"), v      # (B, H, T, L)

    def latent_scores(self, x: int, layer: int, base: str) -> tuple[int, int]:
        """Multi-head latent attention's scores and values (DeepSeek-V2), unfused::

            q          = q_b(norm(q_a(x)))  or  q(x)            # (B, H, T, nope + rope)
            c, k_rope  = split(kv_a(x))                          # [kv_rank | rope_dims]
            c          = norm(c)                                 # the latent the cache holds
            q_rope, k_rope = rope(q_rope), rope(k_rope)          # k_rope: one head for all
            k_nope, v  = split(kv_b(c))                          # per head, over every key
            scores     = q_nope·k_nopeᵀ + q_rope·k_ropeᵀ

        The cache holds c and k_rope per token (kv_rank + rope_dims values); every step
        projects all of the cached latents up again, which `absorb-mla` avoids."""
        s = self.specs[layer]
        att, lat = s.attention, s.attention.latent
        assert lat is not None
        heads, hd, rope_dims = att.heads, att.head_dim, lat.rope_dims
        nope = hd - rope_dims
        latent_norm = dataclasses.replace(s.norm, eps=lat.eps or s.norm.eps)

        def columns(t: int, start: int, stop: int) -> int:
            return self.b.emit(Op.SLICE, t, start=start, stop=stop)
        with self.at("attention.latent.q_rank" if lat.q_rank else "attention.heads"):
            if lat.q_rank:
                q = self.linear(x, f"{base}.q_a", lat.q_rank, att.bias.q, "attention.bias.q")
                q = self.norm(q, f"{base}.q_a_norm", "attention.latent.q_rank", latent_norm)
                q = self.linear(q, f"{base}.q_b", heads * hd, False, "attention.bias.q")
            else:
                q = self.linear(x, f"{base}.q", heads * hd, att.bias.q, "attention.bias.q")
            q = self.b.emit(Op.SPLIT_HEADS, q, heads=heads)                # (B, H, T, hd)
        with self.at("attention.latent"):
            q_nope, q_rope = columns(q, 0, nope), columns(q, nope, hd)
            kv = self.linear(x, f"{base}.kv_a", lat.kv_rank + rope_dims, att.bias.k,
                             "attention.bias.k")
            c = self.norm(columns(kv, 0, lat.kv_rank), f"{base}.kv_a_norm",
                          "attention.latent.kv_rank", latent_norm)
            c, k_rope = (self.b.emit(Op.SPLIT_HEADS, t, heads=1)         # (B, 1, T, ·)
                         for t in (c, columns(kv, lat.kv_rank, lat.kv_rank + rope_dims)))
        with self.at("position.kind"):
            freq, scaling = self.rope_params(layer)
            rope = dict(rotary_dim=rope_dims, interleaved=s.position.interleaved, **scaling)
            q_rope, k_rope = (self.b.emit(Op.ROPE, t, self.positions, freq, **rope)
                              for t in (q_rope, k_rope))
        with self.at("family"):   # (B, 1, P+T, ·)
            c = self.b.emit(Op.KV_CACHE, c, layer=layer, kind="latent", **self.kv_cache)
            k_rope = self.b.emit(Op.KV_CACHE, k_rope, layer=layer, kind="k_rope",
                                 **self.kv_cache)
        with self.at("attention.latent"):
            kv = self.linear(self.b.emit(Op.MERGE_HEADS, c), f"{base}.kv_b",
                             heads * (nope + lat.v_dim), False, "attention.latent")
            kv = self.b.emit(Op.SPLIT_HEADS, kv, heads=heads)    # (B, H, P+T, nope + v)
            k_nope, v = columns(kv, 0, nope), columns(kv, nope, nope + lat.v_dim)
            scores = self.b.emit(Op.ADD, self.b.emit(Op.SCORES, q_nope, k_nope),
                                 self.b.emit(Op.SCORES, q_rope, k_rope))
        return scores, v

    def attend(self, scores: int, v: int, layer: int, base: str, self_attn: bool,
               gate: int | None = None) -> int:
        """Scores (B, H, T, L) scaled, capped, biased, masked and normalized; the values they
        weigh summed per head, merged, times the output gate `gate` if given, and projected
        out."""
        s = self.specs[layer]
        att = s.attention
        if s.attention_scale != 1.0:
            scores = self.pointwise(scores, "attention.head_dim" if att.scale is None else
                                    "attention.scale", "scale", by=s.attention_scale)
        if att.softcap is not None:
            scores = self.pointwise(scores, "attention.softcap", "softcap", cap=att.softcap)
        if s.position.kind == "alibi" and self_attn:
            with self.at("position.kind"):
                slopes = self.alibi_slopes(s)
                slopes = self.param(self.shared(layer, "alibi.slopes", self.alibi_slopes),
                                    att.heads, dtype="f32", shared=True, expr=slopes)
                scores = self.b.emit(Op.ALIBI, scores, slopes)
        if s.position.kind == "relative" and self_attn:
            with self.at("position.kind"):
                table = self.param("layers.0.attn.rel_bias.weight", s.position.buckets, att.heads)
                scores = self.b.emit(Op.REL_BIAS, scores, table, bidirectional=not self.causal,
                                     max_distance=s.position.max_distance)
        score, mask = expressions(s) if self_attn else (None, None)
        named = self.named_operands(layer) if self_attn else {}
        kv_heads = {"kv_heads": att.kv_heads} if att.group_size > 1 else {}
        if score is not None:
            scores = self.b.emit(Op.SCORE_MOD, scores, *self.operands(score, named),
                                 origin="attention.score", score=score, **kv_heads)
        scores = self.mask(s, scores, cross=not self_attn, explicit=mask, named=named)
        nz = att.normalizer
        if self_attn and nz.kind == "softmax" and nz.sinks is not None:
            with self.at("attention.normalizer"):
                probs = self.b.emit(Op.NORMALIZE, scores, named[nz.sinks],
                                    normalizer=Call("softmax", (), (("sinks", nz.sinks),)))
        elif self_attn and nz.kind == "sigmoid":
            with self.at("attention.normalizer"):
                probs = self.b.emit(Op.NORMALIZE, scores,
                                    normalizer=Call("sigmoid", (), (("bias", nz.bias),)))
        else:
            probs = self.b.emit(Op.SOFTMAX, scores, origin="attention")
        with self.at("attention"):
            out = self.b.emit(Op.WEIGHTED_SUM, probs, v)                         # (B, H, T, D)
            out = self.b.emit(Op.MERGE_HEADS, out)                                  # (B, T, H·D)
        if gate is not None:
            out = self.b.emit(Op.MUL, out, gate, origin="attention.output_gate")
        with self.at("attention.heads"):
            return self.linear(out, f"{base}.o", self.d, att.bias.o, "attention.bias.o")

    @staticmethod
    def alibi_slopes(s: Spec) -> Call | None:
        """The ALiBi slopes a layer running `s` adds (None: it adds none)."""
        if s.position.kind != "alibi" or s.mixer.kind != "attention":
            return None
        slopes = Call("alibi_slopes", (), (("heads", s.attention.heads),))
        if s.position.alibi_scaled:  # (q·k + bias)·scale = q·k·scale + bias·scale
            slopes = Call("scale", (slopes,), (("by", s.attention_scale),))
        return slopes

    def named_operands(self, layer: int) -> dict[str, int]:
        """The nodes of the names layer `layer`'s expressions read: its per-head parameters (a
        checkpoint tensor, or the spec's values) and the per-token inputs."""
        s, out = self.specs[layer], dict(self.token_inputs)
        with self.at("attention.params"):
            for p in s.attention.params or ():
                n = head_count(s, p.name)
                if p.weight is not None:
                    out[p.name] = self.param(p.weight.replace("{layer}", str(layer)), n,
                                             dtype="f32", shared=True)
                else:
                    values = p.values if len(p.values) == n else p.values * n
                    out[p.name] = self.param(f"layers.{layer}.attn.{p.name}", n, dtype="f32",
                                             expr=Call("values", (), (("values", values),)))
        return out

    @staticmethod
    def operands(e: object, named: Mapping[str, int]) -> list[int]:
        """The nodes of the names `e` reads, in the order of an op's modifier operands (by
        name: per-head parameters, per-token inputs)."""
        return [named[n] for n in sorted({x.args[0] for x in leaves(e)} & set(named))]

    def mask(self, s: Spec, scores: int, *, cross: bool, explicit: object = None,
             named: Mapping[str, int] | None = None) -> int:
        if cross:
            return self.b.emit(Op.MASK, scores, self.enc_mask, padding=True, origin="family")
        if explicit is not None:
            kv_heads = {"kv_heads": s.attention.kv_heads} if s.attention.group_size > 1 else {}
            pad = [self.padding] if self.padding is not None else []
            return self.b.emit(Op.MASK, scores, *pad, *self.operands(explicit, named or {}),
                               origin="attention.mask", padding=bool(pad), mask=explicit,
                               **kv_heads)
        window = s.attention.window
        global_tokens = s.attention.global_tokens if window else None
        origin = "attention.global_tokens" if global_tokens else \
            "attention.window" if window else "attention.mask"
        prefix = self.prefix_len is not None and s.attention.mask == "prefix"
        extra = [i for i in (self.padding, self.prefix_len if prefix else None) if i is not None]
        return self.b.emit(Op.MASK, scores, *extra, origin=origin, causal=self.causal,
                           padding=self.padding is not None, prefix=prefix,
                           window=window, global_tokens=global_tokens)

    def ffn(self, x: int, layer: int) -> int:
        f = self.specs[layer].ffn
        base = f"layers.{layer}.ffn"
        if f.kind == "moe":
            return self.moe(f, x, base)
        return self.dense_ffn(f, x, base, f.d_ff, f.bias)

    def dense_ffn(self, f: FFN, x: int, base: str, d_ff: int, bias: bool) -> int:
        """FFN `f` (of kind moe.expert for an MoE model's shared expert)."""
        with self.at("ffn.kind"):
            if f.gated:
                gate = self.linear(x, f"{base}.gate", d_ff, bias, "ffn.bias")
                up = self.linear(x, f"{base}.up", d_ff, bias, "ffn.bias")
                h = self.b.emit(Op.MUL, self.b.emit(Op.ACT, gate, fn=f.gate_activation), up)
            else:
                h = self.linear(x, f"{base}.up", d_ff, bias, "ffn.bias")
                h = self.b.emit(Op.ACT, h, fn=f.activation, origin="ffn.activation")
            return self.linear(h, f"{base}.down", self.d, bias, "ffn.bias")

    def moe(self, f: FFN, x: int, base: str) -> int:
        moe = f.moe
        assert moe is not None
        with self.at("ffn.moe"):
            router = self.param(f"{base}.router.weight", moe.experts, self.d)
            logits = self.b.emit(Op.MATMUL, x, router)
        if moe.router_bias:
            with self.at("ffn.moe.router_bias"):
                logits = self.b.emit(Op.ADD, logits, self.param(f"{base}.router.bias",
                                                                moe.experts))
        # DeepSeek's routing: a bias for the choice only (kept in f32, as its checkpoints do:
        # it shifts weights in (0, 1) by small amounts), groups, a scale on the weights
        choice = []
        if moe.choice_bias:
            with self.at("ffn.moe.choice_bias"):
                choice = [self.param(f"{base}.router.choice_bias", moe.experts, dtype="f32")]
        grouped = dict(groups=moe.groups, top_groups=moe.top_groups,
                       group_score=moe.group_score) if moe.groups > 1 else {}
        with self.at("ffn.moe.router" if moe.router != "softmax" else "ffn.moe"):
            gates = self.b.emit(Op.ROUTER, logits, *choice, top_k=moe.top_k,
                                normalize=moe.normalize_top_k, fn=moe.router,
                                choice_bias=moe.choice_bias, scale=float(moe.scale), **grouped)

        def stage(x: int, name: str, rows: int, cols: int, stage: str) -> int:
            w = self.param(f"{base}.experts.{name}.weight", moe.experts, rows, cols)
            bias = [self.param(f"{base}.experts.{name}.bias", moe.experts, rows)] \
                if moe.bias else []
            return self.b.emit(Op.MOE_LINEAR, x, gates, w, *bias, stage=stage, top_k=moe.top_k,
                               bias=moe.bias, gate_input=moe.score_on == "input")

        # one row per routed (token, slot), as the dense FFN but over the chosen experts
        with self.at("ffn.moe"):
            first = stage(x, "gate" if f.gated else "up", f.d_ff, self.d, "up")  # (B, T, k, F)
            if moe.plain_experts:
                h = self.b.emit(Op.ACT, first, fn=f.gate_activation)
            else:
                with self.at("ffn.moe.clamp" if moe.clamp else "ffn.moe.swish_beta"):
                    h = self.b.emit(Op.POINTWISE, first, expr=expert_gate(moe, f.gate_activation))
            if f.gated:
                up = stage(x, "up", f.d_ff, self.d, "up")
                if moe.clamp is not None or moe.up_offset:
                    with self.at("ffn.moe.clamp" if moe.clamp else "ffn.moe.up_offset"):
                        up = self.b.emit(Op.POINTWISE, up, expr=expert_up(moe))
                h = self.b.emit(Op.MUL, h, up)
            y = stage(h, "down", self.d, f.d_ff, "down")               # (B, T, d)
        if moe.shared_expert_d_ff:
            with self.at("ffn.moe.shared_expert_d_ff"):
                shared = self.dense_ffn(f, x, f"{base}.shared", moe.shared_expert_d_ff, False)
            if moe.shared_expert_gate:
                with self.at("ffn.moe.shared_expert_gate"):   # σ(x·w) [B, T, 1]
                    g = self.b.emit(Op.MATMUL, x, self.param(f"{base}.shared_gate.weight", 1,
                                                             self.d))
                    shared = self.b.emit(Op.MUL, shared, self.b.emit(Op.ACT, g, fn="sigmoid"))
            with self.at("ffn.moe.shared_expert_d_ff"):
                y = self.b.emit(Op.ADD, y, shared)
        return y

    def mamba(self, h: int, layer: int) -> int:
        """Mamba (Gu & Dao 2023), as the reference implementation lays it out::

            x, z   = split(in_proj(h))                      # [B, T, 2·d_inner]
            x      = silu(conv1d(x) + conv_bias)            # causal depthwise, width d_conv
            Δ, B, C = split(x_proj(x))                      # [dt_rank | d_state | d_state]
            Δ      = softplus(dt_proj(Δ) + dt_bias)         # (Jamba: RMSNorm on Δ, B, C first)
            y      = selective_scan(x, Δ, A = −exp(A_log), B, C) + D·x
            out    = out_proj(y · silu(z))
        """
        s = self.specs[layer]
        m = s.mixer.mamba
        assert m is not None and m.dt_rank is not None
        inner, n, rank = s.mamba_inner, m.d_state, m.dt_rank
        base = f"layers.{layer}.ssm"
        with self.at("mixer.mamba.expand"):
            xz = self.linear(h, f"{base}.in", 2 * inner, m.bias, "mixer.mamba.bias")
            x = self.b.emit(Op.SLICE, xz, start=0, stop=inner)
            z = self.b.emit(Op.SLICE, xz, start=inner, stop=2 * inner)
        with self.at("mixer.mamba.d_conv"):
            conv = self.param(f"{base}.conv.weight", inner, m.d_conv)
            x = self.b.emit(Op.CAUSAL_CONV, x, conv, layer=layer)
        if m.conv_bias:
            with self.at("mixer.mamba.conv_bias"):
                x = self.b.emit(Op.ADD, x, self.param(f"{base}.conv.bias", inner))
        x = self.b.emit(Op.ACT, x, fn="silu", origin="mixer.mamba.d_conv")
        with self.at("mixer.mamba.dt_rank"):
            proj = self.b.emit(Op.MATMUL, x, self.param(f"{base}.x.weight", rank + 2 * n, inner))
            dt = self.b.emit(Op.SLICE, proj, start=0, stop=rank)
        with self.at("mixer.mamba.d_state"):
            bm = self.b.emit(Op.SLICE, proj, start=rank, stop=rank + n)
            cm = self.b.emit(Op.SLICE, proj, start=rank + n, stop=rank + 2 * n)
        if m.inner_norms:
            with self.at("mixer.mamba.inner_norms"):
                dt, bm, cm = (
                    self.b.emit(Op.NORM, v, self.param(f"{base}.{name}_norm.weight", width),
                                kind="rms", eps=s.norm.eps)
                    for v, name, width in ((dt, "dt", rank), (bm, "b", n), (cm, "c", n)))
        with self.at("mixer.mamba.dt_rank"):
            dt = self.linear(dt, f"{base}.dt", inner, True, "mixer.mamba.dt_rank")
            dt = self.b.emit(Op.ACT, dt, fn="softplus")
        with self.at("mixer.mamba.d_state"):
            self.param(f"{base}.A_log", inner, n)   # the checkpoint's; A = −exp(A_log) at load time
            a = self.param(f"{base}.A", inner, n, dtype="f32",
                           expr=Call("neg_exp", (leaf(self.prefix + f"{base}.A_log"),)))
            y = self.b.emit(Op.SSM_SCAN, x, dt, a, bm, cm, layer=layer)
            y = self.b.emit(Op.ADD, y, self.b.emit(Op.MUL, x, self.param(f"{base}.D", inner)))
        with self.at("mixer.mamba.expand"):
            y = self.b.emit(Op.MUL, y, self.b.emit(Op.ACT, z, fn="silu"))
            return self.linear(y, f"{base}.out", self.d, m.bias, "mixer.mamba.bias")

    def linear_attention(self, h: int, layer: int) -> int:
        """Linear attention (Katharopoulos et al. 2020), with φ = elu + 1 on q and k."""
        base, s = f"layers.{layer}.attn", self.specs[layer]
        q, k, v = self.qkv_heads(s, h, h, base)     # (B, H, T, D), (B, Hkv, T, D) twice
        with self.at("mixer.pattern" if self.s.mixer.pattern is not None else "mixer.kind"):
            q, k = (self.b.emit(Op.ACT, t, fn="elu_plus_one") for t in (q, k))
            out = self.b.emit(Op.LINEAR_ATTENTION, q, k, v, layer=layer)   # (B, T, H·D)
        with self.at("attention.heads"):
            return self.linear(out, f"{base}.o", self.d, s.attention.bias.o, "attention.bias.o")

    def deltanet(self, h: int, layer: int) -> int:
        """Gated DeltaNet (Yang et al. 2024), as Qwen3-Next lays it out::

            q, k, v, z = split(qkvz(h))                    # [H_k·Dk | H_k·Dk | H·Dv | H·Dv]
            b, a       = split(ba(h))                      # [H | H]
            q, k, v    = silu(conv1d(q, k, v))             # causal depthwise, width d_conv
            g, β       = −exp(A_log)·softplus(a + dt_bias), σ(b)
            o          = delta_rule(l2(q), l2(k), v, g, β)  # per value head, f32 state
            out        = out_proj(rmsnorm(o per head)·silu(z))
        """
        s = self.specs[layer]
        dn = s.mixer.deltanet
        assert dn is not None
        h_v, kd, vd = dn.value_heads, dn.key_heads * dn.key_dim, dn.value_heads * dn.value_dim
        base = f"layers.{layer}.delta"

        def cols(t: int, start: int, width: int) -> int:
            return self.b.emit(Op.SLICE, t, start=start, stop=start + width)
        with self.at("mixer.deltanet"):
            qkvz = self.linear(h, f"{base}.qkvz", 2 * kd + 2 * vd, False, "mixer.deltanet")
            ba = self.linear(h, f"{base}.ba", 2 * h_v, False, "mixer.deltanet")
        with self.at("mixer.deltanet.d_conv"):
            conv = self.param(f"{base}.conv.weight", 2 * kd + vd, dn.d_conv)
            qkv = self.b.emit(Op.CAUSAL_CONV, cols(qkvz, 0, 2 * kd + vd), conv, act="silu",
                              layer=layer)
        with self.at("mixer.deltanet"):
            q, k, v = cols(qkv, 0, kd), cols(qkv, kd, kd), cols(qkv, 2 * kd, vd)
            z = cols(qkvz, 2 * kd + vd, vd)
            beta = self.b.emit(Op.ACT, cols(ba, 0, h_v), fn="sigmoid")
            a = self.b.emit(Op.ADD, cols(ba, h_v, h_v), self.param(f"{base}.dt_bias", h_v))
            self.param(f"{base}.A_log", h_v)   # the checkpoint's; −exp(A_log) at load time, in
            # the activations' dtype: the IR has no cast to take softplus(a + dt_bias) to f32
            decay = self.param(f"{base}.A", h_v,
                               expr=Call("neg_exp", (leaf(self.prefix + f"{base}.A_log"),)))
            g = self.b.emit(Op.MUL, self.b.emit(Op.ACT, a, fn="softplus"), decay)
        with self.at("mixer.deltanet.chunk" if dn.algorithm == "chunked" else
                     "mixer.deltanet.algorithm"):
            o = self.b.emit(Op.DELTA_RULE, q, k, v, g, beta, layer=layer, heads=h_v,
                            key_heads=dn.key_heads, algorithm=dn.algorithm, chunk=dn.chunk)
        with self.at("mixer.deltanet"):   # RMSNorm per value head (gain w, not 1 + w), gated
            # one span of Dv columns per head, with the head's gain tiled over the heads: the
            # heads stay merged [B, T, H·Dv], as the out-projection reads them
            self.param(f"{base}.norm.weight", dn.value_dim)   # the checkpoint's
            gain = self.param(f"{base}.norm.weight.tiled", vd, expr=Call(
                "tile", (leaf(self.prefix + f"{base}.norm.weight"),), (("times", h_v),)))
            o = self.b.emit(Op.NORM, o, gain, kind="rms", eps=s.norm.eps,
                            spans=(dn.value_dim,) * h_v)
            o = self.b.emit(Op.MUL, o, self.b.emit(Op.ACT, z, fn="silu"))
            return self.linear(o, f"{base}.out", self.d, False, "mixer.deltanet")

    def mix(self, h: int, layer: int) -> int:
        mixer = self.specs[layer].mixer.kind
        if mixer == "gated_deltanet":
            return self.deltanet(h, layer)
        if mixer == "mamba":
            return self.mamba(h, layer)
        if mixer == "linear_attention":
            return self.linear_attention(h, layer)
        return self.attention(h, layer, "attn")

    def block(self, x: int, layer: int) -> int:
        """One layer: its sequence mixer, a decoder's cross-attention over the encoder states,
        and the FFN, each with its residual add and its norms where the layer places them."""
        s, pre = self.specs[layer], f"layers.{layer}"
        mix_norm = "ssm_norm" if s.mixer.kind == "mamba" else "attn_norm"

        def norm(x: int, name: str, origin: str = "norm.kind") -> int:
            return self.norm(x, f"{pre}.{name}", origin, s.norm)

        def scaled(out: int) -> int:   # a sublayer's output as the residual add takes it
            m = s.block.residual_scale
            return out if m is None else self.pointwise(out, "block.residual_scale", "scale", by=m)
        if s.block.parallel:   # x + mixer(norm(x)) + ffn(norm(x))
            n1 = norm(x, mix_norm)
            n2 = n1 if s.block.shared_norm else norm(x, "ffn_norm", "block.shared_norm")
            a, f = scaled(self.mix(n1, layer)), scaled(self.ffn(n2, layer))
            with self.at("block.parallel"):
                return self.b.emit(Op.ADD, self.b.emit(Op.ADD, x, a), f)
        sublayers: list[tuple[str, Callable[[int], int]]] = [
            (mix_norm, lambda h: self.mix(h, layer))]
        if self.cross:
            sublayers.append(("cross_norm", lambda h: self.attention(
                h, layer, "cross", kv_source=self.enc)))
        if s.ffn.kind != "none":
            sublayers.append(("ffn_norm", lambda h: self.ffn(h, layer)))
        for name, fn in sublayers:
            if s.norm.placement == "post":
                x = norm(self.b.emit(Op.ADD, x, scaled(fn(x)), origin="norm.placement"), name)
                continue
            out = fn(x if s.norm.placement == "output" else norm(x, name))
            if s.norm.placement in ("sandwich", "output"):
                out = norm(out, name.replace("_norm", "_post_norm"), "norm.placement")
            x = self.b.emit(Op.ADD, x, scaled(out), origin="norm.placement")
        return x

    def build(self) -> Graph:
        s = self.s
        self.inputs()
        x = self.embed()
        for layer in range(self.layers):
            x = self.block(x, layer)
        if s.output.final_norm:
            x = self.norm(x, "final_norm", "output.final_norm")
        if not self.causal:
            self.b.output("hidden", x, origin="family")
            return self.b.build()
        if s.output.scale is not None:
            x = self.pointwise(x, "output.scale", "scale", by=s.output.scale)
        width = s.embedding.project_dim or self.d
        if s.embedding.project_dim is not None:
            with self.at("embedding.project_dim"):
                project = self.param("head.project_out.weight", width, self.d, shared=True)
                x = self.b.emit(Op.MATMUL, x, project)
        with self.at("embedding.tied"):
            head = self.param("embed.weight" if s.embedding.tied else "head.weight",
                              s.vocab_size, width, shared=True)
            logits = self.b.emit(Op.MATMUL, x, head)
        if s.output.bias:
            with self.at("output.bias"):
                bias = self.param("head.bias", s.vocab_size, shared=True)
                logits = self.b.emit(Op.ADD, logits, bias)
        if s.output.logit_scale is not None:
            logits = self.pointwise(logits, "output.logit_scale", "scale", by=s.output.logit_scale)
        if s.output.softcap is not None:
            logits = self.pointwise(logits, "output.softcap", "softcap", cap=s.output.softcap)
        self.b.output("logits", logits, origin="family")
        return self.b.build()
