"""Architecture steps: changes to a model made on purpose, each a Spec → Spec transform.

The first seed document walks the 2018 GPT-1 block to the modern one a change at a time; each of
its changes is a step here. Steps are opt-in and never part of the exact pipeline: they change
the function. A step that does not apply to a spec says why (``StepError``) instead of guessing.

On loaded weights only the steps the literature converts without training are allowed:
``gqa:N``/``mqa`` mean-pool the K and V heads of each group (Ainslie et al. 2023), and ``no-bias``
drops what folds exactly and reports the rest (see ``convert.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace

from archc.errors import ArchcError
from archc.spec.load import from_dict, to_dict
from archc.spec.schema import FFN, AttentionBias, Spec


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


def _mixers(spec: Spec) -> str:
    """The mixers a spec's layers have, for a refusal: 'its layers are mamba'."""
    kinds = sorted(set(spec.all_mixers))
    return f"its layers are {' and '.join(k.replace('_', ' ') for k in kinds)}"


def needs_softmax_attention(spec: Spec, what: str) -> None:
    """Masks, windows, score-level positions and QK-norm act on softmax attention's scores."""
    if not spec.softmax_attends:
        raise StepError(f"{spec.name} has no softmax-attention layer ({_mixers(spec)}), and "
                        f"{what} acts on attention scores")


def needs_attention(spec: Spec, what: str) -> None:
    """KV heads belong to attention, softmax or linear."""
    if not spec.attends:
        raise StepError(f"{spec.name} has no attention layer ({_mixers(spec)}), and {what} "
                        "changes attention heads")


def _revalidate(spec: Spec) -> Spec:
    """Round-trip through the loader so a step's result obeys every spec rule."""
    return from_dict(to_dict(spec), source=f"{spec.name} (after a step)")


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
    att, ffn, norm, out, mixer = spec.attention, spec.ffn, spec.norm, spec.output, spec.mixer
    has_norm_bias = norm.kind == "layernorm" and norm.bias
    mamba_bias = mixer.mamba is not None and mixer.mamba.bias
    if not (att.bias.any or ffn.bias or out.bias or has_norm_bias or mamba_bias):
        kept = " (Mamba's conv and Δ biases are part of its recurrence and stay)" \
            if mixer.mamba is not None else ""
        raise StepError(f"{spec.name} has no biases{kept}")
    if mamba_bias:
        assert mixer.mamba is not None
        mixer = replace(mixer, mamba=replace(mixer.mamba, bias=False))
    return replace(spec, attention=replace(att, bias=AttentionBias()),
                   ffn=replace(ffn, bias=False), output=replace(out, bias=False),
                   norm=replace(norm, bias=False) if norm.kind == "layernorm" else norm,
                   mixer=mixer)


