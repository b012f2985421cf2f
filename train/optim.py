"""The optimizer and learning-rate schedule of a run: AdamW (fused on CUDA) over the head's
trainable parameters (and Medusa-2's LoRA adapters, at their own rate), with linear warm-up then
cosine decay."""

from __future__ import annotations

import math
from typing import Any

import torch


def make_optimizer(groups: list[dict], tc: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the parameter groups with train.lr, weight_decay and betas; fused into one kernel
    per step on CUDA (torch's fused AdamW), torch's default (foreach) implementation elsewhere."""
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(
        groups, lr=tc.lr, weight_decay=tc.weight_decay, betas=tuple(tc.betas), **fused
    )


def cosine_schedule(optimizer: Any, warmup: int, total: int, min_ratio: float) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
