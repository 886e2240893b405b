"""Which relays each actor asks for weight chunks (docs/architecture.md, "Weight fan-out").

Actors that advertise a relay (``Hello.relay_endpoint``) form a tree with fan-out ``k``
in registration order, the learner its root: actor ``i`` (0-based among the relaying
actors) has parent ``i // k - 1`` (``-1``: the learner).  So the first ``k`` actors pull
from the learner and every other actor from an earlier one: the learner serves ``k``
copies of a version (its egress does not grow with the number of actors), each relay
uploads at most ``k``, and the depth is ``log_k N`` (``N`` for the chain, ``k = 1``).
Chunk-level pipelining (a relay serves each chunk once verified) keeps depth cheap.

An actor's sources are its ancestors, nearest first, at most ``hops`` of them; the
learner is always the last resort (``Welcome.weights_endpoint``) and is not listed.  The
tree is a pure function of the current registration order: an actor that leaves (or is
dropped) shifts the later ones, who learn their new sources from the next
``HeartbeatAck``; until then a pull from a dead parent falls back to the next source.  The service offers only
relays heard from within 2.5 heartbeat intervals (``SUSPECT_HEARTBEATS``), so a dead relay
costs its children at most a couple of relay timeouts, not one per version until it is forgotten.
Actors that join are appended, so no existing actor's sources change on a join.
"""

from __future__ import annotations


def parent(i: int, fanout: int) -> int:
    """Index of actor ``i``'s parent; -1 is the learner."""
    return i // fanout - 1


def sources(endpoints: list[str], i: int, fanout: int, hops: int) -> list[str]:
    """Relays actor ``i`` of ``endpoints`` (registration order) asks, nearest first."""
    out: list[str] = []
    p = parent(i, fanout)
    while p >= 0 and len(out) < hops:
        out.append(endpoints[p])
        p = parent(p, fanout)
    return out


def learner_children(n: int, fanout: int) -> int:
    """How many actors pull a version straight from the learner (its egress in copies)."""
    return min(n, fanout)


def depth(n: int, fanout: int) -> int:
    """Hops from the learner to the deepest of ``n`` actors."""
    d, i = 0, n - 1
    while i >= 0:
        i, d = parent(i, fanout), d + 1
    return d
