"""EAGLE-1's training objective: from (feature t + noise, token t+1) the drafter predicts feature t+1 and the
target's next-token distribution there."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from headway.heads.draft_layer import drafter_mask
from headway.train.losses import masked_mean
from headway.train.objectives.common import Features, Objective
from headway.train.ttt import causal_allowed, shifted


class EagleObjective(Objective):
    """EAGLE-1: from (feature t + noise, token t+1) predict feature t+1 (smooth-L1) and the target's
    distribution there (cross-entropy), on positions whose next-next token is an answer token."""

    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        ec = self.cfg
        ids, attn = batch["input_ids"], batch["attention_mask"]
        T = ids.shape[1]
        f = feats.hidden[max(feats.hidden)].float()
        noisy = heads.training and ec.feature_noise > 0
        f_in = f + (torch.rand_like(f) - 0.5) * ec.feature_noise if noisy else f
        pos = torch.arange(T, device=ids.device).unsqueeze(0)
        mask = drafter_mask(causal_allowed(attn), heads.fc.weight.dtype)
        out = heads(shifted(ids, 1), f_in, pos, mask)
        valid = shifted(batch["loss_mask"], 2).bool()
        vloss = masked_mean(F.smooth_l1_loss(out.float(), shifted(f, 1), reduction="none").mean(-1), valid)
        target_p = torch.softmax(shifted(feats.logits.detach(), 1)[valid].float(), -1)
        pred = heads.logits(out[valid]).float()  # the full-vocabulary read-out only where a loss is taken
        ploss = -(target_p * F.log_softmax(pred, -1)).sum(-1).mean() if len(pred) else pred.sum()
        top1 = (pred.argmax(-1) == target_p.argmax(-1)).float().mean() if len(pred) else pred.sum()
        loss = ec.feature_weight * vloss + ec.token_weight * ploss
        return loss, {
            "loss/feature": float(vloss.detach()),
            "loss/token": float(ploss.detach()),
            "top1/step0": float(top1),
        }
