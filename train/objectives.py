"""What each head kind learns from the frozen target's features on one batch.

`Features` is the target's side of a batch (hidden states at the layers a head reads, logits), made
by running the target (online) or read back from a feature cache (offline): the objectives cannot
tell which, so both modes give the same loss on the same batch.
"""

from __future__ import annotations

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
        """The target's logits over the draft vocabulary only (offline: just those rows of its lm_head)."""
        if self._logits is not None:
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
    target_p = torch.softmax(feats.draft_logits(heads.d2t.to(ids.device)).detach().float(), -1)
    in_draft = (t2d[feats.argmax] >= 0) if t2d is not None else torch.ones_like(ids, dtype=torch.bool)
    valid = [
        shifted(batch["loss_mask"], 2 + j).bool() & shifted(in_draft, 1 + j, False)
        for j in range(ec.ttt_steps)
    ]
    needed = torch.stack(valid[1:]).any(0) if ec.ttt_steps > 1 else None
    unrolled = ttt_unroll(
        heads, ids, batch["attention_mask"], heads.project(feats.cat(ec.feature_layers)), ec.ttt_steps, needed
    )
    total = target_p.new_zeros(())
    metrics: dict[str, float] = {}
    correct = []
    for j, out in enumerate(unrolled.outputs):
        where = unrolled.valid(j, valid[j])
        hit = torch.zeros_like(valid[0])
        if bool(where.any()):
            logits = heads.logits(
                out[where]
            ).float()  # the draft lm_head only where a loss is taken: most of a step's cost
            p = unrolled.at(j, shifted(target_p, 1 + j))[where]
            loss_j = draft_loss(ec.loss, logits, p)
            total = total + (ec.ttt_decay**j) * loss_j
            right = logits.argmax(-1) == p.argmax(-1)
            metrics[f"loss/step{j}"] = float(loss_j.detach())
            metrics[f"top1/step{j}"] = float(right.float().mean())
            hit = unrolled.scatter(j, where, right, hit)
        correct.append(hit)
    metrics["tau/chain"] = float(chain_acceptance(correct, valid[0]))
    return total, metrics
