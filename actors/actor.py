"""The actor process: register with the learner, pull weights, play leased groups, repeat.

Supervision.  ``Actor.run`` owns one trio nursery per *session* (one Hello -> Welcome
connection to the learner) with these named tasks:

- ``leases``: asks for up to ``max_groups - running`` leases; each lease runs as its own
  task (``lease:<id>``): wait until the engine holds the lease's policy version, take
  ``group_size`` env sessions from the pool, play the group (episodes concurrently),
  send it and wait for its ``GroupAck``;
- ``heartbeat``: every ``heartbeat_interval_s`` names the live leases; leases the learner
  no longer holds are cancelled (abandoned); it starts before the session's first pull, so
  a long first pull does not make the learner forget the actor;
- ``announcements``: SUB to the learner's PUB; a newer ``PolicyAnnouncement`` becomes the
  weight target, ``Shutdown`` starts a graceful stop (a ``Shutdown`` *reply* to a
  ``Hello``, ``LeaseRequest`` or ``Heartbeat`` does the same: PUB is lossy and a
  reconnecting actor is not subscribed);
- ``weights``: pulls the target version's chunks in the background (own DEALER to the
  weights endpoint) and hands them to ``engine.load_weights`` (the engine swaps at its
  safe point, ``engine.update_mode``), then awaits the swap's outcome;
- ``signals`` (process-wide, outside the sessions): SIGTERM/SIGINT start a graceful stop.

Weights.  The weight path (``actors/weight_path.py``, ``Actor.weight_path``) owns *how*
weights are pulled (relays, learner, same-host segment), applied and verified, and is the
only writer of ``applied``; its docstring states the ordering contract (*target -> pulled ->
applied*) and what a failure leaves behind.  This module decides *when*: ``target`` is
written by the session's ``Welcome`` (``_adopt``, before the session's tasks start) and
then only by the ``announcements`` task; the session's first pull (before its tasks start)
and then the ``weights`` task pull ``target`` whenever the weight path ``needs`` it; on
``EngineBroken`` the actor rebuilds the engine and the weights task pulls again.

Readers compare incarnations: a lease starts playing only when ``applied`` is the current
Welcome's incarnation's and at least the lease's version, and the weights task pulls
whenever ``applied`` is another incarnation's.  So a Welcome from another learner
incarnation (a restarted or resumed learner) makes the held weights count for nothing
without anyone else writing ``applied``: they are pulled anew, even when the version
number is the same or lower.

Lost learner.  A control request that times out (``PeerTimeout``) or a
``not_registered`` answer ends the session: its nursery is cancelled (running groups
are dropped; the learner re-issues their leases when they expire), then the actor
re-sends Hello with capped exponential backoff (``reconnect_max_backoff_s``) until the
learner answers.  Engine and env instances survive across sessions.

Graceful stop (SIGTERM/SIGINT or ``Shutdown``), bounded by ``shutdown_grace_s +
2 * stop_timeout_s`` whatever else is alive:

1. no new leases are requested; every control request from now on, and every one already
   waiting for its reply, gets at most ``stop_timeout_s`` (``request_stop`` pulls in the
   deadlines of those in flight);
2. running groups finish and are sent; any still running after ``shutdown_grace_s``
   are cancelled (abandoned); a request that times out now means the learner is gone:
   the session ends at once (no ``Goodbye``; the learner, if it comes back, lets the
   leases expire);
3. ``Goodbye`` is sent (the learner releases any remaining leases at once);
4. the session's tasks are cancelled, env instances closed on the server (for at most
   ``stop_timeout_s``), the engine closed, sockets closed; ``run`` returns 0.

CURVE (``curve``, from ``common.curve.actor_curve``): the three sockets to the learner
use the actor's key pair and the learner's public key.  A monitor on the control socket
(``handshakes``, for the whole session) watches every handshake: the learner refusing
this actor's key (ZAP: not in ``learner.curve.authorized``) or CURVE on one side only
(ZeroMQ's mechanism mismatch) ends the actor at once, and
``actor.curve.max_handshake_failures`` failed handshakes in a row with no success between
(a wrong ``actor.curve.server_key``) end it too; ``run`` then logs the reason and returns
``EXIT_CURVE_REFUSED`` (3) instead of retrying forever in silence (ZeroMQ does not tell a
client why its handshake failed, and a refused client gets no reply at all).

Everything heavy (engine, weight pull, episode runner, env clients) is injected through
``ActorDeps`` so unit tests drive the same loop with fakes; ``actors.main`` wires the
real ones.
"""

