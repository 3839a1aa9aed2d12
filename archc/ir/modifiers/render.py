"""Modifier expressions rendered to torch (eager attention's semantics) and to Triton (the
kernels'). Both compute floats in f32 and integers with Python's floor semantics for // and %;
torch's integers are int64, a kernel's positions int32 (literals are bounded by int32).

Eager evaluates over broadcast tensors, [B, H, T, L] in the end: q_pos [1, 1, T, 1],
kv_pos [1, 1, 1, L], head and kv_head [1, H, 1, 1], a per-head parameter [H] (or [H_kv]) at
them, a per-token input [B, N] at the positions, a per-sequence scalar [B] or [] — and the
scores [B, H, T, L]. A kernel names the value of each leaf in its tile (`triton`): q positions
as a column, kv positions as a row, the head a scalar (or a column of the group's heads).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from archc.ir.attrs import Call
from archc.ir.modifiers import interval as iv
from archc.ir.modifiers.language import Env, Expr, Function, Type, fold
from archc.ir.modifiers.tiles import Intervals, Tile

_DTYPES: dict[Type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float32}


@dataclass(frozen=True)
class EagerValues:
    """What eager attention knows of one call: the absolute positions of its T queries and L
    keys (in any order: a ring's blocks are zig-zag slices), its head counts, the scores, and
    the tensors of the environment's names."""

    q_pos: torch.Tensor                     # [T] int
    kv_pos: torch.Tensor                    # [L] int
    heads: int
    kv_heads: int
    score: torch.Tensor | None = None       # [B, H, T, L] f32
    head_params: Mapping[str, torch.Tensor] = field(default_factory=dict)  # [H] or [H_kv]
    token_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)  # [B, N] by position
    scalars: Mapping[str, torch.Tensor] = field(default_factory=dict)       # [B] or []


