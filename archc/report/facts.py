"""A model's facts, computed from its IR in the model's own dtype: sizes, parameters, FLOPs per
token, KV-cache and recurrent-state size, what each layer type runs — the rows `archc show`
prints and the report's spec table."""

from __future__ import annotations

from archc.ir import cost
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.ir.ops.attention import kv_row_bytes
from archc.ir.ops.base import COLLECTIVE
from archc.ir.shapes import evaluate
from archc.passes.shard import shard_program
from archc.quant.schemes import is_quantized
from archc.spec.load import layer_spec, layer_specs
from archc.spec.schema import MASK_KINDS, MoE, Spec
from archc.ui import nbytes, si


def _attention(s: Spec) -> str:
    att, lat = s.attention, s.attention.latent
    kind = "MHA" if att.kv_heads == att.heads else "MQA" if att.kv_heads == 1 else "GQA"
    heads = f"{kind} {att.heads} heads, {att.kv_heads} KV, head_dim {att.head_dim}"
    if lat is not None:
        heads = (f"latent (MLA) {att.heads} heads, head_dim {att.head_dim} "
                 f"({att.head_dim - lat.rope_dims} + {lat.rope_dims} RoPE), v {lat.v_dim}, "
                 f"kv_rank {lat.kv_rank}" + (f", q_rank {lat.q_rank}" if lat.q_rank else ""))
    parts = [heads, att.mask if att.mask in MASK_KINDS else f"mask {att.mask}"]
    parts += [f"score {att.score}"] if att.score else []
    nz = att.normalizer
    parts += [f"softmax with sinks {nz.sinks}"] if nz.sinks else \
        [f"sigmoid(score + {nz.bias:g})"] if nz.kind == "sigmoid" else []
    parts += [f"window {att.window}"] if att.window else []
    parts += ["pattern " + "/".join(att.pattern)] if att.pattern else []
    parts += [f"softcap {att.softcap:g}"] if att.softcap else []
    parts += [f"qk-norm over each {att.qk_norm_over}"] if att.qk_norm else []
    return ", ".join(parts)


def _mixers(s: Spec) -> str:
    """The sequence mixers, when not every layer is softmax attention."""
    kinds = s.layer_mixers()
    text = kinds[0].replace("_", " ") if len(set(kinds)) == 1 else \
        "pattern " + "/".join(k.replace("_", " ") for k in (s.mixer.pattern or kinds))
    m = s.mixer.mamba
    if m is not None:
        text += (f"{'; mamba layers:' if len(set(kinds)) > 1 else ':'} d_state {m.d_state}, "
                 f"conv {m.d_conv}, expand {m.expand} (inner {s.mamba_inner}), "
                 f"dt_rank {m.dt_rank}" + (", Δ/B/C norms" if m.inner_norms else ""))
    return text


def _positions(s: Spec) -> str:
    p = s.position
    if p.kind == "rope":
        return f"rope θ={p.theta:g}, {s.rotary_dim}/{s.attention.head_dim} dims, " + (
            "interleaved" if p.interleaved else "half-split") + (
            f", {p.scaling.kind} ×{p.scaling.factor:g}" if p.scaling else "")
    if p.kind == "relative":
        return f"relative (T5) {p.buckets} buckets, max distance {p.max_distance}"
    return p.kind


def _ffn(s: Spec) -> str:
    ffn = s.ffn
    if ffn.kind == "none":
        return "none: a block is its mixer alone"
    return f"{ffn.kind}, d_ff {ffn.d_ff}" + (f", {ffn.activation}" if ffn.kind == "mlp" else "") \
        + (_routing(ffn.moe) if ffn.moe else "") + (", biases" if ffn.bias else "")


def _routing(moe: MoE) -> str:
    """The experts and how tokens are routed to them."""
    parts = [f" × {moe.experts} experts ({moe.expert}), top-{moe.top_k} by "
             + (f"{moe.router} router" if moe.router != "softmax" else "softmax router")
             + (" with a bias" if moe.router_bias else "")
             + (", renormalized" if moe.normalize_top_k else "")]
    parts += ["chosen with a choice bias"] if moe.choice_bias else []
    parts += [f"within the best {moe.top_groups} of {moe.groups} groups (by their "
              + ("two best" if moe.group_score == "top2" else "best") + ")"] \
        if moe.groups > 1 else []
    parts += [f"weights × {moe.scale:g}"] if moe.scale != 1.0 else []
    parts += ["scores on the expert's input"] if moe.score_on == "input" else []
    parts += ["expert biases"] if moe.bias else []
    parts += [f"clamp {moe.clamp:g}"] if moe.clamp is not None else []
    parts += [f"swish β {moe.swish_beta:g}"] if moe.swish_beta != 1.0 else []
    parts += [f"up + {moe.up_offset:g}"] if moe.up_offset else []
    parts += [f"shared expert d_ff {moe.shared_expert_d_ff}"] if moe.shared_expert_d_ff else []
    return ", ".join(parts)


