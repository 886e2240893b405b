"""Simulated long-tail workload for throughput benchmarks: ``env.options.sim_latency``.

Real agent tasks have a long tail: most episodes end in a few turns, a few take many,
and some env steps (a page load, a JVM, a search) are slow.  This module reproduces that
shape on top of any real env family, server-side, so every client (our actors,
AgentGym's) sees the same workload:

* each task (``data_idx``) gets a latency factor drawn from a log-normal distribution
  with median 1 (``task_sigma``): some tasks are slow at every step (a heavy page, a big
  search index, a slow simulator state);
* each ``step`` sleeps for ``factor x`` a per-step latency drawn from a log-normal
  distribution (``median_s``, ``sigma``), capped at ``max_s``; each ``reset`` likewise
  with median ``reset_s`` (env start-up: a JVM, a browser page);
* each task (``data_idx``) gets a step budget drawn from a log-normal distribution
  (``steps_median``, ``steps_sigma``), capped at ``steps_max``; when an episode reaches
  its budget the step answers ``done=True, truncated=True`` (success False, reward as
  the env gave it).  ``steps_median: 0`` leaves episode lengths to the env.

It is off by default: only a config with ``env.options.sim_latency`` set enables it, e.g.
``turnscale envhub env=babyai '+env.options.sim_latency={median_s: 0.05, sigma: 1.0}'``.

Invariants:

* Every draw is a pure function of ``(seed, data_idx, k, step)`` where ``k`` counts the
  resets of that ``data_idx`` on this server (``k``-th episode of the task).  Two runs
  that play the same tasks the same number of times therefore face the same multiset of
  costs, whatever order the episodes run in (asynchronous vs. lock-step).
* The sleeps happen inside ``Env.reset``/``Env.step``, i.e. in the server's per-instance
  call path, which runs env calls in a worker-thread pool: other instances are not
  delayed as long as fewer calls than pool threads sleep at once.
* Only steps the client actually sends are delayed and counted: an agent turn that did not
  parse (the actor answers it with a format hint, never stepping the env) costs no env
  time.  The reset latency and the task factor apply to every episode whatever the
  agent writes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import numpy as np

from turnscale.envhub.base import Env, EnvFamily, ResetResult, StepResult

OPTION = "sim_latency"
"""Key in ``env.options`` that turns the simulated workload on."""


@dataclass(frozen=True, kw_only=True)
class SimWorkload:
    """Parameters of the simulated long-tail workload (all times in seconds)."""

    seed: int = 0
    """Seeds every draw together with ``data_idx``, the episode count and the step."""
    median_s: float = 0.05
    """Median per-step env latency."""
    sigma: float = 1.0
    """Log-normal shape of the per-step latency (0: every step takes ``median_s``)."""
    max_s: float = 2.0
    """Cap on one step's (or reset's) latency."""
    task_sigma: float = 0.0
    """Log-normal shape of the per-task latency factor (0: every task alike)."""
    reset_s: float = 0.0
    """Median reset latency (0: resets are not delayed)."""
    steps_median: float = 3.0
    """Median step budget per task (0: the env decides when episodes end)."""
    steps_sigma: float = 1.0
    """Log-normal shape of the step budget."""
    steps_max: int = 30
    """Cap on the step budget."""

    def __post_init__(self) -> None:
        for name in ("median_s", "sigma", "max_s", "task_sigma", "reset_s", "steps_median", "steps_sigma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"config key 'env.options.{OPTION}.{name}': must be >= 0, got {getattr(self, name)}")
        if self.steps_max < 1:
            raise ValueError(f"config key 'env.options.{OPTION}.steps_max': must be >= 1, got {self.steps_max}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "SimWorkload | None":
        """The workload configured in ``env.options``, or None when it is off.  Unknown keys
        raise ``ValueError`` naming the key."""
        raw = options.get(OPTION)
        if raw is None or raw is False:
            return None
        if raw is True:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f"config key 'env.options.{OPTION}': expected a mapping or true, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"config key 'env.options.{OPTION}.{unknown[0]}': unknown; choose from {sorted(known)}")
        return cls(**dict(raw))


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


def task_factor(w: SimWorkload, data_idx: int) -> float:
    """Latency multiplier of every step and reset of ``data_idx`` (median 1)."""
    if w.task_sigma <= 0:
        return 1.0
    return float(np.exp(w.task_sigma * _rng(w.seed, 3, data_idx).standard_normal()))


def step_latency(w: SimWorkload, data_idx: int, episode: int, step: int) -> float:
    """Seconds the ``step``-th step (from 0) of the ``episode``-th play of ``data_idx``
    takes; ``step = -1`` is the reset."""
    median = w.reset_s if step < 0 else w.median_s
    if median <= 0:
        return 0.0
    z = _rng(w.seed, 1, data_idx, episode, step + 1).standard_normal()
    return float(min(w.max_s, task_factor(w, data_idx) * median * np.exp(w.sigma * z)))


def step_budget(w: SimWorkload, data_idx: int) -> int:
    """Steps after which an episode of ``data_idx`` ends (0: no budget, the env decides).
    A property of the task: every play of ``data_idx`` gets the same budget."""
    if w.steps_median <= 0:
        return 0
    z = _rng(w.seed, 2, data_idx).standard_normal()
    return int(min(w.steps_max, max(1, round(w.steps_median * np.exp(w.steps_sigma * z)))))


class _Counter:
    """How many times each ``data_idx`` was reset on this server (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}

    def next(self, data_idx: int) -> int:
        with self._lock:
            k = self._counts.get(data_idx, 0)
            self._counts[data_idx] = k + 1
            return k


