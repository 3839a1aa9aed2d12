"""Recurrent state between calls: what Mamba and linear-attention layers keep instead of a KV cache.

One tensor per (layer, kind) — the conv window and the SSM state of a Mamba layer, the running
sums S and z of a linear-attention layer — as the op table declares them (``archc.ir.ops.state``).
A call at past length P = 0 starts a sequence, so it reads zeros; later calls read what the call
before them left. The size does not grow with the context.
"""

from __future__ import annotations

import torch

from archc.errors import RunError
from archc.runtime.weights import TORCH_DTYPES


class RecurrentState:
    """Per-(layer, kind) state tensors of one batch of sequences."""

    def __init__(self) -> None:
        self.store: dict[tuple[int, str], torch.Tensor] = {}

    def read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device, past: int) -> torch.Tensor:
        """The state the last call left, or zeros when a sequence starts (P = 0)."""
        have = self.store.get((layer, kind))
        if past == 0 or have is None:
            if past > 0:
                raise RunError(f"layer {layer} continues a sequence at P = {past} but holds no "
                               f"{kind} state: reset and prefill first")
            return torch.zeros(shape, dtype=dtype, device=device)
        if tuple(have.shape) != tuple(shape) or have.dtype != dtype:
            raise RunError(f"layer {layer}'s {kind} state is {have.dtype}{list(have.shape)}; "
                           f"this call needs {dtype}{list(shape)} — reset before changing the "
                           "batch")
        return have

    def write(self, layer: int, kind: str, value: torch.Tensor) -> None:
        self.store[(layer, kind)] = value

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())


class StaticStore:
    """Static tensors per (layer, kind), [B, ...], that generated kernels read and write in
    place: allocated anew (zeroed) when the batch size changes, and kept otherwise so a
    captured CUDA graph keeps reading the same addresses (`generation` counts the
    allocations)."""

    what = "tensor"      # for errors: "no k cache for layer 3"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.batch = 0
        self.generation = 0
        self.store: dict[tuple[int, str], torch.Tensor] = {}

    def allocate(self, batch: int) -> dict[tuple[int, str], torch.Tensor]:
        raise NotImplementedError

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One tensor of the store (`archc bench --host` stands in views of one element)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def ensure(self, batch: int) -> None:
        if batch == self.batch:
            return
        self.generation += 1
        self.store = self.allocate(batch)
        self.batch = batch

    def get(self, layer: int, kind: str) -> torch.Tensor:
        try:
            return self.store[(layer, kind)]
        except KeyError:
            raise RunError(f"no {kind} {self.what} for layer {layer}") from None

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())


class StaticState(StaticStore):
    """The recurrent state the generated kernels update in place: one tensor per (layer, kind)
    as codegen recorded it (``Generated.states``), zeroed when a sequence starts — a kernel at
    P = 0 must read zeros, and it reads whatever the tensor holds."""

    what = "state"

    def __init__(self, specs: list[tuple[int, str, tuple[int, ...], str]],
                 device: torch.device) -> None:
        super().__init__(device)
        self.specs = specs

    def allocate(self, batch: int) -> dict[tuple[int, str], torch.Tensor]:
        return {(layer, kind): self.zeros((batch, *shape), TORCH_DTYPES[dtype])
                for layer, kind, shape, dtype in self.specs}

    def zero(self) -> None:
        for t in self.store.values():
            t.zero_()
