"""The target's distribution at temperature > 0: what plain decoding samples from, and what every
engine's acceptance (the host rules in sampling.py, the CUDA backend's on the device, the batched
decoder's rows) measures a draft against."""

from __future__ import annotations

import torch

from headway.inference.config import SamplingConfig


def target_distribution(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities (float64, last dim) after temperature, then top-k, then top-p, as Hugging
    Face's sampling applies them. Plain and speculative decoding both sample from exactly this."""
    scores = logits.double() / cfg.temperature
    if cfg.top_k and cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - cfg.top_p
        drop[..., -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.softmax(-1)