from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio
import zmq

from turnscale.actors.engine import EngineBroken
from turnscale.actors.envpool import EnvClientLike, EnvPool, PooledSession
from turnscale.actors.weight_path import EngineLike, PullFn, WeightPath
from turnscale.conf.schema import ActorConfig
from turnscale.protocol.errors import PeerTimeout, ProtocolError, RemoteError, TransportError, TurnscaleError
from turnscale.protocol.messages import (
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
    Welcome,
)
from turnscale.protocol.transport import AsyncSocket, CurveKeys, Requester, configure

if TYPE_CHECKING:
    from turnscale.common.curve import CurveSetup

log = logging.getLogger("turnscale.actor")

EXIT_CURVE_REFUSED = 3
"""``Actor.run``'s exit code when the learner refuses this actor's CURVE handshake."""
EXIT_LEARNER_GONE = 4
"""``Actor.run``'s exit code after ``actor.learner_lost_timeout_s`` without a learner."""


PlayGroupFn = Callable[[Lease, list[PooledSession]], Awaitable[TrajectoryGroup]]
"""Plays one lease's episodes on the given sessions (one per episode) -> the group."""


@dataclass
class ActorDeps:
    """The heavy parts, built once per process (``make_runtime`` after the first Welcome)."""

    make_runtime: Callable[[Welcome], Awaitable["Runtime"]]
    pull: PullFn
    make_env_client: Callable[[str, str], EnvClientLike]
    """``(url, flavor) -> client``; the flavor is the learner's ``EnvEndpoint.flavor``."""
    new_buffer: Callable[[], Any] = lambda: None
    """A receive buffer for ``pull`` (the actor makes two); None lets ``pull`` allocate."""
    relay: Any = None
    """This actor's ``RelayServer`` (``actors/relay.py``; serves its verified chunks to other
    actors, advertised in ``Hello.relay_endpoint``), or None.  Closed with the actor."""


@dataclass
class Runtime:
    """What a Welcome lets the actor build: the engine and a group player bound to it."""

    engine: EngineLike
    play_group: PlayGroupFn


class LearnerLost(Exception):
    """The learner stopped answering (or forgot us): end the session and reconnect."""


class CurveRefused(Exception):
    """The learner refused this actor's CURVE handshake (the message says why and what to fix)."""


class LearnerGone(Exception):
    """No learner answered for ``actor.learner_lost_timeout_s``: the actor gives up."""


class LearnerStopped(LearnerLost):
    """The learner answered ``Shutdown``: the run is over (a graceful stop has begun)."""


@dataclass
class ActorStats:
    groups_sent: int = 0
    groups_accepted: int = 0
    groups_abandoned: int = 0
    groups_resent: int = 0
    """Groups sent again after a retryable refusal (the learner busy with large messages)."""
    leases_received: int = 0
    sessions: int = 0
    weight_pulls: int = 0
    weight_pull_s: float = 0.0
    weight_failures: int = 0
    engine_rebuilds: int = 0
    torn_weights: int = 0
    """Swaps after which the engine's weights did not checksum to the pulled bytes."""
    weight_chunks_from_relays: int = 0
    weight_chunks_from_learner: int = 0
    weight_relay_fallbacks: int = 0
    """Chunks a relay failed (dead, slow, refusing, corrupt) that were fetched elsewhere."""
    weight_chunks_from_shm: int = 0
    """Chunks copied from the learner's shared-memory segment (actor on the learner's host)."""


