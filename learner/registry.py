"""Who the learner is talking to: registered actors, each bound to one connection.

Every control message arrives on the learner's ROUTER with the sender's ZeroMQ routing
identity (one per DEALER connection; under CURVE the connection is also authenticated by
the actor's key).  ``Hello`` binds an ``actor_id`` to that identity; every later request
that names the actor (``LeaseRequest``, ``Heartbeat``, ``TrajectoryGroup``, ``Goodbye``)
must come from the bound identity, otherwise it is answered ``not_registered`` and changes
nothing.  So one client cannot renew, return, release or abandon another's leases.

Re-binding an ``actor_id`` (a new connection says ``Hello`` with an id already bound):

- same ``Hello.token`` (the same actor process, reconnecting after a lost session): the
  binding moves to the new connection and the old session's leases are released;
- another token (another process): refused as ``actor_id_in_use`` while the bound actor
  is alive (heard from within ``silent_s``); once it has been silent that long it is
  presumed dead and the newcomer takes the id.

Bounds: ids and names have a maximum length (longer ``Hello`` fields are refused, never
stored or logged); at most ``max_actors`` actors are registered (``too_many_actors``,
retryable); ``max_groups`` per actor is capped.  Logs show identifiers truncated
(``short``).

Ids per client: every actor id has its own fair share of leases (``learner.control``), so
one client must not register many.  At most ``max_ids_per_connection`` live ids are bound
to one connection (routing identity) and, under CURVE, at most ``max_ids_per_key`` to one
client key (``peer_key``: the z85 public key ZAP authenticated, which every frame of that
connection carries as its ``User-Id``; a client opening many connections still has one
key).  A ``Hello`` for a further id is refused ``too_many_actor_ids`` (retryable), naming
the config key to raise.  Re-binding an id the client already holds never counts twice.
Ids of the client silent for ``silent_s`` (a crashed actor's) do not count, and a new id
bound by the client ends them (their leases are released with it, as for a re-bound id),
so a client cannot pile up shares by leaving ids silent while their leases live on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from turnscale.protocol.messages import ErrorReply, Hello

MAX_ID_CHARS = 128
"""Longest ``actor_id`` (and ``token``) accepted."""
MAX_NAME_CHARS = 256
"""Longest ``host``, ``engine`` or ``device`` accepted."""
MAX_GROUPS_PER_ACTOR = 1024
"""Largest ``Hello.max_groups`` honoured (leases per actor are capped by it)."""
PEER_KEYS_REMEMBERED = 1 << 16
"""Connections whose CURVE key the registry remembers (most recently heard); each entry is
~100 bytes, and every authorized connection that speaks refreshes its own."""


def short(text: str, n: int = 64) -> str:
    """An identifier as logs show it: at most ``n`` characters."""
    return text if len(text) <= n else text[: n - 3] + "..."


def peer_key(frames: Sequence[Any]) -> str:
    """The CURVE public key (z85) that ZAP authenticated for the connection ``frames`` came
    on, read from the last frame's ``User-Id`` (pyzmq's ZAP handler sets it to the client's
    key); "" without CURVE/ZAP or for frames that are plain bytes (no metadata)."""
    get = getattr(frames[-1], "get", None) if frames else None
    if get is None:
        return ""
    try:
        uid = get("User-Id")
    except Exception:  # zmq.ZMQError: the connection has no User-Id (no ZAP handler)
        return ""
    return uid if isinstance(uid, str) and len(uid) <= MAX_ID_CHARS else ""


@dataclass
class ActorInfo:
    actor_id: str
    host: str
    pid: int
    engine: str
    last_seen: float
    identity: bytes = b""
    """ZeroMQ routing identity of the connection the actor is bound to."""
    peer_key: str = ""
    """The CURVE client key of that connection (``peer_key``); "" without CURVE."""
    token: str = ""
    max_groups: int = 1
    policy_version: int = -1
    stats: dict[str, float] = field(default_factory=dict)
    relay_endpoint: str = ""
    """``Hello.relay_endpoint``: where it serves weight chunks to other actors (empty: none)."""
    relay_public_key: str = ""
    """``Hello.relay_public_key``: the relay's CURVE public key (empty: a plain relay)."""
    pool: str = "default"
    """``Hello.pool``: the actor's hardware/engine pool."""
    draining: bool = False
    """Told to drain (``ControlRequest``): no new leases; told ``Shutdown`` once it holds none."""
    serial: int = 0
    """This registration's number (``ActorRegistry.registrations`` when it was made)."""
    told: int = -1
    """The registrations its relay last heard of: the ``registrations`` count when the learner
    last sent it ``relay_clients`` (an actor registered later is not admitted by it yet)."""


