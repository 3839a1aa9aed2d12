"""paged-kv (options block_size, max_seq_len; ``paged_kv``): a decoder whose KV cache is a pool
of fixed-size blocks, each sequence holding a list of them (its block table), so that many
sequences of different lengths decode together (``archc.runtime.paged``, what a server's
scheduler drives).

A paged step's T rows are tokens, each of its own sequence and at its own position: a prefill's
T tokens are one sequence's prompt (or what follows a prefix it shares), a decode step's are the
next token of each of T sequences (B = 1 throughout), each row's position being its sequence's
past length. Every op of a transformer block but attention acts on each token alone, so
those run unchanged; RoPE and learned positions read the `positions` input, which now holds each
token's own position. The transform adds two inputs, `positions` i64[T] (when the graph had
none) and `block_table` i32[T, blocks] (token t's row: the blocks of its sequence; blocks =
⌈max_seq_len / block_size⌉), and

- a KV-cache write — a `kv_cache` node, or the `kv_write` epilogue step of a projection or of
  a QK-norm — writes token t's row into block block_table[t, pos[t] // block_size] at offset
  pos[t] % block_size of the layer's pool (`kv_cache {paged}`, the `paged_kv_write` step);
- each self-attention reads its layer's pool through the block table (`attention {paged}`):
  token t attends to its sequence's keys at positions 0 … pos[t], under its causal (and window,
  soft-cap, ALiBi) mask at those positions;
- a LongRoPE rotation, whose factors depend on the sequence's length, rotates by its short
  factors when max_seq_len stays within its trained context (a static table); any other rotation
  rescaled by the sequence length is refused, since the rows of one step have different lengths.

The pools, [blocks, H_kv, block_size, D] per layer and k|v, belong to the runtime, as the
static KV cache does. The writes come before the attention that reads them (a prefill reads its
own prompt's keys), as the kv_cache nodes and the projections writing the cache already do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import sympy

from archc.errors import ArchcError
from archc.ir.attrs import Call
from archc.ir.graph import Graph, Node, Program
from archc.ir.ops import Op, full_attrs
from archc.ir.ops.base import RECURRENT
from archc.ir.ops.modifiers import modifiers_of
from archc.ir.ops.steps import HEAD_KERNELS, STEPS, step
from archc.ir.shapes import T
from archc.passes.context import sequence_refusal
from archc.passes.manager import PassContext, optimize, register_pass

NAME = "paged-kv"


class PagedError(ArchcError):
    """A program that cannot run over a paged KV cache, or a bad block size."""


def _refuse(g: Graph, i: int, why: str) -> PagedError:
    return PagedError(f"a paged KV cache: {g.nodes[i].op.value} %{i} in graph {g.name} "
                      f"({g.nodes[i].origin or 'its op'}) {why}")


def _check_node(g: Graph, i: int) -> None:
    """Refuse what a paged step cannot run: ops that carry a state along the sequence, that need
    the sequence's length, attention chains not collapsed, masks beside the causal one."""
    n = g.nodes[i]
    # a recurrent mixer runs as it is: the engine steps a recurrent model one sequence at a
    # time, its state held in that sequence's slot (archc.runtime.paged)
    if n.op not in RECURRENT and (why := sequence_refusal(n)) is not None:
        raise _refuse(g, i, why)
    if n.op == Op.KV_CACHE and n.attr("quant") is not None:
        raise _refuse(g, i, f"holds an {n.attr('quant')} cache; a paged pool holds the model "
                      "dtype (kv_cache=None)")
    if n.op in HEAD_KERNELS and any(st.fn == "kv_write" and st.kw("quant") is not None
                                       for st in n.attr("epilogue", ())):
        raise _refuse(g, i, "writes a quantized cache; a paged pool holds the model dtype")
    if n.op == Op.ATTENTION:
        if n.attr("ring") is not None:
            raise _refuse(g, i, "is ring attention (cp > 1); a paged engine runs with cp = 1")
        if n.attr("kv_quant") is not None:
            raise _refuse(g, i, "reads a quantized cache; a paged pool holds the model dtype")
        if not (n.attr("causal") or n.attr("mask") is not None) or n.attr("prefix") or \
                n.attr("padding"):
            raise _refuse(g, i, "is not a plain causal attention (bidirectional, prefix-LM or "
                          "padded): only a causal decoder decodes token by token")
        bias = n.attr("bias")
        if bias is not None and bias.fn != "alibi":
            raise _refuse(g, i, f"adds a {bias.fn} position bias, which has no paged form")
        own = sorted(set(modifiers_of(full_attrs(n.op, n.attrs)).env.token_inputs) - {"padding"})
        if own:
            raise _refuse(g, i, f"reads the per-token input {own[0]!r}, which a paged engine's "
                          "sequences do not carry")
        cached = n.attr("cache_layer") is not None or all(
            g.nodes[j].op == Op.KV_CACHE for j in n.inputs[1:3])
        if not cached:
            raise _refuse(g, i, "attends over k and v that are not its layer's KV cache")


