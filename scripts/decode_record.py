"""Record what a head decodes, to prove a change kept behaviour: the tokens and target forwards of each
drafter on a prompt set (greedy), beside plain decoding; `--compare` sets two records side by side.

    python scripts/decode_record.py --head HEAD_DIR --prompts eval.jsonl --out before.json [key=value ...]
    python scripts/decode_record.py --compare before.json after.json

Prompts are first turns: the first `--per-category` of each category, then `--limit` in all. Overrides are run
config keys (target.dtype=bfloat16 target.num_threads=1 ...); `--drafters` picks which drafters to record.
Timing-sized trees (hybrid, ngram) may differ in forwards between runs; their tokens may not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.data_scripts.prompts import load_conversations
from headway.inference.api import SpeculativeDecoder
from headway.inference.bench import per_category
from headway.io import atomic_write_json
from headway.run_config import RunConfig

DRAFTERS = ("neural", "hybrid", "ngram")


def record(args: argparse.Namespace) -> None:
    cfg = load_config(RunConfig, args.config, args.overrides)
    convs = per_category(load_conversations(PromptConfig(path=args.prompts)), args.per_category)[: args.limit]
    decoder = SpeculativeDecoder.load(args.head, cfg)
    prompts = [decoder.fmt.first_turn(c.turns[0], c.system) for c in convs]
    out: dict = {"prompts": [c.id for c in convs], "plain": []}
    for ids in prompts:
        out["plain"].append(decoder.generate_plain(ids, args.max_new_tokens).tokens)
    for kind in args.drafters:
        d = decoder.with_drafter(kind)
        runs = [d.generate(ids, args.max_new_tokens) for ids in prompts]
        out[kind] = [
            {"tokens": r.tokens, "forwards": r.target_forwards, "tok_s": r.tokens_per_second} for r in runs
        ]
        tokens = sum(len(r.tokens) - 1 for r in runs)
        print(
            f"{kind}: tau {tokens / max(1, sum(r.target_forwards for r in runs)):.3f}, "
            f"{sum(len(r.tokens) for r in runs) / max(sum(r.seconds for r in runs), 1e-9):.1f} tok/s, "
            f"equal to plain: {all(r.tokens == p for r, p in zip(runs, out['plain']))}"
        )
    atomic_write_json(Path(args.out), out)


def compare(before: Path, after: Path) -> None:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    if a["prompts"] != b["prompts"]:
        raise SystemExit("the two records hold different prompts")
    print(f"plain tokens equal: {a['plain'] == b['plain']}")
    for kind in [k for k in DRAFTERS if k in a and k in b]:
        same = sum(x["tokens"] == y["tokens"] for x, y in zip(a[kind], b[kind]))
        forwards = sum(x["forwards"] == y["forwards"] for x, y in zip(a[kind], b[kind]))
        taus = [
            sum(len(r["tokens"]) - 1 for r in rec[kind]) / sum(r["forwards"] for r in rec[kind])
            for rec in (a, b)
        ]
        print(
            f"{kind}: tokens equal on {same}/{len(a[kind])}, forwards equal on {forwards}/{len(a[kind])}, "
            f"tau {taus[0]:.3f} -> {taus[1]:.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    p.add_argument("--head")
    p.add_argument("--prompts")
    p.add_argument("--out")
    p.add_argument("--config")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", nargs="*", choices=DRAFTERS, default=list(DRAFTERS))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.compare:
        compare(*args.compare)
    elif args.head and args.prompts and args.out:
        record(args)
    else:
        p.error("give --compare BEFORE AFTER, or --head, --prompts and --out")


if __name__ == "__main__":
    main()
