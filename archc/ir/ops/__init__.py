"""The op table: every op declared once (``OP_TABLE``), grouped by family into modules."""

from archc.ir.ops import attention, core, moe, recurrent  # noqa: F401  (they register)
from archc.ir.ops.base import (
    ELEMENTWISE,
    MATMUL,
    META,
    OP_TABLE,
    POINTWISE,
    RECURRENT,
    REDUCTION,
    ROW_KERNELS,
    VIEW,
    Args,
    Attr,
    Op,
    OpDef,
    ShapeError,
    Sig,
    StateDecl,
    attr_problems,
    bind,
    canonical,
    full_attrs,
    is_compute,
    make_sig,
    roles_of,
)

KERNEL_LEVEL = frozenset(op for op, d in OP_TABLE.items() if d.template is not None)

__all__ = [
    "ELEMENTWISE", "KERNEL_LEVEL", "MATMUL", "META", "OP_TABLE", "POINTWISE", "RECURRENT",
    "REDUCTION", "ROW_KERNELS", "VIEW", "Args", "Attr", "Op", "OpDef", "ShapeError", "Sig",
    "StateDecl", "attr_problems", "bind", "canonical", "full_attrs", "is_compute", "make_sig",
    "roles_of",
]
