"""A scaling controller's line to the learner: ``ControlRequest`` -> ``LearnerStatus``.

``LearnerControl`` is a small blocking client (one ZeroMQ DEALER to the learner's control
port, one request at a time, a timeout per request); ``to_sample`` turns two successive
``LearnerStatus`` replies into the controller's ``turnscale.scaling.Sample`` (rates over
the interval between them).  ``Autoscaler.tick`` is one round of the loop: read the
signals, decide, act through a ``ScalingBackend`` (drain the chosen actors through the
learner, or ask the backend for more).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from turnscale.protocol import codec
from turnscale.protocol.errors import PeerTimeout, RemoteError
from turnscale.protocol.messages import ControlRequest, ErrorReply, LearnerStatus
from turnscale.protocol.transport import configure, tcp_endpoint
from turnscale.scaling import Decision, Sample, ScalingBackend, ScalingController, pick_drain

log = logging.getLogger("turnscale.scaling")


class LearnerControl:
    """Blocking ``ControlRequest`` client (see the module docstring).  ``curve``: the
    ``protocol.curve.CurveKeys`` of an authorized client when the learner requires CURVE."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 10.0, curve: Any = None) -> None:
        self._ctx = zmq.Context()
        self._sock = configure(self._ctx.socket(zmq.DEALER), curve=curve)
        self._sock.connect(tcp_endpoint(host, port))
        self.timeout_s = timeout_s
        self._rid = 0

    def request(self, msg: ControlRequest) -> LearnerStatus:
        """Raises ``PeerTimeout`` (no reply in time) or ``RemoteError`` (an ``ErrorReply``)."""
        self._rid += 1
        rid = self._rid.to_bytes(8, "little")
        if not self._sock.poll(int(self.timeout_s * 1000), zmq.POLLOUT):
            raise PeerTimeout(f"cannot send to the learner within {self.timeout_s:g}s")
        self._sock.send_multipart([rid, *codec.encode(msg)])
        while True:
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise PeerTimeout(f"no LearnerStatus within {self.timeout_s:g}s")
            frames = self._sock.recv_multipart()
            if frames and frames[0] == rid:
                break
        out = codec.decode(frames[1:], expect=(LearnerStatus, ErrorReply))
        if isinstance(out, ErrorReply):
            raise RemoteError(out.code, out.message, out.retryable)
        return out

    def status(self) -> LearnerStatus:
        return self.request(ControlRequest())

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def to_sample(prev: LearnerStatus, cur: LearnerStatus) -> Sample:
    """The signals over the interval between two replies (draining actors not counted)."""
    dt = max(cur.uptime_s - prev.uptime_s, 1e-9)
    received = cur.groups_received - prev.groups_received
    trained = cur.groups_trained - prev.groups_trained
    before = {a.actor_id: a.tokens_generated for a in prev.actors}
    actors: dict[str, int] = {}
    tokens: dict[str, float] = {}
    for a in cur.actors:
        tokens[a.pool] = tokens.get(a.pool, 0.0) + max(0.0, a.tokens_generated - before.get(a.actor_id, a.tokens_generated)) / dt
        if not a.draining:
            actors[a.pool] = actors.get(a.pool, 0) + 1
    return Sample(
        idle_fraction=min(1.0, max(0.0, (cur.idle_s - prev.idle_s) / dt)),
        ready_groups=float(cur.ready_groups),
        stale_drop_rate=(cur.groups_stale - prev.groups_stale) / received if received > 0 else 0.0,
        policy_lag=(cur.staleness_sum - prev.staleness_sum) / trained if trained > 0 else 0.0,
        lease_backlog=float(cur.live_leases), actors=actors, tokens_per_s=tokens)


