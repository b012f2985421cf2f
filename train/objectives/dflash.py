"""DFlash's training objective: blocks at random answer anchors, each slot learning the target's
distribution for its token over the draft vocabulary, all of a sequence's blocks in one masked
forward."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from headway.train.chunked_loss import chunked_draft_loss
from headway.train.flops import Dims, attention, layer_linears, linear
from headway.train.losses import chain_metric, counted, draft_loss, masked_mean, wide
from headway.train.objectives.common import Features, Objective, answer_ahead


def dflash_anchors(
    batch: dict, count: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` anchors per sequence, [B, A] with a validity mask: positions whose next token
    is an answer token, drawn at random but fixed by the batch's tokens and the seed (a resumed or
    offline run draws the same). In a packed batch (its `doc`) each sequence draws its own, seeded
    by its own tokens."""
    ids = batch["input_ids"]
    B, T = ids.shape
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(ids.long().sum()) % 1_000_000_007)
    nxt = answer_ahead(batch, 1)

    def draw(where: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if len(where) > count:
            where = torch.sort(where[torch.randperm(len(where), generator=g)[:count]]).values
        return where

    rows = []
    for b in range(B):
        if "doc" not in batch:
            rows.append(draw(nxt[b].nonzero().view(-1).cpu(), g))
            continue
        doc, picks = batch["doc"][b], []
        for d in range(int(doc.max()) + 1):
            own = doc == d
            mine = torch.Generator().manual_seed(
                int(seed) * 1_000_003 + int(ids[b][own].long().sum()) % 1_000_000_007
            )
            picks.append(draw((nxt[b] & own).nonzero().view(-1), mine))
        rows.append(torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long))
    A = max(1, max(len(r) for r in rows))
    anchors = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, r in enumerate(rows):
        anchors[b, : len(r)], valid[b, : len(r)] = r, True
    return anchors.to(ids.device), valid.to(ids.device)


