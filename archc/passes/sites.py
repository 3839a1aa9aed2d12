"""Finding attention in a graph: the score chain after `scores`, and the projections that feed
q, k and v through views, per-head norms, RoPE, the KV cache and `repeat_kv`.

Passes that reason about attention (bias folding, Q/K/V merging, flash attention) share these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from archc.ir.attrs import Call
from archc.ir.ops import Op
from archc.passes.rewrite import Rewriter

# Score modifiers as lowering emits them, in the order the `attention` op applies them: a scale
# and a soft-cap (pointwise), a position bias, the mask.
MODIFIERS = ("scale", "softcap", "alibi", "rel_bias", "mask")

# Ops a q/k/v value may pass through between its projection and the attention that reads it.
HEAD_PATH = frozenset({Op.SPLIT_HEADS, Op.SLICE, Op.ROPE, Op.NORM, Op.KV_CACHE, Op.REPEAT_KV})


def modifier(rw: Rewriter, i: int) -> str | None:
    """Which score modifier node i is (None if it is none): a pointwise scale(x(0)) or
    softcap(x(0)), alibi, rel_bias or mask."""
    n = rw.node(i)
    if n.op == Op.POINTWISE:
        e = n.attr("expr")
        if len(n.inputs) == 1 and e.fn in ("scale", "softcap") and e.args == (Call("x", (0,)),):
            return e.fn
        return None
    return n.op.value if n.op.value in MODIFIERS else None


@dataclass
class ScoreChain:
    """scores → modifiers → softmax → weighted_sum → merge_heads, following single users."""

    scores: int
    modifiers: list[int] = field(default_factory=list)
    softmax: int | None = None
    wsum: int | None = None
    merge: int | None = None
    problem: str = ""          # why the chain stops short, if it does

    def modifier(self, rw: Rewriter, kind: str) -> int | None:
        for i in self.modifiers:
            if modifier(rw, i) == kind:
                return i
        return None


def score_chain(rw: Rewriter, scores: int) -> ScoreChain:
    chain = ScoreChain(scores)
    cur = scores
    while True:
        users = rw.users(cur)
        if len(users) != 1:
            chain.problem = (f"%{cur} ({rw.op(cur).value}) is read by "
                             f"{len(users)} nodes, not only by the next step of attention")
            return chain
        nxt = users[0]
        op = rw.op(nxt)
        if modifier(rw, nxt) is not None and rw.node(nxt).inputs[0] == cur:
            chain.modifiers.append(nxt)
            cur = nxt
            continue
        if op == Op.SOFTMAX:
            chain.softmax = nxt
            break
        chain.problem = f"%{nxt} ({op.value}) between scores and softmax is not a score modifier"
        return chain
    users = rw.users(chain.softmax)
    if len(users) != 1 or rw.op(users[0]) != Op.WEIGHTED_SUM or \
            rw.node(users[0]).inputs[0] != chain.softmax:
        chain.problem = f"the probabilities %{chain.softmax} are read by something other than " \
                        "one weighted_sum"
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
    """For an attention site (a `scores` or `attention` node): the nodes its q, k and v come
    from, when it reads them as inputs."""
    n = rw.node(i)
    if n.op == Op.SCORES:
        chain = score_chain(rw, i)
        if chain.wsum is None:
            return None
        return {"q": n.inputs[0], "k": n.inputs[1], "v": rw.node(chain.wsum).inputs[1]}
    if n.op == Op.ATTENTION:
        if n.attr("cache_layer") is not None:
            return {"q": n.inputs[0]}
        return {"q": n.inputs[0], "k": n.inputs[1], "v": n.inputs[2]}
    if n.op == Op.LINEAR_ATTENTION:
        return {"q": n.inputs[0], "k": n.inputs[1], "v": n.inputs[2]}
    return None


def attention_sites(rw: Rewriter) -> list[int]:
    """Nodes that read q, k and v projections: softmax attention (decomposed or flash) and
    linear attention. Only the projection merges use these; nothing here says a bias is
    invariant (φ(k + b) is not φ(k) shifted, so linear attention keeps its key bias)."""
    return [i for i in rw.order() if rw.op(i) in (Op.SCORES, Op.ATTENTION, Op.LINEAR_ATTENTION)]
