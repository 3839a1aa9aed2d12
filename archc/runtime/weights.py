"""Weights: seeded random checkpoints, and parameters evaluated from checkpoint tensors.

A checkpoint is a mapping from tensor name to tensor (the names the unfused graph's ``param``
nodes carry). A graph's parameters are evaluated from it once — each ``param`` node's ``expr`` (or
the checkpoint tensor of its name) — and cast to the node's dtype.

Random weights are drawn per tensor from a generator seeded by the tensor's name, so a tensor is the
same whatever graph asks for it, and scaled by the role the tensor plays where it is used: matmul
weights N(0, 1/fan_in) keep activations at unit scale, norm gains are 1 + N(0, 0.1²) (N(0, 0.1²)
for Gemma's 1 + w), biases N(0, 0.1²) — random, never constant, so passes that mishandle a bias or
a gain change the output visibly.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator, Mapping

import torch

from archc.dtypes import TORCH_DTYPES
from archc.errors import WeightsError
from archc.ir.graph import Graph, Program
from archc.ir.ops import Op, full_attrs, roles_of
from archc.ir.paramexpr import calls, evaluate, leaf
from archc.ir.shapes import concrete
from archc.quant import QTensor, Weight, is_quantized


def checkpoint_shapes(program: Program) -> dict[str, tuple[int, ...]]:
    """Name → shape of every checkpoint tensor the program reads (params without an expr)."""
    return {n.name: concrete(n.shape, {}) for g in program for n in g
            if n.op == Op.PARAM and n.attr("expr") is None}


def _roles(program: Program) -> dict[str, str]:
    """Checkpoint tensor name → its role, from how the tensor is first used."""
    roles: dict[str, str] = {}
    for g in program:
        for n in g:
            named = roles_of(n.op, full_attrs(n.op, n.attrs), len(n.inputs))
            for role, j in zip(named, n.inputs):
                src = g.nodes[j]
                if src.op != Op.PARAM or src.attr("expr") is not None or src.name in roles:
                    continue
                if n.op == Op.NORM and role == "weight":
                    roles[src.name] = "offset_gain" if n.attr("unit_offset") else "gain"
                elif role.startswith("bias") or n.op == Op.ADD:
                    roles[src.name] = "bias"
                else:
                    roles[src.name] = {Op.EMBEDDING: "table", Op.REL_BIAS: "rel_table"}.get(
                        n.op, "weight")
    return roles


def random_weights(program: Program, seed: int = 0,
                   dtype: str = "f32") -> dict[str, torch.Tensor]:
    """A seeded random checkpoint for `program`, scaled so activations stay sane: drawn in f32,
    held in `dtype` (one tensor at a time, so a bf16 checkpoint never needs its f32 size)."""
    roles = _roles(program)
    out: dict[str, torch.Tensor] = {}
    for name, dims in checkpoint_shapes(program).items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        x = torch.randn(dims, generator=gen)
        role = roles.get(name, "weight")
        if role == "weight":  # matmul, expert weights: fan-in is the last dim
            x = x / dims[-1] ** 0.5
        elif role == "gain":
            x = 1.0 + 0.1 * x
        elif role in ("offset_gain", "bias", "choice_bias"):
            x = 0.1 * x
        elif role == "rel_table":
            x = 0.5 * x
        out[name] = x.to(TORCH_DTYPES[dtype])
    return out


def check_checkpoint(program: Program, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor the program reads is present and of the right shape; nothing is left over."""
    check_shapes(checkpoint_shapes(program), {k: tuple(v.shape) for k, v in tensors.items()})


def check_shapes(want: Mapping[str, tuple[int, ...]], held: Mapping[str, tuple[int, ...]]) -> None:
    """The tensors `held` (name → shape) are those `want` names, each of the shape it wants."""
    for name, dims in want.items():
        if name not in held:
            raise WeightsError(f"checkpoint tensor {name!r} is missing (expected shape "
                               f"{list(dims)})")
        found = tuple(held[name])
        if found != dims:
            raise WeightsError(f"checkpoint tensor {name!r} has shape {list(found)}, expected "
                               f"{list(dims)}")
    extra = sorted(set(held) - set(want))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise WeightsError(f"checkpoint has tensors the model does not use: "
                           f"{', '.join(extra[:3])}{more}")