def _static_rope(g: Graph, i: int, dynamic: Call | None, max_seq_len: int) -> bool:
    """Whether a rope that rescales its frequencies from the sequence length (`dynamic`)
    rotates by a static table in sequences of up to max_seq_len tokens: LongRoPE by its short
    factors (the first rows of its table) within its trained context. Any other is refused:
    the rows of a paged step belong to sequences of different lengths."""
    if dynamic is None:
        return False
    original = dynamic.kw("original_max_seq_len")
    if dynamic.fn == "longrope" and max_seq_len <= original:
        return True
    what = (f"LongRoPE past its trained context of {original} tokens (sequences of up to "
            f"{max_seq_len} here)" if dynamic.fn == "longrope" else "dynamic NTK")
    raise _refuse(g, i, f"rescales its frequencies from the sequence length ({what}), which a "
                  "row of another sequence does not share")


def _static_ropes(g: Graph, max_seq_len: int) -> Graph:
    """`g` with each LongRoPE rotation (a rope node or an epilogue's rope step) that stays
    within its trained context on its short table (``_static_rope``)."""
    nodes = list(g.nodes)
    for i, n in enumerate(nodes):
        if n.op == Op.ROPE and _static_rope(g, i, n.attr("dynamic"), max_seq_len):
            nodes[i] = n.replace(attrs=n.attrs.replace(dynamic=None))
        elif n.op in HEAD_KERNELS:
            steps = n.attr("epilogue", ())
            static = tuple(
                step("rope", **{k: v for k, v in st.kwargs if k != "dynamic"})
                if st.fn == "rope" and _static_rope(g, i, st.kw("dynamic"), max_seq_len)
                else st for st in steps)
            if static != steps:
                nodes[i] = n.replace(attrs=n.attrs.replace(epilogue=static))
    return Graph(g.name, tuple(nodes))


def _step_offset(n: Node, k: int) -> int:
    """Where the inputs of epilogue step k start among n's inputs."""
    steps = n.attr("epilogue", ())
    after = sum(len(STEPS[st.fn].inputs) for st in steps[k:])
    return len(n.inputs) - after


def _paged_write(n: Node, bs: int, pos: int, table: int) -> Node:
    """A projection whose epilogue writes the cache, writing the pool instead."""
    steps = list(n.attr("epilogue", ()))
    k = next(k for k, st in enumerate(steps) if st.fn == "kv_write")
    at = _step_offset(n, k) + len(STEPS["kv_write"].inputs)
    kw = {name: steps[k].kw(name) for name in ("head_dim", "k_start", "kv_heads", "layer",
                                               "v_start")}
    steps[k] = step("paged_kv_write", block_size=bs, **kw)
    inputs = (*n.inputs[:at], pos, table, *n.inputs[at:])
    return n.replace(attrs=n.attrs.replace(epilogue=tuple(steps)), inputs=inputs)


