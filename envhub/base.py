"""The one interface every environment implements; the server wraps it in HTTP.

An ``Env`` instance is used by one request at a time (the server holds a per-instance
lock), so implementations need no locking of their own.  ``reset`` may be called again
on the same instance for a new episode (instances are reused across episodes).

Reward convention (the same in every env): ``reward`` of a step is in [0, 1]; the
episode's return is the sum of step rewards; ``info["success"]`` is True exactly when
the task was solved.  Envs whose native score differs (SciWorld 0-100) document the
mapping and also return the native value under its AgentGym name (``score``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class EnvBusy(Exception):
    """The env cannot serve this call now because a shared resource is exhausted (e.g. every
    SciWorld JVM is in use).  Nothing is wrong with the instance: the server answers 503
    with a ``Retry-After`` header and leaves the instance usable (a failed ``reset`` leaves
    it with no episode), so the client may retry the same call later."""


@dataclass
class StepResult:
    observation: str
    """Text shown to the agent after the action (or why the action was rejected)."""
    reward: float
    """Step reward, see the module docstring."""
    done: bool
    """The episode ended (success, failure or the env's own terminal state)."""
    truncated: bool = False
    """The env's own step cap ended the episode (distinct from ``done``)."""
    info: dict[str, Any] = field(default_factory=dict)
    """``success`` (bool) always; env-specific extras."""
    extra: dict[str, Any] = field(default_factory=dict)
    """AgentGym fields merged into the response as they are (``score`` for BabyAI/SciWorld)."""


@dataclass
class ResetResult:
    observation: str
    """First observation: task description plus the initial state."""
    info: dict[str, Any] = field(default_factory=dict)
    """Task metadata (``category``: level / depth / task type / dataset)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """AgentGym reset fields merged into the response (``task_name``, ``score``, ...).  An
    ``observation`` key here is what AgentGym's routes answer instead of ``observation`` (where
    AgentGym's own text differs, e.g. SciWorld without the task description)."""


@dataclass(frozen=True)
class AgentGymShape:
    """How a family answers on AgentGym's routes (the server's root face; ``/v1`` is uniform).

    A family without an ``agentgym`` attribute uses the defaults (BabyAI's and SciWorld's shapes).
    """

    create: str = "id"
    """``id``: ``{"id", "env_idx"}``; ``reset``: reset to ``data_idx = id`` (or the custom task of
    the body, via ``env.agentgym_custom_task(commands, goal)``) and answer ``{"id", "observation", "done",
    "reward"}`` (TextCraft); ``bare_id``: load task ``body.id`` (default 0), answer the bare int
    (SearchQA)."""
    reset: str = "dict"
    """``dict``: the reset dict; ``text``: the observation string alone (SearchQA)."""
    observation: str = "text"
    """``text``: ``GET /observation`` answers the string; ``dict``: ``env.agentgym_observation()``
    (BabyAI's ``{"observation", "reward", "score", "done", "deleted"}``)."""
    extra_routes: tuple[str, ...] = ()
    """AgentGym's extra routes this family serves (``commands``, ``goal``, ``detail``, ...): each
    is ``env.agentgym_<name>()``, run under the instance lock."""


class Env(Protocol):
    """One environment instance."""

    def reset(self, data_idx: int) -> ResetResult:
        """Start the episode selected deterministically by ``data_idx``."""

    def step(self, action: str) -> StepResult:
        """Apply one action (raw text from the agent's parsed action).  A malformed or
        impossible action is a normal step whose observation says why."""

    def observation(self) -> str:
        """The current observation text (AgentGym's ``GET /observation``)."""

    def close(self) -> None:
        """Release resources (idempotent)."""


class EnvFamily(Protocol):
    """Builds instances of one env family; one per server process."""

    name: str

    def create(self) -> Env: ...

    def num_tasks(self) -> int:
        """Number of distinct ``data_idx`` values before wrapping (for docs and splits)."""

    def close(self) -> None:
        """Release shared resources (JVM pools, indexes)."""


def play_expert(env: Env, first_observation: str, next_action: Any, max_turns: int,
                lost: tuple[type[Exception], ...] = ()) -> tuple[list[tuple[str, str]], bool, float]:
    """Play ``env`` (already reset; ``first_observation``) with ``next_action()`` for at most
    ``max_turns`` turns: ``([(observation shown, action), ...], success, return)``.  An
    exception of a ``lost`` type from ``next_action`` (an oracle that lost its way) ends the
    episode unsolved, keeping the steps so far; any other propagates."""
    steps: list[tuple[str, str]] = []
    obs, success, ret = first_observation, False, 0.0
    try:
        for _ in range(max_turns):
            action = next_action()
            steps.append((obs, action))
            out = env.step(action)
            obs, ret = out.observation, ret + out.reward
            if out.done:
                success = bool(out.info["success"])
                break
    except lost:
        success = False
    return steps, success, ret
