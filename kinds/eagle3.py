"""EAGLE-3: one decoder layer over three fused target layers, trained with training-time test, over
a reduced draft vocabulary."""

from __future__ import annotations

from dataclasses import replace

from headway.heads.eagle3 import Eagle3Config, Eagle3Head
from headway.kinds.spec import HeadKind


def _for_target(cfg: Eagle3Config, num_target_layers: int) -> Eagle3Config:
    """The feature layers resolved for this target (saved with the head), and checked servable."""
    cfg = replace(cfg, feature_layers=Eagle3Head.feature_layers(cfg, num_target_layers))
    Eagle3Head.check_servable(cfg.feature_layers, num_target_layers)
    return cfg


EAGLE3 = HeadKind(
    name="eagle3",
    title="EAGLE-3",
    config=Eagle3Config,
    module=Eagle3Head,
    layered=True,
    draft_tokens=lambda head: int(head.get("ttt_steps", 3)),  # the unroll it was trained for
    for_target=_for_target,
    reduced_vocab=lambda cfg: True,
    drafts_in_bf16=True,
)
