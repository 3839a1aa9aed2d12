"""Translation validation of the tensor-parallel shard pass: the sharded program, run for N
simulated ranks (threads of one process meeting at collectives) on the eager interpreter, gives
what the unsharded program gives — prefill, then decode steps through each rank's KV cache —
for every tiny spec where the split applies, alone and after the default pipeline per rank, with
plain and with int4 (group 32) weights, and with a vocabulary that divides by N (the vocabulary-
parallel embedding and head). Where the spec cannot be split, the refusal names the spec field
and the tp values that work. Tolerance as tests/test_translation.py: 1e-5 of the output scale
(the sharded program sums the same products in a different order: per rank, then across)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from archc.cli import main
from archc.gpus import gpu
from archc.ir.attrs import Call
from archc.ir.graph import Graph, Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.ops.base import COLLECTIVE
from archc.passes import optimize, run_pipeline
from archc.passes.manager import run_pass
from archc.passes.shard import ShardError, shard_program
from archc.perf.roofline import decode_floor
from archc.quant.pack import quantize
from archc.runtime.comm import SimulatedComm, SimulatedWorld, run_simulated
from archc.runtime.eager import EagerSession
from archc.runtime.weights import materialize, quantizable, random_weights
from archc.spec import from_dict, load_spec, to_dict
from archc.spec.schema import Spec
from tests.conftest import TINY_SPECS

TOL = 1e-5
PREFILL, DECODE, BATCH = 5, 2, 2


def variant(name: str) -> Spec:
    """A tiny spec, `NAME+vocab96`: its vocabulary made 96 (divides by 2, 3 and 4), or
    `NAME+qk_norm`: with QK-norm (a norm over each head's dims, replicated)."""
    base, _, extra = name.partition("+")
    spec = load_spec(base)
    if extra == "qk_norm":
        return dataclasses.replace(spec, attention=dataclasses.replace(spec.attention,
                                                                       qk_norm=True))
    return dataclasses.replace(spec, vocab_size=96) if extra == "vocab96" else spec


@functools.cache
def model(name: str, quant: str | None = None) -> tuple[Spec, Program, dict]:
    """Spec, unsharded program and a seeded random checkpoint (every linear weight int4 in
    groups of 32 when `quant` is int4_g32, int8 with a scale per row when it is int8_ch)."""
    spec = variant(name)
    plain = lower(spec)
    checkpoint = random_weights(plain, seed=5)
    if quant is None:
        return spec, plain, checkpoint
    names = quantizable(plain)
    for k in names:
        checkpoint[k] = quantize(checkpoint[k], "int8") if quant == "int8_ch" else \
            quantize(checkpoint[k], "int4", group=32)
    return spec, lower(spec, quant={k: quant for k in names}), checkpoint


def refusal(spec: Spec, tp: int) -> str | None:
    """The spec field a split over tp ranks must be refused for, from the spec alone."""
    if any(m != "attention" for m in spec.layer_mixers(spec.layers)):
        return "mixer.kind"
    att, ffn = spec.attention, spec.ffn
    if ffn.moe is not None and ffn.moe.bias:   # no tp helps: named first, as mixers are
        return "ffn.moe.bias"
    if att.heads % tp:
        return "attention.heads"
    if att.kv_heads % tp and tp % att.kv_heads:
        return "attention.kv_heads"
    if ffn.kind != "none" and ffn.d_ff % tp:
        return "ffn.d_ff"
    return None


def outputs(spec: Spec, program: Program, checkpoint: dict,
            comm: SimulatedComm | None = None) -> list[torch.Tensor]:
    """Prefill then DECODE single-token steps (an encoder: one padded encode) on one rank."""
    gen = torch.Generator().manual_seed(11)
    session = EagerSession(program, checkpoint, max_seq_len=spec.max_seq_len,
                           comms={"tp": comm} if comm else None)
    ids = torch.randint(0, spec.vocab_size, (BATCH, PREFILL + DECODE), generator=gen)
    mask = torch.ones(BATCH, PREFILL, dtype=torch.long)
    mask[1, 3:] = 0
    if spec.family == "encoder":
        return [session.encode(ids[:, :PREFILL], mask)]
    extra = {}
    if spec.family == "encoder-decoder":
        extra = {"encoder_hidden": session.encode(ids[:, :PREFILL], mask), "encoder_mask": mask}
    out = [session.step(ids[:, :PREFILL], **extra)]
    for t in range(PREFILL, PREFILL + DECODE):
        out.append(session.step(ids[:, t:t + 1], **extra))
    return out


def on_ranks(spec: Spec, program: Program, checkpoint: dict, tp: int) -> list[list[torch.Tensor]]:
    world = SimulatedWorld(tp)
    return run_simulated(tp, lambda r: outputs(spec, program, checkpoint,
                                               SimulatedComm(world, r)))


def assert_same(spec: Spec, want: list[torch.Tensor], ranks: list[list[torch.Tensor]]) -> None:
    """Every rank's every call within TOL of the unsharded one; greedy tokens identical."""
    for r, got in enumerate(ranks):
        assert len(got) == len(want)
        for k, (a, b) in enumerate(zip(want, got)):
            assert a.shape == b.shape, f"rank {r} call {k}: {list(b.shape)} for {list(a.shape)}"
            err, scale = float((a - b).abs().max()), float(a.abs().max())
            assert err <= TOL * scale, f"rank {r} call {k}: max error {err:.3g} at {scale:.3g}"
            if spec.family != "encoder":
                assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))


