"""Medusa drafting: head d guesses the token d + 1 positions after the root from the last hidden
state the target produced; the guesses fill a static tree (draft_static)."""

from __future__ import annotations

import torch

from headway.heads.medusa import MedusaHeads
from headway.inference.drafters.static_tree import StaticTreeDrafter
from headway.inference.engines.tree import Tree


class MedusaDrafter(StaticTreeDrafter):
    """Fills a static tree (inference.tree; DEFAULT_STATIC_TREE by default) from the heads' guesses
    on the hidden state that produced the root token."""

    def __init__(self, heads: MedusaHeads, tree: Tree, num_target_layers: int):
        """Args: heads: the Medusa heads; tree: the static tree they fill; num_target_layers: the
        target's."""
        super().__init__(heads, tree, num_target_layers)
        self.hidden: torch.Tensor | None = None

    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        self.hidden = features[-1]

    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        self.hidden = features[-1]

    def offset_logits(self, root: int) -> torch.Tensor:
        """[tree depth, draft vocab]: the head's logits for the token d + 1 positions after the
        root, each depth guessed independently (Medusa: head d on the last hidden state the target
        produced)."""
        hidden = self.hidden.view(1, -1).to(next(self.heads.parameters()).dtype)
        return self.heads(hidden)[: len(self.ks), 0]
