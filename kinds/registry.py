"""The head kinds Headway knows, registered once: every stage looks a kind up here by its name."""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.errors import HeadwayError
from headway.kinds.dflash import DFLASH
from headway.kinds.eagle import EAGLE
from headway.kinds.eagle3 import EAGLE3
from headway.kinds.medusa import MEDUSA
from headway.kinds.spec import HeadKind

KINDS: dict[str, HeadKind] = {kind.name: kind for kind in (MEDUSA, EAGLE, EAGLE3, DFLASH)}


def head_kind(name: str) -> HeadKind:
    """The registered kind called `name`; an unknown name is an error that lists the known ones."""
    if name not in KINDS:
        raise HeadwayError(f"unknown head kind '{name}': this headway knows {', '.join(KINDS)}")
    return KINDS[name]


def build_head(
    kind: str,
    cfg: Any,
    hidden_size: int,
    vocab_size: int,
    d2t: Optional[torch.Tensor] = None,
    layer_config: Optional[dict] = None,
) -> Any:
    """A fresh head of `kind` (see HeadKind.build): cfg is its head.<kind> section, d2t [draft
    vocab] its draft-to-target token map, layer_config its decoder layer's config (layered
    kinds)."""
    return head_kind(kind).build(cfg, hidden_size, vocab_size, d2t, layer_config)
