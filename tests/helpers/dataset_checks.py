"""Checks shared by the distillation tests: where the loss mask is on, and what greedy decoding
writes."""

from __future__ import annotations

import torch


def mask_spans(mask: list[int]) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of 1s in a loss mask: one per assistant turn the target wrote."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def greedy_reference(
    model, context: list[int], max_new_tokens: int, stop_ids: list[int], pad_id: int
) -> list[int]:
    """What batch-1 greedy `generate` writes after `context`, up to and including the first stop
    token."""
    out = model.generate(
        torch.tensor([context]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )[0, len(context) :].tolist()
    return out[: next((i + 1 for i, t in enumerate(out) if t in stop_ids), len(out))]
