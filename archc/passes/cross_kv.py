"""hoist-cross-kv: cross-attention's keys and values are computed once per generation.

The decoder's cross-attention projects the encoder's states to K and V at every decode step,
though they depend on `encoder_hidden` and weights alone. This program pass moves that work into
a graph ``cross_kv``, run once per generation; every decoder step reads its outputs as inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

from archc.ir.attrs import Attrs
from archc.ir.graph import CROSS_KV, Graph, Node, Program
from archc.ir.ops import META, VIEW, Op
from archc.passes.manager import PassContext, register_pass
from archc.passes.rewrite import Rewriter, is_root, unique_name

SOURCE = "encoder_hidden"
# repeat_kv only copies KV heads: hoisting it would store every query head's copy; left in the
# decoder, share-kv-heads reads the KV heads in place instead
NOT_HOISTED = frozenset({Op.REPEAT_KV, Op.KV_CACHE})


def constant_over_steps(g: Graph) -> set[int]:
    """Nodes whose value depends on the encoder's states and weights only."""
    source = g.inputs.get(SOURCE)
    if source is None:
        return set()
    fixed: set[int] = set()
    for i, n in enumerate(g.nodes):
        if n.op in META or n.op in NOT_HOISTED or is_root(n):
            continue
        if all(j == source or j in fixed or g.nodes[j].op == Op.PARAM for j in n.inputs) and \
                any(j == source or j in fixed for j in n.inputs):
            fixed.add(i)
    # views at the edge stay with their readers (free in the decoder; outputs would copy them);
    # in reverse order, a view's readers are settled before it
    users = g.users()
    for i in sorted(fixed, reverse=True):
        if g.nodes[i].op in VIEW and not any(u in fixed for u in users[i]):
            fixed.discard(i)
    return fixed


def _name(g: Graph, i: int, taken: set[str]) -> str:
    """An input/output name for node i: the weight it (or what it reads) multiplies by."""
    queue, base = [i], f"{g.name}.cross_kv.{i}"
    for j in queue:     # breadth first
        n = g.nodes[j]
        params = [g.nodes[k].name for k in n.inputs if g.nodes[k].op == Op.PARAM]
        if params:
            base = params[-1] if n.op == Op.ADD else params[0]
            base = base.removesuffix(".weight").removesuffix(".bias")
            break
        queue += [k for k in n.inputs if k not in queue]
    return unique_name(base, taken)


@register_pass("hoist-cross-kv", "cross-attention K/V projections of the encoder's states leave "
               "the decoder for a cross_kv graph run once per generation; decoder steps read them "
               "as inputs", program=True)
def hoist_cross_kv(program: Program, contexts: Mapping[str, PassContext]) -> Program:
    # 1. In the decoder, the pure nodes (no cache writes) that depend only on `encoder_hidden`
    #    and weights: the same at every step. Profitable if they include a matmul.
    # 2. `cross_kv`: encoder_hidden, the weights they read, the nodes, and an output per node
    #    the decoder still reads, named after its weight.
    # 3. In the decoder each such node becomes an input of that name; what only they read goes.
    names = [g.name for g in program]
    if "decoder" not in names or CROSS_KV in names:
        return program
    g, ctx = program.graph("decoder"), contexts["decoder"]
    fixed = constant_over_steps(g)
    if not fixed:
        return program
    if not any(g.nodes[i].op in (Op.MATMUL, Op.FUSED_LINEAR) for i in fixed):
        ctx.refused("hoist-cross-kv", min(fixed), "nothing read from the encoder's states does "
                    "work that a step could skip", profitability=True)
        return program
    users = g.users()
    frontier = [i for i in sorted(fixed) if any(u not in fixed for u in users[i])]
    taken = set(g.inputs)
    out_names = {i: _name(g, i, taken) for i in frontier}

    # the cross_kv graph, nodes in the decoder's order, each weight just before its first reader
    source = g.inputs[SOURCE]
    number: dict[int, int] = {}
    nodes: list[Node] = []
    for i in [source, *sorted(fixed)]:
        for j in [*g.nodes[i].inputs, i]:
            if j not in number:
                n = g.nodes[j]
                number[j] = len(nodes)
                nodes.append(n.replace(inputs=tuple(number[k] for k in n.inputs), passes=(
                    n.passes if n.op in META else n.passes + ("hoist-cross-kv",))))
    nodes += [Node(Op.OUTPUT, (number[i],), Attrs(name=out_names[i]), g.nodes[i].shape,
                   g.nodes[i].dtype, g.nodes[i].origin, ("hoist-cross-kv",)) for i in frontier]

    # the decoder reads them
    rw = Rewriter(g, ctx)
    for i in frontier:
        n = g.nodes[i]
        rw.replace(i, rw.add_node(Op.INPUT, (), Attrs(name=out_names[i]), n.shape, n.dtype,
                                  like=[i], at=source))
        ctx.applied("hoist-cross-kv", i, f"computed once per generation in {CROSS_KV}, read as "
                    f"input {out_names[i]!r}")
    for i in sorted(fixed - set(frontier), reverse=True):
        rw.kill(i)       # read only by what moved
    if not rw.users(source):
        rw.kill(source)
    k = names.index("decoder")    # cross_kv goes just before the decoder
    return Program(program.model, (*program.graphs[:k], Graph(CROSS_KV, tuple(nodes)),
                                   rw.finish(), *program.graphs[k + 1:]))
