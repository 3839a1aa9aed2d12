"""The elementwise language: one expression form for pointwise kernels, epilogue steps and
activations, rendered to torch (the eager semantics) and to Triton (the kernels).

An expression is a tree of ``Call``s, so it prints and parses as an attribute value: inputs
``x(i)`` (in an epilogue step, x(0) is the accumulator), constants and the functions below, as
in ``softcap(mul(x(0), x(1)), cap=50.0)`` = 50·tanh(x0·x1/50). Each function and activation is
declared once, with its torch code, its Triton code and its FLOPs per element; torch computes
in f32, and so does every kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from archc.ir.attrs import Attr, Call, call_problem

Expr = Any   # a Call tree, or a number


def tanh_code(y: str) -> str:
    """tanh(y) = 2σ(2y) − 1 = 2 / (1 + e^(−2y)) − 1: exp overflows to inf for y ≪ 0, and the
    result is still −1."""
    return f"(2.0 / (1.0 + tl.exp(-2.0 * ({y}))) - 1.0)"


@dataclass(frozen=True)
class Activation:
    name: str
    doc: str
    torch: Callable[[torch.Tensor], torch.Tensor]
    triton: str          # Triton code over `{x}` (written inline: the interpreter pays about a
    flops: int = 8       # millisecond per device-function call)


_SOFTPLUS = ("tl.where({x} > 20.0, {x}, tl.where(1.0 + tl.exp(tl.minimum({x}, 20.0)) == 1.0, "
             "tl.exp(tl.minimum({x}, 20.0)), tl.exp(tl.minimum({x}, 20.0)) * "
             "tl.log(1.0 + tl.exp(tl.minimum({x}, 20.0))) / "
             "tl.maximum(tl.exp(tl.minimum({x}, 20.0)) + 1.0 - 1.0, 1e-30)))")

ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (
    Activation("relu", "max(x, 0)", F.relu, "tl.maximum({x}, 0.0)", 1),
    Activation("gelu", "½x(1 + erf(x/√2))", F.gelu,
               "(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"),
    # ½x(1 + tanh(√(2/π)(x + 0.044715x³))) = x·σ(2√(2/π)(x + 0.044715x³))
    Activation("gelu_tanh", "½x(1 + tanh(√(2/π)(x + 0.044715x³)))",
               lambda x: F.gelu(x, approximate="tanh"),
               "({x} / (1.0 + tl.exp(-1.5957691216057308 * ({x} + 0.044715 * {x} * {x} * {x}))))"),
    Activation("silu", "x·σ(x)", F.silu, "({x} / (1.0 + tl.exp(-{x})))", 4),
    Activation("sigmoid", "σ(x)", torch.sigmoid, "(1.0 / (1.0 + tl.exp(-{x})))", 4),
    Activation("identity", "x", lambda x: x, "{x}", 0),
    # log(1 + eˣ), with log1p(u) = u·log(w)/(w − 1), w = 1 + u rounded (Goldberg 1991): exact
    # where 1 + u rounds (Δ pre-activations near −7 have u ≈ 1e-3); x past 20 as torch's threshold
    Activation("softplus", "log(1 + eˣ): Mamba's step size Δ", F.softplus, _SOFTPLUS),
    Activation("elu_plus_one", "elu(x) + 1 > 0: the feature map φ of linear attention",
               lambda x: F.elu(x) + 1.0,
               "tl.where({x} > 0.0, {x} + 1.0, tl.exp(tl.minimum({x}, 0.0)))", 3),
)}


def _clamp_code(a: str, lo: str | None = None, hi: str | None = None) -> str:
    code = a if lo is None else f"tl.maximum({a}, {lo})"
    return code if hi is None else f"tl.minimum({code}, {hi})"


@dataclass(frozen=True)
class Function:
    name: str
    args: int                         # expression arguments
    params: tuple[Attr, ...]          # literal keyword parameters
    torch: Callable[..., torch.Tensor]
    triton: Callable[..., str]        # over the arguments' code and the parameters' literals
    flops: int = 1                    # per element (act: its activation's)


FUNCTIONS: dict[str, Function] = {f.name: f for f in (
    Function("add", 2, (), lambda a, b: a + b, lambda a, b: f"({a} + {b})"),
    Function("sub", 2, (), lambda a, b: a - b, lambda a, b: f"({a} - {b})"),
    Function("mul", 2, (), lambda a, b: a * b, lambda a, b: f"({a} * {b})"),
    Function("scale", 1, (Attr("by", float),), lambda a, by: a * by, lambda a, by: f"({a} * {by})"),
    Function("act", 1, (Attr("fn", str, choices=tuple(ACTIVATIONS)),),
             lambda a, fn: ACTIVATIONS[fn].torch(a), lambda a, fn: act_code(fn.strip('"'), a)),
    Function("softcap", 1, (Attr("cap", float),), lambda a, cap: cap * torch.tanh(a / cap),
             lambda a, cap: f"({cap} * {tanh_code(f'{a} / {cap}')})", 3),
    # min(max(a, lo), hi), either bound absent (gpt-oss's clamped SwiGLU)
    Function("clamp", 1, (Attr("lo", float, None), Attr("hi", float, None)),
             lambda a, lo=None, hi=None: a.clamp(min=lo, max=hi), _clamp_code),
)}


def problem(e: Expr, inputs: int) -> str | None:
    """What is wrong with `e` as an expression of the language over `inputs` inputs, if
    anything (the verifier's check: the renderings below trust it)."""
    if not isinstance(e, Call):
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e):
            return f"not an expression (a call or a finite number): {e!r}"
        return None
    if e.fn == "x":
        k = e.args[0] if len(e.args) == 1 and not e.kwargs else None
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < inputs:
            return f"x({', '.join(map(repr, e.args))}) is not one of {inputs} inputs"
        return None
    if e.fn not in FUNCTIONS:
        return f"unknown function {e.fn}() (known: {', '.join(FUNCTIONS)})"
    f = FUNCTIONS[e.fn]
    if len(e.args) != f.args:
        return f"{e.fn}() takes {f.args} expression argument(s), got {len(e.args)}"
    return call_problem(Call(e.fn, (), e.kwargs), f.params) or \
        next((p for a in e.args if (p := problem(a, inputs))), None)


