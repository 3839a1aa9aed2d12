#!/usr/bin/env bash
# A rehearsal, on a CPU, of everything in bench/gpu_check.sh that does not need a GPU, with the
# GPU machine's software: Triton 3.6.0 and numpy >= 2.4 (that machine has Python 3.12, torch
# 2.11, triton 3.6.0, numpy 2.5, no network and nothing installable; a GPU lease is 15 minutes,
# so a check that breaks on its software should break here first). Steps, each timed, all run
# even when one fails:
#
#   software   the versions of Python, torch, Triton and numpy in use
#   scripts    bash -n of gpu_check.sh and this script; `gpu_check.sh --plan`
#   imports    every archc module (one that needs a package the GPU machine lacks, such as gguf
#              or fastapi, is listed, not failed), then the modules the stages run and
#              bench/serve_load.py, which must import
#   collect    `pytest --collect-only` of each test stage's selection (`gpu_check.sh
#              --selection`): each must collect, and select tests
#   compile    the ahead-of-time compile for sm_90a of what the bench stages run, with the
#              occupancy report's verdicts, every one of which must pass: llama3-8b in bf16 at
#              contexts 512 and 2048 (the headline), with int4 and int8 weights at 512 (the
#              quantized stage), tiny-llama3 in bf16 (the tiny stage); and the headline's
#              launch code with no-op kernels (`archc bench llama3-8b --layers 4 --host-time`)
#   dry-run    `gpu_check.sh --dry-run`: the stages at tiny shapes on the CPU. Its bench stages
#              run Triton's interpreter, which fails under triton 3.6.0 with numpy >= 2.4 (a
#              GPU run never uses it): where a probe of the interpreter fails, the dry run keeps
#              the stages that do not use it (tests, more-tests, serve) and says so
#
#   bench/rehearse.sh              build (or reuse) a virtual environment with triton 3.6.0,
#                                  numpy >= 2.4 and torch 2.13.0 (from the wheel on local disk),
#                                  and rehearse in it
#   bench/rehearse.sh --python PY  rehearse with an interpreter already set up (the project's
#                                  .venv, with triton 3.9.0)
#
# Takes, on 2 shared CPU cores (an AMD EPYC): about 7 minutes with triton 3.6.0 in a reused
# environment (building it first adds the time to install torch from disk and download triton,
# a minute or two here), about 12 with triton 3.9.0 (the dry run's bench stages run under the
# interpreter there). The compiles go to a fresh kernel cache each run.
#
# Environment: ARCHC_REHEARSE_VENV (where the environment is built; default
# ~/.cache/archc/rehearse-triton-3.6.0), ARCHC_REHEARSE_BASE_PYTHON (the interpreter it is built
# from, default python3: torch's wheel on disk is for its version), ARCHC_REHEARSE_TORCH (default
# torch==2.13.0), ARCHC_REHEARSE_LOGS (where each step's output goes; default a temporary
# directory).

set -u
set -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
TRITON_WANTED="3.6.0"
PY=""
case "${1:-}" in
    "") ;;
    --python)
        PY="${2:?--python needs an interpreter}"
        [[ "$#" == 2 ]] || { echo "usage: $0 [--python PY]" >&2; exit 2; } ;;
    *) echo "usage: $0 [--python PY]" >&2; exit 2 ;;
esac
LOGS="${ARCHC_REHEARSE_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/archc-rehearse.XXXXXX")}"
mkdir -p "$LOGS" || exit 2
CACHE="$LOGS/kernel-cache"
SECONDS=0
RESULTS=()
FAILED=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET

note() { printf '[%4ds] %s\n' "$SECONDS" "$*"; }

# ---- the environment -------------------------------------------------------------------------
if [[ -z "$PY" ]]; then
    VENV="${ARCHC_REHEARSE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/archc/rehearse-triton-$TRITON_WANTED}"
    PY="$VENV/bin/python"
    check_venv="import numpy, triton; v = tuple(map(int, numpy.__version__.split('.')[:2])); \
assert triton.__version__ == '$TRITON_WANTED' and v >= (2, 4), (triton.__version__, v)"
    if [[ -x "$PY" ]] && "$PY" -c "$check_venv" > /dev/null 2>&1; then
        note "environment: reusing $VENV"
    else
        note "environment: building $VENV"
        "${ARCHC_REHEARSE_BASE_PYTHON:-python3}" -m venv --clear "$VENV" || exit 2
        # the GPU machine's packages that archc and the check use, at its versions where they
        # matter; torch pinned, so pip takes the wheel on local disk
        "$PY" -m pip install --quiet "${ARCHC_REHEARSE_TORCH:-torch==2.13.0}" \
            "triton==$TRITON_WANTED" "numpy>=2.4" networkx jinja2 sympy pyyaml rich pygments \
            safetensors pytest pytest-xdist pytest-timeout hypothesis httpx \
            > "$LOGS/pip.log" 2>&1 || { note "pip failed: see $LOGS/pip.log"; exit 2; }
        "$PY" -c "$check_venv" || exit 2
    fi
fi

# step NAME COMMAND...: run COMMAND, its output to $LOGS/NAME.log; the result to the table
step() {
    local name="$1" start=$SECONDS rc=0
    shift
    note "$name …"
    "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
    local status="ok"
    (( rc == 0 )) || { status="FAILED (exit $rc)"; FAILED=1; }
    RESULTS+=("$(printf '%-10s %-18s %4ss  %s' "$name" "$status" "$(( SECONDS - start ))" \
                "$LOGS/$name.log")")
    note "$name: $status in $(( SECONDS - start ))s"
    (( rc == 0 )) || tail -n 15 "$LOGS/$name.log" | sed 's/^/    /'
}

