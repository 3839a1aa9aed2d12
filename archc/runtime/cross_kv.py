"""The cross-KV cache: a program's `cross_kv` graph, run once per generation.

`hoist-cross-kv` moves what the decoder computes from the encoder's states alone (the
cross-attention K and V projections) into a `cross_kv` graph. A session runs it at the first
decoder step after a reset, or when a step brings another `encoder_hidden` tensor, and feeds its
outputs to every step as decoder inputs of the same names. Recomputed values are copied into the
tensors already held when the shapes match, so a captured decode step keeps reading the same
addresses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from archc.ir.graph import CROSS_KV, Program

RunGraph = Callable[[torch.Tensor], dict[str, torch.Tensor]]


class CrossKV:
    """Outputs of the `cross_kv` graph for the encoder states they were computed from."""

    def __init__(self, program: Program, run: RunGraph) -> None:
        self.enabled = any(g.name == CROSS_KV for g in program)
        self.run = run                      # encoder_hidden → the graph's outputs by name
        self.values: dict[str, torch.Tensor] = {}
        self.source: torch.Tensor | None = None

    def reset(self) -> None:
        """A new generation: the next step computes them again (into the same tensors)."""
        self.source = None

    def inputs(self, encoder_hidden: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The decoder inputs computed from `encoder_hidden`, computed now if not yet."""
        if not self.enabled or encoder_hidden is None:
            return {}
        if self.source is not encoder_hidden:
            for name, x in self.run(encoder_hidden).items():
                held = self.values.get(name)
                if held is not None and held.shape == x.shape and held.dtype == x.dtype and \
                        held.device == x.device:
                    held.copy_(x)
                else:
                    self.values[name] = x
            self.source = encoder_hidden
        return dict(self.values)
