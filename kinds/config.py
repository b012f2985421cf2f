"""The `head` config section: which kind to train, and one sub-section per registered kind
(head.<kind>).

Torch-free, like every config module (the command line checks a config before it loads torch), so it
names each kind's section class itself; tests/headway/test_structure.py checks that the sections are
exactly the registered kinds (kinds/registry.py) with their config classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from headway.config import check_choice
from headway.heads.config import DFlashConfig, Eagle3Config, EagleConfig, MedusaConfig


@dataclass
class HeadConfig:
    # Which draft head to train: medusa, eagle (EAGLE-1, decoded with EAGLE-2 trees), eagle3 or
    # dflash; then each kind's settings, so a recipe can hold several and switch with head.kind.
    # eagle3: the recipe's and the shipped head's kind.
    kind: str = "eagle3"
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    dflash: DFlashConfig = field(default_factory=DFlashConfig)

    def __post_init__(self) -> None:
        check_choice("head", "kind", self.kind, kind_names())

    def kind_config(self) -> Any:
        """The selected kind's own section."""
        return getattr(self, self.kind)


def kind_names() -> list[str]:
    """The kinds a config may name (one section each)."""
    return [f.name for f in fields(HeadConfig) if f.name != "kind"]
