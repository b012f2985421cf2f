"""The bench's picture: acceptance by draft depth (per category), and every method's speed per
category."""

from __future__ import annotations

import io
from pathlib import Path

from headway.inference.config import LABELS, PLAIN, SPEC
from headway.io import atomic_write_bytes


def plot_results(result: dict, path: Path) -> Path:
    """Two panels written atomically to `path` (PNG): acceptance at each depth, and tokens/s of each
    method relative to Headway's plain decoding, per category and overall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [*result["by_category"].items(), ("overall", result["overall"])]
    methods = [m for m in result.get("methods", [PLAIN, SPEC]) if m != PLAIN]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, s in groups:
        acc = s["acceptance_by_depth"]
        style = {"color": "black", "linewidth": 2.5} if name == "overall" else {"alpha": 0.7}
        ax1.plot(range(1, len(acc) + 1), acc, marker="o", label=name, **style)
    ax1.set(
        xlabel="draft depth",
        ylabel="share of steps accepting at least this deep",
        ylim=(0, 1),
        title=f"Acceptance by depth (tau {result['overall']['tau']:.2f})",
    )
    ax1.set_xticks(range(1, len(result["overall"]["acceptance_by_depth"]) + 1))
    ax1.legend(fontsize=7, ncol=2)
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        ratios = [s["tok_s"][m] / s["tok_s"][PLAIN] for _, s in groups]
        ax2.bar(
            [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))],
            ratios,
            width,
            label=LABELS[m],
        )
    ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax2.set_xticks(range(len(groups)))
    ax2.set_xticklabels([g for g, _ in groups], rotation=30, ha="right", fontsize=8)
    st = result["settings"]
    ax2.set(
        ylabel="tokens/s relative to Headway plain decoding",
        title=f"Speed by category ({st['threads']} thread(s), {st['dtype'].replace('torch.', '')}, "
        f"{st['device']})",
    )
    ax2.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
