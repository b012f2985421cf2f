"""Packing: whole sequences filled into rows of a fixed token length, instead of padding each to the
longest.

A packed micro-batch is `rows` rows of `length` tokens, however many sequences fill them: every step
has the same shape, and a token of padding is only what the last sequence of a row leaves. Each
sequence keeps its own positions (restarting at 0) and sees only itself: `doc` [R, L] numbers the
sequences of a row (-1 on padding), and the target's and the heads' attention are document-causal
(train/target_features.py, train/ttt.py).

The stream is the padded one (`batch_at`): sequences are taken in its order, so the batches are a
pure function of (seed, sequences consumed) and a resumed run reads the same ones; a step reports
where it stopped.
"""

from __future__ import annotations

from typing import Optional

import torch

from headway.errors import HeadwayError
from headway.train.data import Sample, Stream

# A packed row's sequence: (row, start, end), its tokens row[start:end].
Segment = tuple[int, int, int]


def pack_at(
    samples: list[Sample],
    consumed: int,
    rows: int,
    length: int,
    seed: int,
    window: int = 0,
    stream: Optional[Stream] = None,
) -> tuple[list[list[Sample]], int]:
    """The sequences after the first `consumed` of the stream, filled in order into `rows` rows of
    `length`
    tokens: one that does not fit the current row starts the next, and the first that fits no row
        left ends
    the batch.

    Args:
        stream: the run's `Stream` over `samples` (its epoch orders kept between calls); None: made
            here.
    Returns:
        (the rows' sequences, the stream position after the last one taken).
    """
    stream = stream or Stream(samples, seed, window)
    out: list[list[Sample]] = [[] for _ in range(rows)]
    used, r, k = 0, 0, consumed
    while r < rows:
        s = stream.at(k)
        size = len(s.input_ids)
        if size > length:
            raise HeadwayError(
                f"a {size}-token sequence ({s.key}) is longer than train.pack_length={length}: set "
                "train.pack_length to at least train.max_length"
            )
        if used + size > length:
            r, used = r + 1, 0
            continue
        out[r].append(s)
        used, k = used + size, k + 1
    return out, k


def collate_packed(rows: list[list[Sample]], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The packed micro-batch [R, L]: input_ids, attention_mask (1 on real tokens), loss_mask, doc
    (each token's sequence within its row; -1 on padding) and positions (restarting at each
    sequence, and at the padding)."""
    R = len(rows)
    ids = torch.full((R, length), pad_id, dtype=torch.long)
    attn = torch.zeros((R, length), dtype=torch.long)
    loss = torch.zeros((R, length), dtype=torch.long)
    doc = torch.full((R, length), -1, dtype=torch.long)
    pos = torch.zeros((R, length), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, s in enumerate(row):
            n = len(s.input_ids)
            ids[r, at : at + n] = torch.tensor(s.input_ids)
            loss[r, at : at + n] = torch.tensor(s.loss_mask)
            attn[r, at : at + n], doc[r, at : at + n] = 1, d
            pos[r, at : at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(length - at)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "doc": doc,
        "positions": pos,
    }


def doc_segments(doc: torch.Tensor) -> list[Segment]:
    """Each sequence of a packed batch as (row, start, end), in row order, from `doc` [R, L] (each
    token's sequence id, -1 on padding, as `collate_packed` makes it); the padding is no sequence.
    It reads `doc`'s values: run it on the host's batch when planning the step, which then hands
    them to the target's forward (train/target_features.py: each sequence attends alone).

    Raises:
        HeadwayError: a sequence's tokens are not contiguous in their row.
    """
    out: list[Segment] = []
    for r, row in enumerate(doc.cpu()):
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        ids_, at = ids.tolist(), 0
        real = [i for i in ids_ if i >= 0]
        if len(set(real)) != len(real):
            raise HeadwayError(f"packed row {r}: a sequence's tokens are not contiguous ({ids_})")
        for i, n in zip(ids_, counts.tolist()):
            if i >= 0:
                out.append((r, at, at + n))
            at += n
    return out
