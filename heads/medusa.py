"""Medusa heads: K small heads on the target's last hidden state, head i guessing the token 2+i
ahead.

Each head is L residual blocks (a zero-initialised Linear, SiLU, residual: the head starts as the
identity) followed by a projection to the vocabulary. The projection is either the head's own
(initialised from the target's lm_head, as in the Medusa paper), the target's frozen lm_head shared
by all heads, or a reduced draft vocabulary (the most frequent tokens) with a map back to target
ids.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from headway.errors import HeadwayError
from headway.heads.config import MedusaConfig


class ResBlock(nn.Module):
    """x + SiLU(W x), with W zero-initialised so a new head starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; `forward(hidden)` returns logits [K, ..., V_draft] over draft ids (target ids
    unless reduced)."""

    kind = "medusa"

    def __init__(
        self,
        cfg: MedusaConfig,
        hidden_size: int,
        vocab_size: int,
        d2t: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(cfg.num_layers)])
            for _ in range(cfg.num_heads)
        )
        if cfg.lm_head == "reduced":
            if d2t is None:
                d2t = torch.arange(min(cfg.draft_vocab_size, vocab_size))
            self.register_buffer("d2t", d2t.to(torch.long).clone(), persistent=True)
        else:
            self.d2t = None
        out = (
            0
            if cfg.lm_head == "shared"
            else (len(self.d2t) if self.d2t is not None else vocab_size)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden_size, out, bias=False) for _ in range(cfg.num_heads))
            if out
            else None
        )
        # set by attach_target for lm_head=shared
        self.shared_lm_head: Optional[torch.Tensor] = None

    @property
    def draft_depth(self) -> int:
        """Tokens ahead of the root the heads guess: one per head."""
        return self.cfg.num_heads

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t) if self.d2t is not None else self.vocab_size

    def init_from_target(self, target_model: Any) -> None:
        """Copy the target's lm_head rows into each head's projection (own: all rows; reduced: the
        draft rows)."""
        if self.lm_heads is None:
            return
        target_lm_head = target_model.get_output_embeddings().weight
        rows = target_lm_head if self.d2t is None else target_lm_head[self.d2t]
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(rows.to(head.weight.dtype))

    @staticmethod
    def feature_layers(cfg: MedusaConfig, num_target_layers: int) -> list[int]:
        """Indices into the target's `output_hidden_states` the heads read: the last (post-norm)
        one."""
        return [num_target_layers]

    def attach_target(self, target_model: Any) -> None:
        """Give a shared-projection head the frozen target lm_head (not a parameter, never
        saved)."""
        self.shared_lm_head = target_model.get_output_embeddings().weight.detach()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each head's logits [K, B, T, V] from the target's last hidden state [B, T, h]."""
        outs = []
        for i, h in enumerate(self.states(hidden)):
            if self.lm_heads is not None:
                outs.append(self.lm_heads[i](h))
            else:
                outs.append(h @ self.readout(i).to(h.dtype).T)
        return torch.stack(outs)

    def states(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Each head's input to its lm_head [B, T, h] (the training loss reads them in chunks)."""
        return [block(hidden) for block in self.blocks]

    def readout(self, i: int) -> torch.Tensor:
        """Head i's lm_head weight [V, h]: its own, or the target's frozen one (lm_head=shared)."""
        if self.lm_heads is not None:
            return self.lm_heads[i].weight
        if self.shared_lm_head is None:
            raise HeadwayError(
                "a shared-lm_head Medusa head needs attach_target(target model) first"
            )
        return self.shared_lm_head

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]
