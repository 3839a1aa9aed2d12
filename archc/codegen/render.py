"""Rendering a kernel-level program into one readable Python module of Triton kernels.

1. ``build.build`` turns every compute node into a template and its values; templates render
   with ``StrictUndefined``, so a missing value is an error, never an empty string.
2. Units are deduplicated by their rendered text: identical layers share one kernel. Names follow
   first use (``fused_linear_0``, ``attention_1``, …).
3. The module holds each unit headed by the IR nodes it implements, a ``KERNELS`` table (family,
   static sizes, argument types) and a ``run_<graph>`` per graph that calls the units' launchers
   in order; launchers (``templates/launch.j2``) record their launches with ``d.launch`` for the
   runtime to replay (``archc.runtime.launch``).

The module is written to a cache directory keyed by a hash of the program text and the options,
and imported from there (Triton reads kernel source from the file).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import jinja2

from archc.codegen.build import CodegenOptions, JitKernel, NodeCtx, build, collective_call
from archc.codegen.layout import CodegenError, layouts
from archc.ir.expr import act_code, tanh_code
from archc.ir.graph import Graph, Program
from archc.ir.ops import COLLECTIVE
from archc.ir.text import format_node, format_program
from archc.ir.verify import verify, verify_graph
from archc.versions import ARCHC

TEMPLATES = Path(__file__).parent / "templates"
StoreSpec = tuple[tuple[int, ...], str]     # a KV cache's or recurrent state's shape after B, dtype
PLACEHOLDER = "__KERNEL__"


def _raise(message: str) -> None:
    raise CodegenError(f"template error: {message}")


ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
    trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
ENV.globals.update({"raise": _raise, "act": act_code, "tanh": tanh_code})


@dataclass
class RenderedUnit:
    name: str
    family: str
    source: str
    kernels: list[JitKernel]
    uses: list[tuple[str, int, str]] = field(default_factory=list)  # (graph, node id, text)
    # kernel suffix → the distinct values of its constexpr sizes over the uses, in first-use
    # order (JitKernel.static): one Triton specialization each
    static: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    helpers: tuple[str, ...] = ()

    def specialize(self, kernels: list[JitKernel]) -> None:
        """Note a use's constexpr sizes (its kernels, as `kernels` lists them)."""
        for k in kernels:
            seen = self.static.setdefault(k.suffix, [])
            if k.static and k.static not in seen:
                seen.append(k.static)


@dataclass
class Step:
    node: str          # the IR node, as text
    call: str          # the launch statement
    unit: str          # the unit's name ("" for a host step: a collective)


@dataclass
class Generated:
    """A rendered program: module source, units, per-graph launch steps."""

    model: str
    source: str
    digest: str
    units: list[RenderedUnit]
    steps: dict[str, list[Step]]
    # "cache" | "state" → (layer, kind) → shape and dtype of each KV cache and recurrent state
    stores: dict[str, dict[tuple[int, str], StoreSpec]]
    variants: tuple[str, ...] = ()     # run functions of graphs besides the program's
    helpers: dict[str, str] = field(default_factory=dict)   # module-level helpers' source

    @property
    def launches(self) -> int:
        """Launches of one pass over the program's graphs (its variants aside)."""
        return sum(1 for run, s in self.steps.items() if run not in self.variants
                   for step in s if step.unit)

    @property
    def program_steps(self) -> dict[str, list[Step]]:
        """The steps of the program's graphs, by graph (its variants aside)."""
        return {run: s for run, s in self.steps.items() if run not in self.variants}

    @property
    def program_units(self) -> int:
        """Unique kernels the program's graphs launch (a variant's own aside)."""
        return len({step.unit for s in self.program_steps.values() for step in s if step.unit})

    def unit(self, name: str) -> RenderedUnit:
        return next(u for u in self.units if u.name == name)

    def unit_text(self, name: str) -> str:
        """One unit's source, headed by the IR nodes it implements, as in the module, then the
        module's helpers it calls."""
        u = self.unit(name)
        header = "".join(f"# {line}\n" for line in _header(u.uses))
        uses = f"{len(u.uses)} launch" + ("es" if len(u.uses) != 1 else "")
        return f"# {u.name} ({u.family}): {uses}\n{header}{u.source.rstrip()}\n" + "".join(
            f"\n\n# {h} (a helper of the module)\n{self.helpers[h]}\n" for h in u.helpers)


# A hash of the templates and the code that fills them: a change to either is a new module, never
# a stale one from the cache.
_FINGERPRINT = hashlib.sha256(ARCHC.encode() + b"".join(
    p.name.encode() + p.read_bytes() for p in sorted([*TEMPLATES.glob("*.j2"), *(
        TEMPLATES.parent / f"{name}.py" for name in ("build", "render", "layout", "printer"))])
)).hexdigest()


def _header(uses: list[tuple[str, int, str]]) -> list[str]:
    graph, _, first = uses[0]
    lines = [f"implements {graph} {first}"]
    if len(uses) > 1:
        others = ", ".join(f"{g} %{i}" for g, i, _ in uses[1:])
        lines += textwrap.wrap(f"and the same node in {others}", 96)
    return [_comment_safe(s) for s in lines]


