"""Medusa-1/2's training objective: head i at position t learns the token at t+2+i.

Its settings are head.medusa's (loss, decay); Medusa-2's LoRA adapters and their distillation loss are the
training loop's (train/loop.py), since they train the target rather than the head.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.train.losses import medusa_labels, medusa_loss, medusa_soft_targets
from headway.train.objectives.common import Features, Objective


class MedusaObjective(Objective):
    """Head i at t learns the token at t+2+i (loss=ce) or the target's distribution there (loss=kl), weighted
    decay^i."""

    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        num_layers = max(feats.hidden)
        logits = heads(feats.hidden[num_layers].to(next(heads.parameters()).dtype))
        labels = medusa_labels(batch["input_ids"], batch["loss_mask"], logits.shape[0], t2d)
        soft = (
            medusa_soft_targets(feats.logits.detach(), logits.shape[0], heads.d2t)
            if self.cfg.loss == "kl"
            else None
        )
        return medusa_loss(logits, labels, self.cfg.decay, soft)
