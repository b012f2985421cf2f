"""Where a speculative decoding step's time goes: each prompt decoded speculatively and then plainly
(outputs checked equal), with wall-clock timers around the drafter's parts and the target's lm_head,
so that the drafting cost a step pays is seen beside its verification.

    OMP_NUM_THREADS=2 taskset -c 0,1 python tools/draft_profile.py --prompts eval.jsonl --per-category 1 \\
        target.dtype=bfloat16 target.linear_weights=stream target.num_threads=2
        inference.engine=static

Prints tok/s, speedup and tau (tokens per target forward), seconds in drafting and in verification,
and per timed part its total, its calls and its mean (a part's time includes the parts it calls: the
hybrid's draft holds the EAGLE drafter's commit and candidates, which hold the drafter layer and its
logits).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict

from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.inference import sampling
from headway.inference.api import SpeculativeDecoder
from headway.inference.bench.run import per_category
from headway.inference.drafters import eagle as draft_eagle
from headway.inference.drafters import hybrid as draft_hybrid
from headway.inference.engines import runner as engine
from headway.prompts import load_conversations
from headway.run_config import RunConfig

SECONDS: dict[str, float] = defaultdict(float)
CALLS: Counter = Counter()


def timed(owner, name: str, label: str) -> None:
    """Replace owner.name by a wrapper that adds its wall time to SECONDS[label]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--prompts", required=True, help="a prompt file (jsonl; first turns are decoded)"
    )
    ap.add_argument("--per-category", type=int, default=1, help="prompts per category (0: all)")
    ap.add_argument("--head", default="heads/reference/smollm2-135m-instruct-eagle3")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--config", default="configs/eagle3_smollm2.yaml")
    ap.add_argument("overrides", nargs="*", help="run config keys (target.*, inference.*)")
    args = ap.parse_args()
    convs = load_conversations(PromptConfig(path=args.prompts))
    prompts = [
        c.turns[0] for c in (per_category(convs, args.per_category) if args.per_category else convs)
    ]
    decoder = SpeculativeDecoder.load(
        args.head, load_config(RunConfig, args.config, args.overrides)
    )

    for owner, name, label in (
        (draft_hybrid.HybridDrafter, "draft", "hybrid draft (all below)"),
        (draft_hybrid.HybridDrafter, "accept", "hybrid accept"),
        (draft_eagle.EagleDrafter, "_commit", "EAGLE commit"),
        (draft_eagle.EagleDrafter, "candidates", "EAGLE candidates"),
        (engine.StaticLayerCache, "run", "drafter layer"),
        (type(decoder.heads), "logits", "drafter logits"),
        (type(decoder.heads), "project", "drafter fc"),
        (sampling, "greedy_token", "greedy token"),
        (decoder.target.model.lm_head, "forward", "target lm_head (plain too)"),
    ):
        timed(owner, name, label)
    decoder.warm_up()
    SECONDS.clear()
    CALLS.clear()
    total: Counter = Counter()
    for prompt in prompts:
        ids = decoder.fmt.first_turn(prompt)
        spec = decoder.generate(ids, args.max_new_tokens)
        plain = decoder.generate_plain(ids, args.max_new_tokens)
        if plain.tokens != spec.tokens:
            raise SystemExit("a speculative output differed from plain greedy decoding")
        total.update(
            spec=spec.seconds,
            plain=plain.seconds,
            draft=spec.draft_seconds,
            verify=spec.verify_seconds,
            forwards=spec.target_forwards,
            tokens=len(spec.tokens),
        )
    print(
        f"{len(prompts)} prompts, {total['tokens']} tokens: {total['tokens'] / total['spec']:.1f} tok/s "
        f"against {total['tokens'] / total['plain']:.1f} plain, {total['plain'] / total['spec']:.3f}x, tau "
        f"{total['tokens'] / total['forwards']:.2f}; drafting {total['draft']:.2f} s, verification "
        f"{total['verify']:.2f} s ({1e3 * total['verify'] / total['forwards']:.1f} ms a forward), the rest "
        f"(prompts, acceptance) {total['spec'] - total['draft'] - total['verify']:.2f} s"
    )
    for label in sorted(SECONDS, key=lambda k: -SECONDS[k]):
        mean = 1e6 * SECONDS[label] / CALLS[label]
        print(
            f"  {label:28s} {1e3 * SECONDS[label]:8.1f} ms {CALLS[label]:6d} calls {mean:8.1f} us a call"
        )


if __name__ == "__main__":
    main()