def evaluate(e: Expr, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The value of `e` over tensors `xs`, in f32."""
    if not isinstance(e, Call):
        return torch.tensor(float(e))
    if e.fn == "x":
        return xs[e.args[0]].float()
    args = [evaluate(a, xs) for a in e.args]
    return FUNCTIONS[e.fn].torch(*args, **dict(e.kwargs))


def triton(e: Expr, names: Sequence[str]) -> str:
    """`e` as one Triton expression over the f32 values named `names` (input i is names[i])."""
    if not isinstance(e, Call):
        return repr(float(e))
    if e.fn == "x":
        return names[e.args[0]]
    lits = {k: repr(float(v)) if isinstance(v, (int, float)) else f'"{v}"' for k, v in e.kwargs}
    return FUNCTIONS[e.fn].triton(*(triton(a, names) for a in e.args), **lits)


def flops(e: Expr) -> int:
    if not isinstance(e, Call) or e.fn == "x":
        return 0
    own = ACTIVATIONS[e.kw("fn")].flops if e.fn == "act" else FUNCTIONS[e.fn].flops
    return own + sum(flops(a) for a in e.args)


def substitute(e: Expr, leaves: Sequence[Expr]) -> Expr:
    if not isinstance(e, Call):
        return e
    if e.fn == "x":
        return leaves[e.args[0]]
    return Call(e.fn, tuple(substitute(a, leaves) for a in e.args), e.kwargs)


def x(i: int) -> Call:
    return Call("x", (i,))


def call(name: str, /, *args: Expr, **params: Any) -> Call:
    """A function application with its parameters in a canonical order, None ones left out."""
    return Call(name, args, tuple(sorted((k, v) for k, v in params.items() if v is not None)))


def act_code(fn: str, code: str) -> str:
    return ACTIVATIONS[fn].triton.replace("{x}", code)
