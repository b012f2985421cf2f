"""Plain decoding speed of one target on the static engine against the hf engine (the model's own
forward), in float32 and bf16, on a pinned thread count: what running a family on the static engine
buys.

    python tools/family_speed.py [--target DIR | --family qwen3] [--dtypes float32,bfloat16] [--threads 1]
                                   [--linear-weights native] [--tokens 128] [--repeats 3]

Without --target it builds the tiny random model of --family (tests/helpers/tiny_models.py) in a
temporary directory. Both engines decode the same prompt from the same loaded model, alternating,
and the fastest of
--repeats runs of each is printed (tok/s: new tokens over the whole call, the prompt included). The static
engine's tokens must equal the hf engine's in float32 (exit 1 otherwise; bf16 rounds differently on
the two, so there only the static engine's figure is meaningful, not a comparison of tokens).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from headway.inference.engines.runner import engine_name
from headway.inference.generate import plain_generate
from headway.target.config import TargetConfig
from headway.target.loading import load_target

PROMPT = "Write a short story about a lighthouse keeper."


def tiny_target(family: str, root: Path) -> Path:
    """The tiny random model of `family` (tests/helpers/tiny_models.py), saved under `root`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from tiny_models import make_tiny_model

    return make_tiny_model(family, root / family)


def measure(
    target: Path, dtype: str, threads: int, fmt: str, tokens: int, repeats: int
) -> dict[str, float]:
    """tok/s of plain greedy decoding on the static and hf engines (the fastest of `repeats`
    each)."""
    t = load_target(
        TargetConfig(
            name_or_path=str(target),
            device="cpu",
            num_threads=threads,
            dtype=dtype,
            linear_weights=fmt,
        )
    )
    if engine_name(t.model, "auto") != "static":
        raise SystemExit(f"the static engine does not run {target} ({t.model.config.model_type})")
    ids = t.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    best: dict[str, float] = {"static": 0.0, "hf": 0.0}
    tokens_of: dict[str, list[int]] = {}
    with torch.inference_mode():
        for engine in best:  # warm-up (builds, first-call allocations)
            plain_generate(t.model, ids, 8, [], engine=engine)
        for i in range(repeats):
            for engine in list(best)[i % 2 :] + list(best)[: i % 2]:
                res = plain_generate(t.model, ids, tokens, [], engine=engine)
                best[engine] = max(best[engine], res.tokens_per_second)
                tokens_of[engine] = res.tokens
    if dtype == "float32" and tokens_of["static"] != tokens_of["hf"]:
        print(f"{dtype}: the static engine's tokens differ from the hf engine's", file=sys.stderr)
        raise SystemExit(1)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--target", default=None, help="a model directory (default: the tiny --family model)"
    )
    ap.add_argument(
        "--family", default="qwen3", help="tiny model id of tests/helpers/tiny_models.py"
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--linear-weights", default="native", help="target.linear_weights for both engines"
    )
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(args.target) if args.target else tiny_target(args.family, Path(tmp))
        for dtype in args.dtypes.split(","):
            best = measure(
                target, dtype, args.threads, args.linear_weights, args.tokens, args.repeats
            )
            print(
                f"{target.name} {dtype} ({args.linear_weights} weights, {args.threads} thread(s)): static "
                f"{best['static']:.0f} tok/s, hf {best['hf']:.0f} tok/s, {best['static'] / best['hf']:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
