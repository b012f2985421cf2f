"""What each head kind learns from the frozen target's features on one batch.

`Features` is the target's side of a batch (hidden states at the layers a head reads, logits), made
by running the target (online) or read back from a feature cache (offline): the objectives cannot
tell which, so both modes give the same loss on the same batch.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from headway.heads.draft_layer import drafter_mask
from headway.train.losses import (
    chain_acceptance,
    draft_loss,
    masked_mean,
    medusa_labels,
    medusa_loss,
    medusa_soft_targets,
)
from headway.train.ttt import causal_allowed, shifted, ttt_unroll


class Features:
    """hidden: HF output_hidden_states index -> [B, T, h]; logits: the target's next-token logits [B, T, V],
    given (online) or recomputed on first use from the last hidden state through `model`'s lm_head
    (offline); argmax: the target's greedy next token [B, T], given by the cache or read off the logits."""

    def __init__(
        self,
        hidden: dict[int, torch.Tensor],
        logits: Optional[torch.Tensor] = None,
        model: Any = None,
        argmax: Optional[torch.Tensor] = None,
    ):
        self.hidden = hidden
        self._logits = logits
        self._model = model
        self._argmax = argmax

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            with torch.no_grad():
                self._logits = target_logits(self._model, self.hidden[max(self.hidden)])
        return self._logits

    @property
    def argmax(self) -> torch.Tensor:
        if self._argmax is None:
            self._argmax = self.logits.argmax(-1)
        return self._argmax

    def draft_logits(self, d2t: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary only: just those rows of its lm_head over the final hidden
        state where the model is known (a product a sixth the size of the full one, and no gather of columns out of
        [B, T, V] logits), else those columns of the given logits."""
        if self._model is None:
            return self._logits[..., d2t]
        with torch.no_grad():
            return target_logits(self._model, self.hidden[max(self.hidden)], rows=d2t)

    def cat(self, layers: list[int]) -> torch.Tensor:
        return torch.cat([self.hidden[i].float() for i in layers], dim=-1)


def target_logits(model: Any, last_hidden: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The target's logits from its final (post-norm) hidden state, as its own forward computes them;
    `rows`: only those vocabulary entries."""
    head = model.get_output_embeddings()
    weight = head.weight if rows is None else head.weight[rows.to(head.weight.device)]
    bias = getattr(head, "bias", None)
    if bias is not None and rows is not None:
        bias = bias[rows.to(bias.device)]
    logits = F.linear(last_hidden.to(weight.dtype), weight, bias)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def medusa_objective(
    cfg: Any, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
) -> tuple[torch.Tensor, dict]:
    """Head i at t learns the token at t+2+i (ce) or the target's distribution there (kl), weighted decay^i."""
    num_layers = max(feats.hidden)
    logits = heads(feats.hidden[num_layers].to(next(heads.parameters()).dtype))
    labels = medusa_labels(batch["input_ids"], batch["loss_mask"], logits.shape[0], t2d)
    soft = (
        medusa_soft_targets(feats.logits.detach(), logits.shape[0], heads.d2t)
        if cfg.train.loss == "kl"
        else None
    )
    return medusa_loss(logits, labels, cfg.train.decay, soft)


def eagle_objective(
    cfg: Any, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
) -> tuple[torch.Tensor, dict]:
    """EAGLE-1: from (feature t + noise, token t+1) predict feature t+1 (smooth-L1) and the target's
    distribution there (cross-entropy), on positions whose next-next token is an answer token."""
    ec = heads.cfg
    ids, attn = batch["input_ids"], batch["attention_mask"]
    T = ids.shape[1]
    f = feats.hidden[max(feats.hidden)].float()
    f_in = f + (torch.rand_like(f) - 0.5) * ec.feature_noise if heads.training and ec.feature_noise > 0 else f
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


def eagle3_objective(
    cfg: Any, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
) -> tuple[torch.Tensor, dict]:
    """EAGLE-3: step j of the unrolled drafter at t learns the target's distribution at t+1+j restricted
    to the draft vocabulary, weighted ttt_decay^j; positions whose target argmax is outside the draft
    vocabulary are skipped, as is everything that is not an answer token."""
    ec = heads.cfg
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
        heads, ids, batch["attention_mask"], heads.project(feats.cat(ec.feature_layers)), ec.ttt_steps, needed
    )
    total = torch.zeros((), device=ids.device)
    metrics: dict[str, float] = {}
    correct = []
    for j, out in enumerate(unrolled.outputs):
        where = unrolled.valid(j, valid[j])
        hit = torch.zeros_like(valid[0])
        if bool(where.any()):
            logits = heads.logits(
                out[where]
            ).float()  # the draft lm_head only where a loss is taken: most of a step's cost
            rows, cols = unrolled.positions(j, where)  # step j at t learns the target's distribution at t+1+j
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


