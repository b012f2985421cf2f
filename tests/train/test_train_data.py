"""The training stream's order: a seeded shuffle, in length-sorted windows that pad micro-batches
less, the same for a resumed run and for any split of the batches."""

from __future__ import annotations

import torch

from headway.train.data import Sample, batch_at, collate, sample_order


def _samples(n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 400, (n,), generator=g).tolist()
    return [Sample([1] * k, [0] * (k // 3) + [1] * (k - k // 3)) for k in lengths]


def _padding(samples: list[Sample], window: int, micro: int = 4) -> float:
    padded = real = 0
    for consumed in range(0, len(samples) - micro + 1, micro):
        batch = collate(batch_at(samples, consumed, micro, seed=7, window=window), 0)
        padded += batch["attention_mask"].numel()
        real += int(batch["attention_mask"].sum())
    return 1 - real / padded


def test_length_windows_reorder_within_each_window_and_cut_padding():
    samples = _samples(300)
    lengths = tuple(len(s.input_ids) for s in samples)
    plain = sample_order(len(samples), 7, 0)
    grouped = sample_order(len(samples), 7, 0, lengths, 64)
    assert sorted(grouped) == list(range(300))  # every sample once per epoch
    # each window holds the shuffle's samples, sorted one way or the other
    for start in range(0, 300, 64):
        window = grouped[start : start + 64]
        assert sorted(window) == sorted(plain[start : start + 64])
        ks = [lengths[i] for i in window]
        assert ks in (sorted(ks), sorted(ks, reverse=True))
    assert sample_order(len(samples), 7, 1, lengths, 64) != grouped  # each epoch its own order
    assert _padding(samples, window=128) < 0.1 < 0.3 < _padding(samples, window=0)


def test_the_stream_is_the_same_however_it_is_read():
    """A run resumed at any sequence, or reading micro-batches of another size, sees the same
    sequences."""
    samples = _samples(50)
    whole = batch_at(samples, 0, 120, seed=3, window=16)  # past one epoch
    pieces = [
        s
        for consumed in range(0, 120, 6)
        for s in batch_at(samples, consumed, 6, seed=3, window=16)
    ]
    assert [id(s) for s in pieces] == [id(s) for s in whole]
