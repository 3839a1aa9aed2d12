"""A quantized tensor: its scheme, its logical shape [..., N, K] and its stored parts
(`archc.quant.schemes` says what each part holds). Operations that only move whole rows — take
rows, concatenate or stack along a leading dim, permute rows — apply to every part alike, so a
merged or reordered weight stays quantized; anything that would change a value dequantizes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from archc.dtypes import TORCH_DTYPES
from archc.errors import WeightsError
from archc.quant.schemes import SCHEMES, SUPER, Scheme


class QTensor:
    """A weight kept quantized: `scheme` names the layout, `parts` hold its bits."""

    def __init__(self, scheme: str | Scheme, shape: Sequence[int],
                 parts: Mapping[str, torch.Tensor]) -> None:
        self.scheme = SCHEMES[scheme] if isinstance(scheme, str) else scheme
        self.shape = torch.Size(shape)
        self.parts = dict(parts)
        if len(self.shape) < 2:
            raise WeightsError(f"a {self.scheme.name} tensor is at least 2-D, got "
                               f"{list(self.shape)}")
        want = self.scheme.part_shapes(self.shape[-2], self.shape[-1])
        if set(want) != set(self.parts):
            raise WeightsError(f"a {self.scheme.name} tensor has parts {sorted(want)}, got "
                               f"{sorted(self.parts)}")
        for name, ((rows, cols), dtype) in want.items():
            p = self.parts[name]
            if tuple(p.shape) != (*self.shape[:-2], rows, cols) or p.dtype != TORCH_DTYPES[dtype]:
                raise WeightsError(f"part {name!r} of a {self.scheme.name}{list(self.shape)} "
                                   f"tensor is {p.dtype}{list(p.shape)}, expected "
                                   f"{TORCH_DTYPES[dtype]}{[*self.shape[:-2], rows, cols]}")

    @classmethod
    def zeros(cls, scheme: str | Scheme, shape: Sequence[int],
              make: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
              ) -> QTensor:
        """A tensor of scheme `scheme` whose parts are all zero, each made by `make(shape,
        dtype)` (torch.zeros by default): stand-in weights, for launches that read no value."""
        s = SCHEMES[scheme] if isinstance(scheme, str) else scheme
        make = make or (lambda dims, dtype: torch.zeros(dims, dtype=dtype))
        return cls(s, shape, {name: make((*shape[:-2], rows, cols), TORCH_DTYPES[dtype])
                              for name, ((rows, cols), dtype)
                              in s.part_shapes(shape[-2], shape[-1]).items()})

    # ---- what a tensor answers ----------------------------------------------------------
    @property
    def dtype(self) -> str:
        """The IR dtype of the tensor: its scheme's name."""
        return self.scheme.name

    @property
    def device(self) -> torch.device:
        return self.parts["q"].device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"QTensor({self.scheme.name}, {list(self.shape)}, {self.nbytes:,} bytes)"

    def to(self, device: str | torch.device | None = None) -> QTensor:
        if device is None or torch.device(device) == self.device:
            return self
        return self._map(lambda p: p.to(device))

    # ---- values ---------------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """The integer codes c [..., N, K] (int32), high bits joined to low."""
        return self._codes().to(torch.int32)

    def _codes(self) -> torch.Tensor:
        """The codes in the narrowest integer dtype that holds them (uint8, int8 for 8 bits)."""
        k, s = self.shape[-1], self.scheme
        q = self.parts["q"]
        if s.bits == 8:
            return q
        low = torch.stack([q & 0x0F, q >> 4], dim=-1).flatten(-2)[..., :k]
        if not s.high_bits:
            return low
        per_byte = 8 // s.high_bits
        shifts = torch.arange(per_byte, dtype=torch.uint8, device=q.device) * s.high_bits
        high = (self.parts["qh"][..., None] >> shifts) & ((1 << s.high_bits) - 1)
        return low | (high.flatten(-2)[..., :k] << 4)

    def _float_codes(self) -> torch.Tensor:
        """The codes as a new f32 tensor [..., N, K] (small integers: exact). Four-bit codes
        are written straight from their nibbles, without an integer copy between."""
        s, q = self.scheme, self.parts["q"]
        if s.bits != 4:
            return self._codes().float()
        c = torch.empty((*q.shape, 2), dtype=torch.float32, device=q.device)
        c[..., 0] = q & 0x0F
        c[..., 1] = q >> 4
        c = c.flatten(-2)
        return c if c.shape[-1] == self.shape[-1] else c[..., :self.shape[-1]].contiguous()

    def _per_group(self, part: str, size: int, group: int, groups: int) -> torch.Tensor:
        """A part held per `size` elements, as f32 per `group` elements: [..., N, groups]."""
        v = self.parts[part].float()
        return v if size == group else v.repeat_interleave(size // group, dim=-1)[..., :groups]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values, computed in f32 in the order the module docstring gives, then cast:
        group by group, each group's scale (and offset) broadcast over its elements."""
        s, k = self.scheme, self.shape[-1]
        group = min(s.group, k)
        groups = -(-k // group)
        c = self._float_codes()            # small integers: exact in f32, as is c − zero
        if groups * group != k:
            c = F.pad(c, (0, groups * group - k))
        v = c.unflatten(-1, (groups, group))
        if s.two_level:
            scale = self._per_group("d", SUPER, group, groups) * self.parts["sc"].float()
        else:
            scale = self.parts["scale"].float()
        # in place on the codes' own f32 copy: the same operations, rounded alike, without a
        # new tensor for each
        if s.zero:
            v.sub_(s.zero)
        v.mul_(scale[..., None])
        if s.offset == "f16":
            v.add_(self.parts["min"].float()[..., None])
        elif s.offset == "super":
            v.sub_((self._per_group("dmin", SUPER, group, groups)
                    * self.parts["mn"].float())[..., None])
        return v.flatten(-2)[..., :k].to(dtype)

    def float(self) -> torch.Tensor:
        return self.dequantize(torch.float32)

    # ---- moving whole rows ------------------------------------------------------------------
    def _map(self, fn, shape: Sequence[int] | None = None) -> QTensor:  # noqa: ANN001
        parts = {k: fn(p) for k, p in self.parts.items()}
        lead = next(iter(parts.values())).shape[:-1]
        return QTensor(self.scheme, shape or (*lead, self.shape[-1]), parts)

    def _lead_dim(self, dim: int) -> int:
        dim = dim % self.dim()
        if dim == self.dim() - 1:
            raise WeightsError(f"a {self.scheme.name} tensor moves whole rows; dim {dim} is "
                               "its packed K")
        return dim

    def index_select(self, dim: int, index: torch.Tensor) -> QTensor:
        d = self._lead_dim(dim)
        return self._map(lambda p: p.index_select(d, index.to(p.device)).contiguous())

    def narrow(self, dim: int, start: int, length: int) -> QTensor:
        """Elements [start, start + length) of `dim`: rows of any leading dim, or columns of K
        where both ends fall on whole groups, super-blocks and bytes (`Scheme.align`)."""
        dim = dim % self.dim()
        spans = part_spans(self.scheme, self.shape, dim, start, length)
        parts = {name: p.narrow(d, lo, hi - lo).contiguous()
                 for name, p in self.parts.items() for d, lo, hi in [spans[name]]}
        return QTensor(self.scheme, (*self.shape[:dim], length, *self.shape[dim + 1:]), parts)

    def rows(self, start: int = 0, stop: int | None = None) -> QTensor:
        return self._map(lambda p: p[start:stop].contiguous())

    def select(self, index: int) -> QTensor:
        """Entry `index` of the first dim, that dim dropped (an expert of [E, N, K])."""
        self._lead_dim(0)
        return QTensor(self.scheme, self.shape[1:], {k: p[index] for k, p in self.parts.items()})

    def take(self, ids: torch.Tensor) -> QTensor:
        """Rows of a 2-D table by integer ids of any shape: [*ids, K] (an embedding gather)."""
        flat = ids.reshape(-1).to(self.device)
        out = self._map(lambda p: p.index_select(0, flat))
        return QTensor(self.scheme, (*ids.shape, self.shape[-1]),
                       {k: p.reshape(*ids.shape, p.shape[-1]) for k, p in out.parts.items()})

    @staticmethod
    def cat(tensors: Sequence[QTensor], dim: int = 0) -> QTensor:
        first = tensors[0]
        if any(t.scheme != first.scheme for t in tensors):
            raise WeightsError("cannot join weights of different schemes: "
                               + ", ".join(t.scheme.name for t in tensors))
        dim = dim % first.dim()
        if dim < first.dim() - 1:
            return QTensor(first.scheme, (*first.shape[:dim], sum(t.shape[dim] for t in tensors),
                                          *first.shape[dim + 1:]),
                           {k: torch.cat([t.parts[k] for t in tensors], dim=dim)
                            for k in first.parts})
        # along K: every weight but the last must end on a whole group, super-block and byte
        if any(t.shape[-1] % first.scheme.align for t in tensors[:-1]):
            raise WeightsError(f"cannot join {first.scheme.name} weights along K: K = "
                               f"{[t.shape[-1] for t in tensors]} must be multiples of "
                               f"{first.scheme.align}")
        return QTensor(first.scheme, (*first.shape[:-1], sum(t.shape[-1] for t in tensors)),
                       {k: torch.cat([t.parts[k] for t in tensors], dim=-1) for k in first.parts})

    @staticmethod
    def stack(tensors: Sequence[QTensor], dim: int = 0) -> QTensor:
        first = tensors[0]
        if any(t.scheme != first.scheme or t.shape != first.shape for t in tensors):
            raise WeightsError("cannot stack weights of different schemes or shapes")
        dim = dim % (first.dim() + 1)
        if dim >= first.dim():
            raise WeightsError("quantized weights stack along a leading dim")
        shape = (*first.shape[:dim], len(tensors), *first.shape[dim:])
        return QTensor(first.scheme, shape,
                       {k: torch.stack([t.parts[k] for t in tensors], dim=dim)
                        for k in first.parts})


def part_spans(scheme: Scheme, shape: Sequence[int], dim: int, start: int,
               length: int) -> dict[str, tuple[int, int, int]]:
    """Part → (dim, lo, hi): the span of each stored part of a `scheme` tensor of `shape` that
    holds its elements [start, start + length) of `dim` — what `QTensor.narrow` keeps, and what
    a loader reads of a file to get the same tensor. A leading dim cuts every part alike; K
    only where both ends fall on whole groups, super-blocks and bytes (`Scheme.align`)."""
    dim = dim % len(shape)
    parts = scheme.part_shapes(shape[-2], shape[-1])
    if dim < len(shape) - 1:
        return {name: (dim, start, start + length) for name in parts}
    k = shape[-1]
    step = scheme.k_step(k)
    if start % step or (start + length != k and length % step):
        raise WeightsError(f"a {scheme.name} tensor splits along K only at multiples "
                           f"of {step} elements; columns [{start}, {start + length}) of {k}")
    spans = {}
    for name, ((_, cols), _) in parts.items():
        # a part stored per `k / cols` elements: the columns that hold any of the kept ones
        lo, hi = start * cols // k, -(-(start + length) * cols // k)
        spans[name] = (dim, lo, hi)
    return spans


Weight = torch.Tensor | QTensor


def dense(w: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A weight as a plain tensor: a quantized one dequantized into `dtype`."""
    return w.dequantize(dtype) if isinstance(w, QTensor) else w


# elements of a quantized weight dequantized at once by `by_rows`: 1 MiB in f32, so that
# computing from a weight costs a few blocks of memory beside it, never its dense copy. Blocks
# of 4 MiB left SmolLM2's eager run (Q4_1) peaking 6-12 MiB higher, by hash seed, the heap
# fragmenting around them; these cost ~20% of its decode time (this project's CI machine)
ROW_BLOCK = 1 << 18


def by_rows(w: Weight, dtype: torch.dtype, fn: Callable[[torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
    """fn(values) for a weight [N, K] whose rows are the output columns (x @ wᵀ): a plain
    tensor whole; a quantized one a block of rows at a time, each dequantized into `dtype` as
    it is used, the results joined along the last dim. Each output column is computed from the
    same values as from the whole dense weight (what the eager reference reads)."""
    if not isinstance(w, QTensor):
        return fn(w)
    n = w.shape[0]
    step = max(1, ROW_BLOCK // max(1, w.shape[-1]))
    if step >= n:
        return fn(w.dequantize(dtype))
    # each block's result goes straight into the output, allocated once: nothing allocated
    # for a block outlives it, so the next block reuses its memory (a list of results would
    # pin the heap a little higher block after block)
    out: torch.Tensor | None = None
    for start in range(0, n, step):
        part = fn(w.rows(start, min(start + step, n)).dequantize(dtype))
        if out is None:
            out = part.new_empty((*part.shape[:-1], n))
        out[..., start:start + part.shape[-1]] = part
        del part
    assert out is not None
    return out


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ wᵀ (torch.nn.functional.linear) in x's dtype, a quantized weight dequantized a block
    of rows at a time (`by_rows`)."""
    return by_rows(w, x.dtype, lambda values: F.linear(x, values))


def tensor_bytes(w: Weight) -> int:
    """Bytes a weight holds in memory, quantized or not."""
    return w.nbytes if isinstance(w, QTensor) else w.numel() * w.element_size()