class _Torch:
    def __init__(self, values: EagerValues) -> None:
        self.v = values
        self.device = values.q_pos.device
        heads = torch.arange(values.heads, device=self.device)
        self.head = heads.view(1, -1, 1, 1)
        self.kv_head = (heads // (values.heads // values.kv_heads)).view(1, -1, 1, 1)

    def literal(self, v: bool | int | float) -> torch.Tensor:
        return torch.tensor(v, dtype=_DTYPES[type(v)], device=self.device)

    def leaf(self, e: Call, t: Type) -> torch.Tensor:
        v, name = self.v, e.args[0]
        if e.fn == "index":
            at = e.args[1].args[0]
            if name in v.head_params:
                return v.head_params[name].to(self.device, _DTYPES[t])[
                    self.head if at == "head" else self.kv_head]                  # [1, H, 1, 1]
            pos = (v.q_pos if at == "q_pos" else v.kv_pos).to(self.device).long()
            x = v.token_inputs[name].to(self.device, _DTYPES[t])[:, pos]          # [B, T or L]
            return x[:, None, :, None] if at == "q_pos" else x[:, None, None, :]
        if name == "score":
            assert v.score is not None, "a score expression needs the scores"
            return v.score.float()
        if name in ("q_pos", "kv_pos"):
            pos = (v.q_pos if name == "q_pos" else v.kv_pos).to(self.device).long()
            return pos.view(1, 1, -1, 1) if name == "q_pos" else pos.view(1, 1, 1, -1)
        if name in ("head", "kv_head"):
            return self.head if name == "head" else self.kv_head
        s = v.scalars[name].to(self.device, _DTYPES[t])
        return s.view(-1, 1, 1, 1) if s.dim() else s

    def to_float(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def apply(self, f: Function, args: list[torch.Tensor], result: Type) -> torch.Tensor:
        return f.torch(*args)


def evaluate(e: Expr, env: Env, values: EagerValues) -> torch.Tensor:
    """`e` (checked over `env`) over `values`: a tensor broadcastable to [B, H, T, L] — bool,
    int64 or f32."""
    return fold(e, env, _Torch(values))[0]


# ---- Triton ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TritonCode:
    """An expression as Triton: statements that name the operands used twice (Python's floor
    division reads its dividend twice), then the value's code."""

    lines: tuple[str, ...]
    value: str


@dataclass(frozen=True)
class _Code:
    text: str                                # a primary expression: a name, call, subscript
    range: iv.Value                          # or parenthesized, so `.to(…)` may follow it
    leaf: bool = True
    literal: bool | int | float | None = None
    scalar: bool = True                      # one value for the whole tile


def _on_tile(e: Call) -> bool:
    """Does the leaf vary over the tile? Positions, scores and per-token inputs do; a head, its
    parameters and per-sequence scalars are one value (in a kernel whose rows are several
    heads they are a column, which the renderings below treat alike)."""
    at = e.args[1].args[0] if e.fn == "index" else e.args[0]
    return at in ("score", "q_pos", "kv_pos")


# what a kernel knows of every tile: positions and heads are ≥ 0 (a ring's filler keys at −1
# are hidden whatever the mask says), so // and % of them are C's, and cheaper
KERNEL_TILE = Tile((0, math.inf), (0, math.inf))


class _Triton:
    def __init__(self, code: Mapping[Expr, str], prefix: str) -> None:
        self.code, self.prefix = code, prefix
        self.ranges = Intervals(KERNEL_TILE)
        self.lines: list[str] = []

    def literal(self, v: bool | int | float) -> _Code:
        # a bool literal as a tensor: ~ and & of Python's bools are integer operators
        text = f"tl.full((), {v}, tl.int1)" if isinstance(v, bool) else repr(v) if \
            not isinstance(v, float) or math.isfinite(v) else f'float("{v}")'
        return _Code(text, iv.point(v), literal=v)

    def leaf(self, e: Call, t: Type) -> _Code:
        if e not in self.code:
            raise KeyError(f"no Triton value given for {e}")
        return _Code(self.code[e], self.ranges.leaf(e, t), scalar=not _on_tile(e))

    def to_float(self, x: _Code) -> _Code:
        r = self.ranges.to_float(x.range)
        if x.literal is not None:
            return _Code(repr(float(x.literal)), r, literal=float(x.literal))
        return _Code(f"{x.text}.to(tl.float32)", r, leaf=False, scalar=x.scalar)

    def apply(self, f: Function, args: list[_Code], result: Type) -> _Code:
        r = self.ranges.apply(f, [a.range for a in args], result)
        if all(a.literal is not None for a in args):
            # constants fold here, by torch: a kernel would fold Python numbers by Python's
            # rules, into numbers without .to()
            v = f.torch(*(torch.tensor(a.literal, dtype=_DTYPES[type(a.literal)])
                          for a in args)).item()
            return self.literal(v)
        codes = [a.text for a in args]
        scalar = all(a.scalar for a in args)
        if f.triton_mixed is not None and args[0].scalar != args[1].scalar:
            one, tile = sorted(args, key=lambda a: not a.scalar)
            return _Code(f.triton_mixed(one.text, tile.text), r, leaf=False, scalar=False)
        first = args[0].range
        if f.triton_nonnegative is not None and isinstance(first, iv.Interval) and first.lo >= 0:
            return _Code(f.triton_nonnegative(*codes), r, leaf=False, scalar=scalar)
        if f.bind and not args[0].leaf:
            name = f"{self.prefix}{len(self.lines)}"
            self.lines.append(f"{name} = {codes[0]}")
            codes[0] = name
        return _Code(f.triton(*codes), r, leaf=False, scalar=scalar)


def triton(e: Expr, env: Env, code: Mapping[Expr, str], prefix: str = "mod_") -> TritonCode:
    """`e` (checked over `env`) as Triton over `code`, the kernel's value of each leaf of `e`
    (``leaves(e)``: var("q_pos") → "q_pos[:, None]", index("slope", var("head")) → "slope";
    each a primary expression), with temporaries named `prefix`0, `prefix`1 …"""
    backend = _Triton(code, prefix)
    value, _ = fold(e, env, backend)
    return TritonCode(tuple(backend.lines), value.text)
