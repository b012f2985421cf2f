"""EAGLE-1 (decoded with EAGLE-2's dynamic tree): one decoder layer over [embedding; target
feature]."""

from __future__ import annotations

from headway.heads.eagle import EagleConfig, EagleHead
from headway.kinds.spec import HeadKind


def _upgrade(head: dict, state: dict) -> dict:
    """Heads written before fc_bias was a setting had one."""
    return {"fc_bias": "fc.bias" in state, **head}


EAGLE = HeadKind(
    name="eagle",
    title="EAGLE-1/2",
    config=EagleConfig,
    module=EagleHead,
    layered=True,
    draft_tokens=lambda head: 3,  # EAGLE-1's usual chain in vLLM and SGLang
    upgrade=_upgrade,
)
