"""Hybrid trees: n-gram (prompt-lookup) branches beside neural ones, sized per step; greedy output
stays exact."""

from __future__ import annotations

import pytest
import torch

from headway.errors import HeadwayError
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.inference.cost_model import tree_cost, verify_costs
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.drafters.hybrid import (
    Candidate,
    HybridConfig,
    HybridDrafter,
    Rate,
    _most_likely,
)
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.drafters.ngram import Continuation, NgramIndex
from headway.inference.engines.tree import build_tree, tree_from_parents
from headway.inference.generate import greedy_generate, speculative_generate
from headway.inference.tune.replay import Replay, simulate
from tests.helpers.decode_helpers import chat_ids, load64
from tests.kinds.test_eagle import ARCHS, random_head


def linear_cost(per_node: float):
    return lambda n, depth: 1.0 + per_node * (n - 1)


def ngram_only(per_node: float = 0.0, **kw) -> HybridDrafter:
    return HybridDrafter(
        None, HybridConfig(node_cost=per_node, **kw), linear_cost(per_node), timed=False
    )


def test_ngram_lookup_takes_the_longest_match_most_recent_first():
    index = NgramIndex(1, 2)
    index.reset([1, 2, 3, 4, 1, 2, 5, 1])
    # the suffix (1, 2) (with the extra token 2) was followed by 5 (most recent) and by 3; the
    # 1-gram (2,) adds nothing new
    assert index.lookup([2], 3, 3) == [Continuation([5, 1, 2], 2), Continuation([3, 4, 1], 2)]
    assert index.lookup([2], 3, 1) == [Continuation([5, 1, 2], 2)]
    # only the 1-gram (1,) matches the suffix 1 -> 9
    assert index.lookup([9], 2, 3) == []
    grown = NgramIndex(1, 2)
    for t in [1, 2, 3, 4, 1, 2, 5, 1]:
        grown.extend([t])
    assert grown.follows == index.follows  # one token at a time builds the same index


def test_tree_from_parents_keeps_sibling_order():
    tree, order = tree_from_parents([-1, -1, 0, 2, 1])
    assert tree.paths == [(), (0,), (1,), (0, 0), (1, 0), (0, 0, 0)]
    assert order == [0, 1, 2, 4, 3]  # candidate behind each node after the root
    assert tree.parent == [-1, 0, 0, 1, 2, 3]


def test_neural_proposals_are_cut_to_the_most_likely_paths_with_their_parents():
    # root -> a (0.6), b (0.3), c (0.1); a -> d (0.9), e (0.1); b -> f (0.5); d -> g (1.0000001:
    # rounding above 1)
    ids = [10, 11, 12, 13, 14, 15, 16]
    probs = [0.6, 0.3, 0.1, 0.9, 0.1, 0.5, 1.0000001]
    parents = [-1, -1, -1, 0, 0, 1, 3]
    # paths: a .6, b .3, c .1, d .54, e .06, f .15, g .54 (its parent d first: same path, shallower)
    assert _most_likely(ids, probs, parents, 4) == (
        [10, 11, 13, 16],
        [0.6, 0.3, 0.9, 1.0000001],
        [-1, -1, 0, 2],
    )
    assert _most_likely(ids, probs, parents, 7) == (ids, probs, parents)


def test_hybrid_settings_are_checked():
    with pytest.raises(HeadwayError, match="min_ngram <= max_ngram"):
        HybridConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(HeadwayError, match="ngram_prior"):
        HybridConfig(ngram_prior=0.0)
    with pytest.raises(HeadwayError, match="memory must be in"):
        HybridConfig(memory=0.0)
    with pytest.raises(HeadwayError, match="gain_memory must be in"):
        HybridConfig(gain_memory=1.5)
    with pytest.raises(HeadwayError, match="probe_every <= probe_max"):
        HybridConfig(probe_every=0)
    with pytest.raises(HeadwayError, match="depth_probe_every must be >= 0"):
        HybridConfig(depth_probe_every=-1)


