"""Env instances leased from an envhub server once and reused across episodes.

``EnvPool.acquire(n)`` hands out ``n`` sessions (idle ones first, new instances created
on the server only when none is idle); ``release`` returns them.  A session whose
``reset``/``step`` raised is *broken*: ``release`` closes its instance on the server
(best effort) and drops it, so the next ``acquire`` creates a replacement.  AgentGym-RL
creates and closes ``batch x n`` instances every training step; here an actor creates at
most ``max_groups x group_size`` per env over its whole life (plus replacements).

``EnvSession`` (``reset(data_idx) -> (observation, info)``, ``step(action) ->
(observation, reward, done, info)``) is what the episode runner drives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("turnscale.actor")


class EnvClientLike(Protocol):
    """The subset of ``common.envclient.EnvClient`` the pool uses."""

    async def create(self) -> int: ...

    async def reset(self, env_id: int, data_idx: int) -> Any: ...

    async def step(self, env_id: int, action: str) -> Any: ...

    async def close(self, env_id: int) -> Any: ...


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


@dataclass(eq=False)
class PooledSession:
    """One env instance on a server; implements the episode runner's ``EnvSession``."""

    client: EnvClientLike
    env_id: int
    broken: bool = False
    category: str = ""
    """``info["category"]`` of the last reset (the task's sub-task), for metrics."""
    episodes: int = 0
    error: str = ""

    async def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        try:
            r = await self.client.reset(self.env_id, data_idx)
        except BaseException as exc:
            self._mark(exc)
            raise
        self.episodes += 1
        info = dict(_field(r, "info", None) or {})
        self.category = str(info.get("category", "") or "")
        return str(_field(r, "observation", "")), info

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        try:
            r = await self.client.step(self.env_id, action)
        except BaseException as exc:
            self._mark(exc)
            raise
        info = dict(_field(r, "info", None) or {})
        terminal = bool(_field(r, "done", False))
        truncated = bool(_field(r, "truncated", False)) and not terminal
        info["truncated"] = truncated  # cut by the env's own time limit: not a terminal state
        return str(_field(r, "observation", "")), float(_field(r, "reward", 0.0)), terminal or truncated, info

    def _mark(self, exc: BaseException) -> None:
        import trio

        if isinstance(exc, trio.Cancelled):
            self.broken = True  # the instance may be mid-request: do not reuse it
            self.error = "cancelled"
        elif isinstance(exc, Exception):
            self.broken = True
            self.error = f"{type(exc).__name__}: {exc}"


@dataclass
class EnvPool:
    """Sessions of one env family (see the module docstring)."""

    client: EnvClientLike
    idle: list[PooledSession] = field(default_factory=list)
    busy: set[PooledSession] = field(default_factory=set)
    created: int = 0
    replaced: int = 0

    async def acquire(self, n: int) -> list[PooledSession]:
        out: list[PooledSession] = []
        try:
            while len(out) < n:
                if self.idle:
                    s = self.idle.pop()
                else:
                    s = PooledSession(self.client, int(await self.client.create()))
                    self.created += 1
                self.busy.add(s)
                out.append(s)
        except BaseException:
            await self.release(out)
            raise
        return out

    async def release(self, sessions: list[PooledSession]) -> None:
        for s in sessions:
            self.busy.discard(s)
            if s.broken:
                self.replaced += 1
                log.info("env instance %s broken (%s); closing it", s.env_id, s.error)
                await self._close_quietly(s)
            else:
                self.idle.append(s)

    async def _close_quietly(self, s: PooledSession) -> None:
        import trio

        with trio.move_on_after(2.0) as scope:
            scope.shield = True
            try:
                await self.client.close(s.env_id)
            except Exception as exc:  # the instance is gone anyway; idle expiry cleans up
                log.debug("closing env %s failed: %s", s.env_id, exc)

    async def close(self) -> None:
        """Close every instance this pool holds (idle and busy)."""
        for s in [*self.idle, *self.busy]:
            await self._close_quietly(s)
        self.idle.clear()
        self.busy.clear()

    def stats(self) -> dict[str, float]:
        return {"env_instances_created": float(self.created), "env_instances_replaced": float(self.replaced),
                "env_instances_idle": float(len(self.idle))}
