"""Charts of benchmark results (``turnscale bench --plot DIR``).

``plot_results(results, out_dir)`` writes ``ratios.png``: one bar per figure with its
ratio (higher is better), the figure's target as a black tick, bars green when the target
is reached, red when missed, grey without a target.  matplotlib is imported lazily with
the Agg backend (no display needed).
"""

from __future__ import annotations

import os
from typing import Sequence

from turnscale.benchmarks.common import Result

FILENAME = "ratios.png"


def _color(r: Result) -> str:
    if r.ok is None:
        return "#9e9e9e"
    return "#2e7d32" if r.ok else "#c62828"


def plot_results(results: Sequence[Result], out_dir: str) -> list[str]:
    """Write the ratio chart into ``out_dir`` (created if needed); return the paths written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, FILENAME)
    n = max(1, len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * n + 2), 4.5))
    try:
        xs = list(range(len(results)))
        ratios = [r.ratio if r.ratio == r.ratio and r.ratio != float("inf") else 0.0 for r in results]
        ax.bar(xs, ratios, color=[_color(r) for r in results], width=0.6, label="ratio (higher is better)")
        first = True
        for x, r in zip(xs, results):
            if r.target is not None:
                ax.hlines(r.target, x - 0.4, x + 0.4, colors="black", linewidth=2.5, label="target" if first else None)
                first = False
            ax.annotate(f"{r.ratio:.2f}", (x, ratios[x]), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.axhline(1.0, color="#607d8b", linewidth=0.8, linestyle="--")
        ax.set_xticks(xs)
        ax.set_xticklabels([r.name for r in results], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("value / baseline")
        ax.set_title("turnscale bench: ratio against the in-run baseline")
        if results:
            ax.legend(fontsize=8, loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return [path]
