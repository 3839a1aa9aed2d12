#!/usr/bin/env bash
# The GPU check: the GPU-relevant tests on the GPU (f32, f16 and bf16), then `archc bench` for
# tiny-llama3 and for llama3-8b (its first blocks), dense and with its weights quantized (int4,
# int8), in at most 9½ minutes, with no network. The
# llama3-8b bench measures prefill at 2048 tokens: each fused matmul against torch.matmul on the
# same GEMM and against the unfused sequence, attention against scaled_dot_product_attention and,
# in TFLOP/s, against FlashAttention-3's published forward figure, and (autotuning on) the
# autotune cache's first-run cost; and batch-1 decode at contexts 512 and 2048 (`--contexts`):
# archc's tokens/s against the bandwidth bound of the blocks kept and the head, against
# torch.compile in the same run, and decode attention against a copy of the same KV bytes.
# Quantized (`--quantize int4`, then `int8`): batch-1 decode of the quantized model against the
# decode floor of its quantized bytes and against the bf16 model's floor.
#
#   bench/gpu_check.sh              on a machine with a CUDA GPU, torch and triton
#   bench/gpu_check.sh --dry-run    the same stages on a CPU: a small test selection and
#                                   `archc bench --dry-run` (checks this script, measures nothing)
#
# Each stage runs under its own time limit, and a stage that fails or runs out of time does not
# stop the next. Results go to bench/results/ (a temporary directory in a dry run), named
# <UTC date>_<GPU>_<what>; when $OUT is set, the summary and an archive of them all
# (<prefix>_results.tar.gz) go there:
#   *_summary.txt    what ran, what failed, the headline numbers (decode at each context, the
#                    prefill kernels against their bounds, the autotune first-run cost, the
#                    goals)                                          (read this first)
#   *_tests.log      pytest output;  *_tests.xml  its JUnit report (when pytest finished)
#   *_<spec>.json    the bench report (saved after every section, so a cut run keeps its part)
#   *_<spec>.log     the bench tables and progress lines
#   *_<spec>-int4.json, *_<spec>-int8.json, *_<spec>-quantized.log   the quantized benches
#   *_serve.json, *_serve.log   continuous batching: N streams together against one at a time
#                    (bench/serve_load.py, the paged engine on the triton backend)
#
# Optional environment: PYTHON (default python3), OUT, ARCHC_GPU_CHECK_RESULTS (results
# directory), ARCHC_GPU_CHECK_TESTS (pytest selection, space-separated), ARCHC_GPU_CHECK_BUDGET
# (total seconds, default 560), ARCHC_GPU_CHECK_BUDGET_TESTS / _TINY / _BIG / _QUANT / _SERVE
# (each stage's limit, default 140 / 50 / 240 / 80 / 60, cut to what is left of the total),
# ARCHC_GPU_CHECK_LAYERS
# (llama3-8b blocks kept, default 4), ARCHC_BENCH_EXTRA (extra flags for every `archc bench`).

set -u
set -o pipefail

DRY_RUN=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY_RUN=1 ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
BUDGET="${ARCHC_GPU_CHECK_BUDGET:-560}"     # seconds for everything, the summary included
RESERVE=15                                  # kept back for the summary and copies
GRACE=10                                    # a stage gets TERM, then KILL this much later
LAYERS="${ARCHC_GPU_CHECK_LAYERS:-4}"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
SECONDS=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1

if [[ "$DRY_RUN" == 1 ]]; then
    GPU_NAME="cpu dry run"
    RESULTS="${ARCHC_GPU_CHECK_RESULTS:-$(mktemp -d "${TMPDIR:-/tmp}/archc-gpu-check.XXXXXX")}"
    read -r -a TESTS <<< "${ARCHC_GPU_CHECK_TESTS:-tests/test_roofline.py}"
    BENCH_FLAGS=(--dry-run)
    TINY_ARGS=(tiny-llama3 --prompt-len 8 --new-tokens 4)
    BIG_SPEC="tiny-mistral"
    # contexts past the prompt, the second past tiny-mistral's window of 8
    BIG_ARGS=(tiny-mistral --layers 1 --prompt-len 8 --new-tokens 4 --contexts 12 20)
    QUANT_ARGS=(tiny-mistral --layers 1 --prompt-len 8 --new-tokens 4 --no-kernels
                --compile-modes none)
    SERVE_ARGS=(tiny-llama3 --streams 4 --prompt-len 6 --new-tokens 4)
    BUDGETS=(120 90 90 90 90)