class DFlashObjective(Objective):
    """DFlash: a block at each anchor a (its token, then mask tokens) sees the target's features
    before a and itself; slot j learns the target's distribution at a + j - 1 (the token at a + j)
    over the draft vocabulary, weighted exp(-(j - 1) / loss_gamma). Slots whose token is not an
    answer token, or whose target argmax is outside the draft vocabulary, are skipped (weighted out
    on the device). The anchors are drawn on the host (the plan's `anchors`, `anchor_ok` [B, A])
    with the objective's seed (train.seed)."""

    plan_keys = ("anchors", "anchor_ok")
    needs_logits = False  # the target's draft-vocabulary rows from its hidden state, and its argmax

    def plan(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        anchors, ok = dflash_anchors(batch, self.cfg.anchors, self.cfg.block_size, self.seed)
        return {"anchors": anchors, "anchor_ok": ok}

    def flops(self, heads: Any, plan: dict[str, torch.Tensor], target: Dims) -> float:
        """The teacher's draft rows, the fused context projection (no input gradient), each layer's
        context keys/values and its block tokens (A anchors x block_size) attending to the context
        and their blocks, the read-out of every slot (a frozen target lm_head: its input gradient
        only)."""
        B, T = plan["input_ids"].shape
        dc, h, draft = self.cfg, target.hidden, Dims.of(heads.layer_config)
        Q, vocab = plan["anchors"].shape[1] * dc.block_size, len(heads.d2t)
        fused = len(dc.feature_layers) or 3
        per_layer = (
            linear(B * T, h, 2 * draft.kv)
            + layer_linears(B * Q, draft)
            + attention(B, Q, T + Q, draft)
        )
        read_out = (3 if heads.lm_head is not None else 2) * linear(B * Q, h, vocab)
        teacher = linear(B * T, h, vocab)
        return teacher + 2 * linear(B * T, fused * h, h) + 3 * dc.num_layers * per_layer + read_out

    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        dc = self.cfg
        batch = self.planned(batch)
        ids = batch["input_ids"]
        B, T = ids.shape
        bs, device = dc.block_size, ids.device
        anchors, anchor_ok = batch["anchors"], batch["anchor_ok"]
        A = anchors.shape[1]
        slots = torch.arange(bs, device=device)
        doc, positions = batch.get("doc"), batch.get("positions")
        start = anchors if positions is None else torch.gather(positions, 1, anchors)
        pos = start.unsqueeze(-1) + slots  # [B, A, bs]
        tokens = torch.full((B, A, bs), heads.mask_token_id, dtype=ids.dtype, device=device)
        tokens[..., 0] = torch.gather(ids, 1, anchors)
        # queries of block i see context positions < its anchor and their own block, both ways
        ctx_ok = torch.arange(T, device=device).view(1, 1, T) < anchors.view(B, A, 1)
        if doc is not None:  # a packed batch: its own sequence's context only
            ctx_ok = ctx_ok & (doc.unsqueeze(1) == torch.gather(doc, 1, anchors).unsqueeze(-1))
        same = (
            torch.eye(A, dtype=torch.bool, device=device)
            .repeat_interleave(bs, 0)
            .repeat_interleave(bs, 1)
        )
        allowed = torch.cat(
            (ctx_ok.repeat_interleave(bs, 1), same.unsqueeze(0).expand(B, -1, -1)), dim=2
        )  # [B, A*bs, T + A*bs]
        context_pos = (
            torch.arange(T, device=device).expand(B, T) if positions is None else positions
        )
        context = heads.context(feats.cat(dc.feature_layers), context_pos)
        states = heads.block_states(tokens.view(B, A * bs), pos.view(B, A * bs), context, allowed)
        states = states.view(B, A, bs, -1)
        teacher_all = feats.draft_logits(heads.d2t.to(device)).detach()
        in_draft = (
            (t2d[feats.argmax] >= 0) if t2d is not None else torch.ones_like(ids, dtype=torch.bool)
        )
        total = torch.zeros((), dtype=wide(teacher_all).dtype, device=device)
        # the read-out and the target's distribution over every slot at once
        if not self.loss_chunk:
            logits = heads.read_out(states)
            target_p = torch.softmax(wide(teacher_all), -1)
        metrics: dict[str, torch.Tensor] = {}
        correct, valid0 = [], None
        for j in range(1, bs):
            # the target's distribution here is the token at a + j's
            t = (anchors + j - 1).clamp(max=T - 1)
            ok = anchor_ok & (anchors + j < T)
            ahead = (anchors + j).clamp(max=T - 1)
            ok = (
                ok
                & torch.gather(batch["loss_mask"].bool(), 1, ahead)
                & torch.gather(in_draft, 1, t)
            )
            if doc is not None:
                ok = ok & (torch.gather(doc, 1, ahead) == torch.gather(doc, 1, anchors))
            valid0 = ok if valid0 is None else valid0
            # every anchor's slot, the invalid ones weighted out: a fixed shape, no host read
            at = t.unsqueeze(-1).expand(-1, -1, teacher_all.shape[-1])
            weight = ok.flatten()
            if self.loss_chunk:
                teacher = torch.gather(teacher_all, 1, at).flatten(0, 1)
                x = states[:, :, j].flatten(0, 1)
                loss_j, best = chunked_draft_loss(
                    dc.loss, x, heads.readout_weight, teacher, weight, self.loss_chunk
                )
                want = teacher.argmax(-1)
            else:
                slot_logits = wide(logits[:, :, j].flatten(0, 1))
                p = torch.gather(target_p, 1, at).flatten(0, 1)
                loss_j = draft_loss(dc.loss, slot_logits, p, weight)
                best, want = slot_logits.detach().argmax(-1), p.argmax(-1)
            total = total + math.exp(-(j - 1) / dc.loss_gamma) * loss_j
            right = (best == want) & weight
            counted(metrics, f"loss/slot{j}", loss_j.detach(), weight)
            counted(metrics, f"top1/slot{j}", masked_mean(right, weight), weight)
            correct.append(right.view(B, -1))
        chain_metric(metrics, correct, valid0)
        return total, metrics
