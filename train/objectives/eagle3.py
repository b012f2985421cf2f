"""EAGLE-3's training objective: the drafter unrolled on its own outputs (training-time test,
train/ttt.py), each step learning the target's distribution over the draft vocabulary."""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.train.chunked_loss import chunked_draft_loss
from headway.train.flops import Dims, attention, layer_linears, linear
from headway.train.losses import chain_metric, counted, draft_loss, masked_mean, wide
from headway.train.objectives.common import Features, Objective, answer_ahead, at_least_one_row
from headway.train.ttt import kept_positions, shifted, ttt_unroll
from headway.train.ttt_flex import bucket, pad_to


class Eagle3Objective(Objective):
    """EAGLE-3: step j of the unrolled drafter at t learns the target's distribution at t+1+j
    restricted to the draft vocabulary, weighted ttt_decay^j; positions whose target argmax is
    outside the draft vocabulary are skipped, as is everything that is not an answer token.

    The plan (host side) holds the positions steps j >= 1 run at (`ttt_index`, `ttt_kept` [B, N]:
    where some later step takes a loss on an answer token) and each step's loss rows (`rows{j}`,
    `cols{j}` [n_j] into step j's output, `at{j}` [n_j] the sequence position t); the device masks
    out rows whose target token is outside the draft vocabulary by weight, not by indexing."""

    def __init__(self, cfg: Any, **train: Any) -> None:
        super().__init__(cfg, **train)
        self.plan_keys = (
            "ttt_index",
            "ttt_kept",
            *(f"{k}{j}" for j in range(cfg.ttt_steps) for k in "rca"),
        )
        # the target's draft-vocabulary rows from its hidden state, and its argmax
        self.needs_logits = False

    def plan(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        steps = self.cfg.ttt_steps
        answer = [answer_ahead(batch, 2 + j) for j in range(steps)]
        if steps > 1:
            index, kept = kept_positions(torch.stack(answer[1:]).any(0))
        else:
            index, kept = (
                torch.zeros(answer[0].shape[0], 1, dtype=torch.long),
                answer[0][:, :1] & False,
            )
        # flex compiles once per bucket: N padded up to one (its rows not kept)
        if self.flex_buckets:
            N = bucket(index.shape[1], self.flex_buckets)
            index, kept = pad_to(index, N), pad_to(kept, N, False)
        out = {"ttt_index": index, "ttt_kept": kept}
        for j in range(steps):
            if j == 0:
                rows, cols = answer[0].nonzero(as_tuple=True)
                at = cols
            else:
                where = answer[j].gather(1, index) & kept
                rows, cols = where.nonzero(as_tuple=True)
                at = index[rows, cols]
            out[f"r{j}"], out[f"c{j}"], out[f"a{j}"] = at_least_one_row(rows, cols, at)
        return out

    def flops(self, heads: Any, plan: dict[str, torch.Tensor], target: Dims) -> float:
        """The teacher's draft-vocabulary rows at every position, the fused projection (no input
        gradient), step 0 at every position, steps j >= 1 at the plan's N kept positions (attending
        to T + j keys), the lm_head at each step's loss rows."""
        B, T = plan["input_ids"].shape
        h, draft = target.hidden, Dims.of(heads.layer_config)
        vocab = len(heads.d2t) if heads.d2t is not None else target.vocab
        N = plan["ttt_index"].shape[1]
        head = layer_linears(B * T, draft, 2 * h) + attention(B, T, T, draft)
        for j in range(1, self.cfg.ttt_steps):
            head += layer_linears(B * N, draft, 2 * h) + attention(B, N, T + j, draft)
        head += sum(linear(plan[f"r{j}"].shape[0], h, vocab) for j in range(self.cfg.ttt_steps))
        return linear(B * T, h, vocab) + 2 * linear(B * T, 3 * h, h) + 3 * head

    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        ec = self.cfg
        batch = self.planned(batch)
        ids = batch["input_ids"]
        # the target's distribution is taken (softmax) only at the positions a loss reads
        target_logits_d = feats.draft_logits(heads.d2t.to(ids.device)).detach()
        in_draft = (
            (t2d[feats.argmax] >= 0) if t2d is not None else torch.ones_like(ids, dtype=torch.bool)
        )
        unrolled = ttt_unroll(
            heads,
            ids,
            batch["attention_mask"],
            heads.project(feats.cat(ec.feature_layers)),
            ec.ttt_steps,
            kept=(batch["ttt_index"], batch["ttt_kept"]),
            attention=self.ttt_attention,
            positions=batch.get("positions"),
            doc=batch.get("doc"),
            buckets=self.flex_buckets,
        )
        total = torch.zeros((), device=ids.device)
        metrics: dict[str, torch.Tensor] = {}
        correct = []
        T = ids.shape[1]
        for j, out in enumerate(unrolled.outputs):
            # every step has at least one planned row (a host-known shape); a row added to an empty
            # plan is weighted out here, so every step's loss and metrics exist whatever the
            # micro-batch holds
            rows, cols, at = batch[f"r{j}"], batch[f"c{j}"], batch[f"a{j}"]
            ahead = (at + 1 + j).clamp(max=T - 1)
            # step j at t learns the target's distribution at t+1+j, and the draft lm_head runs only
            # where a loss may be taken: most of a step's cost
            teacher = target_logits_d[rows, ahead]
            weight = in_draft[rows, ahead] & answer_ahead(batch, 2 + j)[rows, at]
            if self.loss_chunk:
                x = heads.norm(out[rows, cols])
                loss_j, best = chunked_draft_loss(
                    ec.loss, x, heads.lm_head.weight, teacher, weight, self.loss_chunk
                )
            else:
                logits = wide(heads.logits(out[rows, cols]))
                loss_j = draft_loss(ec.loss, logits, torch.softmax(wide(teacher), -1), weight)
                best = logits.detach().argmax(-1)
            total = total + (ec.ttt_decay**j) * loss_j
            right = (best == teacher.argmax(-1)) & weight
            counted(metrics, f"loss/step{j}", loss_j.detach(), weight)
            counted(metrics, f"top1/step{j}", masked_mean(right, weight), weight)
            correct.append(torch.zeros_like(ids, dtype=torch.bool).index_put((rows, at), right))
        valid0 = answer_ahead(batch, 2) & shifted(in_draft, 1, False)
        chain_metric(metrics, correct, valid0)
        return total, metrics
