"""Medusa-1/2: extra heads on the target's last hidden state, each guessing one later token."""

from __future__ import annotations

from headway.heads.config import LoraConfig
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.kinds.spec import HeadKind


def _upgrade(head: dict, state: dict) -> dict:
    """The saved section as MedusaConfig takes it: its LoRA settings (a mapping in config.json) as a
    LoraConfig. Heads saved before loss, decay and lora were head.medusa settings (they were
    train.*) have none of the three, and read as the defaults (they shape training only;
    kinds/checkpoint.py marks a Medusa-2 one's lora enabled)."""
    lora = head.get("lora")
    return {**head, "lora": LoraConfig(**lora)} if isinstance(lora, dict) else head


MEDUSA = HeadKind(
    name="medusa",
    title="Medusa-1/2",
    config=MedusaConfig,
    module=MedusaHeads,
    layered=False,
    draft_tokens=lambda head: int(head.get("num_heads", 3)),  # one draft token per head
    reduced_vocab=lambda cfg: cfg.lm_head == "reduced",
    reads_target_lm_head=lambda head: head.get("lm_head") == "shared",
    adapts_target=True,
    upgrade=_upgrade,
)
