"""Two or more heads of one target on the same prompts, alternating head by head on every prompt, so
that the machine's drift between hours (5-10% on small shared CPUs) lands on every head alike. Each
head decodes on its own copy of the target, with each drafter given; every output must equal the
first head's (all are exact greedy).

    python scripts/compare_heads.py --heads old=heads/reference/smollm2-135m-instruct-eagle3 new=RUN/export \\
        --prompts eval.jsonl --per-category 2 target.dtype=bfloat16 \\
        target.linear_weights=onednn target.num_threads=2

Overrides are run config keys on top of --config; --set NAME:KEY=VALUE gives one head its own (the
same head twice with two settings compares those settings). --plain also decodes each prompt plainly
(on the first head's target), in turn with the heads. Prints tok/s and tau (tokens per target
forward) per head and drafter, and with --plain each one's speedup over plain decoding.

    python scripts/compare_heads.py --heads d1=HEAD d3=HEAD --set d1:inference.depth=1 --plain \\
        --prompts eval.jsonl target.dtype=bfloat16 target.linear_weights=onednn target.num_threads=2
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.errors import HeadwayError
from headway.inference.api import SpeculativeDecoder
from headway.inference.bench.run import per_category
from headway.prompts import load_conversations
from headway.run_config import RunConfig


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=HEAD_DIR, two or more")
    ap.add_argument(
        "--prompts", required=True, help="a prompt file (jsonl; first turns are decoded)"
    )
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category (0: all)")
    ap.add_argument(
        "--drafters", default="hybrid,neural", help="comma-separated inference.drafter values"
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--config", default="configs/eagle3_smollm2.yaml")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="an override for one head only",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="decode each prompt plainly too, in turn with the heads",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    heads = dict(h.split("=", 1) for h in args.heads if "=" in h)
    if len(heads) < 2 or len(heads) != len(args.heads):
        raise SystemExit("--heads takes two or more NAME=HEAD_DIR")
    convs = load_conversations(PromptConfig(path=args.prompts))
    prompts = [
        (c.turns[0], c.system)
        for c in (per_category(convs, args.per_category) if args.per_category else convs)
    ]
    if not prompts:
        raise SystemExit(f"{args.prompts} has no prompts")

    own: dict[str, list[str]] = {name: [] for name in heads}
    for item in args.set:
        name, _, override = item.partition(":")
        if name not in own or "=" not in override:
            raise SystemExit(
                f"--set {item}: give NAME:KEY=VALUE with NAME one of {', '.join(heads)}"
            )
        own[name].append(override)
    drafters = args.drafters.split(",")
    decoders = {}
    try:
        for name, path in heads.items():
            base = SpeculativeDecoder.load(
                path, load_config(RunConfig, args.config, args.overrides + own[name])
            )
            base.warm_up(drafters=drafters)
            decoders[name] = {kind: base.with_drafter(kind) for kind in drafters}
    except HeadwayError as e:
        raise SystemExit(str(e)) from None
    first = decoders[next(iter(heads))][drafters[0]]
    plain_total = [0, 0.0]  # tokens, seconds

    def decode_plain(text: str, system: str | None) -> list[int]:
        start = time.perf_counter()
        result = first.generate_plain(first.fmt.first_turn(text, system), args.max_new_tokens)
        plain_total[0] += len(result.tokens)
        plain_total[1] += time.perf_counter() - start
        return result.tokens

    totals: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0, 0])
    names = list(heads)
    mismatches = differ_from_plain = 0
    for i, (text, system) in enumerate(prompts):
        order = names if i % 2 == 0 else names[::-1]  # neither head always runs first
        reference = decode_plain(text, system) if args.plain and i % 2 == 0 else None
        for kind in drafters:
            outputs = {}
            for name in order:
                dec = decoders[name][kind]
                ids = dec.fmt.first_turn(text, system)
                start = time.perf_counter()
                result = dec.generate(ids, args.max_new_tokens)
                seconds = time.perf_counter() - start
                outputs[name] = result.tokens
                t = totals[name, kind]
                t[0] += len(result.tokens)
                t[1] += seconds
                t[2] += sum(result.accepted) + len(result.accepted)
                t[3] += len(result.accepted)
            if args.plain and i % 2 == 1 and kind == drafters[-1]:
                reference = decode_plain(text, system)
            mismatches += any(out != outputs[names[0]] for out in outputs.values())
        if reference is not None:  # the last drafter's outputs against plain greedy decoding
            differ_from_plain += any(out != reference for out in outputs.values())
        print(f"prompt {i + 1}/{len(prompts)}", flush=True)
    plain_rate = plain_total[0] / plain_total[1] if args.plain else None
    rows = [
        {
            "head": name,
            "drafter": kind,
            "tok_s": round(n / s, 1),
            "tau": round(a / max(st, 1), 3),
            **({"speedup": round(n / s / plain_rate, 3)} if plain_rate else {}),
        }
        for (name, kind), (n, s, a, st) in sorted(totals.items())
    ]
    if plain_rate:
        print(json.dumps({"plain": round(plain_rate, 1)}))
    for row in rows:
        print(json.dumps(row))
    print(
        "outputs equal across heads: "
        f"{len(prompts) * len(drafters) - mismatches}/{len(prompts) * len(drafters)}"
    )
    if args.plain:
        print(f"outputs equal to plain greedy: {len(prompts) - differ_from_plain}/{len(prompts)}")


if __name__ == "__main__":
    main()
