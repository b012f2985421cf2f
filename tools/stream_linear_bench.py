"""Time the streaming linear beside the other packed formats' kernels on the default target's
linears.

target/csrc/stream_linear.cpp against the other formats: each of a SmolLM2-135M step's 121 products
(random weights of its shapes) once per call count; the best of 5 passes, and the weights' bytes
over that time.
float32 (1, 4 and 16 rows): the streaming kernel's build against OneDNNLinear. bfloat16 (1, 2, 4, 8
    and 16
rows): StreamLinear (its AVX512-BF16 or AVX2 build) against Float16Linear (fbgemm) and OneDNNLinear
where their kernels run here, as a bf16 target's decoding calls them, and the float32 streaming
kernel over the same weights in float32.

    taskset -c 0,1 python tools/stream_linear_bench.py --threads 2 [--isa avx2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from headway.target.packed_capability import kernels_missing
from headway.target.packed_float16 import Float16Linear
from headway.target.packed_onednn import OneDNNLinear
from headway.target.packed_stream import StreamLinear
from headway.target.stream_kernel import bf16_build as stream_bf16_build
from headway.target.stream_kernel import stream_kernel

# (out, in) of one decoder layer's fused q/k/v, o, fused gate/up and down, 30 layers, then the
# lm_head
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both kernels")
    ap.add_argument(
        "--isa", default="auto", help="the streaming kernel's build: auto, avx512 or avx2"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the weights' and rows' dtype",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = stream_kernel()
    if args.dtype == "bfloat16":
        bf16(args.threads)
        return
    linears = [nn.Linear(k, n, bias=False) for n, k in SHAPES]
    weights = [lin.weight.detach() for lin in linears]
    packed = [OneDNNLinear(lin) for lin in linears]
    mb = sum(w.numel() * 4 for w in weights) / 1e6
    print(f"{len(SHAPES)} float32 linears, {mb:.0f} MB of weights, {args.threads} thread(s)")
    for rows in (1, 4, 16):
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        isa = "avx512" if args.isa == "auto" and _runs(ext, "avx512") else args.isa
        isa = "avx2" if isa == "auto" else isa
        stream = best_ms(
            lambda: [ext.stream_linear_isa(xs[w.shape[1]], w, None, isa) for w in weights]
        )
        onednn = best_ms(lambda: [p(xs[p.in_features]) for p in packed])
        print(
            f"rows {rows:2d}: stream ({isa}) {stream:6.1f} ms ({mb / stream:.1f} GB/s), "
            f"oneDNN {onednn:6.1f} ms ({mb / onednn:.1f} GB/s)"
        )


def bf16(threads: int) -> None:
    """The bf16 formats' modules over the same bf16 weights, as a bf16 target's decoding steps call
    them."""
    linears = [nn.Linear(k, n, bias=False, dtype=torch.bfloat16) for n, k in SHAPES]
    formats = {f"stream ({stream_bf16_build()})": [StreamLinear(lin) for lin in linears]}
    for name, cls in (("float16", Float16Linear), ("onednn", OneDNNLinear)):
        if kernels_missing(name, torch.bfloat16) is None:
            formats[name] = [cls(lin) for lin in linears]
    f32 = [lin.weight.detach().float() for lin in linears]
    mb = sum(lin.weight.numel() * 2 for lin in linears) / 1e6
    print(
        f"{len(SHAPES)} bf16 linears, {mb:.0f} MB of weights, {threads} thread(s): ms per pass (GB/s of bf16)"
    )
    for rows in (1, 2, 4, 8, 16):
        xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
        ms = {
            name: best_ms(lambda m=mods: [p(xs[p.in_features]) for p in m])
            for name, mods in formats.items()
        }
        x32 = {k: v.float() for k, v in xs.items()}
        ms["float32 stream"] = best_ms(
            lambda: [torch.ops.headway_kernels.stream_linear(x32[w.shape[1]], w, None) for w in f32]
        )
        print(
            f"rows {rows:2d}: "
            + ", ".join(f"{name} {t:6.1f} ({mb / t:.1f})" for name, t in ms.items())
        )


def _runs(ext, isa: str) -> bool:
    try:
        ext.stream_linear_isa(torch.zeros(1, 16), torch.zeros(1, 16), None, isa)
    except RuntimeError:
        return False
    return True


if __name__ == "__main__":
    main()