def test_acceptance_estimates_forget_at_the_configured_rate():
    kept, recent = Rate(0.5, 2.0), Rate(0.5, 2.0, memory=0.5)
    for hit in (True, True, False):
        kept.add(hit)
        recent.add(hit)
    assert kept.value == pytest.approx((1 + 2) / 5)  # prior 1 of 2, then 2 of 3
    # weights 0.125 (prior), 0.25, 0.5, 1 (the miss): (0.125 * 1 + 0.25 + 0.5) / (0.125 * 2 + 0.25 +
    # 0.5 + 1)
    assert recent.value == pytest.approx(0.875 / 2.0)


def test_tree_cost_prices_depth_between_the_flat_tree_and_the_chain():
    chain = {1: 10.0, 2: 12.0, 5: 20.0, 9: 40.0}
    flat = {1: 10.0, 2: 12.0, 5: 14.0, 9: 16.0}
    assert tree_cost(chain, flat, 1, 0) == 10.0 and tree_cost(chain, flat, 2, 1) == 12.0
    assert tree_cost(chain, flat, 5, 1) == 14.0 and tree_cost(chain, flat, 5, 4) == 20.0
    assert tree_cost(chain, flat, 5, 2) == pytest.approx(
        16.0
    )  # one level of three above the flat tree
    assert tree_cost(chain, flat, 7, 6) == pytest.approx(30.0) and tree_cost(
        chain, flat, 7, 1
    ) == pytest.approx(15.0)
    assert (
        verify_costs(chain, flat)(5, 2) == tree_cost(chain, flat, 5, 2)
        and verify_costs(chain)(5, 1) == 20.0
    )
    assert (
        tree_cost(chain, {**flat, 5: 25.0}, 5, 1) == 20.0
    )  # a flat tree measured above the chain: the chain's


def test_a_tree_stops_growing_where_its_depth_costs_more_than_it_brings():
    """Three siblings and a chain below the first, every edge 0.8 likely: where each level costs as
    much as the row-exact engine's extra attention call, the siblings alone pay; where depth is
    free, the whole tree does."""
    cands = [
        Candidate(10, -1, 1, [("k",)], {"ngram"}),
        Candidate(11, 0, 2, [("k",)], {"ngram"}),
        Candidate(12, 1, 3, [("k",)], {"ngram"}),
        Candidate(13, -1, 1, [("k",)], {"neural"}),
        Candidate(14, -1, 1, [("k",)], {"neural"}),
    ]
    chosen = {}
    for name, cost in {
        "depth-priced": lambda n, depth: 1.0 + 0.05 * n + 0.5 * max(depth - 1, 0),
        "depth-free": lambda n, depth: 1.0 + 0.05 * n,
    }.items():
        drafter = HybridDrafter(None, HybridConfig(), cost, timed=False)
        drafter.calibration.estimate = lambda keys: 0.8
        chosen[name] = drafter._choose(cands)[0]
    assert chosen == {"depth-priced": [0, 3, 4], "depth-free": [0, 3, 4, 1, 2]}


