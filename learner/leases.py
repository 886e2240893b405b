"""Leases, admission control and intake validation: who may play what, and which groups train.

All times are passed in (``now``, seconds on any monotonic clock), so tests drive a fake
clock; nothing here sleeps, does I/O or imports torch.

Admission (AReaL's rule, generalised to ``publish_every``)::

    in_flight + accepted < (max_staleness + version + 1) * groups_per_step * publish_every

``accepted`` counts every group accepted so far (trained or buffered), ``version`` is the
current policy version.  With ``publish_every = 1`` this is exactly AReaL's rule.  With
``publish_every = k`` one version covers ``k`` steps, so the bound is the number of groups
that the steps trained while the version is at most ``version + max_staleness`` consume:
a group leased now is never trained more than ``max_staleness`` versions after it was
sampled, if nothing is lost.  ``max_staleness = 0`` is synchronous training: one batch of
leases per version, then nothing until the learner has trained and published.

Lease life: ``grant`` -> (``heartbeat`` renews ``deadline = now + ttl_s``) -> ``intake``
of its group, or ``expire`` (a deadline passed: the same task is re-issued under a new
lease id), or ``release_actor`` (Goodbye: re-issued at once), or ``revoke`` (its holder
held more than its fair share while another actor waited: ``learner.control``).

Two deadlines per lease, and it expires at the earlier one:

``deadline``     ``ttl_s`` after the last heartbeat naming it (the actor died or lost it);
``progress_by``  ``progress_timeout_s`` after the holder last made *progress*: returned a
                 group (any outcome but ``not_holder``: ``intake``) or reported more
                 generated tokens or decode steps in a heartbeat (``reported_progress``; the
                 service calls ``progress``).  Heartbeats alone never move it, so an actor whose engine
                 hangs while its heartbeat task runs loses its leases after that long.
                 Progress is per actor (a heartbeat names no per-lease counter), so one
                 lease stuck behind others that progress lives until ``ttl_s`` after its
                 holder stops naming it; what a lying actor can hold so is bounded by its
                 fair share (``learner.control``).

Intake decides, in this order (the first that applies is the drop reason):

``unknown_lease`` never issued by this learner run (or from before a restart);
``duplicate``     the lease's group was already received;
``expired``       the lease expired (its task went to another lease);
``not_holder``    the group names another actor than the lease's holder (the lease stays
                  live: a forged group never makes the real one a ``duplicate``);
``mismatch``      the group does not echo its lease (task, turn limit, group size);
``failed``        the actor reported the group failed (its task is re-issued);
``invalid``       the group decodes but is semantically bad for this run
                  (``learner.validation``: token ids outside the vocabulary, non-finite
                  rewards or log-probs, positive log-probs, longer than the context, loss
                  mask on prompt tokens, versions in the future); its task is re-issued;
``stale``         oldest sampled token's version is more than ``max_staleness`` behind
                  the current version; its task is re-issued.

Staleness at training time.  A group accepted at version ``v`` may wait in the ready
buffer while the learner publishes ``v+1``, ``v+2``...  ``form_batch`` re-checks every
group when a batch is formed, against the version the batch trains at, and drops (and
re-issues) the ones now stale, so no group is ever *trained* more than ``max_staleness``
versions after its oldest token was sampled.  A dropped group gives its admission slot
back (``accepted`` counts groups trained or still ready).  Staleness is never negative:
intake rejects versions in the future as ``invalid``.

Turn limits: every lease is stamped with the limit in force at issue; a group carries
its lease's limit for all its episodes (groups never mix limits).  A group leased under
the previous stage that comes back after the stage advanced is still trained when it
is within staleness: it is valid on-policy-ish data for a shorter horizon, and the
window in which this happens is bounded by ``max_staleness`` versions.
"""

from __future__ import annotations

import math
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol

import numpy as np

from turnscale.learner.tasks import TaskStream
from turnscale.learner.validation import GroupLimits, find_problem
from turnscale.protocol.messages import Lease, Task, TrajectoryGroup

DROP_REASONS = ("unknown_lease", "duplicate", "expired", "not_holder", "mismatch", "failed", "invalid", "stale")

