"""Greedy speculative decoding writes exactly what plain greedy decoding writes (float64, 4
archs)."""

from __future__ import annotations

import random

import pytest
import torch

from headway.errors import HeadwayError
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.engines.tree import best_tree, build_tree, chain_choices
from headway.inference.generate import greedy_generate, speculative_generate
from tests.helpers.decode_helpers import load64

WIDE_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


def prompts_for(tok) -> list[list[int]]:
    texts = ["What is two plus three?", "Write a short poem about the sea.", "def add(a, b):"]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in texts
    ]


class OracleDrafter:
    """Knows the greedy continuation; puts it on some branches and noise on others, so accepted
    paths have every length, through every branch: the cache compaction is exercised for real."""

    feature_layers = [0]
    max_depth = 4
    drafts_on_device = False
    node_sources = None

    def __init__(self, tree, reference: list[int], vocab: int, seed: int):
        self.tree, self.ref, self.vocab = tree, reference, vocab
        self.max_nodes = tree.size
        self.rng = random.Random(seed)
        self.pos = 1  # index in the reference of the token after the current root

    def begin(self, prompt, root, features):
        self.pos = 1

    def accept(self, tokens, features):
        assert len(features) == len(tokens)
        self.pos += len(tokens)

    def draft(self, root: int):
        tokens = [root]
        correct = {0: True}
        for i, path in enumerate(self.tree.paths[1:], start=1):
            parent = self.tree.parent[i]
            want = (
                self.ref[self.pos + len(path) - 1]
                if self.pos + len(path) - 1 < len(self.ref)
                else 0
            )
            right = (
                correct[parent]
                and self.rng.random() < 0.6
                and (path[-1] == 0 or self.rng.random() < 0.5)
            )
            tokens.append(
                want if right else (want + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            )
            correct[i] = right and tokens[-1] == want
        return torch.tensor(tokens), self.tree


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_medusa_untrained_heads_are_exact(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    torch.manual_seed(0)
    hidden, vocab = t.config.hidden_size, t.config.vocab_size
    for lm_head in ("own", "shared", "reduced"):
        heads = MedusaHeads(
            MedusaConfig(num_heads=4, lm_head=lm_head, draft_vocab_size=64), hidden, vocab
        ).double()
        heads.init_from_target(t.model)
        heads.attach_target(t.model)
        for block in heads.blocks:  # random, not identity: the guesses differ per head
            torch.nn.init.normal_(block[0].linear.weight, std=0.5)
        drafter = MedusaDrafter(heads, build_tree(WIDE_TREE), t.config.num_hidden_layers)
        for prompt in prompts_for(t.tokenizer):
            ids = t.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ref = greedy_generate(t.model, ids, 40, [t.tokenizer.eos_token_id])
            spec = speculative_generate(t.model, drafter, ids, 40, [t.tokenizer.eos_token_id])
            assert spec.tokens == ref.tokens, (arch, lm_head)
            hf = t.model.generate(
                torch.tensor([ids]),
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=t.tokenizer.eos_token_id,
                pad_token_id=t.tokenizer.pad_token_id,
            )
            assert ref.tokens == hf[0, len(ids) :].tolist()[: len(ref.tokens)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_accepted_paths_of_every_length_keep_output_exact(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    tree = build_tree(WIDE_TREE)
    for seed, prompt in enumerate(prompts_for(t.tokenizer)):
        ids = t.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref = greedy_generate(t.model, ids, 48, []).tokens
        oracle = OracleDrafter(tree, ref, t.config.vocab_size, seed)
        res = speculative_generate(t.model, oracle, ids, 48, [])
        assert res.tokens == ref
        assert max(res.accepted) >= 3 and min(res.accepted) == 0, (
            res.accepted
        )  # long and empty acceptances
        assert res.tau > 1.5


def test_chain_and_bad_trees():
    assert build_tree(chain_choices(3)).paths == [(), (0,), (0, 0), (0, 0, 0)]
    tree = build_tree(WIDE_TREE)
    assert tree.size == 10 and tree.max_depth == 4 and tree.topk_per_depth() == [3, 2, 1, 1]
    assert tree.ancestors[7].nonzero().flatten().tolist() == [
        0,
        1,
        4,
        7,
    ]  # (0,0,0) sees (0,0), (0), root
    with pytest.raises(HeadwayError, match=r"tree choice \[0, 1\] has no parent \[0\]"):
        build_tree([[0, 1]])


def test_trees_verify_exactly_past_a_sliding_window(tiny_dirs):
    """A sequence that passes Gemma-3's 128-token window: the hf runner keeps every key and masks
    each layer type by position, so a tree verified past the window gives plain greedy's tokens."""
    t = load64(tiny_dirs["gemma3"])
    heads = MedusaHeads(
        MedusaConfig(num_heads=2, lm_head="own"), t.config.hidden_size, t.config.vocab_size
    ).double()
    drafter = MedusaDrafter(heads, build_tree(chain_choices(2)), t.config.num_hidden_layers)
    prompt = [random.Random(0).randrange(3, 300) for _ in range(100)]
    spec = speculative_generate(t.model, drafter, prompt, 40, [])
    assert spec.tokens == greedy_generate(t.model, prompt, 40, []).tokens


def test_best_tree_picks_the_most_likely_paths():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.1, 0.05]]
    tree = best_tree(acc, 4)
    # values: (0)=.6 (0,0)=.3 (1)=.2 (0,1)=.06 (2)=.1 (1,0)=.1 -> top 4: (0), (0,0), (1), then (2)
    # or (1,0) at 0.1
    assert tree[:3] == [[0], [0, 0], [1]] and tree[3] in ([2], [1, 0])
    built = build_tree(tree)  # always a valid tree
    assert built.size == 5
    assert best_tree(acc, 100) == best_tree(acc, 12)  # capped by what exists: 3 + 3*3 paths
    assert len(best_tree(acc, 100)) == 12
