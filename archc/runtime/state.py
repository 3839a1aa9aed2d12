"""Recurrent state between calls: what Mamba and linear-attention layers keep instead of a KV cache.

One tensor per (layer, kind) — the conv window and the SSM state of a Mamba layer, the running
sums S and z of a linear-attention layer — as the op table declares them (``archc.ir.ops.state``).
A call at past length P = 0 starts a sequence, so it reads zeros; later calls read what the call
before them left. The size does not grow with the context.
"""

from __future__ import annotations

import torch

from archc.errors import RunError


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
