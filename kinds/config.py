"""The `head` config section: which kind to train, and one sub-section per registered kind (head.<kind>)."""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import Any

from headway.config import check_choice
from headway.kinds.registry import KINDS


def _check(self: Any) -> None:
    check_choice("head", "kind", self.kind, list(KINDS))


def _kind_config(self: Any) -> Any:
    """The selected kind's own section."""
    return getattr(self, self.kind)


# kind: which draft head to train (medusa, eagle: EAGLE-1 decoded with EAGLE-2 trees, eagle3); then each
# registered kind's settings, so a recipe can hold several and switch with head.kind.
HeadConfig = make_dataclass(
    "HeadConfig",
    [("kind", str, field(default="medusa"))]
    + [(name, kind.config, field(default_factory=kind.config)) for name, kind in KINDS.items()],
    namespace={"__post_init__": _check, "kind_config": _kind_config, "__module__": __name__},
)
