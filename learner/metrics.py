"""Metrics as data: each value is added with a declared reduction and reduced once per step.

``StepMetrics.add(key, value, reduce)`` collects values during a step (from intake,
training and timing); ``StepMetrics.reduce()`` turns them into one ``{key: float}``
and starts the next step.  A key keeps the reduction it was first added with (adding it
with another one is a bug and raises).

Key namespaces (cleanrl-style):

- ``rollout/``: groups received/accepted/dropped (``rollout/dropped/<reason>``; counted in
  the step during which they arrived), and for the groups *trained* in the step: return,
  success, turns per episode, tokens per episode, finish reasons, turn limit, staleness
  (``rollout/staleness/<k>`` counts, ``rollout/staleness_mean``, ``rollout/staleness_max``);
- ``env/<name>/`` and ``env/<name>/<category>/``: return and success;
- ``loss/``: everything the trainer reports (keys without a namespace get ``loss/``);
- ``perf/``: tokens trained/s, step time, learner busy fraction, groups/s, and from the
  actors' heartbeats tokens generated/s and mean engine busy fraction;
- ``pool/<name>/``: per actor pool, actors, generated tokens/s and weight-pull time (from
  heartbeats), and for the groups trained in the step staleness and the behaviour-vs-learner
  log-prob gap (``learner.poolgap``).

Loggers: ``write(step, metrics)`` and ``close()``; ``make_logger`` builds the configured
set (JSONL ``<dir>/metrics.jsonl``, TensorBoard ``<dir>/tb``, W&B lazily, a console line).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, TextIO

REDUCTIONS: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda v: sum(v) / len(v),
    "sum": sum,
    "max": max,
    "min": min,
    "last": lambda v: v[-1],
}


@dataclass
class StepMetrics:
    """Per-step accumulator (see the module docstring)."""

    _values: dict[str, list[float]] = field(default_factory=dict)
    _reduce: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, value: float, reduce: str = "mean") -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"metric {key!r}: unknown reduction {reduce!r}; choose one of {sorted(REDUCTIONS)}")
        have = self._reduce.setdefault(key, reduce)
        if have != reduce:
            raise ValueError(f"metric {key!r} was declared with reduction {have!r}, now {reduce!r}")
        self._values.setdefault(key, []).append(float(value))

    def add_all(self, values: Mapping[str, float], reduce: str = "mean", prefix: str = "") -> None:
        for k, v in values.items():
            self.add(prefix + k, v, reduce)

    def reduce(self) -> dict[str, float]:
        """Reduce every key once and clear (declarations are kept)."""
        out = {k: float(REDUCTIONS[self._reduce[k]](v)) for k, v in self._values.items() if v}
        self._values = {}
        return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- what to record


def record_intake(m: StepMetrics, accepted: bool, reason: str) -> None:
    """Counters for every received group (counted in the step during which it arrived)."""
    m.add("rollout/groups_received", 1, "sum")
    if accepted:
        m.add("rollout/groups_accepted", 1, "sum")
    else:
        m.add("rollout/groups_dropped", 1, "sum")
        m.add(f"rollout/dropped/{reason}", 1, "sum")


def record_trained(m: StepMetrics, group: Any, staleness: int) -> None:
    """Episode statistics and staleness of a group trained in this step."""
    if staleness >= 0:
        m.add(f"rollout/staleness/{staleness}", 1, "sum")
        m.add("rollout/staleness_mean", staleness, "mean")
        m.add("rollout/staleness_max", staleness, "max")
    env = group.task.env
    rewards = [ep.reward for ep in group.episodes]
    if rewards and max(rewards) == min(rewards):
        m.add("rollout/groups_equal_reward", 1, "sum")
    for ep in group.episodes:
        m.add("rollout/return", ep.reward)
        m.add("rollout/success", float(ep.success))
        m.add("rollout/turns_per_episode", len(ep.turns))
        m.add("rollout/tokens_per_episode", len(ep.token_ids))
        m.add("rollout/sampled_tokens", int(ep.loss_mask.sum()), "sum")
        m.add(f"rollout/finish/{ep.finish_reason}", 1, "sum")
        m.add(f"env/{env}/return", ep.reward)
        m.add(f"env/{env}/success", float(ep.success))
        cat = getattr(ep, "category", "")
        if cat:
            m.add(f"env/{env}/{cat}/return", ep.reward)
            m.add(f"env/{env}/{cat}/success", float(ep.success))


def record_train(m: StepMetrics, train_metrics: Mapping[str, float]) -> None:
    """Trainer output as ``loss/...`` (keys already namespaced keep their namespace)."""
    for k, v in train_metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(float(v)):
            m.add(k if "/" in k else f"loss/{k}", v, "last")


def record_actor_stats(m: StepMetrics, stats: Iterable[Mapping[str, float]]) -> None:
    """Sum of every registered actor's latest heartbeat counters as ``actors/<key>`` (e.g.
    ``actors/engine_busy_s``, ``actors/weight_pull_s``, ``actors/weight_pulls``) plus
    ``actors/count``; differences between steps give rates over any window."""
    totals: dict[str, float] = {}
    n = 0
    for st in stats:
        n += 1
        for k, v in st.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                totals[k] = totals.get(k, 0.0) + float(v)
    m.add("actors/count", n, "last")
    for k, v in totals.items():
        m.add(f"actors/{k}", v, "last")


# ----------------------------------------------------------------------------- loggers


class Logger(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """One JSON object per step: ``{"step": int, "time": unix seconds, <key>: float...}``."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._f.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardLogger:
    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=logdir)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbLogger:
    def __init__(self, project: str, run_dir: str, config: Mapping[str, Any] | None = None) -> None:
        try:
            import wandb  # noqa: PLC0415 - optional
        except ImportError:
            raise RuntimeError("logger.wandb=true needs wandb: pip install 'turnscale[wandb]'") from None
        self._run = wandb.init(project=project, dir=run_dir, config=dict(config or {}))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class ConsoleLogger:
    """One plain progress line at most every ``every_s`` seconds (no carriage returns, so it
    reads fine when piped to a file)."""

    def __init__(self, every_s: float = 5.0, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.stream = stream or sys.stdout
        self.clock = clock
        self._last = -math.inf

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.stream.write(format_progress(step, metrics) + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


def format_progress(step: int, m: Mapping[str, float]) -> str:
    def g(k: str, fmt: str = "{:.3g}") -> str:
        return fmt.format(m[k]) if k in m else "-"

    return (f"step {step} | version {g('perf/version', '{:.0f}')} | turns {g('rollout/turn_limit', '{:.0f}')} | "
            f"success {g('rollout/success', '{:.3f}')} | return {g('rollout/return', '{:.3f}')} | "
            f"groups/s {g('perf/groups_per_s')} | tok/s {g('perf/tokens_trained_per_s', '{:.0f}')} | "
            f"staleness {g('rollout/staleness_mean', '{:.2f}')} | dropped {g('rollout/groups_dropped', '{:.0f}')}"
            + (f" | learner ranks {m['perf/learner_ranks']:.0f}" if "perf/learner_ranks" in m else "")
            + format_pools(m))


def format_pools(m: Mapping[str, float]) -> str:
    """`` | pools cpu 2a 310tok/s st0.50 gap2.1e-07/1.3e-07, gpu 1a 900tok/s st1.00 gap0.031``
    when actors report pools other than ``default``: actors, generated tokens/s, mean
    staleness of trained groups, and the mean behaviour-vs-learner log-prob gap
    ``|mu - pi_prox|`` of those groups, then after ``/`` the same over the staleness-0 ones
    only (engine/device numerics; ``learner.poolgap``) when the step had any."""
    names = sorted({k.split("/")[1] for k in m if k.startswith("pool/") and k.endswith("/actors")})
    if not names or names == ["default"]:
        return ""
    parts = []
    for n in names:
        st = m.get(f"pool/{n}/staleness_mean")
        gap, gap0 = m.get(f"pool/{n}/logprob_gap_mean"), m.get(f"pool/{n}/logprob_gap_mean_staleness0")
        parts.append(f"{n} {m[f'pool/{n}/actors']:.0f}a {m.get(f'pool/{n}/tokens_generated_per_s', 0.0):.0f}tok/s"
                     + (f" st{st:.2f}" if st is not None else "")
                     + (f" gap{gap:.2g}" if gap is not None else "")
                     + (f"/{gap0:.2g}" if gap is not None and gap0 is not None else ""))
    return " | pools " + ", ".join(parts)


class MultiLogger:
    def __init__(self, loggers: Iterable[Logger]) -> None:
        self.loggers = list(loggers)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for lg in self.loggers:
            lg.write(step, metrics)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def make_logger(cfg: Any, run_dir: str, config: Mapping[str, Any] | None = None) -> MultiLogger:
    """Loggers enabled in ``cfg`` (``conf.schema.LoggerConfig``) writing under ``run_dir``."""
    out: list[Logger] = []
    if cfg.jsonl:
        out.append(JsonlLogger(os.path.join(run_dir, "metrics.jsonl")))
    if cfg.tensorboard:
        out.append(TensorBoardLogger(os.path.join(run_dir, "tb")))
    if cfg.wandb:
        out.append(WandbLogger(cfg.wandb_project, run_dir, config))
    if cfg.console_every_s > 0:
        out.append(ConsoleLogger(cfg.console_every_s))
    return MultiLogger(out)
