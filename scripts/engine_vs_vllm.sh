#!/usr/bin/env bash
# Headway's CPU engine beside vLLM-CPU on the same prompts, in one run: plain decoding, prompt lookup and the
# head, at each thread count, like with like (float32 against vLLM in float32, bf16 against vLLM in bfloat16, and
# Headway's packed float16-weight formats beside those pairs); and the prefill of a 1,000-token prompt in each.
#
#   scripts/engine_vs_vllm.sh MT_BENCH.jsonl [HEAD_DIR] [extra headway overrides]
# Prompts: MT-bench first turns (PER_CATEGORY per category), inference/bench/prompts/copy.jsonl and
# inference/bench/prompts/long.jsonl (summaries and passages of 530-740 tokens). Run it on a quiet machine.
# Env: VLLM_VENV (default .venv-vllm; made by scripts/check_vllm.sh), THREADS_LIST ("1 2"), DTYPES
#      ("float32 bfloat16"), MODES (vLLM's runs: "plain,ngram,head"), PER_CATEGORY (1), MAX_TOKENS (128),
#      PREFILL (1000), COMPILE (1: vLLM compiled), OUT (outputs/engine-vs-vllm), F32_FORMATS ("native onednn mkl
#      float16": Headway's float32 weight formats), BF16_FORMATS ("onednn float16").
set -euo pipefail
cd "$(dirname "$0")/.."
MT=${1:?usage: scripts/engine_vs_vllm.sh MT_BENCH.jsonl [HEAD_DIR] [overrides]}
HEAD=${2:-heads/reference/smollm2-135m-instruct-eagle3}
shift $(($# >= 2 ? 2 : 1))
VENV=${VLLM_VENV:-.venv-vllm}; THREADS_LIST=${THREADS_LIST:-1 2}; DTYPES=${DTYPES:-float32 bfloat16}
MODES=${MODES:-plain,ngram,head}; PER_CATEGORY=${PER_CATEGORY:-1}; MAX_TOKENS=${MAX_TOKENS:-128}
PREFILL=${PREFILL:-1000}; OUT=${OUT:-outputs/engine-vs-vllm}
export TOKENIZERS_PARALLELISM=false
[ -x "$VENV/bin/python" ] || { echo "no vLLM venv at $VENV: run scripts/check_vllm.sh once, or set VLLM_VENV"; exit 2; }
mkdir -p "$OUT"

echo "== one prompt file: MT-bench first turns, the copy prompts, the long prompts"
python3 - "$MT" "$OUT/prompts.jsonl" <<'PY'
import json, sys
rows = []
for path in (sys.argv[1], "inference/bench/prompts/copy.jsonl", "inference/bench/prompts/long.jsonl"):
    for line in open(path):
        r = json.loads(line)
        turns = r.get("turns") or [r["prompt"]]
        rows.append({"category": r.get("category", "mt"), "turns": turns[:1]})
with open(sys.argv[2], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
PY

echo "== the target as a plain HF directory and the head in vLLM's layout"
[ -f "$OUT/target/config.json" ] || headway target export --out "$OUT/target" --dtype float32 "$@"
KIND=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1] + '/config.json'))['kind'])" "$HEAD")
[ -f "$OUT/draft/config.json" ] || headway export --head "$HEAD" --format vllm --out "$OUT/draft" --dtype float32 "$@"

for T in $THREADS_LIST; do
  CORES=0-$((T - 1))
  for DT in $DTYPES; do
    echo "== vLLM-CPU, $DT, $T thread(s), cores $CORES: $MODES"
    for MODE in ${MODES//,/ }; do
      OMP_NUM_THREADS=$T VLLM_CPU_OMP_THREADS_BIND=$CORES taskset -c "$CORES" "$VENV/bin/python" scripts/vllm_spec_run.py \
        --target "$OUT/target" --draft "$OUT/draft" --method "$KIND" --k 3 --prompts "$OUT/prompts.jsonl" \
        --per-category "$PER_CATEGORY" --max-tokens "$MAX_TOKENS" --dtype "$DT" --prefill "$PREFILL" \
        ${COMPILE:+--compile} --mode "$MODE" --out "$OUT/vllm-$DT-$T.json"
    done
    FORMATS=$([ "$DT" = float32 ] && echo "${F32_FORMATS:-native onednn mkl float16}" || echo "${BF16_FORMATS:-onednn float16}")
    for W in $FORMATS; do
      D=$DT
      if [ "$D:$W" = bfloat16:onednn ] && ! python3 -c "import sys, torch; sys.exit(0 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 1)"; then
        W=native
      fi
      echo "== Headway, $D with $W weights, $T thread(s)"
      OMP_NUM_THREADS=$T taskset -c "$CORES" headway bench --head "$HEAD" --prompts "$OUT/prompts.jsonl" --turns 1 \
        --per-category "$PER_CATEGORY" --out "$OUT/headway-$D-$W-$T.json" target.dtype="$D" target.linear_weights="$W" \
        target.num_threads="$T" inference.max_new_tokens="$MAX_TOKENS" inference.engine=static "bench.baselines=[]" \
        "bench.drafters=[neural,ngram]" bench.plot=false "$@"
      OMP_NUM_THREADS=$T taskset -c "$CORES" python tools/step_profile.py --steps 16 --prompt-tokens "$PREFILL" \
        target.dtype="$D" target.linear_weights="$W" target.num_threads="$T" inference.engine=static \
        2>/dev/null | grep "prefill of" | sed "s/^/  Headway $D $W: /" | tee "$OUT/prefill-$D-$W-$T.txt"
    done
  done
done

echo "== side by side"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print("| threads | format | plain tok/s | prompt lookup | head | hybrid | prefill ms |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for path in sorted(glob.glob(f"{out}/vllm-*.json.plain")):
    dt, t = os.path.basename(path).split(".")[0].split("-")[1:]
    runs = {m: json.load(open(f"{out}/vllm-{dt}-{t}.json.{m}")) for m in ("plain", "ngram", "head")
            if os.path.exists(f"{out}/vllm-{dt}-{t}.json.{m}")}
    tok = lambda m: f"{runs[m]['tok_s']:.1f}" if m in runs else "-"
    print(f"| {t} | vLLM {dt} | {tok('plain')} | {tok('ngram')} | {tok('head')} | - | "
          f"{runs['plain'].get('prefill_ms', 0):.0f} |")
    for h in sorted(glob.glob(f"{out}/headway-*-{t}.json")):
        d, w = os.path.basename(h).split("-")[1:3]
        if d != dt:
            continue
        s = json.load(open(h))["overall"]["tok_s"]
        pre_file = os.path.join(out, os.path.basename(h).replace("headway-", "prefill-").replace(".json", ".txt"))
        pre = open(pre_file).read().split(":")[-1].split()[0] if os.path.exists(pre_file) else "-"
        print(f"| {t} | Headway {d} {w} | {s['plain']:.1f} | {s.get('headway_ngram', 0):.1f} | "
              f"{s.get('headway_neural', 0):.1f} | {s.get('speculative', 0):.1f} | {pre} |")
PY
