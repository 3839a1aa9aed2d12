"""The pass pipeline: its infrastructure, the rules of each pass, the kernel-level contract with
codegen, and the commands that show every step."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import sympy
import torch

import archc
from archc.cli import main
from archc.errors import ArchcError
from archc.ir.attrs import Call
from archc.ir.cost import without_layers
from archc.ir.graph import Graph, GraphBuilder, Program
from archc.ir.lower import lower
from archc.ir.ops import KERNEL_LEVEL, VIEW, Op
from archc.ir.shapes import B, T, shape
from archc.ir.text import format_program, parse_program
from archc.passes import (
    DEFAULT_PIPELINE,
    PASSES,
    PassContext,
    PassFailure,
    optimize,
    register_pass,
    run_pipeline,
)
from archc.passes.manager import run_pass
from archc.passes.measure import kernels_per_layer, kv_cache_bytes_per_token
from archc.runtime.eager import EagerContext, run_graph
from archc.spec import load_spec
from tests.conftest import ALL_SPECS, TINY_SPECS

# Compute nodes per block after the default pipeline (embedding and head aside), for every zoo
# spec. The contract allows 5 for a pre-norm serial block; a change here is a visible diff.
KERNELS_PER_BLOCK = {
    "bert-base": 7, "bloom-560m": 5, "falcon-7b": 3, "gemma2-9b": 7, "gpt-j-6b": 3,
    "gpt-neox-20b": 3, "gpt1": 7, "gpt2": 5, "llama2-70b": 5, "llama2-7b": 5, "llama3-8b": 5,
    "mistral-7b": 5, "mixtral-8x7b": 7, "phi-2": 3, "qwen2-7b": 5, "smollm2-135m": 5,
    "t5-small": 7,
    "tiny-bert": 7, "tiny-bloom": 5, "tiny-falcon": 3, "tiny-gemma2": 7, "tiny-gpt1": 7,
    "tiny-gpt2": 5, "tiny-gptj": 3, "tiny-llama2": 5, "tiny-llama2-70b": 5, "tiny-llama3": 5,
    "tiny-mistral": 5, "tiny-mixtral": 7, "tiny-neox": 3, "tiny-phi2": 3, "tiny-qwen2": 5,
    "tiny-smollm2": 5, "tiny-t5": 7, "tiny-longctx": 5, "tiny-longformer": 7,
    "sinks-banded": 5,
    # QK-norm in the QKV epilogue (Qwen3, Gemma 3); NoPE layers (SmolLM3) and a window (Phi-3)
    # cost nothing; Gemma 3's sandwich norms two kernels each, as Gemma 2's
    "qwen3-8b": 5, "gemma3-12b": 7, "smollm3-3b": 5, "phi3-mini": 5,
    "tiny-qwen3": 5, "tiny-gemma3": 7, "tiny-smollm3": 5, "tiny-phi3": 5,
    # OLMo 2: q and k normalized whole in a norm kernel after the QKV projection (which then
    # rotates and writes the cache), and each output norm a kernel of its own with the residual
    "olmo2-7b": 8, "tiny-olmo2": 8,
    # MoE FFNs as Mixtral's: Qwen3-MoE's QK-norm costs nothing
    "qwen3-30b-a3b": 7, "tiny-qwen3-moe": 7, "gpt-oss-20b": 7, "tiny-gpt-oss": 7,
    # and a shared expert beside them: its gate+up and down (Llama 4)
    "llama4-scout": 9, "tiny-llama4": 9,
    # recurrent mixers: a Mamba mixer is in_proj, causal_conv, x_proj, dt_proj, ssm_scan,
    # out_proj (6); linear attention is qkv, linear_attention, o (3) as softmax attention is.
    # A MoE FFN is norm, router, gate+up experts, down experts with the residual in its sum (4).
    # Jamba-v0.1 averages 28 Mamba and 4 attention mixers with 16 dense FFNs (2) and 16 MoE
    # FFNs (4): (28·6 + 4·3 + 16·2 + 16·4) / 32 = 8.625; tiny-jamba has one of each pairing.
    "mamba-130m": 6, "jamba-v0.1": 8.625,
    # latent attention, absorbed: q_a, q_b (rotating its heads' last dims), kv_a, the latent's
    # norm (rotating the RoPE key and caching the row), the key up-projection, attention, the
    # value up-projection, o (8); a dense FFN 2, a MoE one 6 with its shared expert (Llama 4).
    # DeepSeek-V3: 3 dense layers and 58 MoE ones; the tiny twin one and two
    "deepseek-v3": (3 * (8 + 2) + 58 * (8 + 6)) / 61, "tiny-deepseek-v3": (10 + 2 * 14) / 3,
    "tiny-mamba": 6, "tiny-jamba": 7.5, "tiny-linear-attention": 5,
    # Qwen3-Next: a Gated DeltaNet mixer is qkvz and ba, causal_conv, σ(b), the decay g,
    # delta_rule, SiLU(z), the per-head norm (times it in its epilogue) and out (9); a gated
    # attention mixer is qkv, attention, its gate (σ, then times the attention output in the
    # epilogue) and o (4); the MoE FFN is norm, router, gate+up experts, the shared expert's
    # gate+up, down and σ-gate projection, their product and down experts (8). The 80B has
    # three DeltaNet mixers to each attention one, (3·9 + 4) / 4 + 8 = 15.75; the tiny one each
    # once, (9 + 4) / 2 + 8 = 14.5.
    "qwen3-next-80b-a3b": 15.75, "tiny-qwen3-next": 14.5,
}


@functools.cache
def optimized(name: str) -> Program:
    return optimize(lower(load_spec(name)))


def kernels(g: Graph) -> list:
    """The kernel-level nodes of a graph past its embedding gathers."""
    return [n for n in g if n.op in KERNEL_LEVEL and n.op != Op.EMBEDDING]


def ops(p: Program) -> set[Op]:
    return {n.op for g in p for n in g}


def param_exprs(p: Program) -> dict[str, Call | None]:
    return {n.name: n.attr("expr") for g in p for n in g if n.op == Op.PARAM}


def decisions(name: str, pass_name: str, rule: str) -> list:
    run = run_pipeline(lower(load_spec(name)))
    return [d for d in run.step(pass_name).decisions if d.rule == rule]


# ---- the contract with codegen ---------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_SPECS)
def test_default_pipeline_leaves_only_kernel_level_ops(name: str) -> None:
    p = optimized(name)
    allowed = KERNEL_LEVEL | VIEW | {Op.EMBEDDING, Op.INPUT, Op.PARAM, Op.OUTPUT}
    left = {f"%{i} {n.op.value}" for g in p for i, n in enumerate(g) if n.op not in allowed}
    assert not left, f"unfused ops survive the default pipeline: {sorted(left)[:5]}"


@pytest.mark.parametrize("name", ALL_SPECS)
def test_kernels_per_block(name: str) -> None:
    before, after = kernels_per_layer(load_spec(name))
    assert after == KERNELS_PER_BLOCK[name]
    assert before > 2 * after


@pytest.mark.parametrize("name", ["llama3-8b", "tiny-llama3"])
def test_llama3_block_is_five_kernels(name: str) -> None:
    spec = load_spec(name)
    p, base = optimized(name), optimize(lower(without_layers(spec)))
    count = sum(len(g.compute_ids()) for g in p) - sum(len(g.compute_ids()) for g in base)
    assert count / spec.layers <= 6
    kinds = kernels(p.graphs[0])[:5]
    steps = [[st.fn for st in n.attr("epilogue", ())] for n in kinds]
    assert [n.op for n in kinds] == [Op.FUSED_LINEAR, Op.ATTENTION, Op.FUSED_LINEAR,
                                     Op.FUSED_LINEAR, Op.FUSED_LINEAR]
    assert steps == [["rms_scale", "rope", "kv_write"], [], ["residual"], ["rms_scale", "glu"],
                     ["residual"]]
    assert kinds[0].attr("prologue") == "rms" and kinds[1].attr("cache_layer") == 0


def test_kv_cache_bytes_are_counted_in_either_form() -> None:
    spec = load_spec("llama3-8b")
    unfused = lower(spec, "bf16")
    # 2 (k, v) · 32 layers · 8 KV heads · 128 dims · 2 bytes
    want = 2 * 32 * 8 * 128 * 2
    assert kv_cache_bytes_per_token(unfused) == want
    assert kv_cache_bytes_per_token(optimize(unfused)) == want


# ---- infrastructure --------------------------------------------------------------------------

def test_unknown_pass_names_the_known_ones() -> None:
    with pytest.raises(ArchcError, match=r"unknown pass 'fold-norm' \(did you mean fold-norms"
                                         r"\?\); known: default, none, .*fuse-glu"):
        run_pipeline(lower(load_spec("tiny-llama3")), "merge-qkv,fold-norm")


def test_every_pass_is_registered_and_the_default_pipeline_is_exact() -> None:
    assert set(DEFAULT_PIPELINE) <= set(PASSES)
    assert all(PASSES[name].kind == "exact" for name in DEFAULT_PIPELINE)
    # every other pass is exact too, but the variants: programs whose outputs agree with the
    # program's where their callers read them (tests/test_last_token.py and tests/test_paged.py
    # check them)
    assert all(p.summary and p.kind in ("exact", "variant") for p in PASSES.values())
    assert sorted(n for n, p in PASSES.items() if p.kind == "variant") == \
        ["last-token-logits", "paged-kv"]


def test_a_pass_that_does_not_apply_returns_the_same_object() -> None:
    program = lower(load_spec("tiny-llama3"))
    step = run_pass(program, "fold-biases")     # llama has no biases
    assert step.after is step.before is program and not step.changed
    assert step.log == ("fold-biases: graph decoder: not applied",)
    assert run_pipeline(program, "none").program is program


def test_the_pipeline_is_a_fixed_point() -> None:
    for name in TINY_SPECS:
        p = optimized(name)
        assert run_pipeline(p).program is p, name


def test_passes_with_options_run_in_a_pipeline() -> None:
    """shard, context-parallel and paged-kv are passes like the others: named with their options
    in a pipeline, verified by the manager, their refusals raised in their own words."""
    from archc.passes.shard import ShardError, shard_program
    program = lower(load_spec("tiny-llama3"))
    run = run_pipeline(program, "shard:tp=2,default,paged-kv:block_size=4:max_seq_len=16")
    assert [s.name for s in run.steps] == ["shard", *DEFAULT_PIPELINE, "paged-kv"]
    assert run.steps[0].after == shard_program(program, 2)
    g = run.program.graph("decoder")
    assert g.nodes[g.inputs["block_table"]].shape == (T, 4)    # ⌈16 / 4⌉ blocks a sequence
    assert run_pass(program, "shard").after is program          # tp=1: not applied
    for pipeline, error, message in [
            ("paged-kv", ArchcError, r"pass paged-kv needs option 'max_seq_len'; it takes "
                                     r"paged-kv:block_size=16:max_seq_len=N$"),
            ("shard:cp=2", ArchcError, r"pass shard has no option 'cp'; it takes shard:tp=1$"),
            ("shard:tp=two", ArchcError, r"'shard:tp=two': its options are OPTION=N"),
            ("dce:x=1", ArchcError, r"pass dce has no option 'x'; it takes none$"),
            ("default,shard:tp=2", ShardError, r"splits the unfused program, as lowered"),
            ("shard:tp=3", ShardError, r"attention\.heads = 4 does not divide by tp"),
            ("context-parallel:cp=0", ArchcError, r"given cp=0, not a whole number ≥ 1"),
            ("paged-kv:block_size=0:max_seq_len=8", ArchcError, r"given block_size=0")]:
        with pytest.raises(error, match=message):
            run_pipeline(program, pipeline)


def test_the_diff_of_a_pass_with_options_numbers_the_nodes_it_kept(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ir", "tiny-llama3", "--passes", "shard:tp=2", "--diff", "shard"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the residual add after the first all_reduce keeps its number, reading the new node
    assert "+  %+1 : f32[B,T,64] = all_reduce(%29) {group=\"tp\", ranks=2}" in lines
    assert "+  %30 : f32[B,T,64] = add(%3, %+1)" in lines
    assert main(["ir", "tiny-bloom", "--passes", "flash-attention,context-parallel:cp=2",
                 "--diff", "context-parallel"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # positions put first (%+1), each attention a ring reading them, every number kept
    assert "+  %+1 : i64[T] = input() {name=\"positions\"}" in lines
    assert "   %0 : i64[B,T] = input() {name=\"tokens\"}" in lines
    assert [ln.split(" = ")[0] for ln in lines if ln.startswith(("-  %", "+  %"))] == [
        "+  %+1 : i64[T]", *(f"{s}  %{i} : f32[B,T,64]" for i in (27, 66) for s in "-+")]
    assert main(["ir", "tiny-bloom", "--passes", "context-parallel:cp=2"]) == 2
    assert "run flash-attention first" in capsys.readouterr().err


@pytest.fixture
def broken_pass() -> str:
    @register_pass("test-break-shapes", "breaks a shape, for the test")
    def breaks(g: Graph, ctx: PassContext) -> Graph:
        i = next(i for i, n in enumerate(g) if n.op == Op.MATMUL)
        n = g.nodes[i]
        bad = n.replace(shape=(*n.shape[:-1], n.shape[-1] + 1))
        return Graph(g.name, g.nodes[:i] + (bad,) + g.nodes[i + 1:])
    yield "test-break-shapes"
    del PASSES["test-break-shapes"]


def test_a_failing_pass_is_named_with_those_before_it(broken_pass: str) -> None:
    with pytest.raises(PassFailure, match=r"pass test-break-shapes \(after: fold-biases, "
                                          r"share-kv-heads\) left an invalid graph: verifier: "
                                          r"graph decoder: %\d+ : f32\[B,T,65\] = matmul"):
        run_pipeline(lower(load_spec("tiny-llama3")),
                     ["fold-biases", "share-kv-heads", broken_pass])


def test_provenance_records_origin_and_passes_and_round_trips() -> None:
    p = optimized("tiny-llama3")
    qkv = next(n for n in p.graphs[0] if n.op == Op.FUSED_LINEAR)
    assert qkv.origin == "attention.heads"
    assert qkv.passes == ("merge-qkv", "fold-norms", "fuse-rope", "fuse-kv-write", "pair-rows")
    embedding = next(n for n in p.graphs[0] if n.op == Op.EMBEDDING)
    assert embedding.passes == ()
    for name in TINY_SPECS:
        q = optimized(name)
        assert parse_program(format_program(q, provenance=True)) == q
        assert parse_program(format_program(q)) == dataclasses.replace(q, graphs=tuple(
            Graph(g.name, tuple(n.replace(origin="", passes=()) for n in g)) for g in q))


def test_rewritten_weights_are_parameter_expressions() -> None:
    exprs = param_exprs(optimized("tiny-llama3"))
    qkv = exprs["layers.0.attn.q+k+v.weight*attn_norm"]
    assert qkv.fn == "rope_pairs"    # the rows in RoPE's pair order (pair-rows)
    assert qkv.args[0] == Call("mul", (Call("cat", tuple(Call("w", (f"layers.0.attn.{r}.weight",))
                                                 for r in "qkv"), (("dim", 0),)),
                               Call("w", ("layers.0.attn_norm.weight",))))
    assert "layers.0.attn.q.weight" not in exprs       # read only through the expression


# ---- the rules of each pass ------------------------------------------------------------------

def test_key_bias_is_dropped_where_softmax_cannot_see_it() -> None:
    [d0, d1] = decisions("tiny-gpt2", "fold-biases", "key-bias")
    assert d0.applied and d1.applied
    assert not any("attn.k.bias" in str(e) for e in param_exprs(optimized("tiny-gpt2")).values())


def test_key_bias_stays_under_rope() -> None:
    found = decisions("tiny-qwen2", "fold-biases", "key-bias")
    assert found and all(not d.applied and "rope" in d.reason for d in found)
    exprs = param_exprs(optimized("tiny-qwen2"))
    assert any("attn.k.bias" in str(e) for e in exprs.values())


def test_key_bias_stays_under_a_softcap() -> None:
    spec = load_spec("tiny-gpt2")
    spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, softcap=5.0))
    step = run_pass(lower(spec), "fold-biases")
    keys = [d for d in step.decisions if d.rule == "key-bias"]
    assert keys and all(not d.applied and "softcap" in d.reason for d in keys)


def test_value_bias_folds_into_the_output_bias_per_kv_head() -> None:
    exprs = param_exprs(optimized("tiny-qwen2"))
    bias = exprs["layers.0.attn.o+v.bias"]
    # qwen2 has no output bias: b_o' = W_o · repeat_heads(b_v), KV head h // 2 per query head
    assert bias == Call("mm", (Call("w", ("layers.0.attn.o.weight",)), Call(
        "repeat_heads", (Call("w", ("layers.0.attn.v.bias",)),), (("groups", 2),
                                                                  ("heads", 2)))))


def test_value_bias_folds_through_linear_attention() -> None:
    """Linear attention averages its values with positive weights summing to 1, as softmax
    does: b_o' = b_o + W_o · repeat_heads(b_v), GQA 4/2."""
    found = decisions("tiny-linear-attention", "fold-biases", "value-bias")
    assert len(found) == 2 and all(d.applied for d in found)
    bias = param_exprs(optimized("tiny-linear-attention"))["layers.0.attn.o+v.bias"]
    assert bias == Call("add", (Call("w", ("layers.0.attn.o.bias",)), Call("mm", (
        Call("w", ("layers.0.attn.o.weight",)), Call(
            "repeat_heads", (Call("w", ("layers.0.attn.v.bias",)),),
            (("groups", 2), ("heads", 2)))))))


