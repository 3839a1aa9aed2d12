"""`archc show SOURCE`: sizes and costs of one model, computed from its IR."""

from __future__ import annotations

import argparse

from rich.table import Table

from archc.commands.common import spec_of
from archc.commands.vocabulary import add
from archc.report import facts
from archc.spec.schema import Spec
from archc.ui import console, nbytes, si

NAME = "show"
HELP = "sizes, parameters, FLOPs per token, KV-cache and recurrent-state size of a model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")


def _attention(s: Spec) -> str:
    att = s.attention
    kind = "MHA" if att.kv_heads == att.heads else "MQA" if att.kv_heads == 1 else "GQA"
    parts = [f"{kind} {att.heads} heads, {att.kv_heads} KV, head_dim {att.head_dim}",
             att.mask]
    if att.window:
        parts.append(f"window {att.window}")
    if att.pattern:
        parts.append("pattern " + "/".join(att.pattern))
    if att.softcap:
        parts.append(f"softcap {att.softcap:g}")
    if att.qk_norm:
        parts.append("qk-norm")
    return ", ".join(parts)


def _mixers(s: Spec) -> str:
    """The sequence mixers, when not every layer is softmax attention."""
    kinds = s.layer_mixers()
    text = kinds[0].replace("_", " ") if len(set(kinds)) == 1 else \
        "pattern " + "/".join(k.replace("_", " ") for k in (s.mixer.pattern or kinds))
    m = s.mixer.mamba
    if m is not None:
        text += (f"{'; mamba layers:' if len(set(kinds)) > 1 else ':'} d_state {m.d_state}, "
                 f"conv {m.d_conv}, "
                 f"expand {m.expand} (inner {s.mamba_inner}), dt_rank {m.dt_rank}" +
                 (", Δ/B/C norms" if m.inner_norms else ""))
    return text


def _state_kinds(s: Spec) -> str:
    mixers = set(s.all_mixers)
    return " and ".join(([] if "mamba" not in mixers else ["conv windows and SSM states"]) +
                        ([] if "linear_attention" not in mixers else ["running sums"]))


def _positions(s: Spec) -> str:
    p = s.position
    if p.kind == "rope":
        text = f"rope θ={p.theta:g}, {s.rotary_dim}/{s.attention.head_dim} dims, " + (
            "interleaved" if p.interleaved else "half-split")
        if p.scaling:
            text += f", {p.scaling.kind} ×{p.scaling.factor:g}"
        return text
    if p.kind == "relative":
        return f"relative (T5) {p.buckets} buckets, max distance {p.max_distance}"
    return p.kind


def run(args: argparse.Namespace) -> int:
    s = spec_of(args)
    f = facts(s)
    t = Table(show_header=False, box=None, title=f"{s.name}", title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    if s.description:
        t.add_row("", s.description)
    layers = str(s.layers) if s.decoder_layers is None else \
        f"{s.layers} encoder + {s.decoder_layers} decoder"
    t.add_row("family", s.family)
    t.add_row("layers", layers)
    t.add_row("d_model", str(s.d_model))
    if set(s.layer_mixers()) != {"attention"}:
        t.add_row("mixers", _mixers(s))
    if s.attends:
        t.add_row("attention", _attention(s))
    ffn = s.ffn
    ffn_text = f"{ffn.kind}, d_ff {ffn.d_ff}" + (f", {ffn.activation}" if ffn.kind == "mlp"
                                                   else "")
    if ffn.kind == "none":
        ffn_text = "none: a block is its mixer alone"
    if ffn.moe:
        ffn_text += f" × {ffn.moe.experts} experts ({ffn.moe.expert}), top-{ffn.moe.top_k}"
    t.add_row("ffn", ffn_text + (", biases" if ffn.bias else ""))
    t.add_row("norm", f"{s.norm.kind} ({s.norm.placement}), eps {s.norm.eps:g}" +
              (", 1 + w" if s.norm.unit_offset else ""))
    t.add_row("block", "parallel" if s.block.parallel else "serial")
    t.add_row("positions", _positions(s))
    t.add_row("vocab", f"{s.vocab_size}, head {'tied' if s.embedding.tied else 'untied'}"
              if s.has_head else str(s.vocab_size))
    t.add_row("", "")
    t.add_row("parameters", f"{f.params:,} ({si(f.params)})")
    t.add_row("weights", f"{nbytes(f.weight_bytes)} in {s.dtype}")
    for g, flops in f.flops_per_token.items():
        full = f.flops_per_token_full[g]
        t.add_row(f"FLOPs/token ({g})",
                  f"{si(flops, 'FLOP')} at context 0, {si(full, 'FLOP')} at context "
                  f"{s.max_seq_len - 1}")
    if f.kv_bytes_per_token:
        t.add_row("KV cache", f"{nbytes(f.kv_bytes_per_token)} per token, "
                  f"{nbytes(f.kv_bytes_per_token * s.max_seq_len)} at {s.max_seq_len} tokens "
                  f"({s.dtype}, batch 1)")
    if f.state_bytes:
        t.add_row("recurrent state", f"{nbytes(f.state_bytes)} per sequence at any context "
                  f"({_state_kinds(s)})")
    t.add_row("compute nodes", f"{f.kernels} unfused ({f.kernels_per_layer:g} per layer)")
    console.print(t)
    return 0
