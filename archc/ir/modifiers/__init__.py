"""Attention modifiers as expressions: the `score` and `mask` of an attention written in a small
typed language, parsed by archc (never evaluated as Python), printed and read back as IR
attribute values, rendered to torch and to Triton, and classified over tiles by interval
arithmetic; the built-in variants as library expressions; the normalizers' algebra.

    language     the variables, the environment's names, the one table of functions
    syntax       the infix text: tokenizer, parser, printer
    check        types, and the refusals (one line: field, column, what is allowed)
    render       torch (eager) and Triton (kernels)
    interval     interval arithmetic; tiles: full / partial / empty classification
    library      causal, windows, prefix-LM, Longformer, chunked, ALiBi, soft-cap … and the
                 attention op's shorthand attributes in those terms
    normalizers  softmax, softmax with sinks, sigmoid: one-shot and online
"""

from archc.ir.modifiers.check import Kind, check, check_int32, parse_field
from archc.ir.modifiers.language import Env, Expr, index, leaves, substitute, type_of, var
from archc.ir.modifiers.library import LIBRARY, Modifiers, builtin, from_attention_attrs
from archc.ir.modifiers.normalizers import PARAMS as NORMALIZER_PARAMS
from archc.ir.modifiers.normalizers import SOFTMAX, attend, attend_online, weights
from archc.ir.modifiers.render import EagerValues, TritonCode, evaluate, triton
from archc.ir.modifiers.syntax import ExprError, format_expr, parse
from archc.ir.modifiers.tiles import Tile, TileClass, TileMap, classify, tile_map, value_range

__all__ = [
    "LIBRARY", "NORMALIZER_PARAMS", "SOFTMAX", "EagerValues", "Env", "Expr", "ExprError",
    "Kind", "Modifiers", "Tile", "TileClass", "TileMap", "TritonCode", "attend",
    "attend_online", "builtin", "check", "check_int32", "classify", "evaluate", "format_expr",
    "from_attention_attrs", "index", "leaves", "parse", "parse_field", "substitute",
    "tile_map", "triton", "type_of", "value_range", "var", "weights",
]
