"""Lowering: Spec → Program, faithful and unfused.

Nothing clever happens here: separate Q/K/V projections, explicit bias adds, decomposed attention
(scores, scale, soft-cap, position bias, mask, softmax, value sum), ``repeat_kv`` for GQA, norms
and activations as their own nodes. The passes earn every speed-up, and each can be seen.

Every node records the spec field that made it (its ``origin``), and parameters get HF-like names
(``layers.3.attn.q.weight``). A decoder graph reads and writes the KV cache at offset P, so one
graph serves prefill (P = 0, T = prompt) and decode (T = 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import archc.ir.expr as E
from archc.ir.attrs import Call
from archc.ir.graph import Graph, GraphBuilder, Program
from archc.ir.ops import Op
from archc.ir.ops.steps import step
from archc.ir.paramexpr import leaf, yarn_attention_factor
from archc.ir.shapes import B, S, T, shape
from archc.ir.verify import verify
from archc.spec.schema import Spec


def lower(spec: Spec, dtype: str = "f32") -> Program:
    """The unfused program of `spec`, with activations and weights in `dtype`."""
    if spec.family == "decoder":
        graphs = (_Stack(spec, dtype, "decoder", "", spec.layers, causal=True).build(),)
    elif spec.family == "encoder":
        graphs = (_Stack(spec, dtype, "encoder", "", spec.layers, causal=False).build(),)
    else:
        assert spec.decoder_layers is not None
        graphs = (
            _Stack(spec, dtype, "encoder", "encoder.", spec.layers, causal=False).build(),
            _Stack(spec, dtype, "decoder", "decoder.", spec.decoder_layers, causal=True,
                   cross=True).build(),
        )
    program = Program(spec.name, graphs)
    verify(program)
    return program


class _Stack:
    """Builds one graph: embeddings, `layers` blocks, final norm, and head or hidden output."""

    def __init__(self, spec: Spec, dtype: str, name: str, prefix: str, layers: int, *,
                 causal: bool, cross: bool = False) -> None:
        self.s = spec
        self.dt = dtype
        self.prefix = prefix
        self.layers = layers
        self.causal = causal          # a decoder stack: causal self-attention over a KV cache
        self.cross = cross            # reads encoder states through cross-attention
        self.b = GraphBuilder(name)
        self.d = spec.d_model

    # ---- helpers -----------------------------------------------------------------------------
    @contextmanager
    def at(self, origin: str) -> Iterator[None]:
        """Nodes emitted inside come from spec field `origin`."""
        saved = self.b.origin
        self.b.origin = origin
        try:
            yield
        finally:
            self.b.origin = saved

    def param(self, name: str, *dims: int, shared: bool = False, dtype: str | None = None,
              expr: Call | None = None) -> int:
        full = name if shared else self.prefix + name
        return self.b.param(full, shape(*dims), dtype or self.dt, expr=expr)

    def emit(self, op: Op, *inputs: int, **attrs: object) -> int:
        return self.b.emit(op, *inputs, **attrs)

    def scale(self, x: int, factor: float) -> int:
        return self.emit(Op.POINTWISE, x, expr=E.call("scale", E.x(0), by=factor))

    def norm(self, x: int, name: str, origin: str = "norm.kind") -> int:
        """The spec's norm over the last dim of x, with gain (and LayerNorm bias) params."""
        n = self.s.norm
        width = int(self.b.shape(x)[-1])
        with self.at(origin):
            w = self.param(f"{name}.weight", width)
            if n.kind == "rmsnorm":
                return self.emit(Op.NORM, x, w, kind="rms", eps=n.eps, unit_offset=n.unit_offset)
            if not n.bias:
                return self.emit(Op.NORM, x, w, kind="layer", eps=n.eps)
            return self.emit(Op.NORM, x, w, self.param(f"{name}.bias", width), kind="layer",
                             eps=n.eps, epilogue=(step("bias"),))

    def linear(self, x: int, name: str, n_out: int, bias: bool, bias_origin: str) -> int:
        n_in = int(self.b.shape(x)[-1])
        y = self.emit(Op.MATMUL, x, self.param(f"{name}.weight", n_out, n_in))
        if bias:
            with self.at(bias_origin):
                y = self.emit(Op.ADD, y, self.param(f"{name}.bias", n_out))
        return y

    # ---- inputs and embeddings -----------------------------------------------------------------
    def inputs(self) -> None:
        s, b = self.s, self.b
        with self.at("family"):
            self.tokens = b.input("tokens", shape(B, T), "i64")
        needs_positions = s.position.kind in ("learned", "sinusoidal", "rope")
        self.positions = None
        if needs_positions:
            with self.at("position.kind"):
                self.positions = b.input("positions", shape(T), "i64")
        self.padding = None
        if not self.causal:
            with self.at("family"):
                self.padding = b.input("attention_mask", shape(B, T), "i64")
        self.prefix_len = None
        if self.causal and s.attention.mask == "prefix":
            with self.at("attention.mask"):
                self.prefix_len = b.input("prefix_len", (), "i64")
        self.token_types = None
        if s.embedding.token_types and not self.causal:
            with self.at("embedding.token_types"):
                self.token_types = b.input("token_types", shape(B, T), "i64")
        if self.cross:
            with self.at("family"):
                self.enc = b.input("encoder_hidden", shape(B, S, self.d), self.dt)
                self.enc_mask = b.input("encoder_mask", shape(B, S), "i64")

    def embed(self) -> int:
        s = self.s
        width = s.embedding.project_dim or self.d
        with self.at("vocab_size"):
            table = self.param("embed.weight", s.vocab_size, width, shared=True)
            x = self.emit(Op.EMBEDDING, table, self.tokens)
        if s.embedding.scale is not None:
            with self.at("embedding.scale"):
                x = self.scale(x, s.embedding.scale)
        if s.embedding.project_dim is not None:
            with self.at("embedding.project_dim"):
                x = self.emit(Op.MATMUL, x, self.param("embed.project_in.weight", self.d, width,
                                                       shared=True))
        pos = s.position
        if pos.kind in ("learned", "sinusoidal"):
            with self.at("position.kind"):
                if pos.kind == "learned":
                    rows = s.max_seq_len + pos.offset
                    table = self.param("pos_embed.weight", rows, self.d)
                    if pos.offset:
                        with self.at("position.offset"):
                            table = self.param("pos_embed.rows", s.max_seq_len, self.d,
                                               expr=Call("rows", (leaf(self.prefix +
                                                                       "pos_embed.weight"),),
                                                         (("start", pos.offset),)))
                else:
                    table = self.param("pos_embed.sinusoidal", s.max_seq_len, self.d,
                                       expr=Call("sinusoidal", (), (("rows", s.max_seq_len),
                                                                    ("dim", self.d))))
                x = self.emit(Op.ADD, x, self.emit(Op.EMBEDDING, table, self.positions))
        if self.token_types is not None:
            with self.at("embedding.token_types"):
                table = self.param("type_embed.weight", s.embedding.token_types, self.d)
                x = self.emit(Op.ADD, x, self.emit(Op.EMBEDDING, table, self.token_types))
        if s.embedding.norm:
            x = self.norm(x, "embed_norm", "embedding.norm")
        return x

    # ---- attention -----------------------------------------------------------------------------
    def rope_params(self) -> tuple[int, dict[str, object]]:
        """The inverse-frequency buffer, and the rope attrs that depend on the scaling: the
        cos/sin scale (YaRN's attention factor) and dynamic NTK's rescaling, which needs the
        sequence length and so happens in the rope op, over the default frequencies."""
        pos = self.s.position
        kw: list[tuple[str, object]] = [("dim", self.s.rotary_dim), ("theta", pos.theta)]
        mscale = 1.0
        attrs: dict[str, object] = {}
        if pos.scaling is not None and pos.scaling.kind == "dynamic":
            sc = pos.scaling
            attrs["dynamic"] = Call("ntk", (), (("factor", sc.factor),
                                                ("original_max_seq_len", sc.original_max_seq_len)))
        elif pos.scaling is not None:
            sc = pos.scaling
            kw += [("kind", sc.kind), ("factor", sc.factor)]
            if sc.kind in ("yarn", "llama3"):
                kw.append(("original_max_seq_len", sc.original_max_seq_len))
            if sc.kind == "llama3":
                kw += [("low_freq_factor", sc.low_freq_factor),
                       ("high_freq_factor", sc.high_freq_factor)]
            if sc.kind == "yarn":
                kw += [("beta_fast", sc.beta_fast), ("beta_slow", sc.beta_slow)]
                mscale = yarn_attention_factor(sc.factor, sc.attention_factor)
        with self.at("position.scaling" if pos.scaling else "position.theta"):
            freq = self.param("rope.inv_freq", self.s.rotary_dim // 2, dtype="f32", shared=True,
                              expr=Call("rope_inv_freq", (), tuple(kw)))
        return freq, {"mscale": mscale, **attrs}

    def qkv_heads(self, x: int, src: int, base: str) -> tuple[int, int, int]:
        """The query projection of x and the key and value projections of src, split into
        heads: (B, H, T, D) and twice (B, Hkv, T|S, D)."""
        att = self.s.attention
        heads, kv_heads, hd, bias = att.heads, att.kv_heads, att.head_dim, att.bias
        with self.at("attention.heads"):
            q = self.linear(x, f"{base}.q", heads * hd, bias.q, "attention.bias.q")
        with self.at("attention.kv_heads"):
            k = self.linear(src, f"{base}.k", kv_heads * hd, bias.k, "attention.bias.k")
            v = self.linear(src, f"{base}.v", kv_heads * hd, bias.v, "attention.bias.v")
        with self.at("attention.heads"):
            q = self.emit(Op.SPLIT_HEADS, q, heads=heads)
        with self.at("attention.kv_heads"):
            k = self.emit(Op.SPLIT_HEADS, k, heads=kv_heads)
            v = self.emit(Op.SPLIT_HEADS, v, heads=kv_heads)
        return q, k, v

    def attention(self, x: int, layer: int, name: str, *, local: bool,
                  kv_source: int | None = None) -> int:
        """Multi-head attention of x over itself (through the KV cache in a decoder) or, for
        cross-attention, over `kv_source` (the encoder states)."""
        s, att = self.s, self.s.attention
        cross = kv_source is not None
        src = kv_source if cross else x
        heads, bias = att.heads, att.bias
        base = f"layers.{layer}.{name}"
        q, k, v = self.qkv_heads(x, src, base)   # (B, H, T, D), (B, Hkv, T|S, D) twice
        if att.qk_norm:
            q = self.norm(q, f"{base}.q_norm", "attention.qk_norm")
            k = self.norm(k, f"{base}.k_norm", "attention.qk_norm")
        if s.position.kind == "rope" and not cross:
            with self.at("position.kind"):
                freq, scaling = self.rope_params()
                rope = dict(rotary_dim=s.rotary_dim, interleaved=s.position.interleaved,
                            **scaling)
                q = self.emit(Op.ROPE, q, self.positions, freq, **rope)
                k = self.emit(Op.ROPE, k, self.positions, freq, **rope)
        if self.causal and not cross:
            with self.at("family"):
                k = self.emit(Op.KV_CACHE, k, layer=layer, kind="k")  # (B, Hkv, P+T, D)
                v = self.emit(Op.KV_CACHE, v, layer=layer, kind="v")
        if att.group_size > 1:
            with self.at("attention.kv_heads"):
                k = self.emit(Op.REPEAT_KV, k, groups=att.group_size)  # (B, H, L, D)
                v = self.emit(Op.REPEAT_KV, v, groups=att.group_size)
        with self.at("attention"):
            scores = self.emit(Op.SCORES, q, k)                        # (B, H, T, L)
        if s.attention_scale != 1.0:
            with self.at("attention.scale" if att.scale is not None else "attention.head_dim"):
                scores = self.scale(scores, s.attention_scale)
        if att.softcap is not None:
            with self.at("attention.softcap"):
                scores = self.emit(Op.POINTWISE, scores,
                                   expr=E.call("softcap", E.x(0), cap=att.softcap))
        if s.position.kind == "alibi" and not cross:
            with self.at("position.kind"):
                slopes_expr = Call("alibi_slopes", (), (("heads", heads),))
                if s.position.alibi_scaled:  # (q·k + bias)·scale = q·k·scale + bias·scale
                    slopes_expr = Call("scale", (slopes_expr,), (("by", s.attention_scale),))
                slopes = self.param("alibi.slopes", heads, dtype="f32", shared=True,
                                    expr=slopes_expr)
                scores = self.emit(Op.ALIBI, scores, slopes)
        if s.position.kind == "relative" and not cross:
            with self.at("position.kind"):
                table = self.param("layers.0.attn.rel_bias.weight", s.position.buckets, heads)
                scores = self.emit(Op.REL_BIAS, scores, table, bidirectional=not self.causal,
                                   max_distance=s.position.max_distance)
        scores = self.mask(scores, cross=cross, local=local)
        with self.at("attention"):
            probs = self.emit(Op.SOFTMAX, scores)
            out = self.emit(Op.WEIGHTED_SUM, probs, v)                 # (B, H, T, D)
            out = self.emit(Op.MERGE_HEADS, out)                       # (B, T, H·D)
        with self.at("attention.heads"):
            return self.linear(out, f"{base}.o", self.d, bias.o, "attention.bias.o")

    def mask(self, scores: int, *, cross: bool, local: bool) -> int:
        att = self.s.attention
        extra: list[int] = []
        if cross:
            extra.append(self.enc_mask)
            with self.at("family"):
                return self.emit(Op.MASK, scores, *extra, causal=False, padding=True,
                                 prefix=False)
        if self.padding is not None:
            extra.append(self.padding)
        if self.prefix_len is not None:
            extra.append(self.prefix_len)
        window = att.window if local else None
        global_tokens = att.global_tokens if window else None
        origin = "attention.global_tokens" if global_tokens else \
            "attention.window" if window else "attention.mask"
        with self.at(origin):
            return self.emit(Op.MASK, scores, *extra, causal=self.causal,
                             padding=self.padding is not None, prefix=self.prefix_len is not None,
                             window=window, global_tokens=global_tokens)

    # ---- feed-forward --------------------------------------------------------------------------
    def ffn(self, x: int, layer: int) -> int:
        f = self.s.ffn
        base = f"layers.{layer}.ffn"
        if f.kind == "moe" and self.s.layer_ffns(self.layers)[layer] == "dense":
            assert f.moe is not None
            with self.at("ffn.pattern"):
                return self.dense_ffn(x, base, f.moe.expert, f.d_ff, False)
        if f.kind == "moe":
            return self.moe(x, base)
        return self.dense_ffn(x, base, f.kind, f.d_ff, f.bias)

    def dense_ffn(self, x: int, base: str, kind: str, d_ff: int, bias: bool) -> int:
        f = self.s.ffn
        with self.at("ffn.kind"):
            if kind in ("glu", "reglu", "geglu", "swiglu"):
                gate = self.linear(x, f"{base}.gate", d_ff, bias, "ffn.bias")
                up = self.linear(x, f"{base}.up", d_ff, bias, "ffn.bias")
                h = self.emit(Op.MUL, self.emit(Op.ACT, gate, fn=f.gate_activation), up)
            else:
                h = self.linear(x, f"{base}.up", d_ff, bias, "ffn.bias")
                with self.at("ffn.activation"):
                    h = self.emit(Op.ACT, h, fn=f.activation)
            return self.linear(h, f"{base}.down", self.d, bias, "ffn.bias")

    def moe(self, x: int, base: str) -> int:
        f = self.s.ffn
        moe = f.moe
        assert moe is not None
        d, d_ff, n = self.d, f.d_ff, moe.experts
        with self.at("ffn.moe"):
            k = moe.top_k
            logits = self.emit(Op.MATMUL, x, self.param(f"{base}.router.weight", n, d))
            gates = self.emit(Op.ROUTER, logits, top_k=k, normalize=moe.normalize_top_k)

            def stage(x: int, name: str, rows: int, cols: int, stage: str) -> int:
                w = self.param(f"{base}.experts.{name}.weight", n, rows, cols)
                return self.emit(Op.MOE_LINEAR, x, gates, w, stage=stage, top_k=k)

            # one row per routed (token, slot), as the dense FFN but over the chosen experts
            h = self.emit(Op.ACT, stage(x, "gate" if f.gated else "up", d_ff, d, "up"),
                          fn=f.gate_activation)                       # (B, T, k, F)
            if f.gated:
                h = self.emit(Op.MUL, h, stage(x, "up", d_ff, d, "up"))
            y = stage(h, "down", d, d_ff, "down")                      # (B, T, d)
        if moe.shared_expert_d_ff:
            with self.at("ffn.moe.shared_expert_d_ff"):
                shared = self.dense_ffn(x, f"{base}.shared", moe.expert, moe.shared_expert_d_ff,
                                        False)
                y = self.emit(Op.ADD, y, shared)
        return y

    # ---- recurrent mixers -----------------------------------------------------------------
    def mamba(self, h: int, layer: int) -> int:
        """Mamba (Gu & Dao 2023), as the reference implementation lays it out::

            x, z   = split(in_proj(h))                      # [B, T, 2·d_inner]
            x      = silu(conv1d(x) + conv_bias)            # causal depthwise, width d_conv
            Δ, B, C = split(x_proj(x))                      # [dt_rank | d_state | d_state]
            Δ      = softplus(dt_proj(Δ) + dt_bias)         # (Jamba: RMSNorm on Δ, B, C first)
            y      = selective_scan(x, Δ, A = −exp(A_log), B, C) + D·x
            out    = out_proj(y · silu(z))

        The recurrences carry their state between calls themselves, so one graph serves
        prefill and decode, as the KV cache does for attention."""
        s = self.s
        m = s.mixer.mamba
        assert m is not None and m.dt_rank is not None
        inner, n, rank = s.mamba_inner, m.d_state, m.dt_rank
        base = f"layers.{layer}.ssm"
        with self.at("mixer.mamba.expand"):
            xz = self.linear(h, f"{base}.in", 2 * inner, m.bias, "mixer.mamba.bias")
            x = self.emit(Op.SLICE, xz, start=0, stop=inner)
            z = self.emit(Op.SLICE, xz, start=inner, stop=2 * inner)
        with self.at("mixer.mamba.d_conv"):
            x = self.emit(Op.CAUSAL_CONV, x, self.param(f"{base}.conv.weight", inner, m.d_conv),
                        layer=layer)
        if m.conv_bias:
            with self.at("mixer.mamba.conv_bias"):
                x = self.emit(Op.ADD, x, self.param(f"{base}.conv.bias", inner))
        with self.at("mixer.mamba.d_conv"):
            x = self.emit(Op.ACT, x, fn="silu")
        with self.at("mixer.mamba.dt_rank"):
            proj = self.emit(Op.MATMUL, x, self.param(f"{base}.x.weight", rank + 2 * n, inner))
            dt = self.emit(Op.SLICE, proj, start=0, stop=rank)
        with self.at("mixer.mamba.d_state"):
            bm = self.emit(Op.SLICE, proj, start=rank, stop=rank + n)
            cm = self.emit(Op.SLICE, proj, start=rank + n, stop=rank + 2 * n)
        if m.inner_norms:
            with self.at("mixer.mamba.inner_norms"):
                dt, bm, cm = (self.emit(Op.NORM, v, self.param(f"{base}.{name}_norm.weight", width),
                                      kind="rms", eps=s.norm.eps)
                              for v, name, width in ((dt, "dt", rank), (bm, "b", n), (cm, "c", n)))
        with self.at("mixer.mamba.dt_rank"):
            dt = self.linear(dt, f"{base}.dt", inner, True, "mixer.mamba.dt_rank")
            dt = self.emit(Op.ACT, dt, fn="softplus")
        with self.at("mixer.mamba.d_state"):
            self.param(f"{base}.A_log", inner, n)   # the checkpoint's; A = −exp(A_log) at load time
            a = self.param(f"{base}.A", inner, n, dtype="f32",
                         expr=Call("neg_exp", (leaf(self.prefix + f"{base}.A_log"),)))
            y = self.emit(Op.SSM_SCAN, x, dt, a, bm, cm, layer=layer)
            y = self.emit(Op.ADD, y, self.emit(Op.MUL, x, self.param(f"{base}.D", inner)))
        with self.at("mixer.mamba.expand"):
            y = self.emit(Op.MUL, y, self.emit(Op.ACT, z, fn="silu"))
            return self.linear(y, f"{base}.out", self.d, m.bias, "mixer.mamba.bias")


    def linear_attention(self, h: int, layer: int) -> int:
        """Linear attention (Katharopoulos et al. 2020): q, k, v projections as attention's,
        φ = elu + 1 on q and k, the running sums (heads merged on the way out), the output
        projection."""
        base = f"layers.{layer}.attn"
        mixer = "mixer.pattern" if self.s.mixer.pattern is not None else "mixer.kind"
        q, k, v = self.qkv_heads(h, h, base)     # (B, H, T, D), (B, Hkv, T, D) twice
        with self.at(mixer):
            q = self.emit(Op.ACT, q, fn="elu_plus_one")
            k = self.emit(Op.ACT, k, fn="elu_plus_one")
            out = self.emit(Op.LINEAR_ATTENTION, q, k, v, layer=layer)   # (B, T, H·D)
        with self.at("attention.heads"):
            return self.linear(out, f"{base}.o", self.d, self.s.attention.bias.o,
                               "attention.bias.o")

    # ---- blocks --------------------------------------------------------------------------------
    def mix(self, h: int, layer: int, mixer: str, *, local: bool) -> int:
        """The layer's sequence mixer over h: softmax attention, linear attention or Mamba."""
        if mixer == "mamba":
            return self.mamba(h, layer)
        if mixer == "linear_attention":
            return self.linear_attention(h, layer)
        return self.attention(h, layer, "attn", local=local)

    def block(self, x: int, layer: int, local: bool, mixer: str = "attention") -> int:
        s = self.s
        placement = s.norm.placement
        pre = f"layers.{layer}"
        mix_norm = "ssm_norm" if mixer == "mamba" else "attn_norm"
        has_ffn = s.ffn.kind != "none"

        def attn(h: int) -> int:
            return self.mix(h, layer, mixer, local=local)

        def residual(a: int, b: int) -> int:
            with self.at("norm.placement"):
                return self.emit(Op.ADD, a, b)

        if s.block.parallel:
            n1 = self.norm(x, f"{pre}.{mix_norm}")
            n2 = n1 if s.block.shared_norm else self.norm(x, f"{pre}.ffn_norm",
                                                          "block.shared_norm")
            a, f = attn(n1), self.ffn(n2, layer)
            with self.at("block.parallel"):
                return self.emit(Op.ADD, self.emit(Op.ADD, x, a), f)
        if placement == "post":
            h = self.norm(residual(x, attn(x)), f"{pre}.{mix_norm}")
            if self.cross:
                h = self.norm(residual(h, self.attention(h, layer, "cross", local=False,
                                                         kv_source=self.enc)),
                              f"{pre}.cross_norm")
            if not has_ffn:
                return h
            return self.norm(residual(h, self.ffn(h, layer)), f"{pre}.ffn_norm")
        sandwich = placement == "sandwich"

        def sublayer(h: int, fn: object, norm: str) -> int:
            out = fn(self.norm(h, f"{pre}.{norm}"))  # type: ignore[operator]
            if sandwich:
                out = self.norm(out, f"{pre}.{norm.replace('_norm', '_post_norm')}",
                                "norm.placement")
            return residual(h, out)

        h = sublayer(x, attn, mix_norm)
        if self.cross:
            h = sublayer(h, lambda n: self.attention(n, layer, "cross", local=False,
                                                     kv_source=self.enc), "cross_norm")
        if not has_ffn:
            return h
        return sublayer(h, lambda n: self.ffn(n, layer), "ffn_norm")

    def build(self) -> Graph:
        s = self.s
        self.inputs()
        x = self.embed()
        mixers = s.layer_mixers(self.layers)
        for layer, kind in enumerate(s.layer_kinds(self.layers)):
            x = self.block(x, layer, kind == "local", mixers[layer])
        if s.output.final_norm:
            x = self.norm(x, "final_norm", "output.final_norm")
        if not self.causal:
            with self.at("family"):
                self.b.output("hidden", x)
            return self.b.build()
        if s.output.scale is not None:
            with self.at("output.scale"):
                x = self.scale(x, s.output.scale)
        width = s.embedding.project_dim or self.d
        if s.embedding.project_dim is not None:
            with self.at("embedding.project_dim"):
                x = self.emit(Op.MATMUL, x, self.param("head.project_out.weight", width, self.d,
                                                       shared=True))
        with self.at("embedding.tied"):
            if s.embedding.tied:
                head = self.param("embed.weight", s.vocab_size, width, shared=True)
            else:
                head = self.param("head.weight", s.vocab_size, width, shared=True)
            logits = self.emit(Op.MATMUL, x, head)
        if s.output.bias:
            with self.at("output.bias"):
                logits = self.emit(Op.ADD, logits,
                                   self.param("head.bias", s.vocab_size, shared=True))
        if s.output.softcap is not None:
            with self.at("output.softcap"):
                logits = self.emit(Op.POINTWISE, logits,
                                   expr=E.call("softcap", E.x(0), cap=s.output.softcap))
        with self.at("family"):
            self.b.output("logits", logits)
        return self.b.build()
