"""The LM head over the rows whose logits are used: a prefill for `generate` or the serving
engine needs each sequence's last token's logits only, not T rows of them.

``last-token-logits`` is a *variant* pass: its program's logits are row T − 1 of the program's
(``[B, 1, vocab]``), the rest of the function is unchanged — so it never runs in the default
pipeline; the runtime runs the variant for those prefills (``LAST_TOKEN``) and the program itself
wherever the caller asks for every row (``compiled(ids)``, perplexity, validation). It applies
at any level, unfused or kernel-level:

1. From the graph's `logits` output, walk back through the head: row-wise nodes (a matmul, a
   norm, an elementwise op or fused linear of them) with one activation input — the rest are
   parameters — each read only by the next, none writing a cache.
2. The activation the head starts from (the residual stream after the last block) is read through
   ``last_token``, a view of its last row per sequence: [B, T, D] → [B, 1, D], no copy.
3. The head's nodes are built again over that row, shapes re-inferred, and the output with them.

For llama3-8b's 2048-token prefill the head is about 7% of the FLOPs; the blocks are unchanged
(their last-layer rows still feed the KV cache).
"""

from __future__ import annotations

import sympy

from archc.ir.graph import Graph, Program, infer
from archc.ir.ops import ELEMENTWISE, ROW_KERNELS, Op
from archc.ir.shapes import T
from archc.passes.manager import PassContext, register_pass, run_pass
from archc.passes.rewrite import Rewriter, is_root

PASS = "last-token-logits"
# ops whose output row r is a function of row r of their one activation input
ROW_WISE = (ROW_KERNELS - {Op.MOE_LINEAR}) | ELEMENTWISE | {Op.MATMUL}


def _activations(g: Graph, i: int) -> list[int]:
    """The inputs of node i that are not parameters."""
    return [j for j in g.nodes[i].inputs if g.nodes[j].op != Op.PARAM]


def head(g: Graph, out: int) -> tuple[list[int], int | None]:
    """The head before output `out`, in order (step 1 of the module docstring), and the
    activation it starts from (None when there is no head to select rows for)."""
    users = g.users()
    chain: list[int] = []
    after, i = out, g.nodes[out].inputs[0]
    while (g.nodes[i].op in ROW_WISE and not is_root(g.nodes[i]) and users[i] == [after]
           and len(_activations(g, i)) == 1):
        chain.insert(0, i)
        after, i = i, _activations(g, i)[0]
    shape = g.nodes[i].shape
    if not chain or len(shape) != 3 or sympy.sympify(shape[1]) != T:
        return chain, None
    return chain, i


@register_pass(PASS, "the LM head over each sequence's last token: logits [B, 1, vocab] from a "
               "last_token view of the stream it starts from (a prefill whose caller uses the "
               "last logits only)", kind="variant")
def last_token_logits(g: Graph, ctx: PassContext) -> Graph:
    out = g.outputs.get("logits")
    if out is None:
        return g
    chain, start = head(g, out)
    if start is None:
        ctx.refused(PASS, out, "no row-wise head between the last mixing node and the logits "
                    "(or its stream is not [B, T, D])")
        return g
    rw = Rewriter(g, ctx)
    prev = rw.emit(Op.LAST_TOKEN, [start], like=[chain[0]])
    for i in [*chain, out]:     # the head again over one row a sequence, then the output
        n = rw.nodes[i]
        inputs = [prev if rw.nodes[j].op != Op.PARAM else j for j in n.inputs]
        shape, dtype = infer(n.op, [rw.nodes[j].shape for j in inputs],
                             [rw.nodes[j].dtype for j in inputs], n.attrs)
        new = rw.add_node(n.op, inputs, n.attrs, shape, dtype, [i], i)
        if i == out:
            rw.kill(i)
        else:
            rw.replace(i, new)
        prev = new
    ctx.applied(PASS, out, f"last_token(%{start}) before the {len(chain)} node"
                f"{'s' if len(chain) > 1 else ''} of the head")
    return rw.finish()


def last_token_graph(program: Program) -> Graph | None:
    """The decoder of `program`'s last-token-logits variant, or None where the pass does not
    apply (no decoder, no head it can select rows for)."""
    if "decoder" not in {g.name for g in program}:
        return None
    step = run_pass(program, PASS)
    return step.after.graph("decoder") if step.changed else None