def _norm(s: Spec) -> str:
    return f"{s.norm.kind} ({s.norm.placement}), eps {s.norm.eps:g}" + \
        (", 1 + w" if s.norm.unit_offset else "")


def _sections(s: Spec) -> dict[str, str | None]:
    """What one kind of layer runs, in the words of the rows below (None: it has none)."""
    return {"mixer": s.mixer.kind.replace("_", " "),
            "attention": _attention(s) if s.attends and s.attention.heads else None,
            "ffn": _ffn(s), "norm": _norm(s), "positions": _positions(s)}


def _layer_list(layers: list[int]) -> str:
    """Layer indices as runs: `layers 0-4, 6-10, 12`, cut short past six runs."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    if len(text) > 6:
        text = [*text[:3], "…", text[-1]]
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(text) + \
        (f" ({len(layers)} layers)" if len(runs) > 6 else "")


def _difference(mine: str | None, model: str | None) -> str:
    """What a row of a layer type says that the model's row does not: all of it where the
    kind (its first word) differs, else the parts it changes and `no X` for those it drops
    (the model's per-layer pattern aside)."""
    if mine is None or mine == model:
        return ""
    ours, theirs = mine.split(", "), (model or "").split(", ")
    if model is None or ours[0].split()[0] != theirs[0].split()[0]:
        return mine
    words = {p.split()[0] for p in ours}
    dropped = [f"no {p.split()[0]}" for p in theirs if p.split()[0] not in words and
               not p.startswith("pattern ")]
    return ", ".join([p for p in ours if p not in theirs] + dropped)


def _layer_types(s: Spec) -> list[tuple[str, str]]:
    """A row per layer type: its layers and what it runs that the rows below do not say."""
    types, _ = s.layer_plan()
    if len(types) == 1 and not types[0].overrides:
        return []
    names, model = s.layer_type_names(), _sections(s)
    rows = []
    for k, t in enumerate(types):
        layer = names.index(t.name)
        differs = [f"{label} {text}" for label, mine in _sections(layer_spec(s, layer)).items()
                   if (text := _difference(mine, model[label]))]
        rows.append(("layer types" if k == 0 else "", f"{t.name}: " + _layer_list(
            [i for i, n in enumerate(names) if n == t.name]) + "".join("; " + d for d in differs)))
    return rows


def _weights(program: Program, dtype: str) -> str:
    """Resident weight bytes and what holds them: `14.96 GiB in bf16`, or with quantized
    weights `88.43 MiB (q4_1 ×30 tensors, f32 ×61)`."""
    kinds = cost.parameter_dtypes(program)
    if not any(is_quantized(k) for k in kinds):
        return f"{nbytes(cost.parameter_bytes(program))} in {dtype}"
    held = ", ".join(f"{dtype} ×{n}" + (" tensors" if k == 0 else "")
                     for k, (dtype, n) in enumerate(kinds.items()))
    return f"{nbytes(cost.parameter_bytes(program))} ({held})"


def _tensor_parallel(rank: Program, tp: int, dtype: str) -> list[tuple[str, str]]:
    """What one of `tp` ranks holds (weights, KV cache per token) and sends per decoded token."""
    at = {"B": 1, "T": 1, "P": 0, "S": 1}
    sent = sum(int(evaluate(cost.node_cost(g, i).bytes, at)) for g in rank
               for i in g.compute_ids() if g.nodes[i].op in COLLECTIVE)
    rows = [("", ""), (f"tensor parallel ×{tp}", f"per rank: weights {_weights(rank, dtype)}")]
    kv = cost.kv_cache_bytes_per_token(rank)
    if kv:
        rows.append(("", f"per rank: KV cache {nbytes(kv)} per token"))
    rows.append(("", f"per rank: {nbytes(sent)} sent over the link per decoded token "
                     f"({sum(n.op in COLLECTIVE for g in rank for n in g)} collectives)"))
    return rows


def expanded_kv_bytes_per_token(s: Spec, dtype: str, kv_cache: str | None = None) -> int | None:
    """Bytes per token a cache of every head's keys and values would take in the layers whose
    latent attention caches a latent instead (None: no layer does): H·(head_dim + v_dim) values
    a layer, where the latent cache holds kv_rank + rope_dims."""
    total, latent = 0, False
    for i in range(s.layers):
        ls = layer_spec(s, i)
        att = ls.attention
        if ls.mixer.kind != "attention":
            continue
        latent |= att.latent is not None
        total += att.kv_heads * int(kv_row_bytes(att.head_dim, dtype, kv_cache) +
                                    kv_row_bytes(att.v_dim, dtype, kv_cache))
    return total if latent else None


def kv_cache_format(dtype: str, kv_cache: str | None) -> str:
    """How the KV cache holds a row: in the model dtype, or as codes and a scale."""
    return dtype if kv_cache is None else f"{kv_cache} codes + an f32 scale per token and head"


def _routed(s: Spec) -> MoE | None:
    """The experts a token is routed over: the model's, or the first layer type's that has them
    (DeepSeek's moe layers after dense ones)."""
    return next((ls.ffn.moe for ls in layer_specs(s) if ls.ffn.kind == "moe"), None)


def facts(s: Spec, quant: dict[str, str], kv_cache: str | None = None, tp: int = 1
          ) -> list[tuple[str, str | None]]:
    """The rows `archc show` prints, (label, text); text None: the row does not apply."""
    program = lower(s, s.dtype, quant, kv_cache=kv_cache)
    kernels, params = cost.kernel_count(program), cost.parameter_count(program)
    rows = [("", s.description or None),
            ("family", s.family),
            ("layers", str(s.layers) if s.decoder_layers is None else
             f"{s.layers} encoder + {s.decoder_layers} decoder"),
            ("d_model", str(s.d_model)),
            ("mixers", _mixers(s) if set(s.layer_mixers()) != {"attention"} else None),
            ("attention", _attention(s) if s.attends and s.attention.heads else None),
            ("ffn", _ffn(s)),
            ("norm", _norm(s)),
            ("block", "parallel" if s.block.parallel else "serial"),
            ("positions", _positions(s)),
            ("vocab", f"{s.vocab_size}, head {'tied' if s.embedding.tied else 'untied'}"
             if s.family != "encoder" else str(s.vocab_size)),
            *_layer_types(s),
            ("", ""),
            ("parameters", f"{params:,} ({si(params)})"),
            ("active parameters", f"{active:,} ({si(active)}) per token: {moe.top_k} of "
             f"{moe.experts} experts" if (active := cost.active_parameter_count(program))
             != params and (moe := _routed(s)) else None),
            ("weights", _weights(program, s.dtype))]
    empty, full = {"B": 1, "T": 1, "P": 0, "S": 1}, {"B": 1, "T": 1, "P": s.max_seq_len - 1,
                                                     "S": s.max_seq_len}
    for g in program:
        at = cost.graph_cost(g).at
        rows.append((f"FLOPs/token ({g.name})", f"{si(at(empty)[0], 'FLOP')} at context "
                     f"0, {si(at(full)[0], 'FLOP')} at context {s.max_seq_len - 1}"))
    kv, state = cost.kv_cache_bytes_per_token(program), cost.recurrent_state_bytes(program)
    if kv:
        rows.append(("KV cache", f"{nbytes(kv)} per token, {nbytes(kv * s.max_seq_len)} at "
                     f"{s.max_seq_len} tokens ({kv_cache_format(s.dtype, kv_cache)}, "
                     "batch 1)"))
    if (mha := expanded_kv_bytes_per_token(s, s.dtype, kv_cache)) is not None:
        rows.append(("", f"the latent and RoPE key: {kv / mha:.1%} of the {nbytes(mha)} per "
                     "token of per-head keys and values"))
    if state:
        kinds = [what for what, mixer in (("conv windows and SSM states", "mamba"),
                                          ("running sums", "linear_attention"),
                                          ("conv windows and delta-rule states",
                                           "gated_deltanet"))
                 if mixer in s.all_mixers]
        rows.append(("recurrent state", f"{nbytes(state)} per sequence at any context "
                     f"({' and '.join(kinds)})"))
    per = cost.per_layer(s, kernels, cost.kernel_count(lower(cost.without_layers(s), s.dtype)))
    rows.append(("compute nodes", f"{kernels} unfused ({per:g} per layer)" if per.is_integer()
                 else f"{kernels} unfused ({per:.1f} per layer on average)"))
    if tp > 1:
        rows += _tensor_parallel(shard_program(program, tp), tp, s.dtype)
    return rows
