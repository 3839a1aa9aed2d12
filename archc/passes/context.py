"""context-parallel (the pass, option ``cp``; ``context_parallel(program, cp)``): ring attention
over a "cp" group of ranks, each holding a slice of the sequence (context parallelism for long
prefills).

The split is zig-zag: with cp ranks a sequence of T tokens is cut into 2·cp chunks (as equal as
T allows: the first T mod 2·cp chunks one token longer) and rank r holds chunks r and
2·cp − 1 − r, in that order. Under a causal mask a query's work grows with its position, so the
early chunk of a rank and its late one add up to the same work on every rank.

Every op of a transformer block except attention acts on each token alone, so those run
unchanged on a rank's tokens; RoPE and learned positions read the `positions` input, which the
session fills with the rank's global positions (``zigzag``). Each self-attention becomes ring
attention (the `ring` attribute of ``attention``, ``archc.ir.ops.attention.ring_attention``):
it also reads the positions, which its K/V blocks carry round the ring, so causal, sliding-window,
prefix, global-token and bidirectional masks and the ALiBi and T5 biases see global positions.
Cross-attention (over the encoder's S outputs, which every rank holds) is left as it is.

The session side (``archc.runtime.eager.EagerSession``): a prefill at P = 0 runs as a ring,
every rank gathers the logits (or an encoder's hidden states) of all ranks and puts them back in
sequence order, and then gathers every layer's K/V cache the same way, so after the prefill each
rank holds the whole cache and later steps run whole on every rank. That spends the memory a
split cache would save during decoding; the ring's gain is the prefill's attention work and
activations, divided by cp.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from archc.errors import ArchcError
from archc.ir.graph import Graph, Node, Program
from archc.ir.ops import Op, canonical
from archc.ir.ops.base import RECURRENT
from archc.ir.shapes import S, T
from archc.passes.manager import PassContext, register_pass, run_pass, run_pipeline

NAME = "context-parallel"


class ContextError(ArchcError):
    """A program that cannot run context parallel, or a bad cp."""


def zigzag(length: int, cp: int) -> list[torch.Tensor]:
    """The global positions each of `cp` ranks holds of a sequence of `length` tokens: chunks r
    and 2·cp − 1 − r of 2·cp near-equal chunks (every chunk non-empty: length ≥ 2·cp)."""
    if length < 2 * cp:
        raise ContextError(f"a ring over {cp} ranks splits the sequence into {2 * cp} chunks; "
                           f"{length} tokens are too few")
    chunks = torch.arange(length).tensor_split(2 * cp)
    return [torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)]


def _refuse_unsplittable(program: Program) -> None:
    """Ops that carry state along the sequence (recurrent mixers) or rotate by its length
    (dynamic NTK RoPE) do not split into independent slices."""
    for g in program:
        for i, n in enumerate(g.nodes):
            if n.op in RECURRENT:
                where = n.origin or "a recurrent mixer"
                raise ContextError(f"context parallel (cp) splits the sequence across ranks; "
                                   f"{n.op.value} %{i} in graph {g.name} ({where}) carries a "
                                   "state along it. Use cp=1 for recurrent mixers")
            if n.op == Op.ROPE and n.attr("dynamic") is not None:
                raise ContextError(f"context parallel (cp): rope %{i} in graph {g.name} "
                                   f"({n.origin or 'position.scaling'}) rescales its "
                                   "frequencies from the sequence length (dynamic NTK, "
                                   "LongRoPE), which "
                                   "a slice of the sequence does not know. Use cp=1")
            if n.op == Op.ATTENTION and n.attr("cache_layer") is not None:
                raise ContextError(f"context parallel (cp): attention %{i} in graph {g.name} "
                                   "reads the KV cache itself (fuse-kv-write); ring attention "
                                   "circulates k and v given to it: apply context_parallel "
                                   "before fuse-kv-write")
            if n.op == Op.SCORES:
                raise ContextError(f"context parallel (cp): scores %{i} in graph {g.name} is "
                                   "an attention not collapsed into one attention node; run "
                                   "the flash-attention pass first")


def _positions(g: Graph) -> tuple[Graph, int]:
    """The graph with a `positions` input (put first when it had none) and that input's id."""
    have = g.inputs.get("positions")
    if have is not None:
        return g, have
    pos = Node(Op.INPUT, (), canonical(Op.INPUT, {"name": "positions"}), (T,), "i64",
               "context_parallel")
    return Graph(g.name, (pos, *(n.replace(inputs=tuple(j + 1 for j in n.inputs))
                                 for n in g.nodes))), 0


def _self_attention(g: Graph, n: Node) -> bool:
    """An attention over the graph's own tokens (not cross-attention over the encoder's S)."""
    return n.op == Op.ATTENTION and n.attr("ring") is None and \
        S not in g.nodes[n.inputs[1]].shape[2].free_symbols


def _ring(g: Graph, cp: int) -> Graph:
    if not any(_self_attention(g, n) for n in g.nodes):
        return g
    g, pos = _positions(g)
    nodes = tuple(n.replace(attrs=n.attrs.replace(ring=cp), inputs=(*n.inputs, pos))
                  if _self_attention(g, n) else n for n in g.nodes)
    return Graph(g.name, nodes)


@register_pass(NAME, "context parallelism: every self-attention a ring over the cp ranks of "
               "the cp group, each holding a zig-zag slice of the sequence (attention chains "
               "collapsed first; before fuse-kv-write)", program=True, options={"cp": 1})
def ring(program: Program, contexts: Mapping[str, PassContext], cp: int) -> Program:
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ContextError(f"cp={cp!r}: the number of context-parallel ranks is an integer ≥ 1")
    if cp == 1:
        return program
    # ring attention is an attribute of the attention node: collapse the chains first
    unfused = any(n.op == Op.SCORES for g in program for n in g)
    collapsed = run_pipeline(program, ("flash-attention",) if unfused else ())
    _refuse_unsplittable(collapsed.program)
    graphs = []
    for g in collapsed.program:
        out, ctx = _ring(g, cp), contexts[g.name]
        shift = int(out is not g and "positions" not in g.inputs)   # the input put first
        if out is not g:
            ctx.applied(NAME, g.name, f"self-attention a ring over {cp} ranks")
        ctx.kept = {old: new + shift for old, new in collapsed.kept(g.name).items()}
        graphs.append(out)
    return Program(program.model, tuple(graphs))


def context_parallel(program: Program, cp: int) -> Program:
    """`program` with every self-attention a ring over `cp` ranks of the "cp" group (the same
    program when cp = 1). Raises ContextError for a cp below 1 and for programs whose ops do not
    split along the sequence."""
    return run_pass(program, NAME, options={"cp": cp}).after
