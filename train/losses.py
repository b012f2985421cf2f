"""Losses for draft heads. Medusa: head i learns the token 2+i positions after its hidden state."""

from __future__ import annotations

from typing import Any, Optional

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


# Rows per chunk of Medusa-2's distillation loss: a chunk's float32 [rows, V] tensors at a 128k
# vocabulary are 512 MB each, where the whole [B, T, V] pair at B=4, T=2k would be 4 GB each.
DISTILL_CHUNK = 1024


class _DistillKL(torch.autograd.Function):
    """`distill_kl` a chunk of rows at a time: each chunk's log-softmaxes are made in float32 and
    dropped at once, its gradient with respect to the adapted logits (softmax(z) * sum(q) - q, over
    the real tokens' count) kept in the logits' own dtype, the only [B, T, V] tensor kept for
    backward (as train/chunked_loss.py does for the heads' loss)."""

    @staticmethod
    def forward(
        ctx: Any,
        adapted: torch.Tensor,
        frozen: torch.Tensor,
        mask: torch.Tensor,
        chunk: int,
        grads: bool,
    ) -> torch.Tensor:
        V = adapted.shape[-1]
        z_all, q_all = adapted.reshape(-1, V), frozen.reshape(-1, V)
        n = z_all.shape[0]
        acc = torch.promote_types(adapted.dtype, torch.float32)
        m = mask.reshape(-1).to(acc)
        count = m.sum().clamp(min=1)
        share = m / count  # each real token's share of the mean
        want = grads and ctx.needs_input_grad[0]
        grad = torch.empty(
            z_all.shape if want else (0,), dtype=adapted.dtype, device=adapted.device
        )
        total = torch.zeros((), dtype=acc, device=adapted.device)
        for start in range(0, n, chunk if chunk > 0 else max(n, 1)):
            end = min(n, start + chunk) if chunk > 0 else n
            logp = F.log_softmax(z_all[start:end].to(acc), -1)
            logq = F.log_softmax(q_all[start:end].to(acc), -1)
            q = logq.exp()
            total = total + ((q * (logq - logp)).sum(-1) * m[start:end]).sum()
            if want:
                dz = logp.exp_() * q.sum(-1, keepdim=True) - q
                grad[start:end] = dz * share[start:end].unsqueeze(-1)
        ctx.save_for_backward(grad)
        ctx.shape, ctx.want, ctx.chunk = adapted.shape, want, chunk if chunk > 0 else max(n, 1)
        return total / count

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        if not (ctx.want and ctx.needs_input_grad[0]):
            return None, None, None, None, None
        (grad,) = ctx.saved_tensors
        # scaled in place, a chunk at a time in float32 (no [B, T, V] float32 tensor in backward
        # either); a second backward through it would find it modified and raise
        g = g.to(torch.promote_types(grad.dtype, torch.float32))
        for start in range(0, grad.shape[0], ctx.chunk):
            part = grad[start : start + ctx.chunk]
            part.copy_(part.to(g.dtype) * g)
        return grad.view(ctx.shape), None, None, None, None


def distill_kl(
    adapted_logits: torch.Tensor,
    frozen_logits: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk: int = DISTILL_CHUNK,
) -> torch.Tensor:
    """Mean over real tokens of KL(frozen target || adapted target): keeps Medusa-2's target
    itself.

    Computed `chunk` rows at a time (`_DistillKL`; 0: one pass), in float32 at least: no float32
    [B, T, V] tensor is made, and the one tensor kept for backward is the gradient with respect to
    `adapted_logits`, in their dtype.

    Args:
        adapted_logits: [B, T, V] the LoRA-adapted target's logits, with gradient.
        frozen_logits: [B, T, V] the frozen target's logits (no gradient; any dtype).
        attention_mask: [B, T] the real tokens (1) and the padding (0).
        chunk: rows (tokens) per chunk.
    Returns:
        The 0-dim mean KL (float32, float64 for float64 logits).
    """
    grads = torch.is_grad_enabled()  # forward runs with grad mode off: read it here
    return _DistillKL.apply(adapted_logits, frozen_logits.detach(), attention_mask, chunk, grads)


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
