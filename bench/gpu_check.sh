#!/usr/bin/env bash
# The GPU check, ordered by what its numbers are worth and sized to a lease of 15 minutes of
# device time (a machine start of a minute or more included): at most 450 s by default, no
# network. Stages, in order:
#
#   env           the GPU, the driver, and the versions of Triton, torch and Python
#   headline      `archc bench llama3-8b` (its first blocks, --no-autotune, torch.compile's
#                 default mode only): batch-1 decode at contexts 512 and 2048 against the
#                 bandwidth floor and torch.compile, decode attention against a copy of the same
#                 KV bytes, the prefill matmuls (2048 tokens) against torch.matmul on the same
#                 GEMM, prefill attention against scaled_dot_product_attention and in TFLOP/s
#                 against FlashAttention-3's published forward figure
#   tests         a short correctness selection on the GPU: the bf16 cases of the kernel and
#                 model tests, and the split-K, decode-attention and MoE tests (their
#                 last-arriving programs reduce the others' partial sums through atomics, a race
#                 only a GPU can show), the CUDA-graph and no-host-sync tests
#   ---- the rest: each runs only if its whole budget is left, in this order ----
#   quantized     llama3-8b decode with its weights int4, then int8, against the floor of the
#                 quantized bytes and the bf16 model's
#   autotune      llama3-8b autotuned: the prefill kernels at their tuned tiles, and the tuning
#                 cache's first-run cost (a session on an empty cache, then a second on it)
#   serve         continuous batching: 16 streams together against one at a time
#                 (bench/serve_load.py, the paged engine on the triton backend)
#   more-tests    the rest of the selection (f32, f16, the other files)
#   max-autotune  llama3-8b decode at 512 and 2048 against torch.compile max-autotune
#   tiny          `archc bench tiny-llama3` (launch-bound)
#
#   bench/gpu_check.sh              on a machine with a CUDA GPU, torch and triton
#   bench/gpu_check.sh --rest       only the rest (what a first run left out: a later lease
#                                   finishes the table); ARCHC_GPU_CHECK_STAGES='autotune serve'
#                                   runs exactly the stages named
#   bench/gpu_check.sh --dry-run    the same stages on a CPU at tiny shapes (`archc bench
#                                   --dry-run`, a small test selection): checks this script,
#                                   measures nothing
#   bench/gpu_check.sh --plan       print the stage table (order, seconds given) and stop
#   bench/gpu_check.sh --args       print each stage's commands' arguments and stop, one line
#                                   a command: STAGE<TAB>KIND<TAB>ARG… (KIND: bench, pytest or
#                                   serve), what bench/rehearse.sh checks without a GPU
#
# Every run prints the stage table first. A headline stage is cut to the time left; a stage of
# the rest is skipped when its whole budget is not left (a cut run would measure nothing), and
# the summary names the stages left for a later run. A stage that fails or runs out of time does
# not stop the next. Results go to bench/results/ (a temporary directory in a dry run), named
# <UTC date>_<GPU>_<what>; when $OUT is set, it gets the summary and an archive of every file
# (<prefix>_whole-run.tar.gz), after every stage and every 30 s while one runs, so a run cut
# short still brings back what it measured; the summary's name sorts first:
#   *_summary.txt    what ran and how long, what failed, the software versions, the headline
#                    numbers of each bench report (read this first)
#   *_tests.log, *_more-tests.log   pytest output (-v); *_tests.xml … their JUnit reports
#   *_llama3-8b.json, .log          the headline bench report (saved after every section, so a
#                                   cut run keeps its part) and its tables
#   *_llama3-8b-int4.json, *_llama3-8b-int8.json, *_quantized.log    the quantized benches
#   *_llama3-8b-autotune.json, .log, *_llama3-8b-max-autotune.json, .log,
#   *_tiny-llama3.json, .log, *_serve.json, .log                     the rest
#
# Optional environment: PYTHON (default python3), OUT, ARCHC_GPU_CHECK_RESULTS (results
# directory), ARCHC_GPU_CHECK_BUDGET (total seconds, default 450; 3600 in a dry run),
# ARCHC_GPU_CHECK_BUDGET_<STAGE> (one stage's seconds, e.g. _HEADLINE, _MORE_TESTS; 300 each in
# a dry run),
# ARCHC_GPU_CHECK_STAGES (the stages to run, space-separated; env always runs),
# ARCHC_GPU_CHECK_TESTS (the pytest selection, space-separated), ARCHC_GPU_CHECK_SHORT (the -k
# expression of the short selection; more-tests runs the rest of the selection),
# ARCHC_GPU_CHECK_LAYERS (llama3-8b blocks kept, default 4), ARCHC_BENCH_EXTRA (extra flags for
# every `archc bench`), ARCHC_GPU_CHECK_PUBLISH_EVERY (seconds between copies to $OUT while a
# stage runs, default 30).