def test_budget_follows_confidence():
    """A copy the target keeps refusing stops being verified; one it keeps accepting grows to the
    whole copy."""
    prompt = [5, 6, 7, 8, 9] * 3
    refused = ngram_only(per_node=0.3)
    refused.begin(prompt, 5, torch.empty(0, 0))
    nodes, tree = refused.draft(5)
    assert tree.size > 1 and nodes.tolist()[1:3] == [6, 7]  # optimistic at first: the copy is tried
    for _ in range(12):
        nodes, tree = refused.draft(5)
        refused.accept(
            [42], torch.empty(0, 0)
        )  # the target wrote something else after 5, every time
    assert tree.size == 1  # now a plain step: the copy no longer pays for the larger verification

    taken = ngram_only(per_node=0.3, max_tokens=12)
    cycle = [5, 6, 7, 8, 9]  # the target keeps writing the cycle: every copied token is right
    taken.begin(cycle * 3, 5, torch.empty(0, 0))
    pos, sizes = 15, []
    for _ in range(8):
        nodes, tree = taken.draft(cycle[pos % 5])
        ids, node, accepted = nodes.tolist(), 0, []
        while node := next(
            (c for c in tree.children[node] if ids[c] == cycle[(pos + 1 + len(accepted)) % 5]), None
        ):
            accepted.append(ids[node])
        taken.accept(accepted + [cycle[(pos + 1 + len(accepted)) % 5]], torch.empty(0, 0))
        pos += len(accepted) + 1
        sizes.append(tree.size)
    assert sizes == sorted(sizes) and sizes[-1] >= sizes[0] + 3, (
        sizes
    )  # grows as the copy keeps being accepted
    steep = ngram_only(per_node=50.0)
    steep.begin(prompt, 5, torch.empty(0, 0))
    assert (
        steep.draft(5)[1].size == 1
    )  # nothing is worth a verification that costs 50x more per token


class FixedNeural:
    """A stand-in neural drafter that always proposes `token` (draft probability 0.9)."""

    feature_layers: list = []
    max_depth = 1
    expands_levels = False

    def __init__(self, token: int):
        self.token, self.heads, self.runs = token, torch.nn.Linear(1, 1), 0

    def begin(self, prompt, root, features) -> None:
        pass

    def accept(self, tokens, features) -> None:
        pass

    def proposals(self, root: int):
        self.runs += 1
        return [self.token], [0.9], [-1]


def test_the_neural_drafter_runs_only_while_it_pays():
    """Scored on what the target really wrote: a neural drafter whose token is always right runs
    every step; one that is always wrong (its node makes each verification cost 30% more for
    nothing) stops after a few steps, but for probes ever further apart; one that turns right is
    noticed at a probe and runs every step again. Its own time here is microseconds against the
    modelled 10 ms steps, so timing noise cannot move the outcome."""
    hc = HybridConfig()
    for script, steps in (("right", 48), ("wrong", 48), ("turns", 130)):
        neural = FixedNeural(7)
        drafter = HybridDrafter(neural, hc, lambda n, depth: 0.01 + 0.003 * (n - 1))
        drafter.calibration.estimate = lambda keys: (
            0.9
        )  # the tree always takes the neural node: the gate decides
        drafter.begin(
            list(range(100, 140)), 1, torch.empty(0, 0)
        )  # nothing repeats: no n-gram candidates
        ran = []
        for i in range(steps):
            before = neural.runs
            nodes, tree = drafter.draft(200 + i)
            ran.append(neural.runs - before)
            right = script == "right" or (script == "turns" and i >= 30)
            drafter.accept(([7] if right else []) + [1000 + i], torch.empty(0, 0))
        if script == "right":
            assert sum(ran) == steps and drafter.gate.gains[False].value > 1.2
        elif script == "wrong":
            assert sum(ran) <= hc.gain_steps + 4 and drafter.gate.gains[False].value < hc.gain_floor
        else:
            assert sum(ran[hc.gain_steps : 30]) <= 4 and all(ran[-40:]), ran


class FakeClock:
    """perf_counter for the hybrid: time moves only when a stand-in drafter spends it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class LevelledNeural:
    """A stand-in EAGLE drafter: one token per level (a chain 7, 8, 9, draft probabilities 0.95,
    0.5, 0.5), each level costing `level_cost` seconds of the fake clock and reported in
    level_seconds, as EagleDrafter's are."""

    feature_layers: list = []
    max_depth = 3
    expands_levels = True

    def __init__(self, clock: FakeClock, level_cost: float):
        self.clock, self.level_cost, self.heads = clock, level_cost, torch.nn.Linear(1, 1)
        self.level_seconds: list[float] = []
        self.depths: list[int] = []

    def begin(self, prompt, root, features) -> None:
        pass

    def accept(self, tokens, features) -> None:
        pass

    def proposals(self, root: int, depth=None):
        depth = depth or self.max_depth
        self.depths.append(depth)
        self.level_seconds = [self.level_cost * (d + 1) for d in range(depth)]
        self.clock.now += self.level_cost * depth
        return [7, 8, 9][:depth], [0.95, 0.5, 0.5][:depth], [-1, 0, 1][:depth]


