"""Removing duplicate answers from training data: exact copies, or near copies by MinHash over token
n-grams.

Self-distilled data repeats itself: Magpie prompts ask the same things, and a small target answers
similar prompts with the same text. Repeats spend training steps on what the head has already seen.
The first of a group is kept (data order), so the rule is deterministic and a resumed run sees the
same set.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

# MinHash: NUM_HASHES signature entries in BANDS bands; two answers share a bucket when one band
# agrees.
NUM_HASHES, BANDS = 64, 16
_PRIME = (1 << 61) - 1


def answer_tokens(input_ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[int, ...]:
    return tuple(t for t, m in zip(input_ids, loss_mask) if m)


def minhash(tokens: tuple[int, ...], ngram: int, coeffs: np.ndarray) -> np.ndarray:
    """[NUM_HASHES] uint64 signature of the set of `ngram`-grams (the whole text when it is
    shorter)."""
    n = max(1, len(tokens) - ngram + 1)
    grams = {tokens[i : i + ngram] for i in range(n)}
    keys = np.array(
        [
            int.from_bytes(hashlib.blake2b(repr(g).encode(), digest_size=7).digest(), "little")
            for g in grams
        ],
        dtype=np.uint64,
    )
    a, b = coeffs[:, :1], coeffs[:, 1:]
    # (a * x + b) mod p on 64-bit words; the wrap-around is part of the hash family, not an error
    with np.errstate(over="ignore"):
        return ((a * keys[None, :] + b) % np.uint64(_PRIME)).min(axis=1)


def duplicates(
    answers: list[tuple[int, ...]], rule: str, threshold: float = 0.8, ngram: int = 5
) -> list[bool]:
    """Per answer, True when an earlier answer is the same (rule=exact) or its estimated Jaccard
    similarity of token `ngram`-grams to an earlier kept one is at least `threshold` (rule=near);
    rule=none keeps all."""
    if rule == "none":
        return [False] * len(answers)
    if rule == "exact":
        seen: set[tuple[int, ...]] = set()
        out = []
        for a in answers:
            out.append(a in seen)
            seen.add(a)
        return out
    rng = np.random.default_rng(0)
    coeffs = rng.integers(1, _PRIME, size=(NUM_HASHES, 2), dtype=np.uint64)
    rows = NUM_HASHES // BANDS
    buckets: list[dict[bytes, list[int]]] = [{} for _ in range(BANDS)]
    kept: dict[int, np.ndarray] = {}
    out = []
    for i, a in enumerate(answers):
        sig = minhash(a, ngram, coeffs)
        keys = [sig[k * rows : (k + 1) * rows].tobytes() for k in range(BANDS)]
        near = {j for k, key in enumerate(keys) for j in buckets[k].get(key, ())}
        dup = any(float((kept[j] == sig).mean()) >= threshold for j in near)
        out.append(dup)
        if not dup:
            kept[i] = sig
            for k, key in enumerate(keys):
                buckets[k].setdefault(key, []).append(i)
    return out
