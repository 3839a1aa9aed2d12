"""The per-layer sequence mixer: attention, linear attention and Mamba layers in one spec.

Valid hybrids load with the mixers each layer has; malformed ones are refused with one message
naming the field, the value and what is allowed (the contract of test_spec_errors, whose table
machinery this reuses).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from archc.errors import SpecError
from archc.spec import dump_yaml, from_dict, load_yaml
from tests.test_spec_errors import BASE, DELETE, ENCODER, Bad, _check_message, with_edits

# A pure Mamba decoder: no attention section, no FFN, no positions.
MAMBA = with_edits(BASE, {"mixer": {"kind": "mamba"}, "attention": DELETE,
                          "ffn": {"kind": "none"}, "position": {"kind": "none"}})
# Linear attention only: the attention section sizes its heads, nothing acts on scores.
LINEAR = with_edits(BASE, {"mixer": {"kind": "linear_attention"},
                           "position": {"kind": "learned"}})
HYBRID = with_edits(BASE, {"mixer": {"pattern": ["mamba", "attention"]}})
DELTANET = {"key_heads": 2, "value_heads": 4, "key_dim": 8, "value_dim": 6}
# Gated DeltaNet only: no attention section, no positions.
DELTA = with_edits(BASE, {"mixer": {"kind": "gated_deltanet", "deltanet": DELTANET},
                          "attention": DELETE, "position": {"kind": "none"}})
DELTA_HYBRID = with_edits(BASE, {"mixer": {"pattern": ["gated_deltanet", "attention"],
                                           "deltanet": DELTANET}})


def test_hybrid_layers_repeat_the_pattern() -> None:
    spec = from_dict(with_edits(HYBRID, {"layers": 5}))
    assert spec.layer_mixers() == ("mamba", "attention", "mamba", "attention", "mamba")
    assert spec.mixer.mamba is not None and spec.mixer.mamba.dt_rank == 4   # ⌈64 / 16⌉
    assert spec.mamba_inner == 128
    assert spec.attends and spec.softmax_attends


def test_pure_mamba_has_no_attention_sizes() -> None:
    spec = from_dict(MAMBA)
    assert spec.layer_mixers() == ("mamba", "mamba")
    assert (spec.attention.heads, spec.attention.kv_heads, spec.attention.head_dim) == \
        (None, None, None)
    assert not spec.attends and spec.ffn.d_ff is None
    for full in (False, True):
        assert from_dict(yaml.safe_load(dump_yaml(spec, full=full))) == spec


def test_gated_deltanet_layers_need_no_attention_heads() -> None:
    spec = from_dict(DELTA)
    assert spec.layer_mixers() == ("gated_deltanet", "gated_deltanet")
    assert not spec.attends and spec.attention.heads is None
    assert spec.mixer.deltanet is not None and spec.mixer.deltanet.chunk == 64
    hybrid = from_dict(DELTA_HYBRID)
    assert hybrid.layer_mixers() == ("gated_deltanet", "attention") and hybrid.softmax_attends


def test_linear_attention_takes_heads_but_no_score_settings() -> None:
    spec = from_dict(LINEAR)
    assert spec.attends and not spec.softmax_attends
    assert (spec.attention.heads, spec.attention.kv_heads) == (4, 2)


TABLE: list[Bad] = [
    Bad("mixer-kind-typo", {"mixer.kind": "mamba2"}, "mixer.kind",
        ("'mamba2'", "did you mean 'mamba'?"), "attention, linear_attention, mamba"),
    Bad("pattern-entry-typo", {"mixer.pattern": ["mamba", "atention"]}, "mixer.pattern[1]",
        ("'atention'", "did you mean 'attention'?"), "attention, linear_attention, mamba"),
    Bad("unknown-mamba-key", {"mixer.mamba": {"dstate": 8}}, "mixer.mamba.dstate",
        ("unknown key", "did you mean 'd_state'?"), "d_state", base=HYBRID),
    Bad("pattern-beside-kind", {"mixer.kind": "mamba"}, "mixer.kind",
        ("'mamba'", "beside mixer.pattern [mamba, attention]"), "pattern per layer",
        base=HYBRID),
    Bad("pattern-longer-than-layers", {"mixer.pattern": ["mamba", "attention", "mamba"]},
        "mixer.pattern", ("3 entries for 2 layers",), "at most 2 entries"),
    Bad("mamba-in-an-encoder", {"mixer.pattern": ["mamba", "attention"]}, "mixer.pattern",
        ("encoder", "mamba layers are causal recurrences"), "family: decoder", base=ENCODER),
    Bad("linear-in-an-encoder-decoder", {"family": "encoder-decoder",
                                         "mixer.kind": "linear_attention",
                                         "position": {"kind": "learned"}},
        "mixer.kind", ("'linear_attention' in an encoder-decoder",), "attention"),
    Bad("mamba-section-without-mamba-layers", {"mixer.mamba": {"d_state": 8}}, "mixer.mamba",
        ("no layer is mamba", "mixer.kind 'attention'"), "remove it"),
    Bad("heads-without-attending-layers", {"attention": {"heads": 4}}, "attention.heads",
        ("4", "no layer attends", "mixer.kind 'mamba'"), "remove it", base=MAMBA),
    Bad("bias-without-attending-layers", {"attention": {"bias": True}}, "attention.bias",
        ("no layer attends",), "remove it", base=MAMBA),
    Bad("heads-missing-for-linear-layers", {"attention": {}}, "attention.heads",
        ("missing", "mixer.kind 'linear_attention'"), "a whole number ≥ 1", base=LINEAR),
    Bad("window-without-softmax-layers", {"attention.window": 8}, "attention.window",
        ("8", "acts in softmax attention", "mixer.kind 'linear_attention'"), "remove it",
        base=LINEAR),
    Bad("softcap-without-softmax-layers", {"attention.softcap": 30.0}, "attention.softcap",
        ("30.0", "softmax"), "remove it", base=LINEAR),
    Bad("rope-without-softmax-layers", {"position": {"kind": "rope"}}, "position.kind",
        ("'rope'", "inside softmax attention", "mixer.kind 'mamba'"),
        "none, learned, sinusoidal", base=MAMBA),
    Bad("alibi-with-linear-layers-only", {"position": {"kind": "alibi"}}, "position.kind",
        ("'alibi'",), "none, learned, sinusoidal", base=LINEAR),
    Bad("d_state-zero", {"mixer.mamba": {"d_state": 0}}, "mixer.mamba.d_state",
        ("0", "out of range"), "a whole number ≥ 1", base=HYBRID),
    Bad("conv-of-one-tap", {"mixer.mamba": {"d_conv": 1}}, "mixer.mamba.d_conv",
        ("1", "out of range"), "a whole number ≥ 2", base=HYBRID),
    Bad("dt_rank-as-text", {"mixer.mamba": {"dt_rank": "auto"}}, "mixer.mamba.dt_rank",
        ("'auto'", "not a whole number"), "a whole number ≥ 1", base=HYBRID),
    Bad("d_ff-without-ffn", {"ffn": {"kind": "none", "d_ff": 64}}, "ffn.d_ff",
        ("64", "ffn.kind is 'none'"), "remove it", base=MAMBA),
    Bad("ffn-bias-without-ffn", {"ffn": {"kind": "none", "bias": True}}, "ffn.bias",
        ("true", "ffn.kind is 'none'"), "remove it", base=MAMBA),
    Bad("activation-without-ffn", {"ffn": {"kind": "none", "activation": "relu"}},
        "ffn.activation", ("'relu'", "applies only when ffn.kind is mlp or moe"), "remove it",
        base=MAMBA),
    Bad("deltanet-section-missing", {"mixer.deltanet": DELETE}, "mixer.deltanet",
        ("is missing", "gated_deltanet layers"), "key_heads, value_heads", base=DELTA_HYBRID),
    Bad("deltanet-section-without-deltanet-layers", {"mixer.deltanet": DELTANET},
        "mixer.deltanet", ("no layer is gated_deltanet",), "remove it"),
    Bad("deltanet-key-heads-not-dividing", {"mixer.deltanet.key_heads": 3},
        "mixer.deltanet.key_heads", ("3 does not divide value_heads (4)",), "a divisor",
        base=DELTA),
    Bad("deltanet-chunk-zero", {"mixer.deltanet.chunk": 0}, "mixer.deltanet.chunk",
        ("0", "out of range"), "a whole number ≥ 1", base=DELTA),
    Bad("deltanet-algorithm-typo", {"mixer.deltanet.algorithm": "chunk"},
        "mixer.deltanet.algorithm", ("'chunk'",), "chunked, recurrent", base=DELTA),
    Bad("shared-expert-gate-without-shared-expert",
        {"ffn": {"kind": "moe", "moe": {"experts": 4, "shared_expert_gate": True}}},
        "ffn.moe.shared_expert_gate", ("true", "there is no shared expert"),
        "ffn.moe.shared_expert_d_ff", base=DELTA),
    Bad("parallel-block-without-ffn", {"block.parallel": True}, "block.parallel",
        ("ffn.kind is 'none'",), "false", base=MAMBA),
]


@pytest.mark.parametrize("row", TABLE, ids=[row.id for row in TABLE])
def test_malformed_mixer_is_refused(row: Bad, tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        from_dict(row.data, source="x.yaml")
    _check_message(info.value, "x.yaml", row)
    path = tmp_path / f"{row.id}.yaml"
    path.write_text(yaml.safe_dump(row.data, sort_keys=False, allow_unicode=True))
    with pytest.raises(SpecError) as info:
        load_yaml(path)
    _check_message(info.value, str(path), row)


def test_every_base_loads() -> None:
    for base in (MAMBA, LINEAR, HYBRID, DELTA, DELTA_HYBRID):
        from_dict(base)
