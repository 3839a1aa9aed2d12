"""Malformed specs are refused with one message naming the file, the field, the value and what
is allowed — from a mapping, from a YAML file, and through the CLI (exit 2, no traceback).

Each row of the table is one small change to a valid base spec; the base itself loads (first
test), so every refusal comes from the row's change.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from archc.errors import SpecError
from archc.spec import dump_yaml, from_dict, load_spec, load_yaml, zoo_names

ROOT = Path(__file__).resolve().parents[1]

# A Llama-like decoder: GQA 4/2, SwiGLU, RMSNorm, RoPE, untied head.
BASE: dict[str, Any] = {
    "name": "base", "family": "decoder", "vocab_size": 97, "d_model": 64, "layers": 2,
    "max_seq_len": 64, "dtype": "f32",
    "attention": {"heads": 4, "kv_heads": 2},
    "ffn": {"kind": "swiglu"},
    "norm": {"kind": "rmsnorm", "eps": 1e-5},
    "position": {"kind": "rope", "theta": 10000.0},
    "embedding": {"tied": False},
}

DELETE = object()  # an edit that removes the key


def with_edits(base: dict[str, Any], edits: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with each dotted path set to its value (or removed)."""
    data = copy.deepcopy(base)
    for path, value in edits.items():
        *parents, key = path.split(".")
        section = data
        for name in parents:
            section = section.setdefault(name, {})
        if value is DELETE:
            del section[key]
        else:
            section[key] = value
    return data


# A BERT-like encoder, for the rows about what encoders may not have.
ENCODER = with_edits(BASE, {"family": "encoder", "attention.mask": "bidirectional",
                            "embedding.tied": DELETE})
MOE = {"kind": "moe", "moe": {"experts": 4, "top_k": 2}}


@dataclass(frozen=True)
class Bad:
    """One malformed spec: the change, the field path the message must name, pieces the
    problem must say (the bad value first), and a piece of what is allowed."""

    id: str
    edits: dict[str, Any]
    path: str
    says: tuple[str, ...]
    allowed: str
    base: dict[str, Any] = field(default_factory=lambda: BASE)

    @property
    def data(self) -> dict[str, Any]:
        return with_edits(self.base, self.edits)


