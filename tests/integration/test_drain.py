"""Draining a real actor process: real envhub, learner and two actors (two pools) on
127.0.0.1.  A controller (``turnscale.control.LearnerControl``) drains one actor: it gets no
new lease, its in-flight groups are still trained, then it exits 0 by itself; training
continues on the other one; nothing is lost or trained twice (``batches.jsonl``)."""

from __future__ import annotations

import pytest

from tests.integration.test_failures import Cluster, check_groups, check_ledger, cluster_factory  # noqa: F401  (the fixture)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_drained_actor_finishes_its_groups_and_exits_while_training_goes_on(cluster_factory):
    from turnscale.protocol.messages import ControlRequest
    from turnscale.control import LearnerControl

    c: Cluster = cluster_factory()
    try:
        c.start_envhub()
        learner = c.start_learner()
        a1 = c.procs.start("a1", ["actor", *c.common, "actor.actor_id=a1", "actor.pool=cpu"])
        a2 = c.procs.start("a2", ["actor", *c.common, "actor.actor_id=a2", "actor.pool=cpu_small",
                                  "engine.max_batch=2"])
        c.actors.update(a1=a1, a2=a2)
        c.wait("a group from each pool", lambda: {t["actor_id"] for t in c.trajs()} >= {"a1", "a2"}, 240, alive=[learner, a1, a2])
        # ``pool/<name>/actors`` counts the actors registered when a step ends: under load the
        # first step can end after a2 has already been drained, so wait for one before draining
        c.wait("a step with both pools registered",
               lambda: any("pool/cpu_small/actors" in m and "pool/cpu/actors" in m for m in c.metrics()), 240,
               alive=[learner, a1, a2])
        port = int(next(x.split("=")[1] for x in c.common if x.startswith("learner.port=")))
        ctl = LearnerControl("127.0.0.1", port, timeout_s=30)
        try:
            st = ctl.status()
            assert {(a.actor_id, a.pool) for a in st.actors} == {("a1", "cpu"), ("a2", "cpu_small")}
            st = ctl.request(ControlRequest(drain=["a2"]))
            assert next(a for a in st.actors if a.actor_id == "a2").draining
            rc = a2.popen.wait(timeout=120)  # leaves by itself once its groups are in
            assert rc == 0, a2.tail(40)
            drained_at = c.step()
            c.wait("two more steps on a1 alone", lambda: c.step() >= drained_at + 2, 180, alive=[learner, a1])
            final = ctl.status()
            assert [a.actor_id for a in final.actors] == ["a1"]
        finally:
            ctl.close()
        c.stop_learner()
        log = c.log(learner)
        assert "actor a2 (pool cpu_small) draining" in log and "actor a2 drained" in log
        assert "learner shutdown: drained" in c.log(a2)
        grants_after = [g for g in c.grants(learner) if g[4] == "a2"]
        drain_line = log.index("actor a2 (pool cpu_small) draining")
        assert all(log.index(f"lease {g[0]} ") < drain_line for g in grants_after), "a lease was granted to a drained actor"
        check_groups(c.trajs())
        trained = check_ledger(c.dir)
        assert {g[0] for g in grants_after} <= {t["lease_id"] for t in c.trajs()}, "a drained actor's lease never delivered"
        assert any(r["lease_id"] in {g[0] for g in grants_after} for r in trained)
        metrics = c.metrics()
        assert any("pool/cpu_small/actors" in m for m in metrics) and any("pool/cpu/actors" in m for m in metrics)
    except BaseException:
        c.dump()
        raise