def test_value_bias_stays_where_a_row_can_be_fully_masked() -> None:
    found = decisions("tiny-bert", "fold-biases", "value-bias")
    assert found and all(not d.applied and "padding" in d.reason for d in found)


def test_zero_bias_vanishes() -> None:
    b = GraphBuilder("g")
    x = b.input("x", shape(B, T, 8), "f32")
    w = b.param("w", shape(4, 8), "f32")
    zero = b.param("b", shape(4), "f32", expr=Call("zeros", (), (("shape", (4,)),)))
    b.output("y", b.emit(Op.ADD, b.emit(Op.MATMUL, x, w), zero))
    p = Program("m", (b.build(),))
    after = run_pass(p, "fold-biases").after
    assert ops(after) == {Op.INPUT, Op.PARAM, Op.MATMUL, Op.OUTPUT}


def test_norm_folds_into_every_reader_or_stays() -> None:
    gpt2 = optimized("tiny-gpt2")
    qkv = next(n for n in gpt2.graphs[0] if n.op == Op.FUSED_LINEAR)
    assert qkv.attr("prologue") == "layer"
    assert [st.fn for st in qkv.attr("epilogue")] == ["ln_scale", "bias", "kv_write"]
    [tied] = decisions("tiny-smollm2", "fold-norms", "fold-rmsnorm")[-1:]
    assert tied.verdict == "profitability" and "embed.weight" in tied.reason
    post = decisions("tiny-gemma2", "fold-norms", "fold-rmsnorm")
    assert sum(not d.applied and "(add)" in d.reason for d in post) == 8   # 2 post-norms × 4
    exprs = param_exprs(optimized("tiny-gemma2"))
    assert Call("offset", (Call("w", ("layers.0.attn_norm.weight",)),), (("by", 1.0),)) in \
        exprs["layers.0.attn.q+k+v.weight*attn_norm"].args[0].args   # under rope_pairs


