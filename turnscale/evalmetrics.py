"""Evaluation metrics (pure): success rate, mean reward, Avg@k, Pass@k and mean turns per group.

Definitions (AgentGym-RL's, with an unbiased estimator where they take one sample set):

- A *task* is ``(env, data_idx)``; it has ``n`` samples (episodes) under one checkpoint and turn
  limit.  An episode *passes* when its final score is > 0 (``pass_on="reward"``, AgentGym-RL's
  "max score > 0") or, with ``pass_on="success"``, when the env says it succeeded.
- **Avg@k** = mean over tasks of the expected final score of one of k samples.  The expected mean
  of k samples drawn from the n equals the mean of all n, so the estimate uses all n samples
  (lower variance than the first k); it is reported for every ``k <= n``.
- **Pass@k** = mean over tasks of P(at least one of k samples passes), estimated without bias
  from n >= k samples with c passes as ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021).  With
  n == k this is AgentGym-RL's fraction of tasks whose max score > 0.  When some task of a group
  has fewer than k samples, Pass@k (and Avg@k) of that group is ``None`` (not estimable).
- **success** and **mean_reward** are means over episodes; **mean_turns** the mean turn count.
- Episodes that ended in a failure of the machinery (``ERROR_FINISHES``: ``env_error``,
  ``aborted``, ``render_error``) measure the infrastructure, not the agent: they are left out of
  every metric and counted in ``errors`` (never scored as 0, as the learner never trains on them).

Rows are grouped by ``(checkpoint, turn_limit, env, category)``, plus one row per
``(checkpoint, turn_limit, env)`` with ``category == ""`` (all sub-tasks), plus one per
``(checkpoint, turn_limit)`` with ``env == ""`` when more than one env is present.  Each episode
counts once in each row it belongs to: one without a category (a server that sends none) is
counted once in its env's row, which is then the only row of that env.  Rows come out
sorted by checkpoint (in first-seen order), turn limit, env, category.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from math import comb
from typing import Iterable, Sequence

ERROR_FINISHES = frozenset({"env_error", "aborted", "render_error"})

PASS_RULES = {
    "reward": "an episode passes when its final score (reward) is > 0 (AgentGym-RL)",
    "success": "an episode passes when the env reports success",
}


@dataclass(frozen=True)
class EpisodeResult:
    """One evaluated episode."""

    checkpoint: str
    """Label of the model/checkpoint that played it."""
    env: str
    category: str
    """Sub-task: BabyAI level, TextCraft depth, SciWorld task type, SearchQA dataset."""
    data_idx: int
    sample: int
    """Index of this sample among the task's samples (0..n-1)."""
    reward: float
    """Final score of the episode (its return)."""
    success: bool
    num_turns: int
    turn_limit: int
    finish_reason: str = "done"

    @staticmethod
    def from_record(rec: dict, checkpoint: str = "") -> "EpisodeResult":
        """From a trajectory record (the learner's ``trajectories.jsonl`` format or eval output)."""
        try:
            return EpisodeResult(
                checkpoint=str(rec.get("checkpoint") or checkpoint), env=str(rec["env"]),
                category=str(rec.get("category") or ""), data_idx=int(rec["data_idx"]),
                sample=int(rec.get("sample", rec.get("episode", 0))), reward=float(rec["reward"]),
                success=bool(rec["success"]),
                num_turns=int(rec.get("num_turns", len(rec.get("turns") or []))),
                turn_limit=int(rec.get("turn_limit", 0)), finish_reason=str(rec.get("finish_reason", "done")))
        except KeyError as exc:
            raise ValueError(f"episode record lacks the field {exc.args[0]!r}") from None


