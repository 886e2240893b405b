"""The actor process: register with the learner, pull weights, play leased groups, repeat.

Supervision.  ``Actor.run`` owns one trio nursery per *session* (one Hello -> Welcome
connection to the learner) with these named tasks:

- ``leases``: asks for up to ``max_groups - running`` leases; each lease runs as its own
  task (``lease:<id>``): wait until the engine holds the lease's policy version, take
  ``group_size`` env sessions from the pool, play the group (episodes concurrently),
  send it and wait for its ``GroupAck``;
- ``heartbeat``: every ``heartbeat_interval_s`` names the live leases; leases the learner
  no longer holds are cancelled (abandoned);
- ``announcements``: SUB to the learner's PUB; a newer ``PolicyAnnouncement`` becomes the
  weight target, ``Shutdown`` starts a graceful stop;
- ``weights``: pulls the target version's chunks in the background (own DEALER to the
  weights endpoint) and hands them to ``engine.load_weights`` (the engine swaps at its
  safe point, ``engine.update_mode``);
- ``signals`` (process-wide, outside the sessions): SIGTERM/SIGINT start a graceful stop.

Lost learner.  A control request that times out (``PeerTimeout``) or a
``not_registered`` answer ends the session: its nursery is cancelled (running groups
are dropped; the learner re-issues their leases when they expire), then the actor
re-sends Hello with capped exponential backoff (``reconnect_max_backoff_s``) until the
learner answers.  Engine and env instances survive across sessions.

Graceful stop (SIGTERM/SIGINT or ``Shutdown``), bounded by ``shutdown_grace_s`` + a few
seconds:

1. no new leases are requested;
2. running groups finish and are sent; any still running after ``shutdown_grace_s``
   are cancelled (abandoned);
3. ``Goodbye`` is sent (the learner releases any remaining leases at once);
4. the session's tasks are cancelled, env instances closed on the server, the engine
   closed, sockets closed; ``run`` returns 0.

Everything heavy (engine, weight pull, episode runner, env clients) is injected through
``ActorDeps`` so unit tests drive the same loop with fakes; ``actors.main`` wires the
real ones.
"""

from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Protocol

import trio
import zmq

from actors.envpool import EnvClientLike, EnvPool, PooledSession
from conf.schema import ActorConfig
from protocol.errors import PeerTimeout, ProtocolError, RemoteError, TransportError, TurnscaleError
from protocol.messages import (
    ErrorReply,
    Goodbye,
    GroupAck,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Lease,
    LeaseGrant,
    LeaseRequest,
    PolicyAnnouncement,
    Shutdown,
    TrajectoryGroup,
    WeightManifest,
    Welcome,
)
from protocol.transport import AsyncSocket, Requester, configure

log = logging.getLogger("turnscale.actor")


class EngineLike(Protocol):
    @property
    def version(self) -> int: ...

    def load_weights(self, version: int, tensors: Any) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


PullFn = Callable[[AsyncSocket, WeightManifest, float], Awaitable[Any]]
"""``pull(weights_sock, manifest, timeout_s) -> named tensors`` (checksums verified)."""

PlayGroupFn = Callable[[Lease, list[PooledSession]], Awaitable[TrajectoryGroup]]
"""Plays one lease's episodes on the given sessions (one per episode) -> the group."""


@dataclass
class ActorDeps:
    """The heavy parts, built once per process (``make_runtime`` after the first Welcome)."""

    make_runtime: Callable[[Welcome], Awaitable["Runtime"]]
    pull: PullFn
    make_env_client: Callable[[str, str], EnvClientLike]
    """``(url, flavor) -> client``; the flavor is the learner's ``EnvEndpoint.flavor``."""


@dataclass
class Runtime:
    """What a Welcome lets the actor build: the engine and a group player bound to it."""

    engine: EngineLike
    play_group: PlayGroupFn


class LearnerLost(Exception):
    """The learner stopped answering (or forgot us): end the session and reconnect."""


@dataclass
class ActorStats:
    groups_sent: int = 0
    groups_accepted: int = 0
    groups_abandoned: int = 0
    leases_received: int = 0
    sessions: int = 0
    weight_pulls: int = 0
    weight_pull_s: float = 0.0


def default_actor_id() -> str:
    return f"{pysocket.gethostname()}-{os.getpid()}-{os.urandom(2).hex()}"


def _swap_host(endpoint: str, learner_host: str) -> str:
    """Welcome endpoints bound to a wildcard are reached at the learner's address."""
    for wild in ("0.0.0.0", "*", "[::]"):
        endpoint = endpoint.replace(f"//{wild}:", f"//{learner_host}:")
    return endpoint


