"""``learner.control.ControlHandler`` on its own, with the real registry, lease manager and run
state (no sockets; the service over real sockets: ``test_learner_service.py``'s drain and
autoscaler tests, ``tests/integration/test_drain.py``)."""

from __future__ import annotations

import trio

from turnscale.learner.control import ControlHandler
from turnscale.learner.leases import LeaseManager
from turnscale.learner.registry import ActorRegistry
from turnscale.learner.runstate import RunState
from turnscale.learner.tasks import TaskStream, parse_task_spec
from turnscale.protocol.messages import ControlRequest, Hello, LeaseGrant, LearnerStatus, Shutdown
from tests.unit.fakes import make_group


class Schedule:
    def limit_at(self, step):
        return 8


def parts(max_leases_per_actor: int = 4):
    run = RunState(Schedule())
    leases = LeaseManager(stream=TaskStream(parse_task_spec("0:50", "babyai"), seed=0), group_size=2,
                          groups_per_step=4, max_staleness=2, ttl_s=60.0, policy=run)
    actors = ActorRegistry()
    for aid, pool in (("a", "cpu"), ("b", "gpu")):
        actors.register(Hello(actor_id=aid, host=f"h-{aid}", pid=1, engine="fake", device="cpu", max_groups=8,
                              pool=pool), identity=aid.encode(), now=0.0)
    return ControlHandler(actors, leases, run, max_leases_per_actor), leases, actors, run


def test_a_drained_actor_gets_no_lease_keeps_its_group_then_is_told_drained():
    ctl, leases, actors, _ = parts()
    a, b = actors.actors["a"], actors.actors["b"]
    (held,) = leases.grant("a", 1, now=0.0)
    st = ctl.handle(ControlRequest(drain=["a", "nobody"]), ready_groups=0)
    assert [(x.actor_id, x.draining, x.leases) for x in st.actors] == [("a", True, 1), ("b", False, 0)]
    gate = ctl.lease_gate(a)
    assert isinstance(gate, LeaseGrant) and gate.leases == []  # nothing new while its group is out
    assert ctl.heartbeat_gate(a, [held.lease_id]) is None and ctl.heartbeat_gate(a, []) is None
    assert ctl.lease_gate(b) is None and ctl.heartbeat_gate(b, []) is None  # the other actor is untouched
    assert leases.intake(make_group(held, actor_id="a"), now=1.0).accepted  # its in-flight group still counts
    assert ctl.lease_gate(a) == Shutdown(reason="drained")
    assert ctl.heartbeat_gate(a, []) == Shutdown(reason="drained")
    ctl.handle(ControlRequest(drain=["a"]), ready_groups=1)  # draining twice changes nothing
    assert a.draining and not b.draining


def test_a_drain_survives_the_actor_registering_again():
    ctl, _, actors, _ = parts()
    ctl.handle(ControlRequest(drain=["a"]), ready_groups=0)
    actors.register(Hello(actor_id="a", host="h-a", pid=1, engine="fake", device="cpu", max_groups=8, pool="cpu"),
                    identity=b"a", now=1.0)
    assert ctl.lease_gate(actors.actors["a"]) == Shutdown(reason="drained")


def test_the_lease_limit_is_capped_by_the_config_and_zero_keeps_it():
    ctl, leases, actors, _ = parts(max_leases_per_actor=4)
    a = actors.actors["a"]
    assert ctl.handle(ControlRequest(max_leases_per_actor=2), ready_groups=0).max_leases_per_actor == 2
    leases.grant("a", 1, now=0.0)
    assert ctl.room(a, now=0.0) == 1  # the limit less what it holds
    assert ctl.handle(ControlRequest(max_leases_per_actor=100), ready_groups=0).max_leases_per_actor == 4
    assert ctl.handle(ControlRequest(), ready_groups=0).max_leases_per_actor == 4
    a.max_groups = 2
    assert ctl.room(a, now=0.0) == 1  # the actor's own max_groups binds first
    leases.grant("a", 3, now=0.0)
    assert ctl.room(a, now=0.0) == 0  # never negative


def test_the_status_is_a_snapshot_of_run_leases_actors_and_signals():
    ctl, leases, actors, run = parts()
    actors.actors["b"].stats = {"tokens_generated": 123.0}
    leases.grant("b", 2, now=0.0)
    run.advance(3, groups=12)
    run.publish(2)
    s = ctl.signals
    s.idle_s, s.groups_received, s.groups_stale, s.groups_trained, s.staleness_sum = 1.5, 9, 2, 6, 4

    async def read() -> tuple[LearnerStatus, LearnerStatus]:
        closed = ctl.status(ready_groups=3)
        s.waiting_since = trio.current_time() - 2.0  # a wait in progress counts up to now
        return closed, ctl.status(ready_groups=3)

    st, waiting = trio.run(read)
    assert (st.step, st.version, st.ready_groups, st.live_leases) == (3, 2, 3, 2)
    assert (st.groups_received, st.groups_stale, st.groups_trained, st.staleness_sum) == (9, 2, 6, 4)
    assert st.idle_s == 1.5 and st.max_leases_per_actor == 4 and st.uptime_s >= 0
    by_id = {x.actor_id: x for x in st.actors}
    assert (by_id["b"].pool, by_id["b"].host, by_id["b"].leases, by_id["b"].tokens_generated) == ("gpu", "h-b", 2, 123.0)
    assert by_id["a"].tokens_generated == 0.0
    assert waiting.idle_s >= 3.5