TABLE: list[Bad] = [
    # ---- unknown keys, with "did you mean" -----------------------------------------------------
    Bad("unknown-top-level", {"vocab": 97}, "vocab",
        ("unknown key", "did you mean 'vocab_size'?"), "vocab_size"),
    Bad("unknown-in-section", {"attention.head": 4}, "attention.head",
        ("unknown key", "did you mean 'heads'?"), "kv_heads"),
    Bad("kv_heads-at-top-level", {"kv_heads": 2}, "kv_heads",
        ("unknown key", "did you mean 'attention.kv_heads'?"), "attention"),
    Bad("theta-in-attention", {"attention.theta": 10000.0}, "attention.theta",
        ("unknown key", "did you mean 'position.theta'?"), "heads"),
    Bad("unknown-in-nested-section", {"position.scaling": {"kind": "linear", "facter": 2.0}},
        "position.scaling.facter", ("unknown key", "did you mean 'factor'?"), "factor"),
    Bad("unknown-bias-projection", {"attention.bias": {"query": True}}, "attention.bias.query",
        ("unknown key",), "q, k, v, o"),
    Bad("key-with-spaces", {"max seq len": 64}, "'max seq len'", ("unknown key",), "max_seq_len"),
    # ---- wrong types ---------------------------------------------------------------------------
    Bad("text-for-int", {"d_model": "64"}, "d_model", ("'64'", "not a whole number"),
        "a whole number ≥ 1"),
    Bad("float-for-int", {"attention.heads": 4.0}, "attention.heads",
        ("4.0", "not a whole number"), "a whole number ≥ 1"),
    Bad("fraction-for-int", {"layers": 2.5}, "layers", ("2.5", "not a whole number"),
        "a whole number"),
    Bad("int-for-bool", {"embedding.tied": 1}, "embedding.tied", ("1", "not true/false"),
        "true, false"),
    Bad("text-for-bool", {"attention.qk_norm": "yes"}, "attention.qk_norm",
        ("'yes'", "not true/false"), "true, false"),
    Bad("bool-for-float", {"norm.eps": True}, "norm.eps", ("true", "not a number"),
        "a number > 0"),
    Bad("text-for-float", {"norm.eps": "small"}, "norm.eps", ("'small'", "not a number"),
        "a number > 0"),
    Bad("int-for-text", {"name": 5}, "name", ("5", "not text"), "a string"),
    Bad("list-for-mapping", {"attention": [4, 2]}, "attention", ("a list", "not a mapping"),
        "keys heads, kv_heads"),
    Bad("bool-for-mapping", {"ffn": True}, "ffn", ("true", "not a mapping"), "keys kind"),
    Bad("null-for-mapping", {"norm": None}, "norm", ("null", "not a mapping"), "keys kind"),
    Bad("text-for-bias", {"attention.bias": "yes"}, "attention.bias",
        ("'yes'", "not a mapping"), "true, false, or a mapping with keys q, k, v, o"),
    Bad("mapping-for-list", {"attention.pattern": {"local": 1}, "attention.window": 4},
        "attention.pattern", ("a mapping", "not a list"), "a non-empty list of local, global"),
    Bad("text-for-list", {"attention.pattern": "local", "attention.window": 4},
        "attention.pattern", ("'local'", "not a list"), "a non-empty list of local, global"),
    Bad("empty-list", {"attention.pattern": []}, "attention.pattern", ("an empty list",),
        "a non-empty list"),
    Bad("null-for-required", {"vocab_size": None}, "vocab_size", ("null",), "a whole number"),
    # ---- unknown choices -----------------------------------------------------------------------
    Bad("family-typo", {"family": "decodr"}, "family",
        ("'decodr'", "did you mean 'decoder'?"), "decoder, encoder, encoder-decoder"),
    Bad("mask-typo", {"attention.mask": "casual"}, "attention.mask",
        ("'casual'", "did you mean 'causal'?"), "causal, bidirectional, prefix"),
    Bad("dtype-spelling", {"dtype": "fp32"}, "dtype", ("'fp32'", "did you mean 'f32'?"),
        "f32, f16, bf16"),
    Bad("norm-kind", {"norm.kind": "batchnorm"}, "norm.kind", ("'batchnorm'",),
        "layernorm, rmsnorm"),
    Bad("pattern-entry-typo", {"attention.pattern": ["local", "globl"], "attention.window": 4},
        "attention.pattern[1]", ("'globl'", "did you mean 'global'?"), "local, global"),
    Bad("embedding-scale-word", {"embedding.scale": "sqrt"}, "embedding.scale", ("'sqrt'",),
        "sqrt_d_model"),
    # ---- out of range --------------------------------------------------------------------------
    Bad("heads-zero", {"attention.heads": 0}, "attention.heads", ("0", "out of range"),
        "a whole number ≥ 1"),
    Bad("window-zero", {"attention.window": 0}, "attention.window", ("0", "out of range"),
        "a whole number ≥ 1"),
    Bad("window-negative", {"attention.window": -4}, "attention.window",
        ("-4", "out of range"), "a whole number ≥ 1"),
    Bad("eps-zero", {"norm.eps": 0.0}, "norm.eps", ("0.0", "out of range"), "a number > 0"),
    Bad("eps-negative", {"norm.eps": -1e-5}, "norm.eps", ("-1e-05", "out of range"),
        "a number > 0"),
    Bad("fraction-above-one", {"position.fraction": 1.5}, "position.fraction",
        ("1.5", "out of range"), "a number > 0, ≤ 1.0"),
    Bad("fraction-zero", {"position.fraction": 0.0}, "position.fraction",
        ("0.0", "out of range"), "a number > 0, ≤ 1.0"),
    Bad("theta-negative", {"position.theta": -1.0}, "position.theta", ("-1.0", "out of range"),
        "a number ≥ 1.0"),
    Bad("vocab-negative", {"vocab_size": -3}, "vocab_size", ("-3", "out of range"),
        "a whole number ≥ 1"),
    Bad("one-expert", {"ffn": {"kind": "moe", "moe": {"experts": 1, "top_k": 1}}},
        "ffn.moe.experts", ("1", "out of range"), "a whole number ≥ 2"),
    Bad("scaling-below-one", {"position.scaling": {"kind": "linear", "factor": 0.5}},
        "position.scaling.factor", ("0.5", "out of range"), "a number ≥ 1.0"),
    Bad("softcap-zero", {"attention.softcap": 0.0}, "attention.softcap",
        ("0.0", "out of range"), "a number > 0"),
    Bad("size-past-int32", {"d_model": 2**31}, "d_model", ("2147483648", "too large"),
        "to 2147483647"),
    Bad("float-past-double", {"position.theta": 10**400}, "position.theta",
        ("(401 digits)", "too large"), "a number ≥ 1.0"),
    Bad("eps-nan", {"norm.eps": float("nan")}, "norm.eps", ("nan", "not finite"),
        "a number > 0"),
    Bad("theta-inf", {"position.theta": float("inf")}, "position.theta", ("inf", "not finite"),
        "a number ≥ 1.0"),
    Bad("scale-minus-inf", {"attention.scale": float("-inf")}, "attention.scale",
        ("-inf", "not finite"), "a number > 0"),
    # ---- inconsistent values -------------------------------------------------------------------
    Bad("heads-not-dividing-d_model", {"attention.heads": 5, "attention.kv_heads": DELETE},
        "attention.heads", ("5", "does not divide d_model (64)"), "set attention.head_dim"),
    Bad("kv_heads-not-dividing-heads", {"attention.kv_heads": 3}, "attention.kv_heads",
        ("3", "does not divide attention.heads (4)"), "one of 1, 2, 4"),
    Bad("kv_heads-above-heads", {"attention.kv_heads": 8}, "attention.kv_heads",
        ("8", "does not divide attention.heads (4)"), "one of 1, 2, 4"),
    Bad("rope-odd-rotary-dims", {"position.fraction": 0.1875}, "position.fraction",
        ("0.1875", "gives 3 rotary dims"), "an even number ≥ 2"),
    Bad("rope-odd-head_dim", {"attention.head_dim": 15}, "attention.head_dim",
        ("15", "odd"), "an even number"),
    Bad("local-layers-without-window", {"attention.pattern": ["local", "global"]},
        "attention.pattern", ("[local, global]", "attention.window is not set"),
        "set attention.window"),
    Bad("window-without-local-layers", {"attention.pattern": ["global"], "attention.window": 4},
        "attention.window", ("4", "no local layer"), "local layers in attention.pattern"),
    Bad("pattern-longer-than-layers", {"attention.pattern": ["global"] * 3}, "attention.pattern",
        ("[global, global, global]", "3 entries for 2 layers"), "at most 2 entries"),
    Bad("top_k-above-experts", {"ffn": {"kind": "moe", "moe": {"experts": 2, "top_k": 3}}},
        "ffn.moe.top_k", ("3", "more than ffn.moe.experts (2)"), "1 to 2"),
    Bad("moe-without-section", {"ffn": {"kind": "moe"}}, "ffn.moe", ("missing",),
        "experts, top_k"),
    Bad("moe-section-on-dense-ffn", {"ffn.moe": {"experts": 4}}, "ffn.moe",
        ("a mapping", "applies only when ffn.kind is moe", "'swiglu'"), "remove it"),
    Bad("bias-on-moe-experts", {"ffn": {**MOE, "bias": True}}, "ffn.bias",
        ("true", "the experts' biases are ffn.moe.bias"), "ffn.moe.bias: true"),
    Bad("swish-beta-on-geglu-experts", {"ffn": {**MOE, "moe": {**MOE["moe"], "expert": "geglu",
                                                                "swish_beta": 1.702}}},
        "ffn.moe.swish_beta", ("1.702", "geglu experts have no swish gate"), "expert: swiglu"),
    Bad("clamp-on-mlp-experts", {"ffn": {**MOE, "moe": {**MOE["moe"], "expert": "mlp",
                                                         "clamp": 7.0}}},
        "ffn.moe.clamp", ("7.0", "mlp experts have no gate and up"), "gated experts"),
    Bad("parallel-with-post-norm", {"block.parallel": True, "norm.placement": "post"},
        "block.parallel", ("true", "'post'"), "norm.placement: pre"),
    Bad("separate-norms-in-serial-block", {"block.shared_norm": False}, "block.shared_norm",
        ("false", "serial"), "block.parallel: true"),
    Bad("theta-with-learned-positions", {"position": {"kind": "learned", "theta": 10000.0}},
        "position.theta", ("10000.0", "applies only when position.kind is rope", "'learned'"),
        "remove it"),
    Bad("interleaved-with-alibi", {"position": {"kind": "alibi", "interleaved": True}},
        "position.interleaved", ("true", "applies only when position.kind is rope"),
        "remove it"),
    Bad("unit_offset-with-layernorm", {"norm": {"kind": "layernorm", "unit_offset": True}},
        "norm.unit_offset", ("true", "applies only when norm.kind is rmsnorm"), "remove it"),
    Bad("activation-with-swiglu", {"ffn.activation": "relu"}, "ffn.activation",
        ("'relu'", "applies only when ffn.kind is mlp"), "remove it"),
    Bad("original-context-with-linear-scaling",
        {"position.scaling": {"kind": "linear", "factor": 2.0, "original_max_seq_len": 32}},
        "position.scaling.original_max_seq_len", ("32", "yarn or llama3 or dynamic"),
        "remove it"),
    Bad("yarn-without-original-context", {"position.scaling": {"kind": "yarn", "factor": 4.0}},
        "position.scaling.original_max_seq_len", ("missing for yarn",), "a whole number ≥ 1"),
    Bad("dynamic-without-original-context",
        {"position.scaling": {"kind": "dynamic", "factor": 2.0}},
        "position.scaling.original_max_seq_len", ("missing for dynamic",), "a whole number ≥ 1"),
    Bad("dynamic-over-two-rotary-dims",
        {"position.fraction": 0.125,
         "position.scaling": {"kind": "dynamic", "factor": 2.0, "original_max_seq_len": 32}},
        "position.scaling.kind", ("'dynamic'", "2 rotary dims"), "4 or more rotary dims"),
    Bad("llama3-high-below-low",
        {"position.scaling": {"kind": "llama3", "factor": 8.0, "original_max_seq_len": 32,
                              "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
        "position.scaling.high_freq_factor", ("1.0", "below low_freq_factor (4.0)"),
        "a number ≥ low_freq_factor"),
    Bad("qk-norm-gain-without-qk-norm", {"attention.qk_norm_gain": False},
        "attention.qk_norm_gain", ("false", "attention.qk_norm is false"),
        "set attention.qk_norm"),
    Bad("relative-distance-below-buckets",
        {"position": {"kind": "relative", "buckets": 32, "max_distance": 8}},
        "position.max_distance", ("8", "position.buckets (32)"), "≥ 32"),
    Bad("sinusoidal-odd-d_model", {"position": {"kind": "sinusoidal"}, "d_model": 63,
                                   "attention.head_dim": 16},
        "d_model", ("63", "sin/cos pairs"), "an even number"),
    Bad("encoder-with-causal-mask", {"attention.mask": "causal"}, "attention.mask",
        ("'causal'", "encoder"), "bidirectional", base=ENCODER),
    Bad("decoder-with-bidirectional-mask", {"attention.mask": "bidirectional"}, "attention.mask",
        ("'bidirectional'", "decoder"), "causal, prefix"),
    Bad("encoder-decoder-with-prefix-mask", {"family": "encoder-decoder",
                                             "attention.mask": "prefix"},
        "attention.mask", ("'prefix'", "encoder-decoder"), "causal"),
    Bad("decoder_layers-on-a-decoder", {"decoder_layers": 2}, "decoder_layers",
        ("2", "decoder"), "family: encoder-decoder"),
    Bad("untied-head-on-an-encoder", {"embedding.tied": False}, "embedding.tied",
        ("false", "no output head"), "remove it", base=ENCODER),
    Bad("logit-softcap-on-an-encoder", {"output.softcap": 30.0}, "output.softcap",
        ("30.0", "encoder"), "output.final_norm", base=ENCODER),
    Bad("token-types-on-a-decoder", {"embedding.token_types": 2}, "embedding.token_types",
        ("2", "decoder"), "family: encoder"),
    Bad("sizing-rule-on-a-plain-mlp", {"ffn": {"kind": "mlp", "multiple_of": 256}},
        "ffn.multiple_of", ("256", "non-gated mlp"), "set ffn.d_ff"),
    Bad("d_ff-against-the-sizing-rule", {"ffn": {"kind": "swiglu", "d_ff": 100,
                                                 "multiple_of": 32}},
        "ffn.d_ff", ("100", "gives 192"), "192"),
    Bad("name-with-space-and-bang", {"name": "my model!"}, "name",
        ("'my model!'", "not a valid model name"), "letters, digits"),
    Bad("name-too-long", {"name": "m" * 65}, "name", ("'" + "m" * 65 + "'",), "1-64"),
    Bad("name-missing", {"name": DELETE}, "name", ("missing",), "model name"),
    Bad("vocab-missing", {"vocab_size": DELETE}, "vocab_size", ("missing",), "vocabulary"),
    Bad("heads-missing", {"attention": {}}, "attention.heads", ("missing",), "query heads"),
]


def _check_message(err: SpecError, source: str, row: Bad) -> None:
    msg = str(err)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{source}: {row.path}: "), msg
    assert err.path == row.path
    for piece in row.says:
        assert piece in err.problem, f"{piece!r} not in {msg!r}"
    assert err.allowed is not None and row.allowed in err.allowed, msg
    assert msg.endswith(f"(allowed: {err.allowed})"), msg


def test_base_spec_loads() -> None:
    spec = from_dict(BASE, source="x.yaml")
    assert (spec.attention.heads, spec.attention.kv_heads, spec.attention.head_dim) == (4, 2, 16)
    assert from_dict(ENCODER).family == "encoder"
    assert from_dict(with_edits(BASE, {"ffn": MOE})).ffn.moe is not None


def test_table_is_large_and_ids_are_unique() -> None:
    assert len(TABLE) >= 30
    assert len({row.id for row in TABLE}) == len(TABLE)


@pytest.mark.parametrize("row", TABLE, ids=[row.id for row in TABLE])
def test_malformed_mapping_is_refused(row: Bad) -> None:
    with pytest.raises(SpecError) as info:
        from_dict(row.data, source="x.yaml")
    _check_message(info.value, "x.yaml", row)


@pytest.mark.parametrize("row", TABLE, ids=[row.id for row in TABLE])
def test_malformed_file_is_refused(row: Bad, tmp_path: Path) -> None:
    path = tmp_path / f"{row.id}.yaml"
    path.write_text(yaml.safe_dump(row.data, sort_keys=False, allow_unicode=True))
    with pytest.raises(SpecError) as info:
        load_yaml(path)
    _check_message(info.value, str(path), row)


# ---- problems only a file can have: YAML text, encoding, the document's shape -------------------

BASE_YAML = yaml.safe_dump(BASE, sort_keys=False)


def _line_of(text: str, piece: str) -> int:
    """1-based line of the first occurrence of `piece`."""
    return text[:text.index(piece)].count("\n") + 1


TWICE_TOP = BASE_YAML + "d_model: 128\n"
TWICE_NESTED = BASE_YAML.replace("heads: 4", "heads: 4\n  heads: 8")

# (id, file text, field path ("" for the file as a whole), pieces the message must say)
FILES: list[tuple[str, str | bytes, str, tuple[str, ...]]] = [
    ("yaml-syntax", "name: x\n  d_model: [64\n", "", ("not valid YAML", "line 2")),
    ("unclosed-flow-mapping", BASE_YAML + "block: {parallel: true\n", "",
     ("not valid YAML", "line")),
    ("tab-indentation", "name: x\nattention:\n\theads: 4\n", "",
     ("not valid YAML", "line 3", "'\\t'")),
    ("python-object-tag", "name: !!python/object/apply:os.system [ls]\n", "",
     ("not valid YAML", "line 1", "constructor")),
    ("key-given-twice", TWICE_TOP, "d_model",
     ("given twice", f"lines {_line_of(TWICE_TOP, 'd_model:')} and "
      f"{_line_of(TWICE_TOP, 'd_model: 128')}")),
    ("nested-key-given-twice", TWICE_NESTED, "attention.heads",
     ("given twice", f"lines {_line_of(TWICE_NESTED, 'heads: 4')} and "
      f"{_line_of(TWICE_NESTED, 'heads: 8')}")),
    ("list-document", "- name: x\n- d_model: 64\n", "", ("a list", "not a mapping")),
    ("scalar-document", "tiny-llama3\n", "", ("'tiny-llama3'", "not a mapping")),
    ("empty-file", "", "", ("is empty",)),
    ("only-comments", "# a spec will go here\n", "", ("is empty",)),
    ("not-utf8", b"name: \xff\xfe\n", "", ("not UTF-8",)),
]


@pytest.mark.parametrize("case", FILES, ids=[c[0] for c in FILES])
def test_malformed_file_names_the_problem(case: tuple[str, str | bytes, str, tuple[str, ...]],
                                          tmp_path: Path) -> None:
    name, text, where, says = case
    path = tmp_path / f"{name}.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_yaml(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: " + (f"{where}: " if where else "")), msg
    for piece in says:
        assert piece in msg, f"{piece!r} not in {msg!r}"


def test_missing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(SpecError, match=r"nowhere\.yaml: cannot read the file"):
        load_yaml(path)


def test_exponent_without_a_dot_reads_as_a_number(tmp_path: Path) -> None:
    """YAML 1.1 reads `1e-5` as text; spec files read it as the number it looks like."""
    path = tmp_path / "eps.yaml"
    path.write_text(BASE_YAML.replace("eps: 1.0e-05", "eps: 1e-6"))
    assert load_yaml(path).norm.eps == 1e-6


# ---- the loader refuses nothing valid ---------------------------------------------------------

@pytest.mark.parametrize("name", zoo_names())
def test_zoo_spec_and_its_full_dump_load_back(name: str) -> None:
    spec = load_spec(name)
    for full in (False, True):
        assert from_dict(yaml.safe_load(dump_yaml(spec, full=full))) == spec


# ---- through the command line -----------------------------------------------------------------

def _archc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "archc.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _one_line_error(returncode: int, stderr: str) -> str:
    assert returncode == 2
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_cli_refuses_a_bad_spec_file(tmp_path: Path) -> None:
    """The real command line, in its own interpreter: exit 2, one line, no traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(with_edits(BASE, {"attention.kv_heads": 3})))
    result = _archc("show", str(path))
    line = _one_line_error(result.returncode, result.stderr)
    assert f"{path}: attention.kv_heads: 3 does not divide attention.heads (4)" in line
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["show", "ir", "run"])
def test_cli_unknown_zoo_name_suggests_the_close_ones(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    returncode = main([command, "tiny-lama3"])
    line = _one_line_error(returncode, capsys.readouterr().err)
    assert "'tiny-lama3' is neither a spec file nor a zoo name" in line
    assert "did you mean tiny-llama3" in line


# The same contract in-process (no interpreter start-up), over more kinds of bad input.
@pytest.mark.parametrize("case", [
    ("unknown-key", yaml.safe_dump(with_edits(BASE, {"kv_heads": 2})),
     "kv_heads: unknown key; did you mean 'attention.kv_heads'?"),
    ("wrong-type", yaml.safe_dump(with_edits(BASE, {"norm.eps": "small"})),
     "norm.eps: 'small' is not a number"),
    ("yaml-syntax", "name: x\n  d_model: [64\n", "is not valid YAML at line 2"),
    ("empty-file", "", "is empty"),
], ids=lambda c: c[0])
@pytest.mark.parametrize("command", ["show", "ir", "run"])
def test_cli_commands_refuse_a_bad_spec_with_one_line(
        case: tuple[str, str, str], command: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    name, text, says = case
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    returncode = main([command, str(path)])
    captured = capsys.readouterr()
    line = _one_line_error(returncode, captured.err)
    assert line.startswith(f"archc {command}: error: {path}: ") and says in line, line
    assert captured.out == ""


def test_spec_reference_is_current() -> None:
    """docs/spec-reference.md is generated from the schema; regenerate with
    `python -m archc.spec.reference > docs/spec-reference.md`."""
    from pathlib import Path

    from archc.spec.reference import reference
    doc = Path(__file__).resolve().parents[1] / "docs" / "spec-reference.md"
    assert doc.read_text(encoding="utf-8") == reference()


def test_moe_with_mlp_experts_takes_an_activation() -> None:
    from archc.spec import from_dict
    base = {"name": "m", "vocab_size": 11, "d_model": 16, "layers": 1,
            "attention": {"heads": 2}, "ffn": {"kind": "moe", "d_ff": 8, "activation": "relu",
                                               "moe": {"experts": 2, "top_k": 1,
                                                       "expert": "mlp"}}}
    assert from_dict(base).ffn.activation == "relu"
    base["ffn"]["moe"]["expert"] = "swiglu"
    with pytest.raises(SpecError, match=r"ffn\.activation: 'relu' is set, but swiglu experts"):
        from_dict(base, source="m.yaml")
