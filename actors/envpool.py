"""Env instances leased from an envhub server once and reused across episodes.

``EnvPool.acquire(n)`` hands out ``n`` sessions (idle ones first, new instances created
on the server only when none is idle); ``release`` returns them.  A session whose
``reset``/``step`` raised is *broken*: ``release`` closes its instance on the server
(best effort) and drops it, so the next ``acquire`` creates a replacement.  AgentGym-RL
creates and closes ``batch x n`` instances every training step; here an actor creates at
most ``max_groups x group_size`` per env over its whole life (plus replacements).

Closing is bounded: ``release`` closes a lease's broken instances concurrently, shielded
from cancellation, within one ``CLOSE_TIMEOUT_S`` together; ``close(timeout_s)`` closes
every instance concurrently within ``timeout_s``.  An instance not closed in time is left
to the server's idle expiry: a stopping actor whose env server is gone must still exit
within seconds (docs/architecture.md, "Graceful stop").

``EnvSession`` (``reset(data_idx) -> (observation, info)``, ``step(action) ->
(observation, reward, done, info)``) is what the episode runner drives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("turnscale.actor")

CLOSE_TIMEOUT_S = 2.0
"""Bound on closing a released group's broken instances (all at once)."""


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
        broken = []
        for s in sessions:
            self.busy.discard(s)
            if s.broken:
                self.replaced += 1
                log.info("env instance %s broken (%s); closing it", s.env_id, s.error)
                broken.append(s)
            else:
                self.idle.append(s)
        if broken:
            await self._close_all(broken, CLOSE_TIMEOUT_S, shield=True)

    async def _close_all(self, sessions: list[PooledSession], timeout_s: float, *, shield: bool) -> None:
        """Close ``sessions`` on the server concurrently, for at most ``timeout_s`` in all."""
        import trio

        with trio.move_on_after(timeout_s) as scope:
            scope.shield = shield
            async with trio.open_nursery() as n:
                for s in sessions:
                    n.start_soon(self._close_quietly, s)

    async def _close_quietly(self, s: PooledSession) -> None:
        try:
            await self.client.close(s.env_id)
        except Exception as exc:  # the instance is gone anyway; idle expiry cleans up
            log.debug("closing env %s failed: %s", s.env_id, exc)

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Close every instance this pool holds (idle and busy), for at most ``timeout_s``."""
        sessions = [*self.idle, *self.busy]
        self.idle.clear()
        self.busy.clear()
        await self._close_all(sessions, timeout_s, shield=False)

    def stats(self) -> dict[str, float]:
        return {"env_instances_created": float(self.created), "env_instances_replaced": float(self.replaced),
                "env_instances_idle": float(len(self.idle))}
