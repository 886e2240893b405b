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
    assert ctl.room(a) == 1  # the limit less what it holds
    assert ctl.handle(ControlRequest(max_leases_per_actor=100), ready_groups=0).max_leases_per_actor == 4
    assert ctl.handle(ControlRequest(), ready_groups=0).max_leases_per_actor == 4
    a.max_groups = 2
    assert ctl.room(a) == 1  # the actor's own max_groups binds first
    leases.grant("a", 3, now=0.0)
    assert ctl.room(a) == 0  # never negative


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