set -u
set -o pipefail

usage() { echo "usage: $0 [--dry-run] [--rest] [--plan | --args]" >&2; }
DRY_RUN=0
REST=0
PLAN_ONLY=0
ARGS_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --rest) REST=1 ;;
        --plan) PLAN_ONLY=1 ;;
        --args) ARGS_ONLY=1 ;;
        -h | --help) usage; exit 0 ;;
        *) usage; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
RESERVE=15                                  # kept back for the summary and copies
GRACE=10                                    # a stage gets TERM, then KILL this much later
PUBLISH_EVERY="${ARCHC_GPU_CHECK_PUBLISH_EVERY:-30}"   # seconds between copies to $OUT
LAYERS="${ARCHC_GPU_CHECK_LAYERS:-4}"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
SECONDS=0

# ---- the stages: name, seconds on a GPU, kind (headline: cut to the time left; rest: run
# only whole), what it measures --------------------------------------------------------------
STAGE_NAMES=(env headline tests quantized autotune serve more-tests max-autotune tiny)
STAGE_SECONDS=(20 240 90 80 150 60 150 180 50)
STAGE_KINDS=(headline headline headline rest rest rest rest rest rest)
STAGE_WHAT=(
    "GPU, driver, Triton, torch and Python versions"
    "llama3-8b decode at 512/2048 vs floor and torch.compile; prefill matmuls, attention"
    "short correctness selection on the GPU: bf16, atomics, CUDA graphs"
    "llama3-8b decode with int4, then int8 weights"
    "llama3-8b autotuned prefill kernels; the tuning cache's first-run cost"
    "16 streams through the paged engine, together vs one at a time"
    "the rest of the test selection (f32, f16, other files)"
    "llama3-8b decode vs torch.compile max-autotune"
    "tiny-llama3 bench (launch-bound)")
REST_STAGES="quantized autotune serve more-tests max-autotune tiny"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1

GPU_BUDGET=450                              # a GPU run's seconds, the summary included
if [[ "$DRY_RUN" == 1 ]]; then
    GPU_NAME="cpu dry run"
    BUDGET="${ARCHC_GPU_CHECK_BUDGET:-3600}"
    DRY_STAGE_SECONDS=300                   # each stage at tiny shapes, on a CPU
    RESULTS="${ARCHC_GPU_CHECK_RESULTS:-$(mktemp -d "${TMPDIR:-/tmp}/archc-gpu-check.XXXXXX")}"
    read -r -a TESTS <<< "${ARCHC_GPU_CHECK_TESTS:-tests/test_roofline.py}"
    SHORT="${ARCHC_GPU_CHECK_SHORT:-cli}"
    BENCH_FLAGS=(--dry-run)
    BIG_SPEC="tiny-mistral"
    SMALL=(tiny-mistral --layers 1 --prompt-len 8 --new-tokens 4)
    # contexts past the prompt, the second past tiny-mistral's window of 8
    HEADLINE_ARGS=("${SMALL[@]}" --contexts 12 20 --compile-modes default --no-autotune)
    QUANT_ARGS=("${SMALL[@]}" --no-kernels --compile-modes none --no-autotune)
    AUTOTUNE_ARGS=("${SMALL[@]}" --no-kernels --compile-modes none)
    MAX_AUTOTUNE_ARGS=("${SMALL[@]}" --no-kernels --contexts 12
                       --compile-modes max-autotune-no-cudagraphs --no-autotune)
    TINY_ARGS=(tiny-llama3 --prompt-len 8 --new-tokens 4 --no-kernels --compile-modes default
               --no-autotune)
    SERVE_ARGS=(tiny-llama3 --streams 4 --prompt-len 6 --new-tokens 4)