def hello_problem(msg: Hello) -> str:
    """Why a Hello's fields are unacceptable, or ""."""
    if not 0 < len(msg.actor_id) <= MAX_ID_CHARS or not msg.actor_id.isprintable():
        return f"actor_id must be 1-{MAX_ID_CHARS} printable characters"
    if len(msg.token) > MAX_ID_CHARS:
        return f"token must be at most {MAX_ID_CHARS} characters"
    for name in ("host", "engine", "device", "pool"):
        if len(getattr(msg, name)) > MAX_NAME_CHARS:
            return f"{name} must be at most {MAX_NAME_CHARS} characters"
    if msg.max_groups < 1:
        return "max_groups must be >= 1"
    if not msg.pool or not msg.pool.isprintable():
        return "pool must be a non-empty printable name"
    ep = msg.relay_endpoint
    if ep and (len(ep) > MAX_NAME_CHARS or not ep.startswith("tcp://") or not ep.isprintable() or ":" not in ep[6:]):
        return f"relay_endpoint must be empty or tcp://host:port (at most {MAX_NAME_CHARS} characters)"
    key = msg.relay_public_key
    if key and (len(key) != 40 or not key.isprintable() or not ep):
        return "relay_public_key must be empty or a 40-character z85 CURVE key (with a relay_endpoint)"
    return ""


