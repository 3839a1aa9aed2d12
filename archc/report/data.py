"""A compile as plain data: what `archc report` writes as JSON and the page draws.

Every part comes from the functions the other commands print from, so the page is a view of
the same numbers, never a second computation:

- the spec and its derived numbers: `archc show` (``report.facts``) and ``ir.cost``;
- the pipeline, pass by pass: `archc passes` (``passes.measure.stats``, ``passes.decisions``)
  and `archc explain` (``passes.decisions.grouped``), over the whole model;
- the graph drawn: the model cut to one period of its layer pattern (one block, for a model
  whose blocks are alike), after each pass, with `archc ir --diff`'s text (``step_diff``);
- kernels: codegen's units (``codegen.render.generate``, as `archc compile`), each with the
  nodes it implements; ahead-of-time results (``codegen.aot.compile_module``) with a target;
- the roofline of each kernel for a prefill and a decode step (``perf.roofline``, as
  `archc roofline`), and each kernel's error against eager (``runtime.validation``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from archc.codegen.build import CodegenOptions
from archc.codegen.render import Generated, RenderedUnit, generate
from archc.gpus import GPU
from archc.ir import cost
from archc.ir.graph import Graph, Program
from archc.ir.lower import lower
from archc.ir.ops import COLLECTIVE, META, VIEW, Op
from archc.ir.ops.base import MATMUL, POINTWISE, RECURRENT, REDUCTION
from archc.ir.shapes import format_shape
from archc.ir.text import format_node
from archc.passes import run_pipeline
from archc.passes.decisions import changed
from archc.passes.decisions import grouped as grouped_decisions
from archc.passes.manager import PassStep, PipelineRun, step_diff
from archc.passes.measure import Stats, dims, kernels_per_layer, stats
from archc.perf.attention_tiles import attention_tiles
from archc.perf.roofline import decode_floor, grouped, kernels, per_step
from archc.report.facts import facts
from archc.report.layout import NODE_H, NODE_W, kernel_groups, place
from archc.spec import dump_yaml
from archc.spec.schema import Spec
from archc.versions import ARCHC

FORMAT = "archc-report/1"
# Op families the page colours by, first match wins (the op groups of archc.ir.ops)
FAMILIES: tuple[tuple[str, frozenset[Op]], ...] = (
    ("param", frozenset({Op.PARAM})), ("io", META), ("view", VIEW),
    ("attention", frozenset({Op.ATTENTION, Op.KV_CACHE, Op.REPEAT_KV})),
    ("recurrent", RECURRENT), ("collective", COLLECTIVE), ("matmul", MATMUL),
    ("reduction", REDUCTION), ("pointwise", POINTWISE))
GRAPH_GAP = 80               # px between the graphs of a program drawn side by side


def family(op: Op) -> str:
    """The colour family of an op: one of FAMILIES' names, or "other" (embedding, router)."""
    return next((name for name, ops in FAMILIES if op in ops), "other")


@dataclass(frozen=True)
class Options:
    """What a report is of and what it includes: the flags of `archc report`."""

    source: str
    dtype: str | None = None
    gpu: GPU | None = None             # the roofline's; None: no roofline
    prompt_len: int = 512              # the roofline's prefill, and the decode step after it
    new_tokens: int = 128
    target: str | None = None          # compile every kernel ahead of time for it
    jobs: int = 2


# ---- the spec -------------------------------------------------------------------------------

def spec_data(spec: Spec, quant: dict[str, str], program: Program) -> dict[str, Any]:
    """The spec as YAML, `archc show`'s rows, and the derived numbers as numbers."""
    empty = {"B": 1, "T": 1, "P": 0, "S": 1}
    return {
        "yaml": dump_yaml(spec),
        "facts": [[label, text] for label, text in facts(spec, quant) if text is not None],
        "numbers": {
            "parameters": cost.parameter_count(program),
            "weight_bytes": cost.parameter_bytes(program),
            "kv_cache_bytes_per_token": cost.kv_cache_bytes_per_token(program),
            "recurrent_state_bytes": cost.recurrent_state_bytes(program),
            "flops_per_token": {g.name: cost.graph_cost(g).at(empty)[0] for g in program},
            "layers": spec.layers + (spec.decoder_layers or 0),
        },
    }


# ---- the pipeline over the whole model ---------------------------------------------------------

def _stats(s: Stats) -> dict[str, Any]:
    return dataclasses.asdict(s)


def explain_data(step: PassStep) -> dict[str, Any]:
    """What a pass made and refused, grouped as `archc explain` groups them."""
    made, refused = grouped_decisions(list(step.decisions))
    return {
        "made": [{"rule": rule, "count": n, "note": note}
                 for (_, rule, note), n in made.items()],
        "refused": [{"rule": d.rule, "verdict": d.verdict, "reason": d.reason, "node": d.node,
                     "count": len(group), "graphs": list(dict.fromkeys(x.graph for x in group))}
                    for group in refused.values() for d in group[:1]],
    }


