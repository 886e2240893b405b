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
  weight target, ``Shutdown`` starts a graceful stop (a ``Shutdown`` *reply* to a
  ``Hello``, ``LeaseRequest`` or ``Heartbeat`` does the same: PUB is lossy and a
  reconnecting actor is not subscribed);
- ``weights``: pulls the target version's chunks in the background (own DEALER to the
  weights endpoint) and hands them to ``engine.load_weights`` (the engine swaps at its
  safe point, ``engine.update_mode``), then awaits the swap's outcome;
- ``signals`` (process-wide, outside the sessions): SIGTERM/SIGINT start a graceful stop.

Weights (ordering contract).  Weights move along one chain, *target -> pulled ->
applied*; each link has exactly one writer and only ever follows the link before it:

1. ``target`` (a ``PolicyAnnouncement``): the weights the learner wants played.  Written
   by the session's ``Welcome`` (``_adopt``, before the session's tasks start) and then
   only by the ``announcements`` task, which moves it forward (a larger ``(version,
   step)``) within the Welcome's incarnation and ignores other incarnations' PUB.
2. *pulled* (a receive buffer and its ``WeightSwap``): written only by ``_pull`` — the
   session's first pull of the Welcome's weights (before its tasks start), then the
   ``weights`` task, which pulls ``target``'s manifest when ``target`` is newer than
   ``applied`` (or from another incarnation).  A pull goes into one of two receive
   buffers, never into one the engine may still read (a buffer is reused only once its
   last ``WeightSwap`` is released).
3. ``applied`` (the ``(incarnation, version)`` of the weights the engine holds): written
   only by ``_pull`` (same callers as *pulled*) from the engine's ``WeightSwap`` outcome:
   set when the engine reports the swap *applied*, never when a pull finishes or a swap
   is merely queued; cleared when the swapped weights do not checksum to the pulled
   bytes or the engine broke (``EngineBroken`` rebuilds the engine).  A failed swap
   leaves it as it was and the weights task pulls again.

Relays (``ActorDeps.relay``, ``actors/relay.py``; docs/architecture.md "Weight fan-out").
The actor's ``RelayServer`` serves other actors the chunks it holds, read-only, from the
same two receive buffers: ``_pull`` registers the free buffer for the new version
(``begin``) before the pull writes a byte into it, which withdraws the version it held
at that moment, and marks each chunk once verified (``on_chunk``), so a relay serves
version v only from a buffer holding v that no pull is writing into, and only verified
chunks.  The pull asks the relays the learner named (``sources``, from ``Welcome`` and
``HeartbeatAck``) before the learner and checks every chunk whatever its source
(``actors/weight_sync.py``): a dead, slow or corrupt relay costs a retry elsewhere,
never a torn or wrong version in the chain above.

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
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import trio
import zmq

from turnscale.actors.engine import EngineBroken, EngineError, WeightSwap
from turnscale.actors.envpool import EnvClientLike, EnvPool, PooledSession
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
    WeightManifest,
    Welcome,
)
from turnscale.protocol.transport import AsyncSocket, CurveKeys, Requester, configure, generate_curve_keys

if TYPE_CHECKING:
    from turnscale.common.curve import CurveSetup

log = logging.getLogger("turnscale.actor")

EXIT_CURVE_REFUSED = 3
"""``Actor.run``'s exit code when the learner refuses this actor's CURVE handshake."""


class EngineLike(Protocol):
    @property
    def version(self) -> int: ...

    def load_weights(self, version: int, tensors: Any) -> WeightSwap: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


PullFn = Callable[..., Awaitable[Any]]
"""``pull(weights_sock, manifest, timeout_s, buffer, **relay) -> named tensors`` (checksums
verified), received into ``buffer`` (one of ``ActorDeps.new_buffer()``'s, free for this
pull).  ``relay`` (only when this actor has relays to ask or serves one): ``relays`` (sockets
asked before ``weights_sock``, nearest first), ``on_chunk(i)`` (chunk ``i`` verified) and
``report`` (``actors.weight_sync.PullReport``), as ``actors.weight_sync.pull_weights``."""

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
class _BufferSlot:
    """A receive buffer and the last swap it was handed to (it is free once that swap is released)."""

    buffer: Any
    swap: WeightSwap | None = None

    @property
    def free(self) -> bool:
        return self.swap is None or self.swap.released


@dataclass
class Runtime:
    """What a Welcome lets the actor build: the engine and a group player bound to it."""

    engine: EngineLike
    play_group: PlayGroupFn


class LearnerLost(Exception):
    """The learner stopped answering (or forgot us): end the session and reconnect."""


class CurveRefused(Exception):
    """The learner refused this actor's CURVE handshake (the message says why and what to fix)."""


class LearnerStopped(LearnerLost):
    """The learner answered ``Shutdown``: the run is over (a graceful stop has begun)."""


