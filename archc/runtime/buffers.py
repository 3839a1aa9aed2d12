"""Activation buffers planned by liveness, and reused.

Every compute node writes one root buffer; views (slice, split_heads, merge_heads) alias their
root and keep it alive. The plan is made once per graph, symbolically, and sized per call:

1. A root is live from the node that writes it to the last node that reads it or a view of it;
   the graph's outputs stay live to the end.
2. Walk the nodes in order. A node's output takes a free slot — the one closest in size at a
   reference shape — or opens a new one; then the roots whose last reader was this node are
   freed. (Freeing after allocating keeps a kernel's output from aliasing its own inputs.)
3. At run time each slot is one byte buffer as large as its largest member at the concrete
   B, T, P, S, allocated once per distinct shape and reused by every call with that shape — so
   decode steps run on the same addresses, as a captured CUDA graph needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import sympy
import torch

from archc.codegen.layout import Layout
from archc.codegen.printer import DimFn, dim_function, uses_past
from archc.dtypes import TORCH_DTYPES
from archc.ir.graph import Graph
from archc.ir.shapes import DTYPE_BYTES, numel
from archc.ir.view import live_ranges

Dims = tuple[int, int, int, int]       # B, T, P, S

REFERENCE_DIMS: Dims = (1, 128, 0, 128)
ALIGN = 256  # bytes: every buffer starts on a 256-byte boundary (vector loads, TMA)


@dataclass
class BufferPlan:
    graph: str
    slot_of: dict[int, int]                       # root node → slot
    members: list[list[int]]                      # slot → root nodes
    nbytes: dict[int, sympy.Expr]                 # root node → bytes
    shapes: dict[int, tuple[sympy.Expr, ...]]     # root node → shape
    dtypes: dict[int, str]                        # root node → IR dtype
    _cache: dict[Dims, list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # every root's bytes, then every root's shape, as one compiled function of the dims
        roots = list(self.slot_of)
        self._sizes: DimFn = dim_function(
            [self.nbytes[r] for r in roots] + [d for r in roots for d in self.shapes[r]],
            f"buffer_sizes_{self.graph}")
        self._by_past = uses_past(list(self.nbytes.values()))

    def root_bytes(self, dims: Dims) -> dict[int, int]:
        return dict(zip(self.slot_of, self._sizes(*dims)))

    def slot_bytes(self, dims: Dims) -> list[int]:
        nbytes = self.root_bytes(dims)
        return [(max(nbytes[r] for r in roots) + ALIGN - 1) // ALIGN * ALIGN
                for roots in self.members]

    def tensors(self, dims: Dims, device: torch.device) -> dict[int, torch.Tensor]:
        """Root node → its tensor (a typed view of its slot) at `dims`."""
        key = dims if self._by_past else (dims[0], dims[1], 0, dims[3])
        bufs = self._cache.get(key)
        if bufs is None:
            if len(self._cache) >= 8:                 # distinct prompt lengths: keep a few
                self._cache.pop(next(iter(self._cache)))
            bufs = self._cache[key] = [torch.empty(n, dtype=torch.uint8, device=device)
                                       for n in self.slot_bytes(dims)]
        sizes = self._sizes(*dims)
        at = len(self.slot_of)
        out: dict[int, torch.Tensor] = {}
        for root, slot in self.slot_of.items():
            shape = sizes[at:at + len(self.shapes[root])]
            at += len(shape)
            dtype = self.dtypes[root]
            out[root] = bufs[slot][:math.prod(shape) * DTYPE_BYTES[dtype]].view(
                TORCH_DTYPES[dtype]).view(shape)
        return out


def plan_buffers(g: Graph, lays: Sequence[Layout], *, reuse: bool = True) -> BufferPlan:
    roots = g.compute_ids()
    ranges = live_ranges(g, [lay.root for lay in lays])
    nbytes = {r: numel(g.nodes[r].shape) * DTYPE_BYTES[g.nodes[r].dtype] for r in roots}
    at_ref = dim_function(list(nbytes.values()), f"reference_bytes_{g.name}")(*REFERENCE_DIMS)
    ref = dict(zip(nbytes, at_ref))
    slot_of: dict[int, int] = {}
    members: list[list[int]] = []
    size_at_ref: list[int] = []
    free: list[int] = []
    dying: dict[int, list[int]] = {}
    for r in roots:
        dying.setdefault(ranges[r][1], []).append(r)
    for i in range(len(g.nodes)):
        if i in nbytes:  # node i writes root i
            if reuse and free:
                # the free slot closest in size: an exact fit, else the smallest that holds it,
                # else the largest (it grows)
                fits = [s for s in free if size_at_ref[s] >= ref[i]]
                slot = min(fits, key=lambda s: size_at_ref[s]) if fits else max(
                    free, key=lambda s: size_at_ref[s])
                free.remove(slot)
            else:
                slot = len(members)
                members.append([])
                size_at_ref.append(0)
            members[slot].append(i)
            size_at_ref[slot] = max(size_at_ref[slot], ref[i])
            slot_of[i] = slot
        free += [slot_of[r] for r in dying.get(i, [])]
    return BufferPlan(g.name, slot_of, members, nbytes,
                      {r: tuple(g.nodes[r].shape) for r in roots},
                      {r: g.nodes[r].dtype for r in roots})
