"""EAGLE-1's training objective: from (feature t + noise, token t+1) the drafter predicts feature
t+1 and the target's next-token distribution there."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from headway.heads.draft_layer import drafter_mask
from headway.train.chunked_loss import chunked_draft_loss
from headway.train.flops import Dims, attention, layer_linears, linear
from headway.train.losses import counted, masked_mean, wide
from headway.train.objectives.common import Features, Objective, answer_ahead
from headway.train.ttt import causal_allowed, shifted, ttt_unroll


class EagleObjective(Objective):
    """EAGLE-1: from (feature t + noise, token t+1) predict feature t+1 (smooth-L1) and the target's
    distribution there (cross-entropy), on positions whose next-next token is an answer token (the
    plan's `rows`, `cols` [n])."""

    plan_keys = ("rows", "cols")

    def plan(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows, cols = answer_ahead(batch, 2).nonzero(as_tuple=True)
        return {"rows": rows, "cols": cols}

    def flops(self, heads: Any, plan: dict[str, torch.Tensor], target: Dims) -> float:
        """fc over (embedding, feature) (no input gradient), the draft layer at every position, the
        target's frozen lm_head at the loss rows (its input gradient only)."""
        B, T = plan["input_ids"].shape
        h, draft, n = target.hidden, Dims.of(heads.layer_config), plan["rows"].shape[0]
        layer = layer_linears(B * T, draft) + attention(B, T, T, draft)
        return 2 * linear(B * T, 2 * h, h) + 3 * layer + 2 * linear(n, h, target.vocab)

    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        ec = self.cfg
        batch = self.planned(batch)
        ids, attn = batch["input_ids"], batch["attention_mask"]
        rows, cols = batch["rows"], batch["cols"]
        T = ids.shape[1]
        f = wide(feats.hidden[max(feats.hidden)])
        noisy = heads.training and ec.feature_noise > 0
        f_in = f + (torch.rand_like(f) - 0.5) * ec.feature_noise if noisy else f
        positions, doc = batch.get("positions"), batch.get("doc")
        if self.ttt_attention == "structured":
            pos = (
                torch.arange(T, device=ids.device).unsqueeze(0) if positions is None else positions
            )
            allowed = causal_allowed(attn, doc)
            out = heads(shifted(ids, 1), f_in, pos, drafter_mask(allowed, heads.fc.weight.dtype))
        else:  # flex or recompute: no [T, T] mask, no scores kept (train/ttt.py; one step)
            out = ttt_unroll(
                heads,
                ids,
                attn,
                f_in,
                1,
                attention=self.ttt_attention,
                positions=positions,
                doc=doc,
                buckets=self.flex_buckets,
            ).outputs[0]
        valid = answer_ahead(batch, 2)
        vloss = masked_mean(
            F.smooth_l1_loss(wide(out), shifted(f, 1), reduction="none").mean(-1), valid
        )
        # the full-vocabulary read-out only where a loss is taken
        teacher = feats.logits.detach()[rows, cols + 1]
        n = teacher.shape[0]  # host-known: the plan's
        if self.loss_chunk:
            every = torch.ones(n, dtype=torch.bool, device=ids.device)
            ploss, best = chunked_draft_loss(
                "soft_ce", out[rows, cols], heads.readout_weight, teacher, every, self.loss_chunk
            )
        else:
            pred = wide(heads.logits(out[rows, cols]))
            target_p = torch.softmax(wide(teacher), -1)
            ploss = -(target_p * F.log_softmax(pred, -1)).sum(-1).mean() if n else pred.sum()
            best = pred.detach().argmax(-1)
        top1 = (best == teacher.argmax(-1)).float().mean() if n else ploss.detach() * 0
        loss = ec.feature_weight * vloss + ec.token_weight * ploss
        metrics: dict[str, torch.Tensor] = {}
        counted(metrics, "loss/feature", vloss.detach(), valid)
        every = torch.ones(n, dtype=torch.bool, device=ids.device)
        counted(metrics, "loss/token", ploss.detach(), every)
        counted(metrics, "top1/step0", top1, every)
        return loss, metrics
