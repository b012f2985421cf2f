"""Generated tokens/s of self-distillation's engines on one prompt set: the hf engine (transformers'
batched `generate`) beside the static engine (Headway's batched decoder with refilled slots), same
prompts, batch, dtype and threads; and how many answers the two share.

    python tools/distill_throughput.py --prompts alpaca_eval_instructions.json --limit 32 --batch 16 \
        --max-new-tokens 128 --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headway.data_scripts.config import PromptConfig
from headway.data_scripts.engines import HFEngine, SamplingSettings, StaticEngine
from headway.prompts import load_conversations
from headway.target.chat import ChatFormat
from headway.target.config import TargetConfig
from headway.target.loading import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["hf", "static"], choices=["hf", "static"])
    args = ap.parse_args()
    t = load_target(TargetConfig(device="cpu", dtype=args.dtype, num_threads=args.threads))
    fmt = ChatFormat(t.tokenizer, None, t.generation_config)
    convs = load_conversations(PromptConfig(path=args.prompts, limit=args.limit))
    ids = [fmt.first_turn(c.turns[0], c.system) for c in convs]
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    engines = {
        "hf": lambda: HFEngine(
            t.model, t.tokenizer.pad_token_id, fmt.stop_ids, args.batch, "dynamic"
        ),
        "static": lambda: StaticEngine(
            t.model, fmt.stop_ids, args.batch, max(map(len, ids)) + args.max_new_tokens + 1
        ),
    }
    answers = {}
    for name in args.engines:
        engine = engines[name]()
        engine.generate(ids[:2], SamplingSettings(max_new_tokens=4), 0)  # warm-up
        start = time.perf_counter()
        out = engine.generate(ids, settings, 0)
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in out)
        answers[name] = [g.token_ids for g in out]
        print(
            json.dumps(
                {
                    "engine": name,
                    "dtype": args.dtype,
                    "threads": torch.get_num_threads(),
                    "batch": args.batch,
                    "prompts": len(ids),
                    "max_new_tokens": args.max_new_tokens,
                    "generated_tokens": tokens,
                    "seconds": round(seconds, 2),
                    "tok_s": round(tokens / seconds, 1),
                }
            ),
            flush=True,
        )
    if len(answers) == 2:
        same = sum(a == b for a, b in zip(answers["hf"], answers["static"]))
        print(json.dumps({"answers_equal": same, "of": len(ids)}))


if __name__ == "__main__":
    main()