def pipeline_data(spec: Spec, run: PipelineRun, dtype: str) -> dict[str, Any]:
    """`archc passes`' table (at its default dims: one decode token, nothing cached) and
    `archc explain`'s data per pass."""
    at = dims()
    measured: dict[int, dict[str, Any]] = {}    # a pass that changed nothing returns its input

    def measure(p: Program) -> dict[str, Any]:
        if id(p) not in measured:
            measured[id(p)] = _stats(stats(p, at))
        return measured[id(p)]
    rows = [{"index": 0, "name": "lowered", "kind": "", "changed": "unfused",
             "stats": measure(run.initial), "explain": {"made": [], "refused": []}}]
    rows += [{"index": k, "name": step.name, "kind": step.kind, "changed": changed(step),
              "stats": measure(step.after), "explain": explain_data(step)}
             for k, step in enumerate(run.steps, 1)]
    before, after = kernels_per_layer(spec, [s.name for s in run.steps], dtype)
    return {"dims": at, "rows": rows, "kernels_per_block": [before, after]}


# ---- the graph drawn --------------------------------------------------------------------------

def period(spec: Spec) -> int:
    """Blocks in one period of the spec's layer types: the fewest blocks that show every kind
    of block, capped at the model's."""
    return min(len(spec.layer_plan()[1]), spec.layers)


def drawn_spec(spec: Spec) -> Spec:
    """The model cut to one period of blocks (each of an encoder-decoder's stacks)."""
    k = period(spec)
    decoder = None if spec.decoder_layers is None else min(k, spec.decoder_layers)
    return dataclasses.replace(spec, layers=k, decoder_layers=decoder)


def graph_data(g: Graph, left: int, units: Mapping[tuple[str, int], str]) -> dict[str, Any]:
    """One graph's nodes with their coordinates (shifted right by `left`), groups and, after
    the pipeline, the kernel each compute node runs as."""
    placed = place(g)
    groups = kernel_groups(g)
    nodes = []
    for i, n in enumerate(g.nodes):
        x, y = placed.xy[i]
        nodes.append({
            "id": i, "op": n.op.value, "family": family(n.op), "name": n.name,
            "shape": format_shape(n.dtype, n.shape), "text": format_node(i, n),
            "origin": n.origin, "passes": list(n.passes), "inputs": list(n.inputs),
            "x": x + left, "y": y, "group": groups.get(i), "kernel": units.get((g.name, i)),
        })
    return {"name": g.name, "left": left, "width": placed.width, "height": placed.height,
            "nodes": nodes}


def program_drawing(p: Program, units: Mapping[tuple[str, int], str]) -> dict[str, Any]:
    """Every graph of `p` laid out, side by side."""
    graphs, left = [], 0
    for g in p:
        graphs.append(graph_data(g, left, units))
        left += graphs[-1]["width"] + GRAPH_GAP
    return {"graphs": graphs, "width": max(left - GRAPH_GAP, NODE_W),
            "height": max((g["height"] for g in graphs), default=NODE_H),
            "nodes": sum(len(g) for g in p)}


def drawn_data(spec: Spec, dtype: str, quant: dict[str, str], pipeline: list[str],
               full_units: list[RenderedUnit], options: CodegenOptions) -> dict[str, Any]:
    """The graph of one period of blocks after lowering and after each pass: drawn anew where
    the pass changed it (else `same_as`, the step whose drawing it keeps), with the diff."""
    cut = drawn_spec(spec)
    run = run_pipeline(lower(cut, dtype, quant), pipeline)
    units = _matching_units(generate(run.program, options), full_units)
    steps = [{"name": "lowered", **program_drawing(run.initial, {}), "diff": ""}]
    last_drawn = 0
    for k, step in enumerate(run.steps, 1):
        final = k == len(run.steps)
        if step.changed or final:
            steps.append({"name": step.name, **program_drawing(step.after, units if final else {}),
                          "diff": step_diff(step)})
            last_drawn = k
        else:
            steps.append({"name": step.name, "same_as": last_drawn,
                          "nodes": sum(len(g) for g in step.after), "diff": ""})
    return {"layers": cut.layers + (cut.decoder_layers or 0),
            "of": spec.layers + (spec.decoder_layers or 0), "steps": steps}


def _body(u: RenderedUnit) -> tuple[str, str]:
    """A unit's family and source with its own name taken out: what two programs' units share
    when they are the same kernel."""
    return u.family, u.source.replace(u.name, "\0")


def _matching_units(drawn: Generated, full: list[RenderedUnit]) -> dict[tuple[str, int], str]:
    """(graph, node) of the drawn program → the name of the whole model's unit it renders to
    (the same text: units are deduplicated by it)."""
    by_body = {_body(u): u.name for u in full}
    return {(graph, i): by_body[_body(u)] for u in drawn.units if _body(u) in by_body
            for graph, i, _ in u.uses}


# ---- kernels, roofline, ahead-of-time, validation ----------------------------------------------

def kernels_data(gen: Generated) -> list[dict[str, Any]]:
    """Codegen's units: source, family, launches and the nodes each implements."""
    return [{"name": u.name, "family": u.family, "launches": len(u.uses), "source": u.source,
             "uses": [{"graph": g, "node": i, "text": text} for g, i, text in u.uses]}
            for u in gen.units]


