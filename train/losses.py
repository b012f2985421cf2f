"""Losses for draft heads. Medusa: head i learns the token 2+i positions after its hidden state."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE = -100
# A metric `name` that is a mean over rows comes with `name + COUNT`, its row count: micro-batches
# and ranks are averaged as sums over counts (train/metrics.py), so a micro-batch with few rows
# weighs little and one with none nothing, and every objective emits the same keys whatever its rows
# (the ranks' all-reduce of them has one length).
COUNT = "#n"


def counted(
    metrics: dict[str, torch.Tensor], name: str, mean: torch.Tensor, mask: torch.Tensor
) -> None:
    """Set metrics[name] to `mean` (a mean over the rows where `mask` is true) and its row count."""
    metrics[name] = mean
    metrics[name + COUNT] = mask.sum().float()


def target_to_draft(
    d2t: Optional[torch.Tensor], vocab_size: int, device: torch.device
) -> Optional[torch.Tensor]:
    """t2d map: target id -> draft id, or -1 for tokens outside the draft vocabulary."""
    if d2t is None:
        return None
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    t2d[d2t.to(device)] = torch.arange(len(d2t), device=device)
    return t2d


def medusa_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int, t2d: Optional[torch.Tensor]
) -> torch.Tensor:
    """[K, B, T] draft-id labels: position t of head i is the token at t+2+i where the mask is on,
    else IGNORE.

    Tokens outside a reduced draft vocabulary are IGNORE too (no draft id can name them).
    """
    B, T = input_ids.shape
    labels = torch.full((num_heads, B, T), IGNORE, dtype=torch.long, device=input_ids.device)
    for i in range(num_heads):
        shift = 2 + i
        if shift >= T:
            continue
        tok = input_ids[:, shift:]
        lab = tok if t2d is None else t2d[tok]
        lab = torch.where(
            loss_mask[:, shift:].bool() & (lab >= 0), lab, torch.full_like(lab, IGNORE)
        )
        labels[i, :B, : T - shift] = lab
    return labels


def medusa_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    decay: float,
    soft_targets: Optional[torch.Tensor] = None,
    rows: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum over heads of the mean loss on labelled positions; soft targets turn CE into the
    cross-entropy to the target's distribution (KL up to a constant). Nothing is read back to the
    host: the means divide by device counts, and metrics are 0-dim device tensors.

    Args:
        logits: [K, B, T, V] head logits.
        labels: [K, B, T] draft-id labels, IGNORE where no loss is taken.
        decay: head i's loss weight is decay**i.
        soft_targets: [K, B, T, V] distributions (all positions), or, with `rows`, head i's [n_i, V]
            at its rows.
        rows: head i's (batch rows, positions) [n_i], a host-computed superset of its labelled
            positions (Medusa's plan); None = every position.
    Returns:
        (loss, metrics): loss/head{i}, top1/head{i}, top5/head{i}.
    """
    total = logits.new_zeros((), dtype=torch.promote_types(logits.dtype, torch.float32))
    metrics: dict[str, torch.Tensor] = {}
    for i in range(logits.shape[0]):
        if rows is None:
            lg, lab = logits[i].flatten(0, 1), labels[i].flatten()
            soft = None if soft_targets is None else soft_targets[i].flatten(0, 1)
        else:
            r, c = rows[i]
            lg, lab = logits[i][r, c], labels[i][r, c]
            soft = None if soft_targets is None else soft_targets[i]
        if lg.shape[0] == 0:  # a host-known shape: no row of this head can take a loss
            continue
        weight = lab != IGNORE
        lg = wide(lg)
        if soft is None:
            per_row = F.cross_entropy(lg, lab.clamp(min=0), reduction="none")
        else:
            per_row = -(wide(soft) * F.log_softmax(lg, -1)).sum(-1)
        loss = masked_mean(per_row, weight)
        total = total + (decay**i) * loss
        counted(metrics, f"loss/head{i}", loss.detach(), weight)
        top = lg.detach().topk(min(5, lg.shape[-1]), dim=-1).indices
        want = lab.unsqueeze(-1)
        counted(metrics, f"top1/head{i}", masked_mean((top[:, :1] == want).any(-1), weight), weight)
        counted(metrics, f"top5/head{i}", masked_mean((top == want).any(-1), weight), weight)
    return total, metrics


def distill_kl(
    adapted_logits: torch.Tensor, frozen_logits: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Mean over real tokens of KL(frozen target || adapted target): keeps Medusa-2's target
    itself."""
    logp = F.log_softmax(adapted_logits.float(), -1)
    logq = F.log_softmax(frozen_logits.float(), -1)
    kl = (logq.exp() * (logq - logp)).sum(-1)
    mask = attention_mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least (float64 stays float64: the float64 equivalence tests run in it)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is true (0 when nothing is), with a device denominator: no host
    read."""
    dtype = values.dtype if values.is_floating_point() else torch.float32
    mask = mask.bool()
    kept = torch.where(mask, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))
    return kept.sum() / mask.sum().clamp(min=1).to(dtype)


def draft_loss(
    kind: str, logits: torch.Tensor, target_p: torch.Tensor, weight: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean loss of draft logits [n, V] against the target's distribution target_p [n, V] on the
    same vocabulary, over the rows where the bool `weight` [n] is true (None: all rows); the mean's
    denominator stays on the device.

    soft_ce: cross-entropy to target_p (KL up to a constant); argmax_ce: cross-entropy on target_p's
        argmax,
    the token greedy verification accepts; tv: total variation, since 1 - TV(draft, target) is the
    chance that lossless sampling accepts a drafted token; soft_ce+tv: their sum.
    """
    return masked_mean(draft_loss_rows(kind, logits, target_p), _all_rows(logits, weight))


def _all_rows(logits: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    return (
        torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        if weight is None
        else weight
    )


def draft_loss_rows(kind: str, logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """draft_loss's per-row values [n] (see draft_loss for the kinds)."""
    if kind == "argmax_ce":
        return F.cross_entropy(logits, target_p.argmax(-1), reduction="none")
    logp = F.log_softmax(logits, -1)
    soft = -(target_p * logp).sum(-1)
    if kind == "soft_ce":
        return soft
    tv = 0.5 * (logp.exp() - target_p).abs().sum(-1)
    if kind == "tv":
        return tv
    if kind == "soft_ce+tv":
        return soft + tv
    raise ValueError(f"unknown draft loss {kind!r}")


def chain_acceptance(correct: list[torch.Tensor], valid0: torch.Tensor) -> torch.Tensor:
    """Expected tokens per target forward of a greedy chain, simulated: 1 + the mean over positions
    valid at step 0 of how many leading steps drafted the target's token. correct[j]: bool [B, T],
    step j right at t."""
    run = torch.ones_like(valid0, dtype=torch.float32)
    length = torch.zeros_like(run)
    for c in correct:
        run = run * c.float()
        length = length + run
    return 1 + masked_mean(length, valid0)


def chain_metric(
    metrics: dict[str, torch.Tensor], correct: list[torch.Tensor], valid0: torch.Tensor
) -> None:
    """metrics["tau/chain"] (`chain_acceptance`) and its count: the positions valid at step 0."""
    counted(metrics, "tau/chain", chain_acceptance(correct, valid0).detach(), valid0)
