"""Medusa-1/2: extra heads on the target's last hidden state, each guessing one later token."""

from __future__ import annotations

from headway.export.layouts import MEDUSA_EXPORTS, MEDUSA_REFUSED
from headway.heads.config import LoraConfig
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.inference.draft_medusa import MedusaDrafter
from headway.inference.tree_search import StaticTrees
from headway.kinds.spec import HeadKind
from headway.train.calibration import rank_accuracy
from headway.train.objectives.medusa import MedusaObjective


def _upgrade(head: dict, state: dict) -> dict:
    """The saved section as MedusaConfig takes it: its LoRA settings (a mapping in config.json) as a
    LoraConfig. Heads saved before loss, decay and lora were head.medusa settings (they were train.*) have
    none of the three, and read as the defaults (they shape training only; kinds/checkpoint.py marks a
    Medusa-2 one's
    lora enabled)."""
    lora = head.get("lora")
    return {**head, "lora": LoraConfig(**lora)} if isinstance(lora, dict) else head


MEDUSA = HeadKind(
    name="medusa",
    title="Medusa-1/2",
    config=MedusaConfig,
    module=MedusaHeads,
    layered=False,
    objective=MedusaObjective,
    drafter=MedusaDrafter.from_config,
    tree_space=StaticTrees(),
    exports=MEDUSA_EXPORTS,
    refused_exports=MEDUSA_REFUSED,
    draft_tokens=lambda head: int(head.get("num_heads", 3)),  # one draft token per head
    reduced_vocab=lambda cfg: cfg.lm_head == "reduced",
    reads_target_lm_head=lambda head: head.get("lm_head") == "shared",
    calibrate=rank_accuracy,  # per-rank accuracy of each head, for inference.tree_nodes
    adapts_target=True,
    upgrade=_upgrade,
)
