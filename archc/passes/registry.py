"""Passes by name, and pipelines as lists of names.

``register_pass`` registers a function ``(Graph, PassContext) -> Graph``, run over each graph of a
program; ``register_program_pass`` a function ``(Program, {graph: PassContext}) -> Program`` that
sees every graph at once and may move nodes between graphs or add one. Both are kept as program
functions, so the manager runs every pass by one code path. Every registered pass is *exact*: it
keeps the function up to rounding, and is translation-validated.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from archc.errors import ArchcError
from archc.ir.graph import Graph, Program
from archc.passes.context import PassContext

PassFn = Callable[[Graph, PassContext], Graph]
ProgramPassFn = Callable[[Program, Mapping[str, PassContext]], Program]
Kind = Literal["exact"]


class GraphFailure(Exception):
    """A pass failed on one graph: which, and the error."""

    def __init__(self, graph: str, error: Exception) -> None:
        super().__init__(str(error))
        self.graph, self.error = graph, error


@dataclass(frozen=True)
class Pass:
    name: str
    kind: Kind
    summary: str
    fn: ProgramPassFn
    program: bool = False      # written over the whole program, not graph by graph


PASSES: dict[str, Pass] = {}


def _add(p: Pass) -> None:
    if p.name in PASSES:
        raise ValueError(f"pass {p.name!r} registered twice")
    PASSES[p.name] = p


def register_pass(name: str, kind: Kind, summary: str) -> Callable[[PassFn], PassFn]:
    def register(fn: PassFn) -> PassFn:
        def run(program: Program, contexts: Mapping[str, PassContext]) -> Program:
            graphs = []
            for g in program:
                try:
                    graphs.append(fn(g, contexts[g.name]))
                except Exception as err:
                    raise GraphFailure(g.name, err) from err
            if all(a is b for a, b in zip(graphs, program.graphs)):
                return program       # no graph changed
            return Program(program.model, tuple(graphs))
        _add(Pass(name, kind, summary, run))
        return fn
    return register


def register_program_pass(name: str, kind: Kind, summary: str
                          ) -> Callable[[ProgramPassFn], ProgramPassFn]:
    def register(fn: ProgramPassFn) -> ProgramPassFn:
        _add(Pass(name, kind, summary, fn, program=True))
        return fn
    return register


# The default pipeline, in order. Attention is recognised first (its structure is what the
# projection merges trace from), projections are merged before norms fold (one prologue per
# merged matmul), and the epilogue fusions run last, over merged projections — the expert gate
# and up stages merge before them, so an activation joins a whole expert matmul. Cross-attention's
# K and V leave the decoder once merged (one projection per layer to move), before the kernels
# are chosen in either graph. The recurrent mixers become their kernels beside attention, before
# the projections merge (linear attention's q, k, v trace from its kernel) and before norms fold
# (Jamba's B and C norms join the scan, not a matmul).
DEFAULT_PIPELINE: tuple[str, ...] = (
    "fold-biases", "share-kv-heads", "flash-attention", "fuse-linear-attention",
    "fuse-causal-conv", "fuse-ssm-scan", "merge-qkv", "hoist-cross-kv", "fold-norms", "fuse-glu",
    "merge-parallel", "fuse-qk-norm", "fuse-rope", "fuse-kv-write", "fuse-moe", "fuse-epilogue",
    "fuse-residual", "fuse-pointwise", "select-kernels", "cse", "dce",
)

PIPELINES: dict[str, tuple[str, ...]] = {"default": DEFAULT_PIPELINE, "none": ()}


def known(*, pipelines: bool = True) -> str:
    """Pipelines, then passes in the default pipeline's order, then any others."""
    names = list(DEFAULT_PIPELINE) + sorted(set(PASSES) - set(DEFAULT_PIPELINE))
    return ", ".join((list(PIPELINES) if pipelines else []) + names)


def resolve_pipeline(pipeline: str | Sequence[str]) -> list[str]:
    """Pass names of a pipeline given by name ("default", "none"), as a comma-separated list
    of pass names, or as a sequence of names."""
    if isinstance(pipeline, str):
        if pipeline in PIPELINES:
            return list(PIPELINES[pipeline])
        pipeline = [p.strip() for p in pipeline.split(",") if p.strip()]
    out: list[str] = []
    for name in pipeline:
        if name in PIPELINES:
            out += PIPELINES[name]
        elif name in PASSES:
            out.append(name)
        else:
            close = difflib.get_close_matches(name, list(PASSES) + list(PIPELINES), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ArchcError(f"unknown pass {name!r}{hint}; known: {known()}")
    return out
