"""DFlash: a block drafter that guesses every position of a block in one forward, over the target's
fused context features."""

from __future__ import annotations

from dataclasses import replace

from headway.heads.dflash import DFlashConfig, DFlashHead
from headway.heads.eagle3 import check_servable_layers
from headway.kinds.spec import HeadKind


def _for_target(cfg: DFlashConfig, num_target_layers: int) -> DFlashConfig:
    """The context layers resolved for this target (saved with the head), and checked servable."""
    cfg = replace(cfg, feature_layers=DFlashHead.feature_layers(cfg, num_target_layers))
    check_servable_layers("head.dflash", cfg.feature_layers, num_target_layers)
    return cfg


DFLASH = HeadKind(
    name="dflash",
    title="DFlash",
    config=DFlashConfig,
    module=DFlashHead,
    layered=True,
    draft_tokens=lambda head: int(head.get("block_size", 8)) - 1,  # the block's mask slots
    for_target=_for_target,
    reduced_vocab=lambda cfg: cfg.lm_head == "own",
)
