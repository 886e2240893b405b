"""What one end-to-end run did, read back from the learner's files (pure parsing).

Inputs are the learner's ``<learner.dir>/metrics.jsonl`` (one record per optimizer step:
``{"step", "time", <key>: float}``, see ``learner.metrics``) and
``<learner.dir>/trajectories.jsonl`` (one record per episode of every received group,
groups' episodes consecutive, see ``learner.trajlog``).

Measurement window: from the end of step ``warmup`` to the end of the last step, so
process start-up, model loading and the first weight pull are excluded the same way in
every mode.  Rates count what was *trained* inside that window.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class GroupCost:
    """One received group: how long its episodes took (the sampled workload)."""

    lease_id: str
    data_idx: int
    accepted: bool
    episode_s: tuple[float, ...]
    """Per episode: the sum over its turns of generation and env latency."""
    sampled_tokens: int
    turns: tuple[int, ...]
    lease_s: float = -1.0
    """Learner clock from the lease's grant to the group's arrival (-1: not logged):
    what the group really cost its slot, env resets and round trips included."""

    @property
    def duration_s(self) -> float:
        """The slot time of the group: ``lease_s`` when logged, else its slowest episode's
        generation + env time (a group is done when its slowest episode is)."""
        return self.lease_s if self.lease_s >= 0 else max(self.episode_s, default=0.0)


@dataclass(frozen=True)
class RunStats:
    """Figures of one run (see the module docstring for the window)."""

    steps: int
    """Optimizer steps in metrics.jsonl."""
    window_s: float
    groups_trained: int
    """Groups trained inside the window."""
    groups_per_s: float
    tokens_per_s: float
    """Generated (sampled) tokens of the trained groups per second."""
    learner_busy: float
    """Fraction of the window the learner spent in optimizer steps."""
    step_time_s: float
    """Mean optimizer step time inside the window."""
    staleness_hist: dict[int, int]
    """Accepted groups by staleness (versions behind), over the whole run."""
    dropped: dict[str, int]
    """Dropped groups by reason, over the whole run."""
    groups: tuple[GroupCost, ...] = field(default=(), repr=False)
    """Every received group in arrival order."""
    extra: dict[str, float] = field(default_factory=dict)
    """Other per-run figures (actor engine busy, weight sync per version) when logged."""

    @property
    def trained_durations(self) -> list[float]:
        return [g.duration_s for g in self.groups if g.accepted]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a writer killed mid-line) is skipped."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def group_costs(episodes: Iterable[Mapping[str, Any]]) -> list[GroupCost]:
    """Fold consecutive episode records of one lease into one ``GroupCost`` each."""
    out: list[GroupCost] = []
    cur: list[Mapping[str, Any]] = []

    def flush() -> None:
        if not cur:
            return
        eps = tuple(sum(float(t.get("gen_latency_s", 0.0)) + float(t.get("env_latency_s", 0.0)) for t in e.get("turns", [])) for e in cur)
        toks = sum(int(t.get("num_tokens", 0)) for e in cur for t in e.get("turns", []))
        out.append(GroupCost(str(cur[0].get("lease_id", "")), int(cur[0].get("data_idx", -1)), bool(cur[0].get("accepted", False)),
                             eps, toks, tuple(int(e.get("num_turns", len(e.get("turns", [])))) for e in cur),
                             float(cur[0].get("lease_s", -1.0))))
        cur.clear()

    for rec in episodes:
        if cur and (rec.get("lease_id") != cur[0].get("lease_id") or int(rec.get("episode", 0)) == 0):
            flush()
        cur.append(rec)
    flush()
    return out


def _prefixed_counts(records: Sequence[Mapping[str, Any]], prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith(prefix) and isinstance(v, (int, float)):
                out[k[len(prefix):]] = out.get(k[len(prefix):], 0) + int(round(v))
    return out


def summarize(metrics: Sequence[Mapping[str, Any]], trajectories: Sequence[Mapping[str, Any]], groups_per_step: int, warmup: int = 1) -> RunStats:
    """``RunStats`` of one run.  ``warmup`` steps are excluded from rates (clamped so at
    least one step stays in the window)."""
    steps = sorted((r for r in metrics if "step" in r and "time" in r), key=lambda r: r["step"])
    if len(steps) < 2:
        raise ValueError(f"need at least 2 logged steps to measure a rate, got {len(steps)}")
    k0 = min(max(warmup, 1), len(steps) - 1)
    start, inside = steps[k0 - 1], steps[k0:]
    window = float(inside[-1]["time"]) - float(start["time"])
    if not window > 0:
        raise ValueError(f"measurement window is {window} s; the step clock did not advance")
    groups = groups_per_step * len(inside)
    tokens = sum(float(r.get("rollout/sampled_tokens", 0.0)) for r in inside)
    busy_s = sum(float(r.get("perf/step_time_s", 0.0)) for r in inside)
    stale = {int(k): v for k, v in _prefixed_counts(steps, "rollout/staleness/").items() if k.isdigit()}
    dropped = _prefixed_counts(steps, "rollout/dropped/")
    return RunStats(
        steps=int(steps[-1]["step"]), window_s=window, groups_trained=groups, groups_per_s=groups / window,
        tokens_per_s=tokens / window, learner_busy=busy_s / window, step_time_s=busy_s / len(inside),
        staleness_hist=dict(sorted(stale.items())), dropped=dropped, groups=tuple(group_costs(trajectories)),
        extra=actor_figures(start, inside[-1], window),
    )


def actor_figures(first: Mapping[str, Any], last: Mapping[str, Any], window_s: float) -> dict[str, float]:
    """From the summed actor counters the learner logs (``actors/<key>``, see
    ``learner.metrics.record_actor_stats``) at the window's two ends: the actors' engine
    busy fraction, and the mean seconds an actor took to pull and load one version."""

    def delta(key: str) -> float | None:
        a, b = first.get(key), last.get(key)
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not (math.isfinite(a) and math.isfinite(b)):
            return None
        return float(b) - float(a)

    out: dict[str, float] = {}
    n = last.get("actors/count")
    busy = delta("actors/engine_busy_s")
    if busy is not None and isinstance(n, (int, float)) and n > 0 and window_s > 0:
        out["actor_engine_busy"] = max(0.0, busy) / (window_s * n)
    pulls, pull_s = delta("actors/weight_pulls"), delta("actors/weight_pull_s")
    if pulls and pull_s is not None and pulls > 0:
        out["weight_sync_s"] = pull_s / pulls
    return out


def load_run(learner_dir: str | Path, groups_per_step: int, warmup: int = 1) -> RunStats:
    d = Path(learner_dir)
    return summarize(read_jsonl(d / "metrics.jsonl"), read_jsonl(d / "trajectories.jsonl"), groups_per_step, warmup)
