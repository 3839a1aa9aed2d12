"""The spec: a frozen, validated description of a transformer architecture.

Every field is declared once here, read by the loader, ``to_dict`` and the reference. Metadata:
``min``/``max`` (inclusive) and ``above`` (exclusive: a scale, cap or eps of 0 makes no model),
``words`` (names that stand for a number the loader works out), ``only`` (the field applies only
when its section's ``kind`` is one of these), ``derived`` (computed when omitted),
``required_when`` (a condition the cross-field rules check). A field defaulting to None whose
type does not admit None is required (where it applies).

Layers vary by *layer types*: each names the fields it sets in the per-layer sections
(``LAYER_SECTIONS``), and ``layer_pattern`` gives each layer its type. The older per-layer
patterns (``mixer.pattern``, ``attention.pattern``, ``ffn.pattern``) are shorthand for layer
types (``Spec.layer_plan``); ``archc.spec.load.layer_spec(spec, i)`` is what layer i runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

# The sections a layer type may change; everything else (sizes, embeddings, block arrangement,
# output head) is the model's.
LAYER_SECTIONS = ("mixer", "attention", "position", "ffn", "norm")

Family = Literal["decoder", "encoder", "encoder-decoder"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "sigmoid"]
Placement = Literal["pre", "post", "sandwich", "output"]
FFNKind = Literal["mlp", "glu", "reglu", "geglu", "swiglu", "moe", "none"]
MaskKind = Literal["causal", "bidirectional", "prefix"]
MASK_KINDS: tuple[str, ...] = ("causal", "bidirectional", "prefix")
LayerKind = Literal["local", "global"]
PositionKind = Literal["none", "learned", "sinusoidal", "rope", "alibi", "relative"]
RopeScalingKind = Literal["linear", "ntk", "yarn", "llama3", "dynamic", "longrope"]
MixerKind = Literal["attention", "linear_attention", "mamba", "gated_deltanet"]
# the mixers with no attention heads of their own
HEADLESS_MIXERS: tuple[str, ...] = ("mamba", "gated_deltanet")
FFNLayerKind = Literal["dense", "moe"]

# The activation each gated FFN applies to its gate branch (Shazeer 2020).
GATED_ACTIVATION: dict[str, Activation] = {"glu": "sigmoid", "reglu": "relu", "geglu": "gelu_tanh",
                                           "swiglu": "silu"}


def _f(default: Any = None, doc: str = "", **meta: Any) -> Any:
    meta["doc"] = doc
    if isinstance(default, type):  # a nested section: build its defaults
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RopeScaling:
    kind: RopeScalingKind = _f("linear", "dynamic: NTK from the length past the trained context; "
                               "longrope: per-frequency factors, long ones past it (Phi-3)")
    factor: float = _f(1.0, "context extension factor", min=1.0)
    original_max_seq_len: int = _f(None, "context the model was trained on", min=1,
                                   only=("yarn", "llama3", "dynamic", "longrope"))
    low_freq_factor: float = _f(1.0, "wavelengths above original/low are scaled", above=0,
                                only=("llama3",))
    high_freq_factor: float = _f(4.0, "wavelengths below original/high are kept",
                                 above=0, only=("llama3",))
    beta_fast: float = _f(32.0, "rotations per context below which dims interpolate",
                          above=0, only=("yarn",))
    beta_slow: float = _f(1.0, "rotations per context above which dims extrapolate",
                          above=0, only=("yarn",))
    truncate: bool = _f(True, "round the dims where the blend starts and ends to whole dims "
                        "(false: gpt-oss)", only=("yarn",))
    attention_factor: float | None = _f(
        None, "cos/sin scale (default yarn: 0.1·ln(factor) + 1; longrope: "
        "sqrt(1 + ln(factor)/ln(original_max_seq_len)))", above=0, only=("yarn", "longrope"))
    mscale: float | None = _f(None, "with mscale_all_dim, the cos/sin scale's default is "
                              "m(mscale)/m(mscale_all_dim), m(s) = 0.1·s·ln(factor) + 1",
                              above=0, only=("yarn",))
    mscale_all_dim: float | None = _f(
        None, "see mscale; latent attention also scales its scores by m(mscale_all_dim)² "
        "(DeepSeek)", above=0, only=("yarn",))
    short_factor: tuple[float, ...] = _f(
        None, "longrope: the divisor of each frequency while a call stays within "
        "original_max_seq_len (one per rotary pair)", only=("longrope",))
    long_factor: tuple[float, ...] = _f(
        None, "longrope: the divisors once a call reaches past original_max_seq_len",
        only=("longrope",))


    def yarn_mscale(self, m: float = 1.0) -> float:
        """YaRN's m(s) = 0.1·s·ln(factor) + 1 (1 without extension)."""
        return 0.1 * m * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    @property
    def yarn_attention_factor(self) -> float:
        """The scale of YaRN's cos and sin: attention_factor, else m(mscale)/m(mscale_all_dim)
        where both are given, else m(1)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.mscale) / self.yarn_mscale(self.mscale_all_dim)
        return self.yarn_mscale()


@dataclass(frozen=True)
class Position:
    kind: PositionKind = _f("rope", "how positions enter the model")
    offset: int = _f(0, "table rows skipped at the start (OPT uses 2)", min=0, only=("learned",))
    theta: float = _f(10000.0, "base of the rotation frequencies", min=1.0, only=("rope",))
    fraction: float = _f(1.0, "fraction of each head's dims that rotate", above=0,
                         max=1.0, only=("rope",))
    interleaved: bool = _f(False, "rotate pairs (x0,x1),(x2,x3)… instead of halves", only=("rope",))
    alibi_scaled: bool = _f(False, "the bias joins the scores before the score scale, so it is "
                            "scaled too (Falcon)", only=("alibi",))
    scaling: RopeScaling | None = _f(None, "context-extension scaling", only=("rope",))
    buckets: int = _f(32, "number of T5 distance buckets", min=2, only=("relative",))
    max_distance: int = _f(128, "distance at which buckets stop growing", min=2, only=("relative",))


@dataclass(frozen=True)
class AttentionBias:
    q: bool = _f(False, "bias on the query projection")
    k: bool = _f(False, "bias on the key projection")
    v: bool = _f(False, "bias on the value projection")
    o: bool = _f(False, "bias on the output projection")

    @property
    def any(self) -> bool:
        return self.q or self.k or self.v or self.o


@dataclass(frozen=True)
class Normalizer:
    kind: Literal["softmax", "sigmoid"] = _f(
        "softmax", "how scores become weights: softmax, or sigmoid σ(score + bias) with no "
        "denominator (sigmoid attention, Ramapuram et al. 2024)")
    sinks: str | None = _f(None, "a per-head parameter (attention.params) whose logit joins the "
                           "softmax denominator only: attention sinks (gpt-oss)",
                           only=("softmax",))
    bias: float = _f(0.0, "added to every score before the sigmoid (the paper: −ln of the "
                     "training length)", only=("sigmoid",))


@dataclass(frozen=True)
class HeadParam:
    """A named per-head parameter of the attention expressions: a checkpoint tensor (`weight`,
    with {layer} for the layer's index) or values given in the spec, one per head."""

    name: str
    weight: str | None = None
    values: tuple[float, ...] | None = None


@dataclass(frozen=True)
class TokenInput:
    """A named per-token integer input of the attention expressions, given with each call;
    `default` is its value where the caller gives none (None: it must be given)."""

    name: str
    default: int | None = None


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention (DeepSeek-V2, 2024): keys and values are projected up per head
    from one latent vector per token, and each head's query and key end in a part that RoPE
    rotates, whose key is one for all heads. What a decoder caches is the latent and that key."""

    kv_rank: int = _f(None, "width of the latent each token's keys and values come from (the "
                      "KV cache holds it, normalized)", min=1)
    rope_dims: int = _f(None, "dims at the end of each head's query and key that RoPE rotates; "
                        "their key is one for all heads", min=2)
    q_rank: int | None = _f(None, "queries through a low-rank latent of this width, normalized "
                            "(none: one projection)", min=1)
    v_dim: int = _f(None, "dims of each head's value (default head_dim − rope_dims)", min=1,
                    derived=True)
    eps: float | None = _f(None, "eps of the latents' norms (default norm.eps)", above=0)


@dataclass(frozen=True)
class Attention:
    heads: int = _f(None, "query heads", min=1, required_when="a layer attends")
    kv_heads: int = _f(None, "key/value heads: heads (MHA, the default), 1 (MQA), or a divisor "
                       "(GQA)", min=1, derived=True)
    head_dim: int = _f(None, "dims per head (default d_model / heads)", min=1, derived=True)
    mask: str = _f("causal", "causal, bidirectional, prefix (the prompt sees itself fully), or "
                   "a bool expression of q_pos, kv_pos, head, kv_head, params and inputs, true "
                   "where a query sees a key (docs/attention-expressions.md)")
    score: str | None = _f(None, "a float expression of score (scaled, after softcap and ALiBi), "
                           "q_pos, kv_pos, head, kv_head, params and inputs: the score the "
                           "normalizer sees")
    normalizer: Normalizer = _f(Normalizer, "softmax (default), {kind: softmax, sinks: NAME}, "
                                "or {kind: sigmoid, bias: B}; a word is its kind")
    params: tuple[HeadParam, ...] | None = _f(
        None, "per-head parameters the expressions read as NAME[head] or NAME[kv_head]: NAME: "
        "a checkpoint tensor name ({layer}: the layer's index), a number for every head, or a "
        "list of one per head")
    inputs: tuple[TokenInput, ...] | None = _f(
        None, "per-token integer inputs the expressions read as NAME[q_pos] or NAME[kv_pos], "
        "given with each call: NAME: its default where none is given, or null (required)")
    window: int | None = _f(None, "sliding window: a query sees the last `window` keys", min=1)
    global_tokens: int | None = _f(
        None, "sparse attention (Longformer): the first G positions are global — every query "
        "of a windowed layer sees them, and in an encoder they see every key", min=1)
    pattern: tuple[LayerKind, ...] | None = _f(
        None, "per-layer kinds, repeated over the layers: local (windowed) or global")
    softcap: float | None = _f(None, "attention-logit soft-cap: cap·tanh(s/cap)", above=0)
    scale: float | None = _f(None, "score scale (default 1/sqrt(head_dim))", above=0)
    qk_norm: bool = _f(False, "normalize q and k per head before scores (norm.kind)")
    qk_norm_gain: bool = _f(True, "learned gains on the QK-norm (false: Llama 4's L2 norm, "
                            "x/rms(x) alone)")
    qk_norm_over: Literal["head", "projection"] = _f(
        "head", "what the QK-norm normalizes: each head, or the whole q and k projections "
        "(OLMo 2), with one gain per projected dim")
    bias: AttentionBias = _f(AttentionBias, "biases per projection (or one bool for all; latent "
                             "attention: q on the first query projection, k on the joint "
                             "latent and RoPE-key projection)")
    output_gate: bool = _f(False, "the query projection also yields a gate per head dim: the "
                           "heads' output is multiplied by σ(gate) before the output projection "
                           "(Qwen3-Next)")
    latent: Latent | None = _f(None, "multi-head latent attention (DeepSeek): "
                               "{kv_rank, rope_dims, q_rank, v_dim}; head_dim is the query's "
                               "and key's (no-RoPE dims + rope_dims)")

    @property
    def v_dim(self) -> int:
        """Dims of each head's value: head_dim, or latent attention's own."""
        return self.latent.v_dim if self.latent is not None else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (GQA group)."""
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Mamba:
    d_state: int = _f(16, "state size N of each inner channel's SSM", min=1)
    d_conv: int = _f(4, "width of the causal depthwise convolution over time", min=2)
    expand: int = _f(2, "inner width = expand·d_model", min=1)
    dt_rank: int = _f(None, "rank of the Δ projection (default ⌈d_model/16⌉)", min=1, derived=True)
    conv_bias: bool = _f(True, "bias on the convolution")
    bias: bool = _f(False, "biases on the in- and out-projections")
    inner_norms: bool = _f(False, "RMSNorm (norm.eps) on Δ, B and C after the x-projection (Jamba)")


@dataclass(frozen=True)
class DeltaNet:
    key_heads: int = _f(None, "heads of q and k (each serves value_heads / key_heads value "
                        "heads)", min=1)
    value_heads: int = _f(None, "heads of v, of the state and of the output", min=1)
    key_dim: int = _f(None, "dims of each q and k head", min=1)
    value_dim: int = _f(None, "dims of each v head", min=1)
    d_conv: int = _f(4, "width of the causal depthwise convolution over q, k and v", min=2)
    chunk: int = _f(64, "tokens per chunk of the chunked delta rule", min=1)
    algorithm: Literal["chunked", "recurrent"] = _f(
        "chunked", "how the eager interpreter runs the delta rule: in chunks (WY/UT transform) "
        "or one token at a time; both compute the same function")


@dataclass(frozen=True)
class Mixer:
    kind: MixerKind = _f("attention", "sequence mixer of every layer: attention (softmax), "
                         "linear_attention (φ = elu + 1, running sums), mamba (selective SSM), "
                         "gated_deltanet (the gated delta rule, Qwen3-Next)")
    pattern: tuple[MixerKind, ...] | None = _f(
        None, "per-layer mixers, repeated over the layers, instead of kind (hybrids: "
        "[mamba, mamba, mamba, attention])")
    mamba: Mamba | None = _f(None, "mamba layers: selective state-space sizes")
    deltanet: DeltaNet | None = _f(None, "gated_deltanet layers: {key_heads, value_heads, "
                                   "key_dim, value_dim, d_conv, chunk}")


@dataclass(frozen=True)
class MoE:
    experts: int = _f(None, "number of experts", min=2)
    top_k: int = _f(2, "experts each token is routed to", min=1)
    expert: Literal["mlp", "glu", "reglu", "geglu", "swiglu"] = _f("swiglu", "FFN of each expert")
    router: Literal["softmax", "sigmoid"] = _f(
        "softmax", "how the router's logits become weights: softmax over all the experts, or "
        "σ of each chosen expert's logit (Llama 4); either way the top k logits choose (the "
        "top k weights + choice_bias with a choice bias or groups)")
    router_bias: bool = _f(False, "a learned bias on the router's logits, before the choice "
                           "(gpt-oss)")
    normalize_top_k: bool = _f(True, "renormalize the top-k router weights to sum to 1 (softmax "
                               "over the top-k logits only, as gpt-oss, is this)")
    choice_bias: bool = _f(False, "a learned per-expert bias added to the router's weights for "
                           "the choice only: the experts are chosen by weight + bias, weighed "
                           "by their weights alone (DeepSeek-V3's e_score_correction_bias)")
    groups: int = _f(1, "experts split in this many equal groups (in index order); only the "
                     "top_groups best groups' experts may be chosen (DeepSeek's n_group)", min=1)
    top_groups: int = _f(None, "groups kept for the choice (default: all of them; DeepSeek's "
                         "topk_group)", min=1, derived=True)
    group_score: Literal["top2", "max"] = _f(
        "top2", "a group's score: the sum of its two best choice values (DeepSeek-V3), or its "
        "best (DeepSeek-V2's group_limited_greedy)")
    scale: float = _f(1.0, "the chosen weights are multiplied by this, after any renormalizing "
                      "(DeepSeek's routed_scaling_factor)", above=0)
    score_on: Literal["output", "input"] = _f(
        "output", "what a token's weight for an expert scales: the expert's output (Mixtral), "
        "or its input (Llama 4: expert(g·x), summed unweighted)")
    bias: bool = _f(False, "biases on each expert's projections (gpt-oss)")
    clamp: float | None = _f(None, "gated experts: the gate clamped to ≤ clamp and the up "
                             "projection to ±clamp before the activation (gpt-oss: 7)", above=0)
    swish_beta: float = _f(1.0, "swiglu experts: the gate's activation is g·σ(β·g), SiLU at 1 "
                           "(gpt-oss: 1.702)", above=0)
    up_offset: float = _f(0.0, "gated experts: added to the up projection before the product "
                          "(gpt-oss: act(gate)·(up + 1))")
    shared_expert_d_ff: int | None = _f(None, "hidden size of an always-on shared expert", min=1)
    shared_expert_gate: bool = _f(False, "the shared expert's output is scaled by σ(a learned "
                                  "linear map of the FFN input to one value) (Qwen3-Next)")

    @property
    def plain_experts(self) -> bool:
        """Are the experts' FFNs their kind's alone, with no clamp, slope or offset?"""
        return self.clamp is None and self.swish_beta == 1.0 and self.up_offset == 0.0


@dataclass(frozen=True)
class FFN:
    kind: FFNKind = _f("mlp", "none: no FFN, a block is its mixer alone (Mamba)")
    activation: Activation = _f("gelu", "of an mlp (and of moe's mlp experts)", only=("mlp", "moe"))
    d_ff: int = _f(None, "hidden size (default: 4·d_model, or the gated 2/3 rule)", min=1,
                   derived=True)
    multiple_of: int = _f(1, "gated sizing rule: round the hidden size up to a multiple", min=1)
    multiplier: float = _f(1.0, "gated sizing rule: scale 2/3·4·d_model before rounding", above=0)
    bias: bool = _f(False, "biases on the FFN projections")
    moe: MoE = _f(None, "experts and routing", only=("moe",))
    pattern: tuple[FFNLayerKind, ...] | None = _f(
        None, "per-layer FFNs, repeated over the layers: moe routes over the experts, dense runs "
        "one FFN of kind moe.expert and d_ff (Jamba: [dense, moe])", only=("moe",))

    @property
    def gated(self) -> bool:
        """Does each (expert) FFN have a gate branch?"""
        return (self.moe.expert if self.moe else self.kind) in GATED_ACTIVATION

    @property
    def gate_activation(self) -> Activation:
        return GATED_ACTIVATION.get(self.moe.expert if self.moe else self.kind, self.activation)


@dataclass(frozen=True)
class Norm:
    kind: Literal["layernorm", "rmsnorm"] = _f("layernorm", "kind of every norm")
    eps: float = _f(1e-5, "added to the variance", above=0)
    placement: Placement = _f("pre", "sandwich: a norm before and after each sublayer; output: "
                              "one on each sublayer's output, before the residual add (OLMo 2)")
    unit_offset: bool = _f(False, "gain is (1 + w) as in Gemma", only=("rmsnorm",))
    bias: bool = _f(True, "learned shift β", only=("layernorm",))


@dataclass(frozen=True)
class Block:
    parallel: bool = _f(False, "attention and FFN read the same input and add to the residual")
    shared_norm: bool = _f(True, "parallel block: one norm feeds both branches (else one each)")
    residual_scale: float | None = _f(None, "multiply each sublayer's output before the residual "
                                      "add (Granite's residual_multiplier)", above=0)


@dataclass(frozen=True)
class Embedding:
    scale: float | None = _f(None, "multiply embeddings (Gemma: by sqrt_d_model)", above=0,
                             words=("sqrt_d_model",))
    tied: bool = _f(True, "the output head reuses the token embedding")
    norm: bool = _f(False, "a norm right after the embeddings (BERT, BLOOM)")
    token_types: int = _f(0, "token-type (segment) embeddings, as BERT", min=0)
    project_dim: int | None = _f(
        None, "token-embedding width when not d_model: projected to d_model after the lookup "
        "and back before the head (OPT-350m)", min=1)


@dataclass(frozen=True)
class Output:
    final_norm: bool = _f(True, "a norm after the last layer")
    softcap: float | None = _f(None, "final-logit soft-cap: cap·tanh(z/cap)", above=0)
    bias: bool = _f(False, "bias on the output head")
    scale: float | None = _f(None, "scale the last hidden state before the head (T5 tied)", above=0)
    logit_scale: float | None = _f(None, "multiply the logits, after the head's bias and before "
                                   "any soft-cap (Granite: 1/logits_scaling; Cohere)", above=0)


@dataclass(frozen=True)
class LayerType:
    """One kind of layer: the fields it sets in the model's per-layer sections, as (field path,
    value) pairs such as ("attention.window", 1024) or ("position.kind", "none"); every other
    field is the model's."""

    name: str
    overrides: tuple[tuple[str, Any], ...] = ()

    def get(self, path: str, default: Any) -> Any:
        """The value this type sets at `path`, else `default`."""
        return next((v for p, v in self.overrides if p == path), default)


@dataclass(frozen=True)
class Spec:
    name: str = _f(None, "model name (letters, digits, . _ -)")
    family: Family = _f("decoder", "encoders return hidden states; the others end in a head")
    vocab_size: int = _f(None, "token vocabulary", min=1)
    d_model: int = _f(None, "residual-stream width", min=1)
    layers: int = _f(None, "blocks (encoder blocks for encoder-decoder)", min=1)
    decoder_layers: int | None = _f(None, "encoder-decoder: decoder blocks (default layers)", min=1)
    max_seq_len: int = _f(2048, "longest sequence (positions table, KV-cache size)", min=1)
    dtype: Literal["f32", "f16", "bf16"] = _f("bf16", "weight dtype for size and byte reports")
    description: str = _f("", "free text")
    weights: str | None = _f(
        None, "a checkpoint to run this spec with: a Hugging Face directory, GGUF file, archc "
        "checkpoint directory or quantized file, relative to the spec file; each tensor's shape "
        "must be the one this spec's program wants")
    mixer: Mixer = _f(Mixer, "sequence mixer per layer")
    attention: Attention = _f(Attention, "attention")
    ffn: FFN = _f(FFN, "feed-forward")
    norm: Norm = _f(Norm, "normalization")
    block: Block = _f(Block, "block arrangement")
    position: Position = _f(Position, "positions")
    embedding: Embedding = _f(Embedding, "embeddings")
    output: Output = _f(Output, "output head")
    layer_types: tuple[LayerType, ...] | None = _f(
        None, "named kinds of layer, each the fields it sets in mixer, attention, position, ffn "
        "and norm: {local: {attention: {window: 1024}}, global: {position: {theta: 1e6}}}")
    layer_pattern: tuple[str, ...] | None = _f(
        None, "the type of each layer, repeated over the layers (one entry per layer: an "
        "explicit list)")

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (0 without RoPE): a fraction of the head, or
        latent attention's rope_dims."""
        if self.position.kind != "rope":
            return 0
        if self.attention.latent is not None:
            return self.attention.latent.rope_dims
        return int(self.attention.head_dim * self.position.fraction)

    @property
    def attention_scale(self) -> float:
        """attention.scale, else 1/sqrt(head_dim) — for latent attention under YaRN with
        mscale_all_dim, times m(mscale_all_dim)², as DeepSeek scales its scores."""
        if self.attention.scale is not None:
            return self.attention.scale
        scale, sc = 1.0 / math.sqrt(self.attention.head_dim), self.position.scaling
        if self.attention.latent is not None and sc is not None and sc.kind == "yarn" and \
                sc.mscale_all_dim:
            scale *= sc.yarn_mscale(sc.mscale_all_dim) ** 2
        return scale

    def layer_plan(self) -> tuple[tuple[LayerType, ...], tuple[str, ...]]:
        """The layer types and the type of each layer of one period (repeated over the layers).
        Without `layer_types`, the per-layer shorthands make them: `mixer.pattern` a type per
        mixer, `attention.pattern` local (the window) and global (none), `ffn.pattern` moe and
        dense (one FFN of kind moe.expert); together, a type per combination (`mamba+dense`).
        A model without either has one type, named ''."""
        if self.layer_types is not None and self.layer_pattern is not None:
            return self.layer_types, self.layer_pattern
        no_window = (("attention.window", None), ("attention.global_tokens", None))
        shorthands = [
            [(k, (("mixer.kind", k),)) for k in self.mixer.pattern or ()],
            [(k, () if k == "local" else no_window) for k in self.attention.pattern or ()],
            [(k, () if k == "moe" else (("ffn.kind", self.ffn.moe.expert),))
             for k in (self.ffn.pattern or ()) if self.ffn.moe is not None]]
        given = [p for p in shorthands if p]
        if not given:
            return (LayerType(""),), ("",)
        period = min(math.lcm(*map(len, given)), max(self.layers, self.decoder_layers or 0))
        kinds = [tuple(p[i % len(p)] for p in given) for i in range(period)]
        names = ["+".join(name for name, _ in kind) for kind in kinds]
        types = {n: LayerType(n, sum((o for _, o in kind), ())) for n, kind in zip(names, kinds)}
        return tuple(types.values()), tuple(names)

    def layer_type_names(self, layers: int | None = None) -> tuple[str, ...]:
        """The type of each layer (of a stack of `layers`, default the model's)."""
        return _repeat(self.layer_plan()[1], layers or self.layers)

    def layer_mixers(self, layers: int | None = None) -> tuple[MixerKind, ...]:
        """The sequence mixer of each layer (read off the layer types, unresolved)."""
        kinds = {t.name: t.get("mixer.kind", self.mixer.kind) for t in self.layer_plan()[0]}
        return tuple(kinds.get(name, self.mixer.kind) for name in self.layer_type_names(layers))

    @property
    def attends(self) -> bool:
        """Does any layer attend (softmax or linear), so that attention.heads applies?"""
        return any(m not in HEADLESS_MIXERS for m in self.all_mixers)

    @property
    def softmax_attends(self) -> bool:
        """Does any layer use softmax attention (masks, windows, scores, positions inside)?"""
        return "attention" in self.all_mixers

    @property
    def all_mixers(self) -> tuple[MixerKind, ...]:
        """Mixers of every layer of every stack."""
        return self.layer_mixers(max(self.layers, self.decoder_layers or 0))

    @property
    def mamba_inner(self) -> int:
        """Inner width of a mamba layer (expand·d_model; 0 without mamba layers)."""
        return self.mixer.mamba.expand * self.d_model if self.mixer.mamba else 0



def _repeat(pattern: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    return tuple(pattern[i % len(pattern)] for i in range(n))