def _comment_safe(text: str) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def generate(program: Program, options: CodegenOptions,
             variants: Mapping[str, Graph] | None = None) -> Generated:
    """Render every compute node of `program` (kernel-level, verified first) into one module;
    `variants` adds graphs the runtime runs besides the program's, by the name of their run
    function (the decoder's last-token-logits variant, ``LAST_TOKEN``): their nodes share the
    program's kernels wherever they render alike."""
    verify(program)
    runs = [(g.name, g) for g in program] + list((variants or {}).items())
    for _, g in runs[len(program.graphs):]:
        verify_graph(g)
    by_text: dict[tuple[str, str], RenderedUnit] = {}
    units: list[RenderedUnit] = []
    counters: Counter[str] = Counter()
    steps: dict[str, list[Step]] = {}
    stores: dict[str, dict[tuple[int, str], StoreSpec]] = {"cache": {}, "state": {}}
    for run, g in runs:
        lays = layouts(g)
        steps[run] = []
        for i in g.compute_ids():
            ctx = NodeCtx(g, i, lays, options)
            if g.nodes[i].op in COLLECTIVE:   # a host step between launches, not a kernel
                steps[run].append(Step(_comment_safe(format_node(i, g.nodes[i])),
                                       collective_call(ctx), ""))
                continue
            unit = build(ctx)
            for what, layer, kind, shape, dtype in ctx.stored:
                other = stores[what].setdefault((layer, kind), (shape, dtype))
                if other != (shape, dtype):
                    raise CodegenError(f"layer {layer}'s {kind} {what} is {other[1]}"
                                       f"{list(other[0])} in one kernel and {dtype}{list(shape)} "
                                       "in another")
            try:
                text = ENV.get_template(unit.template).render(name=PLACEHOLDER, **unit.context)
            except jinja2.UndefinedError as err:
                raise CodegenError(f"template {unit.template}: {err}") from None
            ru = by_text.get((unit.template, text))
            if ru is None:
                name = f"{unit.family}_{counters[unit.family]}"
                counters[unit.family] += 1
                ru = by_text[(unit.template, text)] = RenderedUnit(
                    name, unit.family, text.replace(PLACEHOLDER, name), unit.kernels,
                    helpers=unit.helpers)
                units.append(ru)
            ru.specialize(unit.kernels)
            node_text = format_node(i, g.nodes[i])
            ru.uses.append((run, i, node_text))
            steps[run].append(Step(_comment_safe(node_text), f"{ru.name}(d, {unit.call})",
                                   ru.name))
    text = format_program(program) + "".join(
        f"\n{run}: {format_program(Program(program.model, (g,)))}"
        for run, g in runs[len(program.graphs):])
    digest = hashlib.sha256(f"{text}\n{options.key()}\n{_FINGERPRINT}".encode()).hexdigest()
    kernels = [dict(name=u.name, family=u.family, uses=u.uses, header=_header(u.uses),
                    source=u.source.rstrip("\n"), entries=[
                        f"{u.name + k.suffix!r}: {_entry(u, k)!r}" for k in u.kernels])
               for u in units]
    helpers = {h: ENV.get_template(f"{h}.py.j2").render().strip("\n")
               for h in dict.fromkeys(h for u in units for h in u.helpers)}
    graphs = [dict(name=run, steps=steps[run],
                   launches=sum(1 for s in steps[run] if s.unit),
                   hosted=sum(1 for s in steps[run] if not s.unit),
                   unique=len({s.unit for s in steps[run] if s.unit}))
              for run, _ in runs]
    source = ENV.get_template("module.py.j2").render(
        version=ARCHC, model=program.model, kernels=kernels, helpers=list(helpers.values()),
        graphs=graphs,
        launches=sum(1 for g in program for step in steps[g.name] if step.unit),
        options=options.key(),
        graph_hash=digest[:16])
    return Generated(program.model, source, digest, units, steps, stores,
                     tuple(run for run, _ in runs[len(program.graphs):]), helpers)


def _entry(u: RenderedUnit, k: JitKernel) -> dict[str, object]:
    """A kernel's KERNELS entry: family, unit, the sizes of its first use, and — for a kernel
    with constexpr sizes — their values at every use (`static`), each a specialization to
    compile ahead of time; then the types of its runtime arguments."""
    entry: dict[str, object] = dict(family=k.family, unit=u.name, sizes=k.sizes)
    if u.static.get(k.suffix):
        entry["static"] = u.static[k.suffix]
    return {**entry, "types": k.types}


def write_module(gen: Generated, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', gen.model)[:80] or 'model'}.py"
    if not path.exists() or path.read_text() != gen.source:
        # a file of this process's and thread's own, then renamed into place: ranks started
        # together (processes, or simulated ranks' threads) write the same module at once
        tmp = path.with_suffix(f".py.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(gen.source)
        tmp.replace(path)
    return path


_LOADED: dict[str, ModuleType] = {}


def load_module(path: Path, key: str) -> ModuleType:
    """Import the module at `path` once per `key` and source text (Triton reads the kernels'
    source from the file)."""
    key += hashlib.sha256(path.read_bytes()).hexdigest()
    if key not in _LOADED:
        name = f"archc_generated_{key[:16]}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None   # a .py file always has one
        _LOADED[key] = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_LOADED[key])
    return _LOADED[key]