PROGRESS_STATS = ("tokens_generated", "decode_steps")
"""Heartbeat counters whose growth is generation progress (every engine reports both:
``actors.engine.ThreadedEngine.stats``).  ``tokens_generated`` grows when a generation
finishes, ``decode_steps`` at every batched decode step, so one long generation on a slow
device is progress too."""


def reported_progress(before: Mapping[str, float], after: Mapping[str, float]) -> bool:
    """True when a heartbeat's counters (``after``) show progress since the previous one
    (``before``): a ``PROGRESS_STATS`` counter grew.  A counter that went down (an engine
    rebuilt from zero) is not progress; its next growth is."""
    return any(float(after.get(k, 0.0)) > float(before.get(k, 0.0)) for k in PROGRESS_STATS)


@dataclass(slots=True)
class LeaseRecord:
    lease: Lease
    actor_id: str
    issued_at: float
    deadline: float
    """``ttl_s`` after the last heartbeat naming the lease (or its issue)."""
    progress_by: float = math.inf
    """``progress_timeout_s`` after its holder last made progress (or the lease's issue)."""
    serial: int = 0
    """Issue order (``revoke`` takes the youngest leases first: the least work lost)."""


@dataclass(frozen=True, slots=True)
class IntakeResult:
    """What happened to a received group."""

    accepted: bool
    reason: str = ""
    """One of ``DROP_REASONS`` when dropped."""
    staleness: int = -1
    """Current version minus the oldest sampled-token version (-1 when not computed)."""
    lease: Lease | None = None
    """The lease the group answered, when known."""
    problem: str = ""
    """For ``invalid``: the field and what is wrong with it."""


@dataclass(frozen=True, slots=True)
class Ready:
    """An accepted group waiting for a batch."""

    group: TrajectoryGroup
    lease: Lease
    oldest: int
    """Oldest sampled-token version of the group (its staleness is ``version - oldest``)."""
    pool: str = "default"
    """Pool of the actor that sent it, recorded at acceptance (the actor may leave before
    the group is trained; its per-pool metrics still name this pool)."""


def oldest_version(group: TrajectoryGroup, default: int) -> int:
    """Smallest policy version over every sampled token of the group (``default`` if none)."""
    best = None
    for ep in group.episodes:
        mask = np.asarray(ep.loss_mask, dtype=bool)
        if mask.any():
            v = int(np.asarray(ep.versions)[mask].min())
            best = v if best is None else min(best, v)
    return default if best is None else best


class PolicyView(Protocol):
    """Where the lease manager reads the run's current policy (``learner.runstate.RunState``
    in the learner; it is never copied into the manager)."""

    @property
    def version(self) -> int: ...

    @property
    def turn_limit(self) -> int: ...


@dataclass
class FixedPolicy:
    """A ``PolicyView`` of plain values, for a lease manager used on its own (tests, tools)."""

    version: int = 0
    turn_limit: int = 10