class Handover(Mapping[str, Weight]):
    """A model's checkpoint handed to the one session compiled from it: a tensor leaves the
    model's dict once every parameter that reads it has been evaluated (`plan` counts those
    reads in the session's program). A parameter made of several tensors (Q, K and V merged)
    is then held beside its sources one at a time, never the whole model twice."""

    def __init__(self, weights: dict[str, Weight]) -> None:
        self.weights = weights
        self.reads: Counter[str] | None = None

    def plan(self, program: Program) -> None:
        self.reads = Counter(c.args[0] for g in program for n in g if n.op == Op.PARAM
                             for c in calls(n.attr("expr") or leaf(n.name)) if c.fn == "w")

    def __getitem__(self, name: str) -> Weight:
        if self.reads is None:
            raise WeightsError("a handed-over checkpoint is read after plan(program)")
        w = self.weights[name]
        self.reads[name] -= 1
        if self.reads[name] <= 0:
            del self.weights[name]
        return w

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def materialize(graph: Graph, tensors: Mapping[str, Weight],
                device: str | torch.device = "cpu", *, rank: int = 0) -> dict[str, Weight]:
    """Evaluate every param of `graph` from checkpoint `tensors`: name → tensor in its dtype,
    or the quantized tensor of its scheme (a quantized weight is never dequantized here). A
    sharded program's `shard()` expressions take tensor-parallel rank `rank`'s slice."""
    out: dict[str, Weight] = {}
    for i in graph.ids(Op.PARAM):
        n = graph.nodes[i]
        expr = n.attr("expr") or leaf(n.name)
        value = evaluate(expr, tensors, rank=rank)
        dims = concrete(n.shape, {})
        if tuple(value.shape) != dims:
            raise WeightsError(f"parameter {n.name!r} evaluates to shape {list(value.shape)}, "
                               f"the graph declares {list(dims)}")
        if is_quantized(n.dtype) or isinstance(value, QTensor):
            if not isinstance(value, QTensor) or value.dtype != n.dtype:
                got = value.dtype if isinstance(value, QTensor) else "a plain tensor"
                raise WeightsError(f"parameter {n.name!r} is {got}, the graph declares "
                                   f"{n.dtype}")
            out[n.name] = value.to(device)
        else:
            out[n.name] = value.to(device=device, dtype=TORCH_DTYPES[n.dtype])
    return out


def quant_schemes(tensors: Mapping[str, Weight]) -> dict[str, str]:
    """Checkpoint tensor name → scheme, for the tensors kept quantized."""
    return {k: w.dtype for k, w in tensors.items() if isinstance(w, QTensor)}


def quantizable(program: Program) -> list[str]:
    """The checkpoint tensors `quantize=` turns into quantized weights: the weights of linear
    layers and experts (what a matmul streams). Embedding tables (a tied head included), norms,
    biases, routers and recurrent mixers' tensors keep their dtype."""
    roles = _roles(program)
    table_of: set[str] = set()
    linear: set[str] = set()
    for g in program:
        for n in g:
            named = roles_of(n.op, full_attrs(n.op, n.attrs), len(n.inputs))
            for role, j in zip(named, n.inputs):
                src = g.nodes[j]
                if src.op != Op.PARAM or src.attr("expr") is not None:
                    continue
                if n.op == Op.EMBEDDING:
                    table_of.add(src.name)
                elif role == "weight" and n.op in (Op.MATMUL, Op.FUSED_LINEAR, Op.MOE_LINEAR):
                    linear.add(src.name)
    return [name for name in checkpoint_shapes(program)
            if name in linear and name not in table_of and roles.get(name) == "weight"]
