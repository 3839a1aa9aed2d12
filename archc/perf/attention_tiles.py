"""Each attention kernel's modifiers — its score, mask and normalizer expressions — and how its
(query tile, key tile) pairs classify at a given length: full, partial or empty, by interval
arithmetic over each tile's positions (``archc.ir.modifiers.tile_map``), in the tiles the
prefill kernel is launched with (``archc.codegen.blocks``), over a prefill of that length.
Inputs known only at run time (a document id per token) are any value here, so tiles that
read them are partial."""

from __future__ import annotations

from dataclasses import dataclass

from archc.codegen.blocks import launch_config
from archc.ir.attrs import Call, format_value
from archc.ir.graph import Program
from archc.ir.modifiers import TileClass, format_expr, tile_map
from archc.ir.ops import Op, full_attrs, roles_of
from archc.ir.ops.modifiers import modifiers_of
from archc.ir.paramexpr import evaluate
from archc.ir.shapes import DTYPE_BYTES, S


@dataclass(frozen=True)
class AttentionTiles:
    """One attention kernel (its nodes: where layers share it, several), its expressions and
    its tile counts at `length` tokens in tiles of block_m queries × block_n keys."""

    graph: str
    nodes: tuple[int, ...]
    score: str
    mask: str
    normalizer: str
    length: int
    block_m: int
    block_n: int
    full: int
    partial: int
    empty: int

    @property
    def tiles(self) -> int:
        return self.full + self.partial + self.empty

    @property
    def visited(self) -> float:
        """The fraction of tiles a kernel visits: those not empty."""
        return 1.0 - self.empty / self.tiles if self.tiles else 0.0


def attention_tiles(program: Program, length: int, dtype: str = "bf16") -> list[AttentionTiles]:
    """Every distinct self-attention of `program`'s (kernel-level) graphs, classified at a
    prefill of `length` tokens."""
    out: dict[tuple[object, ...], AttentionTiles] = {}
    for g in program:
        for i, n in enumerate(g.nodes):
            if n.op != Op.ATTENTION:
                continue
            at = full_attrs(n.op, n.attrs)
            named = dict(zip(roles_of(n.op, at, len(n.inputs)), n.inputs))
            if "k" in named and S in g.nodes[named["k"]].shape[2].free_symbols:
                continue      # cross-attention over the encoder's states
            mods = modifiers_of(at)
            q = g.nodes[n.inputs[0]].shape
            heads, head_dim = int(q[1]), int(q[3])
            kv_heads = int(g.nodes[named["k"]].shape[1]) if "k" in named else at["kv_heads"]
            key = (g.name, mods.score, mods.mask, mods.normalizer, at["bias"], heads, head_dim)
            if key in out:
                have = out[key]
                out[key] = AttentionTiles(**{**have.__dict__, "nodes": (*have.nodes, i)})
                continue
            # the values of per-head parameters the spec gives (a checkpoint's are unknown)
            given = {}
            for name in mods.env.head_params:
                expr = g.nodes[named[name]].attr("expr")
                if isinstance(expr, Call) and expr.fn == "values":
                    given[name] = evaluate(expr, {})
            cfg = launch_config("attention", "gpu", T=length, L=length, D=head_dim,
                                bytes=DTYPE_BYTES[dtype], t5=int(at["bias"] is not None and
                                                                 at["bias"].fn == "t5"))
            m, nb = cfg["BLOCK_M"], cfg["BLOCK_N"]
            tm = tile_map(mods.mask, mods.env, t=length, length=length, block_m=m, block_n=nb,
                          heads=heads, kv_heads=kv_heads, head_params=given)
            score = format_expr(mods.score) + (" + T5 relative bias" if at["bias"] is not None
                                               and at["bias"].fn == "t5" else "")
            out[key] = AttentionTiles(g.name, (i,), score, format_expr(mods.mask),
                                      format_value(mods.normalizer), length, m, nb,
                                      tm.count(TileClass.FULL), tm.count(TileClass.PARTIAL),
                                      tm.count(TileClass.EMPTY))
    return list(out.values())
