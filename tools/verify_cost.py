"""What verifying a tree of n tokens costs on this machine, against a one-token step: the target's
verification (the decoding engine's forward with hidden states, the greedy walk and the cache
compaction, as decoding does them) for chains and flat trees of each size, after a prompt of
`--prefix` tokens. The curve the hybrid drafter sizes its trees by (inference/cost_model.py).

    python tools/verify_cost.py [--prefix 256] [--sizes 1,4,8,16,32,64] [target.dtype=bfloat16 ...]

Overrides are run config keys (target.dtype, target.linear_weights, target.num_threads,
target.row_attention, inference.engine). Run it pinned (`taskset`), with the thread count set, on a
quiet machine.
"""

from __future__ import annotations

import argparse

import torch

from headway.config import load_config
from headway.inference.cost_model import verify_cost
from headway.run_config import RunConfig
from headway.target.loading import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=256, help="tokens in the cache before the tree")
    p.add_argument("--sizes", default="1,2,4,8,16,24,32,48,64", help="tree sizes (tokens) to time")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed repeats per size (the median is printed)"
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(RunConfig, None, args.overrides)
    model = load_target(cfg.target).model
    sizes = sorted({int(n) for n in args.sizes.split(",")} | {1})
    print(
        f"threads {torch.get_num_threads()}, {cfg.target.dtype} {cfg.target.linear_weights}, row attention "
        f"{cfg.target.row_attention}, prefix {args.prefix}: ms per verification (x a one-token step)"
    )
    for shape in ("chain", "flat"):
        costs = verify_cost(model, sizes, args.prefix, args.repeats, cfg.inference.engine, shape)
        one = costs[1]
        print(
            f"{shape:5s} "
            + "  ".join(f"{n}: {c * 1e3:.1f} ({c / one:.2f}x)" for n, c in costs.items())
        )


if __name__ == "__main__":
    main()