else
    # archc chooses Triton's interpreter only for a CPU device; a stray setting would stop it
    unset TRITON_INTERPRET
    BUDGET="${ARCHC_GPU_CHECK_BUDGET:-$GPU_BUDGET}"
    GPU_BUDGET="$BUDGET"
    DRY_STAGE_SECONDS=""
    GPU_NAME=""
    if [[ "$PLAN_ONLY$ARGS_ONLY" == 00 ]]; then
        GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
        if [[ -z "$GPU_NAME" ]]; then
            GPU_NAME="$(timeout 20 "$PY" -c 'import torch; print(torch.cuda.get_device_name())' \
                        2>/dev/null | tail -n 1)"
        fi
    fi
    GPU_NAME="${GPU_NAME:-unknown gpu}"
    RESULTS="${ARCHC_GPU_CHECK_RESULTS:-$ROOT/bench/results}"
    # Tests whose kernels run on the GPU when there is one (f32, f16 and bf16). Not
    # tests/test_triton_validate.py: it validates on the CPU (Triton's interpreter, which a
    # process running CUDA tests cannot choose; tests/triton_state.py skips such a test there).
    read -r -a TESTS <<< "${ARCHC_GPU_CHECK_TESTS:-tests/test_splitk.py \
tests/test_decode_attention.py tests/test_moe_kernels.py tests/test_triton_kernels.py \
tests/test_triton_recurrent.py tests/test_triton_models.py tests/test_triton_gguf.py \
tests/test_bench.py tests/test_roofline.py}"
    # the short selection: bf16, the files whose kernels reduce through atomics, CUDA graphs
    # and the decode step that must not wait on the host
    SHORT="${ARCHC_GPU_CHECK_SHORT:-bf16 or test_splitk or test_decode_attention or \
test_moe_kernels or cuda_graph or wait_on_the_gpu}"
    BENCH_FLAGS=()
    BIG_SPEC="llama3-8b"
    # prefill at 2048 tokens: the length FlashAttention-3's published figure is compared at;
    # archc at its heuristic tiles (tuning is the autotune stage's), torch.compile's default
    # mode (max-autotune's minutes of GEMM tuning are the max-autotune stage's)
    HEADLINE_ARGS=(llama3-8b --layers "$LAYERS" --prompt-len 2048 --new-tokens 64
                   --contexts 512 2048 --compile-modes default --no-autotune)
    # quantized: whole-model decode only, no tuning (the headline shows the kernels)
    QUANT_ARGS=(llama3-8b --layers "$LAYERS" --prompt-len 512 --new-tokens 64 --no-kernels
                --compile-modes none --no-autotune)
    # tuned: the prefill kernels at their tiles, then the autotune section; few decode steps
    AUTOTUNE_ARGS=(llama3-8b --layers "$LAYERS" --prompt-len 2048 --new-tokens 8
                   --compile-modes none)
    MAX_AUTOTUNE_ARGS=(llama3-8b --layers "$LAYERS" --prompt-len 512 --new-tokens 64
                       --no-kernels --contexts 512 2048
                       --compile-modes max-autotune-no-cudagraphs --no-autotune)
    # tiny-llama3 is launch-bound: torch.compile's default mode says what there is to say
    TINY_ARGS=(tiny-llama3 --dtype bf16 --prompt-len 32 --new-tokens 16 --compile-modes default
               --no-autotune)
    # serving: llama3-8b's shapes (its first blocks), 16 streams through the paged engine
    SERVE_ARGS=(llama3-8b --layers "$LAYERS" --backend triton --device cuda --dtype bf16
                --streams 16 --prompt-len 256 --new-tokens 32)
