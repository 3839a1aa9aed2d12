"""Numbers computed from the IR: FLOPs, bytes moved, kernels, parameters, KV-cache size — every
figure archc prints, from the op table's cost expressions and the nodes' shapes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import sympy

from archc.dtypes import DTYPES
from archc.ir.graph import Graph, Node, Program
from archc.ir.ops import OP_TABLE, Op, full_attrs, roles_of
from archc.ir.ops.attention import kv_row_bytes
from archc.ir.ops.base import Sig, StateDecl
from archc.ir.ops.steps import HEAD_KERNELS
from archc.ir.paramexpr import leaves
from archc.ir.shapes import DTYPE_BYTES, evaluate, numel
from archc.quant.schemes import is_quantized, scheme
from archc.spec.schema import Spec


@dataclass(frozen=True)
class Cost:
    flops: sympy.Expr
    bytes: sympy.Expr

    def at(self, dims: Mapping[str, int]) -> tuple[int, int]:
        return evaluate(self.flops, dims), evaluate(self.bytes, dims)


def op_cost(op: Op, sig: Sig) -> Cost:
    """The counts of `op` over operands `sig`, plus its recurrent state, read once and written
    once."""
    d = OP_TABLE[op]
    state = sum(2 * s.bytes for s in d.states(sig))
    return Cost(sympy.sympify(d.flops(sig)), sympy.sympify(d.bytes(sig) + state))


def node_cost(g: Graph, i: int) -> Cost:
    return op_cost(g.nodes[i].op, g.sig(i))


def graph_cost(g: Graph) -> Cost:
    costs = [node_cost(g, i) for i in g.compute_ids()]
    return Cost(sympy.Add(*[c.flops for c in costs]), sympy.Add(*[c.bytes for c in costs]))


def kernel_count(p: Program) -> int:
    return sum(len(g.compute_ids()) for g in p)


def _checkpoint_params(p: Program) -> dict[str, Node]:
    """Every distinct parameter the program reads, by name, but computed buffers (no leaves)."""
    return {n.name: n for g in p for n in g if n.op == Op.PARAM
            and (n.attr("expr") is None or leaves(n.attr("expr")))}


def parameter_count(p: Program) -> int:
    return sum(evaluate(numel(n.shape), {}) for n in _checkpoint_params(p).values())


def active_parameter_count(p: Program) -> int:
    """Parameters one token's forward pass reads: every one, but of each expert matmul's
    weights and biases only its top_k experts' (k of E)."""
    routed: dict[str, tuple[Node, int, int]] = {}
    for g in p:
        for n in g:
            if n.op != Op.MOE_LINEAR:
                continue
            named = roles_of(n.op, full_attrs(n.op, n.attrs), len(n.inputs))
            for role in ("weight", "bias"):
                if role in named:
                    w = g.nodes[n.inputs[named.index(role)]]
                    routed[w.name] = (w, int(n.attr("top_k")), int(w.shape[0]))
    idle = sum(evaluate(numel(w.shape), {}) // e * (e - k) for w, k, e in routed.values())
    return parameter_count(p) - idle


def param_bytes(n: Node) -> int:
    """Bytes a parameter holds: elements × bytes of its dtype, or for a quantized weight the
    bytes of its stored parts (codes, scales, offsets; a last, partial group or byte counted
    whole — ``Scheme.part_shapes``)."""
    shape = [evaluate(d, {}) for d in n.shape]
    if not is_quantized(n.dtype):
        return evaluate(numel(n.shape), {}) * int(DTYPE_BYTES[n.dtype])
    lead = math.prod(shape[:-2])
    return lead * sum(rows * cols * DTYPES[dtype].bytes for (rows, cols), dtype
                      in scheme(n.dtype).part_shapes(shape[-2], shape[-1]).values())


def parameter_bytes(p: Program) -> int:
    return sum(param_bytes(n) for n in _checkpoint_params(p).values())


def parameter_dtypes(p: Program) -> dict[str, int]:
    """Dtype (or scheme) → how many parameters hold it, the most common first."""
    counts: dict[str, int] = {}
    for n in _checkpoint_params(p).values():
        counts[n.dtype] = counts.get(n.dtype, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def kv_cache_bytes_per_token(p: Program) -> int:
    """Bytes the KV cache grows by per token of one sequence, from `kv_cache` nodes (unfused)
    and `kv_write` epilogue steps (kernel-level): H_kv rows of d_h for k and again for v —
    2·L·H_kv·d_h·bytes for a plain decoder, 2·L·H_kv·(d_h + 4) with an int8 or fp8 cache
    (one-byte codes and an f32 scale a row)."""
    total = sympy.Integer(0)
    for g in p:
        for n in g:
            x = g.nodes[n.inputs[0]] if n.inputs else None
            if n.op == Op.KV_CACHE:   # x: the new k or v rows [B, H_kv, T, d_h]
                total += x.shape[1] * kv_row_bytes(x.shape[3], x.dtype, n.attr("quant"))
            elif n.op in HEAD_KERNELS:     # a projection's or a QK-norm's epilogue
                total += sum(2 * st.kw("kv_heads") * kv_row_bytes(
                    st.kw("head_dim"), x.dtype, st.kw("quant"))
                    for st in n.attr("epilogue") if st.fn == "kv_write")
    return evaluate(sympy.simplify(total), {})


def node_states(g: Graph, i: int) -> tuple[StateDecl, ...]:
    return OP_TABLE[g.nodes[i].op].states(g.sig(i))


def state_keys(g: Graph, i: int) -> list[tuple[int, str]]:
    """The (layer, kind) of each recurrent state node i reads and updates (none for most)."""
    return [(g.nodes[i].attr("layer"), d.kind) for d in node_states(g, i)]


def recurrent_state_bytes(p: Program) -> int:
    """Bytes of recurrent state one sequence keeps, as its nodes declare it: fixed at any length."""
    seen: dict[tuple[int, str], int] = {}
    for g in p:
        for i in g.compute_ids():
            for d in node_states(g, i):
                seen[(g.nodes[i].attr("layer"), d.kind)] = evaluate(d.bytes, {"B": 1})
    return sum(seen.values())


def per_layer(spec: Spec, count: int, count_without_layers: int) -> float:
    """Average of a count over the blocks (encoder and decoder blocks together)."""
    return (count - count_without_layers) / (spec.layers + (spec.decoder_layers or 0))


def without_layers(spec: Spec) -> Spec:
    """The model without blocks, to attribute counts to layers by difference (lowering does not
    validate, so zero layers is fine)."""
    return replace(spec, layers=0, decoder_layers=0 if spec.decoder_layers is not None else None)
