"""Finding attention in a graph: the score chain after `scores`, and the projections that feed
q, k and v through views, per-head norms, RoPE, the KV cache and `repeat_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from archc.ir.graph import Node
from archc.ir.ops import Op
from archc.passes.linear import unary
from archc.passes.rewrite import Rewriter

# Score modifiers as lowering emits them, ranked in the order the `attention` op applies them: a
# scale and a soft-cap (pointwise), a position bias, the mask.
MODIFIERS = {"scale": 0, "softcap": 1, "alibi": 2, "rel_bias": 2, "mask": 3}

# Ops a q/k/v value may pass through between its projection and the attention that reads it.
HEAD_PATH = frozenset({Op.SPLIT_HEADS, Op.SLICE, Op.ROPE, Op.NORM, Op.KV_CACHE, Op.REPEAT_KV})


def modifier(n: Node) -> str | None:
    """Which score modifier n is, if any: a pointwise scale(x(0)) or softcap(x(0)), alibi,
    rel_bias or mask."""
    kind = unary(n) if n.op == Op.POINTWISE else n.op.value
    return kind if kind in MODIFIERS else None


@dataclass
class ScoreChain:
    """scores → modifiers → softmax → weighted_sum → merge_heads, following single users."""

    scores: int
    modifiers: list[int] = field(default_factory=list)
    softmax: int | None = None
    wsum: int | None = None
    merge: int | None = None
    problem: str = ""          # why the chain stops short, if it does


def score_chain(rw: Rewriter, scores: int) -> ScoreChain:
    chain = ScoreChain(scores)
    cur = scores
    while rw.op(cur) != Op.SOFTMAX:
        users = rw.users(cur)
        if len(users) != 1:
            chain.problem = (f"%{cur} ({rw.op(cur).value}) is read by "
                             f"{len(users)} nodes, not only by the next step of attention")
            return chain
        nxt = users[0]
        if rw.op(nxt) != Op.SOFTMAX:
            if modifier(rw.node(nxt)) is None or rw.node(nxt).inputs[0] != cur:
                chain.problem = (f"%{nxt} ({rw.op(nxt).value}) between scores and softmax is "
                                 "not a score modifier")
                return chain
            chain.modifiers.append(nxt)
        cur = nxt
    chain.softmax = cur
    users = rw.users(cur)
    if len(users) != 1 or rw.op(users[0]) != Op.WEIGHTED_SUM or rw.node(users[0]).inputs[0] != cur:
        chain.problem = f"the probabilities %{cur} are read by something other than one " \
                        "weighted_sum"
        return chain
    chain.wsum = users[0]
    users = rw.users(chain.wsum)
    if len(users) == 1 and rw.op(users[0]) == Op.MERGE_HEADS:
        chain.merge = users[0]
    else:
        chain.problem = f"the head outputs %{chain.wsum} are not merged by one merge_heads"
    return chain


def trace_up(rw: Rewriter, i: int) -> tuple[list[int], int]:
    """Walk from node i up its first input while the op is a head-path op; returns the path
    (nearest first) and the node it stops at."""
    path: list[int] = []
    while rw.op(i) in HEAD_PATH:
        path.append(i)
        i = rw.node(i).inputs[0]
    return path, i


def attention_operands(rw: Rewriter, i: int) -> dict[str, int] | None:
    """For a node that reads q, k and v projections — softmax attention (decomposed at its
    `scores`, or flash) or linear attention — the nodes its q, k and v come from, when it reads
    them as inputs. Only the projection merges use these; nothing here says a bias is invariant
    (φ(k + b) is not φ(k) shifted, so linear attention keeps its key bias)."""
    n = rw.node(i)
    if n.op == Op.SCORES:
        wsum = score_chain(rw, i).wsum
        return None if wsum is None else {"q": n.inputs[0], "k": n.inputs[1],
                                          "v": rw.node(wsum).inputs[1]}
    if n.op == Op.ATTENTION and n.attr("cache_layer") is not None:
        return {"q": n.inputs[0]}
    return dict(zip("qkv", n.inputs)) if n.op in (Op.ATTENTION, Op.LINEAR_ATTENTION) else None
