"""The op table: every op declared once (``OP_TABLE``), grouped by family into modules."""

from archc.ir.ops import (  # noqa: F401  (they register)
    attention,
    collective,
    core,
    modifiers,
    recurrent,
)
from archc.ir.ops.base import (
    COLLECTIVE,
    ELEMENTWISE,
    META,
    OP_TABLE,
    ROW_KERNELS,
    VIEW,
    Args,
    Op,
    ShapeError,
    bind,
    canonical,
    full_attrs,
    is_compute,
    roles_of,
)

KERNEL_LEVEL = frozenset(op for op, d in OP_TABLE.items() if d.template is not None)

__all__ = [
    "COLLECTIVE", "ELEMENTWISE", "KERNEL_LEVEL", "META", "OP_TABLE", "ROW_KERNELS", "VIEW",
    "Args", "Op", "ShapeError", "bind", "canonical", "full_attrs", "is_compute", "roles_of",
]
