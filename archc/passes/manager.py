"""Passes by name, the decisions they report, pipelines as lists of names, and the manager.

Every candidate a pass looks at ends in a ``Decision``: applied, or refused by a *legality* rule
("may I?" — doing it would change the function) or a *profitability* rule ("should I?" — legal, but
it would cost more than it saves). A pass, over each graph or the whole program, is exact and
returns the same object when it changed nothing ("not applied"). The manager verifies after each
pass that changed a graph and keeps each program and decision for the CLI (the IR after any pass,
refusals, one pass's diff); a failure names the pass, the graph and the passes before it.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from archc.errors import ArchcError, IRError
from archc.ir.graph import Graph, Program
from archc.ir.text import format_node, format_program
from archc.ir.verify import verify

LOG = logging.getLogger("archc.passes")
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


class PassFailure(IRError):
    """A pass raised or left a graph the verifier refuses."""


PassFn = Callable[[Graph, PassContext], Graph]
ProgramPassFn = Callable[[Program, Mapping[str, PassContext]], Program]
F = TypeVar("F", PassFn, ProgramPassFn)


@dataclass(frozen=True)
class Pass:
    name: str
    summary: str
    fn: Callable[..., Any]     # a PassFn, or a ProgramPassFn when `program`
    program: bool = False      # written over the whole program, not graph by graph
    kind: str = "exact"
    # option → its default (None: required), each a whole number ≥ 1 (a count or a size)
    # passed to `fn` by keyword; named in a pipeline as NAME:OPTION=N[:OPTION=N…]
    options: Mapping[str, int | None] = field(default_factory=dict)

    def usage(self) -> str:
        """`shard:tp=1`: the pass with its options at their defaults (N: required)."""
        return ":".join([self.name, *(f"{k}={'N' if v is None else v}"
                                      for k, v in self.options.items())])

    def given(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """`options` and the defaults of the rest; an unknown, missing or bad one refused."""
        full = {**self.options, **options}
        bad = [f"has no option {k!r}" for k in options if k not in self.options] + [
            f"needs option {k!r}" if v is None else f"given {k}={v!r}, not a whole number ≥ 1"
            for k, v in full.items() if type(v) is not int or v < 1]
        if bad:
            raise ArchcError(f"pass {self.name} {bad[0]}; it takes "
                             f"{self.usage() if self.options else 'none'}")
        return full


PASSES: dict[str, Pass] = {}


def register_pass(name: str, summary: str, *, program: bool = False, kind: str = "exact",
                  options: Mapping[str, int | None] | None = None) -> Callable[[F], F]:
    """Register `fn` under `name`: a PassFn, or a ProgramPassFn when `program`. `kind`:
    "exact" (the function kept), or "variant" (a program the runtime runs in the program's
    place for some callers — the rows they read, the KV cache they page — whose outputs agree
    with the program's where they read them; never in the default pipeline). `options`: see
    `Pass.options`."""
    def register(fn: F) -> F:
        if name in PASSES:
            raise ValueError(f"pass {name!r} registered twice")
        PASSES[name] = Pass(name, summary, fn, program, kind, dict(options or {}))
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
# Projections whose epilogue pairs columns (glu, rope) get their weight rows permuted last, once
# their epilogues are complete.
DEFAULT_PIPELINE: tuple[str, ...] = (
    "absorb-mla", "fold-biases", "share-kv-heads", "flash-attention", "fuse-linear-attention",
    "fuse-causal-conv", "fuse-ssm-scan", "merge-qkv", "hoist-cross-kv", "fold-norms", "fuse-glu",
    "merge-parallel", "fuse-qk-norm", "fuse-rope", "fuse-kv-write", "fuse-moe", "fuse-epilogue",
    "fuse-residual", "fuse-gate", "fuse-pointwise", "pair-rows", "select-kernels", "cse", "dce",
)

PIPELINES: dict[str, tuple[str, ...]] = {"default": DEFAULT_PIPELINE, "none": ()}


def known(*, pipelines: bool = True) -> str:
    """Pipelines, then passes in the default pipeline's order, then any others."""
    names = list(DEFAULT_PIPELINE) + sorted(set(PASSES) - set(DEFAULT_PIPELINE))
    return ", ".join((list(PIPELINES) if pipelines else []) + names)


Pipeline = str | Sequence[str | tuple[str, Mapping[str, Any]]]


def resolve_pipeline(pipeline: Pipeline) -> list[tuple[str, dict[str, Any]]]:
    """The passes, with the options each is given, of a pipeline name ("default", "none"), of
    "a,b,c" or of a sequence of names and (name, options) pairs; a pass given options is named
    "shard:tp=2"."""
    if isinstance(pipeline, str):
        pipeline = [p.strip() for p in pipeline.split(",") if p.strip()]
    out: list[tuple[str, dict[str, Any]]] = []
    for item in pipeline:
        if not isinstance(item, str):       # (name, options), as code gives them
            out.append((item[0], dict(item[1])))
            continue
        name, *given = item.split(":")
        if name in PIPELINES and not given:
            out += [(n, {}) for n in PIPELINES[name]]
        elif name in PASSES:
            try:
                out.append((name, {k: int(v) for k, _, v in (g.partition("=") for g in given)}))
            except ValueError:
                raise ArchcError(f"pass {item!r}: its options are OPTION=N, N a whole "
                                 "number") from None
        else:
            close = difflib.get_close_matches(name, list(PASSES) + list(PIPELINES), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ArchcError(f"unknown pass {name!r}{hint}; known: {known()}")
    return out


@dataclass(frozen=True)
class PassStep:
    name: str
    kind: str
    before: Program
    after: Program
    decisions: tuple[Decision, ...]
    log: tuple[str, ...]
    kept: dict[str, dict[int, int]] = field(default_factory=dict)   # graph → {old id: new id}

    @property
    def changed(self) -> bool:
        return self.after is not self.before

    def applied(self) -> list[Decision]:
        return [d for d in self.decisions if d.applied]

    def refused(self) -> list[Decision]:
        return [d for d in self.decisions if not d.applied]


@dataclass(frozen=True)
class PipelineRun:
    initial: Program
    steps: tuple[PassStep, ...]

    @property
    def program(self) -> Program:
        return self.steps[-1].after if self.steps else self.initial

    def step(self, name: str) -> PassStep:
        for s in self.steps:
            if s.name == name:
                return s
        ran = ", ".join(s.name for s in self.steps) or "none"
        raise IRError(f"pass {name!r} is not in this pipeline (it ran: {ran})")

    def decisions(self) -> list[Decision]:
        return [d for s in self.steps for d in s.decisions]


def run_pass(program: Program, name: str, done: Sequence[str] = (),
             options: Mapping[str, Any] | None = None) -> PassStep:
    """Run one pass over `program` with `options`, verify the result if it changed, and record
    what it did. A pass that refuses its options or the program (an ArchcError other than an
    IRError, in its own words) raises that error as it is."""
    p, ran = PASSES[name], f"(after: {', '.join(done) or 'none'})"
    given = p.given(options or {})
    contexts = {g.name: PassContext(name, g) for g in program}
    graph = ""      # the graph the pass is working on, for an error
    try:
        if p.program:
            after = p.fn(program, contexts, **given)
        else:
            graphs = []
            for g in program:
                graph = g.name
                graphs.append(p.fn(g, contexts[g.name], **given))
            changed = any(a is not b for a, b in zip(graphs, program.graphs))
            after = Program(program.model, tuple(graphs)) if changed else program
    except Exception as err:
        if isinstance(err, ArchcError) and not isinstance(err, IRError):
            raise
        on = f" on graph {graph}" if graph else ""
        detail = str(err) if isinstance(err, IRError) else f"{type(err).__name__}: {err}"
        raise PassFailure(f"pass {name}{on} {ran}: {detail}") from err
    log: list[str] = []
    for g in after:
        ctx = contexts.get(g.name)
        applied = sum(d.applied for d in ctx.decisions) if ctx else 0
        refused = len(ctx.decisions) - applied if ctx else 0
        if ctx is None:
            what = f"added ({len(g.nodes)} nodes)"
        elif g is ctx.graph:
            what = "not applied" + (f" ({refused} candidates refused)" if refused else "")
        else:
            what = f"{applied} rewrites" + (f", {refused} refused" if refused else "")
        log.append(f"{name}: graph {g.name}: {what}")
        LOG.debug(log[-1])
    if after is not program:
        try:
            verify(after)
        except IRError as err:
            raise PassFailure(f"pass {name} {ran} left an invalid graph: {err}") from err
    decisions = tuple(d for ctx in contexts.values() for d in ctx.decisions)
    kept = {g: ctx.kept for g, ctx in contexts.items() if ctx.kept is not None}
    return PassStep(name, p.kind, program, after, decisions, tuple(log), kept)


def run_pipeline(program: Program, pipeline: Pipeline = "default") -> PipelineRun:
    """Run the passes of `pipeline` in order, verifying after each one that changed a graph."""
    items = resolve_pipeline(pipeline)
    steps: list[PassStep] = []
    for k, (name, options) in enumerate(items):
        steps.append(run_pass(steps[-1].after if steps else program, name,
                              [n for n, _ in items[:k]], options))
    return PipelineRun(program, tuple(steps))


def optimize(program: Program, pipeline: Pipeline = "default") -> Program:
    """The program after `pipeline`."""
    return run_pipeline(program, pipeline).program


def _relabel(line: str, labels: list[str]) -> str:
    return re.sub(r"%(\d+)", lambda m: labels[int(m.group(1))], line)


def step_diff(step: PassStep, *, provenance: bool = False) -> str:
    """Unified diff of the program before and after `step` ('' when it changed nothing): the
    nodes the pass kept keep their old numbers, the ones it made are %+1, %+2…"""
    if not step.changed:
        return ""
    after = [f"program {step.after.model}"]
    for g in step.after.graphs:
        kept = step.kept.get(g.name, {i: i for i in range(len(g.nodes))})
        old_of = {new: old for old, new in kept.items()}
        made = iter(range(1, len(g.nodes) + 1))
        labels = [f"%{old_of[i]}" if i in old_of else f"%+{next(made)}"
                  for i in range(len(g.nodes))]
        after += [f"graph {g.name} {{",
                  *("  " + _relabel(format_node(i, n, provenance=provenance), labels)
                    for i, n in enumerate(g.nodes)), "}"]
    return "".join(difflib.unified_diff(
        format_program(step.before, provenance=provenance).splitlines(keepends=True),
        [line + "\n" for line in after], fromfile=f"before {step.name}",
        tofile=f"after {step.name} (kept nodes keep their numbers; %+N are new)"))
