"""What a set of self-distilled datasets holds: per dataset and in all, the samples, distinct
prompts, answer tokens, the share of answers that hit the token cap, and the exact and near
duplicate rates (train.dedup's rules).

    python scripts/data_report.py DATASET_DIR [DATASET_DIR ...] [--threshold 0.8]
"""

from __future__ import annotations

import argparse

from headway.data_scripts.distill import load_distilled
from headway.train.dedup import answer_tokens, duplicates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("datasets", nargs="+")
    p.add_argument(
        "--threshold", type=float, default=0.8, help="train.dedup_threshold for the near rule"
    )
    args = p.parse_args()
    rows, every = [], []
    for path in args.datasets:
        ds, manifest = load_distilled(path)
        answers = [answer_tokens(i, m) for i, m in zip(ds["input_ids"], ds["loss_mask"])]
        prompts = {tuple(i[: len(i) - len(a)]) for i, a in zip(ds["input_ids"], answers)}
        every += answers
        rows.append(
            (
                path,
                len(answers),
                len(prompts),
                sum(map(len, answers)),
                manifest["counts"]["unfinished_samples"],
                sum(duplicates(answers, "exact")),
                sum(duplicates(answers, "near", args.threshold)),
            )
        )
    exact, near = sum(duplicates(every, "exact")), sum(duplicates(every, "near", args.threshold))
    print(
        "| dataset | samples | distinct prompts | answer tokens | hit the cap | exact dup | near dup |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path, n, prompts, tokens, cap, ex, nr in rows:
        print(
            f"| {path} | {n:,} | {prompts:,} | {tokens:,} | {100 * cap / max(1, n):.1f}% "
            f"| {100 * ex / max(1, n):.1f}% | {100 * nr / max(1, n):.1f}% |"
        )
    n = len(every)
    print(
        f"| all | {n:,} | | {sum(map(len, every)):,} | {100 * sum(r[4] for r in rows) / max(1, n):.1f}% | "
        f"{100 * exact / max(1, n):.1f}% | {100 * near / max(1, n):.1f}% (threshold {args.threshold}) |"
    )


if __name__ == "__main__":
    main()
