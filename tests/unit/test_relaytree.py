"""Relay source assignment: tree shape, learner egress bound, re-assignment when an actor
leaves, delivery in Welcome and HeartbeatAck."""

from __future__ import annotations

import pytest
import trio

from turnscale.learner import relaytree
from turnscale.learner.service import LearnerService, ServiceParts
from turnscale.protocol.messages import Goodbye, Heartbeat, HeartbeatAck, Hello, Welcome
from tests.unit.test_learner_service import FakePublisher, FakeSchedule, FakeTrainer, MemCheckpointer, make_cfg


@pytest.mark.parametrize("fanout", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 5, 16, 33])
def test_tree_shape_and_egress_bound(n, fanout):
    eps = [f"tcp://10.0.0.{i}:1" for i in range(n)]
    from_learner = [i for i in range(n) if not relaytree.sources(eps, i, fanout, 99)]
    assert from_learner == list(range(min(n, fanout)))  # the learner serves at most `fanout` copies
    assert relaytree.learner_children(n, fanout) == len(from_learner)
    children = {}
    for i in range(n):
        p = relaytree.parent(i, fanout)
        assert p < i  # parents registered earlier: joins never change existing actors' sources
        children[p] = children.get(p, 0) + 1
    assert max(children.values()) <= fanout  # no relay uploads more than `fanout` copies
    full = [relaytree.sources(eps, i, fanout, 99) for i in range(n)]
    assert max(len(s) for s in full) + 1 == relaytree.depth(n, fanout)
    for i, s in enumerate(full):  # ancestors, nearest first, capped by hops
        assert relaytree.sources(eps, i, fanout, 2) == s[:2]
        if s:
            assert s[0] == eps[relaytree.parent(i, fanout)]


def test_chain_and_binary_tree():
    eps = list("abcdefg")
    assert [relaytree.sources(eps, i, 1, 2) for i in range(4)] == [[], ["a"], ["b", "a"], ["c", "b"]]
    assert [relaytree.sources(eps, i, 2, 3) for i in range(7)] == [[], [], ["a"], ["a"], ["b"], ["b"], ["c", "a"]]
    assert relaytree.depth(16, 2) == 4 and relaytree.depth(16, 1) == 16


def service(**over):
    cfg = make_cfg(**over)
    trainer = FakeTrainer()
    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(),
                         checkpointer=MemCheckpointer(trainer, []), model_path="/m")
    return LearnerService(cfg, parts)


def hello(name, relay=True):
    return Hello(actor_id=name, host="h", pid=1, engine="sim", device="cpu", max_groups=1, token=name,
                 relay_endpoint=f"tcp://{name}:7000" if relay else "")


def test_service_assigns_sources_in_welcome_and_reassigns_on_leave():
    svc = service(**{"learner.relay.fanout": 1, "learner.relay.fallback_hops": 2})

    async def main():
        w = {}
        for name, relay in (("a", True), ("local", False), ("b", True), ("c", True), ("d", True)):
            w[name] = svc.handle(hello(name, relay), identity=name.encode())
            assert isinstance(w[name], Welcome)
        assert w["a"].weight_sources == [] and w["local"].weight_sources == []  # root child; no relay: direct pull
        assert w["b"].weight_sources == ["tcp://a:7000"]
        assert w["d"].weight_sources == ["tcp://c:7000", "tcp://b:7000"]
        svc.handle(Goodbye(actor_id="b"), identity=b"b")
        ack = svc.handle(Heartbeat(actor_id="c", lease_ids=[], policy_version=0), identity=b"c")
        assert isinstance(ack, HeartbeatAck) and ack.weight_sources == ["tcp://a:7000"]
        ack = svc.handle(Heartbeat(actor_id="d", lease_ids=[], policy_version=0), identity=b"d")
        assert ack.weight_sources == ["tcp://c:7000", "tcp://a:7000"]

    trio.run(main)


def test_relays_off_is_the_star():
    svc = service(**{"learner.relay.enabled": "false"})

    async def main():
        for name in "abc":
            assert svc.handle(hello(name), identity=name.encode()).weight_sources == []

    trio.run(main)


def test_a_bad_relay_endpoint_is_refused():
    svc = service()

    async def main():
        bad = Hello(actor_id="x", host="h", pid=1, engine="sim", device="cpu", max_groups=1, relay_endpoint="ipc:///tmp/x")
        assert svc.handle(bad, identity=b"x").code == "bad_message"

    trio.run(main)


