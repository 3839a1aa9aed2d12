"""Layer types: a spec names kinds of layer, each the fields it sets, and gives every layer one.

One test-local spec has three types — `local` (a window of 4, a mixture of experts), `global`
(another RoPE θ with linear scaling) and `nope` (no rotary positions, a smaller dense FFN) — over
four layers. It lowers to what each layer's type says, runs on eager as a plain-torch model
configured layer by layer (``tests.reference_models.Llama``) and on the generated kernels as on
eager, and layers of one type share their kernels. The per-layer shorthands (`mixer.pattern`,
`attention.pattern`, `ffn.pattern`) give the same program as their layer-types form. Bad layer
types are refused with one message naming the field (the contract of test_spec_errors).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import archc
from archc.cli import main
from archc.errors import SpecError
from archc.ir.attrs import format_value
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.text import format_program
from archc.spec import dump_yaml, from_dict, load_spec, load_yaml, to_dict
from archc.spec.load import layer_ffns, layer_kinds, layer_spec
from archc.spec.schema import Spec
from tests.reference_models import KVCache, Llama, LlamaConfig, prefill_then_decode
from tests.test_spec_errors import DELETE, Bad, _check_message, with_edits

LAYER_TYPES: dict[str, Any] = {
    "name": "tiny-layer-types", "family": "decoder", "vocab_size": 61, "d_model": 32,
    "layers": 4, "max_seq_len": 32, "dtype": "f32",
    "attention": {"heads": 4, "kv_heads": 2},
    "ffn": {"kind": "swiglu", "d_ff": 64},
    "norm": {"kind": "rmsnorm", "eps": 1e-6},
    "position": {"kind": "rope", "theta": 10000},
    "embedding": {"tied": False},
    "layer_types": {
        "local": {"attention": {"window": 4}, "ffn": {"kind": "moe",
                                                      "moe": {"experts": 4, "top_k": 2}}},
        "global": {"position": {"theta": 1000000, "scaling": {"kind": "linear", "factor": 4}}},
        "nope": {"position": {"kind": "none"}, "ffn": {"d_ff": 48}},
    },
    "layer_pattern": ["local", "global", "local", "nope"],
}
# What each layer is, written from the YAML above for the reference, not from archc's Spec.
REFERENCE = {
    "local": LlamaConfig(heads=4, kv_heads=2, eps=1e-6, theta=10000.0, window=4, top_k=2),
    "global": LlamaConfig(heads=4, kv_heads=2, eps=1e-6, theta=1e6, rope_factor=4.0),
    "nope": LlamaConfig(heads=4, kv_heads=2, eps=1e-6, theta=10000.0, rope=False),
}
PATTERN = LAYER_TYPES["layer_pattern"]
RTOL = 1e-5   # eager against the plain-torch model, f32: as test_eager_reference says


def spec() -> Spec:
    return from_dict(LAYER_TYPES)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    return float((got - want).abs().max() / want.abs().max())


# ---- what each layer runs --------------------------------------------------------------------

def test_each_layer_runs_its_type() -> None:
    s = spec()
    assert s.layer_type_names() == tuple(PATTERN)
    assert [layer_spec(s, i).attention.window for i in range(4)] == [4, None, 4, None]
    assert [layer_spec(s, i).position.theta for i in range(3)] == [1e4, 1e6, 1e4]
    assert layer_spec(s, 1).position.scaling.factor == 4.0
    assert layer_spec(s, 0).position.scaling is None
    assert layer_spec(s, 3).position.kind == "none"
    assert [layer_spec(s, i).ffn.kind for i in range(4)] == ["moe", "swiglu", "moe", "swiglu"]
    assert (layer_spec(s, 1).ffn.d_ff, layer_spec(s, 3).ffn.d_ff,
            layer_spec(s, 0).ffn.moe.experts) == (64, 48, 4)
    assert layer_ffns(s) == ("moe", "dense", "moe", "dense")
    assert layer_kinds(s) == ("local", "global", "local", "global")


def test_the_program_follows_each_layers_type() -> None:
    g = lower(spec()).graphs[0]
    rotation = {i: g.nodes[i] for i, n in enumerate(g) if n.op == Op.PARAM and "rope" in n.name}
    # one cos/sin table per RoPE setting, named by the first type that has it
    assert sorted(n.name for n in rotation.values()) == ["rope.global.cos_sin",
                                                         "rope.local.cos_sin"]
    exprs = {n.name: format_value(n.attr("expr")) for n in rotation.values()}
    assert "theta=10000.0" in exprs["rope.local.cos_sin"] and "factor" not in \
        exprs["rope.local.cos_sin"]
    assert "theta=1000000.0" in exprs["rope.global.cos_sin"] and "factor=4.0" in \
        exprs["rope.global.cos_sin"]
    # rope ops (q and k) of layers 0, 1, 2 in order; the NoPE layer has none
    ropes = [g.nodes[n.inputs[2]].name for n in g if n.op == Op.ROPE]
    assert ropes == ["rope.local.cos_sin"] * 2 + ["rope.global.cos_sin"] * 2 + \
        ["rope.local.cos_sin"] * 2
    assert [n.attr("window") for n in g if n.op == Op.MASK] == [4, None, 4, None]
    assert sum(n.op == Op.ROUTER for n in g) == 2
    shapes = {n.name: tuple(n.shape) for n in g if n.op == Op.PARAM}
    assert shapes["layers.0.ffn.experts.gate.weight"] == (4, 64, 32)
    assert shapes["layers.1.ffn.gate.weight"] == (64, 32)
    assert shapes["layers.3.ffn.gate.weight"] == (48, 32)
    assert "layers.1.ffn.router.weight" not in shapes


def _eager_and_reference(configs: dict[str, LlamaConfig]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of archc's eager interpreter and of the plain-torch model with one config per
    layer, over the same weights: a prefill of 11 tokens (past the window of 4), then 3 tokens
    one at a time through each side's cache, batch 2."""
    model = archc.from_spec(spec(), seed=5)
    assert model.weights is not None
    reference = Llama([configs[t] for t in PATTERN], {k: v.clone() for k, v in
                                                      model.weights.items()})
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return prefill_then_decode(model.compile("eager").session, reference, ids, 11,
                                   KVCache())