def test_parallel_blocks_are_three_kernels() -> None:
    p = optimized("tiny-falcon")
    first = kernels(p.graphs[0])[:3]
    assert [n.op for n in first] == [Op.FUSED_LINEAR, Op.ATTENTION, Op.FUSED_LINEAR]
    merged_in, _, merged_out = first
    acts = [st for st in merged_in.attr("epilogue") if st.fn == "act"]
    assert acts == [Call("act", (), (("fn", "gelu"), ("start", 96), ("stop", 352)))]
    assert merged_out.attr("concat_k") is True


def test_mixture_of_experts_becomes_router_and_grouped_matmuls() -> None:
    block = kernels(optimized("tiny-mixtral").graphs[0])[:7]
    assert [n.op for n in block] == [Op.FUSED_LINEAR, Op.ATTENTION, Op.FUSED_LINEAR, Op.NORM,
                                     Op.ROUTER, Op.MOE_LINEAR, Op.MOE_LINEAR]
    up, down = block[5:]
    assert [st.fn for st in up.attr("epilogue")] == ["glu"] and up.attr("stage") == "up"
    assert [st.fn for st in down.attr("epilogue")] == ["residual"]   # the residual joins the sum


def qk_norm_variant(name: str) -> archc.spec.schema.Spec:
    spec = load_spec(name)
    return dataclasses.replace(spec, attention=dataclasses.replace(spec.attention,
                                                                   qk_norm=True))


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-phi2", "tiny-gemma2", "tiny-t5"])
def test_qk_norm_runs_in_the_projection_epilogue(name: str) -> None:
    spec = qk_norm_variant(name)
    p = optimize(lower(spec))
    allowed = KERNEL_LEVEL | VIEW | {Op.EMBEDDING, Op.INPUT, Op.PARAM, Op.OUTPUT}
    assert ops(p) <= allowed
    qkv = next(n for n in p.graphs[-1] if n.op == Op.FUSED_LINEAR)
    steps = [st.fn for st in qkv.attr("epilogue")]
    rotary = ["rope"] if spec.position.kind == "rope" else []
    assert steps[-2 - len(rotary):] == ["head_norm", *rotary, "kv_write"]
    norm = next(st for st in qkv.attr("epilogue") if st.fn == "head_norm")
    heads = spec.attention.heads + spec.attention.kv_heads
    assert norm.kw("heads") == heads and norm.kw("head_dim") == spec.attention.head_dim
    gain = next(n for n in p.graphs[-1] if n.name.endswith(".tiled"))
    assert gain.attr("expr").fn == "cat" and [a.kw("times") for a in gain.attr("expr").args] \
        == [spec.attention.heads, spec.attention.kv_heads]


