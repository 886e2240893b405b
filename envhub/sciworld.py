"""ScienceWorld (the ``scienceworld`` package, a Scala simulator in a JVM) with pooled JVMs.

Tasks: AgentGym's flattened list — every (task, variation) pair of the package's task list in
its order (``1-1`` boil, ``1-2`` melt, ...), skipping task ids 5-1, 5-2, 9-1, 9-2, 9-3, 10-1 and
10-2 (23 task types remain), variations ``0 .. max_variations-1``.  ``data_idx % len(games)``
selects the pair (AgentGym indexes without the modulo).  ``info["category"]`` is the task name.

JVMs: each simulator is a JVM (3-4 s to start, ~165 MB with the default ``java_opts``).  They
live in a pool of at most ``jvm_pool`` JVMs shared by every instance of the server and are
reused across episodes and instances, never started per episode.  An ``Env`` borrows a JVM at
``reset`` and gives it back when the episode ends (done), at the next ``reset`` (then borrows
again, usually the same one) and at ``close``.  So at most ``jvm_pool`` episodes run at once; a
``reset`` waits up to ``jvm_wait_s`` for a free JVM, then raises ``PoolExhausted`` (an
``EnvBusy``: the server answers 503 and the instance stays usable).  A JVM that
fails is closed and dropped from the pool (a new one starts when next needed).

Step: the package's ``step()`` lists every valid action (300-400) after every move, which is
most of its cost; ours calls the simulator's own step and score directly, and lists valid
actions only when asked (``valid_actions()`` / ``action_hint()``).

Reward: the native score is 0-100 (negative, -100, when the task is failed).  ``reward`` of a
step = (max(score, 0) - max(previous score, 0)) / 100, so an episode's return is
max(final score, 0) / 100; a step whose action undoes progress has a negative reward.  The
native score is returned as ``score`` (AgentGym's field; its clients read it as the reward).
``done`` when the simulator reports completion (success or failure), the score is negative,
or the move count exceeds ``step_limit`` (then also ``truncated`` unless completed).
``info["success"]`` = score reached 100.

Options (``env.options``):
  ``jvm_pool``: most JVMs alive at once (default 2; more than the core count lowers throughput).
  ``jvm_wait_s``: how long ``reset`` waits for a free JVM before ``PoolExhausted`` (default 120).
  ``max_waiting``: most resets waiting for a JVM at once; more fail at once with
    ``PoolExhausted`` (default 16, half the server's env threads).
  ``step_limit``: the simulator's move limit per episode (default 100, the package's and AgentGym's).
  ``java_opts``: ``JAVA_TOOL_OPTIONS`` for the JVMs unless that variable is already set
    (default ``-Xmx256m -XX:+UseSerialGC``).
  ``simplifications``: ScienceWorld simplification string, e.g. ``easy`` (default ``""``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from turnscale.envhub.base import AgentGymShape, EnvBusy, ResetResult, StepResult
from turnscale.envhub.options import read_options

log = logging.getLogger(__name__)

EXCLUDED_TASKS = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
JAVA_OPTS = "-Xmx256m -XX:+UseSerialGC"


class SciWorldError(RuntimeError):
    """The simulator failed (its JVM is dropped from the pool)."""


class PoolExhausted(SciWorldError, EnvBusy):
    """No JVM became free within ``jvm_wait_s``: raise ``env.options.jvm_pool`` or run fewer
    episodes.  The server answers 503 ``busy`` and the instance stays usable."""


@dataclass(frozen=True)
class Game:
    task_id: str
    task_name: str
    variation: int


class JvmPool:
    """At most ``size`` ScienceWorld JVMs, started on demand, lent one borrower at a time.

    Invariant: ``len(idle) + borrowed + starting <= size``.  ``acquire`` prefers an idle JVM,
    else starts one if there is room, else waits — but at most ``max_waiting`` callers wait at
    once (the server runs env calls on a bounded thread pool; waiting resets must not occupy all
    of it and starve the steps of running episodes); beyond that it fails at once.  Thread-safe.
    """

    def __init__(self, size: int, step_limit: int = 100, java_opts: str = JAVA_OPTS, max_waiting: int = 16) -> None:
        if size < 1:
            raise ValueError("config key 'env.options.jvm_pool': must be >= 1")
        self.size, self.step_limit, self.java_opts, self.max_waiting = size, step_limit, java_opts, max_waiting
        self._waiting = 0
        self._idle: list[Any] = []
        self._live = 0
        self._cond = threading.Condition()
        self._closed = False
        self.started = 0
        """JVMs started over the pool's life (a test checks reuse)."""

    def _start(self) -> Any:
        os.environ.setdefault("JAVA_TOOL_OPTIONS", self.java_opts)
        from scienceworld import ScienceWorldEnv

        jvm = ScienceWorldEnv(None, envStepLimit=self.step_limit)
        self.started += 1
        return jvm

    def acquire(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise SciWorldError("the JVM pool is closed")
                if self._idle:
                    return self._idle.pop()
                if self._live < self.size:
                    self._live += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0 or self._waiting >= self.max_waiting:
                    raise PoolExhausted(
                        f"all {self.size} ScienceWorld JVMs are busy ({self._waiting} resets already waiting, "
                        f"waited {timeout_s:.0f} s at most); raise env.options.jvm_pool or run fewer concurrent episodes"
                    )
                self._waiting += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1
        try:
            return self._start()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def release(self, jvm: Any) -> None:
        with self._cond:
            if self._closed:
                self._live -= 1
                _close_jvm(jvm)
                return
            self._idle.append(jvm)
            self._cond.notify()

    def discard(self, jvm: Any) -> None:
        """Drop a failed JVM; its slot becomes free for a new one."""
        _close_jvm(jvm)
        with self._cond:
            self._live -= 1
            self._cond.notify()

    @property
    def live(self) -> int:
        return self._live

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for jvm in idle:
            _close_jvm(jvm)


def _close_jvm(jvm: Any) -> None:
    try:
        jvm.close()
    except Exception:  # noqa: BLE001 - a dead JVM cannot be closed more
        log.warning("closing a ScienceWorld JVM failed", exc_info=True)


def list_games(jvm: Any) -> list[Game]:
    """AgentGym's flattened (task, variation) list, in the package's task order."""
    from scienceworld.constants import ID2TASK

    games: list[Game] = []
    for task_id, name in ID2TASK.items():
        if task_id not in EXCLUDED_TASKS:
            games += [Game(task_id, name, v) for v in range(int(jvm.get_max_variations(name)))]
    return games


def spread_split(games: list[Game], n_test: int = 200) -> tuple[list[int], list[int]]:
    """(train ids, test ids): ``n_test`` test ids spread over every task type (the first
    ``n_test % types`` types get one more), evenly spaced over each type's variations; the rest
    train.  Pure and deterministic.  Contiguous ranges are *not* such a split: ids are grouped
    by task type, so ``2000:2200`` covers one or two task types.
    """
    by_type: dict[str, list[int]] = {}
    for i, g in enumerate(games):
        by_type.setdefault(g.task_id, []).append(i)
    test: list[int] = []
    for k, ids in enumerate(by_type.values()):
        n = min(len(ids), n_test // len(by_type) + (1 if k < n_test % len(by_type) else 0))
        test += [ids[(j * len(ids)) // n] for j in range(n)]
    chosen = set(test)
    return [i for i in range(len(games)) if i not in chosen], sorted(test)


class SciWorldEnv:
    """One ScienceWorld episode at a time on a JVM borrowed from the family's pool."""

    def __init__(self, family: SciWorldFamily) -> None:
        self._fam = family
        self._jvm: Any = None
        self.game: Game | None = None
        self._score = 0
        self._obs = ""
        self._done = False
        self._task_description = ""

    # -- JVM lending ----------------------------------------------------------------------------
    def _give_back(self) -> None:
        if self._jvm is not None:
            jvm, self._jvm = self._jvm, None
            self._fam.pool.release(jvm)

    def _call(self, fn, *args):
        """Run a simulator call; a failure drops the JVM and raises ``SciWorldError``."""
        try:
            return fn(*args)
        except Exception as e:  # py4j errors: the JVM died or rejected the call
            jvm, self._jvm = self._jvm, None
            if jvm is not None:
                self._fam.pool.discard(jvm)
            self._done = True
            raise SciWorldError(f"ScienceWorld simulator failed: {type(e).__name__}: {e}") from e

    # -- Env interface --------------------------------------------------------------------------
    def reset(self, data_idx: int) -> ResetResult:
        self._give_back()
        game = self._fam.games[data_idx % len(self._fam.games)]
        self._jvm = self._fam.pool.acquire(self._fam.jvm_wait_s)
        self.game = game
        desc, look = self._load(game, gold=False)
        self._obs = f"{desc}\n{look}"
        info = {"category": game.task_name, "task_id": game.task_id, "variation": game.variation}
        extra = {"task_name": game.task_name, "var_num": game.variation, "task_description": desc,
                 "score": self._score, "deleted": False, "done": False,
                 "observation": look}  # AgentGym's reset: the room; its client prepends the description
        self._task_description = desc
        return ResetResult(observation=self._obs, info=info, extra=extra)

    def _load(self, game: Game, gold: bool) -> tuple[str, str]:
        jvm = self._jvm
        self._call(jvm.load, game.task_name, game.variation, self._fam.simplifications, gold)
        desc = str(self._call(jvm.server.getTaskDescription))
        look = str(self._call(jvm.server.step, "look around"))
        self._score, self._done = 0, False
        return desc, look

    def gold_actions(self) -> list[str]:
        """The package's gold action sequence for the current task; restarts the episode."""
        if self._jvm is None or self.game is None:
            raise RuntimeError("gold_actions() needs a running episode (call reset first)")
        self._load(self.game, gold=True)
        return [str(a) for a in self._call(self._jvm.get_gold_action_sequence)]

    def step(self, action: str) -> StepResult:
        if self._jvm is None or self._done:
            raise RuntimeError("step() without a running episode (reset first; the last one ended)")
        jvm = self._jvm
        obs = str(self._call(jvm.server.step, action))
        score = int(round(100 * float(self._call(jvm.server.getScore))))
        completed = bool(self._call(jvm.server.getCompleted))
        moves = int(self._call(jvm.server.getNumMoves))
        reward = (max(score, 0) - max(self._score, 0)) / 100.0
        self._score = score
        over = moves > self._fam.step_limit
        done = completed or score < 0 or over
        success = score >= 100
        self._obs, self._done = obs, done
        if done:
            self._give_back()
        info = {"success": success, "moves": moves}
        return StepResult(observation=obs, reward=reward, done=done, truncated=over and not completed,
                          info=info, extra={"score": score})

    def valid_actions(self) -> list[str]:
        """Every valid action string now (slow: 300-400 strings; for hints, not every step)."""
        if self._jvm is None:
            return []
        return [str(a) for a in self._call(self._jvm.get_valid_action_object_combinations)]

    def action_hint(self) -> dict[str, list[str]]:
        """AgentGym's ``GET /action_hint`` payload: action templates and object names."""
        if self._jvm is None:
            return {"possible_actions": [], "possible_objects": []}
        return {
            "possible_actions": [str(a) for a in self._call(self._jvm.get_possible_actions)],
            "possible_objects": [str(o) for o in self._call(self._jvm.get_possible_objects)],
        }

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self._give_back()
        self._done = True

    # -- AgentGym's extra routes (envhub.server, root face) ---------------------------------------
    def _jvm_or_raise(self) -> Any:
        if self._jvm is None:
            raise RuntimeError("no running episode (reset first)")
        return self._jvm

    def agentgym_goals(self) -> dict[str, str]:
        return {"goals": str(self._call(self._jvm_or_raise().get_goal_progress))}

    def agentgym_detail(self) -> dict[str, Any]:
        game = self.game
        return {"task_name": game.task_name if game else "", "var_num": game.variation if game else 0,
                "task_description": self._task_description, "observation": self._obs,
                "score": self._score, "deleted": False, "done": self._done}

    def agentgym_task_description(self) -> dict[str, str]:
        return {"task_description": self._task_description}

    def agentgym_object_tree(self) -> dict[str, str]:
        return {"object_tree": str(self._call(self._jvm_or_raise().getObjectTree))}

    def agentgym_state(self) -> dict[str, Any]:
        """AgentGym's ``/state``; its ``observation`` is ScienceWorld's ``look()`` (a free look)."""
        jvm = self._jvm_or_raise()
        hint = self.action_hint()
        return {
            "observation": str(self._call(jvm.look)),
            "inventory": str(self._call(jvm.inventory)),
            "task_description": self._task_description,
            "goal_progress": str(self._call(jvm.get_goal_progress)),
            "possible_actions": hint["possible_actions"][:10],
            "possible_objects": hint["possible_objects"][:10],
            "current_moves": int(self._call(jvm.server.getNumMoves)),
            "environment_info": self.agentgym_detail(),
        }


OPTIONS: dict[str, Any] = {
    "jvm_pool": 2,
    "jvm_wait_s": 120.0,
    "max_waiting": 16,
    "step_limit": 100,
    "java_opts": JAVA_OPTS,
    "simplifications": "",
}
"""Every option this family reads, with its default (documented in the module docstring)."""


class SciWorldFamily:
    """The JVM pool and the task list, shared by every instance of the server."""

    name = "sciworld"
    agentgym = AgentGymShape(extra_routes=("goals", "detail", "task_description", "object_tree", "state"))

    def __init__(self, jvm_pool: int = 2, jvm_wait_s: float = 120.0, step_limit: int = 100,
                 java_opts: str = JAVA_OPTS, simplifications: str = "", max_waiting: int = 16) -> None:
        self.pool = JvmPool(jvm_pool, step_limit, java_opts, max_waiting)
        self.jvm_wait_s, self.step_limit, self.simplifications = jvm_wait_s, step_limit, simplifications
        jvm = self.pool.acquire(jvm_wait_s)  # the first JVM lists the tasks, then joins the pool
        try:
            self.games = list_games(jvm)
        except Exception:
            self.pool.discard(jvm)
            raise
        self.pool.release(jvm)

    def create(self) -> SciWorldEnv:
        return SciWorldEnv(self)

    def num_tasks(self) -> int:
        return len(self.games)

    def close(self) -> None:
        self.pool.close()


def make_family(cfg) -> SciWorldFamily:
    o = read_options(cfg.options, OPTIONS, "sciworld")
    return SciWorldFamily(int(o["jvm_pool"]), float(o["jvm_wait_s"]), int(o["step_limit"]),
                          str(o["java_opts"]), str(o["simplifications"]), int(o["max_waiting"]))