def dflash_anchors(batch: dict, count: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` anchors per sequence, [B, A] with a validity mask: positions whose next token is an answer
    token, drawn at random but fixed by the batch's tokens and the seed (a resumed or offline run draws the same)."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
    B, T = ids.shape
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(ids.long().sum()) % 1_000_000_007)
    nxt = torch.zeros_like(loss_mask)
    nxt[:, :-1] = loss_mask[:, 1:]
    rows = []
    for b in range(B):
        where = nxt[b].nonzero().view(-1).cpu()
        if len(where) > count:
            where = torch.sort(where[torch.randperm(len(where), generator=g)[:count]]).values
        rows.append(where)
    A = max(1, max(len(r) for r in rows))
    anchors = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, r in enumerate(rows):
        anchors[b, : len(r)], valid[b, : len(r)] = r, True
    return anchors.to(ids.device), valid.to(ids.device)


def dflash_objective(
    cfg: Any, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
) -> tuple[torch.Tensor, dict]:
    """DFlash: a block at each anchor a (its token, then mask tokens) sees the target's features before a and
    itself; slot j learns the target's distribution at a + j - 1 (the token at a + j) over the draft vocabulary,
    weighted exp(-(j - 1) / loss_gamma). Slots whose token is not an answer token, or whose target argmax is
    outside the draft vocabulary, are skipped."""
    dc = heads.cfg
    ids = batch["input_ids"]
    B, T = ids.shape
    bs, device = dc.block_size, ids.device
    anchors, anchor_ok = dflash_anchors(batch, dc.anchors, bs, cfg.train.seed)
    A = anchors.shape[1]
    slots = torch.arange(bs, device=device)
    pos = anchors.unsqueeze(-1) + slots  # [B, A, bs]
    tokens = torch.full((B, A, bs), heads.mask_token_id, dtype=ids.dtype, device=device)
    tokens[..., 0] = torch.gather(ids, 1, anchors)
    # queries of block i see context positions < its anchor and their own block, both ways
    ctx_ok = torch.arange(T, device=device).view(1, 1, T) < anchors.view(B, A, 1)
    same = torch.eye(A, dtype=torch.bool, device=device).repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    allowed = torch.cat(
        (ctx_ok.repeat_interleave(bs, 1), same.unsqueeze(0).expand(B, -1, -1)), dim=2
    )  # [B, A*bs, T + A*bs]
    context = heads.context(feats.cat(dc.feature_layers), torch.arange(T, device=device).expand(B, T))
    logits = heads.block(tokens.view(B, A * bs), pos.view(B, A * bs), context, allowed).view(B, A, bs, -1)
    target_p = torch.softmax(feats.draft_logits(heads.d2t.to(device)).detach().float(), -1)
    in_draft = (t2d[feats.argmax] >= 0) if t2d is not None else torch.ones_like(ids, dtype=torch.bool)
    total = target_p.new_zeros(())
    metrics: dict[str, float] = {}
    correct, valid0 = [], None
    for j in range(1, bs):
        t = (anchors + j - 1).clamp(max=T - 1)  # the target's distribution here is the token at a + j's
        ok = anchor_ok & (anchors + j < T)
        ok = (
            ok
            & torch.gather(batch["loss_mask"].bool(), 1, (anchors + j).clamp(max=T - 1))
            & torch.gather(in_draft, 1, t)
        )
        valid0 = ok if valid0 is None else valid0
        hit = torch.zeros_like(ok)
        if bool(ok.any()):
            slot_logits = logits[:, :, j][ok].float()
            p = torch.gather(target_p, 1, t.unsqueeze(-1).expand(-1, -1, target_p.shape[-1]))[ok]
            loss_j = draft_loss(dc.loss, slot_logits, p)
            total = total + math.exp(-(j - 1) / dc.loss_gamma) * loss_j
            right = slot_logits.argmax(-1) == p.argmax(-1)
            metrics[f"loss/slot{j}"] = float(loss_j.detach())
            metrics[f"top1/slot{j}"] = float(right.float().mean())
            hit[ok] = right
        correct.append(hit)
    metrics["tau/chain"] = float(chain_acceptance(correct, valid0))
    return total, metrics