def test_eager_matches_a_plain_torch_model_configured_layer_by_layer() -> None:
    got, want = _eager_and_reference(REFERENCE)
    err = relative_error(got, want)
    assert err <= RTOL, f"max error {err:.2e} of the largest logit"


@pytest.mark.parametrize("slip", [
    {"global": LlamaConfig(heads=4, kv_heads=2, eps=1e-6, theta=10000.0)},      # θ of local
    {"local": LlamaConfig(heads=4, kv_heads=2, eps=1e-6, theta=10000.0, top_k=2)},  # no window
    {"nope": LlamaConfig(heads=4, kv_heads=2, eps=1e-6, theta=10000.0)},        # with RoPE
    {"global": LlamaConfig(heads=4, kv_heads=2, eps=1e-6, theta=1e6)},          # unscaled
], ids=["one-theta", "no-window", "rope-everywhere", "no-scaling"])
def test_the_comparison_sees_each_layers_difference(slip: dict[str, LlamaConfig]) -> None:
    """The reference given one layer type wrong: the comparison above would fail."""
    got, want = _eager_and_reference({**REFERENCE, **slip})
    assert relative_error(got, want) > 100 * RTOL


def test_triton_kernels_match_eager_and_layers_of_a_type_share_them(tmp_path: Path) -> None:
    """The generated kernels (Triton's interpreter, f32) against eager, prefill past the window
    then decode; and twice the layers (the pattern repeated) make no more distinct kernels."""
    model = archc.from_spec(spec(), seed=3)
    eager, triton = model.compile("eager"), model.compile("triton", cache_dir=tmp_path)
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    outs = []
    for session in (triton.session, eager.session):
        session.reset()
        outs.append(torch.cat([session.step(ids[:, :7])] +
                              [session.step(ids[:, t:t + 1]) for t in range(7, 9)], dim=1))
    err = relative_error(*outs)
    assert err <= 1e-4, f"max error {err:.2e}"   # test_triton_models' f32 tolerance, and why
    units = triton.session.generated.units
    doubled = archc.from_spec(from_dict({**LAYER_TYPES, "layers": 8}), seed=3).compile(
        "triton", cache_dir=tmp_path).session.generated.units
    assert len(doubled) == len(units)
    # the windowed attention of both local layers is one kernel, launched by each (in the
    # decoder's run; the last-token variant's run launches it too)
    windowed = [u for u in units if u.family == "attention" and "window=4" in u.uses[0][2]]
    assert len(windowed) == 1
    assert [i for graph, i, _ in windowed[0].uses if graph == "decoder"] == [9, 36]


# ---- the shorthands are layer types ----------------------------------------------------------

def _zoo(name: str, edits: dict[str, Any]) -> dict[str, Any]:
    return with_edits(yaml.safe_load((Path(__file__).parents[1] / "specs" /
                                      f"{name}.yaml").read_text()), edits)


