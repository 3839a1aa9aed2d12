"""The recurrent mixers as kernels: Mamba's convolution and selective scan, causal linear attention.

- fuse-causal-conv: conv1d → bias_add → act becomes one `causal_conv` (the conv state is read
  and updated by that kernel alone).
- fuse-ssm-scan: selective_scan → + D·x → · silu(z) becomes one `ssm_scan`; Jamba's RMSNorm of
  B and C joins it too (a norm over d_state, recomputed per token inside the scan).
- fuse-linear-attention: φ(q), φ(k) → linear_scan → merge_heads becomes one `linear_attention`
  reading q, k and v as head views of their projections (GQA by index).

Each rule absorbs one neighbour at a time, so a graph with only some of the pieces still gets the
kernel, and a piece that cannot join is left for `select-kernels` to name.
"""

from __future__ import annotations

from archc.ir.ops import Op
from archc.ir.ops.linear_attention import FEATURE_MAPS
from archc.passes.context import Refusal
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.rewrite import Rewriter

# ---- fuse-causal-conv ------------------------------------------------------------------------


def _conv(rw: Rewriter, m: Bindings) -> int:
    n = rw.node(m["root"])
    return rw.emit(Op.CAUSAL_CONV, list(n.inputs), like=[m["root"]], layer=n.attr("layer"),
                   act="identity", bias=False)


def _conv_bias(rw: Rewriter, m: Bindings) -> int:
    conv = rw.node(m["conv"])
    if conv.attr("bias") or conv.attr("act") != "identity":
        raise Refusal(f"%{m['conv']} already adds a bias or applies {conv.attr('act')}: the "
                      "bias would come after it")
    if rw.op(m["b"]) != Op.PARAM:
        raise Refusal(f"the bias %{m['b']} is a {rw.op(m['b']).value}, not a parameter")
    x, w = conv.inputs
    return rw.emit(Op.CAUSAL_CONV, [x, w, m["b"]], like=[m["conv"], m["root"]],
                   layer=conv.attr("layer"), act="identity", bias=True)


def _conv_act(rw: Rewriter, m: Bindings) -> int:
    conv = rw.node(m["conv"])
    if conv.attr("act") != "identity":
        raise Refusal(f"%{m['conv']} already applies {conv.attr('act')}")
    return rw.emit(Op.CAUSAL_CONV, list(conv.inputs), like=[m["conv"], m["root"]],
                   layer=conv.attr("layer"), act=rw.node(m["root"]).attr("fn"),
                   bias=conv.attr("bias"))


CONV_RULES = (
    # conv1d(x, w) is causal_conv(x, w) with no bias and the identity: the kernel form
    Rule("causal-conv", Pat({Op.CONV1D}, "root"), _conv),
    # conv(x)[t, c] + b[c]: the bias joins the accumulator of each output before it is stored
    Rule("conv-bias", Pat({Op.BIAS_ADD}, "root", (
        Pat({Op.CAUSAL_CONV}, "conv", one_use=True), Pat(None, "b"))), _conv_bias),
    # act(conv(x) + b) elementwise on the accumulator: the pre-activation is never stored
    Rule("conv-act", Pat({Op.ACT}, "root", (Pat({Op.CAUSAL_CONV}, "conv", one_use=True),)),
         _conv_act),
)


register_rule_pass("fuse-causal-conv",
                   "Mamba: depthwise causal conv1d + bias + activation in one kernel that updates "
                   "the conv state",
                   CONV_RULES)


# ---- fuse-ssm-scan ---------------------------------------------------------------------------

def _either(rw: Rewriter, node: int, first: Op, second: Op) -> tuple[int, int] | None:
    """The two inputs of a binary node as (the one of op `first`, the one of op `second`), in
    whichever order they come."""
    a, b = rw.node(node).inputs
    if rw.op(a) == first and rw.op(b) == second:
        return a, b
    if rw.op(b) == first and rw.op(a) == second:
        return b, a
    return None


def _only_read_by(rw: Rewriter, node: int, reader: int) -> None:
    others = [u for u in rw.users(node) if u != reader]
    if others:
        raise Refusal(f"%{node} ({rw.op(node).value}) is also read by "
                      + ", ".join(f"%{u} ({rw.op(u).value})" for u in others)
                      + "; the scan kernel never stores it")


