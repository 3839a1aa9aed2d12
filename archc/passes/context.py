"""context-parallel (option cp; ``context_parallel``): ring attention over a "cp" group of
ranks, each holding a slice of the sequence (context parallelism for long prefills).

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
from archc.ir.ops import Op
from archc.ir.ops.base import RECURRENT
from archc.ir.shapes import S, T
from archc.passes.manager import PassContext, optimize, register_pass

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


def sequence_refusal(n: Node) -> str | None:
    """Why op `n` cannot run on a part of a sequence, or beside rows of other sequences: it
    carries a state along it, rescales by its length, caches a latent, or is an attention chain
    to collapse."""
    if n.op in RECURRENT:
        return "carries a state along the sequence (a recurrent mixer)"
    if n.op == Op.ROPE and n.attr("dynamic") is not None:
        return "rescales its frequencies from the sequence length (dynamic NTK, LongRoPE)"
    if n.op == Op.KV_CACHE and n.attr("kind") == "latent":
        return "caches latent attention's latents, which no ring passes between ranks and no " \
            "paged cache holds yet"
    if n.op == Op.SCORES:
        return "is an attention not collapsed into one attention node; run flash-attention first"
    return None


def _refuse_unsplittable(program: Program) -> None:
    for g in program:
        for i, n in enumerate(g.nodes):
            why = sequence_refusal(n) or ("reads the KV cache itself (fuse-kv-write); ring "
                                          "attention circulates k and v given to it: apply "
                                          "context-parallel before fuse-kv-write"
                                          if n.op == Op.ATTENTION and
                                          n.attr("cache_layer") is not None else None)
            if why is not None:
                raise ContextError(f"context parallel (cp) splits the sequence across ranks; "
                                   f"{n.op.value} %{i} in graph {g.name} "
                                   f"({n.origin or n.op.value}) {why}")


def _self_attention(g: Graph, n: Node) -> bool:
    """An attention over the graph's own tokens (not cross-attention over the encoder's S)."""
    return n.op == Op.ATTENTION and n.attr("ring") is None and \
        S not in g.nodes[n.inputs[1]].shape[2].free_symbols


def _ring(g: Graph, cp: int) -> Graph:
    if not any(_self_attention(g, n) for n in g.nodes):
        return g
    g = g.with_inputs([("positions", (T,), "i64")], "context_parallel")
    pos = g.inputs["positions"]
    nodes = tuple(n.replace(attrs=n.attrs.replace(ring=cp), inputs=(*n.inputs, pos))
                  if _self_attention(g, n) else n for n in g.nodes)
    return Graph(g.name, nodes)


@register_pass(NAME, "context parallelism: every self-attention a ring over the cp ranks of "
               "the cp group, each holding a zig-zag slice of the sequence (after "
               "flash-attention, before fuse-kv-write)", program=True, options={"cp": 1})
def ring(program: Program, contexts: Mapping[str, PassContext], cp: int) -> Program:
    if cp == 1:
        return program
    _refuse_unsplittable(program)
    graphs = []
    for g in program:
        graphs.append(_ring(g, cp))
        if graphs[-1] is not g:
            shift = len(graphs[-1].nodes) - len(g.nodes)     # the positions input put first
            contexts[g.name].applied(NAME, g.name, f"self-attention a ring over {cp} ranks")
            contexts[g.name].kept = {i: i + shift for i in range(len(g.nodes))}
    return Program(program.model, tuple(graphs))


def context_parallel(program: Program, cp: int) -> Program:
    """`program` with its attention chains collapsed (flash-attention) and every self-attention
    a ring over `cp` ranks of the "cp" group. Raises ContextError for programs whose ops do not
    split along the sequence."""
    return optimize(program, ["flash-attention", (NAME, {"cp": cp})])