def test_a_relay_that_missed_heartbeats_is_not_offered_until_heard_again():
    """A dead relay would cost every child a relay timeout per version until the learner forgets
    the actor (lease_ttl_s, a minute by default); after 2.5 silent heartbeat intervals it is
    left out of the sources, and is offered again once it heartbeats."""
    svc = service(**{"learner.relay.fanout": 1, "learner.relay.fallback_hops": 2,
                     "learner.heartbeat_interval_s": 1.0, "learner.lease_ttl_s": 60.0})

    async def main():
        for name in "abc":
            assert isinstance(svc.handle(hello(name), identity=name.encode()), Welcome)
        beat = lambda n: svc.handle(Heartbeat(actor_id=n, lease_ids=[], policy_version=0), identity=n.encode())  # noqa: E731
        assert beat("c").weight_sources == ["tcp://b:7000", "tcp://a:7000"]
        svc.actors.actors["b"].last_seen -= 3.0  # b missed three heartbeats: not forgotten (60 s), but suspect
        assert beat("c").weight_sources == ["tcp://a:7000"]
        assert "b" in svc.actors.actors
        assert beat("b").weight_sources == ["tcp://a:7000"]  # b itself still gets its sources
        assert beat("c").weight_sources == ["tcp://b:7000", "tcp://a:7000"]

    trio.run(main)


def test_each_curve_relay_is_told_which_actor_keys_may_pull_from_it():
    """``relay_clients``: the other registered actors with a CURVE relay (the learner admitted
    them); a plain relay and relays-off get none; a leaver drops out at the next heartbeat."""
    svc = service(**{"learner.relay.fanout": 1})
    keys = {n: (n * 40)[:40] for n in "abc"}

    def curve_hello(name):
        return Hello(actor_id=name, host="h", pid=1, engine="sim", device="cpu", max_groups=1, token=name,
                     relay_endpoint=f"tcp://{name}:7000", relay_public_key=keys[name])

    async def main():
        w = {n: svc.handle(curve_hello(n), identity=n.encode()) for n in "abc"}
        assert w["a"].relay_clients == []  # alone when it registered
        plain = svc.handle(hello("p"), identity=b"p")
        assert plain.relay_clients == []  # a plain relay authenticates no one
        beat = lambda n: svc.handle(Heartbeat(actor_id=n, lease_ids=[], policy_version=0), identity=n.encode())  # noqa: E731
        assert beat("a").relay_clients == [keys["b"], keys["c"]]
        svc.handle(Goodbye(actor_id="c"), identity=b"c")
        assert beat("a").relay_clients == [keys["b"]] and beat("b").relay_clients == [keys["a"]]

    trio.run(main)


def test_a_curve_relay_is_named_to_a_newcomer_only_once_its_owner_was_told_the_newcomers_key():
    """A CURVE relay admits only the keys its owner last heard from the learner; a newcomer
    sent to it earlier is refused, and a refused connection is dead for good (libzmq does not
    reconnect it).  So the learner names a CURVE relay to an actor only after the relay's owner
    got a ``relay_clients`` list made after that actor registered; until then the actor pulls
    from its next source (the learner)."""
    svc = service(**{"learner.relay.fanout": 1, "learner.relay.fallback_hops": 2})
    keys = {n: (n * 40)[:40] for n in "abc"}

    def curve_hello(name):
        return Hello(actor_id=name, host="h", pid=1, engine="sim", device="cpu", max_groups=1, token=name,
                     relay_endpoint=f"tcp://{name}:7000", relay_public_key=keys[name])

    async def main():
        beat = lambda n: svc.handle(Heartbeat(actor_id=n, lease_ids=[], policy_version=0), identity=n.encode())  # noqa: E731
        assert svc.handle(curve_hello("a"), identity=b"a").weight_sources == []
        assert svc.handle(curve_hello("b"), identity=b"b").weight_sources == []  # a has not heard b's key
        assert beat("b").weight_sources == []
        assert beat("a").relay_clients == [keys["b"]]
        assert beat("b").weight_sources == ["tcp://a:7000"]
        assert svc.handle(curve_hello("c"), identity=b"c").weight_sources == []
        assert beat("b").relay_clients == [keys["a"], keys["c"]]  # b knows c; a does not yet
        assert beat("c").weight_sources == ["tcp://b:7000"]
        assert beat("a").relay_clients == [keys["b"], keys["c"]]
        assert beat("c").weight_sources == ["tcp://b:7000", "tcp://a:7000"]
        # b re-registers (a new process, a new key): a must hear the new key before b is sent to a
        w = svc.handle(Hello(actor_id="b", host="h", pid=2, engine="sim", device="cpu", max_groups=1, token="b",
                             relay_endpoint="tcp://b:7000", relay_public_key="d" * 40), identity=b"b2")
        assert isinstance(w, Welcome) and w.weight_sources == []
        assert beat("a").relay_clients == sorted([keys["c"], "d" * 40])
        assert svc.handle(Heartbeat(actor_id="b", lease_ids=[], policy_version=0), identity=b"b2").weight_sources \
            == ["tcp://a:7000"]

    trio.run(main)