@dataclass(frozen=True)
class ReportRow:
    checkpoint: str
    turn_limit: int
    env: str
    """``""``: all envs."""
    category: str
    """``""``: all sub-tasks of ``env``."""
    tasks: int
    episodes: int
    """Episodes counted (those in ``ERROR_FINISHES`` excluded)."""
    errors: int
    """Episodes left out because the env, engine or renderer failed."""
    samples_per_task: int
    """The fewest samples any task of the row has."""
    success: float | None
    mean_reward: float | None
    mean_turns: float | None
    avg_at_k: dict[int, float | None] = field(default_factory=dict)
    pass_at_k: dict[int, float | None] = field(default_factory=dict)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased P(at least one of k samples passes) from n samples with c passes; needs 1 <= k <= n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _passes(e: EpisodeResult, pass_on: str) -> bool:
    return e.reward > 0 if pass_on == "reward" else e.success


def summarize(checkpoint: str, turn_limit: int, env: str, category: str, episodes: Sequence[EpisodeResult],
              ks: Sequence[int], pass_on: str = "reward") -> ReportRow:
    """One row over ``episodes`` (all of one checkpoint and turn limit)."""
    if pass_on not in PASS_RULES:
        raise ValueError(f"pass_on must be one of {sorted(PASS_RULES)}, got {pass_on!r}")
    good = [e for e in episodes if e.finish_reason not in ERROR_FINISHES]
    errors = len(episodes) - len(good)
    by_task: dict[tuple[str, int], list[EpisodeResult]] = defaultdict(list)
    for e in good:
        by_task[(e.env, e.data_idx)].append(e)
    min_n = min((len(v) for v in by_task.values()), default=0)
    avg: dict[int, float | None] = {}
    pas: dict[int, float | None] = {}
    for k in ks:
        if not by_task or k > min_n:
            avg[k] = pas[k] = None
            continue
        avg[k] = _mean(_mean(e.reward for e in v) for v in by_task.values())
        pas[k] = _mean(pass_at_k(len(v), sum(_passes(e, pass_on) for e in v), k) for v in by_task.values())
    return ReportRow(
        checkpoint=checkpoint, turn_limit=turn_limit, env=env, category=category, tasks=len(by_task),
        episodes=len(good), errors=errors, samples_per_task=min_n,
        success=_mean(float(e.success) for e in good), mean_reward=_mean(e.reward for e in good),
        mean_turns=_mean(e.num_turns for e in good), avg_at_k=avg, pass_at_k=pas)


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def report_rows(results: Iterable[EpisodeResult], ks: Sequence[int], pass_on: str = "reward") -> list[ReportRow]:
    """All rows (see the module docstring for grouping and order)."""
    results = list(results)
    ckpt_order = list(dict.fromkeys(r.checkpoint for r in results))
    groups: dict[tuple, list[EpisodeResult]] = defaultdict(list)
    envs = {r.env for r in results}
    for r in results:
        for key in _row_keys(r, several_envs=len(envs) > 1):
            groups[key].append(r)
    keys = sorted(groups, key=lambda g: (ckpt_order.index(g[0]), g[1], g[2] == "", g[2], g[3] != "", g[3]))
    return [summarize(*key, groups[key], ks, pass_on) for key in keys]


def _row_keys(r: EpisodeResult, several_envs: bool) -> list[tuple]:
    """The distinct rows ``r`` counts in: its category's, its env's (``category == ""``) and, with
    several envs, the all-envs row.  A result without a category (a server that sends none, such
    as AgentGym's BabyAI) belongs to its env row once: its category row *is* the env row."""
    keys = [(r.checkpoint, r.turn_limit, r.env, r.category), (r.checkpoint, r.turn_limit, r.env, "")]
    if several_envs:
        keys.append((r.checkpoint, r.turn_limit, "", ""))
    return list(dict.fromkeys(keys))


def row_to_json(row: ReportRow) -> dict:
    d = asdict(row)
    d["avg_at_k"] = {str(k): v for k, v in row.avg_at_k.items()}
    d["pass_at_k"] = {str(k): v for k, v in row.pass_at_k.items()}
    return d
