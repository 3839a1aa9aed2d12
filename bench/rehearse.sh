#!/usr/bin/env bash
# A rehearsal, on a CPU, of everything in bench/gpu_check.sh that does not need a GPU, with the
# GPU machine's software: Triton 3.6.0 and numpy >= 2.4 (that machine has Python 3.12, torch
# 2.11, triton 3.6.0, numpy 2.5, no network and nothing installable; a GPU lease is 15 minutes,
# so a check that breaks on its software should break here first). The steps (the work of most
# is bench/rehearse.py's), each timed, all run even when one fails:
#
#   software   the versions of Python, torch, Triton and numpy in use
#   scripts    bash -n of gpu_check.sh and this script; `gpu_check.sh --plan`
#   imports    every archc module (one that needs a package the GPU machine lacks, such as gguf
#              or fastapi, is listed, not failed), then the modules the stages run and
#              bench/serve_load.py, which must import
#   arguments  every command of the stages, as `gpu_check.sh --args` gives them: archc bench
#              checks all its arguments before it looks for a GPU, so each bench command must
#              be refused here for want of one and for nothing else; serve_load.py's parse
#   collect    `pytest --collect-only` of each test stage's selection: each must select tests
#   compile    the ahead-of-time compile for sm_90a of what each bench command runs, with the
#              occupancy report's verdicts, every one of which must pass — llama3-8b in bf16 at
#              the prefill lengths and contexts the headline, autotune and max-autotune stages
#              use, with int4 and int8 weights (the quantized stage), tiny-llama3 in bf16 —
#              and the headline's launch code with no-op kernels (`archc bench llama3-8b
#              --layers 4 --host-time`)
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
# Takes, measured on 2 CPU cores of an AMD EPYC shared with other work (load average 4 to 5):
# 4 minutes with triton 3.6.0 in an environment built before; 8 from a clean clone, 3 of them to
# build the environment (torch from the wheel on disk, triton downloaded); 5 with triton 3.9.0,
# whose interpreter runs the dry run's bench stages. The compiles go to a fresh kernel cache
# each run.
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
    bash -n bench/gpu_check.sh && bash -n bench/rehearse.sh && bench/gpu_check.sh --plan
}

# the stages' own arguments, as a GPU run makes them: what the next steps check
ARGS="$LOGS/stage-args.tsv"
bench/gpu_check.sh --args > "$ARGS" || { echo "gpu_check.sh --args failed" >&2; exit 2; }

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
step imports "$PY" bench/rehearse.py imports
step arguments "$PY" bench/rehearse.py arguments "$ARGS"
step collect "$PY" bench/rehearse.py collect "$ARGS"
step compile "$PY" bench/rehearse.py compile "$ARGS" "$CACHE"
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