def _values(g: Graph, x: torch.Tensor) -> torch.Tensor:
    params = {n.name: torch.full(tuple(int(d) for d in n.shape), 0.5) for n in g
              if n.op == Op.PARAM}
    return run_graph(g, params, {"x": x}, EagerContext({"B": 1, "T": 3, "P": 0}))["y"]


def test_cse_merges_repeated_work_and_dce_drops_dead_nodes() -> None:
    b = GraphBuilder("g")
    x = b.input("x", shape(B, T, 8), "f32")
    w = b.param("w", shape(8, 8), "f32")
    one = b.emit(Op.ACT, b.emit(Op.MATMUL, x, w), fn="silu")
    two = b.emit(Op.ACT, b.emit(Op.MATMUL, x, w), fn="silu")
    b.emit(Op.MUL, x, x)                                         # read by nothing
    b.output("y", b.emit(Op.ADD, one, two))
    g = b.build()
    p = Program("m", (g,))
    after_cse = run_pass(p, "cse").after
    assert len(after_cse.graphs[0]) == len(g) - 2
    after_dce = run_pass(after_cse, "dce").after
    assert Op.MUL not in ops(after_dce)
    x_val = torch.randn(1, 3, 8)
    assert torch.allclose(_values(g, x_val), _values(after_dce.graphs[0], x_val))
    assert run_pass(after_dce, "dce").after is after_dce