else
    # archc chooses Triton's interpreter only for a CPU device; a stray setting would stop it
    unset TRITON_INTERPRET
    GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
    if [[ -z "$GPU_NAME" ]]; then
        GPU_NAME="$(timeout 60 "$PY" -c 'import torch; print(torch.cuda.get_device_name())' \
                    2>/dev/null | tail -n 1)"
    fi
    GPU_NAME="${GPU_NAME:-unknown gpu}"
    RESULTS="${ARCHC_GPU_CHECK_RESULTS:-$ROOT/bench/results}"
    # Tests whose kernels run on the GPU when there is one (f32, f16 and bf16). Not
    # tests/test_triton_validate.py: it validates on the CPU, and Triton's interpreter, once
    # chosen, is the process's for good — it cannot share a pytest worker with GPU tests.
    # The split-K, decode-attention and MoE tests come first: their last-arriving programs
    # reduce the others' partial sums through atomics, a race only a GPU can show.
    read -r -a TESTS <<< "${ARCHC_GPU_CHECK_TESTS:-tests/test_splitk.py \
tests/test_decode_attention.py tests/test_moe_kernels.py tests/test_triton_kernels.py \
tests/test_triton_recurrent.py tests/test_triton_models.py tests/test_triton_gguf.py \
tests/test_bench.py tests/test_roofline.py}"
    BENCH_FLAGS=()
    # tiny-llama3 is launch-bound: torch.compile's default mode says what there is to say, and
    # max-autotune's minute of GEMM tuning is better spent on llama3-8b; archc does not tune it
    # either (its stage is 60 s): the first-run cost of tuning is llama3-8b's to show
    TINY_ARGS=(tiny-llama3 --dtype bf16 --prompt-len 32 --new-tokens 16 --compile-modes default
               --no-autotune)
    BIG_SPEC="llama3-8b"
    # prefill at 2048 tokens: the length FlashAttention-3's published figure is compared at
    BIG_ARGS=(llama3-8b --layers "$LAYERS" --prompt-len 2048 --new-tokens 64
              --contexts 512 2048)
    # quantized: whole-model decode only, no tuning (the dense run above shows the kernels)
    QUANT_ARGS=(llama3-8b --layers "$LAYERS" --prompt-len 512 --new-tokens 64 --no-kernels
                --compile-modes none --no-autotune)
    # serving: llama3-8b's shapes (its first blocks), 16 streams through the paged engine
    SERVE_ARGS=(llama3-8b --layers "$LAYERS" --backend triton --device cuda --dtype bf16
                --streams 16 --prompt-len 256 --new-tokens 32)
    BUDGETS=(140 50 240 80 60)
fi
read -r -a EXTRA <<< "${ARCHC_BENCH_EXTRA:-}"
BUDGET_TESTS="${ARCHC_GPU_CHECK_BUDGET_TESTS:-${BUDGETS[0]}}"
BUDGET_TINY="${ARCHC_GPU_CHECK_BUDGET_TINY:-${BUDGETS[1]}}"
BUDGET_BIG="${ARCHC_GPU_CHECK_BUDGET_BIG:-${BUDGETS[2]}}"
BUDGET_QUANT="${ARCHC_GPU_CHECK_BUDGET_QUANT:-${BUDGETS[3]}}"
BUDGET_SERVE="${ARCHC_GPU_CHECK_BUDGET_SERVE:-${BUDGETS[4]}}"

SLUG="$(printf '%s' "$GPU_NAME" | tr '[:upper:]' '[:lower:]' | tr -c 'a-z0-9' '-' \
        | tr -s '-' | sed 's/^-//; s/-$//')"
PREFIX="${STAMP}_${SLUG:-gpu}"
mkdir -p "$RESULTS" || { echo "cannot create $RESULTS" >&2; exit 2; }
STAGES="$RESULTS/.${PREFIX}_stages.tsv"
SUMMARY="$RESULTS/${PREFIX}_summary.txt"
: > "$STAGES"
FINISHED=0
CHILD=""
CHILD_STAGE=""
CHILD_LOG=""

note() { printf '[%3ds] %s\n' "$SECONDS" "$*"; }

# The files this run made, for the summary and for $OUT.
outputs() {
    local f
    for f in "$RESULTS/${PREFIX}_"*; do
        [[ -f "$f" ]] && printf '%s\n' "$f"
    done
}

