"""Attention modifiers written as expressions in a spec, on eager.

- The attention op with explicit `score`, `mask` and `normalizer` against plain-torch attention
  over materialized scores written here: ALiBi from per-head slopes, packed documents from a
  per-token input, attention sinks, sigmoid attention, chunked attention, a dilated window, a
  per-KV-head bias; GQA 9 query heads over 3 KV heads, odd lengths, prefill, a step after a
  past and a decode step.
- Whole specs: the unfused program equals the fused one, prefill + decode steps equal the full
  forward, and every tiny spec's shorthand equals its expressions.
- Refusals: a table of bad expressions, each one line naming the field (and the CLI's).

Tolerance (f32): 1e-5 of the output's scale — both sides sum in f32, in different orders.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import archc
from archc.errors import RunError, SpecError
from archc.ir.attrs import Call
from archc.ir.graph import GraphBuilder, Program
from archc.ir.lower import lower
from archc.ir.modifiers import parse
from archc.ir.ops import Op
from archc.ir.paramexpr import alibi_slopes
from archc.ir.shapes import B, shape
from archc.model import Model
from archc.passes import optimize
from archc.runtime.eager import EagerContext, EagerSession, run_graph
from archc.spec import load_spec
from archc.spec.load import from_dict, layer_specs, to_dict
from archc.spec.schema import MASK_KINDS
from tests.conftest import TINY_SPECS
from tests.model_files import tiny_hf_dir  # noqa: F401  (a fixture)

TOL = 1e-5
HEADS, KV_HEADS, D = 9, 3, 8
ROOT = Path(__file__).resolve().parents[1]


def close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> bool:
    return bool((got - want).abs().max() <= tol * want.abs().max())


# ---- the op against materialized scores ---------------------------------------------------

Fn = Callable[..., torch.Tensor]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, score: Fn,
              mask: Fn, normalizer: str = "softmax", sink: torch.Tensor | None = None,
              bias: float = 0.0) -> torch.Tensor:
    """Attention written out: scores [B, H, T, L] materialized, `score(s, i, j, h, g)` and
    `mask(i, j, h, g)` at query positions i [T, 1] (the last T of L), key positions j [1, L],
    head h [H, 1, 1] and KV head g; then softmax (with a sink logit per head in the
    denominator) or σ(s + bias). Output [B, T, H·D]."""
    b, h, t, _ = q.shape
    length, groups = k.shape[2], h // k.shape[1]
    kk, vv = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    s = (q @ kk.transpose(-1, -2)) * scale
    i = torch.arange(length - t, length)[:, None]
    j = torch.arange(length)[None, :]
    heads = torch.arange(h)[:, None, None]
    s = score(s, i, j, heads, heads // groups)
    keep = mask(i, j, heads, heads // groups).expand(b, h, t, length)
    if normalizer == "sigmoid":
        w = torch.sigmoid(s + bias) * keep
    else:
        s = s.masked_fill(~keep, float("-inf"))
        if sink is None:
            w = torch.softmax(s, dim=-1)
        else:
            m = torch.maximum(s.amax(-1), sink[None, :, None])[..., None]
            e = torch.exp(s - m)
            w = e / (torch.exp(sink[None, :, None, None] - m) + e.sum(-1, keepdim=True))
    out = w @ vv
    return out.transpose(1, 2).reshape(b, t, h * out.shape[-1])


def causal(i: torch.Tensor, j: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return j <= i


def plain(s: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return s


SLOPES = torch.tensor([0.5 ** (n + 1) for n in range(HEADS)])
SINKS = torch.linspace(-1.0, 2.0, HEADS)
BONUS = torch.tensor([0.3, -0.7, 1.1])       # per KV head
DOCS = 3


def doc_of(length: int) -> torch.Tensor:
    """[2, L]: packed documents, boundaries at different places in the two rows."""
    rows = [torch.arange(length) * DOCS // length,
            (torch.arange(length) + 2) * DOCS // (length + 2)]
    return torch.stack(rows).to(torch.int32)


# name: (op attrs, operands by name (L → tensor), reference's score and mask, normalizer kw)
CASES: dict[str, tuple[dict[str, Any], dict[str, Callable[[int], torch.Tensor]], Fn, Fn,
                       dict[str, Any]]] = {
    "alibi-slopes": (
        dict(causal=True, score="score - slope[head] * (q_pos - kv_pos)"),
        {"slope": lambda n: SLOPES},
        lambda s, i, j, h, g: s - SLOPES[h] * (i - j), causal, {}),
    "documents": (
        dict(mask="kv_pos <= q_pos and doc[q_pos] == doc[kv_pos]"),
        {"doc": doc_of},
        plain, None, {}),       # mask written per length below
    "sinks": (
        dict(causal=True, normalizer=Call("softmax", (), (("sinks", "sink"),))),
        {"sink": lambda n: SINKS},
        plain, causal, {"sink": SINKS}),
    "sigmoid": (
        dict(causal=True, normalizer=Call("sigmoid", (), (("bias", -2.0),))),
        {}, plain, causal, {"normalizer": "sigmoid", "bias": -2.0}),
    "chunked": (
        dict(mask="kv_pos <= q_pos and q_pos // 4 == kv_pos // 4"),
        {}, plain, lambda i, j, *_: (j <= i) & (i // 4 == j // 4), {}),
    "dilated-window": (
        dict(mask="kv_pos <= q_pos and q_pos - kv_pos < 3 * 2 and (q_pos - kv_pos) % 2 == 0"),
        {}, plain, lambda i, j, *_: (j <= i) & (i - j < 6) & ((i - j) % 2 == 0), {}),
    "kv-head-bias-softcap": (
        dict(causal=True, softcap=3.0, score="score + bonus[kv_head] * (kv_pos % 3)"),
        {"bonus": lambda n: BONUS},
        lambda s, i, j, h, g: 3.0 * torch.tanh(s / 3.0) + BONUS[g] * (j % 3), causal, {}),
}
SHAPES = [(13, 13), (5, 17), (1, 17)]     # a prefill, T new tokens after a past, a decode step


def op_program(attrs: dict[str, Any], names: dict[str, torch.Tensor], length: int,
               t: int) -> Program:
    """One attention of q [B, 9, T, 8] over k, v [B, 3, L, 8], its named operands inputs."""
    b = GraphBuilder("decoder")
    q = b.input("q", shape(B, HEADS, t, D), "f32")
    k = b.input("k", shape(B, KV_HEADS, length, D), "f32")
    v = b.input("v", shape(B, KV_HEADS, length, D), "f32")
    at = {**attrs}
    for key in ("score", "mask"):
        if key in at:
            at[key] = parse(at[key], key).tree
    extra = [b.input(n, shape(B, length), "i32") if n == "doc" else
             b.input(n, shape(*x.shape), "f32") for n, x in sorted(names.items())]
    b.output("o", b.emit(Op.ATTENTION, q, k, v, *extra, scale=0.3, **at))
    return Program("m", (b.build(),))


@pytest.mark.parametrize("t,length", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_op_equals_materialized_attention(case: str, t: int, length: int) -> None:
    attrs, operands, score, mask, kw = CASES[case]
    names = {n: f(length) for n, f in operands.items()}
    if case == "documents":
        doc = names["doc"].long()

        def mask(i: torch.Tensor, j: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
            return ((j <= i) & (doc[:, i] == doc[:, j]))[:, None]   # [B, 1, T, L]
    g = torch.Generator().manual_seed(t * 31 + length)
    q = torch.randn(2, HEADS, t, D, generator=g)
    k, v = (torch.randn(2, KV_HEADS, length, D, generator=g) for _ in range(2))
    got = run_graph(op_program(attrs, names, length, t).graphs[0], {},
                    {"q": q, "k": k, "v": v, **names},
                    EagerContext({"B": 2, "T": t, "P": length - t, "S": 0}))["o"]
    want = reference(q, k, v, 0.3, score, mask, **kw)
    assert close(got, want), (case, float((got - want).abs().max()))


def test_a_reference_that_differs_is_caught() -> None:
    """The comparison can fail: the sink left out, or the chunk boundary moved, shows."""
    attrs, operands, _, _, kw = CASES["sinks"]
    names = {n: f(13) for n, f in operands.items()}
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, HEADS, 13, D, generator=g), \
        torch.randn(2, KV_HEADS, 13, D, generator=g), torch.randn(2, KV_HEADS, 13, D, generator=g)
    got = run_graph(op_program(attrs, names, 13, 13).graphs[0], {},
                    {"q": q, "k": k, "v": v, **names},
                    EagerContext({"B": 2, "T": 13, "P": 0, "S": 0}))["o"]
    assert not close(got, reference(q, k, v, 0.3, plain, causal))
    assert close(got, reference(q, k, v, 0.3, plain, causal, **kw))


# ---- whole specs ----------------------------------------------------------------------------

def smollm2(attention: dict[str, Any], **top: Any) -> dict[str, Any]:
    """tiny-smollm2 (GQA 9/3) as data, its attention section updated."""
    data = yaml.safe_load((ROOT / "specs" / "tiny-smollm2.yaml").read_text())
    data["attention"].update(attention)
    data.update(top)
    return data


PACKED = {"mask": "kv_pos <= q_pos and doc[q_pos] == doc[kv_pos]", "inputs": {"doc": 0},
          "score": "score - slope[head] * (q_pos - kv_pos)",
          "params": {"slope": [0.5 ** (n + 1) for n in range(HEADS)], "sink": 0.5},
          "normalizer": {"kind": "softmax", "sinks": "sink"}}
SIGMOID = {"normalizer": {"kind": "sigmoid", "bias": -2.0},
           "mask": "kv_pos <= q_pos and q_pos // 4 == kv_pos // 4"}


@pytest.mark.parametrize("attention", [PACKED, SIGMOID], ids=["packed-alibi-sinks", "sigmoid"])
def test_unfused_equals_fused_and_decode_equals_prefill(attention: dict[str, Any]) -> None:
    model = archc.from_spec(from_dict(smollm2(attention)))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    doc = doc_of(11)
    inputs = {"doc": doc} if "inputs" in attention else {}
    unfused = EagerSession(model.graph, model.weights, max_seq_len=64)
    fused = model.compile("eager")
    whole = fused(ids, inputs=inputs)
    assert close(unfused.step(ids, inputs=inputs), whole)
    # prefill 6 tokens, then one token a step, each step given its document id
    s = fused.session
    s.reset()
    steps = [s.step(ids[:, :6], inputs={k: x[:, :6] for k, x in inputs.items()})]
    for n in range(6, 11):
        steps.append(s.step(ids[:, n:n + 1], inputs={k: x[:, n:n + 1] for k, x in inputs.items()}))
    assert close(torch.cat(steps, dim=1), whole)
    if inputs:
        # the documents matter: one document for all is another function
        assert not close(fused(ids, inputs={"doc": torch.zeros_like(doc)}), whole, 1e-3)


def test_per_token_inputs_continue_and_refuse() -> None:
    """A step without a value continues each row's last document; an input without a default
    must be given; an unknown one is refused."""
    required = dict(PACKED, inputs={"doc": None})
    compiled = archc.from_spec(from_dict(smollm2(required))).compile("eager")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    doc = doc_of(9)
    whole = compiled(ids, inputs={"doc": doc})
    with pytest.raises(RunError, match="per-token input 'doc', which has no default"):
        compiled(ids)
    with pytest.raises(RunError, match="reads no per-token input 'dox'"):
        compiled(ids, inputs={"doc": doc, "dox": doc})
    s = compiled.session
    s.reset()
    first = s.step(ids[:, :8], inputs={"doc": doc[:, :8]})
    assert torch.equal(doc[:, 8], doc[:, 7])            # the 9th token continues the 8th's
    assert close(torch.cat([first, s.step(ids[:, 8:])], dim=1), whole)


def alibi_rewritten(spec_name: str) -> tuple[Model, Model]:
    """tiny-bloom (ALiBi), and the same weights with ALiBi as a score expression reading the
    slopes from the checkpoint by name."""
    model = archc.from_spec(load_spec(spec_name))
    data = to_dict(model.spec)
    data["position"] = {"kind": "none"}
    data["attention"].update(score="score - slope[head] * (q_pos - kv_pos)",
                             params={"slope": "alibi.slopes"})
    weights = {**model.weights, "alibi.slopes": alibi_slopes(model.spec.attention.heads)}
    return model, Model(from_dict(data), weights=weights)


def test_alibi_from_checkpoint_slopes() -> None:
    shorthand, explicit = alibi_rewritten("tiny-bloom")
    assert "alibi.slopes" in explicit.graph.graphs[0].params
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    want = shorthand.compile("eager")(ids)
    assert close(explicit.compile("eager")(ids), want)
    # the slopes are read: other values give other logits
    other = Model(explicit.spec, weights={**explicit.weights,
                                          "alibi.slopes": alibi_slopes(4).flip(0)})
    assert not close(other.compile("eager")(ids), want, 1e-3)


# ---- every tiny spec's shorthand is its expressions -----------------------------------------

def explicit_attention(layer: Any, family: str) -> dict[str, Any]:
    """The attention fields of one kind of layer with its shorthand written as expressions."""
    att, out = layer.attention, {}
    w, g = att.window, att.global_tokens
    if att.mask not in MASK_KINDS:   # written as an expression already (Llama 4's chunks)
        out["mask"] = att.mask
    elif family == "encoder":
        out["mask"] = "true" if w is None else \
            f"abs(q_pos - kv_pos) < {w}" + (f" or kv_pos < {g} or q_pos < {g}" if g else "")
    else:
        near = f"q_pos - kv_pos < {w}" + (f" or kv_pos < {g}" if g else "")
        out["mask"] = "kv_pos <= q_pos" if w is None else f"kv_pos <= q_pos and ({near})"
    score = "score" if att.softcap is None else f"{att.softcap!r} * tanh(score / {att.softcap!r})"
    if att.score is not None:   # an expression already: of the shorthand's score
        assert score == "score" and layer.position.kind != "alibi", "a score over a shorthand"
        score = att.score
    if layer.position.kind == "alibi":
        slopes = alibi_slopes(att.heads)
        if layer.position.alibi_scaled:
            slopes = slopes * layer.attention_scale
        score = f"{score} - slopes[head] * (q_pos - kv_pos)"
        out["params"] = {"slopes": slopes.tolist()}
    if score != "score":
        out["score"] = score
    return out


def rewritten(spec: Any) -> dict[str, Any]:
    """`spec` as data with every attention shorthand (mask kind, window, global tokens,
    attention.pattern, softcap, ALiBi) written as explicit expressions, per layer type."""
    data = copy.deepcopy(to_dict(spec))
    types, pattern = spec.layer_plan()
    for key in ("window", "global_tokens", "pattern", "softcap"):
        data["attention"].pop(key, None)
    for section in ("mixer", "ffn"):
        data.get(section, {}).pop("pattern", None)
    if spec.position.kind == "alibi":
        data["position"] = {"kind": "none"}
    overrides = {}
    for t, layer in zip(types, layer_specs(spec)):
        mine = _nested_overrides(t)
        if layer.mixer.kind == "attention":
            mine.setdefault("attention", {}).update(explicit_attention(layer, spec.family))
            for key in ("window", "global_tokens"):
                mine["attention"].pop(key, None)
        overrides[t.name or "all"] = mine
    data["layer_types"] = overrides
    data["layer_pattern"] = [name or "all" for name in pattern]
    return data


def _nested_overrides(t: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in t.overrides:
        *parents, key = path.split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[key] = value
    return out


SOFTMAX_TINY = [n for n in TINY_SPECS if load_spec(n).softmax_attends
                and load_spec(n).family != "encoder-decoder"]


@pytest.mark.parametrize("name", SOFTMAX_TINY)
def test_each_shorthand_equals_its_expressions(name: str) -> None:
    spec = load_spec(name)
    explicit_spec = from_dict(rewritten(spec))
    plan = [layer_specs(explicit_spec)[i] for i in range(len(explicit_spec.layer_plan()[0]))]
    assert all(ls.attention.window is None and ls.attention.softcap is None and
               ls.position.kind != "alibi" for ls in plan)
    model = archc.from_spec(spec)
    explicit = Model(explicit_spec, weights=model.weights)
    ids = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    if spec.family == "encoder":
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[1, 10:] = 0
        want = model.compile("eager")(ids, attention_mask=mask)
        got = explicit.compile("eager")(ids, attention_mask=mask)
    else:
        want, got = model.compile("eager")(ids), explicit.compile("eager")(ids)
    assert close(got, want), (name, float((got - want).abs().max()))


# ---- refusals ------------------------------------------------------------------------------

BAD = [
    ("undefined-name", {"mask": "kv_pos <= q_pos and dok[q_pos] == 1"}, "attention.mask",
     "column 21", "dok is not a per-head parameter or per-token input"),
    ("unknown-variable", {"score": "score * temperature"}, "attention.score", "column 9",
     "undefined name 'temperature'"),
    ("wrong-type", {"score": "q_pos < kv_pos"}, "attention.score", "column 1",
     "a score is a float expression"),
    ("mask-reads-score", {"mask": "score > 0"}, "attention.mask", "column 1",
     "a mask may not use score"),
    ("and-of-numbers", {"mask": "q_pos and kv_pos"}, "attention.mask", "column", "takes bools"),
    ("unbalanced", {"mask": "(kv_pos <= q_pos"}, "attention.mask", "column 17",
     "expected ')' to close the '(' at column 1"),
    ("import", {"mask": "__import__('os')"}, "attention.mask", "column 1",
     "unknown function __import__()"),
    ("string", {"mask": "doc == 'a'"}, "attention.mask", "column 8",
     "strings are not allowed"),
    ("attribute", {"score": "score.real"}, "attention.score", "column 6",
     "attribute access (a.b) is not allowed"),
    ("huge-literal", {"mask": "q_pos - kv_pos < 99999999999999999999"}, "attention.mask",
     "column 18", "too large"),
    ("huge-float", {"score": "score * 1e300"}, "attention.score", "column 9", "too large"),
    ("param-unread", {"params": {"slope": 0.5}}, "attention.params.slope", "",
     "no expression reads it"),
    ("sinks-undeclared", {"normalizer": {"kind": "softmax", "sinks": "s"}},
     "attention.normalizer.sinks", "", "is not in attention.params"),
    ("param-wrong-length", {"score": "score + b[head]", "params": {"b": [1.0, 2.0]}},
     "attention.params.b", "", "has 2 values"),
    ("window-beside-mask", {"mask": "kv_pos <= q_pos", "window": 4}, "attention.window", "",
     "attention.mask is an expression"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_expression_is_refused_in_one_line(case: tuple[Any, ...]) -> None:
    _, attention, path, column, says = case
    with pytest.raises(SpecError) as info:
        from_dict(smollm2(attention), source="x.yaml")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"x.yaml: {path}: "), msg
    assert column in msg and says in msg, msg


def test_bad_expression_in_a_layer_type_names_the_type() -> None:
    data = smollm2({}, layer_types={"docs": {"attention": {"mask": "kv_pos <= q_pos and"}}},
                   layer_pattern=["docs"])
    with pytest.raises(SpecError, match=r"^layer_types\.docs\.attention\.mask: column 20: "):
        from_dict(data)


def test_cli_refuses_a_bad_expression_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(smollm2({"mask": "kv_pos <= q_pos and __import__"})))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "archc", "show", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "attention.mask: column 21: undefined name '__import__'" in err[0]
    assert "Traceback" not in done.stderr


def test_expressions_print_and_parse_back() -> None:
    from archc.ir.text import format_program, parse_program
    program = lower(from_dict(smollm2(PACKED)))
    fused = optimize(program, archc.model.EAGER_PIPELINE)
    for p in (program, fused):
        text = format_program(p, provenance=True)
        assert parse_program(text) == p
    att = next(n for n in fused.graphs[0].nodes if n.op == Op.ATTENTION)
    assert att.attr("normalizer") == Call("softmax", (), (("sinks", "sink"),))
    assert att.attr("score") is not None and att.attr("mask") is not None


# ---- paged and ring attention run the same expressions ------------------------------------

def test_paged_eager_runs_the_expressions(tmp_path: Path) -> None:
    """The paged engine's steps (scattered blocks, rows of several sequences) give the
    contiguous cache's logits with ALiBi slopes, sinks and a window written as expressions."""
    from tests.test_paged import check_against_contiguous
    attention = {key: PACKED[key] for key in ("score", "params", "normalizer")}
    attention["mask"] = "kv_pos <= q_pos and q_pos - kv_pos < 5"
    path = tmp_path / "paged.yaml"
    path.write_text(yaml.safe_dump(smollm2(attention, name="paged-expressions")))
    check_against_contiguous(str(path), "eager")


