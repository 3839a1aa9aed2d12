"""The recurrent mixers as kernels: Mamba's causal convolution and selective scan (with Jamba's
B and C norms), and causal linear attention with its feature map. Each rule absorbs one neighbour
at a time, so a graph with only some of the pieces still gets the kernel, and a piece that cannot
join is left for `select-kernels` to name.
"""

from __future__ import annotations

from archc.ir.ops import Op
from archc.ir.ops.recurrent import FEATURE_MAPS
from archc.passes.linear import bias_of, norm_parts
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.rewrite import Refusal, Rewriter


def _conv_bias(rw: Rewriter, m: Bindings) -> int:
    conv = rw.nodes[m["conv"]]
    if conv.attr("bias") or conv.attr("act") != "identity":
        raise Refusal(f"%{m['conv']} already adds a bias or applies {conv.attr('act')}: the "
                      "bias would come after it")
    found = bias_of(rw, m["root"])
    if found is None:
        raise Refusal(f"%{m['root']} adds something that is not a parameter vector")
    return rw.emit(Op.CAUSAL_CONV, [*conv.inputs, found[1]], like=[m["conv"], m["root"]],
                   layer=conv.attr("layer"), bias=True)


def _conv_act(rw: Rewriter, m: Bindings) -> int:
    conv = rw.nodes[m["conv"]]
    if conv.attr("act") != "identity":
        raise Refusal(f"%{m['conv']} already applies {conv.attr('act')}")
    return rw.emit(Op.CAUSAL_CONV, conv.inputs, like=[m["conv"], m["root"]],
                   **conv.attrs.replace(act=rw.nodes[m["root"]].attr("fn")))


CONV = Pat({Op.CAUSAL_CONV}, "conv", one_use=True)
register_rule_pass("fuse-causal-conv", "Mamba: depthwise causal conv1d + bias + activation in one "
                   "kernel that updates the conv state", (
    # conv(x)[t, c] + b[c]: the bias joins the accumulator of each output before it is stored
    Rule("conv-bias", Pat({Op.ADD}, "root", (CONV,)), _conv_bias),
    # act(conv(x) + b) elementwise on the accumulator: the pre-activation is never stored
    Rule("conv-act", Pat({Op.ACT}, "root", (CONV,)), _conv_act),
))


def _ssm_scan(rw: Rewriter, m: Bindings) -> int:
    # (scan(x, Δ, A, B, C) + x·D) · silu(z)
    scan, skip, gate = rw.nodes[m["scan"]], rw.nodes[m["skip"]], rw.nodes[m["gate"]]
    x = scan.inputs[0]
    a, b = skip.inputs
    d = b if a == x else a if b == x else None
    if d is None:
        raise Refusal(f"the skip %{m['skip']} does not multiply the scan's input %{x}")
    if rw.op(d) != Op.PARAM or len(rw.shape(d)) != 1:
        raise Refusal(f"the skip's D %{d} is not a [channels] parameter")
    if gate.attr("fn") != "silu":
        raise Refusal(f"the gate %{m['gate']} is {gate.attr('fn')}, the kernel gates by silu")
    like = [m["scan"], m["skip"], m["add"], m["gate"], m["root"]]
    ins, extra = list(scan.inputs[:5]), []
    attrs = scan.attrs.replace(gate=True)
    normed = rw.attempt("ssm-norms", m["scan"], _bc_norms, rw, m["scan"], ins[3], ins[4])
    if normed:
        (ins[3], gb), (ins[4], gc), eps = normed
        extra, attrs = [gb, gc], attrs.replace(norm_eps=eps)
        like += list(scan.inputs[3:5])
        rw.ctx.applied("ssm-norms", m["scan"], "B and C normalized inside the scan")
    return rw.emit(Op.SSM_SCAN, [*ins, d, gate.inputs[0], *extra], like=like, **attrs)


def _bc_norms(rw: Rewriter, scan: int, bm: int, cm: int
              ) -> tuple[tuple[int, int], tuple[int, int], float] | None:
    """(B, gain), (C, gain), ε when B and C are both RMSNorms with a gain and one ε, read by the
    scan alone (Jamba); None when neither is a norm."""
    if rw.op(bm) != Op.NORM and rw.op(cm) != Op.NORM:
        return None
    parts = []
    for name, i in (("B", bm), ("C", cm)):
        norm = rw.nodes[i]
        if norm.op != Op.NORM or norm.attr("kind") != "rms" or norm.attr("unit_offset"):
            raise Refusal(f"{name} (%{i}) is not normalized as x·w/rms(x) with a gain w, "
                          "and the kernel normalizes both or neither")
        x, gain, shift = norm_parts(rw, i)
        if shift is not None:
            raise Refusal(f"{name} (%{i}) adds a shift after its norm")
        others = [u for u in rw.users(i) if u != scan]
        if others:
            raise Refusal(f"%{i} (norm) is also read by "
                          + ", ".join(f"%{u} ({rw.op(u).value})" for u in others)
                          + "; the scan kernel never stores it")
        parts.append((x, gain))
    eps_b, eps_c = rw.nodes[bm].attr("eps"), rw.nodes[cm].attr("eps")
    if eps_b != eps_c:
        raise Refusal(f"the B and C norms differ in ε ({eps_b} vs {eps_c})")
    return parts[0], parts[1], eps_b


register_rule_pass("fuse-ssm-scan", "Mamba: selective scan + D·x skip + silu(z) gate (+ B, C "
                   "norms) in one kernel that updates the SSM state", (
    # y = scan(x) + D·x, out = y·silu(z): the skip and the gate act on the scan's output per
    # channel and token, so they run where y_t is computed; y never leaves the kernel. Jamba's
    # B_t ← B_t·g_B/rms(B_t) (C likewise) is a per-token norm over d_state, which the scan loads
    # whole at each step anyway: it joins too.
    Rule("ssm-scan", Pat({Op.MUL}, "root", (
        Pat({Op.ADD}, "add", (Pat({Op.SSM_SCAN}, "scan", one_use=True,
                                  where=lambda n: not n.attr("gate")),
                              Pat({Op.MUL}, "skip")), one_use=True),
        Pat({Op.ACT}, "gate"))), _ssm_scan),
))


def _linear_attention(rw: Rewriter, m: Bindings) -> int:
    q_act, k_act = rw.nodes[m["q"]], rw.nodes[m["k"]]
    feature = q_act.attr("fn")
    if feature not in FEATURE_MAPS or k_act.attr("fn") != feature:
        raise Refusal(f"φ(q) is {feature} and φ(k) {k_act.attr('fn')}: the kernel applies one "
                      f"feature map of {', '.join(FEATURE_MAPS)} to both")
    root = rw.nodes[m["root"]]
    return rw.emit(Op.LINEAR_ATTENTION, [q_act.inputs[0], k_act.inputs[0], root.inputs[2]],
                   like=[m["root"], m["q"], m["k"]], **root.attrs.replace(feature=feature))


register_rule_pass("fuse-linear-attention", "linear attention: φ(q) and φ(k) in the kernel that "
                   "keeps the running sums and merges the heads", (
    # φq·S_i / φq·z_i with S, z the running sums of φ(k)vᵀ and φ(k): φ is elementwise, so the
    # kernel applies it to the q and k heads it loads
    Rule("linear-attention", Pat({Op.LINEAR_ATTENTION}, "root", (
        Pat({Op.ACT}, "q", one_use=True), Pat({Op.ACT}, "k", one_use=True)),
        where=lambda n: n.attr("feature") == "identity"), _linear_attention),
))