def test_cse_never_merges_cache_writes() -> None:
    p = optimized("tiny-llama3")
    assert run_pass(p, "cse").after is p


# ---- the commands ----------------------------------------------------------------------------

def test_passes_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["passes", "tiny-llama3", "--prompt-len", "4", "--past", "3"]) == 0
    out = capsys.readouterr().out
    for name in DEFAULT_PIPELINE:
        assert name in out
    assert "merge-qkv ×2" in out and "not applied" in out
    assert "kernels per block (embedding and head aside): 24 unfused → 5" in out


def test_passes_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["passes", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PASSES)
    assert main(["passes"]) == 2
    assert "or --list" in capsys.readouterr().err


def test_ir_after_diff_and_print_after_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ir", "tiny-llama3", "--after", "fuse-glu"]) == 0
    assert 'glu(fn="silu")' in capsys.readouterr().out
    assert main(["ir", "tiny-llama3", "--diff", "fuse-glu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- before fuse-glu\n+++ after fuse-glu (kept nodes keep their "
                          "numbers; %+N are new)\n")
    lines = out.splitlines()
    # per layer: gate, up, act and mul go; one weight and one fused_linear with glu come
    assert sum(ln.startswith("-  ") and "= mul(" in ln for ln in lines) == 2
    made = [ln for ln in lines if ln.startswith("+  %+")]
    assert len(made) == 4 and sum('glu(fn="silu")' in ln for ln in made) == 2
    assert "+  %28 : f32[B,T,64] = matmul(%+2, %27)" in lines    # kept, reading the new node
    assert main(["ir", "tiny-llama3", "--print-after-all"]) == 0
    out = capsys.readouterr().out
    assert f"; *** IR after fold-biases (exact, pass 2 of {len(DEFAULT_PIPELINE)}) *** " \
           "not applied" in out
    assert out.count("program tiny-llama3") == 1 + sum(
        s.changed for s in run_pipeline(lower(load_spec("tiny-llama3"))).steps)
    assert main(["ir", "tiny-llama3", "--passes", "default", "--provenance"]) == 0
    assert 'passes=["merge-qkv", "fold-norms", "fuse-rope", "fuse-kv-write", "pair-rows"]' in \
        capsys.readouterr().out


def test_explain_names_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "tiny-qwen2"]) == 0
    out = capsys.readouterr().out
    assert "fold-biases · key-bias — not legal ×2" in out
    assert "rope %" in out and "= add(" in out
    assert main(["explain", "tiny-llama3"]) == 0
    assert "every fusion the pipeline looked for was made" in capsys.readouterr().out


