"""The steps of bench/rehearse.sh that read the GPU check's own stage arguments
(`bench/gpu_check.sh --args`: one line per command, `STAGE<TAB>KIND<TAB>ARG…`, KIND bench, pytest
or serve), so that the rehearsal checks exactly what a GPU run will run:

    python bench/rehearse.py imports
    python bench/rehearse.py arguments ARGS_FILE     every bench command's arguments pass
                                                     archc bench's checks (on a CPU it then
                                                     refuses for want of a GPU, and only so);
                                                     serve_load's parse
    python bench/rehearse.py collect ARGS_FILE       each pytest selection collects tests
    python bench/rehearse.py compile ARGS_FILE DIR   the ahead-of-time compile of what each bench
                                                     command runs, for sm_90a, with the
                                                     occupancy verdicts (every one must pass),
                                                     and the headline's launch code with no-op
                                                     kernels; DIR: a kernel cache

Each prints what it did and exits 1 when something failed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# packages of archc's extras the GPU machine does not have: a module that needs one is listed
OPTIONAL = {"gguf", "fastapi", "uvicorn", "transformers", "tokenizers", "openai", "matplotlib",
            "playwright"}
# what the stages run beyond archc bench's own imports: the triton backend, tuning and the
# ahead-of-time compile, the serving engine of bench/serve_load.py, Triton's timer
STAGES = ["archc.cli", "archc.commands.bench", "archc.perf.bench", "archc.perf.baselines",
          "archc.perf.summary", "archc.versions", "archc.runtime.triton_backend",
          "archc.runtime.tuning", "archc.codegen.aot", "archc.codegen.aot_worker",
          "archc.serve.engine", "archc.serve.scheduler", "triton.testing"]
NO_GPU = "no CUDA GPU here"


def commands(path: str, kind: str) -> Iterator[tuple[str, list[str]]]:
    """(stage, arguments) of each line of `path` of that kind."""
    for line in Path(path).read_text().splitlines():
        stage, what, *args = line.split("\t")
        if what == kind:
            yield stage, args


def serve_load():  # noqa: ANN201 — the module
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "bench" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imports() -> list[str]:
    """Every archc module, the modules the stages run, and bench/serve_load.py."""
    import archc
    failed, optional, n = [], [], 0
    for info in pkgutil.walk_packages(archc.__path__, "archc."):
        if info.name.endswith("__main__"):
            continue
        n += 1
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as err:
            root = (err.name or "").split(".")[0]
            (optional if root in OPTIONAL else failed).append(f"{info.name}: {err}")
        except Exception as err:  # noqa: BLE001 — reported
            failed.append(f"{info.name}: {type(err).__name__}: {err}")
    for name in STAGES:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001
            failed.append(f"{name} (a stage runs it): {type(err).__name__}: {err}")
    try:
        serve_load()
    except Exception as err:  # noqa: BLE001
        failed.append(f"bench/serve_load.py: {type(err).__name__}: {err}")
    print(f"{n} archc modules, {len(STAGES)} modules the stages run, bench/serve_load.py")
    for line in optional:
        print("not on the GPU machine either:", line)
    return failed


def arguments(path: str) -> list[str]:
    """archc bench checks every argument before it looks for a GPU: on a CPU, a command whose
    arguments are right is refused for want of one, and for nothing else."""
    import torch

    from archc.cli import main
    failed = []
    if torch.cuda.is_available():
        print("a CUDA GPU is here: the bench commands' arguments are checked by running them")
    for stage, args in () if torch.cuda.is_available() else commands(path, "bench"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(["bench", *args])
        said = (err.getvalue().strip().splitlines() or [""])[-1]
        ok = status == 2 and NO_GPU in said
        print(f"{stage}: archc bench {' '.join(args)}\n  {'ok' if ok else 'FAILED'}: {said}")
        if not ok:
            failed.append(f"{stage}: {said}")
    from archc.perf.bench import keep_layers
    from archc.spec import load_spec
    for stage, args in commands(path, "serve"):
        try:
            parsed = serve_load().parse_args(args)
            keep_layers(load_spec(parsed.source), parsed.layers)
            print(f"{stage}: serve_load.py {' '.join(args)}\n  ok")
        except (Exception, SystemExit) as err:  # noqa: BLE001 — argparse exits
            failed.append(f"{stage}: serve_load.py {' '.join(args)}: {err}")
    return failed


def collect(path: str) -> list[str]:
    failed = []
    for stage, args in commands(path, "pytest"):
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                              "-p", "no:cacheprovider", *args], capture_output=True, text=True,
                             timeout=600)
        last = (run.stdout.strip().splitlines() or [""])[-1]
        print(f"{stage}: pytest {' '.join(args)}\n  {last}")
        if run.returncode != 0:   # 5: nothing selected
            failed.append(f"{stage}: pytest --collect-only exit {run.returncode}: {last}")
            print(run.stdout[-3000:] + run.stderr[-3000:])
    return failed


def compile_all(path: str, cache: str) -> list[str]:
    """One occupancy report per (model, dtype, quantization) the bench commands run, at every
    prefill length and context they use."""
    from archc.cli import build_parser
    from archc.commands.bench import GPU_RUN
    reports: dict[tuple[str, ...], set[int]] = {}
    headline = None
    for _, args in commands(path, "bench"):
        a = build_parser().parse_args(["bench", *args])
        key = (a.source, *(("--dtype", a.dtype) if a.dtype else ()),
               *(("--quantize", a.quantize) if a.quantize else ()),
               *(("--group", str(a.group)) if a.group else ()))
        reports.setdefault(key, set()).update({a.prompt_len or GPU_RUN["prompt"], *a.contexts})
        headline = headline or (a.source, a.layers)
    failed = []
    for (source, *flags), contexts in reports.items():
        argv = [source, *flags, "--target", "sm_90a", "--occupancy", "--context",
                *map(str, sorted(contexts)), "--cache-dir", cache]
        print(f"== archc compile {' '.join(argv)}", flush=True)
        run = subprocess.run([sys.executable, "-m", "archc.cli", "compile", *argv],
                             capture_output=True, text=True, timeout=1800)
        print(run.stdout + run.stderr, flush=True)
        verdicts = [line for line in run.stdout.splitlines() if ": FAIL " in line]
        if run.returncode != 0 or verdicts:
            failed.append(f"archc compile {' '.join(argv[:-2])}: exit {run.returncode}, "
                          f"{len(verdicts)} verdicts FAIL")
    if headline is not None:    # the headline's launch code, every kernel a no-op
        source, layers = headline
        argv = [source, *(("--layers", str(layers)) if layers else ()), "--host-time",
                "--new-tokens", "50", "--cache-dir", cache]
        print(f"== archc bench {' '.join(argv)}", flush=True)
        run = subprocess.run([sys.executable, "-m", "archc.cli", "bench", *argv],
                             capture_output=True, text=True, timeout=600)
        print(run.stdout + run.stderr, flush=True)
        if run.returncode != 0:
            failed.append(f"archc bench {' '.join(argv[:-2])}: exit {run.returncode}")
    return failed


def main(argv: list[str]) -> int:
    steps = {"imports": imports, "arguments": arguments, "collect": collect,
             "compile": compile_all}
    if not argv or argv[0] not in steps:
        print(__doc__, file=sys.stderr)
        return 2
    failed = steps[argv[0]](*argv[1:])
    for line in failed:
        print("FAILED:", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
