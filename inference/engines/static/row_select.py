"""Greedy's token and a drafter's most likely tokens from logit rows: the extension's kernels
(csrc/row_select.cpp) for CPU rows in float32 or bf16 where this process has built it, torch's
reductions elsewhere. ATen's max along a dimension and its topk scan a row one element at a time on
CPUs (~100 us for a 49,152-token bf16 row); the kernels skip a 16-value block after one vector
compare."""

from __future__ import annotations

import torch

from headway.inference.engines.static import layer_loop

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernels(logits: torch.Tensor):
    """The extension where it serves these rows, else None."""
    if logits.device.type != "cpu" or logits.dtype not in _KERNEL_DTYPES or logits.shape[-1] == 0:
        return None
    return layer_loop.built()


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest logit, argmax's token (the first NaN where a row has
    one).

    Args:
        logits: [n, V] or [V].
    Returns:
        int64 indices [n] (a 0-d tensor for a [V] row)."""
    rows = logits.reshape(-1, logits.shape[-1])
    ext = _kernels(logits)
    # argmax, not max(-1).indices: only argmax promises the first of tied maxima on every device
    # (the CUDA backend's step picks greedy tokens with it, and plain decoding must pick the same)
    picked = ext.first_max(rows) if ext is not None else rows.argmax(-1)
    return picked.reshape(logits.shape[:-1])


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k most likely tokens: log_softmax(logits).topk(k), largest first (ties: lower
    index first with the kernel), the log probabilities within float rounding of torch's.

    Args:
        logits: [n, V] with 1 <= k <= V.
    Returns:
        (log probabilities [n, k] float32, token indices [n, k] int64)."""
    ext = _kernels(logits)
    if ext is not None and logits.dim() == 2:
        return tuple(ext.top_logprobs(logits, k))
    top = torch.log_softmax(logits.float(), -1).topk(k)
    return top.values, top.indices
