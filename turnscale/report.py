"""Plots and the summary table of a run directory, from its ``metrics.jsonl``.

``metrics.jsonl`` holds one JSON object per learner step with ``"step"`` and namespaced
keys.  A figure is drawn from the first key that exists among its candidates, so the
plots survive renamed metrics; a figure with no data is skipped, never faked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

FIGURES: dict[str, tuple[str, ...]] = {
    "success": ("rollout/success", "rollout/success_rate", "env/success"),
    "return": ("rollout/return", "rollout/reward", "rollout/return_mean"),
    "turns": ("rollout/turns", "rollout/turns_per_episode", "rollout/num_turns"),
    "turn_limit": ("schedule/turn_limit", "rollout/turn_limit", "turn_limit"),
    "groups_per_s": ("perf/groups_per_s", "perf/groups_trained_per_s"),
    "tokens_per_s": ("perf/tokens_trained_per_s", "perf/train_tokens_per_s", "perf/tokens_per_s"),
    "gen_tokens_per_s": ("perf/tokens_generated_per_s", "perf/gen_tokens_per_s"),
}


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def series(rows: Iterable[dict], figure: str) -> tuple[list[int], list[float], str]:
    rows = list(rows)
    for key in FIGURES[figure]:
        pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            return [p[0] for p in pts], [p[1] for p in pts], key
    return [], [], ""


def _shade_stages(ax, rows: list[dict]) -> None:
    steps, limits, _ = series(rows, "turn_limit")
    if not steps:
        return
    start, cur = steps[0], limits[0]
    shades = ["#f2f2f2", "#e0e8f5"]
    k = 0
    for s, lim in zip(steps[1:] + [steps[-1] + 1], limits[1:] + [None]):
        if lim != cur:
            ax.axvspan(start, s, color=shades[k % 2], zorder=0)
            ax.text(start, 1.0, f" {int(cur)} turns", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
            start, cur, k = s, lim, k + 1


def write_plots(run_dir: Path, rows: list[dict] | None = None) -> list[Path]:
    """Write learning.png, turns.png and throughput.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl") if rows is None else rows
    written = []
    panels = [
        ("learning.png", [("success", "success rate"), ("return", "return")]),
        ("turns.png", [("turns", "turns per episode"), ("turn_limit", "turn limit")]),
        ("throughput.png", [("groups_per_s", "groups/s"), ("tokens_per_s", "trained tokens/s"), ("gen_tokens_per_s", "generated tokens/s")]),
    ]
    for fname, figs in panels:
        data = [(label, *series(rows, f)) for f, label in figs]
        data = [d for d in data if d[1]]
        if not data:
            continue
        fig, axes = plt.subplots(len(data), 1, figsize=(7, 2.6 * len(data)), sharex=True, squeeze=False)
        for ax, (label, xs, ys, key) in zip(axes[:, 0], data):
            _shade_stages(ax, rows)
            ax.plot(xs, ys, lw=1, alpha=0.45, label="per step")
            if len(ys) >= 10:
                w = max(3, len(ys) // 10)
                smooth = [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
                ax.plot(xs, smooth, lw=2, label=f"mean of last {w}")
                ax.legend(fontsize=7, loc="lower right")
            ax.set_ylabel(label)
            ax.set_title(key, fontsize=8, loc="right")
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("learner step")
        fig.tight_layout()
        out = run_dir / fname
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


def summary_table(summary: dict) -> str:
    """The table printed at the end of ``turnscale run``."""
    def success(key: str) -> str:
        return f"{summary[key]['success']:.3f}" if summary.get(key) else "not evaluated"

    planned = summary.get("steps_planned")
    rows = [
        ("held-out success, warm start", success("warm_start")),
        ("held-out success, after RL", success("final")),
        ("learner steps", f"{summary['steps']}" + (f" of {planned}" if planned and planned != summary["steps"] else "")),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    if summary.get("stopped"):
        rows.insert(0, ("run", summary["stopped"]))
    for k, v in summary.get("extra", {}).items():
        rows.append((k, str(v)))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)
