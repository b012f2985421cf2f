"""The static engine: the same logits and hidden states as the model's own forward (prefill, tree, compaction),
the same tokens in plain and speculative decoding, and a clear refusal where it does not apply."""

from __future__ import annotations

import pytest
import torch

from headway.errors import HeadwayError
from headway.heads.target import TargetConfig, load_target
from headway.inference.draft_eagle import EagleDrafter
from headway.inference.engine import HFRunner, StaticRunner, make_runner, static_supported
from headway.inference.generate import greedy_generate, speculative_generate
from headway.inference.tree import build_tree
from test_eagle import chat_ids, random_head

STATIC = ["llama", "qwen2", "mistral"]


def load64(path):
    return load_target(TargetConfig(name_or_path=str(path), device="cpu", num_threads=1, dtype="float64"))


@pytest.mark.parametrize("arch", STATIC)
@torch.inference_mode()
def test_static_runner_matches_the_model_forward(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    assert static_supported(t.model)
    hf, static = HFRunner(t.model), StaticRunner(t.model, 64)
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    steps = [(torch.arange(10, 40), None, None), (torch.tensor([5, 6, 7, 8, 9, 10]), tree, [0, 1, 3]),
             (torch.tensor([11]), None, None), (torch.tensor([3, 4, 5, 6, 7, 8]), tree, [0, 2, 4, 5])]
    for ids, t_, keep in steps:
        (la, ha), (lb, hb) = hf.forward(ids, t_, hidden=True), static.forward(ids, t_, hidden=True)
        assert len(ha) == len(hb) == t.config.num_hidden_layers + 1
        assert torch.allclose(la, torch.stack([lb[i] for i in range(len(lb))]), atol=1e-10, rtol=0)
        assert all(torch.allclose(x, y, atol=1e-10, rtol=0) for x, y in zip(ha, hb))
        if keep:
            hf.keep(tree.size, keep)
            static.keep(tree.size, keep)
        assert hf.length == static.length


@pytest.mark.parametrize("arch", STATIC)
def test_static_and_dynamic_paths_give_the_same_tokens(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    heads = random_head(t, "eagle3")
    drafter = EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8)
    stop = [t.tokenizer.eos_token_id]
    for text in ["What is two plus three?", "Write a short poem about the sea."]:
        ids = chat_ids(t, text)
        ref = greedy_generate(t.model, ids, 32, stop, engine="hf")
        assert greedy_generate(t.model, ids, 32, stop, engine="static").tokens == ref.tokens
        for engine in ("hf", "static"):
            assert speculative_generate(t.model, drafter, ids, 32, stop, engine=engine).tokens == ref.tokens


def test_static_engine_is_refused_where_it_does_not_apply(tiny_dirs):
    t = load64(tiny_dirs["gemma3"])
    assert not static_supported(t.model)
    assert isinstance(make_runner(t.model, 32, "auto"), HFRunner)
    with pytest.raises(HeadwayError, match=r"inference.engine=static supports llama, qwen2, mistral .* not this "
                                           r"'gemma3\w*' target: use inference.engine=auto or hf"):
        make_runner(t.model, 32, "static")
