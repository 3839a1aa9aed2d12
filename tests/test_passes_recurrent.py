"""The recurrent mixers through the default pipeline: what their blocks become, and the rules of
fuse-causal-conv, fuse-ssm-scan and fuse-linear-attention — each fusion kept where it is legal,
refused by name where it is not, and the function the same either way (translation validation
runs every pass on every zoo spec as well; these graphs reach the refusals the zoo never does)."""

from __future__ import annotations

import functools

import pytest
import torch

from archc.ir.graph import GraphBuilder, Program
from archc.ir.lower import lower
from archc.ir.ops import KERNEL_LEVEL, Op
from archc.ir.shapes import B, T, shape
from archc.passes import optimize
from archc.passes.manager import run_pass
from archc.runtime.eager import EagerContext, RecurrentState, run_graph
from archc.spec import load_spec


@functools.cache
def optimized(name: str) -> Program:
    return optimize(lower(load_spec(name)))


@pytest.mark.parametrize("name", ["tiny-mamba", "mamba-130m"])
def test_a_mamba_block_is_six_kernels(name: str) -> None:
    kinds = [n for n in optimized(name).graphs[0]
             if n.op in KERNEL_LEVEL and n.op != Op.EMBEDDING][:6]             # layer 0
    assert [n.op for n in kinds] == [Op.FUSED_LINEAR, Op.CAUSAL_CONV, Op.FUSED_LINEAR,
                                     Op.FUSED_LINEAR, Op.SSM_SCAN, Op.FUSED_LINEAR]
    in_proj, conv, x_proj, dt_proj, scan, out_proj = kinds
    assert in_proj.attr("prologue") == "rms"                       # the block's norm, folded
    assert (conv.attr("act"), conv.attr("bias")) == ("silu", True)
    assert [st.fn for st in dt_proj.attr("epilogue")] == ["bias", "act"]
    assert dt_proj.attr("epilogue")[1].kw("fn") == "softplus"
    assert x_proj.attr("epilogue", ()) == () and scan.attr("norm_eps") is None
    assert [st.fn for st in out_proj.attr("epilogue")] == ["residual"]


def test_jamba_normalizes_b_and_c_in_the_scan_and_folds_the_dt_norm() -> None:
    g = optimized("tiny-jamba").graphs[0]
    scan = next(n for n in g if n.op == Op.SSM_SCAN)
    assert scan.attr("norm_eps") == 1e-6 and len(scan.inputs) == 9
    assert [g.nodes[j].name for j in scan.inputs[7:]] == ["layers.0.ssm.b_norm.weight",
                                                          "layers.0.ssm.c_norm.weight"]
    dt = g.nodes[scan.inputs[1]]
    assert dt.op == Op.FUSED_LINEAR and dt.attr("prologue") == "rms"
    assert not any(g.nodes[j].name.endswith(("b_norm.weight", "c_norm.weight"))
                   for n in g if n.op == Op.NORM for j in n.inputs)


def test_linear_attention_reads_heads_of_one_merged_projection() -> None:
    g = optimized("tiny-linear-attention").graphs[0]
    la = next(n for n in g if n.op == Op.LINEAR_ATTENTION)
    roots = set()
    for j in la.inputs:                       # split_heads(slice(qkv)) for q, k and v
        view = g.nodes[j]
        assert view.op == Op.SPLIT_HEADS and g.nodes[view.inputs[0]].op == Op.SLICE
        roots.add(g.nodes[view.inputs[0]].inputs[0])
    (qkv,) = roots
    assert g.nodes[qkv].op == Op.FUSED_LINEAR and g.nodes[qkv].attr("prologue") == "layer"
    assert sum(n.op == Op.POINTWISE for n in g) == 1   # the position embedding's; φ is inside
    assert [g.nodes[j].shape[1] for j in la.inputs] == [4, 2, 2]           # GQA by index


# ---- rules and refusals on hand-built graphs ---------------------------------------------------

def scan_graph(*, norm_b: bool, norm_c: bool, leak: bool = False, gate: str = "silu"
               ) -> Program:
    """x, Δ, B, C, z as inputs; (scan + x·D) · gate(z); optionally the scan's output also
    returned (read outside the fusion)."""
    b = GraphBuilder("decoder")
    x, dt, z = (b.input(n, shape(B, T, 8), "f32") for n in ("x", "dt", "z"))
    bm, cm = (b.input(n, shape(B, T, 4), "f32") for n in ("bm", "cm"))
    a, d = b.param("a", shape(8, 4), "f32"), b.param("d", shape(8), "f32")
    if norm_b:
        bm = b.emit(Op.NORM, bm, b.param("gb", shape(4), "f32"), kind="rms", eps=1e-6)
    if norm_c:
        cm = b.emit(Op.NORM, cm, b.param("gc", shape(4), "f32"), kind="rms", eps=1e-6)
    y = b.emit(Op.SSM_SCAN, x, dt, a, bm, cm, layer=0)
    out = b.emit(Op.MUL, b.emit(Op.ADD, y, b.emit(Op.MUL, x, d)), b.emit(Op.ACT, z, fn=gate))
    b.output("y", out)
    if leak:
        b.output("scan", y)
    return Program("m", (b.build(),))