def gated(kind: str) -> Callable[[Spec, int | None], Spec]:
    def apply(spec: Spec, arg: int | None) -> Spec:
        # 3·d·d_gated = 2·d·d_ff  ⇒  d_gated = 2/3·d_ff, rounded up to a multiple (default 1)
        ffn = spec.ffn
        if ffn.kind != "mlp":
            raise StepError(f"{kind} replaces a plain MLP; {spec.name}'s FFN is {ffn.kind}")
        multiple = arg or 1
        d_gated = multiple * -(-(2 * ffn.d_ff) // (3 * multiple))
        # the gate's activation comes with the kind; `activation` is an MLP field: reset it
        return replace(spec, ffn=replace(ffn, kind=kind, d_ff=d_gated,
                                         activation=FFN().activation))
    return apply


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
    kind = spec.position.kind
    if kind == "rope":
        raise StepError(f"{spec.name} already uses RoPE")
    needs_softmax_attention(spec, "RoPE")
    if kind not in ("learned", "sinusoidal", "none"):
        raise StepError(f"rope replaces absolute positions; {spec.name} uses {kind} attention "
                        "biases")
    return replace(spec, position=dataclasses.replace(type(spec.position)(), kind="rope"))


def alibi(spec: Spec, arg: int | None) -> Spec:
    # positions leave the embeddings; each head adds −m_h·(i − j) to its scores
    if spec.position.kind == "alibi":
        raise StepError(f"{spec.name} already uses ALiBi")
    needs_softmax_attention(spec, "ALiBi")
    return replace(spec, position=dataclasses.replace(type(spec.position)(), kind="alibi"))


def gqa(spec: Spec, arg: int | None) -> Spec:
    # KV cache ∝ H_kv·d_h per token per layer: H_q/H_kv times smaller
    needs_attention(spec, "GQA")
    att = spec.attention
    kv = arg if arg is not None else _default_kv_heads(att.heads)
    if att.heads % kv:
        raise StepError(f"{kv} KV heads do not divide {att.heads} query heads")
    if kv >= att.kv_heads:
        raise StepError(f"{spec.name} already has {att.kv_heads} KV heads (asked for {kv}); GQA "
                        "only reduces them")
    if att.kv_heads % kv:
        raise StepError(f"{kv} KV heads do not group the current {att.kv_heads} evenly")
    return replace(spec, attention=replace(att, kv_heads=kv))


def _default_kv_heads(heads: int) -> int:
    """A Llama-3-like group of 4 query heads per KV head, or the nearest divisor."""
    target = max(1, heads // 4)
    return min((d for d in range(1, heads + 1) if heads % d == 0), key=lambda d:
               (abs(d - target), d))


def mqa(spec: Spec, arg: int | None) -> Spec:
    return gqa(spec, 1)


def sliding_window(spec: Spec, arg: int | None) -> Spec:
    att = spec.attention
    assert arg is not None
    if spec.family == "encoder":
        raise StepError("a sliding window here is for causal decoders")
    needs_softmax_attention(spec, "a sliding window")
    return replace(spec, attention=replace(att, window=arg, pattern=None))


def qk_norm(spec: Spec, arg: int | None) -> Spec:
    if spec.attention.qk_norm:
        raise StepError(f"{spec.name} already normalizes q and k")
    needs_softmax_attention(spec, "QK-norm")
    return replace(spec, attention=replace(spec.attention, qk_norm=True))


STEPS: dict[str, Step] = {s.name: s for s in [
    Step("prenorm", "post-norm → pre-norm (adds a final norm)", prenorm),
    Step("sandwich-norm", "add a norm after each sublayer (Gemma 2)", sandwich_norm),
    Step("rmsnorm", "LayerNorm → RMSNorm", rmsnorm),
    Step("no-bias", "drop every bias", no_bias, converts_weights=True),
    Step("swiglu", "MLP → SwiGLU at 2/3 the hidden width (swiglu:M rounds up to M)",
         gated("swiglu"), takes_arg=True),
    Step("geglu", "MLP → GeGLU at 2/3 the hidden width", gated("geglu"), takes_arg=True),
    Step("reglu", "MLP → ReGLU at 2/3 the hidden width", gated("reglu"), takes_arg=True),
    Step("parallel", "serial → parallel attention and FFN", parallel),
    Step("rope", "learned or sinusoidal positions → RoPE", rope),
    Step("alibi", "positions → ALiBi attention biases", alibi),
    Step("gqa", "fewer KV heads: gqa:N (default: groups of 4)", gqa, takes_arg=True,
         converts_weights=True),
    Step("mqa", "one KV head", mqa, converts_weights=True),
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
        new = self.step.apply(spec, self.arg)
        slug = self.text.replace(":", "")
        name = f"{spec.name}-{slug}"[:64]
        return _revalidate(replace(new, name=name, description=(
            f"{spec.name} after {self.text}: {self.step.doc}")))


def parse_steps(text: str) -> list[StepCall]:
    """`prenorm,swiglu:64,gqa:8` → steps; unknown names and bad arguments are refused."""
    calls = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            raise ArchcError(f"empty step in {text!r}")
        name, _, raw = item.partition(":")
        step = STEPS.get(name)
        if step is None:
            raise ArchcError(f"unknown step {name!r} (known: {', '.join(STEPS)})")
        arg = None
        if raw:
            if not step.takes_arg:
                raise ArchcError(f"step {name} takes no argument (got {item!r})")
            if not raw.isdigit() or int(raw) < 1:
                raise ArchcError(f"step {item!r}: the argument must be a whole number ≥ 1")
            arg = int(raw)
        elif step.needs_arg:
            raise ArchcError(f"step {name} needs an argument, e.g. {name}:4096")
        calls.append(StepCall(step, arg))
    return calls
