"""Presenting evaluation rows: terminal table, Markdown, the JSON document, test-time scaling plots.

The JSON document (``turnscale eval --json PATH``) is::

    {"kind": "turnscale.eval", "schema": 1, "pass_rule": str, "k": [int], "turns": [int],
     "checkpoints": [str], "rows": [ReportRow as JSON: Avg@k / Pass@k keyed by str(k)],
     "trajectories": "trajectories.jsonl" (when episodes were written beside it), "config": {...}}

``turnscale view`` reads the same document.  Plots use matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from turnscale.evalmetrics import PASS_RULES, ReportRow, row_to_json

SCHEMA = 1


def _f(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}" if pct else f"{v:.3f}"


def _cells(row: ReportRow, ks: Sequence[int]) -> list[str]:
    return [row.checkpoint, str(row.turn_limit), row.env or "(all)", row.category or "(all)", str(row.tasks),
            str(row.episodes), str(row.errors), _f(row.success, True), _f(row.mean_reward),
            _f(row.mean_turns) if row.mean_turns is not None else "n/a",
            *(_f(row.avg_at_k.get(k)) for k in ks), *(_f(row.pass_at_k.get(k), True) for k in ks)]


def _header(ks: Sequence[int]) -> list[str]:
    return ["checkpoint", "turns", "env", "category", "tasks", "episodes", "errors", "success %", "reward",
            "mean turns", *(f"Avg@{k}" for k in ks), *(f"Pass@{k} %" for k in ks)]


def format_table(rows: Sequence[ReportRow], ks: Sequence[int]) -> str:
    """A fixed-width table for the terminal."""
    table = [_header(ks)] + [_cells(r, ks) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    out = []
    for j, line in enumerate(table):
        out.append("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_markdown(rows: Sequence[ReportRow], ks: Sequence[int], pass_on: str, plots: Sequence[str] = (),
                    config: dict | None = None) -> str:
    """A Markdown report: what was run, the table, the definitions, and the plots (relative paths)."""
    head = _header(ks)
    lines = ["# turnscale eval", ""]
    if config:
        lines += [f"- {k}: `{json.dumps(v)}`" for k, v in config.items()] + [""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(r, ks)) + " |" for r in rows]
    lines += ["", f"Pass rule: {PASS_RULES[pass_on]}. Pass@k is the unbiased estimate 1 - C(n-c,k)/C(n,k) "
              "from n samples per task with c passes (equal to AgentGym-RL's max-score > 0 when n = k); "
              "Avg@k is the mean final score, estimated from all n samples. n/a: fewer than k samples. "
              "Episodes that ended in env_error, aborted or render_error are counted under errors and left out of the metrics."]
    for p in plots:
        lines += ["", f"![{Path(p).stem}]({p})"]
    return "\n".join(lines) + "\n"


def report_json(rows: Sequence[ReportRow], ks: Sequence[int], pass_on: str, *, trajectories: str = "",
                config: dict | None = None) -> dict:
    checkpoints = list(dict.fromkeys(r.checkpoint for r in rows))
    doc = {"kind": "turnscale.eval", "schema": SCHEMA, "pass_rule": PASS_RULES[pass_on], "k": list(ks),
           "turns": sorted({r.turn_limit for r in rows}), "checkpoints": checkpoints,
           "rows": [row_to_json(r) for r in rows], "config": config or {}}
    if trajectories:
        doc["trajectories"] = trajectories
    return doc


def write_json(path: str | Path, doc: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False))
    tmp.replace(p)


def _overall(rows: Sequence[ReportRow], env: str) -> list[ReportRow]:
    return [r for r in rows if r.env == env and r.category == ""]


def plot_turn_scaling(rows: Sequence[ReportRow], path: str | Path) -> Path | None:
    """Success vs turn limit, one line per checkpoint, one panel per env; ``None`` with < 2 limits."""
    envs = sorted({r.env for r in rows if r.env})
    if len({r.turn_limit for r in rows}) < 2 or not envs:
        return None
    return _plot(path, envs, rows, "turn limit", "success (%)", lambda r: [(r.turn_limit, r.success)], "turn scaling")


def plot_pass_at_k(rows: Sequence[ReportRow], ks: Sequence[int], path: str | Path) -> Path | None:
    """Pass@k vs k at the largest turn limit, one line per checkpoint; ``None`` with < 2 values of k."""
    envs = sorted({r.env for r in rows if r.env})
    if len(ks) < 2 or not envs:
        return None
    top = max(r.turn_limit for r in rows)
    rows = [r for r in rows if r.turn_limit == top]
    return _plot(path, envs, rows, "k (samples per task)", "Pass@k (%)",
                 lambda r: [(k, v) for k, v in r.pass_at_k.items()], f"Pass@k at turn limit {top}", log2x=True)


def _plot(path, envs, rows, xlabel, ylabel, points, title, log2x=False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(envs), figsize=(4.2 * len(envs), 3.4), squeeze=False)
    for ax, env in zip(axes[0], envs):
        by_ckpt: dict[str, list[tuple[float, float]]] = {}
        for r in _overall(rows, env):
            by_ckpt.setdefault(r.checkpoint, []).extend((x, 100 * y) for x, y in points(r) if y is not None)
        for ckpt, pts in by_ckpt.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=ckpt)
        xs = sorted({x for pts in by_ckpt.values() for x, _ in pts})
        if log2x:
            ax.set_xscale("log", base=2)
        if xs:
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
        ax.set_title(f"{env}: {title}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
