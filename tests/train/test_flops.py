"""The analytic FLOP count behind throughput and MFU (train/flops.py) against torch's
FlopCounterMode.

At the default target's real shapes (SmolLM2-135M: hidden 576, 30 layers, 9 query and 3 key/value
heads, MLP 1536, vocabulary 49152), on the meta device, so nothing is computed: a micro-batch's
target forward plus each head kind's forward and backward, counted by FlopCounterMode, and by the
count the run logs.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from headway.config import load_config
from headway.run_config import RunConfig
from headway.train.data import Sample
from headway.train.distributed import HeadObjective
from headway.train.flops import counter
from headway.train.objectives import OBJECTIVES, Features
from headway.train.setup_heads import build_heads, feature_layers
from headway.train.step import plan_batch
from headway.train.target_features import target_features

SMOLLM2 = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
)
KINDS = {
    "medusa": ["head.medusa.num_heads=3"],
    "eagle": ["head.eagle.feature_noise=0"],
    "eagle3": ["head.eagle3.ttt_steps=3"],
    "dflash": [],
}


def target_on(device: str) -> SimpleNamespace:
    """The default target's architecture as `build_heads` reads a target: on the meta device (no
    weights), or on the CPU with its memory left uninitialised (a head copies weights from it; their
    values do not matter here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    if device != "meta":
        model = model.to_empty(device=device)
    model.requires_grad_(False)
    return SimpleNamespace(config=config, model=model, device=torch.device(device), fingerprint={})


def samples(n: int, width: int, vocab: int) -> list[Sample]:
    """Sequences of up to `width` tokens (padding), their answers starting at a random point."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        length = width - 37 * i
        prompt = rng.randrange(8, length // 2)
        ids = [rng.randrange(vocab) for _ in range(length)]
        out.append(Sample(ids, [0] * prompt + [1] * (length - prompt), f"s#{i}"))
    return out


@pytest.mark.parametrize("kind,lm_head", [(k, True) for k in sorted(KINDS)] + [("eagle3", False)])
def test_the_logged_flops_match_torchs_count_at_the_default_targets_shapes(
    kind: str, lm_head: bool
):
    """(lm_head False: train.target_argmax=data, the target's full lm_head skipped.)"""
    cfg = load_config(RunConfig, None, [f"head.kind={kind}", *KINDS[kind]])
    batch = samples(2, 512, SMOLLM2["vocab_size"])
    torch.manual_seed(0)
    heads = build_heads(cfg.head, None, target_on("cpu"), batch).to("meta")
    target = target_on("meta")
    heads.attach_target(target.model)

    objective = OBJECTIVES[kind](heads.cfg, seed=0)
    planned = plan_batch(batch, 0, objective)
    analytic = counter(objective, heads, target, online=True, lm_head=lm_head)(planned)

    meta = {k: v.to("meta") for k, v in planned.items()}
    t2d = None
    if heads.d2t is not None:
        t2d = torch.full((SMOLLM2["vocab_size"],), -1, dtype=torch.long)
        t2d[heads.d2t] = torch.arange(len(heads.d2t))
        t2d = t2d.to("meta")
    with FlopCounterMode(display=False) as flops:
        with torch.no_grad():
            layers = feature_layers(cfg.head, target)
            hidden, logits = target_features(
                target.model, meta["input_ids"], layers, logits=lm_head
            )
        argmax = None if lm_head else meta["input_ids"]
        feats = Features(hidden, logits, model=target.model, argmax=argmax)
        loss, _ = HeadObjective(heads, objective)(meta, feats, t2d)
        loss.backward()
    measured = flops.get_total_flops()
    assert measured > 0
    print(
        f"{kind}: analytic {analytic:.5g}, FlopCounterMode {measured:.5g}, ratio {analytic / measured:.4f}"
    )
    assert analytic == pytest.approx(measured, rel=0.05), (
        f"analytic {analytic:.4g} vs counted {measured:.4g}"
    )