def is_slice(expr: object) -> bool:
    """Is a param expression a rank's shard() of a checkpoint tensor?"""
    return isinstance(expr, Call) and expr.fn == "shard" and expr.args[0].fn == "w"


CASES = [(name, tp) for name in TINY_SPECS for tp in (2, 3, 4)]


@pytest.mark.parametrize(("name", "tp"), CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_sharded_program_computes_the_unsharded_one(name: str, tp: int) -> None:
    spec, program, checkpoint = model(name)
    field = refusal(spec, tp)
    if field is not None:
        with pytest.raises(ShardError, match=rf"{field} = .*tp values that work: 1\b"):
            shard_program(program, tp)
        return
    sharded = shard_program(program, tp)
    assert sum(n.op == Op.ALL_REDUCE for g in sharded for n in g) >= spec.layers
    assert_same(spec, outputs(spec, program, checkpoint), on_ranks(spec, sharded, checkpoint, tp))


@pytest.mark.parametrize(("name", "tp"), [("tiny-llama3", 2), ("tiny-llama2-70b", 4),
                                          ("tiny-falcon", 4), ("tiny-mixtral", 2),
                                          ("tiny-t5", 2), ("tiny-bloom", 4), ("tiny-phi2", 2),
                                          ("tiny-smollm2", 3), ("tiny-gemma2+vocab96", 2),
                                          ("tiny-llama3+qk_norm", 4), ("tiny-phi2+qk_norm", 2)])
def test_default_pipeline_on_each_rank(name: str, tp: int) -> None:
    """The optimized sharded program (the default pipeline run on it) against the unsharded
    unfused one."""
    spec, program, checkpoint = model(name)
    sharded = shard_program(program, tp)
    fast = optimize(sharded)
    assert not any(n.op in (Op.MATMUL, Op.SCORES) for g in fast for n in g)   # it did fuse
    collectives = [[n.op for g in p for n in g if n.op in COLLECTIVE] for p in (sharded, fast)]
    assert collectives[0] == collectives[1]         # no fusion took in (or dropped) one
    assert_same(spec, outputs(spec, program, checkpoint), on_ranks(spec, fast, checkpoint, tp))


# expressions over the heads (a per-head slope: on a rank's heads their local numbers would read
# the wrong slopes) and over positions alone (a chunked mask, a temperature by the query's place)
HEAD_EXPRESSIONS = {
    "per-head": dict(score="score - slope[head] * (q_pos - kv_pos)",
                     params={"slope": [0.5 ** (h + 1) for h in range(9)]}),
    "positions": dict(score="score * (1.0 + 0.1 * log(floor((q_pos + 1) / 4) + 1.0))",
                      mask="kv_pos <= q_pos and q_pos // 4 == kv_pos // 4")}


@pytest.mark.parametrize("which", list(HEAD_EXPRESSIONS))
def test_score_and_mask_expressions_split_by_head_only_when_they_do_not_read_it(
        which: str) -> None:
    """tiny-smollm2 (9 heads over 3 KV heads) at tp = 3 with a score and mask expression: one
    that reads the head runs on the whole scores (gathered), one of positions alone on each
    rank's heads; both compute the unsharded model."""
    data = to_dict(load_spec("tiny-smollm2"))
    data["position"] = {"kind": "none"}
    data["attention"].update(HEAD_EXPRESSIONS[which])
    spec = from_dict(data)
    program = lower(spec)
    checkpoint = random_weights(program, seed=5)
    sharded = shard_program(program, 3)
    gathered = any(n.op == Op.ALL_GATHER and "attention" in (n.origin or "")
                   for g in sharded for n in g)
    assert gathered == (which == "per-head")
    assert_same(spec, outputs(spec, program, checkpoint), on_ranks(spec, sharded, checkpoint, 3))


@pytest.mark.parametrize(("name", "tp"), [("tiny-gpt2", 2), ("tiny-llama2-70b", 2)])
def test_quantized_weights_split_on_whole_groups(name: str, tp: int) -> None:
    spec, program, checkpoint = model(name, "int4_g32")
    sharded = shard_program(program, tp)
    assert any(n.dtype == "int4_g32" and is_slice(n.attr("expr"))
               for g in sharded for n in g if n.op == Op.PARAM)
    assert_same(spec, outputs(spec, program, checkpoint), on_ranks(spec, sharded, checkpoint, tp))


@pytest.mark.parametrize("tp", [2, 4])
def test_int8_weights_with_a_scale_per_row_split_along_k_anywhere(tp: int) -> None:
    """One scale covers a whole row of int8 codes: a row-parallel cut keeps every row's scale
    and any columns (tiny-llama3's d_ff of 224 into 112 or 56)."""
    spec, program, checkpoint = model("tiny-llama3", "int8_ch")
    sharded = shard_program(program, tp)
    assert any(n.dtype == "int8_ch" and is_slice(n.attr("expr")) and n.shape[1] == 224 // tp
               for g in sharded for n in g if n.op == Op.PARAM)
    assert_same(spec, outputs(spec, program, checkpoint), on_ranks(spec, sharded, checkpoint, tp))


def test_quantized_k_that_splits_off_a_group_is_refused() -> None:
    _, program, _ = model("tiny-llama3", "int4_g32")     # d_ff 224: 112 per rank, not 32·k
    with pytest.raises(ShardError, match=r"ffn\.d_ff = 224 \(K of the int4_g32 weights\) .* "
                                         r"32-element groups; tp values that work: 1$"):
        shard_program(program, 2)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocabulary_parallel_embedding_and_head(tp: int) -> None:
    name = "tiny-llama3+vocab96" if tp != 3 else "tiny-smollm2+vocab96"
    spec, program, checkpoint = model(name)
    step = run_pass(program, "shard", options={"tp": tp})
    g = step.after.graph("decoder")
    embedding = g.nodes[g.ids(Op.EMBEDDING)[0]]
    assert embedding.attr("parts") == tp and embedding.shape[-1] == spec.d_model
    assert g.nodes[embedding.inputs[0]].shape == (96 // tp, spec.d_model)
    assert len(g.ids(Op.ALL_GATHER)) == 1
    assert {d.rule for d in step.applied()} >= {"vocab-parallel", "column-parallel",
                                                  "row-parallel", "all-reduce"}
    assert_same(spec, outputs(spec, program, checkpoint),
                on_ranks(spec, step.after, checkpoint, tp))


def test_a_vocabulary_that_does_not_divide_is_replicated() -> None:
    _, program, _ = model("tiny-llama3")      # vocab 97
    step = run_pass(program, "shard", options={"tp": 2})
    g = step.after.graph("decoder")
    assert not g.ids(Op.ALL_GATHER)
    assert g.nodes[g.params["embed.weight"]].attr("expr") is None
    assert any(d.rule == "vocab-parallel" and not d.applied and "97" in d.reason
               for d in step.decisions)


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    _, program, _ = model("tiny-llama2-70b")     # 8 heads, 2 KV heads
    step = run_pass(program, "shard", options={"tp": 4})
    k = step.after.graph("decoder").params["layers.0.attn.k.weight"]
    expr = step.after.graph("decoder").nodes[k].attr("expr")
    assert (expr.kw("dim"), expr.kw("parts"), expr.kw("every")) == (0, 2, 2)
    assert any(d.rule == "kv-replicated" for d in step.applied())


@pytest.mark.parametrize("name", ["tiny-llama3+vocab96", "tiny-gpt2", "tiny-mixtral"])
def test_the_split_does_not_depend_on_weight_names(name: str) -> None:
    """Column-parallel projections and the vocabulary-parallel tables are found by what reads
    them: with every weight renamed, the sharded program is the same but for the names."""
    _, program, _ = model(name)
    renamed = Program(program.model, tuple(Graph(g.name, tuple(
        n.replace(attrs=n.attrs.replace(name=f"w{i}")) if n.op == Op.PARAM
        and n.attr("expr") is None else n for i, n in enumerate(g.nodes))) for g in program))

    def unnamed(p: Program) -> list[tuple]:
        cut = lambda e: e.kwargs if e is not None and e.fn == "shard" else None  # noqa: E731
        return [(n.op, n.inputs, n.shape, n.attrs.replace(name="", expr=None),
                 cut(n.attr("expr"))) for g in p for n in g]
    assert unnamed(shard_program(renamed, 2)) == unnamed(shard_program(program, 2))


def test_row_parallel_bias_is_added_once_after_the_all_reduce() -> None:
    _, program, _ = model("tiny-gpt2")
    g = shard_program(program, 2).graph("decoder")
    bias = g.params["layers.0.attn.o.bias"]
    (user,) = [n for n in g if bias in n.inputs]
    assert g.nodes[user.inputs[0]].op == Op.ALL_REDUCE and g.nodes[bias].attr("expr") is None


def test_a_parallel_block_reduces_once_and_still_merges() -> None:
    spec, program, _ = model("tiny-gptj")        # attention and FFN from one input, summed
    g = shard_program(program, 2).graph("decoder")
    assert len(g.ids(Op.ALL_REDUCE)) == spec.layers
    merged = run_pipeline(shard_program(program, 2)).step("merge-parallel").applied()
    assert [d.rule for d in merged] == ["merge-parallel-out", "merge-parallel-in"] * spec.layers


@pytest.mark.parametrize(("name", "change", "tp", "message"), [
    ("tiny-smollm2", {}, 2, r"attention\.heads = 9 does not divide by tp; tp values that work: "
                           r"1, 3$"),
    ("tiny-mamba", {}, 2, r"mixer\.kind = mamba layers are not split .* work: 1$"),
    ("tiny-linear-attention", {}, 4, r"mixer\.kind = linear_attention layers"),
    ("tiny-llama3", {"d_ff": 90}, 4, r"ffn\.d_ff = 90 does not divide by tp; tp values that "
                                      r"work: 1, 2$"),
    ("tiny-mixtral", {"d_ff": 90}, 4, r"ffn\.d_ff = 90 does not divide"),
])
def test_refusals_name_the_field_and_the_tp_that_work(name: str, change: dict, tp: int,
                                                      message: str) -> None:
    spec = load_spec(name)
    if change:
        spec = dataclasses.replace(spec, ffn=dataclasses.replace(spec.ffn, **change))
    with pytest.raises(ShardError, match=message):
        shard_program(lower(spec), tp)


def test_each_rank_holds_a_part_of_the_split_weights() -> None:
    """Resident bytes, from what materialize gives each rank: the replicated params whole,
    the split ones 1/N each, and the N ranks' parts make up the whole of them (tp=2: the two
    KV heads split too, none shared)."""
    tp = 2
    _, program, checkpoint = model("tiny-llama3+vocab96")
    sharded = shard_program(program, tp).graph("decoder")
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts.values())  # noqa: E731
    whole = materialize(program.graph("decoder"), checkpoint)
    split = {n.name for n in sharded if n.op == Op.PARAM and is_slice(n.attr("expr"))}
    replicated = nbytes({k: v for k, v in whole.items() if k not in split})
    split_bytes = nbytes({k: v for k, v in whole.items() if k in split})
    assert split_bytes > 0.9 * nbytes(whole)
    parts = [materialize(sharded, checkpoint, rank=r) for r in range(tp)]
    for mine in parts:
        assert nbytes(mine) == replicated + split_bytes // tp
    for name in ("layers.0.attn.q.weight", "layers.0.ffn.down.weight"):   # parts make the whole
        dim = 1 if "down" in name else 0
        assert torch.equal(torch.cat([p[name] for p in parts], dim), whole[name])


def test_llama2_70b_over_eight_h100s_by_hand() -> None:
    """Llama 2 70B (d 8192, 80 layers, 64 heads, 8 KV heads of 128, d_ff 28672, vocab 32000,
    bf16) on 8 H100s, one decode step at context 512: each GPU reads an eighth of every
    layer's weights (one KV head; the norm gains are folded into them) and of the head;
    sends per layer two ring all-reduces of one 8192-wide bf16 row (2·7/8 of 16 KiB each),
    plus the embedding's all-reduce and the logits' all-gather (7/8 of 32000 bf16 logits),
    at 450 GB/s."""
    d, layers, hd, d_ff, vocab, tp = 8192, 80, 128, 28672, 32000, 8
    program = optimize(shard_program(lower(load_spec("llama2-70b"), "bf16"), tp))
    floor = decode_floor(program, gpu("h100"), batch=1, past=511)
    per_layer = (2 * d * d + 2 * d * 8 * hd + 3 * d * d_ff) // tp   # q, o; k, v; gate, up, down
    weights = 2 * (layers * per_layer + vocab // tp * d + d)     # head; the one embedding row
    assert floor.weight_bytes == weights
    assert floor.kv_bytes == layers * 2 * 1 * 512 * hd * 2      # one KV head per GPU
    row = 2 * d
    link = (2 * layers + 1) * 2 * row * 7 // 8 + vocab * 2 * 7 // 8
    assert floor.link_bytes == link
    assert floor.link_seconds == pytest.approx(link / 450e9)
    assert floor.seconds == pytest.approx((weights + floor.kv_bytes) / 3.35e12 + link / 450e9)
    single = decode_floor(optimize(lower(load_spec("llama2-70b"), "bf16")), gpu("h100"), 1, 511)
    assert 7.5 < single.seconds / floor.seconds < 8     # the link costs a little of 8×


def test_passes_cli_shows_the_shard_pass_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["passes", "tiny-llama3", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if "│  1 │" in line)
    assert "shard" in first and "column-parallel" in first
    # 2 layers × 2 all-reduces of 64 f32 (256 B), each rank sending 2·1/2 of it: 1 KiB a token
    assert "each rank sends 1.00 KiB per token over the link (all_reduce 1.00 KiB)" in out
    assert main(["passes", "tiny-smollm2", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "attention.heads = 9" in err and "tp values that work: 1, 3" in err
    assert "Traceback" not in err


def test_roofline_and_show_cli_price_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "tiny-llama3", "--tp", "2", "--prompt-len", "8", "--new-tokens",
                 "2"]) == 0
    out = capsys.readouterr().out
    assert "2 × H200 SXM, tensor parallel" in out and "all_reduce" in out and "link" in out
    assert "collectives 1.00 KiB sent at 450.00 GB/s" in out
    assert main(["show", "tiny-llama3", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel ×2" in out and "1.00 KiB sent over the link per decoded token" in out