fi
read -r -a EXTRA <<< "${ARCHC_BENCH_EXTRA:-}"
QUANT_KINDS=(int4 int8)
SHORT_ARGS=(-m "not slow" -k "$SHORT")      # the tests stage's selection of TESTS
MORE_ARGS=(-k "not ($SHORT)")               # more-tests': the rest of it

# the stages this run makes: all, the rest (--rest), or those named
if [[ -n "${ARCHC_GPU_CHECK_STAGES:-}" ]]; then
    WANTED="${ARCHC_GPU_CHECK_STAGES}"
elif [[ "$REST" == 1 ]]; then
    WANTED="$REST_STAGES"
else
    WANTED="${STAGE_NAMES[*]}"
fi
for name in $WANTED; do
    if [[ " ${STAGE_NAMES[*]} " != *" $name "* ]]; then
        echo "$0: no stage '$name' (stages: ${STAGE_NAMES[*]})" >&2
        exit 2
    fi
done
wanted() { [[ "$1" == env || " $WANTED " == *" $1 "* ]]; }

# gpu_seconds_of NAME: the stage's seconds on a GPU (ARCHC_GPU_CHECK_BUDGET_<NAME> overrides)
gpu_seconds_of() {
    local i var
    for i in "${!STAGE_NAMES[@]}"; do
        [[ "${STAGE_NAMES[$i]}" == "$1" ]] || continue
        var="ARCHC_GPU_CHECK_BUDGET_${1^^}"
        var="${var//-/_}"
        echo "${!var:-${STAGE_SECONDS[$i]}}"
        return 0
    done
}

# seconds_of NAME: the stage's seconds in this run (in a dry run, DRY_STAGE_SECONDS unless
# overridden)
seconds_of() {
    local var="ARCHC_GPU_CHECK_BUDGET_${1^^}"
    var="${var//-/_}"
    if [[ -n "$DRY_STAGE_SECONDS" && -z "${!var:-}" ]]; then
        echo "$DRY_STAGE_SECONDS"
    else
        gpu_seconds_of "$1"
    fi
}

kind_of() {
    local i
    for i in "${!STAGE_NAMES[@]}"; do
        [[ "${STAGE_NAMES[$i]}" == "$1" ]] && echo "${STAGE_KINDS[$i]}"
    done
}

# The stage table of a GPU run: order, seconds given, the latest a stage can end (every stage
# before it using all of its seconds), when it runs, what it measures.
print_plan() {
    local i name secs end=0 when usable=$(( GPU_BUDGET - RESERVE - GRACE ))
    echo "stages on a GPU: ${GPU_BUDGET}s in all, ${RESERVE}s of them kept for the summary" \
         "and ${GRACE}s for a stage stopped at its limit"
    printf '  %-2s %-13s %7s %8s  %-34s %s\n' "#" stage seconds "ends by" runs measures
    for i in "${!STAGE_NAMES[@]}"; do
        name="${STAGE_NAMES[$i]}"
        wanted "$name" || continue
        secs="$(gpu_seconds_of "$name")"
        end=$(( end + secs ))
        if [[ "${STAGE_KINDS[$i]}" == headline ]]; then
            when="always (cut to the time left)"
        elif (( end <= usable )); then
            when="if all its seconds are left"
        else
            when="if the stages before end early"
        fi
        printf '  %-2s %-13s %6ss %7ss  %-34s %s\n' "$(( i + 1 ))" "$name" "$secs" "$end" \
            "$when" "${STAGE_WHAT[$i]}"
    done
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "this dry run: the same stages at tiny shapes on the CPU, up to" \
             "${DRY_STAGE_SECONDS}s each and ${BUDGET}s in all"
    fi
}