@dataclass
class Actor:
    cfg: ActorConfig
    deps: ActorDeps
    engine_name: str = "hf"
    device: str = "cpu"
    actor_id: str = field(default_factory=default_actor_id)
    stats: ActorStats = field(default_factory=ActorStats)
    runtime: Runtime | None = None
    stopping: bool = False
    stop_reason: str = ""
    pools: dict[str, EnvPool] = field(default_factory=dict)
    welcome: Welcome | None = None
    target: PolicyAnnouncement | None = None
    pulled_version: int = -1
    _ctx: zmq.Context | None = None
    _running: dict[str, trio.CancelScope] = field(default_factory=dict)
    _changed: trio.Event = field(default_factory=trio.Event)

    # ------------------------------------------------------------------ top level
    async def run(self) -> int:
        """Run until a graceful stop; returns the process exit code (0)."""
        self._ctx = zmq.Context()
        try:
            async with trio.open_nursery() as top:
                top.start_soon(self._signals, name="signals")
                await self._sessions()
                top.cancel_scope.cancel()
        finally:
            await self._cleanup()
        log.info("actor %s stopped (%s): %s", self.actor_id, self.stop_reason or "done", self.stats)
        return 0

    def request_stop(self, reason: str, *, abandon: bool = False) -> None:
        """Start a graceful stop; ``abandon`` cancels running groups at once (the run is over)."""
        if not self.stopping:
            log.info("actor %s stopping: %s", self.actor_id, reason)
        self.stopping = True
        self.stop_reason = self.stop_reason or reason
        if abandon:
            for scope in self._running.values():
                scope.cancel()
        self._poke()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for sig in sigs:
                self.request_stop(signal.Signals(sig).name.lower())

    async def _cleanup(self) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5):
                for pool in self.pools.values():
                    await pool.close()
        if self.runtime is not None:
            self.runtime.engine.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _sessions(self) -> None:
        backoff = 0.2
        while not self.stopping:
            lost: BaseException | None = None
            sessions = self.stats.sessions
            try:
                await self._session()
            except* LearnerLost as eg:
                lost = eg.exceptions[0]
            if lost is None or self.stopping:
                return  # graceful end
            if self.stats.sessions > sessions:
                backoff = 0.2  # it was registered: start the backoff afresh
            log.warning("learner lost (%s); reconnecting in %.1fs", lost, backoff)
            with trio.move_on_after(backoff):
                while not self.stopping:
                    await self._changed.wait()
            backoff = min(backoff * 2, self.cfg.reconnect_max_backoff_s)

    # ------------------------------------------------------------------ one session
    async def _session(self) -> None:
        assert self._ctx is not None
        control = AsyncSocket(configure(self._ctx.socket(zmq.DEALER)))
        control.sock.connect(f"tcp://{self.cfg.learner_host}:{self.cfg.learner_port}")
        req = Requester(control)
        sub = weights = None
        try:
            welcome = await self._hello(req)
            self.stats.sessions += 1
            await self._adopt(welcome)
            pub_ep = _swap_host(welcome.pub_endpoint, self.cfg.learner_host)
            w_ep = _swap_host(welcome.weights_endpoint, self.cfg.learner_host)
            sub = AsyncSocket(configure(self._ctx.socket(zmq.SUB)))
            sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
            sub.sock.connect(pub_ep)
            weights = AsyncSocket(configure(self._ctx.socket(zmq.DEALER)))
            weights.sock.connect(w_ep)
            try:
                with trio.fail_after(max(30.0, self.cfg.request_timeout_s)):
                    await self._pull(weights, welcome.policy)  # current weights before the first lease
            except (trio.TooSlowError, TurnscaleError) as exc:
                raise LearnerLost(f"initial weight pull failed: {exc}") from None
            async with trio.open_nursery() as n:
                n.start_soon(self._announcements, sub, name="announcements")
                n.start_soon(self._weights, weights, name="weights")
                n.start_soon(self._heartbeat, req, name="heartbeat")
                await self._lease_loop(req, n)
                await self._goodbye(req)
                n.cancel_scope.cancel()
        finally:
            for s in (control, sub, weights):
                if s is not None:
                    s.close()

    async def _hello(self, req: Requester) -> Welcome:
        hello = Hello(actor_id=self.actor_id, host=pysocket.gethostname(), pid=os.getpid(), engine=self.engine_name,
                      device=self.device, max_groups=self.cfg.max_groups)
        backoff = 0.2
        while True:
            try:
                w = await self._request(req, hello, Welcome)
                log.info("registered with learner run %s (version %d)", w.run_id, w.policy.version)
                return w
            except (LearnerLost, RemoteError) as exc:
                if self.stopping:
                    raise LearnerLost("stopping before registration") from None
                log.info("no Welcome yet (%s); retrying in %.1fs", exc, backoff)
                with trio.move_on_after(backoff):
                    while not self.stopping:
                        await self._changed.wait()
                backoff = min(backoff * 2, self.cfg.reconnect_max_backoff_s)

    async def _adopt(self, welcome: Welcome) -> None:
        new_run = self.welcome is not None and self.welcome.run_id != welcome.run_id
        self.welcome = welcome
        if self.runtime is None:
            self.runtime = await self.deps.make_runtime(welcome)
        if new_run:
            self.pulled_version = -1  # another run's versions mean other weights
        for ep in welcome.envs:
            if ep.name not in self.pools:
                url = self.cfg.env_url or ep.url
                self.pools[ep.name] = EnvPool(self.deps.make_env_client(url, ep.flavor))
        self.target = welcome.policy

    async def _request(self, req: Requester, msg: Any, expect: type) -> Any:
        """One control request; ``LearnerLost`` on timeout/transport failure or ``not_registered``."""
        timeout = self.cfg.request_timeout_s
        try:
            # the deadline covers the send too: a DEALER whose peer is gone blocks on send
            with trio.move_on_after(timeout + 0.5) as scope:
                reply = await req.request(msg, timeout_s=timeout)
            if scope.cancelled_caught:
                raise PeerTimeout(f"no reply to {type(msg).__name__} within {timeout:.1f}s")
        except (PeerTimeout, TransportError) as exc:
            raise LearnerLost(str(exc)) from None
        except RemoteError as exc:
            reply = ErrorReply(code=exc.code, message=exc.message, retryable=exc.retryable)
        except ProtocolError as exc:
            raise LearnerLost(f"unreadable reply: {exc}") from None
        if isinstance(reply, ErrorReply):
            if reply.code == "not_registered":
                raise LearnerLost(f"learner forgot this actor: {reply.message}")
            raise RemoteError(reply.code, reply.message, reply.retryable)
        if not isinstance(reply, expect):
            raise LearnerLost(f"expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    # ------------------------------------------------------------------ leases
    async def _lease_loop(self, req: Requester, n: trio.Nursery) -> None:
        grace_deadline: float | None = None
        while True:
            if self.stopping:
                if not self._running:
                    return
                if grace_deadline is None:
                    grace_deadline = trio.current_time() + self.cfg.shutdown_grace_s
                if trio.current_time() >= grace_deadline:
                    for lid, scope in list(self._running.items()):
                        log.info("abandoning lease %s at shutdown", lid)
                        self.stats.groups_abandoned += 1
                        scope.cancel()
                    return
                with trio.move_on_at(grace_deadline):
                    await self._changed.wait()
                continue
            free = self.cfg.max_groups - len(self._running)
            if free <= 0:
                await self._changed.wait()
                continue
            try:
                grant = await self._request(req, LeaseRequest(actor_id=self.actor_id, max_leases=free), LeaseGrant)
            except RemoteError as exc:
                log.warning("lease request refused: %s", exc)
                grant = LeaseGrant(leases=[], retry_after_s=1.0)
            for lease in grant.leases:
                self.stats.leases_received += 1
                scope = trio.CancelScope()
                self._running[lease.lease_id] = scope
                n.start_soon(self._run_lease, req, lease, scope, name=f"lease:{lease.lease_id}")
            if len(grant.leases) < free:
                with trio.move_on_after(max(0.05, grant.retry_after_s)):
                    await self._changed.wait()

    async def _run_lease(self, req: Requester, lease: Lease, scope: trio.CancelScope) -> None:
        assert self.runtime is not None
        try:
            with scope:
                await self._wait_for_version(lease.policy_version)
                group = await self._play(lease)
                ack = await self._request(req, group, GroupAck)
                self.stats.groups_sent += 1
                self.stats.groups_accepted += int(ack.accepted)
                if not ack.accepted:
                    log.info("group %s dropped by the learner: %s", lease.lease_id, ack.reason)
        except RemoteError as exc:
            log.warning("group %s refused: %s", lease.lease_id, exc)
        finally:
            self._running.pop(lease.lease_id, None)
            self._poke()

    async def _play(self, lease: Lease) -> TrajectoryGroup:
        """Play the lease's group; a crash of the runner or the env pool becomes a failed
        group (the learner re-issues its task) instead of killing the actor."""
        assert self.runtime is not None
        pool = self.pools.get(lease.task.env)
        if pool is None:
            return self._failed(lease, f"this actor has no env server for {lease.task.env!r}")
        try:
            sessions = await pool.acquire(lease.group_size)
        except Exception as exc:
            return self._failed(lease, f"env instances unavailable: {type(exc).__name__}: {exc}")
        try:
            group = await self.runtime.play_group(lease, sessions)
        except Exception as exc:
            log.exception("group %s crashed", lease.lease_id)
            for s_ in sessions:
                s_.broken = True
            return self._failed(lease, f"{type(exc).__name__}: {exc}")
        finally:
            with trio.CancelScope(shield=True):
                await pool.release(sessions)
        cat = next((s.category for s in sessions if s.category), "")
        if cat:
            group = replace(group, episodes=[e if e.category else replace(e, category=cat) for e in group.episodes])
        return group

    def _failed(self, lease: Lease, error: str) -> TrajectoryGroup:
        return TrajectoryGroup(lease_id=lease.lease_id, actor_id=self.actor_id, task=lease.task,
                               turn_limit=lease.turn_limit, episodes=[], failed=True, error=error[:2000])

    async def _wait_for_version(self, version: int) -> None:
        """A lease issued under a newer policy waits until the engine holds it."""
        assert self.runtime is not None
        while self.runtime.engine.version < version:
            with trio.move_on_after(0.05):
                await self._changed.wait()

    # ------------------------------------------------------------------ background
    async def _heartbeat(self, req: Requester) -> None:
        assert self.welcome is not None
        while True:
            await trio.sleep(self.welcome.heartbeat_interval_s)
            assert self.runtime is not None
            stats = {**self.runtime.engine.stats(), **{k: float(v) for k, v in vars(self.stats).items()}}
            for pool in self.pools.values():
                stats.update(pool.stats())
            numeric = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            hb = Heartbeat(actor_id=self.actor_id, lease_ids=sorted(self._running), policy_version=self.runtime.engine.version,
                           stats=numeric)
            ack = await self._request(req, hb, HeartbeatAck)
            for lid in ack.unknown_lease_ids:
                scope = self._running.get(lid)
                if scope is not None:
                    log.info("learner no longer holds lease %s; abandoning it", lid)
                    self.stats.groups_abandoned += 1
                    scope.cancel()

    async def _announcements(self, sub: AsyncSocket) -> None:
        while True:
            try:
                msg = await sub.recv_msg(expect=(PolicyAnnouncement, Shutdown))
            except ProtocolError as exc:
                log.warning("bad announcement: %s", exc)
                continue
            if isinstance(msg, Shutdown):
                self.request_stop(f"learner shutdown: {msg.reason}", abandon=True)
            elif self.target is None or (msg.version, msg.step) > (self.target.version, self.target.step):
                self.target = msg
                self._poke()

    async def _weights(self, sock: AsyncSocket) -> None:
        while True:
            t = self.target
            if t is not None and t.manifest is not None and t.version > self.pulled_version:
                try:
                    await self._pull(sock, t)
                except TurnscaleError as exc:  # transport, checksum, protocol, engine errors
                    log.warning("weight pull of version %d failed (%s); retrying", t.version, exc)
                    await trio.sleep(0.5)
                continue
            await self._changed.wait()

    async def _pull(self, sock: AsyncSocket, policy: PolicyAnnouncement) -> None:
        assert self.runtime is not None
        if policy.manifest is None or policy.version <= self.pulled_version:
            return
        t0 = time.monotonic()
        tensors = await self.deps.pull(sock, policy.manifest, max(30.0, self.cfg.request_timeout_s))
        self.runtime.engine.load_weights(policy.version, tensors)
        self.pulled_version = policy.version
        self.stats.weight_pulls += 1
        self.stats.weight_pull_s += time.monotonic() - t0
        log.info("pulled weights version %d in %.2fs", policy.version, time.monotonic() - t0)
        self._poke()

    async def _goodbye(self, req: Requester) -> None:
        with trio.move_on_after(min(5.0, self.cfg.request_timeout_s)):
            try:
                await self._request(req, Goodbye(actor_id=self.actor_id, reason=self.stop_reason or "done"), GroupAck)
            except (LearnerLost, RemoteError) as exc:
                log.info("goodbye not acknowledged: %s", exc)