RING = {"alibi-sinks-chunks": dict(mask="kv_pos <= q_pos and q_pos // 5 == kv_pos // 5",
                                   score="score - slope[head] * (q_pos - kv_pos)",
                                   normalizer=Call("softmax", (), (("sinks", "sink"),))),
        "sigmoid-dilated": dict(mask="kv_pos <= q_pos and (q_pos - kv_pos) % 2 == 0",
                                score="score - slope[head] * abs(q_pos - kv_pos)",
                                normalizer=Call("sigmoid", (), (("bias", -1.0),)))}


@pytest.mark.parametrize("case", RING)
@pytest.mark.parametrize("cp,length", [(2, 20), (3, 23)])
def test_ring_attention_runs_the_expressions(case: str, cp: int, length: int) -> None:
    """Each rank's zig-zag tokens against every block passed round the ring, one online step
    of the normalizer each, equal the attention on one rank."""
    from archc.ir.shapes import T
    from archc.passes.context import context_parallel, zigzag
    from archc.runtime.comm import SimulatedComm, SimulatedWorld, run_simulated
    b = GraphBuilder("decoder")
    q = b.input("q", shape(B, HEADS, T, D), "f32")
    k, v = (b.input(n, shape(B, KV_HEADS, T, D), "f32") for n in ("k", "v"))
    names = [b.param(n, shape(HEADS), "f32") for n in
             (("sink", "slope") if "sinks" in case else ("slope",))]
    at = {key: parse(x, key).tree if isinstance(x, str) else x for key, x in RING[case].items()}
    b.output("o", b.emit(Op.ATTENTION, q, k, v, *names, scale=0.3, **at))
    program = Program("m", (b.build(),))
    ring = context_parallel(program, cp)
    g = torch.Generator().manual_seed(length)
    x = {n: torch.randn(2, h, length, D, generator=g)
         for n, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    params = {"slope": SLOPES, "sink": SINKS}
    dims = {"B": 2, "P": 0, "S": 0}
    whole = run_graph(program.graphs[0], params, x, EagerContext({**dims, "T": length}))["o"]
    parts, world = zigzag(length, cp), SimulatedWorld(cp)

    def rank(r: int) -> torch.Tensor:
        mine = parts[r]
        inputs = {n: t[:, :, mine] for n, t in x.items()}
        ctx = EagerContext({**dims, "T": len(mine)}, comms={"cp": SimulatedComm(world, r)})
        return run_graph(ring.graphs[0], params, {**inputs, "positions": mine}, ctx)["o"]
    for got, mine in zip(run_simulated(cp, rank), parts):
        assert close(got, whole[:, mine]), case


# ---- explain, and a borrowed checkpoint --------------------------------------------------

def brute_force_tiles(seen: torch.Tensor, block_m: int, block_n: int) -> tuple[int, int, int]:
    """(full, partial, empty) tiles of a [T, L] visibility, pair by pair."""
    counts = [0, 0, 0]
    for a in range(0, seen.shape[0], block_m):
        for b in range(0, seen.shape[1], block_n):
            tile = seen[a:a + block_m, b:b + block_n]
            counts[0 if bool(tile.all()) else 2 if not bool(tile.any()) else 1] += 1
    return counts[0], counts[1], counts[2]


def test_explain_shows_expressions_and_tiles(capsys: pytest.CaptureFixture[str]) -> None:
    from archc.cli import main
    from archc.codegen.blocks import launch_config
    length = 300                                     # tiles that end inside the sequence
    assert main(["explain", "sinks-banded", "--length", str(length), "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    cfg = launch_config("attention", "gpu", T=length, L=length, D=16, bytes=2)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for mask, seen in (("kv_pos <= q_pos and q_pos - kv_pos < 128", (j <= i) & (i - j < 128)),
                       ("kv_pos <= q_pos", j <= i)):
        full, partial, empty = brute_force_tiles(seen, cfg["BLOCK_M"], cfg["BLOCK_N"])
        tiles = full + partial + empty
        block = out.split(f"  mask       {mask}\n")[1].split("\n\n")[0]
        assert 'normalizer softmax(sinks="sinks")' in block
        assert f"tiles      {tiles}: {full} full, {partial} partial, {empty} empty; " \
            f"{1 - empty / tiles:.4f} visited" in block, block
    assert f"at {length} tokens, tiles of {cfg['BLOCK_M']} × {cfg['BLOCK_N']}" in out


def test_a_borrowed_checkpoint_runs_with_an_expression(tiny_hf_dir: Path,  # noqa: F811
                                                       tmp_path: Path) -> None:
    """`weights: PATH` with the attention changed to an expression: the window written as a
    mask runs the checkpoint as the window shorthand does, and not as the checkpoint does."""
    from tests.test_borrowed_weights import variant
    window = variant(tiny_hf_dir, tmp_path / "window", {"attention": {"window": 4}})
    written = variant(tiny_hf_dir, tmp_path / "mask",
                      {"attention": {"mask": "kv_pos <= q_pos and q_pos - kv_pos < 4"}})
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    want = archc.load(window).compile("eager")(ids)
    assert close(archc.load(written).compile("eager")(ids), want)
    assert not close(archc.load(tiny_hf_dir).compile("eager")(ids), want, 1e-3)
