"""A micro-batch's saved-for-backward memory grows linearly with its length, at the default target's
shapes.

On the meta device (nothing computed), every tensor autograd keeps for backward is counted while a
head's loss is built on one sequence of 512 to 8,192 tokens. With the memory settings
(train.ttt_attention= recompute, train.loss_chunk) the bytes each added token costs stay the same
from short to long batches; the weight-sized tensors a batch keeps whatever its length (the chunked
loss's lm_head gradient) are the difference between two lengths' totals, so the per-token figure is
that difference over the added tokens. The structured attention, which keeps its scores, is shown
growing with the length as the contrast.
"""

from __future__ import annotations

import pytest
import torch

from headway.config import load_config
from headway.run_config import RunConfig
from headway.train.distributed import HeadObjective
from headway.train.objectives import OBJECTIVES, Features
from headway.train.setup_heads import build_heads, feature_layers
from headway.train.step import plan_batch
from headway.train.target_features import target_features
from tests.train.test_flops import SMOLLM2, samples, target_on

KINDS = {"medusa": [], "eagle": ["head.eagle.feature_noise=0"], "eagle3": [], "dflash": []}


@pytest.fixture(scope="module")
def cpu_target():
    return target_on("cpu")


def saved_bytes(kind: str, width: int, attention: str, chunk: int, cpu_target) -> int:
    """Bytes autograd keeps for backward (parameters excluded) for one sequence of `width`
    tokens."""
    cfg = load_config(RunConfig, None, [f"head.kind={kind}", *KINDS[kind]])
    batch = samples(1, width, SMOLLM2["vocab_size"])
    torch.manual_seed(0)
    heads = build_heads(cfg.head, None, cpu_target, batch).to("meta")
    target = target_on("meta")
    heads.attach_target(target.model)
    objective = OBJECTIVES[kind](heads.cfg, seed=0, loss_chunk=chunk, ttt_attention=attention)
    meta = {k: v.to("meta") for k, v in plan_batch(batch, 0, objective).items()}
    t2d = None
    if heads.d2t is not None:
        t2d = torch.full((SMOLLM2["vocab_size"],), -1, dtype=torch.long)
        t2d[heads.d2t] = torch.arange(len(heads.d2t))
        t2d = t2d.to("meta")
    with torch.no_grad():
        hidden, logits = target_features(
            target.model, meta["input_ids"], feature_layers(cfg.head, target)
        )
    # by object, each held here until counted: an id alone could be reused by a tensor made after
    # one is freed
    kept: dict[int, tuple[torch.Tensor, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            kept[id(t)] = (t, t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        HeadObjective(heads, objective)(meta, Features(hidden, logits, model=target.model), t2d)
    return sum(size for _, size in kept.values())


def per_token(kind: str, short: int, long: int, attention: str, chunk: int, cpu_target) -> float:
    return (
        saved_bytes(kind, long, attention, chunk, cpu_target)
        - saved_bytes(kind, short, attention, chunk, cpu_target)
    ) / (long - short)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_saved_bytes_per_token_stay_flat_from_512_to_8192_tokens(kind: str, cpu_target):
    short = per_token(kind, 512, 1024, "recompute", 4096, cpu_target)
    long = per_token(kind, 4096, 8192, "recompute", 4096, cpu_target)
    assert long == pytest.approx(short, rel=0.10), (
        f"{short / 1024:.0f} KiB/token short, {long / 1024:.0f} long"
    )


def test_the_structured_attention_keeps_scores_that_grow_with_the_length(cpu_target):
    short = per_token("eagle3", 512, 1024, "structured", 0, cpu_target)
    long = per_token("eagle3", 4096, 8192, "structured", 0, cpu_target)
    assert long > 2 * short
