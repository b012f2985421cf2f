"""EAGLE-3's training objective: the drafter unrolled on its own outputs (training-time test, train/ttt.py),
each step learning the target's distribution over the draft vocabulary."""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.train.losses import chain_acceptance, draft_loss
from headway.train.objectives.common import Features, Objective
from headway.train.ttt import shifted, ttt_unroll


class Eagle3Objective(Objective):
    """EAGLE-3: step j of the unrolled drafter at t learns the target's distribution at t+1+j restricted
    to the draft vocabulary, weighted ttt_decay^j; positions whose target argmax is outside the draft
    vocabulary are skipped, as is everything that is not an answer token."""

    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        ec = self.cfg
        ids = batch["input_ids"]
        # the target's distribution is taken (softmax) only at the positions a loss reads
        target_logits_d = feats.draft_logits(heads.d2t.to(ids.device)).detach()
        in_draft = (t2d[feats.argmax] >= 0) if t2d is not None else torch.ones_like(ids, dtype=torch.bool)
        valid = [
            shifted(batch["loss_mask"], 2 + j).bool() & shifted(in_draft, 1 + j, False)
            for j in range(ec.ttt_steps)
        ]
        needed = torch.stack(valid[1:]).any(0) if ec.ttt_steps > 1 else None
        unrolled = ttt_unroll(
            heads,
            ids,
            batch["attention_mask"],
            heads.project(feats.cat(ec.feature_layers)),
            ec.ttt_steps,
            needed,
        )
        total = torch.zeros((), device=ids.device)
        metrics: dict[str, float] = {}
        correct = []
        for j, out in enumerate(unrolled.outputs):
            where = unrolled.valid(j, valid[j])
            hit = torch.zeros_like(valid[0])
            if bool(where.any()):
                # the draft lm_head only where a loss is taken: most of a step's cost
                logits = heads.logits(out[where]).float()
                rows, cols = unrolled.positions(
                    j, where
                )  # step j at t learns the target's distribution at t+1+j
                p = torch.softmax(target_logits_d[rows, cols + 1 + j].float(), -1)
                loss_j = draft_loss(ec.loss, logits, p)
                total = total + (ec.ttt_decay**j) * loss_j
                right = logits.argmax(-1) == p.argmax(-1)
                metrics[f"loss/step{j}"] = float(loss_j.detach())
                metrics[f"top1/step{j}"] = float(right.float().mean())
                hit = unrolled.scatter(j, where, right, hit)
            correct.append(hit)
        metrics["tau/chain"] = float(chain_acceptance(correct, valid[0]))
        return total, metrics
