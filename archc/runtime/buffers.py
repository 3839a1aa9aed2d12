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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import sympy
import torch

from archc.codegen.layout import Layout
from archc.ir.graph import Graph
from archc.ir.shapes import DIMS, DTYPE_BYTES, numel
from archc.ir.view import live_ranges
from archc.runtime.weights import TORCH_DTYPES

REFERENCE_DIMS = {"B": 1, "T": 128, "P": 0, "S": 128}
ALIGN = 256  # bytes: every buffer starts on a 256-byte boundary (vector loads, TMA)


def _bytes(expr: sympy.Expr, dims: Mapping[str, int]) -> int:
    value = expr.xreplace({DIMS[k]: v for k, v in dims.items() if k in DIMS})
    return int(value)


@dataclass
class BufferPlan:
    graph: str
    slot_of: dict[int, int]                       # root node → slot
    members: list[list[int]]                      # slot → root nodes
    nbytes: dict[int, sympy.Expr]                 # root node → bytes
    _cache: dict[tuple[int, ...], list[torch.Tensor]] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return len(self.members)

    def slot_bytes(self, dims: Mapping[str, int]) -> list[int]:
        out = []
        for roots in self.members:
            size = max(_bytes(self.nbytes[r], dims) for r in roots)
            out.append((size + ALIGN - 1) // ALIGN * ALIGN)
        return out

    def planned_bytes(self, dims: Mapping[str, int]) -> int:
        return sum(self.slot_bytes(dims))

    def unplanned_bytes(self, dims: Mapping[str, int]) -> int:
        return sum(_bytes(b, dims) for b in self.nbytes.values())

    def buffers(self, dims: Mapping[str, int], device: torch.device) -> list[torch.Tensor]:
        key = tuple(int(dims.get(k, 0)) for k in ("B", "T", "P", "S"))
        if not any(d.has(DIMS["P"]) for d in self.nbytes.values()):
            key = key[:2] + (0,) + key[3:]           # sizes do not depend on P
        bufs = self._cache.get(key)
        if bufs is None:
            if len(self._cache) >= 8:                 # distinct prompt lengths: keep a few
                self._cache.pop(next(iter(self._cache)))
            bufs = [torch.empty(n, dtype=torch.uint8, device=device)
                    for n in self.slot_bytes(dims)]
            self._cache[key] = bufs
        return bufs

    def tensors(self, g: Graph, dims: Mapping[str, int], device: torch.device
                ) -> dict[int, torch.Tensor]:
        """Root node → its tensor (a typed view of its slot) at `dims`."""
        bufs = self.buffers(dims, device)
        out: dict[int, torch.Tensor] = {}
        for root, slot in self.slot_of.items():
            n = g.nodes[root]
            shape = [_bytes(s, dims) for s in n.shape]
            count = 1
            for s in shape:
                count *= s
            dtype = TORCH_DTYPES[n.dtype]
            width = DTYPE_BYTES[n.dtype]
            out[root] = bufs[slot][:count * width].view(dtype).view(shape)
        return out


def plan_buffers(g: Graph, lays: Sequence[Layout], *, reuse: bool = True) -> BufferPlan:
    roots = g.compute_ids()
    ranges = live_ranges(g, [lay.root for lay in lays])
    last = {r: ranges[r][1] for r in roots}
    end = len(g.nodes)
    nbytes = {r: numel(g.nodes[r].shape) * DTYPE_BYTES[g.nodes[r].dtype] for r in roots}
    ref = {r: _bytes(nbytes[r], REFERENCE_DIMS) for r in roots}
    slot_of: dict[int, int] = {}
    members: list[list[int]] = []
    size_at_ref: list[int] = []
    free: list[int] = []
    dying: dict[int, list[int]] = {}
    for r in roots:
        dying.setdefault(last[r], []).append(r)
    for i in range(end):
        if i in last:  # node i writes root i
            slot = None
            if reuse and free:
                # the free slot closest in size: an exact fit, else the smallest that holds it,
                # else the largest (it grows)
                fits = [s for s in free if size_at_ref[s] >= ref[i]]
                slot = min(fits, key=lambda s: size_at_ref[s]) if fits else max(
                    free, key=lambda s: size_at_ref[s])
                free.remove(slot)
            if slot is None:
                slot = len(members)
                members.append([])
                size_at_ref.append(0)
            members[slot].append(i)
            size_at_ref[slot] = max(size_at_ref[slot], ref[i])
            slot_of[i] = slot
        for r in dying.get(i, []):
            free.append(slot_of[r])
    return BufferPlan(g.name, slot_of, members, nbytes)
