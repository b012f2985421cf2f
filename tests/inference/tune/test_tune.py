"""`headway tune`: the replayed acceptance equals real verification step by step, the cost model and
the search, and the saved choice is what generate and bench then use (on this machine only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from headway.config import load_config
from headway.errors import HeadwayError
from headway.inference.api import SpeculativeDecoder
from headway.inference.config import TuneConfig
from headway.inference.cost_model import interpolate
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.engines.tree import build_tree, chain_choices
from headway.inference.generate import speculative_generate
from headway.inference.tune.replay import (
    best_static_trees,
    eagle_accepted_along,
    replay_answers,
    static_matches_along,
)
from headway.inference.tune.run import search
from headway.run_config import RunConfig
from tests.helpers.decode_helpers import float64_run
from tests.helpers.train_helpers import small_run

PROMPTS = [
    "Question 3: what is 3 plus 4?",
    "Question 5: what is 5 plus 6? Tell me a story about it.",
]


@pytest.fixture(scope="module")
def trained_heads(tiny_dirs, tiny_data, tmp_path_factory) -> dict[str, Path]:
    """Small EAGLE-3, DFlash and Medusa heads for the tiny Llama: trained enough to accept drafts on
    its answers."""
    from headway.train.loop import train

    root = tmp_path_factory.mktemp("tune-heads")
    return {
        "eagle3": train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                root / "e3",
                "head.kind=eagle3",
                "head.eagle3.draft_vocab_size=64",
                "head.eagle3.ttt_steps=3",
                "train.max_steps=12",
            )
        ),
        "dflash": train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                root / "d",
                "head.kind=dflash",
                "head.dflash.draft_vocab_size=64",
                "head.dflash.block_size=4",
                "train.max_steps=12",
            )
        ),
        "medusa": train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                root / "m",
                "head.kind=medusa",
                "head.medusa.num_heads=3",
                "train.max_steps=12",
            )
        ),
    }


def _decoder(tiny_dirs, head: Path, *extra: str) -> SpeculativeDecoder:
    return SpeculativeDecoder.load(
        head, float64_run(tiny_dirs["llama"], "target.num_threads=1", *extra)
    )


def _root_positions(accepted: list[int]) -> list[int]:
    """Answer index of each verification's root: every step moves past its accepted drafts and the
    bonus."""
    out, p = [], 0
    for a in accepted:
        out.append(p)
        p += a + 1
    return out


def test_replayed_eagle_acceptance_equals_real_verification(tiny_dirs, trained_heads):
    """At every position where real decoding verified a tree, the replay predicts exactly how many
    drafts it accepted, for several (depth, top_k, total_tokens) scored by one expansion per
    top_k."""
    d = _decoder(
        tiny_dirs, trained_heads["eagle3"], "inference.use_tuned=false", "inference.drafter=neural"
    )
    prompts = [d.fmt.first_turn(p) for p in PROMPTS]
    replays = replay_answers(d, prompts, 24)
    num_layers = d.target.config.num_hidden_layers
    settings = [(1, 1, 1), (3, 2, 4), (4, 4, 10), (2, 4, 20)]
    seen_accepts = 0
    for r in replays:
        along = dict(eagle_accepted_along(d.drafter, r, [1, 2, 3, 4], [1, 2, 4], [1, 4, 10, 20]))
        for depth, k, n in settings:
            drafter = EagleDrafter(d.heads, num_layers, depth, k, n)
            real = speculative_generate(d.target.model, drafter, r.prompt, 24, d.fmt.stop_ids)
            assert real.tokens == r.answer
            for p, acc in zip(_root_positions(real.accepted), real.accepted):
                assert along[p][depth, k, n] == acc, (depth, k, n, p)
                seen_accepts += acc
    assert (
        seen_accepts > 0
    )  # the trained head accepts drafts here, so the comparison is not vacuous


@pytest.mark.parametrize("kind", ["medusa", "dflash"])
def test_replayed_static_tree_matches_equal_real_verification(tiny_dirs, trained_heads, kind: str):
    """Static trees (Medusa's heads, DFlash's block slots): the ranks replayed along the target's
    answers accept exactly what real verification accepts, for any tree; and the tune search's best
    tree decodes exactly."""
    d = _decoder(
        tiny_dirs,
        trained_heads[kind],
        "inference.use_tuned=false",
        "inference.tree=[[0],[1],[0,0]]",
        "inference.drafter=neural",
    )
    L = d.target.config.num_hidden_layers
    Drafter = type(d.drafter)
    replays = replay_answers(d, [d.fmt.first_turn(p) for p in PROMPTS], 24)
    tree_choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = Drafter(d.heads, build_tree(tree_choices), L)
    nodes = {tuple(c) for c in tree_choices}
    seen = 0
    for r in replays:
        along = dict(
            static_matches_along(
                Drafter(d.heads, build_tree(chain_choices(d.heads.draft_depth)), L), r, 8
            )
        )
        real = speculative_generate(d.target.model, drafter, r.prompt, 24, d.fmt.stop_ids)
        for p, acc in zip(_root_positions(real.accepted), real.accepted):
            assert sum(1 for k in range(1, len(along[p]) + 1) if along[p][:k] in nodes) == acc
            seen += acc
    assert seen > 0
    best = search(
        d, replays, lambda n, depth: 1e-3 * (1 + 0.1 * n), TuneConfig(static_nodes=[1, 3, 6])
    )[0]
    tuned = Drafter(d.heads, build_tree(best["inference"]["tree"]), L)
    for r in replays:
        assert (
            speculative_generate(d.target.model, tuned, r.prompt, 24, d.fmt.stop_ids).tokens
            == r.answer
        )


def test_best_static_trees_take_the_most_frequent_matches():
    rates = {(0,): 0.5, (1,): 0.2, (0, 0): 0.3, (0, 1): 0.1, (0, 0, 0): 0.25, (2,): 0.05}
    trees = best_static_trees(rates, [1, 3, 5, 9])
    assert trees[1] == ([[0]], 0.5)
    assert trees[3][0] == [[0], [0, 0], [0, 0, 0]] and trees[3][1] == pytest.approx(1.05)
    assert trees[5][0] == [[0], [0, 0], [0, 0, 0], [1], [0, 1]]
    assert 9 not in trees  # fewer nodes ever matched than that
    build_tree(trees[5][0])  # a valid tree: every node's parent is in it


def test_cost_interpolation():
    costs = {1: 1.0, 4: 2.5, 8: 3.0}
    assert interpolate(costs, 1) == 1.0 and interpolate(costs, 2) == pytest.approx(1.5)
    assert interpolate(costs, 6) == pytest.approx(2.75) and interpolate(costs, 12) == pytest.approx(
        3.5
    )


def test_tune_settings_are_checked():
    with pytest.raises(HeadwayError, match="tune.depths"):
        TuneConfig(depths=[0, 2])
    with pytest.raises(HeadwayError, match="tune.num_prompts"):
        TuneConfig(num_prompts=0)


def test_renamed_tune_keys_still_load(tmp_path: Path):
    """A run config saved before issue 54 (tune.medusa_nodes, tune.medusa_top_k) loads into the
    renamed fields, from a file and from the command line; setting an old key and its new name
    together is an error."""
    saved = tmp_path / "config.yaml"
    saved.write_text("tune:\n  medusa_nodes: [2, 5]\n  medusa_top_k: 3\n")
    cfg = load_config(RunConfig, saved)
    assert cfg.tune.static_nodes == [2, 5] and cfg.tune.static_top_k == 3
    assert load_config(RunConfig, None, ["tune.medusa_top_k=4"]).tune.static_top_k == 4
    # the command line's new key wins over the file's old one, as any later layer does
    assert load_config(RunConfig, saved, ["tune.static_top_k=6"]).tune.static_top_k == 6
    with pytest.raises(HeadwayError, match="sets both tune.medusa_top_k and tune.static_top_k"):
        load_config(RunConfig, None, ["tune.medusa_top_k=4", "tune.static_top_k=5"])


def _headway(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "headway", *args], capture_output=True, text=True, timeout=600
    )


def test_tune_saves_a_choice_that_generate_and_bench_use(tiny_dirs, trained_heads, tmp_path: Path):
    import shutil

    head = tmp_path / "head"
    shutil.copytree(trained_heads["eagle3"], head)
    target = [
        f"target.name_or_path={tiny_dirs['llama']}",
        "target.num_threads=1",
        "target.dtype=float64",
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p, "category": c}) + "\n"
            for p, c in zip(PROMPTS, ["math", "story"])
        )
    )
    res = _headway(
        "tune",
        "--head",
        str(head),
        "--prompts",
        str(prompts),
        *target,
        "tune.max_new_tokens=16",
        "tune.repeats=1",
        "tune.depths=[1,2,3]",
        "tune.top_ks=[1,2]",
        "tune.total_tokens=[1,2,4,6]",
        "tune.verify_sizes=[1,2,4,8]",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    entry = json.loads((head / "tuned.json").read_text())["entries"][0]
    chosen = entry["chosen"]["inference"]
    assert (
        set(chosen) == {"depth", "top_k", "total_tokens", "drafter"}
        and entry["machine"]["threads"] == 1
    )
    # every drafter kind was replayed along the calibration answers; the fastest is the choice
    replayed = entry["drafters"]
    assert sorted(d["drafter"] for d in replayed) == ["hybrid", "neural", "ngram"]
    assert chosen["drafter"] == replayed[0]["drafter"] and replayed[0]["tok_s"] == max(
        d["tok_s"] for d in replayed
    )
    assert entry["machine"]["dtype"] == "torch.float64" and entry["machine"]["device"] == "cpu"
    assert entry["top_candidates"][0]["tok_s"] == max(c["tok_s"] for c in entry["top_candidates"])
    v = entry["validation"]
    assert v["tuned"]["matches_plain"] == 1.0 and v["configured"]["matches_plain"] == 1.0
    assert "saved in" in res.stdout and "tuned/configured" in res.stdout

    runs = iter(range(100))

    def bench_drafter(*extra: str) -> dict:
        out = tmp_path / f"b{next(runs)}.json"  # (bench never writes over an earlier result)
        r = _headway(
            "bench",
            "--head",
            str(head),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            *target,
            "inference.max_new_tokens=8",
            "bench.baselines=[]",
            "bench.plot=false",
            *extra,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(out.read_text())["settings"]["drafter"]

    used = bench_drafter()
    assert used["drafter"] == chosen["drafter"]  # the tuned choice is the default here
    if chosen["drafter"] != "ngram":  # (an n-gram tree has no neural settings)
        assert {k: used[k] for k in chosen} == chosen
    assert bench_drafter("inference.depth=4")["depth"] == 4  # a tree set on the command line wins
    assert (
        bench_drafter("inference.use_tuned=false")["total_tokens"] == 15
    )  # the configured default
    entry["machine"]["processor"] = "another machine"  # tuned elsewhere: not used here
    (head / "tuned.json").write_text(json.dumps({"entries": [entry]}))
    assert bench_drafter()["total_tokens"] == 15