# Each tiny spec with a per-layer shorthand, written out by hand as layer types.
WRITTEN_OUT = {
    "tiny-gemma2": {"attention.pattern": DELETE, "attention.window": DELETE,
                    "layer_types": {"local": {"attention": {"window": 8}}, "global": {}},
                    "layer_pattern": ["local", "global"]},
    "tiny-longctx": {"attention.pattern": DELETE, "attention.window": DELETE,
                     "attention.global_tokens": DELETE,
                     "layer_types": {"local": {"attention": {"window": 8, "global_tokens": 2}},
                                     "global": {}},
                     "layer_pattern": ["local", "global"]},
    "tiny-jamba": {"mixer.pattern": DELETE, "ffn.pattern": DELETE,
                   "layer_types": {"mamba+dense": {"mixer": {"kind": "mamba"},
                                                   "ffn": {"kind": "swiglu"}},
                                   "attention+moe": {},
                                   "mamba+moe": {"mixer": {"kind": "mamba"}},
                                   "attention+dense": {"ffn": {"kind": "swiglu"}}},
                   "layer_pattern": ["mamba+dense", "attention+moe", "mamba+moe",
                                     "attention+dense"]},
    "tiny-qwen3-next": {"mixer.pattern": DELETE,
                        "layer_types": {"gated_deltanet": {"mixer": {"kind": "gated_deltanet"}},
                                        "attention": {}},
                        "layer_pattern": ["gated_deltanet", "attention"]},
}


def test_every_tiny_spec_with_a_shorthand_is_written_out_here() -> None:
    from tests.conftest import TINY_SPECS
    shorthand = {n for n in TINY_SPECS if any(
        getattr(load_spec(n), section).pattern is not None
        for section in ("mixer", "attention", "ffn"))}
    assert shorthand == set(WRITTEN_OUT)


@pytest.mark.parametrize("name", sorted(WRITTEN_OUT))
def test_a_shorthand_gives_the_program_of_its_layer_types(name: str) -> None:
    """The IR (with each node's origin) of the zoo spec and of its layer-types form are one."""
    short, written = load_spec(name), from_dict(_zoo(name, WRITTEN_OUT[name]))
    assert written.layer_types is not None and short.layer_types is None
    assert format_program(lower(short), provenance=True) == \
        format_program(lower(written), provenance=True)


# ---- the spec round trip, export-spec and show -------------------------------------------------

def test_layer_types_round_trip_through_yaml(tmp_path: Path) -> None:
    s = spec()
    for full in (False, True):
        assert from_dict(yaml.safe_load(dump_yaml(s, full=full))) == s
    assert to_dict(s)["layer_types"]["global"] == {
        "position": {"theta": 1e6, "scaling": {"kind": "linear", "factor": 4.0}}}
    path = tmp_path / "lt.yaml"
    path.write_text(yaml.safe_dump(LAYER_TYPES))
    assert main(["export-spec", str(path), "-o", str(tmp_path / "out.yaml")]) == 0
    assert load_yaml(tmp_path / "out.yaml") == s


