"""The roofline model: a time for every kernel before any GPU is touched.

A node's roofline time is max(FLOPs / peak, bytes / bandwidth), its FLOPs and bytes from the IR;
it is compute- or memory-bound by which term wins. A collective (a tensor-parallel program's
all_reduce, all_gather…) is no kernel over HBM: its bytes are those one GPU sends over the link
to the others, priced at the link's bandwidth, and kept apart from memory traffic. A decode step
has a floor no kernel can beat: what it must read (and, for recurrent state, write) once from
HBM, plus, for a tensor-parallel program, what its collectives must send, which cannot overlap
the layers that wait on them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from archc.gpus import GPU
from archc.ir.cost import node_cost, node_states, param_bytes
from archc.ir.graph import CROSS_KV, Graph, Program
from archc.ir.ops import Op
from archc.ir.ops.attention import kv_row_bytes
from archc.ir.ops.base import COLLECTIVE
from archc.ir.ops.core import routed_pairs
from archc.ir.paramexpr import leaves
from archc.ir.shapes import DTYPE_BYTES, evaluate, numel
from archc.quant.schemes import is_quantized

_LAYER = re.compile(r"(layers\.|layer )\d+\b")    # a layer's number, which grouping drops


@dataclass(frozen=True)
class KernelRoof:
    graph: str
    index: int
    op: str
    label: str
    flops: int
    bytes: int

    @property
    def collective(self) -> bool:
        """Bytes over the GPU-to-GPU link, not through memory."""
        return Op(self.op) in COLLECTIVE

    def time(self, g: GPU) -> float:
        if self.collective:
            return self.bytes / g.link
        return max(self.flops / g.peak_flops, self.bytes / g.bandwidth)

    def bound(self, g: GPU) -> str:
        if self.collective:
            return "link"
        return "compute" if self.flops / g.peak_flops >= self.bytes / g.bandwidth else "memory"


def _is_weight(g: Graph, j: int) -> bool:
    """A param read from the checkpoint (not a computed buffer such as RoPE frequencies)."""
    p = g.nodes[j]
    return p.op == Op.PARAM and (p.attr("expr") is None or bool(leaves(p.attr("expr"))))


def label(g: Graph, i: int) -> str:
    """What a kernel works on: the first weight it reads, or its layer."""
    n = g.nodes[i]
    weight = next((g.nodes[j].name for j in n.inputs if _is_weight(g, j)), None)
    layer = n.attr("cache_layer", n.attr("layer"))
    return weight or (f"layer {layer}" if layer is not None else n.origin)


def per_step(program: Program) -> Program:
    """The graphs a decode step runs: all but the encoder and the cross-KV graph (run once per
    generation, before the decode steps)."""
    return Program(program.model, tuple(g for g in program if g.name not in ("encoder", CROSS_KV)))


def kernels(program: Program, dims: Mapping[str, int]) -> list[KernelRoof]:
    return [KernelRoof(g.name, i, g.nodes[i].op.value, label(g, i), *node_cost(g, i).at(dims))
            for g in program for i in g.compute_ids()]


@dataclass(frozen=True)
class KernelGroup:
    """Kernels that are the same but for the layer: one row of a report."""

    op: str
    label: str
    launches: int
    flops: int
    bytes: int
    time: float
    bound: str

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def grouped(ks: list[KernelRoof], g: GPU) -> list[KernelGroup]:
    rows: dict[tuple[str, str, str], list[KernelRoof]] = {}
    for k in ks:
        rows.setdefault((k.graph, k.op, _LAYER.sub(r"\1*", k.label)), []).append(k)
    return [KernelGroup(op, lab, len(group), sum(k.flops for k in group),
                        sum(k.bytes for k in group), sum(k.time(g) for k in group),
                        group[0].bound(g)) for (_, op, lab), group in rows.items()]


# ---- the decode floor ------------------------------------------------------------------------

def weight_bytes_read(program: Program, dims: Mapping[str, int]) -> int:
    """Bytes of every weight a step reads once: embedding tables only the rows looked up, MoE
    expert weights only the experts tokens are routed to (min(E, tokens·k) of E); a quantized
    weight, the bytes of its stored parts (codes, scales, offsets)."""
    seen: dict[str, float] = {}
    for g in program:
        for i in g.compute_ids():
            n = g.nodes[i]
            for slot, j in enumerate(n.inputs):
                if not _is_weight(g, j):
                    continue
                p = g.nodes[j]
                read = n.shape if n.op == Op.EMBEDDING else p.shape   # a gather: its rows
                size = evaluate(numel(read), dims) * DTYPE_BYTES[p.dtype]
                if is_quantized(p.dtype):   # its stored parts, a row's scales counted whole
                    size = param_bytes(p) * evaluate(numel(read), dims) / evaluate(
                        numel(p.shape), dims)
                if n.op == Op.MOE_LINEAR and slot == 2:   # the experts some token is routed to
                    experts = evaluate(p.shape[0], dims)
                    size = size * min(experts, evaluate(routed_pairs(g.sig(i)), dims)) / experts
                seen[p.name] = max(seen.get(p.name, 0.0), size)
    return int(sum(seen.values()))


def _window_of_layer(g: Graph, layer: int) -> tuple[int | None, int | None]:
    """The sliding window and global tokens of a cached layer: of the first mask (in the graph's
    topological order) its key cache flows into."""
    start = next(i for i, n in enumerate(g.nodes) if n.op == Op.KV_CACHE
                 and n.attr("layer") == layer and n.attr("kind") in ("k", "latent"))
    reached = {start}
    for u in range(start + 1, len(g.nodes)):
        n = g.nodes[u]
        if reached.intersection(n.inputs):
            if n.op == Op.MASK:
                return n.attr("window"), n.attr("global_tokens")
            reached.add(u)
    return None, None


def kv_bytes_read(program: Program, dims: Mapping[str, int]) -> int:
    """KV-cache bytes a step attends over: each cached layer's K and V over the keys its
    mask lets through (P + T, or the window and global tokens for local layers)."""
    length = dims["P"] + dims["T"]

    def keys(window: int | None, global_tokens: int | None) -> int:
        return length if window is None else min(length, window + dims["T"] - 1
                                                 + (global_tokens or 0))
    total = 0
    for g in program:
        for n in g.nodes:
            if n.op == Op.KV_CACHE:     # unfused: a K or a V of [B, H_kv, T, D]
                x = g.nodes[n.inputs[0]]
                # B·H_kv rows of D values (codes and a scale each in a quantized cache)
                row = evaluate(numel(x.shape[:2]) * kv_row_bytes(x.shape[3], x.dtype,
                                                                 n.attr("quant")), dims)
                total += row * keys(*_window_of_layer(g, n.attr("layer")))
            elif n.op == Op.ATTENTION and n.attr("cache_layer") is not None:
                q = g.nodes[n.inputs[0]]
                row = 2 * dims["B"] * n.attr("kv_heads") * evaluate(   # K and V
                    kv_row_bytes(q.shape[3], q.dtype, n.attr("kv_quant")), dims)
                total += row * keys(n.attr("window"), n.attr("global_tokens"))
    return total


def state_bytes_moved(program: Program, dims: Mapping[str, int]) -> int:
    """Recurrent-state bytes a step moves: each state a node declares (``StateDecl``), read at
    the start of the call and written at its end."""
    return sum(2 * evaluate(d.bytes, dims) for g in program for i in g.compute_ids()
               for d in node_states(g, i))


def link_bytes_sent(program: Program, dims: Mapping[str, int]) -> int:
    """Bytes one GPU sends over the link in a call: its collectives' (ring all-reduce of n
    bytes over N ranks: 2·(N − 1)/N·n)."""
    return int(sum(evaluate(node_cost(g, i).bytes, dims) for g in program
                   for i in g.compute_ids() if g.nodes[i].op in COLLECTIVE))


@dataclass(frozen=True)
class DecodeFloor:
    weight_bytes: int
    kv_bytes: int
    seconds: float
    tokens_per_second: float
    state_bytes: int = 0        # recurrent state read and written (Mamba, linear attention)
    link_bytes: int = 0         # sent to the other GPUs by a tensor-parallel program's collectives
    link_seconds: float = 0.0   # link_bytes at the link's bandwidth (part of `seconds`)

    @property
    def bytes(self) -> int:
        """Bytes through HBM (the link's apart)."""
        return self.weight_bytes + self.kv_bytes + self.state_bytes


def decode_floor(program: Program, g: GPU, batch: int, past: int) -> DecodeFloor:
    """The fastest a decode step can be on one GPU running `program` (a tensor-parallel rank's,
    when sharded): weights and KV cache read once, recurrent state read and written once, at
    full bandwidth; then its collectives' bytes sent at the link's bandwidth — each layer waits
    on its all-reduce, so that time adds (a collective's latency is left out)."""
    dims = {"B": batch, "T": 1, "P": past, "S": max(past, 1)}
    step = per_step(program)
    w, kv, state = (f(step, dims) for f in (weight_bytes_read, kv_bytes_read, state_bytes_moved))
    link = link_bytes_sent(step, dims)
    link_seconds = link / g.link if link else 0.0
    seconds = (w + kv + state) / g.bandwidth + link_seconds
    return DecodeFloor(w, kv, seconds, batch / seconds, state, link, link_seconds)
