"""Targets of many families on the hf engine (the model's own forward through transformers).

Sliding-window families (Mistral with a window, Gemma-2, Gemma-3, gpt-oss) verify trees exactly at
any
length: the runner's cache keeps every key and each layer type gets its own mask, so greedy
    speculative
decoding equals plain greedy decoding, which equals the model's own `generate`, across the window.
The attention each family loads with (`target.attn_implementation=auto`), the training forward's
hidden states against the model's own, gpt-oss through distillation, training and decoding, and the
one-line refusals (explicit sdpa on a family without it; trees on recurrent caches).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from headway.errors import HeadwayError
from headway.inference.cost_model import verify_cost
from headway.inference.engines.hf import attention_windows, step_masks
from headway.inference.engines.runner import HFRunner
from headway.inference.engines.tree import Tree, build_tree
from headway.inference.generate import plain_generate, speculative_generate
from headway.target.config import TargetConfig
from headway.target.loading import attention_implementation, load_target
from headway.train.target_features import target_features
from tests.helpers.decode_helpers import float64_run, load64
from tests.helpers.tiny_models import make_tiny_model
from tests.helpers.train_helpers import small_run

WINDOWED = ("mistral_swa", "gemma2", "gemma3", "gpt_oss")
RECURRENT = ("falcon_h1", "qwen3_next", "lfm2")
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_model(f, root / f) for f in (*WINDOWED, *RECURRENT)}


def _window(model) -> int:
    return int(model.config.get_text_config().sliding_window)


class OracleDrafter:
    """Knows the greedy continuation and puts it on some branches, noise on others: accepted paths
    of every length and through every branch are kept, rejected ones dropped (the compaction runs
    for real)."""

    feature_layers = [0]
    max_depth = 4
    drafts_on_device = False
    node_sources = None

    def __init__(self, tree: Tree, reference: list[int], vocab: int, seed: int):
        self.tree, self.ref, self.vocab = tree, reference, vocab
        self.max_nodes = tree.size
        self.rng = random.Random(seed)
        self.pos = 1

    def begin(self, prompt, root, features):
        self.pos = 1

    def accept(self, tokens, features):
        assert len(features) == len(tokens)
        self.pos += len(tokens)

    def draft(self, root: int):
        tokens, right = [root], {0: True}
        for i, path in enumerate(self.tree.paths[1:], start=1):
            at = self.pos + len(path) - 1
            want = self.ref[at] if at < len(self.ref) else 0
            ok = right[self.tree.parent[i]] and self.rng.random() < 0.6
            tokens.append(
                want if ok else (want + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            )
            right[i] = ok
        return torch.tensor(tokens), self.tree


@pytest.mark.parametrize("family", WINDOWED)
def test_trees_verify_exactly_across_the_sliding_window(family_dirs, family: str):
    """float64: plain greedy through the runner equals the model's own generate, and speculative
    greedy equals plain, for a prompt shorter than the window that decodes past it and for one
    longer than the window."""
    t = load64(family_dirs[family])
    window = _window(t.model)
    vocab = t.config.get_text_config().vocab_size
    for prompt_len, new in ((20, window + 24), (window + 10, 30)):
        prompt = [(7 * i + 3) % (vocab - 20) + 10 for i in range(prompt_len)]
        plain = plain_generate(t.model, prompt, new, [], engine="hf")
        own = t.model.generate(
            torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )[0, prompt_len:]
        assert plain.tokens == own.tolist(), (family, prompt_len)
        spec = speculative_generate(
            t.model,
            OracleDrafter(build_tree(TREE), plain.tokens, vocab, 1),
            prompt,
            new,
            [],
            engine="hf",
        )
        assert spec.tokens == plain.tokens, (family, prompt_len)
        assert spec.target_forwards < plain.target_forwards  # trees were accepted past the window


def test_the_runner_keeps_every_key_and_masks_the_window(family_dirs):
    """The cache of a sliding layer holds every position; a tree node's sliding mask hides the keys
    more than window - 1 positions behind the node's own position (prefix + depth), the full layers'
    none."""
    t = load64(family_dirs["gemma2"])
    runner = HFRunner(t.model)
    runner.forward(torch.arange(10, 70))  # 60 > the window of 48
    assert all(layer.keys.shape[-2] == 60 for layer in runner.cache.layers)
    windows = attention_windows(t.model)
    assert windows == {"sliding_attention": 48, "full_attention": None}
    tree = build_tree([[0], [1], [0, 0]])
    pos = 60 + tree.depth
    masks = step_masks(windows, 60, pos, tree.ancestors, torch.float64)
    seen = {k: (m[0, 0] == 0) for k, m in masks.items()}
    assert seen["full_attention"][:, :60].all()
    for i, p in enumerate(pos.tolist()):  # node i sees prefix keys p - 47 .. 59
        assert seen["sliding_attention"][i, :60].nonzero().min().item() == p - 47
    assert torch.equal(seen["sliding_attention"][:, 60:], tree.ancestors)
    # Mistral-style configs (no layer types) share one mask
    assert attention_windows(load64(family_dirs["mistral_swa"]).model) == {"": 48}


def test_verify_cost_measures_past_the_window(family_dirs):
    """The hybrid drafter's cost curve measures after a 256-token prefix: longer than every window
    here."""
    for family in ("gemma3", "gpt_oss"):
        t = load_target(
            TargetConfig(name_or_path=str(family_dirs[family]), device="cpu", num_threads=1)
        )
        costs = verify_cost(t.model, [1, 4, 16], prefix_len=256, repeats=1, engine="hf")
        assert sorted(costs) == [1, 4, 16] and all(c > 0 for c in costs.values())


def test_attention_auto_per_family(family_dirs, monkeypatch):
    """auto: the family table's attention, else sdpa where the model class has it, else eager; an
    explicit sdpa on a family without it, and flex_attention on a CPU, are refused in one line
    before weights load."""
    from transformers import AutoConfig, BloomConfig

    assert TargetConfig().attn_implementation == "auto"
    expect = {"gemma2": "eager", "gpt_oss": "eager", "gemma3": "sdpa", "mistral_swa": "sdpa"}
    for family, attn in expect.items():
        config = AutoConfig.from_pretrained(family_dirs[family])
        assert attention_implementation("auto", config) == attn, family
    assert (
        attention_implementation("auto", BloomConfig()) == "eager"
    )  # not in the table, no SDPA class
    with pytest.raises(HeadwayError, match="BloomForCausalLM has no SDPA") as e:
        attention_implementation("sdpa", BloomConfig())
    assert "\n" not in str(e.value)

    for family in ("gemma2", "gpt_oss"):  # auto loads them (sdpa did not)
        t = load_target(
            TargetConfig(name_or_path=str(family_dirs[family]), device="cpu", num_threads=1)
        )
        assert t.model.config._attn_implementation == "eager"

    from transformers import AutoModelForCausalLM

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    for family, name in (("gemma2", "Gemma-2"), ("gpt_oss", "gpt-oss")):
        cfg = TargetConfig(
            name_or_path=str(family_dirs[family]), device="cpu", attn_implementation="sdpa"
        )
        with pytest.raises(HeadwayError, match=f"this {name} target") as e:
            load_target(cfg)
        assert "\n" not in str(e.value) and "auto or eager" in str(e.value)
    cfg = TargetConfig(
        name_or_path=str(family_dirs["gemma3"]), device="cpu", attn_implementation="flex_attention"
    )
    with pytest.raises(HeadwayError, match="CUDA devices only"):
        load_target(cfg)
    with pytest.raises(Exception, match="attn_implementation"):
        TargetConfig(attn_implementation="flash")


@pytest.mark.parametrize("family", WINDOWED)
def test_training_forward_equals_the_models_own(family_dirs, family: str):
    """The training forward (train/target_features.py, which may swap in its own attention) gives
    the model's own hidden states and logits, bit for bit, on batches shorter and longer than the
    window."""
    t = load64(family_dirs[family])
    n = t.config.get_text_config().num_hidden_layers
    for width in (40, _window(t.model) + 20):
        ids = torch.randint(10, 300, (2, width), generator=torch.Generator().manual_seed(width))
        hidden, logits = target_features(t.model, ids, list(range(n + 1)))
        own = t.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        for i in range(n + 1):
            assert torch.equal(hidden[i], own.hidden_states[i]), (family, width, i)
        assert torch.equal(logits, own.logits)


@pytest.mark.parametrize("family", RECURRENT)
def test_recurrent_caches_refuse_trees_in_one_line(family_dirs, family: str):
    """A recurrent layer's state cannot drop a rejected branch: plain decoding runs, a tree, a
    compaction or a rollback is one HeadwayError (never an AttributeError)."""
    t = load_target(
        TargetConfig(name_or_path=str(family_dirs[family]), device="cpu", num_threads=1)
    )
    prompt = list(range(10, 30))
    plain = plain_generate(t.model, prompt, 4, [], engine="hf")
    assert len(plain.tokens) == 4
    runner = HFRunner(t.model)
    runner.forward(torch.tensor(prompt))
    tree = build_tree([[0], [1]])
    for step in (
        lambda: runner.forward(torch.tensor([1, 2, 3]), tree),
        lambda: runner.keep(3, [0, 1]),
        lambda: runner.truncate(5),
        lambda: speculative_generate(
            t.model, OracleDrafter(tree, plain.tokens, 300, 0), prompt, 4, [], engine="hf"
        ),
    ):
        with pytest.raises(HeadwayError, match="recurrent") as e:
            step()
        assert "\n" not in str(e.value)


def test_gpt_oss_distils_trains_and_decodes_exactly(family_dirs, tmp_path: Path):
    """gpt-oss (attention sinks, sliding windows on alternate layers, MoE): distilled on the hf
    engine, EAGLE-3 trained 2 steps, decoded on the hf engine past its window, equal to plain greedy
    (float64)."""
    from headway.config import load_config
    from headway.data_scripts.distill import distill
    from headway.inference.api import SpeculativeDecoder
    from headway.run_config import RunConfig
    from headway.train.loop import train

    target = family_dirs["gpt_oss"]
    rows = [{"instruction": f"Question {i}: what is {i} plus {i + 1}?"} for i in range(6)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        RunConfig,
        None,
        [
            f"target.name_or_path={target}",
            "target.device=cpu",
            "target.num_threads=1",
            f"prompts.path={tmp_path / 'p.jsonl'}",
            f"distill.output_dir={tmp_path / 'ds'}",
            "distill.engine=hf",
            "distill.max_new_tokens=16",
            "distill.batch_size=3",
        ],
    )
    data = distill(cfg.target, cfg.prompts, cfg.distill, cfg.magpie)
    head_dir = train(
        small_run(
            target,
            data,
            tmp_path / "run",
            "head.kind=eagle3",
            "train.max_steps=2",
            "train.save_every=2",
        )
    )
    assert json.loads((head_dir / "config.json").read_text())["kind"] == "eagle3"
    decoder = SpeculativeDecoder.load(
        head_dir,
        # a fixed node cost sizes the hybrid's trees (test_verify_cost_measures_past_the_window
        # measures)
        float64_run(
            target,
            "target.num_threads=1",
            "inference.max_new_tokens=60",
            "inference.engine=hf",
            "inference.hybrid.node_cost=0.05",
        ),
    )
    result = decoder.chat("Question 3: what is 3 plus 4?")
    assert len(result.plain.tokens) == 60 and result.spec.tokens == result.plain.tokens
