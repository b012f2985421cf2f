"""Medusa-1/2's training objective: head i at position t learns the token at t+2+i.

Its settings are head.medusa's (loss, decay); Medusa-2's LoRA adapters and their distillation loss are the
training loop's (train/loop.py), since they train the target rather than the head.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.train.flops import Dims, linear
from headway.train.losses import medusa_labels, medusa_loss
from headway.train.objectives.common import Features, Objective


class MedusaObjective(Objective):
    """Head i at t learns the token at t+2+i (loss=ce) or the target's distribution there (loss=kl), weighted
    decay^i. The plan holds each head's answer positions (`rows{i}`, `cols{i}` [n_i]); a token outside a
    reduced draft vocabulary is masked out on the device by its label."""

    def __init__(self, cfg: Any, **train: Any) -> None:
        super().__init__(cfg, **train)
        self.plan_keys = tuple(f"{k}{i}" for i in range(cfg.num_heads) for k in "rc")

    def plan(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss_mask, out = batch["loss_mask"].bool(), {}
        for i in range(self.cfg.num_heads):
            answer = torch.zeros_like(loss_mask)
            answer[:, : max(0, loss_mask.shape[1] - 2 - i)] = loss_mask[:, 2 + i :]
            out[f"r{i}"], out[f"c{i}"] = answer.nonzero(as_tuple=True)
        return out

    def flops(self, heads: Any, plan: dict[str, torch.Tensor], target: Dims) -> float:
        """Each head's residual blocks and lm_head at every position; the first block reads the frozen
        feature (no input gradient), a shared lm_head is frozen (its input gradient only)."""
        B, T = plan["input_ids"].shape
        h, rows, n = target.hidden, B * T, self.cfg.num_layers
        vocab = len(heads.d2t) if heads.d2t is not None else target.vocab
        per_head = (3 * n - 1) * linear(rows, h, h) if n else 0.0
        trains_lm_head = self.cfg.lm_head != "shared"
        per_head += (1 + trains_lm_head + (n > 0)) * linear(rows, h, vocab)
        return self.cfg.num_heads * per_head

    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        batch = self.planned(batch)
        num_layers = max(feats.hidden)
        logits = heads(feats.hidden[num_layers].to(next(heads.parameters()).dtype))
        K = logits.shape[0]
        labels = medusa_labels(batch["input_ids"], batch["loss_mask"], K, t2d)
        rows = [(batch[f"r{i}"], batch[f"c{i}"]) for i in range(K)]
        soft = None
        if self.cfg.loss == "kl":  # head i at t: the target's distribution at t+1+i, at its rows only
            target = feats.logits.detach()
            d2t = None if heads.d2t is None else heads.d2t.to(target.device)
            soft = []
            for i, (r, c) in enumerate(rows):
                at = target[r, c + 1 + i]
                soft.append(torch.softmax((at if d2t is None else at[..., d2t]).float(), -1))
        return medusa_loss(logits, labels, self.cfg.decay, soft, rows)