def attention_data(program: Program, length: int, dtype: str) -> list[dict[str, Any]]:
    """Each attention kernel's score, mask and normalizer, and its tiles at `length` tokens."""
    return [{**dataclasses.asdict(a), "tiles": a.tiles, "visited": a.visited}
            for a in attention_tiles(program, length, dtype)]


def roofline_data(program: Program, gen: Generated, g: GPU, batch: int, prompt_len: int,
                  new_tokens: int) -> dict[str, Any]:
    """`archc roofline`'s rows for a prefill of `prompt_len` tokens and the last decode step
    of `new_tokens`, each row with the units that implement its kernels, and the decode floor."""
    units = {(graph, i): u.name for u in gen.units for graph, i, _ in u.uses}
    n, past = prompt_len, prompt_len + new_tokens - 1

    def rows(p: Program, at: dict[str, int]) -> dict[str, Any]:
        ks = kernels(p, at)
        # the units of each row: kernels keyed as `grouped` keys them, in its order
        names: dict[tuple[str, str, str], list[str]] = {}
        for k in ks:
            row = names.setdefault((k.graph, k.op, grouped([k], g)[0].label), [])
            unit = units.get((k.graph, k.index))
            if unit is not None and unit not in row:
                row.append(unit)
        return {"dims": at, "rows": [
            {"op": r.op, "label": r.label, "launches": r.launches, "flops": r.flops,
             "bytes": r.bytes, "intensity": r.intensity if r.bytes else None, "time": r.time,
             "bound": r.bound, "kernels": unit_names}
            for r, unit_names in zip(grouped(ks, g), names.values(), strict=True)]}

    out: dict[str, Any] = {
        "gpu": {"name": g.name, "peak_flops": g.peak_flops, "bandwidth": g.bandwidth,
                "ridge": g.ridge},
        "prefill": rows(program, {"B": batch, "T": n, "P": 0, "S": n})}
    if new_tokens:
        out["decode"] = rows(per_step(program), {"B": batch, "T": 1, "P": past, "S": n})
        out["floor"] = dataclasses.asdict(decode_floor(program, g, batch, past))
    return out


def aot_data(gen: Generated, target: str, jobs: int, cache_dir: Any) -> dict[str, Any]:
    """Every unit compiled ahead of time for `target` (`archc compile --target`)."""
    from archc.codegen.aot import compile_module
    from archc.codegen.render import write_module
    from archc.kernel_cache import default_cache_dir, used
    path = write_module(gen, (cache_dir or default_cache_dir()) / gen.digest[:24])
    used(path)
    results = compile_module(path, target, jobs=jobs)
    return {"target": target, "results": [{**dataclasses.asdict(r), "ok": r.ok}
                                          for r in results]}


def validation_data(report: Any) -> dict[str, Any]:
    """A ``runtime.validation.Report`` as data (`archc validate`)."""
    return {"model": report.model, "dtype": report.dtype, "tolerance": report.tolerance,
            "ok": report.ok,
            "kernels": [{**dataclasses.asdict(k), "relative": k.relative}
                        for k in report.kernels],
            "phases": [{**dataclasses.asdict(p), "relative": p.relative}
                       for p in report.phases]}


# ---- the whole report ---------------------------------------------------------------------------

def build(spec: Spec, quant: dict[str, str], options: Options, *,
          validate: Callable[[], Any] | None = None, cache_dir: Any = None) -> dict[str, Any]:
    """The report's data. `validate`: runs the validation (it needs the weights), or None."""
    dtype = options.dtype or spec.dtype
    lowered = lower(spec, dtype, quant)
    run = run_pipeline(lowered, "default")
    codegen = CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len)
    gen = generate(run.program, codegen)
    data: dict[str, Any] = {
        "format": FORMAT, "archc": ARCHC, "model": spec.name, "source": options.source,
        "dtype": dtype, "quantized": dict(sorted(Counter(quant.values()).items())),
        "spec": spec_data(spec, quant, lowered),
        "pipeline": pipeline_data(spec, run, dtype),
        "drawn": drawn_data(spec, dtype, quant, [s.name for s in run.steps], gen.units, codegen),
        "kernels": kernels_data(gen),
        "launches": gen.launches,
        "attention": attention_data(run.program, min(spec.max_seq_len, 4096), dtype),
        "roofline": None if options.gpu is None else roofline_data(
            run.program, gen, options.gpu, 1, options.prompt_len, options.new_tokens),
        "aot": None if options.target is None else aot_data(gen, options.target, options.jobs,
                                                             cache_dir),
        "validation": None if validate is None else validation_data(validate()),
    }
    return data


def _finite(value: Any) -> Any:
    """`value` with every infinite or NaN float as the string JavaScript's Number() reads
    ("Infinity", "NaN"): JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_json(data: dict[str, Any]) -> str:
    """The report's data as JSON text: what `--json` prints and the page embeds."""
    return json.dumps(_finite(data), indent=1, allow_nan=False)