_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in eg.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


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
    curve: CurveSetup | None = None
    """CURVE keys for the sockets to the learner (``common.curve.actor_curve``); None: plain TCP."""
    _ctx: zmq.Context | None = None
    _running: dict[str, trio.CancelScope] = field(default_factory=dict)
    _changed: trio.Event = field(default_factory=trio.Event)
    _token: str = field(default_factory=lambda: os.urandom(8).hex())
    """This process's ``Hello.token`` (keeps its actor id across reconnects)."""
    _requests: set[trio.CancelScope] = field(default_factory=set)
    """Deadlines of the control requests waiting for a reply (``request_stop`` shortens them)."""
    _lost_since: float = 0.0
    """trio time since which no session is registered (``_give_up_without_learner``)."""
    weight_path: WeightPath = field(init=False)
    """Pulls, applies and verifies weights; the only writer of ``applied`` (``actors/weight_path.py``)."""

    def __post_init__(self) -> None:
        self.weight_path = WeightPath(cfg=self.cfg, deps=self.deps, stats=self.stats, on_applied=self._poke)

    @property
    def applied(self) -> tuple[str, int] | None:
        """``(incarnation, version)`` of the weights the engine has applied (``WeightPath.applied``)."""
        return self.weight_path.applied

    # ------------------------------------------------------------------ top level
    async def run(self) -> int:
        """Run until a graceful stop; returns the process exit code (0, ``EXIT_CURVE_REFUSED``
        when the learner refused the CURVE handshake, or ``EXIT_LEARNER_GONE`` after
        ``learner_lost_timeout_s`` without a learner)."""
        self._ctx = zmq.Context()
        code = 0
        try:
            async with trio.open_nursery() as top:
                top.start_soon(self._signals, name="signals")
                await self._sessions()
                top.cancel_scope.cancel()
        except* CurveRefused as eg:
            self.stop_reason = "CURVE refused"
            log.error("%s", eg.exceptions[0])
            code = EXIT_CURVE_REFUSED
        except* LearnerGone as eg:
            self.stop_reason = "no learner"
            log.error("%s", eg.exceptions[0])
            code = EXIT_LEARNER_GONE
        finally:
            await self._cleanup()
        log.info("actor %s stopped (%s): %s", self.actor_id, self.stop_reason or "done", self.stats)
        return code

    def request_stop(self, reason: str, *, abandon: bool = False) -> None:
        """Start a graceful stop; ``abandon`` cancels running groups at once (the run is over)."""
        if not self.stopping:
            log.info("actor %s stopping: %s", self.actor_id, reason)
        self.stopping = True
        self.stop_reason = self.stop_reason or reason
        cap = trio.current_time() + self.cfg.stop_timeout_s
        for scope in self._requests:
            scope.deadline = min(scope.deadline, cap)
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
            with trio.move_on_after(self.cfg.stop_timeout_s):  # one bound for every pool
                for pool in self.pools.values():
                    await pool.close(self.cfg.stop_timeout_s)
        if self.runtime is not None:
            self.runtime.engine.close()
        if self.deps.relay is not None:
            self.deps.relay.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _sessions(self) -> None:
        """Sessions until a graceful end, reconnecting with capped backoff; ``LearnerGone``
        after ``learner_lost_timeout_s`` without a registered session (counted from the start,
        or from the moment the last registered session was lost)."""
        backoff = 0.2
        self._lost_since = trio.current_time()
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
                self._lost_since = trio.current_time()
            self._give_up_without_learner(lost)
            log.warning("learner lost (%s); reconnecting in %.1fs", lost, backoff)
            with trio.move_on_after(backoff):
                while not self.stopping:
                    await self._changed.wait()
            backoff = min(backoff * 2, self.cfg.reconnect_max_backoff_s)

    def _give_up_without_learner(self, last: BaseException) -> None:
        """``LearnerGone`` once ``learner_lost_timeout_s`` passed since ``_lost_since`` (the
        start, or the loss of the last registered session) with no registration since."""
        limit = self.cfg.learner_lost_timeout_s
        if limit > 0 and trio.current_time() - self._lost_since >= limit:
            raise LearnerGone(f"no learner at {self.cfg.learner_host}:{self.cfg.learner_port} for {limit:.0f}s "
                              f"(last: {last}); giving up (actor.learner_lost_timeout_s; 0 never gives up)")

    # ------------------------------------------------------------------ one session
    def _keys(self) -> CurveKeys | None:
        return self.curve.client() if self.curve is not None else None

    async def _session(self) -> None:
        assert self._ctx is not None
        control = AsyncSocket(configure(self._ctx.socket(zmq.DEALER), curve=self._keys()))
        monitor = AsyncSocket(control.sock.get_monitor_socket(_HANDSHAKE_EVENTS))
        try:
            async with trio.open_nursery() as guard:
                guard.start_soon(self._handshakes, monitor, name="handshakes")
                await self._session_on(control)
                guard.cancel_scope.cancel()
        except BaseExceptionGroup as eg:  # one failure (LearnerLost, CurveRefused): raise it as itself
            leaves = _leaves(eg)
            if len(leaves) == 1:
                raise leaves[0] from None
            raise
        finally:
            try:
                control.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close()
            control.close()

    async def _handshakes(self, monitor: AsyncSocket) -> None:
        """Watch the control socket's handshakes (see the module docstring, CURVE)."""
        from zmq.utils.monitor import parse_monitor_message

        where = f"{self.cfg.learner_host}:{self.cfg.learner_port}"
        failures = 0
        while True:
            frames = await monitor.recv_multipart(copy=True)
            try:
                ev = parse_monitor_message(frames)
            except Exception:  # a malformed monitor message: not ours to judge
                continue
            event = ev["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                failures = 0
                continue
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                c = self.curve
                pub = c.public.decode() if c is not None else "?"
                raise CurveRefused(
                    f"the learner at {where} refused this actor's CURVE key (actor.curve.secret_key={c.secret_path if c else ''}, "
                    f"public key {pub}, ZAP status {ev.get('value')}): add its public key to the learner's "
                    f"learner.curve.authorized folder")
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and ev.get("value") == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                raise CurveRefused(  # deterministic, and ZeroMQ does not try again
                    f"the learner at {where} does not speak CURVE (learner.curve.enabled=false?) while this actor does "
                    f"(actor.curve.enabled={self.cfg.curve.enabled})" if self.curve is not None else
                    f"the learner at {where} requires CURVE and this actor has it off: set actor.curve.server_key and "
                    f"actor.curve.secret_key (keys from `turnscale keys DIR`) and actor.curve.enabled=true")
            failures += 1
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                why = f"handshake with the learner at {where} failed (ZMTP protocol error {ev.get('value')})"
            elif self.curve is None:
                why = (f"handshake with the learner at {where} failed: it probably requires CURVE; set actor.curve.server_key "
                       f"and actor.curve.secret_key (keys from `turnscale keys DIR`) and actor.curve.enabled=true")
            else:
                why = (f"CURVE handshake with the learner at {where} failed: actor.curve.server_key="
                       f"{self.curve.server_key_path if self.curve else ''} is probably not this learner's public key "
                       f"(DIR/learner.key of the learner's `turnscale keys`)")
            log.warning("%s (handshake failure %d of %d)", why, failures, self.cfg.curve.max_handshake_failures)
            if failures >= self.cfg.curve.max_handshake_failures:
                raise CurveRefused(f"{why}; giving up after {failures} failed handshakes")

    async def _session_on(self, control: AsyncSocket) -> None:
        assert self._ctx is not None
        control.sock.connect(f"tcp://{self.cfg.learner_host}:{self.cfg.learner_port}")
        req = Requester(control)
        sub = weights = None
        try:
            welcome = await self._hello(req)
            self.stats.sessions += 1
            await self._adopt(welcome)
            pub_ep = _swap_host(welcome.pub_endpoint, self.cfg.learner_host)
            w_ep = _swap_host(welcome.weights_endpoint, self.cfg.learner_host)
            sub = AsyncSocket(configure(self._ctx.socket(zmq.SUB), curve=self._keys()))
            sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
            sub.sock.connect(pub_ep)
            weights = AsyncSocket(configure(self._ctx.socket(zmq.DEALER), curve=self._keys()))
            weights.sock.connect(w_ep)
            self.weight_path.open_session(self._ctx, self.curve)
            async with trio.open_nursery() as n:
                # heartbeats first: a first pull longer than the learner's actor timeout (big
                # weights, a slow link) must not make the learner forget this actor
                n.start_soon(self._heartbeat, req, name="heartbeat")
                try:
                    with trio.fail_after(max(30.0, self.cfg.request_timeout_s)):
                        await self._first_pull(weights, sub)  # current weights before the first lease
                except (trio.TooSlowError, TurnscaleError) as exc:
                    raise LearnerLost(f"initial weight pull failed: {exc}") from None
                n.start_soon(self._announcements, sub, name="announcements")
                n.start_soon(self._weights, weights, name="weights")
                await self._lease_loop(req, n)
                await self._goodbye(req)
                n.cancel_scope.cancel()
        finally:
            for s in (sub, weights):
                if s is not None:
                    s.close()
            self.weight_path.close_session()

    async def _hello(self, req: Requester) -> Welcome:
        relay = self.deps.relay
        hello = Hello(actor_id=self.actor_id, host=pysocket.gethostname(), pid=os.getpid(), engine=self.engine_name,
                      device=self.device, max_groups=self.cfg.max_groups, token=self._token,
                      relay_endpoint=relay.endpoint if relay is not None else "",
                      relay_public_key=getattr(relay, "public_key", "") if relay is not None else "",
                      pool=self.cfg.pool)
        backoff = 0.2
        while True:
            try:
                w = await self._request(req, hello, Welcome)
                log.info("registered with learner run %s (version %d)", w.run_id, w.policy.version)
                return w
            except (LearnerLost, RemoteError) as exc:
                if self.stopping:
                    raise LearnerLost("stopping before registration") from None
                self._give_up_without_learner(exc)
                log.info("no Welcome yet (%s); retrying in %.1fs", exc, backoff)
                with trio.move_on_after(backoff):
                    while not self.stopping:
                        await self._changed.wait()
                backoff = min(backoff * 2, self.cfg.reconnect_max_backoff_s)

    async def _adopt(self, welcome: Welcome) -> None:
        self.welcome = welcome
        if self.runtime is None:
            self.runtime = await self.deps.make_runtime(welcome)
        if self.applied is not None and self.applied[0] != welcome.policy.incarnation:
            # another learner process: its version numbers name other weights.  ``applied`` is
            # the weight path's to write; holds/needs compare incarnations, so these no
            # longer count and are pulled anew (module docstring, "Weights").
            log.info("learner incarnation changed (%s -> %s): dropping weights v%d", self.applied[0],
                     welcome.policy.incarnation, self.applied[1])
        for ep in welcome.envs:
            if ep.name not in self.pools:
                url = self.cfg.env_url or ep.url
                self.pools[ep.name] = EnvPool(self.deps.make_env_client(url, ep.flavor))
        self.target = welcome.policy
        self.weight_path.set_sources(welcome.weight_sources, welcome.weight_source_keys, welcome.relay_clients)

    async def _request(self, req: Requester, msg: Any, expect: type) -> Any:
        """One control request; ``LearnerLost`` on timeout/transport failure or ``not_registered``."""
        timeout = min(self.cfg.request_timeout_s, self.cfg.stop_timeout_s) if self.stopping else self.cfg.request_timeout_s
        try:
            # the deadline covers the send too: a DEALER whose peer is gone blocks on send;
            # a stop pulls it in (``request_stop``), the transport's own timeout stays the outer bound
            with trio.move_on_after(timeout + 0.5) as scope:
                self._requests.add(scope)
                try:
                    reply = await req.request(msg, timeout_s=timeout)
                finally:
                    self._requests.discard(scope)
            if scope.cancelled_caught:
                raise PeerTimeout(f"no reply to {type(msg).__name__} in time"
                                  + (" (stopping)" if self.stopping else f" ({timeout:.1f}s)"))
        except (PeerTimeout, TransportError) as exc:
            raise LearnerLost(str(exc)) from None
        except RemoteError as exc:
            reply = ErrorReply(code=exc.code, message=exc.message, retryable=exc.retryable)
        except ProtocolError as exc:
            raise LearnerLost(f"unreadable reply: {exc}") from None
        if isinstance(reply, Shutdown):
            self.request_stop(f"learner shutdown: {reply.reason}", abandon=True)
            raise LearnerStopped(f"learner shut down ({reply.reason})")
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
            except LearnerStopped:
                continue  # stopping now: finish (nothing runs at abandon) and say goodbye
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
                ack = await self._send_group(req, lease, group)
                self.stats.groups_sent += 1
                self.stats.groups_accepted += int(ack.accepted)
                if not ack.accepted:
                    log.info("group %s dropped by the learner: %s", lease.lease_id, ack.reason)
        except RemoteError as exc:
            log.warning("group %s refused: %s", lease.lease_id, exc)
        finally:
            self._running.pop(lease.lease_id, None)
            self._poke()

    async def _send_group(self, req: Requester, lease: Lease, group: TrajectoryGroup) -> GroupAck:
        """Hand a finished group to the learner.  A retryable refusal (``busy``: the learner's
        queue of large messages is full while another client floods it) is retried with
        capped backoff for at most the lease's ``ttl_s``, so a played group is not thrown
        away; any other refusal, or a retryable one past that time, is raised."""
        delay, give_up = 0.1, trio.current_time() + lease.ttl_s
        while True:
            try:
                return await self._request(req, group, GroupAck)
            except RemoteError as exc:
                if not exc.retryable or self.stopping and not self._running or trio.current_time() + delay > give_up:
                    raise
                log.info("group %s not taken yet (%s); sending it again in %.1fs", lease.lease_id, exc.code, delay)
                self.stats.groups_resent += 1
                await trio.sleep(delay)
                delay = min(2.0, 2 * delay)

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

    def _holds(self, version: int) -> bool:
        """The engine has applied this learner incarnation's weights, version >= ``version``."""
        assert self.welcome is not None
        return self.weight_path.holds(self.welcome.policy.incarnation, version)

    async def _wait_for_version(self, version: int) -> None:
        """A lease waits until the engine has applied its version (woken by the swap)."""
        while not self._holds(version):
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
            try:
                ack = await self._request(req, hb, HeartbeatAck)
            except LearnerStopped:
                return  # the lease loop ends the session (goodbye)
            self.weight_path.set_sources(ack.weight_sources, ack.weight_source_keys, ack.relay_clients)
            for lid in ack.unknown_lease_ids:
                scope = self._running.get(lid)
                if scope is not None:
                    log.info("learner no longer holds lease %s; abandoning it", lid)
                    self.stats.groups_abandoned += 1
                    scope.cancel()

    async def _announcements(self, sub: AsyncSocket) -> None:
        while True:
            await self._next_announcement(sub)

    async def _next_announcement(self, sub: AsyncSocket) -> None:
        """Read one message off the learner's PUB: a newer ``PolicyAnnouncement`` of this
        learner incarnation becomes ``target``; ``Shutdown`` starts a graceful stop."""
        try:
            msg = await sub.recv_msg(expect=(PolicyAnnouncement, Shutdown))
        except ProtocolError as exc:
            log.warning("bad announcement: %s", exc)
            return
        if isinstance(msg, Shutdown):
            self.request_stop(f"learner shutdown: {msg.reason}", abandon=True)
        elif self.welcome is None or msg.incarnation != self.welcome.policy.incarnation:
            return  # another learner process (restarted): its Welcome decides, not its PUB
        elif self.target is None or (msg.version, msg.step) > (self.target.version, self.target.step):
            self.target = msg
            self._poke()

    async def _first_pull(self, weights: AsyncSocket, sub: AsyncSocket) -> None:
        """The session's first pull (before its tasks start): the Welcome's version or, when
        the learner retired it before this actor got to pull it (``unknown_version``: versions
        were published meanwhile, e.g. while a large fleet joined), the newest one announced
        on PUB (re-sent every ``announce_every_s``) — without registering again."""
        while True:
            policy = self.target
            assert policy is not None
            try:
                await self._pull(weights, policy)
                return
            except RemoteError as exc:
                if exc.code != "unknown_version":
                    raise
            self.stats.weight_failures += 1
            log.info("weights version %d were retired before this actor pulled them; pulling the newest announced",
                     policy.version)
            while self.target is policy:  # until a newer announcement (the caller's deadline bounds the wait)
                if self.stopping:
                    raise LearnerLost("stopping before the first weights arrived")
                await self._next_announcement(sub)

    async def _weights(self, sock: AsyncSocket) -> None:
        while True:
            t = self.target
            if t is not None and self.weight_path.needs(t):
                try:
                    await self._pull(sock, t)
                except TurnscaleError as exc:  # transport, checksum, protocol, engine errors: pull again
                    self.stats.weight_failures += 1
                    log.warning("weights version %d not applied (%s); pulling again", t.version, exc)
                    await trio.sleep(0.5)
                continue
            await self._changed.wait()

    async def _pull(self, sock: AsyncSocket, policy: PolicyAnnouncement) -> None:
        """Pull ``policy``'s weights and have the engine apply them (``WeightPath.pull``); an
        engine that broke on the swap is rebuilt before the error goes on to the caller."""
        assert self.runtime is not None
        engine = self.runtime.engine
        try:
            await self.weight_path.pull(sock, policy, engine)
        except EngineBroken:
            await self._rebuild_engine(engine)
            raise

    async def _rebuild_engine(self, broken: EngineLike) -> None:
        """The engine lost its weights: close it and build a new one (its leases fail and are re-issued)."""
        assert self.welcome is not None
        log.warning("engine broken; rebuilding it")  # the weight path has cleared ``applied``
        self.stats.engine_rebuilds += 1
        broken.close()
        self.runtime = await self.deps.make_runtime(self.welcome)

    async def _goodbye(self, req: Requester) -> None:
        with trio.move_on_after(min(self.cfg.stop_timeout_s, self.cfg.request_timeout_s) + 0.5):
            try:
                await self._request(req, Goodbye(actor_id=self.actor_id, reason=self.stop_reason or "done"), GroupAck)
            except (LearnerLost, RemoteError) as exc:
                log.info("goodbye not acknowledged: %s", exc)
