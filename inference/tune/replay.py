"""Acceptance along the target's own answers: a drafter replayed over greedy answers, without the
target.

At every position each candidate tree is checked against the tokens the target really wrote next; a
tree's accepted length is the number of its nodes whose whole path matches (what greedy verification
accepts), so one replay scores every tree. `headway tune` searches with these.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tqdm import tqdm

from headway.inference.generate import features_at


@dataclass
class Replay:
    """A greedy answer and the target's features along it: what the drafter sees at each
    position."""

    prompt: list[int]
    answer: list[int]
    features: torch.Tensor  # [len(prompt) + len(answer) - 1, F]


@torch.inference_mode()
def replay_answers(decoder: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Replay]:
    """Greedy answers to the prompts, then one target forward over each whole sequence for its
    features."""
    model = decoder.target.model
    device = next(model.parameters()).device
    out = []
    for ids in tqdm(prompts, desc="tune: target answers", unit="prompt"):
        answer = decoder.generate_plain(ids, max_new_tokens).tokens
        seq = torch.tensor([ids + answer[:-1]], device=device)
        o = model(seq, output_hidden_states=True)
        out.append(
            Replay(
                ids,
                answer,
                features_at(o.hidden_states, decoder.drafter.feature_layers, slice(None)),
            )
        )
    return out


def eagle_acceptance(
    drafter: Any, replays: list[Replay], depths: list[int], top_ks: list[int], sizes: list[int]
) -> dict[tuple[int, int, int], float]:
    """Mean accepted drafts per step for every (depth, top_k, total_tokens), from one expansion per
    top_k at the deepest depth at every answer position (see the module docstring)."""
    sums: dict[tuple[int, int, int], float] = {}
    steps = 0
    for r in tqdm(replays, desc="tune: drafter replay", unit="prompt"):
        for _, counts in eagle_accepted_along(drafter, r, depths, top_ks, sizes):
            steps += 1
            for key, c in counts.items():
                sums[key] = sums.get(key, 0.0) + c
    return {key: v / max(1, steps) for key, v in sums.items()}


def eagle_accepted_along(
    drafter: Any, r: Replay, depths: list[int], top_ks: list[int], sizes: list[int]
) -> Any:
    """For each answer position p (the root being answer[p]): p and the drafts greedy verification
    would accept there for every (depth, top_k, total_tokens) whose tree the expansion can fill."""
    dmax = max(depths)
    n_prompt = len(r.prompt)
    drafter.begin(r.prompt, r.answer[0], r.features[:n_prompt])
    for p in range(len(r.answer) - 1):
        want = r.answer[p + 1 :]
        counts: dict[tuple[int, int, int], int] = {}
        for k in top_ks:
            tokens, scores, parents, cdepths = drafter.candidates(dmax, k)
            target_ids = drafter.heads.to_target_ids(
                torch.tensor(tokens, device=drafter.param.device)
            ).tolist()
            chain = _matching_chain(target_ids, parents, cdepths, want)
            for d in depths:
                pool = [c for c in range(len(tokens)) if cdepths[c] <= d]
                rank = {
                    c: i
                    for i, c in enumerate(sorted(pool, key=lambda c: (-scores[c], cdepths[c], c)))
                }
                ranks = [rank[c] for c in chain if cdepths[c] <= d]
                for n in sizes:
                    if n <= len(pool):
                        counts[d, k, n] = sum(1 for x in ranks if x < n)
        yield p, counts
        drafter.accept([r.answer[p + 1]], r.features[n_prompt + p : n_prompt + p + 1])


def simulate(
    drafter: Any, replays: list[Replay], verify_seconds: Callable[[int, int], float]
) -> dict:
    """Speculative decoding replayed along the target's greedy answers, without the target: each
    step the drafter drafts its tree, greedy verification would accept the longest path spelling the
    answer's next tokens, and the step costs verify_seconds(tree size, tree depth) plus the
    drafter's own measured time. Exact for greedy decoding, so any drafter (dynamic and hybrid trees
    too) is scored on what it would really do."""
    steps = accepted = 0
    seconds = 0.0
    for r in replays:
        n_prompt = len(r.prompt)
        drafter.begin(r.prompt, r.answer[0], r.features[:n_prompt])
        p = 0
        while p < len(r.answer) - 1:
            t0 = time.perf_counter()
            nodes, tree = drafter.draft(r.answer[p])
            ids, node, k = nodes.tolist(), 0, 0
            while p + 1 + k < len(r.answer):
                node = next((c for c in tree.children[node] if ids[c] == r.answer[p + 1 + k]), None)
                if node is None:
                    break
                k += 1
            k = min(k, len(r.answer) - 2 - p)  # the answer's last token is a bonus, never a draft
            drafter.accept(
                r.answer[p + 1 : p + k + 2], r.features[n_prompt + p : n_prompt + p + k + 1]
            )
            seconds += time.perf_counter() - t0 + verify_seconds(tree.size, tree.max_depth)
            steps, accepted, p = steps + 1, accepted + k, p + k + 1
    tokens = steps + accepted
    return {"steps": steps, "tau": tokens / max(1, steps), "tok_s": tokens / max(1e-9, seconds)}


def _matching_chain(
    target_ids: list[int], parents: list[int], depths: list[int], want: list[int]
) -> list[int]:
    """The candidates whose whole path spells the target's next tokens: one per depth, until one
    is missing."""
    chain: list[int] = []
    parent = -1
    for d, token in enumerate(want, start=1):
        nxt = [
            c
            for c in range(len(target_ids))
            if parents[c] == parent and depths[c] == d and target_ids[c] == token
        ]
        if not nxt:
            break
        parent = nxt[0]
        chain.append(parent)
    return chain


def static_node_rates(
    drafter: Any, replays: list[Replay], top_k: int
) -> dict[tuple[int, ...], float]:
    """How often each static tree node (a path of per-position ranks) matches the target's next
    tokens, per position; `drafter` is a static-tree drafter (Medusa, DFlash) whose tree reaches the
    head's full depth."""
    counts: dict[tuple[int, ...], int] = {}
    steps = 0
    for r in replays:
        for _, path in static_matches_along(drafter, r, top_k):
            steps += 1
            for d in range(1, len(path) + 1):
                counts[path[:d]] = counts.get(path[:d], 0) + 1
    return {path: c / max(1, steps) for path, c in counts.items()}


