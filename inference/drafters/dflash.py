"""DFlash drafting: one block forward guesses every position ahead of the root; the guesses fill a
static tree.

The drafter keeps each layer's context keys and values for the positions the target has verified, so
a step runs the block alone ([root, mask, ...]) against that cache: its cost does not grow with the
draft's depth.
"""

from __future__ import annotations

import torch

from headway.heads.dflash import DFlashHead
from headway.inference.drafters.static_tree import StaticTreeDrafter
from headway.inference.engines.tree import Tree, chain_choices


class DFlashDrafter(StaticTreeDrafter):
    """A static tree over the block's slots (inference.tree; a chain as deep as the block by
    default)."""

    @classmethod
    def default_tree(cls, heads: DFlashHead) -> list[list[int]]:
        """The chain of every block slot, which one forward drafts."""
        return chain_choices(heads.draft_depth)

    def __init__(self, heads: DFlashHead, tree: Tree, num_target_layers: int):
        """Args: heads: the DFlash head; tree: the static tree over its block slots;
        num_target_layers: the target's."""
        super().__init__(heads, tree, num_target_layers)
        # per layer, [1, kv_heads, capacity, head_dim]
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0  # context positions cached: the root's position

    @property
    def context(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cached context keys and values, [1, kv_heads, length, head_dim] (views)."""
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in self._kv]

    def _extend(self, features: torch.Tensor) -> None:
        """Add the context keys and values of the next positions' features [n, F], in buffers that
        double when full, so a step copies only its own positions."""
        n = features.shape[0]
        positions = torch.arange(self.length, self.length + n, device=features.device).view(1, -1)
        new = self.heads.context(features.unsqueeze(0), positions)
        end = self.length + n
        if not self._kv or end > self._kv[0][0].shape[2]:
            size = max(2 * end, 256)
            grown = [
                (
                    nk.new_empty(*nk.shape[:2], size, nk.shape[3]),
                    nv.new_empty(*nv.shape[:2], size, nv.shape[3]),
                )
                for nk, nv in new
            ]
            for (k, v), (gk, gv) in zip(self._kv, grown):
                gk[:, :, : self.length], gv[:, :, : self.length] = (
                    k[:, :, : self.length],
                    v[:, :, : self.length],
                )
            self._kv = grown
        for (k, v), (nk, nv) in zip(self._kv, new):
            k[:, :, self.length : end], v[:, :, self.length : end] = nk, nv
        self.length = end

    @torch.no_grad()
    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        self.length = 0  # the buffers are reused; only the first `length` positions are read
        self._extend(features)

    @torch.no_grad()
    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        """features [k, F]: the verified positions' (the old root and the accepted drafts); tokens
        end with the new root."""
        self._extend(features)

    def offset_logits(self, root: int) -> torch.Tensor:
        return self.heads.draft_logits(self.context, root, self.length)[: len(self.ks)]