def _ssm_scan(rw: Rewriter, m: Bindings) -> int | None:
    # (scan(x, Δ, A, B, C) + x·D) · silu(z), the sum and the gate in either order
    root = m["root"]
    gated = _either(rw, root, Op.ADD, Op.ACT)
    if gated is None:
        return None
    add, gate = gated
    skip = _either(rw, add, Op.SELECTIVE_SCAN, Op.MUL)
    if skip is None:
        return None
    scan, mul = skip
    x = rw.node(scan).inputs[0]
    a, b = rw.node(mul).inputs
    d = b if a == x else a if b == x else None
    if d is None:
        raise Refusal(f"the skip %{mul} does not multiply the scan's input %{x}")
    if rw.op(d) != Op.PARAM or len(rw.shape(d)) != 1:
        raise Refusal(f"the skip's D %{d} is not a [channels] parameter")
    if rw.node(gate).attr("fn") != "silu":
        raise Refusal(f"the gate %{gate} is {rw.node(gate).attr('fn')}, the kernel gates by silu")
    _only_read_by(rw, scan, add)
    _only_read_by(rw, add, root)
    z = rw.node(gate).inputs[0]
    n = rw.node(scan)
    x, dt, am, bm, cm = n.inputs
    like = [scan, mul, add, gate, root]
    normed = _bc_norms(rw, scan, bm, cm)
    if normed is None:
        return rw.emit(Op.SSM_SCAN, [x, dt, am, bm, cm, d, z], like=like,
                       layer=n.attr("layer"))
    (bm, gb), (cm, gc), eps = normed
    return rw.emit(Op.SSM_SCAN, [x, dt, am, bm, cm, d, z, gb, gc], like=[*like, n.inputs[3],
                                                                          n.inputs[4]],
                   layer=n.attr("layer"), norm_eps=eps)


def _bc_norms(rw: Rewriter, scan: int, bm: int, cm: int
              ) -> tuple[tuple[int, int], tuple[int, int], float] | None:
    """(B, gain), (C, gain), ε when B and C are both RMSNorms with a gain and one ε, read by
    the scan alone (Jamba); None when they are not, and then the norms stay kernels of their
    own — the decision says why."""
    if rw.op(bm) != Op.RMSNORM and rw.op(cm) != Op.RMSNORM:
        return None
    try:
        norms = [rw.node(i) for i in (bm, cm)]
        for name, i, norm in (("B", bm, norms[0]), ("C", cm, norms[1])):
            if norm.op != Op.RMSNORM or len(norm.inputs) != 2 or norm.attr("unit_offset"):
                raise Refusal(f"{name} (%{i}) is not normalized as x·w/rms(x) with a gain w, "
                              "and the kernel normalizes both or neither")
            _only_read_by(rw, i, scan)
        if norms[0].attr("eps") != norms[1].attr("eps"):
            raise Refusal(f"the B and C norms differ in ε ({norms[0].attr('eps')} vs "
                          f"{norms[1].attr('eps')})")
    except Refusal as r:
        rw.ctx.refused("ssm-norms", rw.describe(scan), r.why)
        return None
    rw.ctx.applied("ssm-norms", rw.describe(scan), "B and C normalized inside the scan")
    b_in, c_in = norms[0].inputs, norms[1].inputs
    return (b_in[0], b_in[1]), (c_in[0], c_in[1]), norms[0].attr("eps")


SCAN_RULES = (
    # y = scan(x) + D·x, out = y·silu(z): the skip and the gate act on the scan's output per
    # channel and token, so they run where y_t is computed; y never leaves the kernel. Jamba's
    # B_t ← B_t·g_B/rms(B_t) (C likewise) is a per-token norm over d_state, which the scan loads
    # whole at each step anyway: it joins too.
    Rule("ssm-scan", Pat({Op.MUL}, "root"), _ssm_scan),
)


register_rule_pass("fuse-ssm-scan",
                   "Mamba: selective scan + D·x skip + silu(z) gate (+ B, C norms) in one kernel "
                   "that updates the SSM state",
                   SCAN_RULES)


# ---- fuse-linear-attention ---------------------------------------------------------------------

def _linear_attention(rw: Rewriter, m: Bindings) -> int:
    q_act, k_act = rw.node(m["q"]), rw.node(m["k"])
    feature = q_act.attr("fn")
    if feature not in FEATURE_MAPS or k_act.attr("fn") != feature:
        raise Refusal(f"φ(q) is {feature} and φ(k) {k_act.attr('fn')}: the kernel applies one "
                      f"feature map of {', '.join(FEATURE_MAPS)} to both")
    scan = rw.node(m["scan"])
    q, k, v = q_act.inputs[0], k_act.inputs[0], scan.inputs[2]
    return rw.emit(Op.LINEAR_ATTENTION, [q, k, v], like=[m["scan"], m["q"], m["k"], m["root"]],
                   layer=scan.attr("layer"), feature=feature)


LINEAR_ATTENTION_RULES = (
    # merge(φq·S_i / φq·z_i) with S, z the running sums of φ(k)vᵀ and φ(k): φ is elementwise,
    # so the kernel applies it to the q and k heads it loads; it writes the heads merged
    Rule("linear-attention", Pat({Op.MERGE_HEADS}, "root", (
        Pat({Op.LINEAR_SCAN}, "scan", (Pat({Op.ACT}, "q"), Pat({Op.ACT}, "k")), one_use=True),)),
        _linear_attention),
)


register_rule_pass("fuse-linear-attention",
                   "linear attention: φ(q), φ(k), running sums and head merge in one kernel that "
                   "updates the layer's sums",
                   LINEAR_ATTENTION_RULES)
