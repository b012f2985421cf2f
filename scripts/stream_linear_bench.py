"""Time the streaming float32 linear beside oneDNN's packed float32 kernel on the default target's linears.

target/csrc/stream_linear.cpp against OneDNNLinear: each of a SmolLM2-135M step's 121 products (random weights of its shapes) once per call
count, for 1, 4 and 16 rows; the best of 5 passes, and the weights' bytes over that time.

    taskset -c 0,1 python scripts/stream_linear_bench.py --threads 2 [--isa avx2]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from headway.target.packed_linear import OneDNNLinear
from headway.target.stream_kernel import stream_kernel

# (out, in) of one decoder layer's fused q/k/v, o, fused gate/up and down, 30 layers, then the lm_head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def best_ms(run, passes: int = 5) -> float:
    run()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both kernels")
    ap.add_argument("--isa", default="auto", help="the streaming kernel's build: auto, avx512 or avx2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = stream_kernel()
    linears = [nn.Linear(k, n, bias=False) for n, k in SHAPES]
    weights = [lin.weight.detach() for lin in linears]
    packed = [OneDNNLinear(lin) for lin in linears]
    mb = sum(w.numel() * 4 for w in weights) / 1e6
    print(f"{len(SHAPES)} float32 linears, {mb:.0f} MB of weights, {args.threads} thread(s)")
    for rows in (1, 4, 16):
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        isa = "avx512" if args.isa == "auto" and _runs(ext, "avx512") else args.isa
        isa = "avx2" if isa == "auto" else isa
        stream = best_ms(lambda: [ext.stream_linear_isa(xs[w.shape[1]], w, None, isa) for w in weights])
        onednn = best_ms(lambda: [p(xs[p.in_features]) for p in packed])
        print(
            f"rows {rows:2d}: stream ({isa}) {stream:6.1f} ms ({mb / stream:.1f} GB/s), "
            f"oneDNN {onednn:6.1f} ms ({mb / onednn:.1f} GB/s)"
        )


def _runs(ext, isa: str) -> bool:
    try:
        ext.stream_linear_isa(torch.zeros(1, 16), torch.zeros(1, 16), None, isa)
    except RuntimeError:
        return False
    return True


if __name__ == "__main__":
    main()