def fair(n_actors: int = 3, window_staleness: int = 1, gps: int = 4, max_leases_per_actor: int = 64):
    """A handler over actors h (a hoarder: max_groups 1000), a, b, ... with the default lease
    cap; window ``(window_staleness + 1) * gps`` (the defaults: 8)."""
    run = RunState(Schedule())
    leases = LeaseManager(stream=TaskStream(parse_task_spec("0:50", "babyai"), seed=0), group_size=2,
                          groups_per_step=gps, max_staleness=window_staleness, ttl_s=60.0, policy=run)
    actors = ActorRegistry()
    for aid in ["h", "a", "b", "c"][:n_actors]:
        actors.register(Hello(actor_id=aid, host="h", pid=1, engine="fake", device="cpu",
                              max_groups=1000 if aid == "h" else 2), identity=aid.encode(), now=0.0)
    return ControlHandler(actors, leases, run, max_leases_per_actor), leases, actors


def ask(ctl, leases, actors, aid, n, now):
    """What the service does on a LeaseRequest: room, reclaim, grant."""
    a = actors.actors[aid]
    want = ctl.ask(a, n, now)
    revoked = ctl.reclaim(a, want, now)
    return leases.grant(aid, want, now), revoked


def test_a_lone_actor_may_use_the_whole_window():
    ctl, leases, actors = fair()
    got, revoked = ask(ctl, leases, actors, "h", 1_000_000, now=0.0)
    assert len(got) == 8 and revoked == []  # the admission window, nobody else asks


def test_a_hoarder_is_cut_to_its_share_as_soon_as_another_actor_asks():
    """h took the whole window alone; honest a asks and gets what it wants at once (h's
    youngest leases are revoked and re-issued to it); h gets nothing more while a contends;
    b arriving cuts h again; nobody at or below its share loses a lease."""
    ctl, leases, actors = fair()
    hoard, _ = ask(ctl, leases, actors, "h", 1_000_000, now=0.0)
    got, revoked = ask(ctl, leases, actors, "a", 2, now=1.0)
    assert revoked == hoard[-2:][::-1] and [l.task for l in got] == [l.task for l in hoard[-2:][::-1]]
    assert ask(ctl, leases, actors, "h", 1_000_000, now=1.5) == ([], [])  # over its share ceil(8/2) = 4
    got_b, revoked_b = ask(ctl, leases, actors, "b", 2, now=2.0)
    assert len(got_b) == 2 and len(revoked_b) == 2  # share ceil(8/3) = 3: h held 6, a 2
    held = leases.holdings()
    assert (held["h"], held["a"], held["b"]) == (4, 2, 2)
    assert all(leases.live[l.lease_id].actor_id == "a" for l in got)  # a was never over its share
    # a returns both groups and asks again: the slots its accepted groups fill are not taken
    # from anyone (they wait for their step, like everyone's), h stays capped at its share
    for l in got:
        assert leases.intake(make_group(l, actor_id="a"), now=3.0).accepted
    got2, revoked2 = ask(ctl, leases, actors, "a", 2, now=3.0)
    assert len(got2) == 1 and [l.lease_id for l in revoked2] == [hoard[3].lease_id]  # h: 4 > 3, cut to 3
    assert ask(ctl, leases, actors, "h", 1_000_000, now=3.5) == ([], [])


def test_actors_waiting_for_a_training_step_take_nothing_from_each_other():
    ctl, leases, actors = fair(n_actors=3)
    actors.actors["a"].max_groups = actors.actors["h"].max_groups = 4
    mine, _ = ask(ctl, leases, actors, "a", 4, now=0.0)
    theirs, _ = ask(ctl, leases, actors, "h", 4, now=0.0)
    for l in mine:  # a's groups fill the window until they are trained
        assert leases.intake(make_group(l, actor_id="a"), now=1.0).accepted
    assert ask(ctl, leases, actors, "a", 4, now=1.0) == ([], [])  # h holds its share (4 of 8): kept
    assert leases.holdings()["h"] == 4


