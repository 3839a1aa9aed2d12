"""The op table: every op declared once (``OP_TABLE``), grouped by family into modules."""

from archc.ir.ops import (  # noqa: F401  (each module registers its ops)
    attention,
    core,
    fused,
    linear_attention,
    moe,
    ssm,
)
from archc.ir.ops.base import (
    KERNEL_LEVEL,
    MATMUL,
    META,
    OP_TABLE,
    POINTWISE,
    RECURRENT,
    REDUCTION,
    VIEW,
    EagerCtx,
    Op,
    OpDef,
    ShapeError,
    Sig,
    is_compute,
)

__all__ = [
    "KERNEL_LEVEL", "MATMUL", "META", "OP_TABLE", "POINTWISE", "RECURRENT", "REDUCTION", "VIEW",
    "EagerCtx", "Op", "OpDef", "ShapeError", "Sig", "is_compute",
]