@pytest.mark.parametrize(
    "level_cost, deep_right, best",
    [(1e-4, True, 3), (0.02, True, 1), (0.002, True, 3), (0.002, False, 1)],
    ids=["cheap-levels", "costly-levels", "deep-levels-right", "deep-levels-wrong"],
)
def test_the_neural_drafter_expands_as_deep_as_its_levels_pay(
    monkeypatch, level_cost, deep_right, best
):
    """Steps cost 10 ms + 1 ms a node and each level of the stand-in drafter `level_cost`, on a fake
    clock: where the deeper levels' tokens are right and cost less than they bring, the drafter
        expands all three
    levels; where they cost more (20 ms a level against ~16 ms of a step per token) or are wrong, it
    expands one, but for its probes."""
    from types import SimpleNamespace

    from headway.inference.drafters import hybrid as draft_hybrid

    clock = FakeClock()
    monkeypatch.setattr(draft_hybrid, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    hc = HybridConfig(
        gain_floor=0.0, depth_probe_every=8
    )  # the neural drafter always runs: depth is under test
    neural = LevelledNeural(clock, level_cost)
    drafter = HybridDrafter(neural, hc, lambda n, depth: 0.010 + 0.001 * (n - 1))
    drafter.begin(
        list(range(100, 140)), 1, torch.empty(0, 0)
    )  # nothing repeats: no n-gram candidates
    for i in range(48):
        nodes, tree = drafter.draft(200 + i)
        ids, node, accepted = nodes.tolist(), 0, []
        for token in [7, 8, 9] if deep_right else [7]:
            node = next((c for c in tree.children[node] if ids[c] == token), None)
            if node is None:
                break
            accepted.append(token)
        drafter.accept(accepted + [1000 + i], torch.empty(0, 0))
    assert drafter.depths.best == best, drafter.depths.ratio
    probes = neural.depths[::8]
    assert probes == [3] * len(probes)  # every 8th step expands every level
    assert [d for i, d in enumerate(neural.depths[16:], start=16) if i % 8] == [best] * 28
    assert drafter.depths.seconds[1] == pytest.approx(level_cost)


def test_drafting_depth_is_fixed_where_drafting_time_does_not_count(tiny_dirs):
    """Untimed hybrids (node_cost >= 0, tune's replays) and depth_probe_every=0 keep
    inference.depth."""
    t = load64(tiny_dirs["llama"])
    neural = EagleDrafter(random_head(t, "eagle3"), t.config.num_hidden_layers, 3, 3, 8)
    assert HybridDrafter(neural, HybridConfig(), linear_cost(0.1), timed=False).depths is None
    assert HybridDrafter(neural, HybridConfig(depth_probe_every=0), linear_cost(0.1)).depths is None
    assert HybridDrafter(neural, HybridConfig(), linear_cost(0.1)).depths.most == 3


def repetitive_ids(t) -> list[list[int]]:
    return [
        chat_ids(
            t,
            "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
        ),
        chat_ids(t, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_and_ngram_trees_are_exact(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    L = t.config.num_hidden_layers
    medusa = MedusaHeads(
        MedusaConfig(num_heads=3, lm_head="own"), t.config.hidden_size, t.config.vocab_size
    ).double()
    medusa.init_from_target(t.model)
    medusa.attach_target(t.model)
    for block in medusa.blocks:
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
    neurals = {
        "ngram": lambda: None,
        "eagle3": lambda: EagleDrafter(random_head(t, "eagle3"), L, 3, 3, 8),
        "medusa": lambda: MedusaDrafter(medusa, build_tree([[0], [1], [0, 0], [0, 0, 0]]), L),
    }
    for name, make in neurals.items():
        for per_node in (0.0, 0.2):
            drafter = HybridDrafter(
                make(),
                HybridConfig(node_cost=per_node, max_tokens=6, max_nodes=12),
                linear_cost(per_node),
                timed=False,
            )
            sources: dict[str, int] = {}
            for ids in repetitive_ids(t):
                ref = greedy_generate(t.model, ids, 40, [t.tokenizer.eos_token_id])
                spec = speculative_generate(t.model, drafter, ids, 40, [t.tokenizer.eos_token_id])
                assert spec.tokens == ref.tokens, (arch, name, per_node)
                for k, v in spec.sources.items():
                    sources[k] = sources.get(k, 0) + v
            assert sum(sources.values()) > 0, (
                arch,
                name,
            )  # drafts were accepted, so the trees were used
            assert set(sources) <= ({"ngram"} if name == "ngram" else {"ngram", "neural", "both"})


def test_simulation_equals_real_decoding(tiny_dirs):
    """simulate() (tune's replay) predicts exactly the steps and tau of real greedy decoding, hybrid
    trees too."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    L = t.config.num_hidden_layers
    from headway.inference.generate import features_at

    for make in (
        lambda: ngram_only(0.1),
        lambda: HybridDrafter(
            EagleDrafter(heads, L, 2, 3, 6),
            HybridConfig(node_cost=0.1),
            linear_cost(0.1),
            timed=False,
        ),
    ):
        for ids in repetitive_ids(t):
            real = speculative_generate(t.model, make(), ids, 30, [])
            seq = torch.tensor([ids + real.tokens[:-1]])
            hidden = t.model(seq, output_hidden_states=True).hidden_states
            drafter = make()
            replay = Replay(
                ids, real.tokens, features_at(hidden, drafter.feature_layers, slice(None))
            )
            sim = simulate(drafter, [replay], lambda n, depth: 1.0)
            assert sim["steps"] == real.target_forwards
            assert sim["tau"] == pytest.approx(real.tau)


def test_hybrid_prices_tree_depth_only_on_the_row_exact_engine(tiny_dirs, monkeypatch):
    """bf16 on the static engine verifies row by row (one attention call per depth level): there the
    drafter measures a flat tree besides the chain and prices depth; elsewhere a tree's cost is its
    size's. The curves are stand-ins (a tiny model's timings are noise), so only the choice of
    curves is under test."""
    from headway.inference import api
    from headway.inference.engines.runner import depth_matters
    from headway.run_config import RunConfig
    from headway.target.config import TargetConfig
    from headway.target.loading import load_target

    asked = []

    def curve(model, engine, most, saved=None, shape="chain"):
        asked.append(shape)
        return {
            n: (1.0 + 0.1 * n if shape == "chain" else 1.0 + 0.05 * n) for n in range(1, most + 1)
        }

    monkeypatch.setattr(api, "verify_cost_curve", curve)
    path = str(tiny_dirs["llama"])
    bf16 = load_target(
        TargetConfig(name_or_path=path, device="cpu", num_threads=1, dtype="bfloat16")
    )
    f32 = load_target(TargetConfig(name_or_path=path, device="cpu", num_threads=1, dtype="float32"))
    assert depth_matters(bf16.model, "static") and depth_matters(bf16.model, "auto")
    assert not depth_matters(bf16.model, "hf") and not depth_matters(f32.model, "static")
    cfg = RunConfig()
    cfg.inference.hybrid.max_nodes = 5
    drafter = api.make_hybrid(None, cfg.inference, bf16.model)
    assert sorted(asked) == ["chain", "flat"]
    assert drafter.verify_cost(6, 5) == pytest.approx(1.6) and drafter.verify_cost(
        6, 1
    ) == pytest.approx(1.3)
    asked.clear()
    drafter = api.make_hybrid(None, cfg.inference, f32.model)
    assert asked == ["chain"] and drafter.verify_cost(6, 5) == drafter.verify_cost(
        6, 1
    ) == pytest.approx(1.6)
