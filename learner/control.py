"""The learner's side of the scaling control channel: drains, the lease limit, fair shares, the status.

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

Fair shares (``ask``, ``reclaim``; on every ``LeaseRequest``).  The *contenders* are the
actors that hold a lease or asked for leases within ``ASKED_RECENTLY_S`` (an actor that
wants leases asks at least every ``retry_after_s``, at most 1 s) and did not leave since.
With ``W`` the admission window (``LeaseManager.window``, or the leases in flight plus the
free slots when that is more) and ``n`` contenders, an actor's share is ``ceil(W / n)``;
it may hold at most ``min(share, lease limit, Hello.max_groups)``.  So:

6. An actor alone may use the whole window (``n = 1``): a lone actor is never held back.
7. While others contend, no actor is granted past its share, whatever it asks for.
8. When an actor below its share asks and the free slots do not cover its room, the
   leases others hold *above* their share are revoked (``LeaseManager.revoke``: youngest
   first, from the actor furthest above its share first), just enough to cover it, and
   their tasks re-issued; so an actor that took the whole window while alone (a hoarder,
   or a lone honest actor when others join) is cut back to its share as soon as another
   actor asks, and nobody at or below its share ever loses a lease this way.
   ``W`` does not shrink while accepted groups wait for their step, so shares do not
   either: actors waiting for a training step take nothing from each other.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import trio

from turnscale.learner.registry import ActorInfo, ActorRegistry, short
from turnscale.protocol.messages import ActorStatus, ControlRequest, LearnerStatus, Lease, LeaseGrant, Shutdown

log = logging.getLogger("turnscale.learner")

__all__ = ["ASKED_RECENTLY_S", "ControlHandler", "ScalingSignals"]

ASKED_RECENTLY_S = 3.0
"""An actor that asked for leases this recently contends for the window (one that wants
leases asks again within ``LeaseGrant.retry_after_s``, at most 1 s; three such periods
without a request mean it stopped wanting)."""


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

    @property
    def window(self) -> int: ...

    def held_by(self, actor_id: str) -> int: ...

    def holdings(self) -> Counter[str]: ...

    def capacity(self) -> int: ...

    def expire(self, now: float) -> list[Lease]: ...

    def revoke(self, actor_id: str, n: int) -> list[Lease]: ...


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
        self._asked: OrderedDict[str, float] = OrderedDict()
        """Actor id -> when it last asked for leases, oldest first (pruned past ``ASKED_RECENTLY_S``)."""

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

    def ask(self, a: ActorInfo, max_leases: int, now: float) -> int:
        """``a`` asks for ``max_leases`` leases at ``now``: it contends from now on (for
        ``ASKED_RECENTLY_S``); returns how many it may be granted (``room``)."""
        self._asked[a.actor_id] = now
        self._asked.move_to_end(a.actor_id)
        return min(max_leases, self.room(a, now))

    def forget(self, actor_id: str) -> None:
        """``actor_id`` left (``Goodbye``): it no longer contends, whenever it last asked."""
        self._asked.pop(actor_id, None)

    def room(self, a: ActorInfo, now: float) -> int:
        """Leases ``a`` may still take at ``now``: its own ``max_groups``, the lease limit and its
        fair share (invariants 6-7), less what it holds (>= 0)."""
        held = self.leases.holdings()
        return max(0, min(a.max_groups, self.lease_limit, self.share(a.actor_id, held, now)) - held[a.actor_id])

    def share(self, actor_id: str, held: Counter[str], now: float) -> int:
        """``ceil(W / n)``: the fair share of the window among the ``n`` contenders at ``now``
        (``held``: live leases per actor); ``actor_id`` itself always contends.  Costs
        O(actors holding leases): the recent askers are counted, not visited."""
        while self._asked and next(iter(self._asked.values())) < now - ASKED_RECENTLY_S:
            self._asked.popitem(last=False)  # oldest first: stopped asking
        n = len(self._asked) + sum(1 for h in held if held[h] > 0 and h not in self._asked)
        if actor_id not in self._asked and held[actor_id] == 0:
            n += 1
        return -(-self._window() // max(1, n))

    def reclaim(self, a: ActorInfo, want: int, now: float) -> list[Lease]:
        """Invariant 8: revoke leases held above their share by other actors so that ``a`` (its
        room is ``want``) finds ``want`` free slots; returns the revoked leases (often none)."""
        self.leases.expire(now)  # a lease past its deadline frees its slot without revoking anything
        need = want - self.leases.capacity()
        if need <= 0:
            return []
        held = self.leases.holdings()
        share = self.share(a.actor_id, held, now)  # everyone's: holders contend, so n is the same for them
        over = [(share - k, aid) for aid, k in held.items() if aid != a.actor_id and k > share]
        heapq.heapify(over)
        take: Counter[str] = Counter()
        while need > 0 and over:  # one lease at a time from whoever is furthest above its share
            excess, aid = heapq.heappop(over)
            take[aid] += 1
            need -= 1
            if excess + 1 < 0:
                heapq.heappush(over, (excess + 1, aid))
        out: list[Lease] = []
        for aid, k in take.items():
            gone = self.leases.revoke(aid, k)
            log.info("revoked %d lease(s) of actor %s (held %d, fair share %d of %d) for actor %s", len(gone),
                     short(aid), held[aid], share, self._window(), short(a.actor_id))
            out += gone
        return out

    def _window(self) -> int:
        """The window shares are cut from: the admission window, or more when the rule admits
        more now (leases in flight plus free slots)."""
        return max(self.leases.window, len(self.leases.live) + self.leases.capacity())

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
