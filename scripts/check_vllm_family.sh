#!/usr/bin/env bash
# The default head kind for a target of another family, end to end: a small random Qwen2, Mistral or Llama
# target with Llama-3's rope scaling (llama3: the exports carry it, docs/export.md "RoPE scaling"), head_dim 64
# (which vLLM-CPU's attention takes), self-distilled data, an EAGLE-3 head with the default Llama-style draft
# layer, then its exports served in vLLM beside `headway bench` (scripts/check_vllm.sh).
#
#   scripts/check_vllm_family.sh qwen2|mistral|llama3
# Env: KIND (eagle3; or eagle, or medusa with its own full-vocabulary lm_heads, the layout vLLM loads),
#      LAYERS (EAGLE-3's fused layers, e.g. [2,3,4]; default: the kind's default),
#      WORK (outputs/family-check/ARCH-KIND), STEPS (80), VLLM_VENV and THREADS as for scripts/check_vllm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${1:?usage: scripts/check_vllm_family.sh qwen2|mistral|llama3}
KIND=${KIND:-eagle3}; WORK=${WORK:-outputs/family-check/$ARCH-$KIND}; STEPS=${STEPS:-80}
mkdir -p "$WORK"

if [ ! -f "$WORK/target/config.json" ]; then
  echo "== a random $ARCH target in $WORK/target"
  python - "$ARCH" "$WORK/target" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, MistralConfig, Qwen2Config

sys.path.insert(0, "tests")
from tiny_models import make_tokenizer  # noqa: E402

arch, out = sys.argv[1], sys.argv[2]
tok = make_tokenizer(arch)
common = dict(vocab_size=(len(tok) + 16) // 16 * 16, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              tie_word_embeddings=True)
# llama3: Llama-3.1's rope scaling (factor 8, low/high frequency factors 1 and 4) over an original length of 512
llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
config = {
    "qwen2": lambda: Qwen2Config(**common),
    "mistral": lambda: MistralConfig(**common, sliding_window=None),
    "llama3": lambda: LlamaConfig(**common, rope_parameters=llama3),
}[arch]()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                           pad_token_id=tok.pad_token_id)
model.save_pretrained(out)
tok.save_pretrained(out)
EOF
fi

python - "$WORK/prompts.jsonl" "$WORK/eval.jsonl" <<'EOF'
import json
import sys

words = ["fox", "sea", "sky", "numbers", "cat", "crow", "story", "poem", "question", "answer"]
with open(sys.argv[1], "w") as f:
    for i in range(160):
        f.write(json.dumps({"instruction": f"Tell me about the {words[i % 10]} and {words[(i * 7) % 10]}, {i}."}) + "\n")
with open(sys.argv[2], "w") as f:
    for i in range(8):
        f.write(json.dumps({"instruction": f"Write about the {words[i]} and the {words[(i + 3) % 10]}."}) + "\n")
EOF

T="target.name_or_path=$WORK/target"
echo "== self-distillation and training ($STEPS steps)"
headway distill "$T" "prompts.path=$WORK/prompts.jsonl" "distill.output_dir=$WORK/data" distill.engine=hf \
  distill.max_new_tokens=96 distill.batch_size=32
headway train "$T" head.kind="$KIND" head.eagle3.draft_vocab_size=256 head.medusa.lm_head=own \
  head.medusa.num_heads=3 "train.datasets=[$WORK/data]" \
  "train.output_dir=$WORK/train" train.max_steps="$STEPS" train.micro_batch_size=8 train.warmup_steps=10 \
  train.lr=0.003 train.eval_every=0 train.save_every=0 train.autocast_dtype=float32 \
  ${LAYERS:+"head.eagle3.feature_layers=$LAYERS"}
PER_CATEGORY=0 OUT="$WORK/vllm-check" scripts/check_vllm.sh "$WORK/train/head" "$WORK/eval.jsonl" "$T"
