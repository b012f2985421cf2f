"""Training runs side by side from their logs: each evaluation's answer tokens trained on, wall
time, held-out top-1 at the first unrolled steps and the simulated chain tau (`eval/tau/chain`), so
runs are compared at equal compute without decoding. Logs written before runs counted answer tokens
give `--tokens-per-step` times the step.

    python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] [--steps 3] [--tokens-per-step 2230]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def evaluations(run: Path) -> list[dict]:
    """The eval records of a run's log.jsonl, each with the totals of the training record logged
    before it."""
    rows, last = [], {}
    for line in (run / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            last = record
        elif "eval/tau/chain" in record:
            rows.append({**{k: last.get(k) for k in ("answer_tokens", "wall_seconds")}, **record})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="train.output_dir of each run")
    p.add_argument("--steps", type=int, default=3, help="unrolled steps whose top-1 to show")
    p.add_argument(
        "--tokens-per-step",
        type=float,
        default=None,
        help="estimate for logs without answer_tokens (sequences per step x mean answer length)",
    )
    args = p.parse_args()
    tops = " / ".join(str(i) for i in range(args.steps))
    print(f"| run | step | answer tokens | wall min | top-1 at steps {tops} | tau (chain) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for run in args.runs:
        for r in evaluations(run):
            tokens = r["answer_tokens"]
            if tokens is None and args.tokens_per_step:
                tokens = f"~{round(r['step'] * args.tokens_per_step):,}"
            elif tokens is not None:
                tokens = f"{tokens:,}"
            wall = "" if r["wall_seconds"] is None else f"{r['wall_seconds'] / 60:.0f}"
            # EAGLE's unrolled steps 0, 1, ... and DFlash's block slots 1, 2, ... are the same draft
            # positions
            top = " / ".join(
                f"{r.get(f'eval/top1/step{i}', r.get(f'eval/top1/slot{i + 1}', float('nan'))):.3f}"
                for i in range(args.steps)
            )
            print(
                f"| {run.name} | {r['step']} | {tokens or ''} | {wall} | {top} | {r['eval/tau/chain']:.3f} |"
            )


if __name__ == "__main__":
    main()
