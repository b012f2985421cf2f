"""Record what a head decodes, to prove a change kept behaviour: the tokens and target forwards of
each drafter on a prompt set (greedy), beside plain decoding; `--compare` sets two records side by
side.

    python tools/decode_record.py --head HEAD_DIR --prompts eval.jsonl --out before.json [key=value ...]
    python tools/decode_record.py --compare before.json after.json

Prompts are first turns: the first `--per-category` of each category, then `--limit` in all.
Overrides are run config keys (target.dtype=bfloat16 target.num_threads=1 ...); `--drafters` picks
which drafters to record. Timing-sized trees (hybrid, ngram) may differ in forwards between runs;
their tokens may not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.inference.api import SpeculativeDecoder
from headway.inference.bench.run import per_category
from headway.io import atomic_write_json
from headway.prompts import load_conversations
from headway.run_config import RunConfig

DRAFTERS = ("neural", "hybrid", "ngram")


def record(args: argparse.Namespace) -> None:
    """Decode each prompt plainly and with each drafter, saving the record after every prompt.

    A run that stops resumes from the record at `--out` when it holds the same prompts and drafters.
    """
    cfg = load_config(RunConfig, args.config, args.overrides)
    convs = per_category(load_conversations(PromptConfig(path=args.prompts)), args.per_category)[
        : args.limit
    ]
    decoder = SpeculativeDecoder.load(args.head, cfg)
    prompts = [decoder.fmt.first_turn(c.turns[0], c.system) for c in convs]
    out: dict = {"prompts": [c.id for c in convs], "plain": [], **{k: [] for k in args.drafters}}
    path = Path(args.out)
    if path.exists():
        done = json.loads(path.read_text())
        if done.get("prompts") == out["prompts"] and all(k in done for k in out):
            out = {k: done[k] for k in out}
    drafters = {kind: decoder.with_drafter(kind) for kind in args.drafters}
    for i, ids in enumerate(prompts):
        if i < len(out["plain"]) and all(i < len(out[k]) for k in drafters):
            continue
        out["plain"] = out["plain"][:i] + [decoder.generate_plain(ids, args.max_new_tokens).tokens]
        for kind, d in drafters.items():
            r = d.generate(ids, args.max_new_tokens)
            row = {"tokens": r.tokens, "forwards": r.target_forwards, "tok_s": r.tokens_per_second}
            out[kind] = out[kind][:i] + [{**row, "seconds": r.seconds}]
        atomic_write_json(path, out)
        equal = " ".join(f"{k}={out[k][i]['tokens'] == out['plain'][i]}" for k in drafters)
        print(
            f"prompt {i + 1}/{len(prompts)} {out['prompts'][i]}: equal to plain: {equal}",
            flush=True,
        )
    for kind in drafters:
        runs = out[kind]
        tokens = sum(len(r["tokens"]) - 1 for r in runs)
        seconds = sum(r.get("seconds", 0.0) for r in runs)
        print(
            f"{kind}: tau {tokens / max(1, sum(r['forwards'] for r in runs)):.3f}, "
            f"{sum(len(r['tokens']) for r in runs) / max(seconds, 1e-9):.1f} tok/s, "
            f"equal to plain on {sum(r['tokens'] == p for r, p in zip(runs, out['plain']))}/{len(runs)}"
        )


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