def test_show_gives_a_line_per_layer_type(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lt.yaml"
    path.write_text(yaml.safe_dump(LAYER_TYPES))
    assert main(["show", str(path)]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("layer types"))
    got = " ".join(lines[start:start + 4]).removeprefix("layer types ")
    assert "local: layers 0, 2; attention window 4; ffn moe, d_ff 64 × 4 experts (swiglu), " \
        "top-2 " in got
    assert "global: layer 1; positions rope θ=1e+06, linear ×4 " in got
    assert "nope: layer 3; ffn d_ff 48; positions none" in got


# ---- refusals --------------------------------------------------------------------------------

def _type(name: str, **sections: Any) -> dict[str, Any]:
    """LAYER_TYPES' layer_types with type `name` set to `sections`."""
    return {**copy.deepcopy(LAYER_TYPES["layer_types"]), name: sections}


TABLE: list[Bad] = [
    Bad("unknown-type-in-pattern", {"layer_pattern": ["local", "globl", "local", "nope"]},
        "layer_pattern[1]", ("'globl'", "not a layer type", "did you mean 'global'?"),
        "local, global, nope"),
    Bad("unknown-field", {"layer_types": _type("nope", attention={"windw": 4})},
        "layer_types.nope.attention.windw", ("unknown key", "did you mean 'window'?"), "window"),
    Bad("ill-typed-field", {"layer_types": _type("nope", attention={"window": "wide"})},
        "layer_types.nope.attention.window", ("'wide'", "not a whole number"),
        "a whole number ≥ 1"),
    Bad("unknown-section", {"layer_types": _type("nope", atention={"window": 4})},
        "layer_types.nope.atention", ("unknown key", "did you mean 'attention'?"), "position"),
    Bad("a-models-field", {"layer_types": _type("nope", embedding={"tied": True})},
        "layer_types.nope.embedding", ("the model's, not a layer's",), "mixer, attention"),
    Bad("section-not-a-mapping", {"layer_types": _type("nope", ffn="moe")},
        "layer_types.nope.ffn", ("'moe'", "not a mapping"), "a mapping with keys kind"),
    Bad("field-of-another-kind", {"layer_types": _type("nope", position={"kind": "none",
                                                                         "theta": 5.0})},
        "layer_types.nope.position.theta", ("5.0", "applies only when position.kind is rope"),
        "remove it"),
    Bad("invalid-in-the-layer", {"layer_types": _type("nope", attention={"kv_heads": 3})},
        "layer_types.nope.attention.kv_heads", ("3 does not divide attention.heads (4)",),
        "one of 1, 2, 4"),
    Bad("makes-a-models-field-invalid", {"layer_types": _type("nope", attention={"heads": 5,
                                                                                 "head_dim": 8})},
        "layer_types.nope", ("makes attention.kv_heads invalid", "2 does not divide "
                             "attention.heads (5)"), "one of 1, 5"),
    Bad("missing-beside-its-kind", {"layer_types": _type("nope", position={
        "scaling": {"kind": "yarn", "factor": 2.0}})},
        "layer_types.nope.position.scaling.original_max_seq_len", ("is missing for yarn",),
        "context the model was trained on"),
    Bad("pattern-without-types", {"layer_types": DELETE}, "layer_pattern",
        ("[local, global, local, nope]", "layer_types is not set"), "set layer_types"),
    Bad("types-without-pattern", {"layer_pattern": DELETE}, "layer_pattern",
        ("is missing",), "local, global, nope"),
    Bad("unused-type", {"layer_types": _type("spare")}, "layer_types.spare",
        ("no layer has this type",), "name it in layer_pattern"),
    Bad("pattern-longer-than-layers", {"layer_pattern": PATTERN + ["local"]}, "layer_pattern",
        ("5 entries for 4 layers",), "at most 4 entries"),
    Bad("shorthand-beside-types", {"attention.pattern": ["local", "global"],
                                   "attention.window": 4},
        "attention.pattern", ("[local, global]", "beside layer_pattern"), "one of them"),
    Bad("pattern-in-a-type", {"layer_types": _type("nope", ffn={"pattern": ["dense"]})},
        "layer_types.nope.ffn.pattern", ("a list", "one kind of layer"), "layer_pattern"),
    Bad("score-field-in-a-mamba-type", {"layer_types": _type("nope", mixer={"kind": "mamba"},
                                                             attention={"window": 4})},
        "layer_types.nope.attention.window", ("layers of this type are mamba layers",),
        "remove it"),
    Bad("learned-positions-in-a-type", {"layer_types": _type("nope", position={
        "kind": "learned"})},
        "layer_types.nope.position.kind", ("learned positions are the model's",),
        "rope, alibi or none"),
    Bad("bad-type-name", {"layer_types": {**LAYER_TYPES["layer_types"], "9lives": {}}},
        "layer_types.'9lives'", ("not a valid layer type name",), "starting with a letter"),
    Bad("empty-layer-types", {"layer_types": {}}, "layer_types", ("an empty mapping",),
        "a mapping of type names"),
    Bad("empty-weights-path", {"weights": ""}, "weights", ("an empty string",),
        "the path of a checkpoint"),
]


def test_table_ids_are_unique() -> None:
    assert len({row.id for row in TABLE}) == len(TABLE)


@pytest.mark.parametrize("row", TABLE, ids=[row.id for row in TABLE])
def test_bad_layer_types_are_refused(row: Bad) -> None:
    data = with_edits(LAYER_TYPES, row.edits)
    with pytest.raises(SpecError) as info:
        from_dict(data, source="x.yaml")
    _check_message(info.value, "x.yaml", row)


def test_an_architecture_step_applies_to_every_layer_or_is_refused() -> None:
    from archc.spec.steps import StepError, parse_steps
    step = parse_steps("qk-norm")[0].apply(spec())
    assert all(layer_spec(step, i).attention.qk_norm for i in range(4))
    assert layer_spec(step, 0).attention.window == 4    # what the type sets stays
    with pytest.raises(StepError, match="changes attention.window, which layer type 'local' "
                                        "sets"):
        parse_steps("sliding-window:8")[0].apply(spec())