def _paged_graph(g: Graph, bs: int, max_seq_len: int) -> Graph:
    g = _static_ropes(g, max_seq_len)     # first: the checks refuse any rope left dynamic
    for i in range(len(g.nodes)):
        _check_node(g, i)
    g = g.with_inputs([("positions", (T,), "i64"),
                       ("block_table", (T, sympy.Integer(max_blocks(max_seq_len, bs))), "i32")],
                      "paged_kv")
    pos, table = g.inputs["positions"], g.inputs["block_table"]
    nodes = list(g.nodes)
    for i, n in enumerate(nodes):
        if n.op == Op.KV_CACHE:
            readers = [u for u, m in enumerate(nodes) if i in m.inputs]
            if any(nodes[u].op != Op.ATTENTION for u in readers):
                raise _refuse(g, i, "is read by something other than its attention")
            nodes[i] = n.replace(attrs=n.attrs.replace(paged=bs), inputs=(*n.inputs, pos, table),
                                 shape=g.nodes[n.inputs[0]].shape)
        elif n.op in HEAD_KERNELS and any(st.fn == "kv_write" for st in n.attr("epilogue", ())):
            nodes[i] = _paged_write(n, bs, pos, table)
        elif n.op == Op.ATTENTION and n.attr("cache_layer") is not None:
            nodes[i] = n.replace(attrs=n.attrs.replace(paged=bs), inputs=(*n.inputs, pos, table))
        elif n.op == Op.ATTENTION:       # over kv_cache nodes: it reads their layer's pool
            kc = g.nodes[n.inputs[1]]
            nodes[i] = n.replace(attrs=n.attrs.replace(
                paged=bs, cache_layer=kc.attr("layer"), kv_heads=int(kc.shape[1])),
                inputs=(n.inputs[0], *n.inputs[3:], pos, table))
    return Graph(g.name, tuple(nodes))


def max_blocks(max_seq_len: int, block_size: int) -> int:
    """The blocks one sequence of max_seq_len tokens holds: a block table's width."""
    return math.ceil(max_seq_len / block_size)


@register_pass(NAME, "a decoder whose KV cache is a pool of block_size-token blocks, each "
               "sequence reading its own through a block table of sequences up to max_seq_len "
               "tokens, what the serving engine runs (after share-kv-heads and "
               "flash-attention)", program=True, kind="variant",
               options={"block_size": 16, "max_seq_len": None})
def paged(program: Program, contexts: Mapping[str, PassContext], block_size: int,
          max_seq_len: int) -> Program:
    if [g.name for g in program] != ["decoder"]:
        names = ", ".join(g.name for g in program)
        raise PagedError(f"a paged KV cache serves a decoder-only model; {program.model} has "
                         f"the graphs {names} (encoders and encoder-decoders are not served)")
    if any(n.attr("paged") is not None for g in program for n in g
           if n.op in (Op.ATTENTION, Op.KV_CACHE)):
        raise PagedError(f"{program.model}'s KV cache is paged already")
    (g,) = program.graphs
    out = _paged_graph(g, block_size, max_seq_len)
    contexts[g.name].applied(NAME, g.name, f"the KV cache paged in blocks of {block_size} tokens")
    shift = len(out.nodes) - len(g.nodes)      # the inputs put first
    contexts[g.name].kept = {i: i + shift for i in range(len(g.nodes))}
    return Program(program.model, (out,))


def paged_kv(program: Program, block_size: int, max_seq_len: int) -> Program:
    """`program` with its attention chains collapsed, reading KV head h // group in place
    (share-kv-heads, flash-attention), and its KV cache paged in blocks of `block_size` tokens,
    sequences of up to `max_seq_len` tokens. Raises PagedError for programs a paged cache cannot
    serve (encoders, encoder-decoders, non-causal attention…). Recurrent mixers pass
    through: the engine holds their state, one slot per sequence."""
    return optimize(program, ["share-kv-heads", "flash-attention",
                              (NAME, {"block_size": block_size, "max_seq_len": max_seq_len})])
