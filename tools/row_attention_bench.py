"""Time the row-exact attention kernel of bf16 decoding steps at the default target's sizes.

A tree of `rows` rows (each row: the prefix, then itself and one ancestor) over 9 query heads
sharing 3 key/value heads of 64, after a prefix of `--prefix` tokens; the median per layer call, and
times 30 for the default target's layers. The kernel's build (avx512, avx2, base) is printed first.

    taskset -c 0,1 python tools/row_attention_bench.py --threads 2 --prefix 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from headway.inference.engines.static.layer_loop import extension, row_kernel
from headway.inference.engines.static.plans import RowAttention, TransposedKeys

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--prefix", type=int, default=256, help="tokens in the cache before the tree")
    ap.add_argument("--rows", default="1,2,8,16,32", help="tree sizes (rows) to time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = row_kernel("cpp")
    print(
        f"build {extension().row_attention_build()}, {args.threads} thread(s), prefix {args.prefix}"
    )
    gen = torch.Generator().manual_seed(0)
    length = args.prefix + 64
    k_cache = torch.randn(KV_HEADS, length, HEAD_DIM, generator=gen)
    v_cache = torch.randn(KV_HEADS, length, HEAD_DIM, generator=gen)
    keys = TransposedKeys([k_cache])
    start = args.prefix
    for rows in (int(r) for r in args.rows.split(",")):
        tails = [[start]] if rows == 1 else [[start, start + 1 + i] for i in range(rows)]
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
        attend = RowAttention(start, tails, q.device, kernel, keys)
        for _ in range(20):
            attend(q, k_cache, v_cache, HEAD_DIM**-0.5)
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            attend(q, k_cache, v_cache, HEAD_DIM**-0.5)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        print(
            f"rows {rows:2d}: {ms:.3f} ms per layer, {ms * LAYERS:.2f} ms per step of {LAYERS} layers"
        )


if __name__ == "__main__":
    main()
