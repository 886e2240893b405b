"""The learner's side of the scaling control channel: drains, the lease limit, the status.

A controller (the client is ``turnscale.control.LearnerControl``, driven by the autoscaler
there; not this module) sends ``ControlRequest`` on the learner's control socket;
``LearnerService.handle`` passes it to ``ControlHandler.handle`` and answers the
``LearnerStatus`` it returns.  The service also asks this module, on every ``LeaseRequest``
and ``Heartbeat``, whether the actor is draining (``lease_gate``, ``heartbeat_gate``) and how
many leases it may hold (``room``).

Invariants and ordering (each call is synchronous: no await, so it runs between two handled
requests and sees and changes the state of one instant):

1. A request drains the named registered actors (an unknown id is logged and ignored) and,
   when ``max_leases_per_actor > 0``, sets the lease limit per actor to it, capped at
   ``learner.max_leases_per_actor``; 0 keeps the limit.  The drain flag lives on the actor's
   ``registry.ActorInfo`` and survives a reconnect (``ActorRegistry.register``).
2. A drained actor gets no new lease: its ``LeaseRequest`` is answered with an empty
   ``LeaseGrant`` while it holds a lease (checked before anything else grants).
3. Its in-flight groups are still accepted and trained as usual: draining changes neither
   intake nor the lease manager, only who gets the next lease, so nothing is lost or
   trained twice.
4. Once it holds no lease, its next ``LeaseRequest`` (or a ``Heartbeat`` naming no lease) is
   answered ``Shutdown(reason="drained")`` and it leaves (``Goodbye``).
5. Every reply is a consistent snapshot (``status``): built in one synchronous call from the
   run state, the lease manager, the registry and ``ScalingSignals``, so its counters,
   leases and actors belong to the same moment.  The signals are cumulative; a controller
   differences two replies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import trio

from turnscale.learner.registry import ActorInfo, ActorRegistry, short
from turnscale.protocol.messages import ActorStatus, ControlRequest, LearnerStatus, LeaseGrant, Shutdown

log = logging.getLogger("turnscale.learner")

__all__ = ["ControlHandler", "ScalingSignals"]


@dataclass
class ScalingSignals:
    """Cumulative counters behind ``LearnerStatus`` (the scaling signals); the service's
    intake and training loop write them, ``ControlHandler.status`` reads them."""

    started: float = field(default_factory=time.monotonic)
    idle_s: float = 0.0
    """Time the training loop waited for groups (closed waits)."""
    waiting_since: float | None = None
    """trio time the current wait began (None: not waiting)."""
    groups_received: int = 0
    groups_stale: int = 0
    groups_trained: int = 0
    staleness_sum: int = 0


class LeasesLike(Protocol):
    """What this module reads of ``learner.leases.LeaseManager``."""

    live: dict

    def held_by(self, actor_id: str) -> int: ...


class RunLike(Protocol):
    """What this module reads of ``learner.runstate.RunState``."""

    step: int
    version: int


class ControlHandler:
    """See the module docstring for the invariants and their order."""

    def __init__(self, actors: ActorRegistry, leases: LeasesLike, run: RunLike, max_leases_per_actor: int,
                 signals: ScalingSignals | None = None) -> None:
        self.actors = actors
        self.leases = leases
        self.run = run
        self.max_leases_per_actor = max_leases_per_actor
        """The configured cap (``learner.max_leases_per_actor``): no request raises the limit above it."""
        self.lease_limit = max_leases_per_actor
        """Leases one actor may hold now; a controller may lower it (``ControlRequest``)."""
        self.signals = signals if signals is not None else ScalingSignals()

    def handle(self, msg: ControlRequest, ready_groups: int) -> LearnerStatus:
        """Drain the named actors and/or set the lease limit; answer the signals
        (``ready_groups``: accepted groups waiting for a batch, from the service)."""
        for aid in msg.drain:
            a = self.actors.actors.get(aid)
            if a is None:
                log.info("drain: no actor %s registered; ignored", short(aid))
            elif not a.draining:
                a.draining = True
                log.info("actor %s (pool %s) draining: no new leases, %d in flight", short(aid), short(a.pool),
                         self.leases.held_by(aid))
        if msg.max_leases_per_actor > 0:
            limit = min(msg.max_leases_per_actor, self.max_leases_per_actor)
            if limit != self.lease_limit:
                log.info("lease limit per actor %d -> %d", self.lease_limit, limit)
            self.lease_limit = limit
        return self.status(ready_groups)

    def room(self, a: ActorInfo) -> int:
        """Leases ``a`` may still take: its own ``max_groups`` and the lease limit, less what it holds (>= 0)."""
        return max(0, min(a.max_groups, self.lease_limit) - self.leases.held_by(a.actor_id))

    def lease_gate(self, a: ActorInfo) -> LeaseGrant | Shutdown | None:
        """The answer to a ``LeaseRequest`` from a draining actor (nothing while it holds a
        lease, then ``Shutdown("drained")``); None when ``a`` is not draining."""
        if not a.draining:
            return None
        return self._drained(a) if self.leases.held_by(a.actor_id) == 0 else LeaseGrant(leases=[], retry_after_s=1.0)

    def heartbeat_gate(self, a: ActorInfo, lease_ids: list[str]) -> Shutdown | None:
        """``Shutdown("drained")`` for a draining actor that holds no lease and names none; else None."""
        if a.draining and self.leases.held_by(a.actor_id) == 0 and not lease_ids:
            return self._drained(a)
        return None

    def status(self, ready_groups: int) -> LearnerStatus:
        """The signals now (one synchronous read: a consistent snapshot)."""
        s = self.signals
        actors = [ActorStatus(actor_id=a.actor_id, pool=a.pool, host=a.host, leases=self.leases.held_by(a.actor_id),
                              draining=a.draining, tokens_generated=float(a.stats.get("tokens_generated", 0.0)))
                  for a in self.actors.values()]
        idle = s.idle_s + (trio.current_time() - s.waiting_since if s.waiting_since is not None else 0.0)
        return LearnerStatus(step=self.run.step, version=self.run.version, uptime_s=time.monotonic() - s.started,
                             idle_s=idle, ready_groups=ready_groups, live_leases=len(self.leases.live),
                             groups_received=s.groups_received, groups_stale=s.groups_stale,
                             groups_trained=s.groups_trained, staleness_sum=s.staleness_sum,
                             max_leases_per_actor=self.lease_limit, actors=actors)

    @staticmethod
    def _drained(a: ActorInfo) -> Shutdown:
        log.info("actor %s drained (no lease left); told to leave", short(a.actor_id))
        return Shutdown(reason="drained")