def same_function(before: Program, after: Program) -> None:
    gen = torch.Generator().manual_seed(0)
    g0, g1 = before.graphs[0], after.graphs[0]
    values = {n.name: torch.randn(*(2 if str(d) == "B" else 3 if str(d) == "T" else int(d)
                                    for d in n.shape), generator=gen)
              for n in g0 if n.op in (Op.INPUT, Op.PARAM)}
    values["dt"] = values["dt"].abs()
    values["a"] = -values["a"].exp()
    for name in ("gb", "gc"):
        if name in values:
            values[name] = values[name] + 2.0
    dims = {"B": 2, "T": 3, "P": 0}
    outs = []
    for g in (g0, g1):
        params = {n.name: values[n.name] for n in g if n.op == Op.PARAM}
        inputs = {n.name: values[n.name] for n in g if n.op == Op.INPUT}
        outs.append(run_graph(g, params, inputs, EagerContext(dims, None, RecurrentState())))
    for k in outs[0]:
        assert torch.allclose(outs[0][k], outs[1][k], rtol=1e-5, atol=1e-6), k


def test_scan_skip_gate_and_norms_become_one_kernel() -> None:
    p = scan_graph(norm_b=True, norm_c=True)
    step = run_pass(p, "fuse-ssm-scan")
    ops = [n.op for n in step.after.graphs[0]]
    assert ops.count(Op.SSM_SCAN) == 1 and Op.NORM not in ops and Op.MUL not in ops
    assert {d.rule for d in step.applied()} == {"ssm-scan", "ssm-norms"}
    same_function(p, step.after)


def test_one_normed_operand_keeps_its_norm() -> None:
    p = scan_graph(norm_b=True, norm_c=False)
    step = run_pass(p, "fuse-ssm-scan")
    ops = [n.op for n in step.after.graphs[0]]
    assert ops.count(Op.SSM_SCAN) == 1 and ops.count(Op.NORM) == 1
    (refused,) = step.refused()
    assert refused.rule == "ssm-norms" and "normalizes both or neither" in refused.reason
    same_function(p, step.after)


@pytest.mark.parametrize("leak, gate, why", [
    (True, "silu", "is also read by"),
    (False, "gelu", "the kernel gates by silu"),
])
def test_scan_fusion_refuses_what_would_change_the_function(leak: bool, gate: str,
                                                            why: str) -> None:
    p = scan_graph(norm_b=False, norm_c=False, leak=leak, gate=gate)
    step = run_pass(p, "fuse-ssm-scan")
    assert step.after is p
    (refused,) = step.refused()
    assert refused.rule == "ssm-scan" and why in refused.reason


def test_conv_takes_any_activation_and_a_parameter_bias_only() -> None:
    b = GraphBuilder("decoder")
    x = b.input("x", shape(B, T, 8), "f32")
    w = b.param("w", shape(8, 3), "f32")
    shift = b.input("shift", shape(8), "f32")              # a bias that is not a weight
    y = b.emit(Op.ADD, b.emit(Op.CAUSAL_CONV, x, w, layer=0), shift)
    b.output("y", b.emit(Op.ACT, y, fn="gelu"))
    p = Program("m", (b.build(),))
    step = run_pass(p, "fuse-causal-conv")
    ops = [n.op for n in step.after.graphs[0]]
    assert Op.CAUSAL_CONV in ops and Op.ADD in ops          # conv alone; bias and act stay
    assert any(d.rule == "conv-bias" and "not a parameter" in d.reason for d in step.refused())


def test_different_feature_maps_on_q_and_k_are_refused() -> None:
    b = GraphBuilder("decoder")
    q = b.input("q", shape(B, 2, T, 4), "f32")
    k = b.input("k", shape(B, 1, T, 4), "f32")
    v = b.input("v", shape(B, 1, T, 4), "f32")
    out = b.emit(Op.LINEAR_ATTENTION, b.emit(Op.ACT, q, fn="elu_plus_one"),
                 b.emit(Op.ACT, k, fn="relu"), v, layer=0)
    b.output("y", out)
    p = Program("m", (b.build(),))
    step = run_pass(p, "fuse-linear-attention")
    assert step.after is p
    (refused,) = step.refused()
    assert "one feature map" in refused.reason
