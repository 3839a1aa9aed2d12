"""The recurrent state an op carries between calls, declared with the op.

A recurrent mixer (Mamba's convolution and selective scan, linear attention's running sums) reads
its layer's state at the start of a call and leaves the updated state for the next call, so a
prompt prefilled in one call and continued token by token computes what one call over the whole
sequence computes. Each such op declares its state in the op table (``OpDef.extra["state"]``): a
function from the node's signature to the tensors it keeps — kind, shape over ``B`` and dtype —
so the runtimes allocate it and the cost model counts it from the IR alone.

The state of a sequence starts at zero: a call at past length P = 0 reads zeros, whatever an
earlier sequence left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from archc.ir.shapes import DTYPE_BYTES, Shape, numel


@dataclass(frozen=True)
class StateDecl:
    """One state tensor of a layer: `kind` names it ("conv", "ssm", "S", "z")."""

    kind: str
    shape: Shape          # leading dim B
    dtype: str

    @property
    def bytes(self) -> sympy.Expr:
        return numel(self.shape) * DTYPE_BYTES[self.dtype]


StatesFn = Callable[..., tuple[StateDecl, ...]]   # (Sig) -> the op's state tensors


def state_bytes(decls: tuple[StateDecl, ...]) -> sympy.Expr:
    """Bytes of the given state tensors (sympy in B)."""
    return sympy.Add(*[d.bytes for d in decls])
