"""What persists between calls: the KV cache and the recurrent state.

The recurrent state is what Mamba and linear-attention layers keep instead of a KV cache (the
conv window and SSM state, the running sums S and z), as the op table declares it
(``archc.ir.ops.state``); it does not grow with the context. A call at P = 0 starts a sequence,
so it reads zeros.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from archc.errors import RunError
from archc.runtime.weights import TORCH_DTYPES


class RecurrentState:
    """The eager interpreter's per-(layer, kind) state tensors of one batch of sequences."""

    def __init__(self) -> None:
        self.store: dict[tuple[int, str], torch.Tensor] = {}

    def read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device, past: int) -> torch.Tensor:
        """The state the last call left, or zeros when a sequence starts (P = 0)."""
        have = self.store.get((layer, kind))
        if past == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        if have is None:
            raise RunError(f"layer {layer} continues a sequence at P = {past} but holds no "
                           f"{kind} state: reset and prefill first")
        if tuple(have.shape) != tuple(shape) or have.dtype != dtype:
            raise RunError(f"layer {layer}'s {kind} state is {have.dtype}{list(have.shape)}; "
                           f"this call needs {dtype}{list(shape)} — reset before changing the "
                           "batch")
        return have

    def write(self, layer: int, kind: str, value: torch.Tensor) -> None:
        self.store[(layer, kind)] = value


class StaticStore:
    """Static tensors per (layer, kind), [B, ...], that generated kernels read and write in
    place: allocated anew (zeroed) when the batch size changes, and kept otherwise so a
    captured CUDA graph keeps reading the same addresses (`generation` counts the
    allocations)."""

    def __init__(self, what: str, specs: Mapping[tuple[int, str], tuple[tuple[int, ...], str]],
                 device: torch.device) -> None:
        self.what = what          # for errors: "no k cache for layer 3"
        self.specs = specs        # (layer, kind) → shape after B, IR dtype (``Generated.stores``)
        self.device = device
        self.batch = 0
        self.generation = 0
        self.store: dict[tuple[int, str], torch.Tensor] = {}

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One tensor of the store (`archc bench --host` stands in views of one element)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def ensure(self, batch: int) -> None:
        if batch != self.batch:
            self.generation += 1
            self.store = {key: self.zeros((batch, *shape), TORCH_DTYPES[dtype])
                          for key, (shape, dtype) in self.specs.items()}
            self.batch = batch

    def get(self, layer: int, kind: str) -> torch.Tensor:
        try:
            return self.store[(layer, kind)]
        except KeyError:
            raise RunError(f"no {kind} {self.what} for layer {layer}") from None

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())

    def zero(self) -> None:
        """A sequence starts: a kernel at P = 0 must read a zero state, and it reads whatever
        the tensor holds."""
        for t in self.store.values():
            t.zero_()