@dataclass
class LeaseManager:
    """Owns live leases, the admission counter and intake decisions for one task stream.

    The current version (admission, staleness, future-version checks) and the turn limit
    stamped on new leases are read from ``policy`` at each call; the manager keeps no copy."""

    stream: TaskStream
    group_size: int
    groups_per_step: int
    max_staleness: int
    ttl_s: float
    publish_every: int = 1
    progress_timeout_s: float = math.inf
    """A lease whose holder makes no progress for this long expires (``learner.lease_progress_timeout_s``)."""
    seed: int = 0
    policy: PolicyView = field(default_factory=FixedPolicy)
    """The run's current version and turn limit (read-only here)."""
    limits: GroupLimits = field(default_factory=GroupLimits)
    """What a group must respect to be valid (vocabulary, context)."""
    accepted: int = 0
    remember: int = 100_000
    """How many finished/expired lease ids are remembered for duplicate/expired answers."""
    live: dict[str, LeaseRecord] = field(default_factory=dict)
    prefix: str = field(default_factory=lambda: "l" + os.urandom(3).hex())
    _counter: int = 0
    _finished: "OrderedDict[str, str]" = field(default_factory=OrderedDict)
    """lease id -> ``received`` | ``expired``."""
    _unreported: list[Lease] = field(default_factory=list)
    """Expired leases not yet handed to ``take_expired`` (expiry also happens inside
    ``grant``, ``heartbeat`` and ``intake``; the service reports all of them once)."""

    @property
    def version(self) -> int:
        """Current policy version (``policy.version``)."""
        return self.policy.version

    @property
    def turn_limit(self) -> int:
        """Turn limit stamped on new leases (``policy.turn_limit``)."""
        return self.policy.turn_limit

    # ------------------------------------------------------------------ admission
    @property
    def in_flight(self) -> int:
        return len(self.live)

    @property
    def limit(self) -> int:
        return (self.max_staleness + self.version + 1) * self.groups_per_step * self.publish_every

    def capacity(self) -> int:
        """How many more leases admission allows now (>= 0)."""
        return max(0, self.limit - self.in_flight - self.accepted)

    @property
    def window(self) -> int:
        """The admission window: groups in flight or accepted for the versions the rule admits
        at once, ``(max_staleness + 1) * groups_per_step * publish_every``.  Fair shares are
        cut from it (``learner.control``): it does not shrink while accepted groups wait for
        their step, so an actor's share does not either."""
        return (self.max_staleness + 1) * self.groups_per_step * self.publish_every

    def grant(self, actor_id: str, max_leases: int, now: float) -> list[Lease]:
        """Up to ``max_leases`` new leases for ``actor_id`` (fewer when admission is closed)."""
        self.expire(now)
        out = []
        for _ in range(max(0, min(max_leases, self.capacity()))):
            out.append(self._issue(self.stream.next(), actor_id, now))
        return out

    def _issue(self, task: Task, actor_id: str, now: float) -> Lease:
        self._counter += 1
        lease = Lease(
            lease_id=f"{self.prefix}-{self._counter}-{os.urandom(4).hex()}",  # unguessable: only its holder knows it
            task=task,
            group_size=self.group_size,
            turn_limit=self.turn_limit,
            policy_version=self.version,
            ttl_s=self.ttl_s,
            seed=int(np.random.default_rng([self.seed, self._counter]).integers(0, 2**31 - 1)),
        )
        self.live[lease.lease_id] = LeaseRecord(lease, actor_id, now, now + self.ttl_s,
                                                now + self.progress_timeout_s, self._counter)
        return lease

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, actor_id: str, lease_ids: Iterable[str], now: float) -> list[str]:
        """Renew the named leases held by ``actor_id``; returns those it no longer holds."""
        self.expire(now)
        unknown = []
        for lid in lease_ids:
            rec = self.live.get(lid)
            if rec is None or rec.actor_id != actor_id:
                unknown.append(lid)
            else:
                rec.deadline = now + self.ttl_s
        return unknown

    def progress(self, actor_id: str, now: float) -> None:
        """``actor_id`` made progress: each of its leases may live ``progress_timeout_s`` more."""
        for rec in self.live.values():
            if rec.actor_id == actor_id:
                rec.progress_by = now + self.progress_timeout_s

    def expire(self, now: float) -> list[Lease]:
        """Expire leases whose deadline (heartbeat or progress) passed; their tasks are
        re-issued.  Returns them."""
        gone = [rec.lease for rec in self.live.values() if min(rec.deadline, rec.progress_by) <= now]
        for lease in gone:
            self._retire(lease.lease_id, "expired")
            self.stream.reissue(lease.task)
        self._unreported += gone
        return gone

    def take_expired(self) -> list[Lease]:
        """Every lease expired since the last call, by whichever call expired it (oldest first)."""
        out, self._unreported = self._unreported, []
        return out

    def held_by(self, actor_id: str) -> int:
        """Live leases of ``actor_id``."""
        return sum(1 for rec in self.live.values() if rec.actor_id == actor_id)

    def holdings(self) -> Counter[str]:
        """Live leases per actor id (one pass)."""
        return Counter(rec.actor_id for rec in self.live.values())

    def revoke(self, actor_id: str, n: int) -> list[Lease]:
        """End the ``n`` youngest leases of ``actor_id`` (the least work lost); their tasks are
        re-issued at once.  Its heartbeats then name them unknown (it abandons them) and a
        group it still returns for one is dropped as ``expired``.  Returns them."""
        mine = sorted((rec for rec in self.live.values() if rec.actor_id == actor_id), key=lambda r: -r.serial)
        gone = [rec.lease for rec in mine[:max(0, n)]]
        for lease in gone:
            self._retire(lease.lease_id, "expired")
            self.stream.reissue(lease.task)
        return gone

    def release_actor(self, actor_id: str) -> list[Lease]:
        """An actor left (Goodbye) or re-registered: its leases end and their tasks are re-issued."""
        gone = [rec.lease for rec in self.live.values() if rec.actor_id == actor_id]
        for lease in gone:
            self._retire(lease.lease_id, "expired")
            self.stream.reissue(lease.task)
        return gone

    def _retire(self, lease_id: str, how: str) -> None:
        self.live.pop(lease_id, None)
        self._finished[lease_id] = how
        self._finished.move_to_end(lease_id)
        while len(self._finished) > self.remember:
            self._finished.popitem(last=False)

    # ------------------------------------------------------------------ intake
    def intake(self, group: TrajectoryGroup, now: float) -> IntakeResult:
        """Validate a received group (see the module docstring for the order of checks)."""
        self.expire(now)
        rec = self.live.get(group.lease_id)
        if rec is None:
            how = self._finished.get(group.lease_id)
            reason = {"received": "duplicate", "expired": "expired"}.get(how or "", "unknown_lease")
            return IntakeResult(False, reason)
        lease = rec.lease
        if rec.actor_id != group.actor_id:  # not its holder: the lease stays live for the real group
            return IntakeResult(False, "not_holder")
        self.progress(rec.actor_id, now)  # its holder returned a group (whatever it is worth)
        if (group.task != lease.task or group.turn_limit != lease.turn_limit
                or (not group.failed and len(group.episodes) != lease.group_size)):
            self._retire(lease.lease_id, "received")
            self.stream.reissue(lease.task)
            return IntakeResult(False, "mismatch", lease=lease)
        self._retire(lease.lease_id, "received")
        if group.failed:
            self.stream.reissue(lease.task)
            return IntakeResult(False, "failed", lease=lease)
        problem = find_problem(group, self.limits, self.version)
        if problem:
            self.stream.reissue(lease.task)
            return IntakeResult(False, "invalid", lease=lease, problem=problem)
        staleness = self.version - oldest_version(group, lease.policy_version)
        if staleness > self.max_staleness:
            self.stream.reissue(lease.task)
            return IntakeResult(False, "stale", staleness, lease)
        self.accepted += 1
        return IntakeResult(True, "", staleness, lease)

    def ready(self, group: TrajectoryGroup, result: IntakeResult, pool: str = "default") -> Ready:
        """The buffer entry of an accepted group sent by an actor of ``pool``."""
        assert result.accepted and result.lease is not None
        return Ready(group, result.lease, self.version - result.staleness, pool)

    def form_batch(self, ready: list[Ready], size: int) -> tuple[list[Ready], list[Ready], list[Ready]]:
        """Split ``ready`` (arrival order) into ``(batch, rest, stale)`` at the current version.

        Groups now more than ``max_staleness`` versions old go to ``stale``: their tasks are
        re-issued and their admission slots freed.  ``batch`` holds the first ``size`` fresh
        groups (fewer if there are not enough: the caller waits for more and calls again)."""
        fresh, stale = [], []
        for r in ready:
            (stale if self.version - r.oldest > self.max_staleness else fresh).append(r)
        for r in stale:
            self.untrain(r, reissue=True)
        if len(fresh) < size:
            return [], fresh, stale
        return fresh[:size], fresh[size:], stale

    def untrain(self, r: Ready, *, reissue: bool) -> None:
        """An accepted group leaves without being trained: its admission slot is freed and,
        with ``reissue``, its task is played again."""
        self.accepted -= 1
        if reissue:
            self.stream.reissue(r.lease.task)

    # ------------------------------------------------------------------ checkpoints
    def state(self, trained_groups: int, untrained: Iterable[Task] = ()) -> dict[str, Any]:
        """Checkpoint data.  ``trained_groups`` becomes ``accepted`` on resume; tasks of
        buffered-but-untrained groups (``untrained``) and of live leases are re-issued."""
        pending = [*untrained, *(rec.lease.task for rec in self.live.values())]
        return {"stream": self.stream.state(extra_reissue=pending), "accepted": trained_groups,
                "counter": self._counter}

    def load_state(self, state: dict[str, Any], tasks: list[Task]) -> None:
        self.stream = TaskStream.from_state(tasks, state["stream"])
        self.accepted = int(state["accepted"])
        self._counter = int(state.get("counter", 0))
        self.live.clear()