# $OUT gets the summary and one archive of every file (a device run brings back at most 8)
publish() {
    [[ -n "${OUT:-}" ]] || return 0
    mkdir -p "$OUT" || return 0
    local names=()
    local f
    while IFS= read -r f; do
        names+=("$(basename -- "$f")")
    done < <(outputs)
    cp -f -- "$SUMMARY" "$OUT/" || note "could not copy the summary to \$OUT"
    (( ${#names[@]} )) || return 0
    tar -czf "$OUT/${PREFIX}_results.tar.gz" -C "$RESULTS" -- "${names[@]}" \
        || note "could not archive the results into \$OUT"
}

# run_stage NAME BUDGET LOG COMMAND...: COMMAND under `timeout`, all output to LOG; the result
# goes to the stage table. The budget shrinks to what is left before the deadline.
run_stage() {
    local name="$1" budget="$2" log="$3"
    shift 3
    local left=$(( BUDGET - RESERVE - GRACE - SECONDS ))
    if (( left < 5 )); then
        note "$name: skipped, no time left"
        printf '%s\tskipped (no time left)\t0\t%s\n' "$name" "$(basename "$log")" >> "$STAGES"
        return 0
    fi
    if (( budget > left )); then
        budget=$left
    fi
    note "$name: up to ${budget}s → $(basename "$log")"
    local start=$SECONDS rc=0 status
    # in the background, so a signal to this script is handled at once (see on_signal)
    timeout --kill-after="$GRACE" "$budget" "$@" > "$log" 2>&1 &
    CHILD=$!
    CHILD_STAGE="$name"
    CHILD_LOG="$log"
    wait "$CHILD" || rc=$?
    CHILD=""
    case "$rc" in
        0) status="ok" ;;
        124 | 137) status="TIMED OUT after ${budget}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    note "$name: $status in $(( SECONDS - start ))s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( SECONDS - start ))" \
        "$(basename "$log")" >> "$STAGES"
    write_summary
    publish
}

test_counts() {
    local log="$1" last
    last="$(grep -E '^=+ .*(passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -n 1)"
    if [[ -n "$last" ]]; then
        printf '%s' "$last" | sed 's/^=* //; s/ =*$//'
    else  # cut short: count the per-test lines pytest -v wrote
        printf '%s passed, %s failed, %s errors, %s skipped so far (pytest did not finish)' \
            "$(grep -c ' PASSED' "$log")" "$(grep -c ' FAILED' "$log")" \
            "$(grep -c ' ERROR' "$log")" "$(grep -c ' SKIPPED' "$log")"
    fi
}