class SimLatencyEnv:
    """Wraps one env instance: sleeps per step and ends episodes at the task's budget."""

    def __init__(self, inner: Env, workload: SimWorkload, counter: _Counter, sleep: Callable[[float], None] = time.sleep) -> None:
        self._inner = inner
        self._w = workload
        self._counter = counter
        self._sleep = sleep
        self._data_idx = 0
        self._episode = 0
        self._steps = 0
        self._budget = 0

    def reset(self, data_idx: int) -> ResetResult:
        self._data_idx = int(data_idx)
        self._episode = self._counter.next(self._data_idx)
        self._steps = 0
        self._budget = step_budget(self._w, self._data_idx)
        delay = step_latency(self._w, self._data_idx, self._episode, -1)
        if delay > 0:
            self._sleep(delay)
        out = self._inner.reset(data_idx)
        out.info = {**out.info, "sim_latency_s": delay}
        return out

    def step(self, action: str) -> StepResult:
        delay = step_latency(self._w, self._data_idx, self._episode, self._steps)
        if delay > 0:
            self._sleep(delay)
        out = self._inner.step(action)
        self._steps += 1
        out.info = {**out.info, "sim_latency_s": delay}
        if self._budget and self._steps >= self._budget and not out.done:
            out.done = True
            out.truncated = True
            out.info["success"] = bool(out.info.get("success", False))
        return out

    def observation(self) -> str:
        return self._inner.observation()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, attr: str) -> Any:
        # Env-specific extras (action hints) pass through to the wrapped instance.
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._inner, attr)


class SimLatencyFamily:
    """An env family whose instances are wrapped in ``SimLatencyEnv``."""

    def __init__(self, inner: EnvFamily, workload: SimWorkload, sleep: Callable[[float], None] = time.sleep) -> None:
        self._inner = inner
        self.workload = workload
        self.name = inner.name
        self._counter = _Counter()
        self._sleep = sleep

    def create(self) -> Env:
        return SimLatencyEnv(self._inner.create(), self.workload, self._counter, self._sleep)

    def num_tasks(self) -> int:
        return self._inner.num_tasks()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, attr: str) -> Any:
        # Family-specific extras (oracles, hints) pass through to the wrapped family.
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._inner, attr)


def split_options(cfg: Any) -> tuple[Any, SimWorkload | None]:
    """``(cfg without the sim_latency option, the workload or None)``: the env family's own
    factory never sees the benchmark option.  Validates the option (``ValueError``)."""
    w = SimWorkload.from_options(cfg.options)
    if OPTION not in cfg.options:
        return cfg, w
    return dataclasses.replace(cfg, options={k: v for k, v in cfg.options.items() if k != OPTION}), w


def wrap(family: EnvFamily, workload: SimWorkload | None) -> EnvFamily:
    """``family`` unchanged without a workload; else wrapped in ``SimLatencyFamily``."""
    return family if workload is None else SimLatencyFamily(family, workload)
