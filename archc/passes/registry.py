"""Passes by name, what they report, and pipelines as lists of names.

Every candidate a pass looks at ends in a ``Decision``: applied, or refused by a *legality* rule
("may I?" — doing it would change the function) or a *profitability* rule ("should I?" — legal, but
it would cost more than it saves). ``archc explain`` prints the refusals; ``archc passes`` counts
the applications. The ``PassContext`` that collects them is passed explicitly to every pass.

A pass is a function ``(Graph, PassContext) -> Graph`` run over each graph of a program, or a
program function ``(Program, {graph: PassContext}) -> Program`` that may move nodes between
graphs; the manager runs both as the latter. Every registered pass is *exact*: it keeps the
function up to rounding, and is translation-validated.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from archc.errors import ArchcError
from archc.ir.graph import Graph, Program
from archc.ir.text import format_node

Verdict = Literal["applied", "legality", "profitability"]


@dataclass(frozen=True)
class Decision:
    pass_name: str
    graph: str
    rule: str              # the rule that decided, e.g. "key-bias", "fold-rmsnorm"
    node: str              # the candidate node in text form, numbered as the pass saw it
    verdict: Verdict
    reason: str = ""       # what was done, or why not

    @property
    def applied(self) -> bool:
        return self.verdict == "applied"


@dataclass
class PassContext:
    """Collects the decisions of one pass over one graph."""

    pass_name: str
    graph: Graph
    decisions: list[Decision] = field(default_factory=list)
    kept: dict[int, int] | None = None   # old id → new id of the nodes kept, set on renumbering

    def describe(self, i: int) -> str:
        """Node i of the graph as the pass received it, in text form."""
        return format_node(i, self.graph.nodes[i]) if 0 <= i < len(self.graph.nodes) else \
            f"%{i} (made by this pass)"

    def decide(self, rule: str, where: int | str, verdict: Verdict, reason: str) -> None:
        """`where`: a node id of the graph as the pass received it, or a node's text."""
        text = where if isinstance(where, str) else self.describe(where)
        self.decisions.append(Decision(self.pass_name, self.graph.name, rule, text, verdict,
                                       reason))

    def applied(self, rule: str, where: int | str, what: str = "") -> None:
        self.decide(rule, where, "applied", what)

    def refused(self, rule: str, where: int | str, why: str, *,
                profitability: bool = False) -> None:
        self.decide(rule, where, "profitability" if profitability else "legality", why)


class Refusal(Exception):
    """Raised inside a rewrite to refuse it: `why` names the rule that said no."""

    def __init__(self, why: str, *, profitability: bool = False) -> None:
        super().__init__(why)
        self.why, self.profitability = why, profitability


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
