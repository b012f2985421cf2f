"""A draft head's vocabulary loss in chunks of rows, keeping no [n, V] tensor for backward.

The full loss (train/losses.py, `draft_loss`) computes logits [n, V] in float32, the log-softmax and
the target's distribution, and autograd keeps several of those [n, V] tensors until backward, at
every TTT step. Here each chunk of rows makes its logits, its loss rows and their gradient with
respect to the logits, and folds that at once into the gradients of the hidden states [n, d] and of
the lm_head weight [V, d]; only those two are kept for backward, scaled there by the loss's incoming
gradient (the loss is a scalar). The values and gradients are the full loss's
(tests/train/test_chunked_loss.py checks them in float64).

The gradient of each kind with respect to the logits z (q = softmax(z), p = the target's
distribution):
soft_ce: q * sum(p) - p; argmax_ce: q - onehot(argmax p), and ce the same on given labels; tv
(0.5 * |q - p|_1): q * (g - <q, g>) with g = 0.5 * sign(q - p).
"""

from __future__ import annotations

from typing import Any

import torch

KINDS = ("soft_ce", "argmax_ce", "tv", "soft_ce+tv", "ce")  # ce: cross-entropy on given labels


def _rows_and_grad(
    kind: str, z: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss [c] and its gradient with respect to the logits [c, V], for logits z and target
    p."""
    logp = torch.log_softmax(z, -1)
    q = logp.exp()
    if kind in ("argmax_ce", "ce"):
        best = p.unsqueeze(-1) if kind == "ce" else p.argmax(-1, keepdim=True)
        grad = q.scatter_add(-1, best, -torch.ones_like(best, dtype=q.dtype))
        return -logp.gather(-1, best).squeeze(-1), grad
    rows = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
    grad = torch.zeros_like(z)
    if kind in ("soft_ce", "soft_ce+tv"):
        rows = rows - (p * logp).sum(-1)
        grad = grad + q * p.sum(-1, keepdim=True) - p
    if kind in ("tv", "soft_ce+tv"):
        diff = q - p
        rows = rows + 0.5 * diff.abs().sum(-1)
        g = 0.5 * diff.sign()
        grad = grad + q * (g - (q * g).sum(-1, keepdim=True))
    return rows, grad


class _ChunkedDraftLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target_logits: torch.Tensor,
        rows: torch.Tensor,
        kind: str,
        chunk: int,
        top: int,
        grads: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 when given
        # the weight cast once, to the dtype its matmuls run in (autocast's, else the hidden
        # states'), and shared by every chunk: autocast would otherwise cast it again in each
        # chunk's two matmuls
        device = hidden.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        w = weight.to(torch.get_autocast_dtype(device) if autocast else hidden.dtype)
        # grad_h's matmul: dz is in acc
        w_grad = w if autocast or w.dtype == acc else weight.to(acc)
        scale = rows.to(acc) / rows.sum().clamp(min=1).to(acc)  # each kept row's share of the mean
        # no gradients under no_grad (evaluation); a frozen lm_head (EAGLE-1's, the target's) needs
        # none
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        grad_h = torch.empty(hidden.shape if want_h else (0,), dtype=acc, device=hidden.device)
        grad_w = torch.zeros(weight.shape if want_w else (0,), dtype=acc, device=weight.device)
        best = torch.empty((n, top) if top > 1 else n, dtype=torch.long, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            h = hidden[start:end]
            z = (h @ w.T).to(acc)
            teacher = target_logits[start:end]
            p = teacher if kind == "ce" else torch.softmax(teacher.to(acc), -1)
            per_row, dz = _rows_and_grad(kind, z, p)
            s = scale[start:end]
            total = total + (per_row * s).sum()
            dz = dz * s.unsqueeze(-1)
            if want_h:
                grad_h[start:end] = dz @ w_grad
            if want_w:
                grad_w += dz.T @ h.to(acc)
            best[start:end] = z.argmax(-1) if top == 1 else z.topk(top, dim=-1).indices
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.wanted = (want_h, want_w)
        ctx.mark_non_differentiable(best)
        return total, best

    @staticmethod
    def backward(ctx: Any, g_total: torch.Tensor, g_best: Any) -> tuple:
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        want_h, want_w = ctx.wanted
        g = g_total.to(grad_h.dtype)
        gh = (grad_h * g).to(h_dtype) if want_h and ctx.needs_input_grad[0] else None
        gw = (grad_w * g).to(w_dtype) if want_w and ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None


def chunked_draft_loss(
    kind: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    rows: torch.Tensor,
    chunk: int,
    top: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_loss(kind, hidden @ weight.T, softmax(target_logits), rows)` computed `chunk` rows at
    a time.

    Args:
        kind: soft_ce, argmax_ce, tv or soft_ce+tv (as `draft_loss`), or ce (cross-entropy on
            labels).
        hidden: [n, d] the lm_head's input (after the head's final norm), with gradient.
        weight: [V, d] the lm_head weight, with gradient.
        target_logits: [n, V] the target's logits over the same vocabulary (no gradient; any dtype);
            for ce, the labels [n] (long, in range: clamp ignored rows' labels and leave them out of
            `rows`).
        rows: [n] bool, the rows the mean is over.
        chunk: rows per chunk (> 0).
        top: how many of each row's best logits to return (1: the argmax).
    Returns:
        (loss, best): the 0-dim mean loss (float32, float64 for float64 inputs) and the logits'
        argmax [n] (top=1) or top-k indices [n, top] (for accuracy metrics), with no [n, V] tensor
        kept.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown draft loss {kind!r}")
    top = min(top, weight.shape[0])
    grads = torch.is_grad_enabled()  # forward runs with grad mode off: read it here
    return _ChunkedDraftLoss.apply(
        hidden, weight, target_logits.detach(), rows, kind, chunk, top, grads
    )
