"""The pass manager: runs a pipeline over every graph of a program, verifying after each pass.

Each step keeps the program before and after and the decisions the pass made, so the CLI can
print the IR after any pass, tabulate the pipeline, explain refusals and diff one pass (kept
nodes under their old numbers, not every id the renumbering shifted). A pass that changed nothing
returns the same graph object: "not applied". A failure names the pass, the graph and the passes
that ran before it.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from archc.errors import IRError
from archc.ir.graph import Program
from archc.ir.text import format_node, format_program
from archc.ir.verify import verify
from archc.passes.registry import PASSES, Decision, GraphFailure, PassContext, resolve_pipeline

LOG = logging.getLogger("archc.passes")


class PassFailure(IRError):
    """A pass raised or left a graph the verifier refuses."""


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


def run_pass(program: Program, name: str, done: Sequence[str] = ()) -> PassStep:
    """Run one pass over every graph of `program` (one context per graph), verify the result if
    it changed, and record what it did."""
    def where(graph: str | None = None) -> str:
        on = f" on graph {graph}" if graph else ""
        return f"pass {name}{on} (after: {', '.join(done) or 'none'})"

    contexts = {g.name: PassContext(name, g) for g in program}
    try:
        after = PASSES[name].fn(program, contexts)
    except Exception as err:
        graph, cause = (err.graph, err.error) if isinstance(err, GraphFailure) else (None, err)
        detail = str(cause) if isinstance(cause, IRError) else f"{type(cause).__name__}: {cause}"
        raise PassFailure(f"{where(graph)}: {detail}") from cause
    log: list[str] = []
    for g in after:
        ctx = contexts.get(g.name)
        if ctx is None:
            log.append(f"{name}: graph {g.name}: added ({len(g.nodes)} nodes)")
            continue
        applied = sum(d.applied for d in ctx.decisions)
        refused = len(ctx.decisions) - applied
        if g is ctx.graph:
            log.append(f"{name}: graph {g.name}: not applied" +
                       (f" ({refused} candidates refused)" if refused else ""))
        else:
            log.append(f"{name}: graph {g.name}: {applied} rewrites" +
                       (f", {refused} refused" if refused else ""))
    for line in log:
        LOG.debug(line)
    if after is not program:
        try:
            verify(after)
        except IRError as err:
            raise PassFailure(f"{where()} left an invalid graph: {err}") from err
    decisions = tuple(d for ctx in contexts.values() for d in ctx.decisions)
    kept = {g: ctx.kept for g, ctx in contexts.items() if ctx.kept is not None}
    return PassStep(name, PASSES[name].kind, program, after, decisions, tuple(log), kept)


def run_pipeline(program: Program, pipeline: str | Sequence[str] = "default") -> PipelineRun:
    """Run the passes of `pipeline` in order, verifying after each one that changed a graph."""
    names = resolve_pipeline(pipeline)
    steps: list[PassStep] = []
    for k, name in enumerate(names):
        steps.append(run_pass(steps[-1].after if steps else program, name, names[:k]))
    return PipelineRun(program, tuple(steps))


def optimize(program: Program, pipeline: str | Sequence[str] = "default") -> Program:
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
