"""The package's floors: what may import what.

Every module stands on one floor; a module imports from its own floor or the floors below it,
never from one above, and no chain of imports comes back to where it started — counting the
imports inside functions and under ``TYPE_CHECKING``, which run (or type-check) as surely as the
top-level ones. Read from the source with ``ast``, so nothing is imported to find them. And every
module imports alone, in a process of its own: none relies on another having been imported
first.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "archc"

# The floors, lowest first: a module's floor is the longest prefix (below `archc.`) of its name
# listed here ("" is the package itself, whose `__init__` is the Python API).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base: errors, element types, versions, terminal, memory, the kernel cache, tokenizers",
     ("errors", "dtypes", "versions", "ui", "memory", "kernel_cache", "tokenizer", "gpus")),
    ("quantized values: schemes, QTensor, packing (an IR dtype may be a scheme)",
     ("quant",)),
    ("the expression language of attention's scores, masks and normalizers",
     ("ir.attrs", "ir.expr", "ir.modifiers")),
    ("the spec, its loader and the architecture steps", ("spec",)),
    ("the IR: op table, graph, lowering, text, verifier, costs", ("ir",)),
    ("passes, the manager, the shard pass and a rank's slices", ("passes",)),
    ("codegen: templates, the builder, ahead-of-time compiles", ("codegen",)),
    ("runtime: eager interpreter, triton backend, paged engine, communicators, process groups, "
     "devices and pricing", ("runtime", "dist", "devices")),
    ("the model: Model and CompiledModel, the walk of architecture steps", ("model", "modernize")),
    ("checkpoint sources (HF, GGUF, archc's own, quantized files)", ("sources",)),
    ("performance and the report: roofline, occupancy, benchmark, the report's data",
     ("perf", "report")),
    ("the Python API and the server", ("", "api", "serve")),
    ("the commands", ("commands",)),
    ("the command line", ("cli", "__main__")),
]

# (importer, imported) pairs allowed to run up a floor, each with its reason. At most one.
UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor(module: str) -> int:
    rest = module.removeprefix("archc").removeprefix(".")
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            named = rest == prefix or (prefix and rest.startswith(prefix + "."))
            if named and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{module} stands on no floor: add it to FLOORS")
    return best[0]


def _resolve(name: str) -> str | None:
    """The archc module an imported name lives in (a module, or a package's __init__)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> Iterator[tuple[str, int]]:
    """(archc module imported, line) for every import statement anywhere in `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from archc.passes import shard` imports the module archc.passes.shard
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.split(".")[0] == "archc" else None
            if target is not None and target != module:
                yield target, node.lineno


@functools.cache
def import_graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    for module in MODULES:
        for target, line in imports(module):
            g.add_edge(module, target, line=line)
    return g


def test_every_module_stands_on_a_floor() -> None:
    for module in MODULES:
        floor(module)


def test_no_import_cycles_counting_imports_inside_functions() -> None:
    g = import_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    shown = []
    for members in cycles:
        cycle = nx.find_cycle(g.subgraph(members))
        shown.append(" → ".join(f"{a} (line {g.edges[a, b]['line']})" for a, b in cycle))
    assert not cycles, "import cycles:\n" + "\n".join(shown)


def test_no_import_runs_up_a_floor() -> None:
    assert len(UPWARD) <= 1, "one upward import at most"
    g = import_graph()
    upward = [(a, b, g.edges[a, b]["line"]) for a, b in g.edges
              if floor(b) > floor(a) and (a, b) not in UPWARD]
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(
        f"{a}:{line} imports {b} ({FLOORS[floor(a)][0]} → {FLOORS[floor(b)][0]})"
        for a, b, line in upward)
    stale = [pair for pair in UPWARD if not g.has_edge(*pair)]
    assert not stale, f"allowed upward imports that no longer exist: {stale}"


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The parser sees an import inside a function, a relative one and one under
    TYPE_CHECKING; the floors put a runtime module above a pass."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from archc.model import Model\n"
                      "def f():\n    from archc.passes import shard\n    import archc.ir.lower\n")
    MODULES["archc.passes.probe"] = source
    try:
        found = {m for m, _ in imports("archc.passes.probe")}
    finally:
        del MODULES["archc.passes.probe"]
    assert found == {"archc.model", "archc.passes.shard", "archc.ir.lower"}
    assert floor("archc.runtime.eager") > floor("archc.passes.shard") > floor("archc.ir.graph")
    assert floor("archc.sources.quantized") > floor("archc.model") > floor("archc.quant.tensor")


# Importing any archc module first imports the package `archc`, whose __init__ (the Python API)
# runs to its end before the module is looked at: every fresh process starts from that state. So
# `import archc` is run once in a fresh process, and each module it did not import on the way is
# imported in a child forked from that process — the same as a fresh process, at a fork's cost.
# The third-party packages archc's modules import at their top are imported before the fork too:
# what is checked is archc's own order.
_CHILDREN = r"""
import importlib, os, sys, traceback  # noqa: E401
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
    except ImportError:     # an optional extra: the module that needs it says so itself
        pass
import archc  # noqa: F401  (what any import of an archc module runs first)
failed = []
for name in sys.argv[2:]:
    if name in sys.modules:     # imported by archc itself: it imports alone as archc does
        continue
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED:" + ",".join(failed))
"""


def third_party() -> list[str]:
    """The packages other than archc that archc's modules import at their top level."""
    found: set[str] = set()
    for path in MODULES.values():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module)
    return sorted(n for n in found if n.split(".")[0] not in ("archc", "__future__"))


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_every_module_imports_alone_in_a_fresh_process() -> None:
    modules = [m for m in MODULES if m != "archc.__main__"]   # __main__ runs the command line
    run = subprocess.run([sys.executable, "-c", _CHILDREN, ",".join(third_party()), *modules],
                         cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert last.startswith("FAILED:"), run.stderr[-3000:]
    failed = [m for m in last.removeprefix("FAILED:").split(",") if m]
    assert not failed, f"modules that do not import alone: {failed}\n{run.stderr[-3000:]}"