@torch.no_grad()
def static_matches_along(drafter: Any, r: Replay, top_k: int) -> Any:
    """For each answer position p: p and the ranks of the target's next tokens among the drafter's
    guesses for each position ahead of the root, as far as they are among the top_k (every tree node
    that is a prefix of this path is accepted there)."""
    n_prompt = len(r.prompt)
    drafter.begin(r.prompt, r.answer[0], r.features[:n_prompt])
    for p in range(len(r.answer) - 1):
        logits = drafter.offset_logits(r.answer[p])  # [depth, draft vocab]
        top = drafter.heads.to_target_ids(
            logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices
        ).tolist()
        path: tuple[int, ...] = ()
        for d in range(len(top)):
            if p + 1 + d >= len(r.answer) or r.answer[p + 1 + d] not in top[d]:
                break
            path = path + (top[d].index(r.answer[p + 1 + d]),)
        yield p, path
        drafter.accept([r.answer[p + 1]], r.features[n_prompt + p : n_prompt + p + 1])


def best_static_trees(
    rates: dict[tuple[int, ...], float], sizes: list[int]
) -> dict[int, tuple[list[list[int]], float]]:
    """For each size, the nodes with the highest match rates (a child never beats its parent, so
    they form a tree) and the expected accepted drafts per step, their summed rates."""
    ranked = sorted(rates, key=lambda p: (-rates[p], len(p), p))
    out = {}
    for n in sizes:
        chosen = ranked[:n]
        if len(chosen) == n:
            out[n] = ([list(p) for p in chosen], sum(rates[p] for p in chosen))
    return out


@torch.inference_mode()
def draft_cost(drafter: Any, replay: Replay, positions: int = 12) -> float:
    """Median seconds per step in the drafter: one draft() plus the accept() of the verified
    tokens."""
    n_prompt = len(replay.prompt)
    drafter.begin(replay.prompt, replay.answer[0], replay.features[:n_prompt])
    t_draft, t_accept = [], []
    for p in range(min(positions, len(replay.answer) - 1)):
        t0 = time.perf_counter()
        drafter.draft(replay.answer[p])
        t1 = time.perf_counter()
        drafter.accept([replay.answer[p + 1]], replay.features[n_prompt + p : n_prompt + p + 1])
        t_draft.append(t1 - t0)
        t_accept.append(time.perf_counter() - t1)
    return statistics.median(t_draft) + statistics.median(t_accept) if t_draft else 0.0
