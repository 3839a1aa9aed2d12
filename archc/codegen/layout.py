"""Where each node's values live: a root buffer, an element offset and symbolic strides.

Every input, param and compute node owns a contiguous buffer. View ops (slice, split_heads,
merge_heads) own nothing: they change the offset and strides through which their root is read,
so kernels read q, k and v straight out of a fused QKV projection — never through copies.

    slice(start, stop) on the last dim:  offset += start·stride[-1]
    last_token: [B, T, D] → [B, 1, D]:   offset += (T − 1)·stride[1]
    split_heads(H): [B, T, H·D] (sb, st, 1) → [B, H, T, D] (sb, D, st, 1)
    merge_heads:    [B, H, T, D] (sb, sh, st, sd) → [B, T, H·D] (sb, st, sd), needs sh = D·sd
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from archc.errors import ArchcError
from archc.ir.graph import Graph
from archc.ir.ops import Op
from archc.ir.shapes import Shape, numel
from archc.ir.text import format_node


class CodegenError(ArchcError):
    """A node codegen cannot render; the message names the node."""


@dataclass(frozen=True)
class Layout:
    root: int                         # the node whose buffer holds the values
    offset: sympy.Expr                # elements from the start of that buffer
    shape: Shape
    strides: tuple[sympy.Expr, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def contiguous_rows(self) -> bool:
        """Can the leading dims be walked as one row index with stride strides[-2]?"""
        return all(sympy.expand(self.strides[i] - self.strides[i + 1] * self.shape[i + 1]) == 0
                   for i in range(self.rank - 2))


def layouts(g: Graph) -> list[Layout]:
    """The layout of every node of `g`, in node order."""
    out: list[Layout] = []
    for i, n in enumerate(g.nodes):
        shape = tuple(sympy.sympify(d) for d in n.shape)
        if n.op == Op.SLICE:
            src = out[n.inputs[0]]
            out.append(Layout(src.root, src.offset + n.attr("start") * src.strides[-1], shape,
                              src.strides))
        elif n.op == Op.SPLIT_HEADS:
            src = out[n.inputs[0]]
            sb, st, sw = src.strides
            out.append(Layout(src.root, src.offset, shape, (sb, shape[3] * sw, st, sw)))
        elif n.op == Op.MERGE_HEADS:
            src = out[n.inputs[0]]
            sb, sh, st, sd = src.strides
            if sympy.expand(sh - src.shape[3] * sd) != 0:
                raise CodegenError(f"{format_node(i, n)}: heads of %{n.inputs[0]} are not "
                                   "adjacent in memory; merging them needs a copy")
            out.append(Layout(src.root, src.offset, shape, (sb, st, sd)))
        elif n.op == Op.LAST_TOKEN:   # row T − 1 of each sequence: [B, 1, D], same strides
            src = out[n.inputs[0]]
            out.append(Layout(src.root, src.offset + (src.shape[1] - 1) * src.strides[1], shape,
                              src.strides))
        elif n.op == Op.OUTPUT:
            out.append(out[n.inputs[0]])
        else:
            strides = tuple(numel(shape[k + 1:]) for k in range(len(shape)))
            out.append(Layout(i, sympy.Integer(0), shape, strides))
    return out
