"""Head kinds by name: the config section each reads and the module it builds."""

from __future__ import annotations

from dataclasses import dataclass, field

from headway.config import check_choice
from headway.heads.medusa import MedusaConfig, MedusaHeads

KINDS = {"medusa": (MedusaConfig, MedusaHeads)}


@dataclass
class HeadConfig:
    # Which draft head to train: medusa (EAGLE kinds join this list as they land).
    kind: str = "medusa"
    medusa: MedusaConfig = field(default_factory=MedusaConfig)

    def __post_init__(self) -> None:
        check_choice("head", "kind", self.kind, list(KINDS))

    def kind_config(self):
        return getattr(self, self.kind)
