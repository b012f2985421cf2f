"""fbgemm's float16 kernel as the float16 format calls it: one call, the chunked calls that give a
row the same bits for any row count, and the probe that tells whether this CPU's kernels need them.

Apart from the format's module (target/packed_float16.py) because the capability checks
(target/packed_capability.py) run the probe too, before any weight is packed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# fbgemm's float16 kernels on AVX2 CPUs (not on AVX512 ones) accumulate a block of 1 or 2 rows in
# another order than a block of 3 to 6, and a call picks its blocks from its row count: a row's bits
# then depend on how many rows the call has, and a verified tree's rows differ from the one-row
# steps of plain decoding. Row-exact (bf16) calls of up to this many rows then go in chunks of 3 to
# 6 rows (a step of 1 or 2 rows padded with copies of its first), whose rows agree with each other;
# longer inputs (a prompt's prefill, the same call in plain and speculative decoding) go in one
# call. fbgemm's thread count never changes a row's bits.
FBGEMM_CHUNKED_ROWS = 512
FBGEMM_CHUNK = (3, 6)  # the fewest and most rows of a chunk


def fbgemm_fp16(x: torch.Tensor, packed: object) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16.default(x, packed)


def fbgemm_chunked(x: torch.Tensor, packed: object) -> torch.Tensor:
    """x [rows, in] (float32) through fbgemm in chunks of FBGEMM_CHUNK rows: every row's bits the
    same for any row count, on every CPU."""
    rows, (least, most) = x.shape[0], FBGEMM_CHUNK
    if rows < least:
        return fbgemm_fp16(torch.cat([x, x[:1].expand(least - rows, -1)]), packed)[:rows]
    if rows <= most:
        return fbgemm_fp16(x, packed)
    chunks = -(-rows // most)  # as even as possible: each has rows // chunks >= least rows
    sizes = [rows // chunks + (i < rows % chunks) for i in range(chunks)]
    return torch.cat([fbgemm_fp16(part, packed) for part in x.split(sizes)])


@functools.cache
def fbgemm_probe() -> tuple[bool, bool]:
    """Probed once on a small random weight: whether fbgemm's float16 kernel gives a row other bits
    in calls of other row counts on this CPU (AVX2: yes), and whether `fbgemm_chunked` gives it the
    same bits for every count."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 512, generator=gen) / 16).half().float()
    x = torch.randn(16, 512, generator=gen)
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)

    def agree(call: Any) -> bool:
        alone = torch.cat([call(x[i : i + 1], packed) for i in range(16)])
        return all(torch.equal(call(x[:n], packed), alone[:n]) for n in range(2, 17))

    return not agree(fbgemm_fp16), agree(fbgemm_chunked)


def fbgemm_rows_vary() -> bool:
    """Whether this CPU's fbgemm float16 kernels give a row bits that depend on the call's row count
    (AVX2: yes); Float16Linear then chunks row-exact calls (`fbgemm_chunked`)."""
    return fbgemm_probe()[0]
