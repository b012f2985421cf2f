"""EAGLE-1 (decoded with EAGLE-2's dynamic tree): one decoder layer over [embedding; target feature]."""

from __future__ import annotations

from headway.export.layouts import EAGLE_EXPORTS, EAGLE_REFUSED
from headway.heads.eagle import EagleConfig, EagleHead
from headway.inference.draft_eagle import EagleDrafter
from headway.inference.tree_search import EagleTrees
from headway.kinds.spec import HeadKind
from headway.train.objectives.eagle import EagleObjective


def _upgrade(head: dict, state: dict) -> dict:
    """Heads written before fc_bias was a setting had one."""
    return {"fc_bias": "fc.bias" in state, **head}


EAGLE = HeadKind(
    name="eagle",
    title="EAGLE-1/2",
    config=EagleConfig,
    module=EagleHead,
    layered=True,
    objective=EagleObjective,
    drafter=EagleDrafter.from_config,
    tree_space=EagleTrees(),
    exports=EAGLE_EXPORTS,
    refused_exports=EAGLE_REFUSED,
    draft_tokens=lambda head: 3,  # EAGLE-1's usual chain in vLLM and SGLang
    upgrade=_upgrade,
)