# write_summary [final]: the stage table (after every stage, so a run killed outright still
# leaves one); with `final`, also the bench reports' headline numbers and the environment.
write_summary() {
    local final="${1:-}" failed=0 name status secs log dirty=""
    if git -C "$ROOT" status --porcelain 2>/dev/null | grep -q .; then
        dirty=" (with local changes)"
    fi
    {
        echo "archc GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $GPU_NAME" \
             "$([[ "$DRY_RUN" == 1 ]] && echo '(DRY RUN on the CPU)')"
        echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$dirty"
        echo "budget: ${BUDGET}s, used ${SECONDS}s"
        echo
        echo "stages:"
        while IFS=$'\t' read -r name status secs log; do
            printf '  %-20s %-26s %4ss  %s\n' "$name" "$status" "$secs" "$log"
            [[ "$status" == ok ]] || failed=1
            if [[ "$name" == tests && -f "$RESULTS/$log" ]]; then
                printf '  %-20s %s\n' "" "$(test_counts "$RESULTS/$log")"
                grep -E '^(FAILED|ERROR) ' "$RESULTS/$log" | head -n 20 | sed 's/^/      /'
            fi
        done < "$STAGES"
        if [[ -z "$final" ]]; then
            echo "(the run is still going: this summary is rewritten after each stage)"
        elif (( failed )); then
            echo "SOME STAGES DID NOT PASS: see the lines above and their logs"
        else
            echo "all stages passed"
        fi
        if [[ -n "$final" ]]; then
            echo
            local reports=() f
            for f in "$RESULTS/${PREFIX}_"*.json; do
                [[ -f "$f" ]] && reports+=("$f")
            done
            if (( ${#reports[@]} )); then
                timeout 60 "$PY" -m archc.perf.summary "${reports[@]}" \
                    || echo "(the bench summary could not be made: exit $?)"
            else
                echo "no bench reports were written"
            fi
            if [[ -f "$RESULTS/.${PREFIX}_env.txt" ]]; then
                echo
                echo "environment:"
                cat "$RESULTS/.${PREFIX}_env.txt"
            fi
        fi
    } > "$SUMMARY" 2>&1
    return "$failed"
}

finish() {
    (( FINISHED )) && return 0
    FINISHED=1
    local failed=0
    write_summary final || failed=1
    rm -f "$RESULTS/.${PREFIX}_env.txt" "$STAGES"
    publish
    cat "$SUMMARY"
    note "results in $RESULTS"
    return "$failed"
}
# Interrupted (INT, TERM): stop the running stage, note it, and still write the summary.
# shellcheck disable=SC2317,SC2329  # run by the trap below
on_signal() {
    note "interrupted"
    if [[ -n "$CHILD" ]]; then
        kill -TERM "$CHILD" 2> /dev/null
        wait "$CHILD" 2> /dev/null
        printf '%s\tINTERRUPTED\t-\t%s\n' "$CHILD_STAGE" "$(basename "$CHILD_LOG")" >> "$STAGES"
        CHILD=""
    fi
    finish
    exit 130
}
trap on_signal INT TERM

note "archc GPU check: $GPU_NAME, results in $RESULTS, budget ${BUDGET}s"

# ---- 1. environment: what runs here (never fatal) -----------------------------------------------
ENV_PY="$(cat <<'EOF'
import importlib, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda",
      torch.version.cuda, "| GPU visible to torch:", torch.cuda.is_available())
for name in ("triton", "jinja2", "sympy", "yaml", "rich", "networkx", "numpy", "safetensors",
             "pytest", "xdist", "pytest_timeout", "transformers"):
    try:
        module = importlib.import_module(name)
        print(" ", name, getattr(module, "__version__", ""))
    except Exception as err:
        print(" ", name, "MISSING", type(err).__name__)
EOF
)"
# shellcheck disable=SC2016  # $0 and $1 belong to the inner shell
run_stage env 30 "$RESULTS/.${PREFIX}_env.txt" bash -c '
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
        --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
    "$0" -c "$1"' "$PY" "$ENV_PY"

# ---- 2. tests ----------------------------------------------------------------------------------
# -v: one line per test, so a run cut short still shows what passed
PYTEST_FLAGS=(-v -rfE -p no:cacheprovider --junitxml="$RESULTS/${PREFIX}_tests.xml")
if "$PY" -c 'import xdist' > /dev/null 2>&1; then
    # workers compile Triton kernels, one core each; two cores stay for the rest
    cores="$(nproc 2>/dev/null || echo 4)"
    workers=$(( cores - 2 ))
    (( workers > 14 )) && workers=14
    (( workers < 2 )) && workers=2
    PYTEST_FLAGS+=(-n "$workers")
fi
if "$PY" -c 'import pytest_timeout' > /dev/null 2>&1; then
    PYTEST_FLAGS+=(--timeout=120)
fi
SELECTED=()
for t in "${TESTS[@]}"; do   # a file this checkout lacks would stop pytest before any test
    if [[ -e "$ROOT/${t%%::*}" ]]; then
        SELECTED+=("$t")
    else
        note "tests: $t is not in this checkout, left out"
    fi
done
if (( ${#SELECTED[@]} )); then
    run_stage tests "$BUDGET_TESTS" "$RESULTS/${PREFIX}_tests.log" \
        "$PY" -m pytest "${PYTEST_FLAGS[@]}" "${SELECTED[@]}"
else
    printf '%s\t%s\t0\t-\n' tests "FAILED (no test file found)" >> "$STAGES"
fi

# ---- 3. benchmarks -----------------------------------------------------------------------------
run_stage "bench tiny" "$BUDGET_TINY" "$RESULTS/${PREFIX}_tiny-llama3.log" \
    "$PY" -m archc.cli bench "${TINY_ARGS[@]}" \
    ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"} \
    -o "$RESULTS/${PREFIX}_tiny-llama3.json"
run_stage "bench $BIG_SPEC" "$BUDGET_BIG" "$RESULTS/${PREFIX}_${BIG_SPEC}.log" \
    "$PY" -m archc.cli bench "${BIG_ARGS[@]}" \
    ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"} \
    -o "$RESULTS/${PREFIX}_${BIG_SPEC}.json"
# both quantized benches in one stage and one log; int8 runs even when int4 fails
# shellcheck disable=SC2016  # the variables belong to the inner shell
run_stage "bench quantized" "$BUDGET_QUANT" "$RESULTS/${PREFIX}_${BIG_SPEC}-quantized.log" \
    bash -c 'py="$1" out="$2"; shift 2; rc=0
        for kind in int4 int8; do
            echo "== archc bench --quantize $kind"
            "$py" -m archc.cli bench "$@" --quantize "$kind" -o "$out-$kind.json" || rc=$?
        done
        exit "$rc"' bash "$PY" "$RESULTS/${PREFIX}_${BIG_SPEC}" "${QUANT_ARGS[@]}" \
    ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
run_stage "bench serve" "$BUDGET_SERVE" "$RESULTS/${PREFIX}_serve.log" \
    "$PY" bench/serve_load.py "${SERVE_ARGS[@]}" -o "$RESULTS/${PREFIX}_serve.json"

finish
exit $?