# Each stage's commands, as this run would make them (results paths aside): one line a command,
# STAGE<TAB>KIND<TAB>ARG… — the arguments of `archc bench`, of pytest and of serve_load.py.
print_args() {
    emit() { local IFS=$'\t'; echo "$*"; }
    local kind bench_flags=(${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"})
    emit headline bench "${HEADLINE_ARGS[@]}" ${bench_flags[@]+"${bench_flags[@]}"}
    emit tests pytest "${SHORT_ARGS[@]}" "${TESTS[@]}"
    for kind in "${QUANT_KINDS[@]}"; do
        emit quantized bench "${QUANT_ARGS[@]}" ${bench_flags[@]+"${bench_flags[@]}"} \
            --quantize "$kind"
    done
    emit autotune bench "${AUTOTUNE_ARGS[@]}" ${bench_flags[@]+"${bench_flags[@]}"}
    emit serve serve "${SERVE_ARGS[@]}"
    emit more-tests pytest "${MORE_ARGS[@]}" "${TESTS[@]}"
    emit max-autotune bench "${MAX_AUTOTUNE_ARGS[@]}" ${bench_flags[@]+"${bench_flags[@]}"}
    emit tiny bench "${TINY_ARGS[@]}" ${bench_flags[@]+"${bench_flags[@]}"}
}

if [[ "$PLAN_ONLY" == 1 ]]; then
    print_plan
    exit 0
fi
if [[ "$ARGS_ONLY" == 1 ]]; then
    print_args
    exit 0
fi

SLUG="$(printf '%s' "$GPU_NAME" | tr '[:upper:]' '[:lower:]' | tr -c 'a-z0-9' '-' \
        | tr -s '-' | sed 's/^-//; s/-$//')"
PREFIX="${STAMP}_${SLUG:-gpu}"
mkdir -p "$RESULTS" || { echo "cannot create $RESULTS" >&2; exit 2; }
STAGES="$RESULTS/.${PREFIX}_stages.tsv"
ENV_LOG="$RESULTS/.${PREFIX}_env.txt"
SUMMARY="$RESULTS/${PREFIX}_summary.txt"
ARCHIVE="${PREFIX}_whole-run.tar.gz"       # sorts after the summary
REPORTS=()                                  # bench reports, in stage order
: > "$STAGES"
FINISHED=0
CHILD=""
CHILD_STAGE=""
CHILD_LOG=""
CHILD_START=0

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
    if ! tar -czf "$OUT/$ARCHIVE.tmp" -C "$RESULTS" -- "${names[@]}"; then
        note "could not archive the results into \$OUT"
        return 0
    fi
    mv -f -- "$OUT/$ARCHIVE.tmp" "$OUT/$ARCHIVE"
}

# skip NAME WHY: the stage does not run; the stage table says why
skip() {
    note "$1: skipped, $2"
    printf '%s\tskipped (%s)\t0\t-\n' "$1" "$2" >> "$STAGES"
}

# run_stage NAME LOG COMMAND...: COMMAND under `timeout`, all output to LOG; the result goes to
# the stage table. A headline stage's budget shrinks to what is left before the deadline; a
# stage of the rest runs only with its whole budget left.
run_stage() {
    local name="$1" log="$2"
    shift 2
    wanted "$name" || return 0
    local budget left
    budget="$(seconds_of "$name")"
    left=$(( BUDGET - RESERVE - GRACE - SECONDS ))
    if [[ "$(kind_of "$name")" == rest ]] && (( budget > left )); then
        skip "$name" "needs ${budget}s, ${left}s left"
        return 0
    fi
    if (( left < 5 )); then
        skip "$name" "no time left"
        return 0
    fi
    (( budget > left )) && budget=$left
    note "$name: up to ${budget}s → $(basename "$log")"
    local rc=0 status last=$SECONDS
    CHILD_START=$SECONDS
    # in the background, so a signal to this script is handled at once (see on_signal)
    timeout --kill-after="$GRACE" "$budget" "$@" > "$log" 2>&1 &
    CHILD=$!
    CHILD_STAGE="$name"
    CHILD_LOG="$log"
    while kill -0 "$CHILD" 2> /dev/null; do     # copy what there is to $OUT as it goes
        sleep 1 & wait $!
        if (( SECONDS - last >= PUBLISH_EVERY )); then
            last=$SECONDS
            write_summary
            publish
        fi
    done
    wait "$CHILD" || rc=$?
    CHILD=""
    case "$rc" in
        0) status="ok" ;;
        124 | 137) status="TIMED OUT after ${budget}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    note "$name: $status in $(( SECONDS - CHILD_START ))s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( SECONDS - CHILD_START ))" \
        "$(basename "$log")" >> "$STAGES"
    write_summary
    publish
}