@dataclass
class Autoscaler:
    """One controller round per ``tick`` (the caller paces it: e.g. every 10 s)."""

    control: LearnerControl
    controller: ScalingController
    backend: ScalingBackend
    last: LearnerStatus | None = None
    decisions: list[Decision] = field(default_factory=list)
    backoff_s: float = 30.0
    """First wait before resubmitting a pool's lost actors again (``slurm.resubmit_backoff_s``)."""
    backoff_max_s: float = 600.0
    """Longest wait (``slurm.resubmit_backoff_max_s``)."""
    clock: Callable[[], float] = time.monotonic
    failures: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Pool -> (resubmissions in a row whose actors have not registered, earliest next one)."""

    def replace_lost(self) -> dict[str, int]:
        """Resubmit actors that the resource manager lost: a backend that can count what it
        really runs (``refresh() -> {pool: live}``, e.g. ``SlurmBackend`` from ``squeue``) is
        asked for the controller's wanted count of every pool it runs short of (a crashed
        actor or a dead node's tasks are gone from the queue; the learner meanwhile re-issues
        their leases when ``lease_ttl_s`` passes).  Pending tasks count as live, so a task
        waiting for a node is not submitted twice; a draining actor's task still counts until
        it ends, so a drain never triggers a replacement.  Returns the pools scaled (pool ->
        wanted); a backend without ``refresh`` is left alone.  A pool whose resubmitted actors
        are lost again before registering (they keep failing) is resubmitted with exponential
        back-off (``backoff_s`` doubling up to ``backoff_max_s``; logged as a warning,
        ``failures``); once its actors have registered the count starts afresh."""
        refresh = getattr(self.backend, "refresh", None)
        if refresh is None:
            return {}
        have = refresh()
        registered = self._registered()
        now, out = self.clock(), {}
        for pool, want in self.controller.wanted.items():
            if registered.get(pool, 0) >= want:
                self.failures.pop(pool, None)  # its actors are up: the next loss starts afresh
            if pool not in have or have[pool] >= want:
                continue
            n, not_before = self.failures.get(pool, (0, now))
            if now < not_before:
                continue
            delay = min(self.backoff_max_s, self.backoff_s * 2 ** n)
            self.failures[pool] = (n + 1, now + delay)
            if n:
                log.warning("scaling: pool %s lost its actors again (%d resubmissions in a row, none registered): "
                            "resubmitting; the next no sooner than %.0fs from now (see the pool's job logs)",
                            pool, n + 1, delay)
            else:
                log.info("scaling: pool %s runs %d of %d actors (lost ones): resubmitting", pool, have[pool], want)
            self.backend.scale_to(pool, want)
            out[pool] = want
        return out

    def _registered(self) -> dict[str, int]:
        """Pool -> actors registered with the learner (not draining) in the last status."""
        out: dict[str, int] = {}
        for a in self.last.actors if self.last is not None else []:
            if not a.draining:
                out[a.pool] = out.get(a.pool, 0) + 1
        return out

    def tick(self) -> Decision | None:
        """``replace_lost`` first, then one controller round on the learner's status."""
        self.replace_lost()
        cur = self.control.status()
        prev, self.last = self.last, cur
        if prev is None:  # the learner's lease limit is the starting point: changed only by a decision
            self.controller.adopt_leases(cur.max_leases_per_actor)
            return None
        d = self.controller.observe(to_sample(prev, cur))
        self.decisions.append(d)
        if not d.changed:
            return d
        log.info("scaling: %s", d.reason)
        if d.max_leases_per_actor != cur.max_leases_per_actor:
            self.control.request(ControlRequest(max_leases_per_actor=d.max_leases_per_actor))
        live = [(a.actor_id, a.pool, a.leases) for a in cur.actors if not a.draining]
        for pool, want in d.wanted.items():
            have = sum(1 for _, p, _ in live if p == pool)
            if want < have:
                ids = pick_drain(live, pool, have - want)
                self.control.request(ControlRequest(drain=ids))
                for aid in ids:
                    self.backend.drain(aid)
            elif want > have:
                self.backend.scale_to(pool, want)
        return d