def test_diff_two_variants(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", "tiny-falcon", "tiny-llama3"]) == 0
    out = capsys.readouterr().out
    for row in ("nodes", "kernels per block", "parameters", "FLOPs per token",
                "bytes moved per token", "KV cache per token"):
        assert row in out
    assert "256 B" in out and "512 B" in out      # falcon's one KV head vs llama3's two


@pytest.mark.parametrize("argv", [["ir", "tiny-llama3", "--after", "nope"],
                                  ["passes", "tiny-llama3", "--passes", "merge-qkv,nope"],
                                  ["explain", "tiny-llama3", "--passes", "nope"],
                                  ["ir", "tiny-llama3", "--after", "merge-parallel",
                                   "--passes", "merge-qkv"]])
def test_bad_arguments_give_one_message(argv: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "pass" in err


def test_compile_runs_the_pipeline_for_the_eager_backend() -> None:
    model = archc.load("tiny-gemma2")
    unfused, fused = model.compile("eager", passes="none"), model.compile("eager",
                                                                          passes="default")
    programs = [c.session.program for c in (unfused, fused)]   # type: ignore[attr-defined]
    assert Op.ATTENTION in ops(programs[1]) and Op.ATTENTION not in ops(programs[0])
    assert Op.FUSED_LINEAR in ops(programs[1]) and Op.FUSED_LINEAR not in ops(programs[0])
    # by default: the unfused program with attention chains collapsed (for fused attention)
    plain = ops(model.compile("eager").session.program)   # type: ignore[attr-defined]
    assert Op.ATTENTION in plain and Op.FUSED_LINEAR not in plain and Op.SCORES not in plain
    with pytest.raises(ArchcError, match="unknown pass 'nope'"):
        model.compile("eager", passes="nope")
    with pytest.raises(ArchcError, match="takes one option, passes"):
        model.compile("eager", fast=True)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    a, b = unfused(ids), fused(ids)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    assert unfused.generate(ids, 4).tolist() == fused.generate(ids, 4).tolist()


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gpt2", "tiny-falcon", "tiny-gemma2"])
def test_kernel_level_graph_is_as_accurate_in_half_precision(name: str, dtype: str) -> None:
    """In f16/bf16 the unfused graph rounds every intermediate; the kernel-level ops accumulate
    in f32 and round once per kernel, so against the f32 result the kernel-level graph is no
    further off than the unfused one (25% slack: two different rounding sequences). A mistake
    in a pass shows as an error 10-100× the rounding."""
    model = archc.load(name)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    want = model.compile("eager")(ids)
    unfused = model.compile("eager", dtype=dtype)(ids).float()
    fused = model.compile("eager", dtype=dtype, passes="default")(ids).float()
    assert (fused - want).abs().max() <= 1.25 * (unfused - want).abs().max()


def test_symbolic_shapes_of_new_parameters_are_sympy() -> None:
    for g in optimized("tiny-neox"):
        for n in g:
            assert all(isinstance(d, sympy.Expr) for d in n.shape), n


def test_passes_reference_is_current() -> None:
    """docs/passes-reference.md is generated from the registry; regenerate with
    `python -m archc.passes.reference > docs/passes-reference.md`."""
    from pathlib import Path

    from archc.passes.reference import reference
    doc = Path(__file__).resolve().parents[1] / "docs" / "passes-reference.md"
    assert doc.read_text(encoding="utf-8") == reference()


def test_gated_attention_multiplies_in_its_gate_projection() -> None:
    """Qwen3-Next's σ(gate) ⊙ attention runs in the gate projection's epilogue, after its σ; the
    shared expert's [B, T, 1] σ-gate broadcasts over its output's columns, which a step that
    reads whole rows of the product's width cannot do: refused, and left a pointwise kernel."""
    found = decisions("tiny-qwen3-next", "fuse-gate", "gate-epilogue")
    applied = [d for d in found if d.applied]
    refused = [d for d in found if not d.applied]
    assert len(applied) == 2 and len(refused) == 2   # the gated norm and attention; 2 experts
    assert all("differ in shape (broadcast)" in d.reason for d in refused)
    g = optimized("tiny-qwen3-next").graphs[0]
    gated = [n for n in g if n.op == Op.FUSED_LINEAR and
             [st.fn for st in n.attr("epilogue", ())][-2:] == ["act", "gate"]]
    assert len(gated) == 1 and gated[0].attr("epilogue")[-2].kw("fn") == "sigmoid"
    assert g.nodes[gated[0].inputs[-1]].op == Op.ATTENTION