test_counts() {
    local log="$1" last
    last="$(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s' "$log" \
            | tail -n 1)"
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
    local final="${1:-}" failed=0 name status secs log dirty="" left=()
    if git -C "$ROOT" status --porcelain 2>/dev/null | grep -q .; then
        dirty=" (with local changes)"
    fi
    {
        echo "archc GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $GPU_NAME" \
             "$([[ "$DRY_RUN" == 1 ]] && echo '(DRY RUN on the CPU)')"
        echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$dirty"
        grep -m 1 '^software: ' "$ENV_LOG" 2>/dev/null \
            || echo "software: unknown (the env stage did not say)"
        echo "budget: ${BUDGET}s, used ${SECONDS}s"
        echo
        echo "stages:"
        while IFS=$'\t' read -r name status secs log; do
            printf '  %-13s %-36s %4ss  %s\n' "$name" "$status" "$secs" "$log"
            [[ "$status" == ok || "$status" == skipped* ]] || failed=1
            [[ "$status" == skipped* ]] && left+=("$name")
            if [[ "$name" == *tests && -f "$RESULTS/$log" ]]; then
                printf '  %-13s %s\n' "" "$(test_counts "$RESULTS/$log")"
                grep -E '^(FAILED|ERROR) ' "$RESULTS/$log" | head -n 20 | sed 's/^/      /'
            fi
        done < "$STAGES"
        if [[ -n "$CHILD" ]]; then
            echo "  $CHILD_STAGE: running for $(( SECONDS - CHILD_START ))s so far"
        fi
        if [[ -z "$final" ]]; then
            echo "(the run is still going: this summary is rewritten as it goes)"
        elif (( failed )); then
            echo "SOME STAGES DID NOT PASS: see the lines above and their logs"
        else
            echo "every stage that ran passed"
        fi
        if [[ -n "$final" ]] && (( ${#left[@]} )); then
            echo "left for a later run: ${left[*]} — ARCHC_GPU_CHECK_STAGES='${left[*]}'" \
                 "bench/gpu_check.sh"
        fi
        if [[ -n "$final" ]]; then
            echo
            local present=() f
            for f in ${REPORTS[@]+"${REPORTS[@]}"}; do
                [[ -f "$f" ]] && present+=("$f")
            done
            if (( ${#present[@]} )); then
                timeout "$(( RESERVE - 3 ))" "$PY" -m archc.perf.summary "${present[@]}" \
                    || echo "(the bench summary could not be made: exit $?)"
            else
                echo "no bench reports were written"
            fi
            if [[ -f "$ENV_LOG" ]]; then
                echo
                echo "environment:"
                cat "$ENV_LOG"
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
    rm -f "$ENV_LOG" "$STAGES"
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
        printf '%s\tINTERRUPTED\t%s\t%s\n' "$CHILD_STAGE" "$(( SECONDS - CHILD_START ))" \
            "$(basename "$CHILD_LOG")" >> "$STAGES"
        CHILD=""
    fi
    finish
    exit 130
}
trap on_signal INT TERM

note "archc GPU check: $GPU_NAME, results in $RESULTS, budget ${BUDGET}s"
print_plan

# bench NAME LOG JSON ARGS...: `archc bench ARGS` as stage NAME, its report JSON
bench() {
    local name="$1" log="$2" json="$3"
    shift 3
    REPORTS+=("$json")
    run_stage "$name" "$log" "$PY" -m archc.cli bench "$@" \
        ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"} -o "$json"
}

# tests NAME ARGS...: the selection (files this checkout lacks left out), pytest ARGS
tests() {
    local name="$1"
    shift
    local flags=(-v -rfE -p no:cacheprovider --junitxml="$RESULTS/${PREFIX}_${name}.xml") t
    if "$PY" -c 'import xdist' > /dev/null 2>&1; then
        # workers compile Triton kernels, one core each; two cores stay for the rest
        local cores workers
        cores="$(nproc 2>/dev/null || echo 4)"
        workers=$(( cores - 2 ))
        (( workers > 14 )) && workers=14
        (( workers < 2 )) && workers=2
        flags+=(-n "$workers")
    fi
    if "$PY" -c 'import pytest_timeout' > /dev/null 2>&1; then
        flags+=(--timeout=120)
    fi
    local selected=()
    for t in "${TESTS[@]}"; do   # a file this checkout lacks would stop pytest before any test
        if [[ -e "$ROOT/${t%%::*}" ]]; then
            selected+=("$t")
        else
            note "$name: $t is not in this checkout, left out"
        fi
    done
    if (( ${#selected[@]} == 0 )); then
        wanted "$name" && printf '%s\t%s\t0\t-\n' "$name" "FAILED (no test file found)" \
            >> "$STAGES"
        return 0
    fi
    run_stage "$name" "$RESULTS/${PREFIX}_${name}.log" \
        "$PY" -m pytest "${flags[@]}" "$@" "${selected[@]}"
}

# ---- env: what runs here (never fatal) -------------------------------------------------------
ENV_PY="$(cat <<'EOF'
import importlib, platform
from archc.versions import software_text
import torch
print(software_text())
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
run_stage env "$ENV_LOG" bash -c '
    "$0" -c "$1"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
        --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"' "$PY" "$ENV_PY"

# ---- the headline, then the short tests ------------------------------------------------------
bench headline "$RESULTS/${PREFIX}_${BIG_SPEC}.log" "$RESULTS/${PREFIX}_${BIG_SPEC}.json" \
    "${HEADLINE_ARGS[@]}"
tests tests "${SHORT_ARGS[@]}"

# ---- the rest, while time is left ------------------------------------------------------------
# both quantized benches in one stage and one log; int8 runs even when int4 fails
if wanted quantized; then
    for kind in "${QUANT_KINDS[@]}"; do
        REPORTS+=("$RESULTS/${PREFIX}_${BIG_SPEC}-$kind.json")
    done
fi
# shellcheck disable=SC2016  # the variables belong to the inner shell
run_stage quantized "$RESULTS/${PREFIX}_quantized.log" \
    bash -c 'py="$1" out="$2" kinds="$3"; shift 3; rc=0
        for kind in $kinds; do
            echo "== archc bench --quantize $kind"
            "$py" -m archc.cli bench "$@" --quantize "$kind" -o "$out-$kind.json" || rc=$?
        done
        exit "$rc"' bash "$PY" "$RESULTS/${PREFIX}_${BIG_SPEC}" "${QUANT_KINDS[*]}" \
    "${QUANT_ARGS[@]}" ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
bench autotune "$RESULTS/${PREFIX}_${BIG_SPEC}-autotune.log" \
    "$RESULTS/${PREFIX}_${BIG_SPEC}-autotune.json" "${AUTOTUNE_ARGS[@]}"
run_stage serve "$RESULTS/${PREFIX}_serve.log" \
    "$PY" bench/serve_load.py "${SERVE_ARGS[@]}" -o "$RESULTS/${PREFIX}_serve.json"
tests more-tests "${MORE_ARGS[@]}"
bench max-autotune "$RESULTS/${PREFIX}_${BIG_SPEC}-max-autotune.log" \
    "$RESULTS/${PREFIX}_${BIG_SPEC}-max-autotune.json" "${MAX_AUTOTUNE_ARGS[@]}"
bench tiny "$RESULTS/${PREFIX}_tiny-llama3.log" "$RESULTS/${PREFIX}_tiny-llama3.json" \
    "${TINY_ARGS[@]}"

finish
exit $?
