#!/usr/bin/env bash
# The prepared GPU check (issues 50 and 51): one command that ends within the run's budget (limits.env) and appends
# every figure to one results file as it goes ($OUT/gpu_check.jsonl), so a command killed at its limit still
# leaves what it measured.
#
#   bash scripts/gpu/gpu_check.sh             # on a CUDA machine ($OUT: the folder that comes back)
#   bash scripts/gpu/gpu_check.sh --dry-run   # the same steps on a CPU with tiny budgets, in a few minutes (CI runs it)
#
# Its limits (each step's, the margin, the run's budget) are settings: scripts/gpu/limits.env, each overridable
# from the environment.
#
# Steps (each a line {"step": "run", ...} with its exit status and seconds, beside its own figures):
#   setup    the wheels and the default target's reassembled wheel (scripts/gpu/common.sh, shared with
#            scripts/gpu/gpu_train.sh)
#   env      GPU, torch, CUDA, transformers, commit
#   cudnn    the old path's bf16 steps with cuDNN's SDPA preferred, then (cudnn_deprioritized) deprioritised
#   capture_tests  the CUDA backend's fake-CUDA and capturability tests and the tree attention kernel's bit tests
#            (tests/inference/engines/cuda/test_cuda_capture.py, tests/inference/engines/cuda/test_tree_attention_kernel.py)
#   backend  the CUDA backend: capture time and memory, replay ms at 1/16/48/64 rows, host reads per step
#   exact    speculative greedy output against plain greedy output, per engine and dtype: tiny models of four
#            architectures and the default target in float32 and bf16
#   decode   tok/s, tau, verify and draft ms per forward of plain and speculative decoding (hybrid, neural, n-gram),
#            per engine and dtype, beside HF generate and HF prompt lookup, at batch 1
#   profile  kernels per target forward and ms in drafting, verification and the rest, per engine and dtype
#   distill  `headway distill`'s hf engine: generated tokens/s per dtype, KV cache and batch size
#   bench    `headway bench` in bf16: 2 prompts per category (16 of MT-bench), 6 methods, timed whole
# Prompts: $PROMPTS (MT-bench questions: copy ../shared/data/prompts/mt_bench_question.jsonl into the checkout
# before the run, since ../shared does not travel); without it, built-in prompts. The copy prompts are always added.
set -uo pipefail
cd "$(dirname "$0")/../.."

NAME=gpu_check
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh "$@"
PROMPTS=${PROMPTS:-}
ALL=${GPU_CHECK_ALL:-}
# per-step limits in seconds (limits.env: GPU_CHECK_LIMITS, or GPU_CHECK_DRY_LIMITS in the dry run)
# (setup env cudnn cudnn_deprioritized capture_tests backend exact decode profile distill bench); on the GPU
# distill and bench run only with GPU_CHECK_ALL=1, so that the rest ends within the run's budget (limits.env)
step_limits GPU_CHECK_LIMITS GPU_CHECK_DRY_LIMITS "$([ -n "$ALL" ] && echo 11 || echo 9)"
# exact and decode stop themselves between units of work (a model, a prompt) at their limit less this margin
# (limits.env: GPU_MARGIN_S), writing how far they got, so that a limit too small for a GPU's speed leaves
# whole rows and says so
MARGIN=$GPU_MARGIN_S

run_setup "${LIMITS[0]}"
run_step env "${LIMITS[1]}" $PY scripts/gpu/gpu_check.py env --results "$RESULTS" $DRY
P=()
if [ -n "$PROMPTS" ]; then P=(--prompts "$PROMPTS"); fi
# first, the cuDNN question on the old path: the same steps with cuDNN's SDPA preferred (torch's default on
# sm90 in bf16) and deprioritised
run_step cudnn "${LIMITS[2]}" $PY scripts/gpu/gpu_check.py cudnn --results "$RESULTS" $DRY
run_step cudnn_deprioritized "${LIMITS[3]}" env TORCH_CUDNN_SDPA_DEPRIORITIZED=1 \
    $PY scripts/gpu/gpu_check.py cudnn --results "$RESULTS" $DRY
# the CUDA backend's CPU proofs rerun here (fake CUDA, the checking compile backend, frozen scalars)
K=()
# (on a GPU the tree attention tests run the Triton kernel compiled for the device, not the interpreter)
# (the dry run only collects them: CI runs them all in the suite)
if [ -n "$DRY" ]; then K=(--collect-only -k "fake_cuda or frozen or same_ops or alone"); fi
run_step capture_tests "${LIMITS[4]}" $PY -m pytest -q -p no:cacheprovider tests/inference/engines/cuda/test_cuda_capture.py \
    tests/inference/engines/cuda/test_tree_attention_kernel.py "${K[@]}"
run_step backend "${LIMITS[5]}" $PY scripts/gpu/gpu_check.py backend --results "$RESULTS" $DRY "${P[@]}"
run_step exact "${LIMITS[6]}" $PY scripts/gpu/gpu_check.py exact --results "$RESULTS" $DRY "${P[@]}" \
    --deadline $(( LIMITS[6] - MARGIN ))
run_step decode "${LIMITS[7]}" $PY scripts/gpu/gpu_check.py decode --results "$RESULTS" $DRY "${P[@]}" \
    --deadline $(( LIMITS[7] - MARGIN ))
run_step profile "${LIMITS[8]}" $PY scripts/gpu/gpu_check.py profile --results "$RESULTS" $DRY "${P[@]}"
if [ -z "$DRY" ] && [ -z "$ALL" ]; then
    echo "results: $RESULTS (log: $LOG); distill and bench skipped (GPU_CHECK_ALL=1 runs them)"
    exit 0
fi
run_step distill "${LIMITS[9]}" $PY scripts/gpu/gpu_check.py distill --results "$RESULTS" $DRY "${P[@]}"
if [ -n "$DRY" ]; then
    # (a fixed cost per node sizes the trees: the dry run checks the step runs, not its speed)
    BENCH=(--prompts inference/bench/prompts/copy.jsonl --limit 2 target.device=cpu target.num_threads=1
        inference.max_new_tokens=8 inference.hybrid.node_cost=0.1)
else
    BENCH=(--prompts "${PROMPTS:-inference/bench/prompts/copy.jsonl}" --per-category 2 --turns 1
        target.device=cuda inference.max_new_tokens=128)
fi
run_step bench "${LIMITS[10]}" $PY -m headway bench --head heads/reference/smollm2-135m-instruct-eagle3 \
    --out "$OUT/bench.json" "${BENCH[@]}" target.dtype=bfloat16 "bench.drafters=[neural,ngram]" bench.plot=false
echo "results: $RESULTS (log: $LOG)"
