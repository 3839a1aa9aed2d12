"""Architecture steps, each a Spec → Spec transform: the walk from the 2018 GPT-1 block to the
modern one, a change at a time. Opt-in, never in the exact pipeline (they change the function);
a step that does not apply says why (``StepError``) instead of guessing. What each step buys, and
converting a loaded checkpoint through the steps that need no training: ``archc.modernize``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from archc.errors import ArchcError, SpecError
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
        try:
            return from_dict(to_dict(new), source=f"{new.name} (after a step)")
        except SpecError as err:    # the step does not fit this spec: refused, saying why
            raise StepError(f"{self.text} does not apply to {spec.name}: {err}") from None

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
