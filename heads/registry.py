"""Head kinds by name: the config section each reads, the module it builds, and how to build one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from headway.config import check_choice
from headway.heads.eagle import EagleConfig, EagleHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Head
from headway.heads.medusa import MedusaConfig, MedusaHeads

KINDS = {
    "medusa": (MedusaConfig, MedusaHeads),
    "eagle": (EagleConfig, EagleHead),
    "eagle3": (Eagle3Config, Eagle3Head),
}
LAYERED = ("eagle", "eagle3")  # kinds that carry a decoder layer built from the target's config


@dataclass
class HeadConfig:
    # Which draft head to train: medusa, eagle (EAGLE-1/2 decoding) or eagle3.
    kind: str = "medusa"
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)

    def __post_init__(self) -> None:
        check_choice("head", "kind", self.kind, list(KINDS))

    def kind_config(self):
        return getattr(self, self.kind)


def build_head(
    kind: str,
    kind_cfg: Any,
    hidden_size: int,
    vocab_size: int,
    d2t: Optional[torch.Tensor] = None,
    layer_config: Optional[dict] = None,
) -> Any:
    """A head module of `kind`; EAGLE kinds also take the one-layer config of their decoder."""
    _, module_cls = KINDS[kind]
    if kind in LAYERED:
        return module_cls(kind_cfg, hidden_size, vocab_size, layer_config, d2t=d2t)
    return module_cls(kind_cfg, hidden_size, vocab_size, d2t=d2t)