software() {
    "$PY" -m archc.versions
    "$PY" -c 'import numpy; print("numpy", numpy.__version__)'
}

scripts() {
    bash -n bench/gpu_check.sh && bash -n bench/rehearse.sh && PYTHON="$PY" bench/gpu_check.sh --plan
}

IMPORTS_PY="$(cat <<'EOF'
import importlib, importlib.util, pkgutil, sys
import archc
# packages of archc's extras the GPU machine does not have: a module that needs one is listed
OPTIONAL = {"gguf", "fastapi", "uvicorn", "transformers", "tokenizers", "openai", "matplotlib",
            "playwright"}
# what the stages run: archc bench (its tables, JSON, summary), the triton backend, tuning and
# the ahead-of-time compile, the serving engine of bench/serve_load.py, Triton's timer
STAGES = ["archc.cli", "archc.commands.bench", "archc.perf.bench", "archc.perf.baselines",
          "archc.perf.summary", "archc.versions", "archc.runtime.triton_backend",
          "archc.runtime.tuning", "archc.codegen.aot", "archc.codegen.aot_worker",
          "archc.serve.engine", "archc.serve.scheduler", "triton.testing"]
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
    except Exception as err:
        failed.append(f"{info.name}: {type(err).__name__}: {err}")
for name in STAGES:
    try:
        importlib.import_module(name)
    except Exception as err:
        failed.append(f"{name} (a stage runs it): {type(err).__name__}: {err}")
spec = importlib.util.spec_from_file_location("serve_load", "bench/serve_load.py")
try:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
except Exception as err:
    failed.append(f"bench/serve_load.py: {type(err).__name__}: {err}")
print(f"{n} archc modules; {len(STAGES)} modules the stages run, and bench/serve_load.py")
for line in optional:
    print("not on the GPU machine either:", line)
for line in failed:
    print("FAILED:", line)
sys.exit(1 if failed else 0)
EOF
)"

imports() { "$PY" -c "$IMPORTS_PY"; }

# collect: each test stage's selection collects, and selects tests
collect() {
    local selection short tests
    selection="$(PYTHON="$PY" bench/gpu_check.sh --selection)" || return 1
    short="$(sed -n 's/^short: //p' <<< "$selection")"
    read -r -a tests <<< "$(sed -n 's/^tests: //p' <<< "$selection")"
    echo "== tests: -m 'not slow' -k '$short'"
    "$PY" -m pytest --collect-only -q -p no:cacheprovider -m "not slow" -k "$short" \
        "${tests[@]}" || return 1
    echo "== more-tests: -k 'not ($short)'"
    "$PY" -m pytest --collect-only -q -p no:cacheprovider -k "not ($short)" "${tests[@]}"
}

# occupancy ARGS...: `archc compile ARGS --target sm_90a --occupancy`; a FAIL verdict fails
occupancy() {
    local out rc=0
    out="$("$PY" -m archc.cli compile "$@" --target sm_90a --occupancy --cache-dir "$CACHE" \
           2>&1)" || rc=$?
    printf '%s\n' "$out"
    (( rc == 0 )) || return "$rc"
    if grep -q ': FAIL ' <<< "$out"; then
        echo "== a verdict fails: $*"
        return 1
    fi
}

compile() {
    local rc=0
    echo "== llama3-8b, bf16 (the headline)"
    occupancy llama3-8b --context 512 2048 || rc=1
    for kind in int4 int8; do
        echo "== llama3-8b, $kind weights (the quantized stage)"
        occupancy llama3-8b --quantize "$kind" --context 512 || rc=1
    done
    echo "== tiny-llama3, bf16 (the tiny stage)"
    "$PY" -m archc.cli compile tiny-llama3 --dtype bf16 --target sm_90a --cache-dir "$CACHE" \
        || rc=1
    echo "== the headline's launch code, every kernel a no-op"
    "$PY" -m archc.cli bench llama3-8b --layers 4 --host-time --new-tokens 50 \
        --cache-dir "$CACHE" || rc=1
    return "$rc"
}

# dry_run: gpu_check.sh --dry-run; its bench stages only where Triton's interpreter runs
dry_run() {
    local probe='import archc, torch
archc.load("tiny-llama3").compile("triton", device="cpu", cache_dir="'"$CACHE"'")(
    torch.zeros(1, 3, dtype=torch.long))'
    local stages=""
    if ! "$PY" -c "$probe" > "$LOGS/interpreter-probe.log" 2>&1; then
        stages="tests more-tests serve"
        echo "Triton's interpreter fails here ($(tail -n 1 "$LOGS/interpreter-probe.log")):"
        echo "the dry run keeps the stages that do not use it: $stages"
    fi
    PYTHON="$PY" ARCHC_GPU_CHECK_STAGES="$stages" ARCHC_GPU_CHECK_RESULTS="$LOGS/dry-run" \
        bench/gpu_check.sh --dry-run
}

step software software
step scripts scripts
step imports imports
step collect collect
step compile compile
step dry-run dry_run

echo
echo "rehearsal of bench/gpu_check.sh's software, $(date -u '+%Y-%m-%d %H:%M UTC'):" \
     "$("$PY" -m archc.versions 2>/dev/null)"
printf '  %s\n' "${RESULTS[@]}"
if (( FAILED )); then
    echo "SOME STEPS FAILED (${SECONDS}s)"
    exit 1
fi
echo "every step passed (${SECONDS}s)"
