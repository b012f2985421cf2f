"""Medusa-1/2's training objective: head i at position t learns the token at t+2+i.

Its settings are head.medusa's (loss, decay); Medusa-2's LoRA adapters and their distillation loss
are the training loop's (train/loop.py), since they train the target rather than the head.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.train.calibration import rank_accuracy
from headway.train.chunked_loss import chunked_draft_loss
from headway.train.flops import Dims, linear
from headway.train.losses import IGNORE, counted, masked_mean, medusa_labels, medusa_loss, wide
from headway.train.objectives.common import Features, Objective, answer_ahead, at_least_one_row


class MedusaObjective(Objective):
    """Head i at t learns the token at t+2+i (loss=ce) or the target's distribution there (loss=kl),
    weighted decay^i. The plan holds each head's answer positions (`rows{i}`, `cols{i}` [n_i]); a
    token outside a reduced draft vocabulary is masked out on the device by its label."""

    # per-rank accuracy of each head, for inference.tree_nodes
    calibrate = staticmethod(rank_accuracy)

    def __init__(self, cfg: Any, **train: Any) -> None:
        super().__init__(cfg, **train)
        self.plan_keys = tuple(f"{k}{i}" for i in range(cfg.num_heads) for k in "rc")
        self.needs_logits = cfg.loss == "kl"  # CE learns the data's tokens

    def plan(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(self.cfg.num_heads):
            out[f"r{i}"], out[f"c{i}"] = at_least_one_row(
                *answer_ahead(batch, 2 + i).nonzero(as_tuple=True)
            )
        return out

    def flops(self, heads: Any, plan: dict[str, torch.Tensor], target: Dims) -> float:
        """Each head's residual blocks and lm_head at every position; the first block reads the
        frozen feature (no input gradient), a shared lm_head is frozen (its input gradient only)."""
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
        hidden = feats.hidden[max(feats.hidden)].to(next(heads.parameters()).dtype)
        K = self.cfg.num_heads
        labels = medusa_labels(batch["input_ids"], batch["loss_mask"], K, t2d)
        rows = [(batch[f"r{i}"], batch[f"c{i}"]) for i in range(K)]
        if self.loss_chunk:
            return self._chunked(heads, hidden, labels, rows, feats)
        logits = heads(hidden)
        soft = None
        # head i at t: the target's distribution at t+1+i, at its rows only
        if self.cfg.loss == "kl":
            target = feats.logits.detach()
            d2t = None if heads.d2t is None else heads.d2t.to(target.device)
            soft = []
            for i, (r, c) in enumerate(rows):
                # (an added row: weighted out)
                at = target[r, (c + 1 + i).clamp(max=target.shape[1] - 1)]
                soft.append(torch.softmax(wide(at if d2t is None else at[..., d2t]), -1))
        return medusa_loss(logits, labels, self.cfg.decay, soft, rows)

    def _chunked(
        self, heads: Any, hidden: torch.Tensor, labels: torch.Tensor, rows: list, feats: Features
    ) -> tuple[torch.Tensor, dict]:
        """`medusa_loss` with each head's lm_head and loss run in chunks of its loss rows
        (train.loss_chunk): the same loss and metrics, and no [n, V] tensor kept for backward."""
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        metrics: dict[str, torch.Tensor] = {}
        target = feats.logits.detach() if self.cfg.loss == "kl" else None
        d2t = None if heads.d2t is None or target is None else heads.d2t.to(target.device)
        for i, (state, (r, c)) in enumerate(zip(heads.states(hidden), rows)):
            lab = labels[i][r, c]
            weight = lab != IGNORE
            if target is None:
                kind, teacher = "ce", lab.clamp(min=0)
            else:  # head i at t: the target's distribution at t+1+i
                at = target[r, (c + 1 + i).clamp(max=target.shape[1] - 1)]
                kind, teacher = "soft_ce", at if d2t is None else at[..., d2t]
            loss, top = chunked_draft_loss(
                kind, state[r, c], heads.readout(i), teacher, weight, self.loss_chunk, top=5
            )
            total = total + (self.cfg.decay**i) * loss
            want = lab.unsqueeze(-1)
            counted(metrics, f"loss/head{i}", loss.detach(), weight)
            counted(
                metrics, f"top1/head{i}", masked_mean((top[:, :1] == want).any(-1), weight), weight
            )
            counted(metrics, f"top5/head{i}", masked_mean((top == want).any(-1), weight), weight)
        return total, metrics