def test_an_actor_that_stopped_asking_no_longer_shrinks_the_others_share():
    from turnscale.learner.control import ASKED_RECENTLY_S

    ctl, leases, actors = fair(n_actors=2)
    ask(ctl, leases, actors, "a", 0, now=0.0)  # asked (for nothing it could get), holds nothing
    got, _ = ask(ctl, leases, actors, "h", 1_000_000, now=1.0)
    assert len(got) == 4  # a contends: ceil(8 / 2)
    got, _ = ask(ctl, leases, actors, "h", 1_000_000, now=ASKED_RECENTLY_S + 0.1)
    assert len(got) == 4  # a stopped asking: h alone may fill the window
    ctl2, leases2, actors2 = fair(n_actors=2)
    ask(ctl2, leases2, actors2, "a", 0, now=0.0)
    ctl2.forget("a")  # a said Goodbye
    assert len(ask(ctl2, leases2, actors2, "h", 1_000_000, now=0.5)[0]) == 8


def test_the_lease_limit_and_max_groups_still_bind_below_the_share():
    ctl, leases, actors = fair(n_actors=2, max_leases_per_actor=3)
    assert len(ask(ctl, leases, actors, "h", 100, now=0.0)[0]) == 3  # learner.max_leases_per_actor
    assert len(ask(ctl, leases, actors, "a", 100, now=0.0)[0]) == 2  # its Hello.max_groups


def hello(aid, token=""):
    return Hello(actor_id=aid, host="h", pid=1, engine="fake", device="cpu", max_groups=2, token=token)


def test_one_connection_cannot_register_more_actor_ids_than_allowed():
    reg = ActorRegistry(silent_s=15.0)  # max_ids_per_connection: 1 (the default)
    assert reg.register(hello("a"), identity=b"conn", now=0.0)[1] is None
    info, err, _ = reg.register(hello("b"), identity=b"conn", now=1.0)
    assert info is None and err.code == "too_many_actor_ids" and err.retryable
    assert "learner.max_actor_ids_per_connection" in err.message and "b" not in reg.actors
    assert reg.register(hello("a"), identity=b"conn", now=2.0)[1] is None  # its own id again: fine
    assert reg.register(hello("b"), identity=b"other", now=2.0)[1] is None  # another connection
    assert reg.register(hello("d"), identity=b"other", now=3.0)[1].code == "too_many_actor_ids"
    reg.drop("b")  # Goodbye
    assert reg.register(hello("d"), identity=b"other", now=3.0)[1] is None
    info, err, ended = reg.register(hello("c"), identity=b"conn", now=17.1)  # "a" silent 15 s: presumed dead
    assert err is None and ended == ["a"] and "a" not in reg.actors  # a's leases go back (no piling up shares)
    assert reg.register(hello("c"), identity=b"conn", now=18.0)[2] == ["c"]  # re-bound: its old session ends


class KeyedFrame:
    """A received frame whose connection ZAP authenticated with CURVE key ``key``."""

    def __init__(self, key):
        self.key = key

    def get(self, prop):
        assert prop == "User-Id"
        return self.key


def test_one_curve_key_cannot_register_more_actor_ids_than_allowed_over_many_connections():
    reg = ActorRegistry(max_ids_per_connection=1, max_ids_per_key=2)
    key, other = "K" * 40, "L" * 40
    for i in range(3):
        reg.note_peer(f"c{i}".encode(), [b"header", KeyedFrame(key)])
    reg.note_peer(b"d", [KeyedFrame(other)])
    assert reg.register(hello("a0"), identity=b"c0", now=0.0)[1] is None
    assert reg.register(hello("a1"), identity=b"c1", now=0.0)[1] is None
    err = reg.register(hello("a2"), identity=b"c2", now=0.0)[1]
    assert err.code == "too_many_actor_ids" and "learner.max_actor_ids_per_key" in err.message
    assert reg.register(hello("a3"), identity=b"d", now=0.0)[1] is None  # another key
    assert reg.actors["a0"].peer_key == key


def test_peer_key_is_the_curve_public_key_zap_authenticated():
    """Real sockets: the frames a CURVE ROUTER receives carry the client's z85 public key as
    ``User-Id`` (set by the ZAP handler); plain frames carry none."""
    import zmq
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    from turnscale.learner.registry import peer_key
    from turnscale.protocol.transport import free_port

    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    try:
        server_pub, server_sec = zmq.curve_keypair()
        client_pub, client_sec = zmq.curve_keypair()
        out = {}
        for curve in (True, False):
            router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
            if curve:
                router.curve_server, router.curve_secretkey = True, server_sec
                dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_pub, client_pub, client_sec
            port = free_port()
            router.bind(f"tcp://127.0.0.1:{port}")
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send_multipart([b"rid", b"hello"])
            assert router.poll(10_000), "no message within 10 s"
            out[curve] = peer_key(router.recv_multipart(copy=False)[2:])
            router.close(0)
            dealer.close(0)
        assert out == {True: client_pub.decode(), False: ""}
        assert peer_key([b"plain bytes"]) == "" and peer_key([]) == ""
    finally:
        auth.stop()
        ctx.destroy(linger=0)
