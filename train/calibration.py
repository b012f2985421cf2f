"""Per-head, per-rank accuracy on held-out data: what the tree builder needs to pick a tree."""

from __future__ import annotations

from typing import Any

import torch

from headway.train.data import Sample, collate
from headway.train.losses import IGNORE, medusa_labels


@torch.no_grad()
def rank_accuracy(
    target: Any, heads: Any, samples: list[Sample], batch_size: int, t2d: Any, topk: int = 8
) -> list[list[float]]:
    """[num_heads][topk]: the fraction of labelled positions where head d's rank-k guess is the
    token."""
    device = target.device
    hits = torch.zeros(heads.cfg.num_heads, topk)
    total = torch.zeros(heads.cfg.num_heads)
    was_training = heads.training
    heads.eval()
    for start in range(0, len(samples), batch_size):
        batch = collate(samples[start : start + batch_size], target.tokenizer.pad_token_id or 0)
        ids = batch["input_ids"].to(device)
        out = target.model(
            input_ids=ids,
            attention_mask=batch["attention_mask"].to(device),
            output_hidden_states=True,
        )
        logits = heads(out.hidden_states[-1].to(next(heads.parameters()).dtype))
        labels = medusa_labels(ids, batch["loss_mask"].to(device), logits.shape[0], t2d)
        top = logits.topk(topk, dim=-1).indices  # [K, B, T, topk]
        for d in range(logits.shape[0]):
            valid = labels[d] != IGNORE
            match = top[d][valid] == labels[d][valid].unsqueeze(-1)
            hits[d] += match.float().sum(0).cpu()
            total[d] += int(valid.sum())
    heads.train(was_training)
    return (hits / total.clamp(min=1).unsqueeze(-1)).tolist()