@dataclass
class ActorRegistry:
    """See the module docstring."""

    max_actors: int = 4096
    silent_s: float = 15.0
    """An actor not heard from for this long is presumed dead (its id can be taken)."""
    max_ids_per_connection: int = 1
    """Live actor ids one connection may hold (``learner.max_actor_ids_per_connection``)."""
    max_ids_per_key: int = 8
    """Live actor ids one CURVE client key may hold (``learner.max_actor_ids_per_key``)."""
    actors: dict[str, ActorInfo] = field(default_factory=dict)
    registrations: int = 0
    """Registrations made so far (each ``ActorInfo.serial`` is the count after its own)."""
    peer_keys: "OrderedDict[bytes, str]" = field(default_factory=OrderedDict)
    """Routing identity -> CURVE client key of that connection (``note_peer``), most recent last."""
    _on_conn: dict[bytes, set[str]] = field(default_factory=dict)
    """Routing identity -> the actor ids bound to it (kept with ``actors``)."""
    _on_key: dict[str, set[str]] = field(default_factory=dict)
    """CURVE client key -> the actor ids bound to it (kept with ``actors``)."""

    def __len__(self) -> int:
        return len(self.actors)

    def values(self):
        return self.actors.values()

    def note_peer(self, identity: bytes, frames: Sequence[Any]) -> None:
        """Remember the CURVE key of the connection ``identity`` from a message it sent (the
        control loop calls this for every message, before handling it); no-op without CURVE."""
        key = peer_key(frames)
        if key:
            self.peer_keys[identity] = key
            self.peer_keys.move_to_end(identity)
            while len(self.peer_keys) > PEER_KEYS_REMEMBERED:
                self.peer_keys.popitem(last=False)

    def register(self, msg: Hello, identity: bytes,
                 now: float) -> tuple[ActorInfo | None, ErrorReply | None, list[str]]:
        """Bind ``msg.actor_id`` to ``identity`` (and to its CURVE key, ``note_peer``).  Returns
        (info, None, ended) on success, ``ended`` the actor ids whose registrations this one
        ended (release their leases): the id itself when it was bound before, and silent ids
        of the same client (see the module docstring); (None, error, []) when refused."""
        peer_key = self.peer_keys.get(identity, "")
        problem = hello_problem(msg)
        if problem:
            return None, ErrorReply(code="bad_message", message=f"Hello: {problem}"), []
        old = self.actors.get(msg.actor_id)
        if old is not None and old.identity != identity and not (msg.token and msg.token == old.token):
            if now - old.last_seen < self.silent_s:
                return None, ErrorReply(
                    code="actor_id_in_use", retryable=True,
                    message=f"actor id {short(msg.actor_id)!r} is bound to another live connection; use a unique "
                            f"actor.actor_id (or wait {self.silent_s:.0f}s after the other process died)"), []
        crowded = self._ids_problem(msg.actor_id, identity, peer_key, now)
        if crowded is not None:
            return None, crowded, []
        if old is None and len(self.actors) >= self.max_actors:
            return None, ErrorReply(code="too_many_actors", retryable=True,
                                    message=f"the learner serves at most {self.max_actors} actors"), []
        info = ActorInfo(msg.actor_id, msg.host, msg.pid, msg.engine, now, identity=identity, token=msg.token,
                         peer_key=peer_key,
                         max_groups=min(msg.max_groups, MAX_GROUPS_PER_ACTOR), relay_endpoint=msg.relay_endpoint,
                         relay_public_key=msg.relay_public_key, pool=msg.pool,
                         draining=old is not None and old.draining)  # a drain survives a reconnect
        self.registrations += 1
        info.serial = self.registrations
        ended = [msg.actor_id] if old is not None else []
        ended += self._end_silent(msg.actor_id, identity, peer_key, now)
        self.drop(msg.actor_id)
        self.actors[msg.actor_id] = info
        self._on_conn.setdefault(identity, set()).add(msg.actor_id)
        if peer_key:
            self._on_key.setdefault(peer_key, set()).add(msg.actor_id)
        return info, None, ended

    def _end_silent(self, actor_id: str, identity: bytes, peer_key: str, now: float) -> list[str]:
        """Drop the other ids of this connection (and CURVE key) silent for ``silent_s``; their ids."""
        mine = set(self._on_conn.get(identity, ())) | (set(self._on_key.get(peer_key, ())) if peer_key else set())
        gone = sorted(i for i in mine if i != actor_id and now - self.actors[i].last_seen >= self.silent_s)
        for i in gone:
            self.drop(i)
        return gone

    def _ids_problem(self, actor_id: str, identity: bytes, peer_key: str, now: float) -> ErrorReply | None:
        """``too_many_actor_ids`` when binding ``actor_id`` would give this connection (or this
        CURVE key) more live ids than allowed; None otherwise.  The id itself and ids silent
        for ``silent_s`` do not count."""
        def live(ids: set[str]) -> int:  # O(ids of this client): never a pass over every actor
            return sum(1 for i in ids if i != actor_id and now - self.actors[i].last_seen < self.silent_s)

        on_conn = live(self._on_conn.get(identity, set()))
        if on_conn >= self.max_ids_per_connection:
            return ErrorReply(code="too_many_actor_ids", retryable=True,
                              message=f"this connection already holds {on_conn} live actor id(s), the most "
                                      f"learner.max_actor_ids_per_connection={self.max_ids_per_connection} allows: "
                                      f"use one connection per actor id, or raise learner.max_actor_ids_per_connection")
        on_key = live(self._on_key.get(peer_key, set())) if peer_key else 0
        if on_key >= self.max_ids_per_key:
            return ErrorReply(code="too_many_actor_ids", retryable=True,
                              message=f"this CURVE key already holds {on_key} live actor id(s), the most "
                                      f"learner.max_actor_ids_per_key={self.max_ids_per_key} allows: give each host "
                                      f"or actor its own key (turnscale keys), or raise learner.max_actor_ids_per_key")
        return None

    def bound(self, actor_id: str, identity: bytes) -> ActorInfo | None:
        """The actor ``actor_id`` if this connection is the one bound to it, else None."""
        info = self.actors.get(actor_id)
        return info if info is not None and info.identity == identity else None

    def drop(self, actor_id: str) -> None:
        info = self.actors.pop(actor_id, None)
        if info is None:
            return
        for index, k in ((self._on_conn, info.identity), (self._on_key, info.peer_key)):
            ids = index.get(k)
            if ids is not None:
                ids.discard(actor_id)
                if not ids:
                    del index[k]

    def silent(self, now: float, after_s: float) -> list[ActorInfo]:
        return [a for a in self.actors.values() if now - a.last_seen > after_s]
