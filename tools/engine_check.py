"""Engines side by side on one machine: plain and speculative decoding with the transformers forward
(hf), the static engine and the compiled one (torch.compile; the warm-up compiles), the same
prompts, in rotating order. Speculative output must equal plain greedy output on the same engine
(exit 1 otherwise); whether the engines agree with each other is reported (near-ties may differ
between them). Prints tok/s, tau and ms per verification and draft step, and writes them as JSON.

    python tools/engine_check.py [--head DIR] [--device cpu|cuda] [--dtype float32|bfloat16] [--threads 1]
                                   [--max-new-tokens 128] [--prompts FILE.jsonl] [--out FILE.json]
                                   [overrides...]

On a GPU machine this is the one-command check:
`python tools/engine_check.py --device cuda --dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.demo import reference_head
from headway.inference.api import SpeculativeDecoder
from headway.inference.engines.runner import engine_name
from headway.inference.generate import alternate, plain_generate, pooled, speculative_generate
from headway.prompts import load_conversations
from headway.run_config import RunConfig

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works, with a Python example.",
    "Summarize the plot of Hamlet in five sentences.",
    "List ten countries in Europe and their capitals.",
    "What is 17 times 23? Show your steps.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--head", default=None, help="head directory (default: the shipped reference head)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--prompts",
        default=None,
        help="a prompt file (first turns are used); default: 5 built-in prompts",
    )
    ap.add_argument("--out", default="outputs/engine_check.json")
    args, overrides = ap.parse_known_args()
    cfg = load_config(
        RunConfig,
        None,
        [
            f"target.device={args.device}",
            f"target.dtype={args.dtype}",
            f"target.num_threads={args.threads}",
            *overrides,
        ],
    )
    decoder = SpeculativeDecoder.load(args.head or reference_head(), cfg)
    model, stops, n = decoder.target.model, decoder.fmt.stop_ids, args.max_new_tokens
    texts = (
        [c.turns[0] for c in load_conversations(PromptConfig(path=args.prompts))]
        if args.prompts
        else PROMPTS
    )
    engines = ["hf"] + (["static", "compiled"] if engine_name(model) == "static" else [])
    runners = {}
    for e in engines:
        runners[f"plain/{e}"] = lambda ids, e=e: plain_generate(model, ids, n, stops, engine=e)
        runners[f"spec/{e}"] = lambda ids, e=e: speculative_generate(
            model, decoder.drafter, ids, n, stops, engine=e
        )
    warm = decoder.fmt.first_turn("Hello")
    for run in runners.values():
        run(warm[:8])
    results: dict[str, list] = {k: [] for k in runners}
    mismatches = engines_differ = 0
    for i, text in enumerate(texts):
        ids = decoder.fmt.first_turn(text)
        out = alternate(runners, ids, i)
        for k, r in out.items():
            results[k].append(r)
            mismatches += (
                r.tokens != out[f"plain/{k.split('/')[1]}"].tokens
            )  # exactness: against plain, same engine
            engines_differ += r.tokens != out["plain/hf"].tokens
    base = pooled(results["plain/hf"])["tok_s"]
    rows = {}
    print(
        f"{'method':14s} {'tok/s':>7s} {'vs plain/hf':>11s} {'tau':>5s} {'verify ms':>9s} {'draft ms':>8s}"
    )
    for k, rs in results.items():
        p, fw = pooled(rs), max(1, sum(r.target_forwards for r in rs))
        rows[k] = {
            **p,
            "verify_ms": 1e3 * sum(r.verify_seconds for r in rs) / fw,
            "draft_ms": 1e3 * sum(r.draft_seconds for r in rs) / fw,
        }
        print(
            f"{k:14s} {p['tok_s']:7.2f} {p['tok_s'] / base:10.2f}x {p['tau']:5.2f} "
            f"{rows[k]['verify_ms']:9.1f} {rows[k]['draft_ms']:8.1f}"
        )
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    record = {
        "device": device,
        "dtype": args.dtype,
        "threads": args.threads,
        "max_new_tokens": n,
        "prompts": len(texts),
        "tree": {k: getattr(decoder.cfg.inference, k) for k in ("depth", "top_k", "total_tokens")},
        "results": rows,
        "speculative_equals_plain_same_engine": mismatches == 0,
        "all_equal_to_plain_hf": engines_differ == 0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"{device}, {args.dtype}, {args.threads} thread(s); speculative equals plain greedy on the same "
        f"engine: {mismatches == 0}; every output equals plain/hf: {engines_differ == 0} -> {args.out}"
    )
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
