"""The trees `headway tune` searches, one space per drafter family, each scored by replaying the
head along the target's answers (`replay`) and priced with this machine's verify cost
(`cost_model`)."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from headway.inference.config import TuneConfig
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.engines.tree import build_tree, chain_choices
from headway.inference.tune.replay import (
    Replay,
    best_static_trees,
    draft_cost,
    eagle_acceptance,
    static_node_rates,
)

Cost = Callable[[int, int], float]  # (verified tokens, tree depth) -> seconds


def candidate(settings: dict, nodes: int, accepted: float, verify_s: float, draft_s: float) -> dict:
    """One scored tree setting: the inference keys it sets, its size, and its expected tau, times
    and tokens/s."""
    step = verify_s + draft_s
    return {
        "inference": settings,
        "draft_nodes": nodes,
        "expected_tau": 1 + accepted,
        "verify_ms": 1e3 * verify_s,
        "draft_ms": 1e3 * draft_s,
        "tok_s": (1 + accepted) / step,
    }


class StaticTrees:
    """Static trees (Medusa's heads, DFlash's block slots): for each size in tune.static_nodes, the
    nodes (paths of per-position ranks) that matched the target's next tokens most often."""

    def verify_sizes(self, tc: TuneConfig) -> list[int]:
        return [n + 1 for n in tc.static_nodes]

    def candidates(
        self,
        heads: Any,
        drafter: Any,
        replays: list[Replay],
        cost: Cost,
        tc: TuneConfig,
        num_layers: int,
    ) -> list[dict]:
        """Every tree size's best tree, scored; `drafter` (the decoder's own) gives the drafter
        class."""
        deep = type(drafter)(heads, build_tree(chain_choices(heads.draft_depth)), num_layers)
        trees = best_static_trees(
            static_node_rates(deep, replays, tc.static_top_k), tc.static_nodes
        )
        out = []
        for n, (choices, acc) in trees.items():
            d_cost = draft_cost(type(drafter)(heads, build_tree(choices), num_layers), replays[0])
            depth = max((len(c) for c in choices), default=0)
            out.append(
                candidate({"tree": choices, "tree_nodes": 0}, n, acc, cost(n + 1, depth), d_cost)
            )
        return out


class EagleTrees:
    """EAGLE-2 dynamic trees: every (depth, top_k, total_tokens) of the tune section; one expansion
    per top_k at the deepest depth scores every depth and size."""

    def verify_sizes(self, tc: TuneConfig) -> list[int]:
        return [n + 1 for n in tc.total_tokens]

    def candidates(
        self,
        heads: Any,
        drafter: Any,
        replays: list[Replay],
        cost: Cost,
        tc: TuneConfig,
        num_layers: int,
    ) -> list[dict]:
        """Every setting, scored; `drafter` is the decoder's EAGLE drafter, replayed for the
        acceptance."""
        top_ks = [k for k in tc.top_ks if k <= heads.draft_vocab_size]
        acc = eagle_acceptance(drafter, replays, tc.depths, top_ks, tc.total_tokens)
        d_costs = {}
        for d in tc.depths:
            for k in top_ks:
                n_max = max(n for (dd, kk, n) in acc if dd == d and kk == k)
                d_costs[d, k] = draft_cost(EagleDrafter(heads, num_layers, d, k, n_max), replays[0])
        return [
            candidate(
                {"depth": d, "top_k": k, "total_tokens": n},
                n,
                a,
                cost(n + 1, min(d, n)),
                d_costs[d, k],
            )
            for (d, k, n), a in acc.items()
        ]


class TreeSpace(Protocol):
    """The trees `headway tune` searches for a kind."""

    def verify_sizes(self, tc: TuneConfig) -> list[int]:
        """The verified-token counts whose cost the search needs measured."""

    def candidates(
        self,
        heads: Any,
        drafter: Any,
        replays: list,
        cost: Cost,
        tc: TuneConfig,
        num_layers: int,
    ) -> list[dict]:
        """Every candidate tree setting, scored (`candidate`)."""


# kind -> its search space (every kind of kinds/registry.py has one; tests/headway/test_structure.py
# checks)
TREE_SPACES: dict[str, TreeSpace] = {
    "medusa": StaticTrees(),
    "eagle": EagleTrees(),
    "eagle3": EagleTrees(),
    "dflash": StaticTrees(),
}
