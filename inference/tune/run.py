"""`headway tune`: pick the draft tree that is fastest on this machine for this head.

The best tree is a trade: a larger tree accepts more tokens per step, but verifying it costs more,
and how much more depends on the hardware (on a CPU the cost grows with the tokens verified; on a
GPU the curve is nearly flat; docs/benchmarks.md). Tune measures the two sides separately and
multiplies them out:

- cost: the target's forward time against the number of verified tokens, over a cache of typical
  length, and the drafter's time for each tree setting, all on this machine with these threads;
- acceptance: the target's greedy answers to calibration prompts are decoded once, then the drafter
  is replayed along them, and at every position each candidate tree is checked against the tokens
  the target really wrote next. A tree's accepted length is exactly the number of its nodes whose
  whole path matches (greedy verification accepts that chain), so one replay scores every tree.
  Medusa: every node's empirical match rate gives the best tree of each size. EAGLE-2: the dynamic
  tree for (depth, top_k, total_tokens) is the top total_tokens candidates of the expansion of
  depth `depth` with `top_k`, so one expansion per top_k scores every depth and size.

Expected tokens/s = (1 + accepted per step) / (verify + draft + commit time per step); the best
setting is saved in the head directory (tuned.json, keyed by machine, threads and dtype) and used by
`generate` and `bench` on the same machine unless inference.use_tuned=false or the command line sets
a tree. Tune ends by decoding the prompts with the configured and the tuned tree, beside plain.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from headway.data_scripts.config import PromptConfig
from headway.errors import HeadwayError
from headway.heads.draft_layer import text_config
from headway.inference.api import SpeculativeDecoder, build_drafter
from headway.inference.config import TREE_KEYS, TuneConfig
from headway.inference.cost_model import machine_key, verify_cost, verify_costs
from headway.inference.engines.runner import depth_matters
from headway.inference.generate import alternate, pooled
from headway.inference.tune.replay import Replay, replay_answers, simulate
from headway.inference.tune.spaces import TREE_SPACES
from headway.inference.tuned import save_tuned
from headway.prompts import load_conversations

log = logging.getLogger("headway")


def calibration_prompts(decoder: Any, tc: TuneConfig) -> list[list[int]]:
    """First-turn prompt ids of the calibration prompts (the user's, or the set shipped with
    Headway)."""
    path = tc.prompts or str(Path(__file__).parent / "prompts" / "calibration.jsonl")
    convs = load_conversations(PromptConfig(path=path, limit=tc.num_prompts))
    if not convs:
        raise HeadwayError(f"tune.prompts={path} has no prompts")
    return [decoder.fmt.first_turn(c.turns[0], c.system) for c in convs]


def search(
    decoder: Any, replays: list[Replay], cost: Callable[[int, int], float], tc: TuneConfig
) -> list[dict]:
    """Every candidate tree setting of the head kind's search space with its expected accepted
    drafts, step time and tokens/s, best first; cost(n, depth) is the verify time of n tokens in a
    tree that deep (`verify_costs`)."""
    num_layers = int(text_config(decoder.target.config).num_hidden_layers)
    space = TREE_SPACES[decoder.heads.kind]
    out = space.candidates(decoder.heads, decoder.drafter, replays, cost, tc, num_layers)
    return sorted(out, key=lambda c: -c["tok_s"])


def compare_drafters(
    decoder: Any,
    replays: list[Replay],
    cost: Callable[[int, int], float],
    neural_settings: dict,
    kinds: list[str],
) -> list[dict]:
    """Each drafter kind replayed along the calibration answers (simulate), best first: the neural
    tree with the chosen settings, n-gram branches alone, and both in one hybrid tree."""
    inference = dataclasses.replace(decoder.cfg.inference, **neural_settings)
    head, target = decoder.heads, decoder.target
    out = []
    for kind in kinds:
        drafter = build_drafter(kind, head, inference, decoder.head_config, target, cost=cost)
        out.append({"drafter": kind, **simulate(drafter, replays, cost)})
    return sorted(out, key=lambda d: -d["tok_s"])


def tune(head_dir: str | Path, cfg: Any) -> dict:
    """Measure, search, validate and save; returns the saved entry."""
    tc = cfg.tune
    configured = dataclasses.replace(
        cfg, inference=dataclasses.replace(cfg.inference, use_tuned=False)
    )
    as_configured = SpeculativeDecoder.load(head_dir, configured)
    # the search below scores the head's own trees
    decoder = (
        as_configured
        if configured.inference.drafter == "neural"
        else as_configured.with_drafter("neural")
    )
    model = decoder.target.model
    prompts = calibration_prompts(decoder, tc)
    replays = replay_answers(decoder, prompts, tc.max_new_tokens)
    prefix = int(statistics.median(len(p) for p in prompts) + tc.max_new_tokens // 2)
    sizes = tc.verify_sizes or TREE_SPACES[decoder.heads.kind].verify_sizes(tc)
    log.info(
        "measuring the target's verification time over 1..%d tokens after a %d-token cache",
        max(sizes),
        prefix,
    )
    engine = decoder.options  # (the engine's settings the decoder runs with)
    costs = verify_cost(model, sorted({1, *sizes}), prefix, tc.repeats, engine)
    flat = None
    if depth_matters(model, engine):
        log.info("and in a flat tree (this engine's cost depends on the tree's depth)")
        flat = verify_cost(model, sorted({1, *sizes}), prefix, tc.repeats, engine, shape="flat")
    cost = verify_costs(costs, flat)
    candidates = search(decoder, replays, cost, tc)
    drafters = compare_drafters(decoder, replays, cost, candidates[0]["inference"], tc.drafters)
    best = {
        **candidates[0],
        "inference": {**candidates[0]["inference"], "drafter": drafters[0]["drafter"]},
        "replayed": drafters[0],
    }
    log.info(
        "replayed drafters (tokens/s): %s",
        ", ".join(f"{d['drafter']} {d['tok_s']:.1f}" for d in drafters),
    )
    entry = {
        "machine": machine_key(model, cfg.inference.engine),
        "date": time.strftime("%Y-%m-%d"),
        "chosen": best,
        "configured": {k: getattr(cfg.inference, k) for k in TREE_KEYS},
        "plain_tok_s_estimate": 1 / costs[1],
        "verify_ms": {str(n): 1e3 * s for n, s in sorted(costs.items())},
        "cache_prefix": prefix,
        **({"verify_flat_ms": {str(n): 1e3 * s for n, s in sorted(flat.items())}} if flat else {}),
        "calibration": {
            "prompts": tc.prompts or "shipped tune/prompts/calibration.jsonl",
            "num_prompts": len(prompts),
            "answer_tokens": sum(len(r.answer) for r in replays),
            "max_new_tokens": tc.max_new_tokens,
        },
        "top_candidates": candidates[:15],
        "drafters": drafters,
    }
    if tc.validate:
        as_configured.saved_costs = entry["verify_ms"]
        entry["validation"] = validate(
            as_configured, configured, best["inference"], prompts, tc.max_new_tokens
        )
    path = save_tuned(head_dir, entry)
    log.info("saved %s", path)
    return entry


def validate(
    decoder: Any, cfg: Any, tuned: dict, prompts: list[list[int]], max_new_tokens: int
) -> dict:
    """Plain decoding, the configured tree and the tuned tree on the prompts, in rotating order."""
    tuned_cfg = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, **tuned))
    tuned_decoder = SpeculativeDecoder(
        decoder.target, decoder.heads, tuned_cfg, decoder.head_config, decoder.saved_costs
    )
    runs = {
        "plain": lambda ids: decoder.generate_plain(ids, max_new_tokens),
        "configured": lambda ids: decoder.generate(ids, max_new_tokens),
        "tuned": lambda ids: tuned_decoder.generate(ids, max_new_tokens),
    }
    results: dict[str, list] = {n: [] for n in runs}
    for i, ids in enumerate(tqdm(prompts, desc="tune: validation", unit="prompt")):
        for n, r in alternate(runs, ids, i).items():
            results[n].append(r)
    out: dict = {
        n: {
            **pooled(rs),
            "matches_plain": sum(r.tokens == p.tokens for r, p in zip(rs, results["plain"]))
            / len(rs),
        }
        for n, rs in results.items()
    }
    out["tuned_over_configured"] = out["tuned"]["tok_s"] / out["configured"]["tok_s"]
    out["tuned_over_plain"] = out["tuned"]["tok_s"] / out["plain"]["tok_s"]
    return out
