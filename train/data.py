"""Training data: self-distilled datasets checked against the target, a stable held-out split,
batches.

The sample order is a pure function of (seed, samples consumed), so a resumed run reads exactly the
batches the uninterrupted run would have read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from headway.data_scripts.distill import load_distilled
from headway.errors import HeadwayError
from headway.target.loading import fingerprint_mismatch
from headway.train.dedup import answer_tokens, duplicates


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]
    key: str = ""  # "<dataset dir>#<sample id>": stable across runs (the feature cache's key)


def load_samples(
    paths: list[str], fingerprint: dict, max_length: int
) -> tuple[list[tuple[str, Sample]], dict]:
    """(key, sample) pairs from every dataset, and what the datasets share: `greedy`, every one
    distilled at temperature 0 (each answer token is the target's argmax); `answerless`, how many
    samples were dropped for having no answer token left after truncation to `max_length` (a prompt
    at least that long): such a sample teaches nothing, and a micro-batch of them has no loss row. A
    dataset made by another target is refused."""
    if not paths:
        raise HeadwayError(
            "no training data: set train.datasets=[DIR, ...] (directories written by `headway distill`)"
        )
    out, greedy, answerless = [], True, 0
    for path in paths:
        ds, manifest = load_distilled(path)
        greedy = greedy and (manifest.get("generation") or {}).get("temperature", 1.0) == 0
        diff = fingerprint_mismatch(manifest["target_fingerprint"], fingerprint)
        if diff:
            raise HeadwayError(
                f"dataset {path} was made by target {manifest['target_fingerprint'].get('id')}, not the "
                f"configured target {fingerprint.get('id')} ({'; '.join(diff)}): distil it again with this "
                "target"
            )
        for i, ids, mask in zip(ds["id"], ds["input_ids"], ds["loss_mask"]):
            key, mask = f"{path}#{i}", list(mask[:max_length])
            if not any(mask):
                answerless += 1
                continue
            out.append((key, Sample(list(ids[:max_length]), mask, key)))
    return out, {"datasets": paths, "greedy": greedy, "answerless": answerless}


def drop_duplicates(
    samples: list[tuple[str, Sample]], rule: str, threshold: float
) -> tuple[list[tuple[str, Sample]], int]:
    """The samples without duplicate answers (train.dedup), and how many were dropped."""
    dup = duplicates([answer_tokens(s.input_ids, s.loss_mask) for _, s in samples], rule, threshold)
    return [x for x, d in zip(samples, dup) if not d], sum(dup)


def split_heldout(
    samples: list[tuple[str, Sample]], fraction: float
) -> tuple[list[Sample], list[Sample]]:
    """Held-out by a hash of the sample's tokens: the same samples whatever the order, the other
    data or where the dataset lies (a key with the directory's path would move the split with it),
    and duplicates fall together."""
    train, held = [], []
    for _, s in samples:
        bucket = int(hashlib.sha256(repr(s.input_ids).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (held if bucket < fraction else train).append(s)
    if not train:
        raise HeadwayError(
            "every sample was held out for evaluation: lower train.eval_fraction or add data"
        )
    return train, held


def sample_order(
    n: int, seed: int, epoch: int, lengths: Optional[Sequence[int]] = None, window: int = 0
) -> tuple[int, ...]:
    """Epoch `epoch`'s order of n samples: a seeded shuffle; with `window` > 1, cut into windows of
    that many samples, each sorted by `lengths` (ascending or descending, by a seeded coin per
    window), so that consecutive samples (a micro-batch) are of similar length and pad little. A
    pure function of its
    arguments: a resumed run, or one that splits its batches otherwise, reads the same stream."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    if window > 1 and lengths is not None:
        flips = torch.randint(0, 2, ((n + window - 1) // window,), generator=g).tolist()
        order = [
            i
            for w, start in enumerate(range(0, n, window))
            for i in sorted(
                order[start : start + window], key=lambda i: lengths[i], reverse=bool(flips[w])
            )
        ]
    return tuple(order)


class Stream:
    """The training stream over `samples` (`sample_order` per epoch): the lengths read once, each
    epoch's order computed once when first read, so that reading a micro-batch costs O(its size),
    not O(dataset) (a step's host plan must keep ahead of the GPUs at any corpus size)."""

    def __init__(self, samples: list[Sample], seed: int, window: int = 0) -> None:
        self.samples, self.seed, self.window = samples, seed, window
        self.lengths = [len(s.input_ids) for s in samples] if window > 1 else None
        self._orders: dict[int, tuple[int, ...]] = {}

    def order(self, epoch: int) -> tuple[int, ...]:
        """Epoch `epoch`'s order (the last two epochs kept: a micro-batch may straddle them)."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = sample_order(
                len(self.samples), self.seed, epoch, self.lengths, self.window
            )
        return self._orders[epoch]

    def at(self, k: int) -> Sample:
        """The k-th sample of the stream."""
        n = len(self.samples)
        return self.samples[self.order(k // n)[k % n]]

    def take(self, consumed: int, size: int) -> list[Sample]:
        """The `size` samples after the first `consumed`."""
        return [self.at(k) for k in range(consumed, consumed + size)]


def batch_at(
    samples: list[Sample], consumed: int, size: int, seed: int, window: int = 0
) -> list[Sample]:
    """The `size` samples after the first `consumed` ones of the epoch-shuffled stream
    (length-sorted in windows of `window` samples: `sample_order`). A run reads through one `Stream`
    instead, which keeps the epoch's order between calls."""
    return Stream(samples, seed, window).take(consumed, size)


def collate(batch: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and loss_mask tensors [B, T]."""
    width = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    loss = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        loss[i, :n] = torch.tensor(s.loss_mask)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


def token_frequencies(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """How often each token id appears where the loss mask is on (the target's own writing)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.tensor([t for t, m in zip(s.input_ids, s.loss_mask) if m], dtype=torch.long)
        if len(ids):
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts
