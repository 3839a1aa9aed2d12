"""The operator IR: plain-data nodes, graphs, text form, verifier, lowering."""

from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.text import format_program, parse_program
from archc.ir.verify import verify

__all__ = ["Op", "format_program", "lower", "parse_program", "verify"]
