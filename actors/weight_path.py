"""The actor's weight path: pull a policy's weights (relays, learner, shared memory), hand
them to the engine, verify the swap, count it.  ``actors/actor.py`` owns the loop that
decides *when* to pull (its ``weights`` task and the first pull of a session); this module
owns *how*, and is the only writer of ``applied``.  The chunk protocol itself (windows,
retries, checksums per chunk, the shared-memory segment) is ``actors/weight_sync.py``.

Ordering contract.  Weights move along one chain, *target -> pulled -> applied*; each
link has exactly one writer and only ever follows the link before it:

1. ``target`` (a ``PolicyAnnouncement``, held by the actor): the weights the learner wants
   played.  Written by the session's ``Welcome`` and then only by the actor's
   ``announcements`` task, which moves it forward (a larger ``(version, step)``) within
   the Welcome's incarnation.
2. *pulled* (a receive buffer and its ``WeightSwap``): written only by ``WeightPath.pull``
   — the session's first pull of the Welcome's weights (before its tasks start), then the
   actor's ``weights`` task, which pulls ``target`` when ``needs(target)``.  A pull goes
   into one of two receive buffers, never into one the engine may still read (a buffer is
   reused only once its last ``WeightSwap`` is released).
3. ``applied`` (the ``(incarnation, version)`` of the weights the engine holds): written
   only by ``WeightPath.pull`` from the engine's ``WeightSwap`` outcome: set when the
   engine reports the swap *applied*, never when a pull finishes or a swap is merely
   queued.

Invariants.

- No torn weights: a version is applied whole or not at all.  The engine gets the tensors
  only once every chunk verified (``weight_sync``); with ``actor.verify_weights`` the
  engine's weights are checksummed against the pulled bytes after the swap, and a mismatch
  clears ``applied`` (``torn_weights`` += 1) and raises ``EngineError``.
- Versions are monotonic within a learner incarnation: ``pull`` does nothing unless
  ``needs(policy)`` (newer than ``applied``, or another incarnation's: a restarted learner's
  version numbers name other weights, so they are pulled anew even when not larger).
- Failure: every failure raises a ``TurnscaleError`` (transport, checksum, protocol,
  ``RemoteError``, ``EngineError``) and leaves ``applied`` as it was, except a torn swap or
  ``EngineBroken`` (the engine can no longer vouch for its weights), which clear it.  The
  caller pulls again (the ``weights`` task) or ends the session (its first pull); on
  ``EngineBroken`` the actor rebuilds the engine.  A pull that fails withdraws its buffer
  from this actor's relay.

Relays (``relay``: this actor's ``RelayServer``, ``actors/relay.py``; docs/architecture.md
"Weight fan-out").  The relay serves other actors the chunks this actor holds, read-only,
from the same two receive buffers: ``pull`` registers the free buffer for the new version
(``begin``) before the pull writes a byte into it, which withdraws the version it held at
that moment, and marks each chunk once verified (``on_chunk``), so a relay serves version v
only from a buffer holding v that no pull is writing into, and only verified chunks.  The
pull asks the relays the learner named (``sources``, from ``Welcome`` and ``HeartbeatAck``)
before the learner and checks every chunk whatever its source: a dead, slow or corrupt relay
costs a retry elsewhere, never a torn or wrong version.  The DEALERs to those relays live
for one session (``open_session`` .. ``close_session``); one to a relay that failed a pull
(no reply in time) is replaced at the next pull (``_reconnect`` says why).

Same host (``PolicyAnnouncement.shm_path``, ``actor.weights_shm``): with no relay involved,
the pull views the learner's shared-memory segment; the hold on it is released once the
swap is applied (``ReceiveBuffer.release``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import trio
import zmq

from turnscale.actors.engine import EngineBroken, EngineError, WeightSwap
from turnscale.conf.schema import ActorConfig
from turnscale.protocol.messages import PolicyAnnouncement, WeightManifest
from turnscale.protocol.transport import AsyncSocket, CurveKeys, configure, generate_curve_keys

if TYPE_CHECKING:
    from turnscale.common.curve import CurveSetup

log = logging.getLogger("turnscale.actor")


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


class WeightDeps(Protocol):
    """What the weight path uses of ``actors.actor.ActorDeps`` (read at each pull)."""

    pull: PullFn
    new_buffer: Callable[[], Any]
    relay: Any


class WeightCounters(Protocol):
    """The counters the weight path keeps (fields of ``actors.actor.ActorStats``)."""

    weight_pulls: int
    weight_pull_s: float
    torn_weights: int
    weight_chunks_from_relays: int
    weight_chunks_from_learner: int
    weight_relay_fallbacks: int
    weight_chunks_from_shm: int


@dataclass
class BufferSlot:
    """A receive buffer and the last swap it was handed to (it is free once that swap is released)."""

    buffer: Any
    swap: WeightSwap | None = None

    @property
    def free(self) -> bool:
        return self.swap is None or self.swap.released


@dataclass
class WeightPath:
    """One actor's weight path (see the module docstring); lives as long as the actor."""

    cfg: ActorConfig
    deps: WeightDeps
    stats: WeightCounters
    on_applied: Callable[[], None] = lambda: None
    """Called after ``applied`` moved forward (the actor wakes leases waiting for a version)."""
    applied: tuple[str, int] | None = None
    """``(incarnation, version)`` of the weights the engine has applied (written only here)."""
    sources: list[str] = field(default_factory=list)
    """Relays to ask for weight chunks before the learner (``Welcome``/``HeartbeatAck.weight_sources``)."""
    source_keys: dict[str, str] = field(default_factory=dict)
    """CURVE public key of each of ``sources`` ("" or absent: a plain relay)."""
    slots: list[BufferSlot] = field(default_factory=list)
    """The two receive buffers (made at the first pull)."""
    _ctx: zmq.Context | None = None
    _curve: CurveSetup | None = None
    _relay_socks: dict[tuple[str, str], AsyncSocket] = field(default_factory=dict)
    """This session's DEALERs to ``sources``, by (endpoint, key) (closed with the session)."""

    # ------------------------------------------------------------------ queries
    def holds(self, incarnation: str, version: int) -> bool:
        """The engine has applied ``incarnation``'s weights, version >= ``version``."""
        a = self.applied
        return a is not None and a[0] == incarnation and a[1] >= version

    def needs(self, policy: PolicyAnnouncement) -> bool:
        """``policy`` has weights and they are newer than (or from another incarnation than) ours."""
        a = self.applied
        return policy.manifest is not None and (a is None or a[0] != policy.incarnation or a[1] < policy.version)

    # ------------------------------------------------------------------ sources and sessions
    def set_sources(self, endpoints: list[str], keys: list[str], clients: list[str]) -> None:
        """The relays to pull from (with their CURVE keys), and who may pull from ours."""
        self.sources = list(endpoints)
        self.source_keys = {ep: k for ep, k in zip(endpoints, keys) if k}
        if self.deps.relay is not None:
            self.deps.relay.allow_clients(clients)

    def open_session(self, ctx: zmq.Context, curve: CurveSetup | None) -> None:
        """A session starts: relay DEALERs are made in ``ctx``, with ``curve``'s key pair."""
        self._ctx, self._curve = ctx, curve

    def close_session(self) -> None:
        """The session ended: close its DEALERs to other actors' relays."""
        for s in self._relay_socks.values():
            s.close()
        self._relay_socks.clear()

    def _relay_sock(self, endpoint: str) -> AsyncSocket:
        """This session's DEALER to another actor's relay (made on first use).  A relay that
        serves CURVE (its key came with the sources, from the authenticated learner) is
        reached with CURVE: with this actor's own key pair when it has one, else a throwaway
        pair (which a CURVE relay refuses: it admits only the keys the learner lists, so that
        actor falls back to its next source)."""
        assert self._ctx is not None, "open_session first"
        key = self.source_keys.get(endpoint, "")
        s = self._relay_socks.get((endpoint, key))
        if s is None:
            curve = None
            if key:
                own = self._curve.server() if self._curve is not None else generate_curve_keys()
                curve = CurveKeys(public=own.public, secret=own.secret, server_public=key.encode())
            s = self._relay_socks[(endpoint, key)] = AsyncSocket(configure(self._ctx.socket(zmq.DEALER), curve=curve))
            s.sock.connect(endpoint)
        return s

    def _reconnect(self, endpoints: list[str]) -> None:
        """Close this session's DEALERs to ``endpoints`` (relays that failed a pull): the next
        pull connects afresh.  A socket is not reused after a silent relay, because libzmq
        (4.3) never reconnects a DEALER whose CURVE handshake the relay refused (it refuses an
        actor until its owner's next ``HeartbeatAck`` lists the newcomer's key), and every
        request on it would time out from then on."""
        for key in [k for k in self._relay_socks if k[0] in endpoints]:
            self._relay_socks.pop(key).close()

    # ------------------------------------------------------------------ the pull
    async def _free_slot(self) -> BufferSlot:
        """A receive buffer the engine does not hold (waits for a release if both are held)."""
        if not self.slots:
            self.slots = [BufferSlot(self.deps.new_buffer()) for _ in range(2)]
        while True:
            for slot in self.slots:
                if slot.free:
                    return slot
            assert self.slots[0].swap is not None
            await self.slots[0].swap.wait_released()

    async def pull(self, sock: AsyncSocket, policy: PolicyAnnouncement, engine: EngineLike) -> None:
        """Pull ``policy``'s weights into a free buffer, hand them to ``engine`` and await the
        swap; ``applied`` moves to ``policy`` only once the swap applied (and verified)."""
        if not self.needs(policy):
            return
        assert policy.manifest is not None
        t0 = time.monotonic()
        slot = await self._free_slot()
        tensors = await self._receive(sock, policy, slot)
        slot.swap = engine.load_weights(policy.version, tensors)  # the engine owns them until released
        try:
            await slot.swap.wait()
        except EngineBroken:
            self.applied = None
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
        self.on_applied()

    async def _receive(self, sock: AsyncSocket, policy: PolicyAnnouncement, slot: BufferSlot) -> Any:
        """Receive ``policy``'s verified tensors into ``slot`` (relays first, the learner, or
        the same-host segment); on failure the slot's buffer is withdrawn from our relay."""
        assert policy.manifest is not None
        relay, key = self.deps.relay, id(slot)
        kw: dict[str, Any] = {}
        sources = list(self.sources)  # a HeartbeatAck may replace them during the pull
        if sources:
            kw["relays"] = [self._relay_sock(ep) for ep in sources]
        if relay is not None and slot.buffer is not None:
            # before any byte lands in the buffer: its old version is withdrawn from the relay,
            # and the new one is served chunk by chunk as each is verified (actors/relay.py)
            relay.begin(key, policy.manifest, slot.buffer.take(policy.manifest.total_bytes))
            kw["on_chunk"] = lambda i: relay.mark(key, i)
        if policy.shm_path and self.cfg.weights_shm != "false" and "on_chunk" not in kw and "relays" not in kw:
            # same host: the tensors view the learner's segment, held until released after the swap
            from turnscale.protocol.shmweights import SegmentRef

            kw["shm"] = SegmentRef(path=policy.shm_path, token=policy.shm_token)
        report = None
        if kw:
            from turnscale.actors.weight_sync import PullReport

            kw["report"] = report = PullReport()
        try:
            return await self.deps.pull(sock, policy.manifest, max(30.0, self.cfg.request_timeout_s), slot.buffer, **kw)
        except BaseException:
            if relay is not None:
                relay.withdraw(key)
            raise
        finally:
            if report is not None:
                self._reconnect([sources[i] for i in report.dead_relays])
                self.stats.weight_chunks_from_relays += report.from_relays
                self.stats.weight_chunks_from_learner += report.from_learner
                self.stats.weight_relay_fallbacks += report.fallbacks
                self.stats.weight_chunks_from_shm += report.from_shm
                if report.shm_error and self.cfg.weights_shm == "true":
                    log.warning("weights v%d: shared-memory segment not used fully (%s); pulled over TCP",
                                policy.version, report.shm_error)

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
