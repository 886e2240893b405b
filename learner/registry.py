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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnscale.protocol.messages import ErrorReply, Hello

MAX_ID_CHARS = 128
"""Longest ``actor_id`` (and ``token``) accepted."""
MAX_NAME_CHARS = 256
"""Longest ``host``, ``engine`` or ``device`` accepted."""
MAX_GROUPS_PER_ACTOR = 1024
"""Largest ``Hello.max_groups`` honoured (leases per actor are capped by it)."""


def short(text: str, n: int = 64) -> str:
    """An identifier as logs show it: at most ``n`` characters."""
    return text if len(text) <= n else text[: n - 3] + "..."


@dataclass
class ActorInfo:
    actor_id: str
    host: str
    pid: int
    engine: str
    last_seen: float
    identity: bytes = b""
    """ZeroMQ routing identity of the connection the actor is bound to."""
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
    actors: dict[str, ActorInfo] = field(default_factory=dict)
    registrations: int = 0
    """Registrations made so far (each ``ActorInfo.serial`` is the count after its own)."""

    def __len__(self) -> int:
        return len(self.actors)

    def values(self):
        return self.actors.values()

    def register(self, msg: Hello, identity: bytes, now: float) -> tuple[ActorInfo | None, ErrorReply | None, bool]:
        """Bind ``msg.actor_id`` to ``identity``.  Returns (info, None, replaced) on success,
        ``replaced`` True when an earlier binding of the id ended (release its leases);
        (None, error, False) when refused."""
        problem = hello_problem(msg)
        if problem:
            return None, ErrorReply(code="bad_message", message=f"Hello: {problem}"), False
        old = self.actors.get(msg.actor_id)
        if old is not None and old.identity != identity and not (msg.token and msg.token == old.token):
            if now - old.last_seen < self.silent_s:
                return None, ErrorReply(
                    code="actor_id_in_use", retryable=True,
                    message=f"actor id {short(msg.actor_id)!r} is bound to another live connection; use a unique "
                            f"actor.actor_id (or wait {self.silent_s:.0f}s after the other process died)"), False
        if old is None and len(self.actors) >= self.max_actors:
            return None, ErrorReply(code="too_many_actors", retryable=True,
                                    message=f"the learner serves at most {self.max_actors} actors"), False
        info = ActorInfo(msg.actor_id, msg.host, msg.pid, msg.engine, now, identity=identity, token=msg.token,
                         max_groups=min(msg.max_groups, MAX_GROUPS_PER_ACTOR), relay_endpoint=msg.relay_endpoint,
                         relay_public_key=msg.relay_public_key, pool=msg.pool,
                         draining=old is not None and old.draining)  # a drain survives a reconnect
        self.registrations += 1
        info.serial = self.registrations
        self.actors[msg.actor_id] = info
        return info, None, old is not None

    def bound(self, actor_id: str, identity: bytes) -> ActorInfo | None:
        """The actor ``actor_id`` if this connection is the one bound to it, else None."""
        info = self.actors.get(actor_id)
        return info if info is not None and info.identity == identity else None

    def drop(self, actor_id: str) -> None:
        self.actors.pop(actor_id, None)

    def silent(self, now: float, after_s: float) -> list[ActorInfo]:
        return [a for a in self.actors.values() if now - a.last_seen > after_s]
