"""Run llama.cpp's `llama-server` on prompts two or three ways (no draft, its n-gram drafting, a
Headway head exported with `headway export --format gguf`) and write, for each, tokens/s with the
prompt included (as `headway bench` counts them), the acceptance length (tokens per target step) and
whether each output equals llama.cpp's own plain greedy output. Called by scripts/check_llamacpp.sh;
prompts are formatted by Headway's own chat formatting, as `headway bench` does, and sent as token
ids.

    python scripts/llamacpp_spec_run.py --server BIN --target TARGET.gguf --tokenizer HF_DIR \
        --prompts P.jsonl [--draft HEAD.gguf] [--k 3] [--max-tokens 128] [--threads 1] \
        [--per-category 1] --out llamacpp.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

# (scripts/: the same prompts, formatted the same, as the vLLM check)
from vllm_spec_run import prompt_ids

from headway.inference.bench.llamacpp import LlamaServer, draft_args
from headway.io import atomic_write_json


def run(mode: str, args: argparse.Namespace, ids: list[list[int]]) -> dict:
    """One mode over every prompt: greedy, `max_tokens` new tokens, no prompt cache between
    requests (inference/bench/llamacpp.py's server, as `headway bench` runs it)."""
    extra = {
        "plain": (),
        "ngram": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", str(args.k)),
        # a full chain of K every step, as `headway bench`'s chain drafts it (p-min 0: no early
        # stop)
        "head": draft_args(str(args.draft), args.k, args.threads) if args.draft else (),
    }[mode]
    log = Path(f"{args.out}.{mode}.log")
    outs, tokens, seconds, steps = [], 0, 0.0, 0
    with LlamaServer(args.server, args.target, args.threads, extra, log=log) as server:
        server.complete(ids[0], 4)  # warm-up
        for p in ids:
            r = server.complete(p, args.max_tokens)
            outs.append(r.tokens)
            tokens, seconds, steps = (
                tokens + len(r.tokens),
                seconds + r.seconds,
                steps + r.target_forwards,
            )
    return {
        "mode": mode,
        "tok_s": tokens / seconds,
        # tokens per target step after the prompt's (accepted drafts and one of its own), as tau
        "acceptance_length": (tokens - len(ids)) / max(steps, 1),
        "tokens": tokens,
        "outputs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--modes", default="plain,ngram,head")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ids, _ = prompt_ids(args.tokenizer, args.prompts, 0, args.per_category)
    modes = [m for m in args.modes.split(",") if m != "head" or args.draft]
    results = [run(m, args, ids) for m in modes]
    plain = next((r["outputs"] for r in results if r["mode"] == "plain"), None)
    for r in results:
        if plain is not None:
            r["matches_plain"] = sum(a == b for a, b in zip(r["outputs"], plain)) / len(plain)
        print(
            f"llama.cpp {r['mode']:<6} tok/s {r['tok_s']:8.1f}  "
            f"acceptance length {r['acceptance_length']:.2f}  matches plain {r.get('matches_plain', 1.0):.0%}"
        )
    atomic_write_json(Path(args.out), {"prompts": len(ids), "k": args.k, "results": results})


if __name__ == "__main__":
    main()
