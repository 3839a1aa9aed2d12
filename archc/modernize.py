"""Architecture steps, each a Spec → Spec transform: the walk from the 2018 GPT-1 block to the
modern one, a change at a time, what each step buys, and converting a loaded checkpoint through
the steps that need no training. Opt-in, never in the exact pipeline (they change the function);
a step that does not apply says why (``StepError``) instead of guessing."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from archc.errors import ArchcError
from archc.ir.cost import graph_cost, kv_cache_bytes_per_token, parameter_count
from archc.ir.lower import lower
from archc.passes import optimize
from archc.passes.measure import kernels_per_layer
from archc.runtime.weights import checkpoint_shapes
from archc.spec.load import from_dict, to_dict
from archc.spec.schema import FFN, AttentionBias, Position, Spec


class StepError(ArchcError):
    """A step that cannot apply to this spec, with the reason."""


@dataclass(frozen=True)
class Step:
    name: str
    doc: str
    apply: Callable[[Spec, int | None], Spec]
    takes_arg: bool = False        # e.g. gqa:N, sliding-window:W, swiglu:MULTIPLE
    needs_arg: bool = False
    converts_weights: bool = False  # can run on a loaded checkpoint without training


def _needs(spec: Spec, layer: str, why: str) -> None:
    """Refuse a step that needs a kind of layer ('attention': softmax or linear, for KV heads;
    'softmax-attention', for what acts on scores) that the spec does not have."""
    if not (spec.softmax_attends if layer == "softmax-attention" else spec.attends):
        kinds = " and ".join(sorted(k.replace("_", " ") for k in set(spec.all_mixers)))
        raise StepError(f"{spec.name} has no {layer} layer (its layers are {kinds}), and {why}")


def prenorm(spec: Spec, arg: int | None) -> Spec:
    # x_{l+1} = LN(x_l + F(x_l))  →  x_{l+1} = x_l + F(LN(x_l)); the residual stream is no longer
    # normalized, so the output needs a final norm
    if spec.norm.placement != "post":
        raise StepError(f"{spec.name} is already {spec.norm.placement}-norm")
    return replace(spec, norm=replace(spec.norm, placement="pre"),
                   output=replace(spec.output, final_norm=True))


def sandwich_norm(spec: Spec, arg: int | None) -> Spec:
    # x_{l+1} = x_l + LN_out(F(LN_in(x_l))): bounds what each sublayer adds to the stream
    if spec.norm.placement != "pre":
        raise StepError(f"sandwich-norm adds a norm after each pre-normed sublayer; {spec.name} "
                        f"is {spec.norm.placement}-norm (apply prenorm first)")
    if spec.block.parallel:
        raise StepError("sandwich-norm is defined for serial blocks")
    return replace(spec, norm=replace(spec.norm, placement="sandwich"))


def rmsnorm(spec: Spec, arg: int | None) -> Spec:
    # (x − E[x])/σ·γ + β  →  x/rms(x)·γ: no re-centering, no β
    if spec.norm.kind == "rmsnorm":
        raise StepError(f"{spec.name} already uses RMSNorm")
    return replace(spec, norm=replace(spec.norm, kind="rmsnorm", bias=True, unit_offset=False))


def no_bias(spec: Spec, arg: int | None) -> Spec:
    # the biases of linear layers and norms; Mamba's conv and Δ biases are part of its
    # recurrence (Δ = softplus(W·x + b) sets the step size), not a projection's offset
    att, ffn, norm, out, mamba = spec.attention, spec.ffn, spec.norm, spec.output, spec.mixer.mamba
    norm_bias = norm.kind == "layernorm" and norm.bias
    mamba_bias = mamba is not None and mamba.bias
    if not (att.bias.any or ffn.bias or out.bias or norm_bias or mamba_bias):
        kept = " (Mamba's conv and Δ biases are part of its recurrence and stay)" if mamba else ""
        raise StepError(f"{spec.name} has no biases{kept}")
    return replace(spec, attention=replace(att, bias=AttentionBias()),
                   ffn=replace(ffn, bias=False), output=replace(out, bias=False),
                   norm=replace(norm, bias=False) if norm_bias else norm,
                   mixer=replace(spec.mixer, mamba=replace(mamba, bias=False) if mamba else None))


def gated(kind: str, spec: Spec, arg: int | None) -> Spec:
    # 3·d·d_gated = 2·d·d_ff  ⇒  d_gated = 2/3·d_ff, rounded up to a multiple (default 1)
    ffn, multiple = spec.ffn, arg or 1
    if ffn.kind != "mlp":
        raise StepError(f"{kind} replaces a plain MLP; {spec.name}'s FFN is {ffn.kind}")
    # the gate's activation comes with the kind; `activation` is an MLP field: reset it
    return replace(spec, ffn=replace(ffn, kind=kind, activation=FFN().activation,
                                     d_ff=multiple * -(-(2 * ffn.d_ff) // (3 * multiple))))


def parallel(spec: Spec, arg: int | None) -> Spec:
    # x + FFN(N(x + Attn(N(x))))  →  x + Attn(N(x)) + FFN(N(x)): one shared norm, both branches
    # read the same input
    if spec.block.parallel:
        raise StepError(f"{spec.name} already has parallel blocks")
    if spec.norm.placement != "pre":
        raise StepError(f"parallel blocks are pre-norm; {spec.name} is {spec.norm.placement}-"
                        "norm (apply prenorm first)")
    if spec.family == "encoder-decoder":
        raise StepError("parallel blocks are defined for one stack without cross-attention")
    if spec.ffn.kind == "none":
        raise StepError(f"{spec.name} has no FFN to run beside its mixer")
    return replace(spec, block=replace(spec.block, parallel=True, shared_norm=True))


def rope(spec: Spec, arg: int | None) -> Spec:
    # h = e + p  →  q_m = R_m W_q x_m, k_n = R_n W_k x_n: position enters q·k as R_{n−m}
    if spec.position.kind == "rope":
        raise StepError(f"{spec.name} already uses RoPE")
    _needs(spec, "softmax-attention", "RoPE acts on attention scores")
    if spec.position.kind not in ("learned", "sinusoidal", "none"):
        raise StepError(f"rope replaces absolute positions; {spec.name} uses "
                        f"{spec.position.kind} attention biases")
    return replace(spec, position=Position(kind="rope"))


def alibi(spec: Spec, arg: int | None) -> Spec:
    # positions leave the embeddings; each head adds −m_h·(i − j) to its scores
    if spec.position.kind == "alibi":
        raise StepError(f"{spec.name} already uses ALiBi")
    _needs(spec, "softmax-attention", "ALiBi acts on attention scores")
    return replace(spec, position=Position(kind="alibi"))


def gqa(spec: Spec, arg: int | None) -> Spec:
    # KV cache ∝ H_kv·d_h per token per layer: H_q/H_kv times smaller
    _needs(spec, "attention", "GQA changes attention heads")
    att = spec.attention
    # by default a Llama-3-like group of 4 query heads per KV head, or the nearest divisor
    kv = arg or min((d for d in range(1, att.heads + 1) if att.heads % d == 0),
                    key=lambda d: (abs(d - max(1, att.heads // 4)), d))
    if kv >= att.kv_heads:
        raise StepError(f"{spec.name} already has {att.kv_heads} KV heads (asked for {kv}); GQA "
                        "only reduces them")
    if att.kv_heads % kv:  # then kv divides the query heads too
        raise StepError(f"{kv} KV heads do not group the current {att.kv_heads} evenly "
                        f"({att.heads} query heads)")
    return replace(spec, attention=replace(att, kv_heads=kv))


def sliding_window(spec: Spec, arg: int | None) -> Spec:
    if spec.family == "encoder":
        raise StepError("a sliding window here is for causal decoders")
    _needs(spec, "softmax-attention", "a sliding window acts on attention scores")
    return replace(spec, attention=replace(spec.attention, window=arg, pattern=None))


def qk_norm(spec: Spec, arg: int | None) -> Spec:
    if spec.attention.qk_norm:
        raise StepError(f"{spec.name} already normalizes q and k")
    _needs(spec, "softmax-attention", "QK-norm acts on attention scores")
    return replace(spec, attention=replace(spec.attention, qk_norm=True))


STEPS: dict[str, Step] = {s.name: s for s in [
    Step("prenorm", "post-norm → pre-norm (adds a final norm)", prenorm),
    Step("sandwich-norm", "add a norm after each sublayer (Gemma 2)", sandwich_norm),
    Step("rmsnorm", "LayerNorm → RMSNorm", rmsnorm),
    Step("no-bias", "drop every bias", no_bias, converts_weights=True),
    Step("swiglu", "MLP → SwiGLU at 2/3 the hidden width (swiglu:M rounds up to M)",
         partial(gated, "swiglu"), takes_arg=True),
    Step("geglu", "MLP → GeGLU at 2/3 the hidden width", partial(gated, "geglu"), takes_arg=True),
    Step("reglu", "MLP → ReGLU at 2/3 the hidden width", partial(gated, "reglu"), takes_arg=True),
    Step("parallel", "serial → parallel attention and FFN", parallel),
    Step("rope", "learned or sinusoidal positions → RoPE", rope),
    Step("alibi", "positions → ALiBi attention biases", alibi),
    Step("gqa", "fewer KV heads: gqa:N (default: groups of 4)", gqa, takes_arg=True,
         converts_weights=True),
    Step("mqa", "one KV head", lambda spec, arg: gqa(spec, 1), converts_weights=True),
    Step("sliding-window", "every layer attends to the last W tokens: sliding-window:W",
         sliding_window, takes_arg=True, needs_arg=True),
    Step("qk-norm", "normalize q and k per head", qk_norm),
]}

# The seed's walk from GPT-1 to a Llama-style block.
DEFAULT_STEPS = ("prenorm", "rmsnorm", "no-bias", "swiglu", "rope", "gqa")


@dataclass(frozen=True)
class StepCall:
    step: Step
    arg: int | None

    @property
    def text(self) -> str:
        return self.step.name + (f":{self.arg}" if self.arg is not None else "")

    def apply(self, spec: Spec) -> Spec:
        """The step's spec, renamed, described, and round-tripped through the loader so that it
        obeys every spec rule."""
        new = replace(self.step.apply(spec, self.arg),
                      name=f"{spec.name}-{self.text.replace(':', '')}"[:64],
                      description=f"{spec.name} after {self.text}: {self.step.doc}")
        self._keep_layer_types(spec, new)
        return from_dict(to_dict(new), source=f"{new.name} (after a step)")

    def _keep_layer_types(self, before: Spec, after: Spec) -> None:
        """A step changes the model's fields; one that a layer type sets for its layers would
        stay as the type sets it, and the step not do what it says: refused."""
        def leaves(data: object, path: str = "") -> dict[str, object]:
            if not isinstance(data, dict):
                return {path: data}
            return {k: v for key, value in data.items()
                    for k, v in leaves(value, f"{path}.{key}" if path else key).items()}
        old, new = leaves(to_dict(before, full=True)), leaves(to_dict(after, full=True))
        changed = [p for p in old.keys() | new.keys() if old.get(p) != new.get(p)]
        for t in before.layer_types or ():
            for path, _ in t.overrides:
                hit = next((c for c in changed if (c + ".").startswith(path + ".") or
                            (path + ".").startswith(c + ".")), None)
                if hit is not None:
                    raise StepError(f"{self.text} changes {hit}, which layer type {t.name!r} "
                                    f"sets ({path}): edit layer_types instead")


def parse_steps(text: str) -> list[StepCall]:
    """`prenorm,swiglu:64,gqa:8` → steps; unknown names and bad arguments are refused."""
    calls = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            raise ArchcError(f"empty step in {text!r}")
        name, _, raw = item.partition(":")
        if (step := STEPS.get(name)) is None:
            raise ArchcError(f"unknown step {name!r} (known: {', '.join(STEPS)})")
        if raw and not step.takes_arg:
            raise ArchcError(f"step {name} takes no argument (got {item!r})")
        if raw and (not raw.isdigit() or int(raw) < 1):
            raise ArchcError(f"step {item!r}: the argument must be a whole number ≥ 1")
        if not raw and step.needs_arg:
            raise ArchcError(f"step {name} needs an argument, e.g. {name}:4096")
        calls.append(StepCall(step, int(raw) if raw else None))
    return calls


def decode_intensity(d: int, n: int, kv_heads: int, q_heads: int, b: int) -> float:
    """The first seed's rough model ("A rough arithmetic-intensity model"): over n decode steps
    at batch b, dense work is O(b·n·d²) against memory O(b·n·d + b·n²·d·H_kv/H_q + n·d²), so
    AI = (1/d + n·H_kv/(d·H_q) + 1/b)⁻¹ up to constants: compare it across steps, not with a
    GPU."""
    return 1.0 / (1.0 / d + n * kv_heads / (d * q_heads) + 1.0 / b)


@dataclass(frozen=True)
class Row:
    step: str
    spec: Spec
    params: int
    flops_per_token: int
    kv_bytes_per_token: int
    kv_bytes_at_context: int
    intensity: float
    kernels_per_layer: float   # after the default exact pipeline
    decode_bytes_per_token: int
    call: StepCall | None = None   # the step that made it (None: the start)


def measure(step: str, spec: Spec, batch: int, context: int) -> Row:
    program = lower(spec, spec.dtype)
    dims = {"B": batch, "T": 1, "P": context - 1, "S": context}
    flops, moved = map(sum, zip(*(graph_cost(g).at(dims) for g in optimize(program))))
    kv = kv_cache_bytes_per_token(program)
    att = spec.attention
    # a model without softmax attention keeps no KV cache that grows with the context
    kv_heads, heads = (att.kv_heads, att.heads) if spec.softmax_attends else (0, 1)
    return Row(step, spec, parameter_count(program), flops // batch, kv, kv * context * batch,
               decode_intensity(spec.d_model, context, kv_heads, heads, batch),
               kernels_per_layer(spec, dtype=spec.dtype)[1], moved // batch)


def walk(spec: Spec, calls: list[StepCall], batch: int, context: int, *,
         skipped: Callable[[StepCall, StepError], None] | None = None) -> list[Row]:
    """The starting spec and the spec after each step, measured. With `skipped`, a step that
    does not apply is passed to it and left out (else its StepError is raised)."""
    rows = [measure("(start)", spec, batch, context)]
    for call in calls:
        try:
            spec = call.apply(spec)
        except StepError as err:
            if skipped is None:
                raise
            skipped(call, err)
            continue
        rows.append(replace(measure(call.text, spec, batch, context), call=call))
    return rows


_KV = re.compile(r"^(.*layers\.\d+\.(?:attn|cross))\.([kv])\.(weight|bias)$")


@dataclass
class Conversion:
    """What a conversion did to each tensor it touched."""

    exact: list[str] = field(default_factory=list)
    dropped: list[tuple[str, float]] = field(default_factory=list)   # name, RMS of the values
    pooled: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        if self.pooled:
            out.append(f"mean-pooled the K/V heads of {len(self.pooled)} tensors")
        if self.exact:
            out.append(f"removed exactly ({len(self.exact)}): " + ", ".join(self.exact[:4]) +
                       (" …" if len(self.exact) > 4 else ""))
        if self.dropped:
            name, rms = max(self.dropped, key=lambda x: x[1])
            out.append(f"dropped, changing the function ({len(self.dropped)}): largest RMS "
                       f"{rms:.3g} in {name}")
        return out


def convert(call: StepCall, before: Spec, after: Spec,
            weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Conversion]:
    """The checkpoint of `after` from the checkpoint of `before`, or StepError. ``gqa:N``/``mqa``
    give each new KV head the mean of the old heads of its group (Ainslie et al. 2023, "GQA:
    Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints");
    ``no-bias`` removes zero biases, and key biases nothing position-dependent acts on, exactly
    (q·(k + b) = q·k + q·b is constant along the softmax axis), and drops every other bias, which
    changes the function, reporting its size."""
    if not call.step.converts_weights:
        raise StepError(f"{call.text} changes what the weights compute and needs training; "
                        "only gqa:N, mqa and no-bias convert a loaded checkpoint")
    quantized = sorted(k for k, w in weights.items() if not isinstance(w, torch.Tensor))
    if quantized:
        raise StepError(f"{call.text} converts float weights; {quantized[0]} and "
                        f"{len(quantized) - 1} more are quantized: convert the float "
                        "checkpoint, then quantize the result")
    out, report = dict(weights), Conversion()
    if call.step.name in ("gqa", "mqa"):
        old, new = before.attention.kv_heads, after.attention.kv_heads
        for name in filter(_KV.match, weights):
            # [H_old·D, …] → [H_new, H_old/H_new, D, …]: each new head is its group's mean
            out[name] = weights[name].unflatten(0, (new, old // new, -1)).mean(1).flatten(0, 1)
            report.pooled.append(name)
        return out, report
    # no-bias. Nothing position-dependent may act on k after its bias for it to fold: RoPE
    # rotates k_j + b by R_j (q·R_j b then varies with j); qk-norm rescales k + b per key.
    key_bias_folds = before.position.kind != "rope" and not before.attention.qk_norm
    for name in sorted(set(weights) - set(checkpoint_shapes(lower(after)))):
        t, m = out.pop(name).float(), _KV.match(name)
        key_bias = m is not None and m.group(2, 3) == ("k", "bias")
        if not bool(t.abs().max() > 0) or (key_bias and key_bias_folds):
            report.exact.append(name)
        else:
            report.dropped.append((name, float(t.pow(2).mean().sqrt())))
    return out, report