@dataclass
class ActorStats:
    groups_sent: int = 0
    groups_accepted: int = 0
    groups_abandoned: int = 0
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
    applied: tuple[str, int] | None = None
    """``(incarnation, version)`` of the weights the engine has applied; written only by the
    weight path (``_pull``; see the module docstring, "Weights")."""
    curve: CurveSetup | None = None
    """CURVE keys for the sockets to the learner (``common.curve.actor_curve``); None: plain TCP."""
    _ctx: zmq.Context | None = None
    _running: dict[str, trio.CancelScope] = field(default_factory=dict)
    _changed: trio.Event = field(default_factory=trio.Event)
    _slots: list[_BufferSlot] = field(default_factory=list)
    _token: str = field(default_factory=lambda: os.urandom(8).hex())
    """This process's ``Hello.token`` (keeps its actor id across reconnects)."""
    sources: list[str] = field(default_factory=list)
    """Relays to ask for weight chunks before the learner (``Welcome``/``HeartbeatAck.weight_sources``)."""
    source_keys: dict[str, str] = field(default_factory=dict)
    """CURVE public key of each of ``sources`` ("" or absent: a plain relay)."""
    _relay_socks: dict[tuple[str, str], AsyncSocket] = field(default_factory=dict)
    """This session's DEALERs to ``sources``, by (endpoint, key) (closed with the session)."""
    _requests: set[trio.CancelScope] = field(default_factory=set)
    """Deadlines of the control requests waiting for a reply (``request_stop`` shortens them)."""

    # ------------------------------------------------------------------ top level
    async def run(self) -> int:
        """Run until a graceful stop; returns the process exit code (0, or
        ``EXIT_CURVE_REFUSED`` when the learner refused the CURVE handshake)."""
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
            for s in (sub, weights, *self._relay_socks.values()):
                if s is not None:
                    s.close()
            self._relay_socks.clear()

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
            # the weight path's to write; _holds/_needs compare incarnations, so these no
            # longer count and are pulled anew (module docstring, "Weights").
            log.info("learner incarnation changed (%s -> %s): dropping weights v%d", self.applied[0],
                     welcome.policy.incarnation, self.applied[1])
        for ep in welcome.envs:
            if ep.name not in self.pools:
                url = self.cfg.env_url or ep.url
                self.pools[ep.name] = EnvPool(self.deps.make_env_client(url, ep.flavor))
        self.target = welcome.policy
        self._set_sources(welcome.weight_sources, welcome.weight_source_keys, welcome.relay_clients)

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

    def _holds(self, version: int) -> bool:
        """The engine has applied this learner incarnation's weights, version >= ``version``."""
        assert self.welcome is not None
        a = self.applied
        return a is not None and a[0] == self.welcome.policy.incarnation and a[1] >= version

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
            self._set_sources(ack.weight_sources, ack.weight_source_keys, ack.relay_clients)
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
            elif self.welcome is None or msg.incarnation != self.welcome.policy.incarnation:
                continue  # another learner process (restarted): its Welcome decides, not its PUB
            elif self.target is None or (msg.version, msg.step) > (self.target.version, self.target.step):
                self.target = msg
                self._poke()

    def _needs(self, policy: PolicyAnnouncement) -> bool:
        """``policy`` has weights and they are newer than (or from another incarnation than) ours."""
        a = self.applied
        return policy.manifest is not None and (a is None or a[0] != policy.incarnation or a[1] < policy.version)

    async def _weights(self, sock: AsyncSocket) -> None:
        while True:
            t = self.target
            if t is not None and self._needs(t):
                try:
                    await self._pull(sock, t)
                except TurnscaleError as exc:  # transport, checksum, protocol, engine errors: pull again
                    self.stats.weight_failures += 1
                    log.warning("weights version %d not applied (%s); pulling again", t.version, exc)
                    await trio.sleep(0.5)
                continue
            await self._changed.wait()

    async def _free_slot(self) -> _BufferSlot:
        """A receive buffer the engine does not hold (waits for a release if both are held)."""
        if not self._slots:
            self._slots = [_BufferSlot(self.deps.new_buffer()) for _ in range(2)]
        while True:
            for slot in self._slots:
                if slot.free:
                    return slot
            assert self._slots[0].swap is not None
            await self._slots[0].swap.wait_released()

    async def _pull(self, sock: AsyncSocket, policy: PolicyAnnouncement) -> None:
        """Pull ``policy``'s weights into a free buffer, hand them to the engine and await the swap."""
        assert self.runtime is not None
        if not self._needs(policy):
            return
        assert policy.manifest is not None
        t0 = time.monotonic()
        slot = await self._free_slot()
        relay, key = self.deps.relay, id(slot)
        kw: dict[str, Any] = {}
        if self.sources:
            kw["relays"] = [self._relay_sock(ep) for ep in self.sources]
        if relay is not None and slot.buffer is not None:
            # before any byte lands in the buffer: its old version is withdrawn from the relay,
            # and the new one is served chunk by chunk as each is verified (actors/relay.py)
            relay.begin(key, policy.manifest, slot.buffer.take(policy.manifest.total_bytes))
            kw["on_chunk"] = lambda i: relay.mark(key, i)
        if policy.shm_path and self.cfg.weights_shm != "false" and "on_chunk" not in kw and "relays" not in kw:
            # same host: the tensors view the learner's segment, held until released below
            from turnscale.protocol.shmweights import SegmentRef

            kw["shm"] = SegmentRef(path=policy.shm_path, token=policy.shm_token)
        report = None
        if kw:
            from turnscale.actors.weight_sync import PullReport

            kw["report"] = report = PullReport()
        try:
            tensors = await self.deps.pull(sock, policy.manifest, max(30.0, self.cfg.request_timeout_s), slot.buffer, **kw)
        except BaseException:
            if relay is not None:
                relay.withdraw(key)
            raise
        finally:
            if report is not None:
                self.stats.weight_chunks_from_relays += report.from_relays
                self.stats.weight_chunks_from_learner += report.from_learner
                self.stats.weight_relay_fallbacks += report.fallbacks
                self.stats.weight_chunks_from_shm += report.from_shm
                if report.shm_error and self.cfg.weights_shm == "true":
                    log.warning("weights v%d: shared-memory segment not used fully (%s); pulled over TCP",
                                policy.version, report.shm_error)
        engine = self.runtime.engine
        slot.swap = engine.load_weights(policy.version, tensors)  # the engine owns them until released
        try:
            await slot.swap.wait()
        except EngineBroken:
            await self._rebuild_engine(engine)
            raise
        if self.cfg.verify_weights:  # released: the buffer is ours again until the next pull
            await self._verify(engine, tensors, policy.manifest)
        release = getattr(slot.buffer, "release", None)  # ReceiveBuffer (test fakes may have none)
        if release is not None:
            release()  # a same-host pull's segment: the learner may reuse it now
        self.applied = (policy.incarnation, policy.version)
        self.stats.weight_pulls += 1
        self.stats.weight_pull_s += time.monotonic() - t0
        log.info("applied weights version %d in %.2fs", policy.version, time.monotonic() - t0)
        self._poke()

    def _set_sources(self, endpoints: list[str], keys: list[str], clients: list[str]) -> None:
        """The relays to pull from (with their CURVE keys), and who may pull from ours."""
        self.sources = list(endpoints)
        self.source_keys = {ep: k for ep, k in zip(endpoints, keys) if k}
        if self.deps.relay is not None:
            self.deps.relay.allow_clients(clients)

    def _relay_sock(self, endpoint: str) -> AsyncSocket:
        """This session's DEALER to another actor's relay (made on first use).  A relay that
        serves CURVE (its key came with the sources, from the authenticated learner) is
        reached with CURVE: with this actor's own key pair when it has one, else a throwaway
        pair (which a CURVE relay refuses: it admits only the keys the learner lists, so that
        actor falls back to its next source)."""
        assert self._ctx is not None
        key = self.source_keys.get(endpoint, "")
        s = self._relay_socks.get((endpoint, key))
        if s is None:
            curve = None
            if key:
                own = self.curve.server() if self.curve is not None else generate_curve_keys()
                curve = CurveKeys(public=own.public, secret=own.secret, server_public=key.encode())
            s = self._relay_socks[(endpoint, key)] = AsyncSocket(configure(self._ctx.socket(zmq.DEALER), curve=curve))
            s.sock.connect(endpoint)
        return s

    async def _verify(self, engine: EngineLike, tensors: Any, manifest: WeightManifest) -> None:
        """Checksum the engine's weights against the pulled bytes, as the engine stores them
        (engines that can read them back; ``actors.engine.mismatched_weights``)."""
        from turnscale.actors.engine import mismatched_weights

        bad = await trio.to_thread.run_sync(mismatched_weights, engine, tensors, manifest.dtype, manifest.checksum_algo)
        if bad:
            self.stats.torn_weights += 1
            self.applied = None
            log.error("weights v%d in the engine differ from the pulled bytes in %d tensor(s), e.g. %s; pulling again",
                      manifest.version, len(bad), bad[0])
            raise EngineError(f"torn weights after the swap to v{manifest.version}")

    async def _rebuild_engine(self, broken: EngineLike) -> None:
        """The engine lost its weights: close it and build a new one (its leases fail and are re-issued)."""
        assert self.welcome is not None
        log.warning("engine broken; rebuilding it")
        self.applied = None
        self.stats.engine_rebuilds += 1
        broken.close()
        self.runtime = await self.deps.make_runtime(self.welcome)

    async def _goodbye(self, req: Requester) -> None:
        with trio.move_on_after(min(self.cfg.stop_timeout_s, self.cfg.request_timeout_s) + 0.5):
            try:
                await self._request(req, Goodbye(actor_id=self.actor_id, reason=self.stop_reason or "done"), GroupAck)
            except (LearnerLost, RemoteError) as exc:
                log.info("goodbye not acknowledged: %s", exc)
