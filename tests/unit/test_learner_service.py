"""The learner loop over real sockets on 127.0.0.1 with a fake trainer, publisher and checkpointer."""

from __future__ import annotations

import time

import pytest
import trio
import zmq

from turnscale import conf
from turnscale.learner.service import LearnerService, ServiceParts
from turnscale.protocol import codec
from turnscale.protocol.errors import RemoteError
from turnscale.protocol.messages import (
    ErrorReply,
    Goodbye,
    GroupAck,
    Heartbeat,
    HeartbeatAck,
    Hello,
    LeaseGrant,
    LeaseRequest,
    PolicyAnnouncement,
    Shutdown,
    WeightManifest,
    Welcome,
)
from turnscale.protocol.transport import AsyncSocket, Requester, configure, free_port
from tests.unit.fakes import make_group


class FakeTrainer:
    def __init__(self):
        self.step = 0
        self.last_group_gaps: list = []  # none reported: no per-pool gap metrics
        self.trained: list[str] = []
        self.tasks: list = []

    def train_step(self, groups):
        self.trained += [g.lease_id for g in groups]
        self.tasks += [g.task for g in groups]
        self.step += 1
        return {"loss/pg": 0.1 * self.step, "grad_norm": 1.0}


class FakePublisher:
    def __init__(self):
        self.versions: list[int] = []

    def publish(self, version, state_dict):
        self.versions.append(version)
        return WeightManifest(version=version, dtype="float32", total_bytes=0, checksum_algo="crc32", tensors=[], chunks=[])

    def close(self):
        pass


class FakeSchedule:
    def limit_at(self, step):
        return 6 if step < 2 else 13


class MemCheckpointer:
    def __init__(self, trainer, store):
        self.trainer, self.store = trainer, store

    def save(self, step, extra):
        self.store.append((step, extra))

    def load_latest(self):
        if not self.store:
            return None
        step, extra = self.store[-1]
        self.trainer.step = step
        return extra


def make_cfg(**over):
    ports = [free_port() for _ in range(3)]
    args = [f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
            "learner.groups_per_step=2", "learner.max_staleness=0", "learner.steps=3", "algo.group_size=2",
            "env.tasks.train=0:20", "learner.checkpoint_every=2"]
    args += [f"{k}={v}" for k, v in over.items()]
    return conf.load(args)


async def client(ctx, cfg):
    d = configure(ctx.socket(zmq.DEALER))
    d.connect(f"tcp://127.0.0.1:{cfg.learner.port}")
    return Requester(AsyncSocket(d))


class RowLogger:
    """A metrics logger that appends each step's reduced metrics to ``rows``."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def write(self, step, metrics):
        self.rows.append(metrics)

    def close(self):
        pass


def run_service_with(cfg, parts, script):
    """Run the service and ``script(service, ctx)`` concurrently; bounded in time."""
    svc = LearnerService(cfg, parts)
    svc.linger_s = 0.3
    svc.announce_every_s = 0.2
    ctx = zmq.Context()
    out = {}

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                out["result"] = await script(svc, ctx)
                n.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        ctx.destroy(linger=0)
    return svc, out.get("result")


def test_synchronous_run_trains_every_group_once_and_advances_versions():
    cfg = make_cfg()
    trainer, pub, store, logged = FakeTrainer(), FakePublisher(), [], []

    class CaptureLogger:
        def write(self, step, metrics):
            logged.append((step, metrics))

        def close(self):
            pass

    parts = ServiceParts(trainer=trainer, publisher=pub, weights=dict, schedule=FakeSchedule(),
                         checkpointer=MemCheckpointer(trainer, store), model_path="/models/tiny", logger=CaptureLogger())

    async def script(svc, ctx):
        sub = configure(ctx.socket(zmq.SUB))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{cfg.learner.pub_port}")
        sub = AsyncSocket(sub)
        req = await client(ctx, cfg)
        w = await req.request(Hello(actor_id="a1", host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
        assert isinstance(w, Welcome) and w.model_path == "/models/tiny" and w.policy.version == 0
        assert svc.turn_limit == 6 and w.policy.manifest is not None
        seen_turn_limits, sent = [], []
        while svc.step < 3:
            g = await req.request(LeaseRequest(actor_id="a1", max_leases=4), timeout_s=5)
            assert isinstance(g, LeaseGrant)
            assert len(g.leases) <= 2  # synchronous: one batch per version
            for lease in g.leases:
                seen_turn_limits.append(lease.turn_limit)
                ack = await req.request(make_group(lease, actor_id="a1"), timeout_s=5)
                assert isinstance(ack, GroupAck) and ack.accepted, ack
                sent.append(lease.lease_id)
                dup = await req.request(make_group(lease, actor_id="a1"), timeout_s=5)
                assert (dup.accepted, dup.reason) == (False, "duplicate")
            if not g.leases:
                await trio.sleep(0.02)
        versions, shutdown = [], False
        with trio.move_on_after(5):
            while not shutdown:
                m = await sub.recv_msg()
                if isinstance(m, PolicyAnnouncement):
                    versions.append(m.version)
                shutdown = isinstance(m, Shutdown)
        bye = await req.request(Goodbye(actor_id="a1", reason="done"), timeout_s=5)
        assert isinstance(bye, GroupAck)
        sub.close()
        req.sock.close()
        return sent, seen_turn_limits, versions, shutdown

    svc, (sent, limits, versions, shutdown) = run_service_with(cfg, parts, script)
    assert trainer.step == 3 and len(trainer.trained) == 6
    assert sorted(trainer.trained) == sorted(set(trainer.trained)) == sorted(sent)
    assert pub.versions == [0, 1, 2, 3]
    assert limits == [6, 6, 6, 6, 13, 13]  # stage advances at step 2
    assert shutdown and max(versions) == 3
    assert [s for s, _ in store] == [2, 3]
    assert [st for st, _ in logged] == [1, 2, 3]
    for st, m in logged:  # rollout statistics describe the groups trained in that step
        assert m["rollout/trained_groups_total"] == 2 * st
        assert m["rollout/return"] == 0.5 and m["rollout/staleness/0"] == 2
        assert m["loss/pg"] == pytest.approx(0.1 * st) and m["loss/grad_norm"] == 1.0
        assert m["rollout/turn_limit"] == (6 if st <= 2 else 13)
    assert store[-1][1]["version"] == 3 and FakeSchedule().limit_at(store[-1][1]["step"]) == 13  # the limit follows from the step


def test_bad_messages_get_error_replies_and_the_loop_keeps_serving():
    cfg = make_cfg()
    trainer = FakeTrainer()
    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule())

    async def script(svc, ctx):
        d = configure(ctx.socket(zmq.DEALER))
        d.connect(f"tcp://127.0.0.1:{cfg.learner.port}")
        s = AsyncSocket(d)
        replies = []
        for body in ([b"\xc1garbage"], [b"\x93\x01\x02"], codec.encode(Shutdown(reason="x"))):
            await s.send_multipart([b"rid00001", *body])
            frames = await s.recv_multipart()
            replies.append(codec.decode(frames[1:]))
        req = Requester(s)

        async def ask(msg):  # an ErrorReply comes back as a value or as RemoteError, by transport version
            try:
                return await req.request(msg, timeout_s=5)
            except RemoteError as exc:
                return ErrorReply(code=exc.code, message=exc.message, retryable=exc.retryable)

        not_reg = await ask(LeaseRequest(actor_id="ghost", max_leases=1))
        hb = await ask(Heartbeat(actor_id="ghost", lease_ids=[], policy_version=0))
        await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=1), timeout_s=5)
        hb2 = await req.request(Heartbeat(actor_id="a", lease_ids=["nope"], policy_version=0), timeout_s=5)
        s.close()
        return replies, not_reg, hb, hb2

    _, (replies, not_reg, hb, hb2) = run_service_with(cfg, parts, script)
    assert all(isinstance(r, ErrorReply) and r.code == "bad_message" for r in replies)
    assert isinstance(not_reg, ErrorReply) and not_reg.code == "not_registered" and not_reg.retryable
    assert isinstance(hb, ErrorReply) and hb.code == "not_registered"
    assert isinstance(hb2, HeartbeatAck) and hb2.unknown_lease_ids == ["nope"]


def test_resume_restores_version_step_and_task_cursor():
    cfg = make_cfg(**{"learner.steps": 2})
    trainer, store = FakeTrainer(), []
    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(),
                         checkpointer=MemCheckpointer(trainer, store))

    async def play(svc, ctx, actor):
        req = await client(ctx, svc.cfg)
        await req.request(Hello(actor_id=actor, host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
        tasks = {}
        while svc.step < svc.cfg.learner.steps:
            g = await req.request(LeaseRequest(actor_id=actor, max_leases=4), timeout_s=5)
            for lease in g.leases:
                tasks[lease.lease_id] = (lease.task.data_idx, lease.turn_limit, lease.policy_version)
                await req.request(make_group(lease, actor_id=actor), timeout_s=5)
            if not g.leases:
                await trio.sleep(0.02)
        while not svc.stopping:  # the last step's publication and checkpoint are written
            await trio.sleep(0.02)
        req.sock.close()
        return tasks

    _, first = run_service_with(cfg, parts, lambda s, c: play(s, c, "a"))
    # a second learner process, same config, resume=true
    trainer2 = FakeTrainer()
    cfg2 = make_cfg(**{"learner.steps": 4})
    parts2 = ServiceParts(trainer=trainer2, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(),
                          checkpointer=MemCheckpointer(trainer2, store))

    async def resumed(svc, ctx):
        assert svc.step == 2 and svc.version == 2 and svc.turn_limit == 13
        return await play(svc, ctx, "b")

    svc2 = LearnerService(cfg2, parts2)
    assert svc2.restore()
    # straight run for reference: the task order of 4 steps
    ref_trainer = FakeTrainer()
    ref = run_service_with(make_cfg(**{"learner.steps": 4}), ServiceParts(trainer=ref_trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()), lambda s, c: play(s, c, "r"))[1]

    async def main():
        svc2.linger_s, svc2.announce_every_s = 0.3, 0.2
        ctx = zmq.Context()
        try:
            with trio.fail_after(60):
                async with trio.open_nursery() as n:
                    n.start_soon(svc2.serve)
                    await svc2.ready.wait()
                    out = await resumed(svc2, ctx)
                    n.cancel_scope.cancel()
        finally:
            ctx.destroy(linger=0)
        return out

    second = trio.run(main)
    # what was trained, in order: the resumed pair equals the straight run
    done = [first[l] for l in trainer.trained] + [second[l] for l in trainer2.trained]
    assert [t[0] for t in done] == [ref[l][0] for l in ref_trainer.trained]
    assert [second[l][1:] for l in trainer2.trained] == [(13, 2), (13, 2), (13, 3), (13, 3)]


# ----------------------------------------------------------------------------- async-core invariants


class GateTrainer(FakeTrainer):
    """Blocks inside step number ``block_step`` (1-based) until ``gate`` is set."""

    def __init__(self, block_step):
        import threading

        super().__init__()
        self.block_step, self.gate, self.inside = block_step, threading.Event(), threading.Event()

    def train_step(self, groups):
        if self.step + 1 == self.block_step:
            self.inside.set()
            assert self.gate.wait(30)
        return super().train_step(groups)


async def _wait_for(cond, what, timeout_s=20):
    with trio.fail_after(timeout_s):
        while not cond():
            await trio.sleep(0.01)


def test_group_fresh_on_arrival_but_stale_when_its_batch_forms_is_dropped_counted_and_reissued():
    """B is sampled at v0 and accepted at v1 (staleness 1 = the bound) while C's step runs;
    C's step publishes v2, so B would train at staleness 2: it is dropped, counted, and its
    task is the next one leased."""
    cfg = make_cfg(**{"learner.steps": 3, "learner.max_staleness": 1, "learner.groups_per_step": 1})
    trainer, rows = GateTrainer(block_step=2), []

    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(), logger=RowLogger(rows))

    async def script(svc, ctx):
        req = await client(ctx, cfg)
        await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
        a, b = (await req.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)).leases
        assert (await req.request(make_group(a, actor_id="a", version=0), timeout_s=5)).accepted
        await _wait_for(lambda: svc.version == 1, "v1")
        (c,) = (await req.request(LeaseRequest(actor_id="a", max_leases=1), timeout_s=5)).leases
        assert c.policy_version == 1
        assert (await req.request(make_group(c, actor_id="a", version=1), timeout_s=5)).accepted
        await trio.to_thread.run_sync(trainer.inside.wait, 10)  # C's step is running
        ack = await req.request(make_group(b, actor_id="a", version=0), timeout_s=5)
        assert ack.accepted  # staleness 1 on arrival
        trainer.gate.set()
        await _wait_for(lambda: svc.version == 2, "v2")
        await _wait_for(lambda: not svc.publishing, "publication done")
        (d,) = (await req.request(LeaseRequest(actor_id="a", max_leases=1), timeout_s=5)).leases
        assert (await req.request(make_group(d, actor_id="a", version=2), timeout_s=5)).accepted
        await _wait_for(lambda: svc.step == 3, "step 3")
        return a, b, c, d

    _, (a, b, c, d) = run_service_with(cfg, parts, script)
    assert trainer.trained == [a.lease_id, c.lease_id, d.lease_id]  # never b
    assert d.task == b.task  # b's task re-issued first
    assert sum(r.get("rollout/groups_dropped/stale", 0) for r in rows) == 1
    assert all(r.get("rollout/staleness_max", 0) <= 1 for r in rows)


def test_a_group_whose_trajectory_log_write_fails_is_still_trained_exactly_once():
    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 0})
    trainer = FakeTrainer()

    class BrokenLog:
        def write_group(self, group, **kw):
            raise OSError(28, "No space left on device")

        def write_batch_entry(self, group, **kw):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    rows = []

    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(),
                         trajlog=BrokenLog(), logger=RowLogger(rows))

    async def script(svc, ctx):
        req = await client(ctx, cfg)
        await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
        sent, acks = [], []
        while svc.step < 2:
            for lease in (await req.request(LeaseRequest(actor_id="a", max_leases=4), timeout_s=5)).leases:
                sent.append(lease.lease_id)
                acks.append(await req.request(make_group(lease, actor_id="a"), timeout_s=5))
            await trio.sleep(0.01)
        resend = await req.request(make_group(lease, actor_id="a"), timeout_s=5)
        return sent, acks, resend

    _, (sent, acks, resend) = run_service_with(cfg, parts, script)
    assert all(a.accepted for a in acks)
    assert sorted(trainer.trained) == sorted(sent) and len(set(trainer.trained)) == len(trainer.trained) == 4
    assert (resend.accepted, resend.reason) == (False, "duplicate")
    assert sum(r.get("rollout/trajlog_errors", 0) for r in rows) >= 4


def test_a_step_the_trainer_refuses_publishes_nothing():
    cfg = make_cfg(**{"learner.steps": 1, "learner.max_staleness": 0})

    class NanOnce(FakeTrainer):
        def __init__(self):
            super().__init__()
            self.refused = 0

        def train_step(self, groups):
            if not self.refused:
                self.refused += 1
                return {"train/nonfinite": 1.0}
            return super().train_step(groups)

    trainer, pub, rows = NanOnce(), FakePublisher(), []

    parts = ServiceParts(trainer=trainer, publisher=pub, weights=dict, schedule=FakeSchedule(), logger=RowLogger(rows))

    async def script(svc, ctx):
        req = await client(ctx, cfg)
        await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
        while svc.step < 1:
            for lease in (await req.request(LeaseRequest(actor_id="a", max_leases=4), timeout_s=5)).leases:
                await req.request(make_group(lease, actor_id="a"), timeout_s=5)
            await trio.sleep(0.01)
        await _wait_for(lambda: svc.version == 1, "v1")

    run_service_with(cfg, parts, script)
    assert trainer.refused == 1 and trainer.step == 1
    assert pub.versions == [0, 1]  # the refused step published nothing
    assert sum(r.get("train/steps_skipped/nonfinite", 0) for r in rows) == 1


def test_no_lease_is_granted_while_weights_are_published_and_later_ones_carry_the_new_stage():
    import threading

    cfg = make_cfg(**{"learner.steps": 3, "learner.max_staleness": 1})
    gate, inside = threading.Event(), threading.Event()

    class SlowPublisher(FakePublisher):
        def publish(self, version, sd):
            if version == 2:  # the publication after step 2, where FakeSchedule moves 6 -> 13
                inside.set()
                assert gate.wait(30)
            return super().publish(version, sd)

    parts = ServiceParts(trainer=FakeTrainer(), publisher=SlowPublisher(), weights=dict, schedule=FakeSchedule())

    async def script(svc, ctx):
        req = await client(ctx, cfg)
        await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=8), timeout_s=5)
        while not inside.is_set():
            for lease in (await req.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)).leases:
                await req.request(make_group(lease, actor_id="a"), timeout_s=5)
            await trio.sleep(0.01)
        during = await req.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)
        gate.set()
        await _wait_for(lambda: svc.version == 2 and not svc.publishing, "v2")
        after = await req.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)
        return during, after

    _, (during, after) = run_service_with(cfg, parts, script)
    assert during.leases == [] and 0 < during.retry_after_s <= 0.5
    assert after.leases and all(l.policy_version == 2 and l.turn_limit == 13 for l in after.leases)


# ----------------------------------------------------------------------------- shutdown reaches every actor


def test_after_the_last_step_requests_are_answered_shutdown_and_the_learner_waits_for_goodbyes():
    """PUB is lossy and a reconnecting actor is not subscribed, so once the run is over the
    learner answers Hello, LeaseRequest and Heartbeat with ``Shutdown``; it lingers while a
    registered actor has not said goodbye (not a fixed sleep) and leaves once it has."""
    cfg = make_cfg(**{"learner.steps": 1, "learner.heartbeat_interval_s": 5})
    trainer = FakeTrainer()
    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule())
    svc = LearnerService(cfg, parts)
    svc.linger_s, svc.announce_every_s = 30.0, 0.2
    ctx = zmq.Context()
    seen = {}

    async def script():
        a = await client(ctx, cfg)
        await a.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=2, token="ta"), timeout_s=5)
        b = await client(ctx, cfg)
        await b.request(Hello(actor_id="b", host="h", pid=2, engine="fake", device="cpu", max_groups=2, token="tb"), timeout_s=5)
        while svc.step < 1:
            g = await a.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)
            for lease in g.leases:
                await a.request(make_group(lease, actor_id="a"), timeout_s=5)
            await trio.sleep(0.02)
        await _wait_for(lambda: svc.stopping, "stopping")
        seen["lease"] = await a.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)
        seen["heartbeat"] = await a.request(Heartbeat(actor_id="a", lease_ids=[], policy_version=1), timeout_s=5)
        late = await client(ctx, cfg)  # a newcomer, and "b" reconnecting on a new connection
        seen["newcomer"] = await late.request(Hello(actor_id="c", host="h", pid=3, engine="fake", device="cpu", max_groups=1), timeout_s=5)
        b2 = await client(ctx, cfg)
        seen["reconnect"] = await b2.request(Hello(actor_id="b", host="h", pid=2, engine="fake", device="cpu", max_groups=2, token="tb"), timeout_s=5)
        await trio.sleep(0.5)
        seen["lingering"] = not svc.done  # "a" has not said goodbye yet
        t0 = trio.current_time()
        await a.request(Goodbye(actor_id="a", reason="learner shutdown: done"), timeout_s=5)
        await _wait_for(lambda: svc.done, "done after the last goodbye", timeout_s=10)
        seen["left_after_s"] = trio.current_time() - t0

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                await script()

    try:
        trio.run(main)
    finally:
        ctx.destroy(linger=0)
    for key in ("lease", "heartbeat", "newcomer", "reconnect"):
        assert isinstance(seen[key], Shutdown), (key, seen[key])
    assert seen["lingering"]
    assert seen["left_after_s"] < 5  # not the 30 s bound
    assert "c" not in svc.actors.actors  # the newcomer was never registered


def test_a_checkpoint_from_before_schema_3_with_a_turn_limit_in_extra_still_resumes():
    """``extra["turn_limit"]`` is no longer written (the schedule gives it from the step); an
    old checkpoint that has one resumes, and the limit still comes from the schedule."""
    cfg = make_cfg()
    trainer, store = FakeTrainer(), []
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(),
                                           checkpointer=MemCheckpointer(trainer, store)))
    trainer.step = 2
    svc.run.advance(2, 4)
    svc.run.publish(2)
    extra = svc.checkpoint_extra()
    assert "turn_limit" not in extra
    store.append((2, {**extra, "turn_limit": 99}))
    trainer2 = FakeTrainer()
    svc2 = LearnerService(cfg, ServiceParts(trainer=trainer2, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(),
                                            checkpointer=MemCheckpointer(trainer2, store)))
    assert svc2.restore() and (svc2.step, svc2.version, svc2.turn_limit) == (2, 2, 13)


def test_a_drained_actor_gets_no_new_lease_finishes_its_groups_then_is_told_to_leave():
    """``ControlRequest(drain=[...])``: the learner stops leasing to the actor, its in-flight
    group is still accepted and trained, then its next ``LeaseRequest`` is answered
    ``Shutdown("drained")``; the reply carries the signals, split by pool."""
    from turnscale.protocol.messages import ControlRequest, LearnerStatus

    cfg = make_cfg(**{"learner.steps": 50, "learner.max_staleness": 3})
    trainer = FakeTrainer()
    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule())
    seen = {}

    async def script(svc, ctx):
        a = await client(ctx, cfg)
        await a.request(Hello(actor_id="a", host="h1", pid=1, engine="fake", device="cpu", max_groups=2, pool="cpu"), timeout_s=5)
        b = await client(ctx, cfg)
        await b.request(Hello(actor_id="b", host="h2", pid=2, engine="fake", device="cpu", max_groups=2, pool="gpu"), timeout_s=5)
        g = await a.request(LeaseRequest(actor_id="a", max_leases=1), timeout_s=5)
        held = g.leases[0]
        ctl = await client(ctx, cfg)
        st = await ctl.request(ControlRequest(drain=["a", "nobody"], max_leases_per_actor=1), timeout_s=5)
        seen["status"] = st
        seen["grant_while_draining"] = await a.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)
        seen["b_grant"] = await b.request(LeaseRequest(actor_id="b", max_leases=2), timeout_s=5)  # limit 1 now
        seen["ack"] = await a.request(make_group(held, actor_id="a"), timeout_s=5)
        seen["after"] = await a.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)
        await a.request(Goodbye(actor_id="a", reason="learner shutdown: drained"), timeout_s=5)
        seen["final"] = await ctl.request(ControlRequest(), timeout_s=5)
        return held.lease_id

    svc, held = run_service_with(cfg, parts, script)
    st = seen["status"]
    assert isinstance(st, LearnerStatus) and st.max_leases_per_actor == 1 and st.live_leases == 1
    by_id = {x.actor_id: x for x in st.actors}
    assert (by_id["a"].pool, by_id["a"].draining, by_id["a"].leases) == ("cpu", True, 1)
    assert (by_id["b"].pool, by_id["b"].draining) == ("gpu", False)
    assert seen["grant_while_draining"].leases == []
    assert len(seen["b_grant"].leases) == 1
    assert seen["ack"].accepted
    assert isinstance(seen["after"], Shutdown) and seen["after"].reason == "drained"
    fin = seen["final"]
    assert [x.actor_id for x in fin.actors] == ["b"] and fin.groups_received == 1
    assert fin.ready_groups + fin.groups_trained == 1  # the drained actor's group is kept
    assert fin.uptime_s >= fin.idle_s >= 0


def test_step_metrics_are_split_by_actor_pool():
    """Two actors in two pools: each pool's actors, generated tokens/s (from heartbeats) and
    the staleness of the groups it played appear as ``pool/<name>/...``."""
    cfg = make_cfg(**{"learner.steps": 2, "learner.groups_per_step": 2})
    trainer, logged = FakeTrainer(), []

    class CaptureLogger:
        def write(self, step, metrics):
            logged.append(dict(metrics))

        def close(self):
            pass

    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(), logger=CaptureLogger())

    async def script(svc, ctx):
        reqs = {}
        for aid, pool in (("a", "cpu"), ("b", "gpu")):
            reqs[aid] = await client(ctx, cfg)
            await reqs[aid].request(Hello(actor_id=aid, host="h", pid=1, engine="fake", device="cpu", max_groups=1, pool=pool), timeout_s=5)
        tokens = {"a": 0.0, "b": 0.0}
        while svc.step < 2:
            for aid, req in reqs.items():
                tokens[aid] += 100.0 if aid == "a" else 400.0
                await req.request(Heartbeat(actor_id=aid, lease_ids=[], policy_version=svc.version,
                                            stats={"tokens_generated": tokens[aid], "weight_pulls": 1.0, "weight_pull_s": 0.5}), timeout_s=5)
                g = await req.request(LeaseRequest(actor_id=aid, max_leases=1), timeout_s=5)
                for lease in g.leases:
                    await req.request(make_group(lease, actor_id=aid), timeout_s=5)
            await trio.sleep(0.02)

    run_service_with(cfg, parts, script)
    last = logged[-1]
    assert last["pool/cpu/actors"] == 1 and last["pool/gpu/actors"] == 1
    assert last["pool/gpu/tokens_generated_per_s"] > last["pool/cpu/tokens_generated_per_s"] > 0
    assert last["pool/cpu/weight_pull_s_mean"] == 0.5
    assert any("pool/cpu/staleness_mean" in m for m in logged) and any("pool/gpu/staleness_mean" in m for m in logged)
    from turnscale.learner.metrics import format_progress

    line = format_progress(2, last)
    assert "| pools cpu 1a" in line and "gpu 1a" in line


def test_a_groups_pool_and_logprob_gap_count_even_after_its_actor_has_left():
    """The pool is recorded with the group when it is accepted: actor ``a`` (pool ``cpu``)
    sends its group and says goodbye before the step trains it; the step still reports
    ``pool/cpu/...`` staleness and the trainer's gap for that group (fake sums: cpu 0.25
    nats per token, gpu 0.5), each at staleness 0 too."""
    from turnscale.learner.poolgap import GroupGap

    cfg = make_cfg(**{"learner.steps": 1, "learner.groups_per_step": 2})
    per_actor = {"a": GroupGap(tokens=4, abs_gap_sum=1.0, weight_sum=5.0), "b": GroupGap(tokens=2, abs_gap_sum=1.0, weight_sum=3.0)}

    class GapTrainer(FakeTrainer):
        def train_step(self, groups):
            self.last_group_gaps = [per_actor[g.actor_id] for g in groups]
            return super().train_step(groups)

    logged = []

    class CaptureLogger:
        def write(self, step, metrics):
            logged.append(dict(metrics))

        def close(self):
            pass

    parts = ServiceParts(trainer=GapTrainer(), publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(), logger=CaptureLogger())

    async def script(svc, ctx):
        for aid, pool in (("a", "cpu"), ("b", "gpu")):
            req = await client(ctx, cfg)
            await req.request(Hello(actor_id=aid, host="h", pid=1, engine="fake", device="cpu", max_groups=1, pool=pool), timeout_s=5)
            g = await req.request(LeaseRequest(actor_id=aid, max_leases=1), timeout_s=5)
            assert (await req.request(make_group(g.leases[0], actor_id=aid), timeout_s=5)).accepted
            if aid == "a":
                await req.request(Goodbye(actor_id="a", reason="done"), timeout_s=5)
                assert "a" not in svc.actors.actors and svc.step == 0
        with trio.fail_after(20):
            while svc.step < 1:
                await trio.sleep(0.01)

    run_service_with(cfg, parts, script)
    m = logged[0]
    assert m["pool/cpu/staleness_mean"] == 0 and m["pool/gpu/staleness_mean"] == 0
    assert not any(k.startswith("pool/departed/") for k in m)
    assert m["pool/cpu/logprob_gap_mean"] == 0.25 and m["pool/cpu/behaviour_weight_mean"] == 1.25
    assert m["pool/gpu/logprob_gap_mean"] == 0.5 and m["pool/gpu/behaviour_weight_mean"] == 1.5
    assert m["pool/cpu/logprob_gap_mean_staleness0"] == 0.25 and m["pool/gpu/logprob_gap_mean_staleness0"] == 0.5


def test_autoscaler_reads_the_real_learner_and_acts_through_the_backend():
    """``turnscale.control.Autoscaler`` against the real service: a pool above its max is
    drained down (the least busy actor, told through the learner), a starved learner gets
    more actors from the backend (a fake backend records the calls)."""
    from turnscale.control import Autoscaler, LearnerControl
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy

    cfg = make_cfg(**{"learner.steps": 50})
    parts = ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict, schedule=FakeSchedule())

    class Backend:
        def __init__(self):
            self.calls = []

        def scale_to(self, pool, n):
            self.calls.append(("scale_to", pool, n))

        def drain(self, actor_id):
            self.calls.append(("drain", actor_id))

    backend = Backend()
    seen = {}

    async def script(svc, ctx):
        reqs = {}
        for aid, pool in (("a", "cpu"), ("b", "cpu"), ("g", "gpu")):
            reqs[aid] = await client(ctx, cfg)
            await reqs[aid].request(Hello(actor_id=aid, host="h", pid=1, engine="fake", device="cpu", max_groups=2, pool=pool), timeout_s=5)
        await reqs["a"].request(LeaseRequest(actor_id="a", max_leases=1), timeout_s=5)  # "a" is busier than "b"
        control = LearnerControl("127.0.0.1", cfg.learner.port, timeout_s=10)
        policy = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=1),
                                      PoolPolicy(name="gpu", min_actors=0, max_actors=2, cost=2.0)),
                               window=1, max_leases=2, up_idle=0.2, down_idle=0.01)
        auto = Autoscaler(control=control, controller=ScalingController(policy, wanted={"cpu": 2, "gpu": 1}), backend=backend)
        try:
            seen["first"] = await trio.to_thread.run_sync(auto.tick)  # no interval yet
            await trio.sleep(0.3)
            seen["clamp"] = await trio.to_thread.run_sync(auto.tick)  # cpu 2 > max 1: drain one
            seen["draining"] = {a.actor_id for a in svc.actors.values() if a.draining}
            await trio.sleep(0.3)
            seen["starved"] = await trio.to_thread.run_sync(auto.tick)  # learner idle, nothing ready: gpu + 1
        finally:
            control.close()

    run_service_with(cfg, parts, script)
    assert seen["first"] is None
    assert seen["clamp"].changed and seen["clamp"].wanted["cpu"] == 1
    assert seen["draining"] == {"b"}
    assert ("drain", "b") in backend.calls
    assert seen["starved"].changed and backend.calls[-1] == ("scale_to", "gpu", 2), (seen["starved"].reason, backend.calls)


# ----------------------------------------------------------------------------- SIGTERM at any point of the step cycle


class LedgerLog:
    """The training ledger (``write_batch_entry``) in memory: data_idx of every trained group."""

    def __init__(self):
        self.trained: list[int] = []

    def write_group(self, group, **kw):
        pass

    def write_batch_entry(self, group, *, outcome, **kw):
        if outcome == "trained":
            self.trained.append(group.task.data_idx)

    def close(self):
        pass


class GatedPublisher(FakePublisher):
    def __init__(self, block_version):
        import threading

        super().__init__()
        self.block_version, self.gate, self.inside = block_version, threading.Event(), threading.Event()

    def publish(self, version, sd):
        if version == self.block_version:
            self.inside.set()
            assert self.gate.wait(30)
        return super().publish(version, sd)


class GatedCheckpointer(MemCheckpointer):
    def __init__(self, trainer, store, block_step):
        import threading

        super().__init__(trainer, store)
        self.block_step, self.gate, self.inside = block_step, threading.Event(), threading.Event()

    def save(self, step, extra):
        if step == self.block_step:
            self.inside.set()
            assert self.gate.wait(30)
        super().save(step, extra)


def _reissued_after_resume(cfg, store, old_cursor):
    """data_idx of every task a learner resumed from ``store``'s newest checkpoint hands out
    again: its re-issue queue, then its cursor's tasks up to where the stopped learner's
    cursor was (tasks leased after the checkpoint was taken)."""
    from turnscale.learner.tasks import TaskStream

    trainer = FakeTrainer()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict,
                                           schedule=FakeSchedule(), checkpointer=MemCheckpointer(trainer, store)))
    assert svc.restore()
    stream = svc.leases.stream
    out = [t.data_idx for t in stream.pending_reissue]
    replay = TaskStream(stream.tasks, seed=stream.seed, cursor=stream.cursor)
    for _ in range(len(stream.tasks) * 3):
        if replay.cursor == old_cursor:
            break
        out.append(replay.next().data_idx)
    assert replay.cursor == old_cursor
    return out


@pytest.mark.parametrize("point", ["waiting_for_groups", "training_with_next_batch_buffered", "publishing",
                                   "periodic_checkpoint"])
def test_sigterm_at_any_point_of_the_step_cycle_loses_no_acknowledged_group(point):
    """A stop (``learner.main.checkpoint_and_stop``, what SIGTERM runs) while an actor keeps
    sending: every group acked ``accepted=True`` is in the training ledger or handed out
    again by the resumed learner.  ``training_with_next_batch_buffered`` is the old loss: the
    stop waited for the step's lock, the train loop took the next batch out of the buffer
    before the stop got the lock, and the checkpoint saw those groups nowhere."""
    from collections import Counter

    from turnscale.learner.main import checkpoint_and_stop

    cfg = make_cfg(**{"learner.steps": 10, "learner.max_staleness": 2,
                      "learner.checkpoint_every": 2 if point == "periodic_checkpoint" else 100})
    store, ledger = [], LedgerLog()
    trainer = GateTrainer(block_step=2 if point == "training_with_next_batch_buffered" else 0)
    publisher = GatedPublisher(block_version=2 if point == "publishing" else -1)
    ckpt = GatedCheckpointer(trainer, store, block_step=2 if point == "periodic_checkpoint" else -1)
    gated = {"training_with_next_batch_buffered": trainer, "publishing": publisher, "periodic_checkpoint": ckpt}.get(point)
    parts = ServiceParts(trainer=trainer, publisher=publisher, weights=dict, schedule=FakeSchedule(),
                         checkpointer=ckpt, trajlog=ledger)
    svc = LearnerService(cfg, parts)
    svc.linger_s, svc.announce_every_s = 0.3, 0.2
    ctx = zmq.Context()
    acked: list[int] = []
    limit = 5 if point == "waiting_for_groups" else 10**6

    async def feed(req):
        held = 0
        while len(acked) < limit:
            for lease in (await req.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)).leases:
                if held < 1 and len(acked) == 3:  # one lease stays live, unanswered: re-issued on resume
                    held += 1
                    continue
                ack = await req.request(make_group(lease, actor_id="a"), timeout_s=5)
                if ack.accepted:
                    acked.append(lease.task.data_idx)
                if len(acked) >= limit:
                    return
            await trio.sleep(0.005)

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                req = await client(ctx, cfg)
                await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=8), timeout_s=5)
                n.start_soon(feed, req)
                if gated is None:  # the train loop waits for its next batch, one group short
                    await _wait_for(lambda: len(acked) == limit and svc.step == 2 and len(svc.buffer) == 1, "waiting")
                    await checkpoint_and_stop(n.cancel_scope, svc)
                    return
                await trio.to_thread.run_sync(gated.inside.wait, 20)
                if point == "training_with_next_batch_buffered":  # (no lease is granted while publishing)
                    await _wait_for(lambda: len(svc.buffer) >= cfg.learner.groups_per_step, "the next batch buffered")
                async with trio.open_nursery() as stop:
                    stop.start_soon(checkpoint_and_stop, n.cancel_scope, svc)
                    await _wait_for(lambda: svc.train_lock.statistics().tasks_waiting >= 1, "the stop waits for the step")
                    gated.gate.set()

    try:
        trio.run(main)
    finally:
        ctx.destroy(linger=0)
    assert store, "a checkpoint was written"
    assert svc.step == store[-1][0]  # no step after the checkpoint
    reissued = _reissued_after_resume(cfg, store, svc.leases.stream.cursor)
    lost = Counter(acked) - Counter(ledger.trained) - Counter(reissued)
    assert not lost, (point, acked, ledger.trained, reissued)
    assert len(acked) > len(ledger.trained)  # some acked groups were still untrained at the stop


async def _ask(req, msg):
    """The reply, or the ``ErrorReply`` a ``RemoteError`` carried."""
    try:
        return await req.request(msg, timeout_s=5)
    except RemoteError as exc:
        return ErrorReply(code=exc.code, message=exc.message, retryable=exc.retryable)


def _hello(aid, max_groups=2):
    return Hello(actor_id=aid, host="h", pid=1, engine="fake", device="cpu", max_groups=max_groups)


def test_a_hoarder_holds_no_more_than_its_share_once_another_actor_asks():
    """Default lease settings (window (1 + 1) * 4 = 8, 64 leases per actor): a client asking
    for 10^6 leases alone gets the window; an honest actor asking next gets what it asks for
    at once, and the hoarder's further requests get nothing while the honest one contends."""
    cfg = make_cfg(**{"learner.steps": 50, "learner.max_staleness": 1, "learner.groups_per_step": 4})
    parts = ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict, schedule=FakeSchedule())
    seen = {}

    async def script(svc, ctx):
        from turnscale.protocol.messages import ControlRequest

        hoarder, honest, ctl = await client(ctx, cfg), await client(ctx, cfg), await client(ctx, cfg)
        await hoarder.request(_hello("hoarder", max_groups=1000), timeout_s=5)
        await honest.request(_hello("honest"), timeout_s=5)
        seen["alone"] = await hoarder.request(LeaseRequest(actor_id="hoarder", max_leases=1_000_000), timeout_s=5)
        seen["honest"] = await honest.request(LeaseRequest(actor_id="honest", max_leases=2), timeout_s=5)
        seen["again"] = await hoarder.request(LeaseRequest(actor_id="hoarder", max_leases=1_000_000), timeout_s=5)
        seen["hb"] = await hoarder.request(Heartbeat(actor_id="hoarder", lease_ids=[l.lease_id for l in seen["alone"].leases],
                                                     policy_version=0), timeout_s=5)
        seen["status"] = await ctl.request(ControlRequest(), timeout_s=5)

    svc, _ = run_service_with(cfg, parts, script)
    assert len(seen["alone"].leases) == 8
    assert len(seen["honest"].leases) == 2 and seen["again"].leases == []
    revoked = [l.lease_id for l in seen["alone"].leases[-2:]]  # the youngest: the least work lost
    assert sorted(seen["hb"].unknown_lease_ids) == sorted(revoked)  # the hoarder is told to abandon them
    by_id = {a.actor_id: a.leases for a in seen["status"].actors}
    assert by_id == {"hoarder": 6, "honest": 2}
    assert svc.metrics.reduce().get("rollout/leases_revoked") == 2


def test_a_heartbeat_without_generation_progress_does_not_keep_leases_alive():
    """learner.lease_progress_timeout_s: both actors heartbeat every 0.1 s; the one whose
    tokens_generated grows keeps its lease, the one whose engine hangs loses it (named
    unknown in its HeartbeatAck, its task re-issued) although its heartbeats never stop."""
    cfg = make_cfg(**{"learner.steps": 50, "learner.max_staleness": 3, "learner.lease_progress_timeout_s": 0.6,
                      "learner.lease_ttl_s": 30})
    parts = ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict, schedule=FakeSchedule())
    seen = {"busy": [], "hung": []}

    async def script(svc, ctx):
        reqs = {aid: await client(ctx, cfg) for aid in seen}
        held = {}
        for aid, req in reqs.items():
            await req.request(_hello(aid, max_groups=1), timeout_s=5)
            (held[aid],) = (await req.request(LeaseRequest(actor_id=aid, max_leases=1), timeout_s=5)).leases
        t0 = trio.current_time()
        tokens = 0.0
        while trio.current_time() - t0 < 1.5:
            tokens += 10.0
            for aid, req in reqs.items():
                stats = {"tokens_generated": tokens if aid == "busy" else 5.0, "engine_busy": 1.0}
                ack = await req.request(Heartbeat(actor_id=aid, lease_ids=[held[aid].lease_id], policy_version=0,
                                                  stats=stats), timeout_s=5)
                seen[aid].append((trio.current_time() - t0, ack.unknown_lease_ids))
            await trio.sleep(0.1)
        return held, svc.leases.stream.next()

    _, (held, next_task) = run_service_with(cfg, parts, script)
    assert all(unknown == [] for _, unknown in seen["busy"])
    lost = [t for t, unknown in seen["hung"] if unknown == [held["hung"].lease_id]]
    assert lost and 0.6 <= lost[0] < 1.2, seen["hung"]  # gone after the timeout, not before
    assert all(unknown == [] for t, unknown in seen["hung"] if t < 0.6)
    assert next_task == held["hung"].task  # re-issued


def test_one_connection_gets_one_actor_id_and_the_refusal_names_the_key_to_raise():
    cfg = make_cfg()
    parts = ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict, schedule=FakeSchedule())

    async def script(svc, ctx):
        req = await client(ctx, cfg)
        first = await _ask(req, _hello("a"))
        second = await _ask(req, _hello("b"))
        again = await _ask(req, _hello("a"))
        elsewhere = await _ask(await client(ctx, cfg), _hello("b"))
        return first, second, again, elsewhere

    _, (first, second, again, elsewhere) = run_service_with(cfg, parts, script)
    assert isinstance(first, Welcome) and isinstance(again, Welcome) and isinstance(elsewhere, Welcome)
    assert isinstance(second, ErrorReply) and second.code == "too_many_actor_ids"
    assert "learner.max_actor_ids_per_connection" in second.message


def test_one_curve_key_registers_at_most_max_actor_ids_per_key_over_all_its_connections(tmp_path):
    """CURVE on: 9 connections with one client key (each its own routing identity) register
    8 actor ids (``learner.max_actor_ids_per_key``); the 9th is refused; another key is not."""
    import logging

    from turnscale.protocol.curve import ZapAuthenticator, create_keys, load_cert, load_secret
    from turnscale.protocol.transport import CurveKeys

    ks = create_keys(str(tmp_path / "k"), actors=2)
    lpub, lsec = load_secret(ks.learner_secret)
    cfg = make_cfg()
    ctx = zmq.Context()
    auth = ZapAuthenticator(ctx, ks.authorized, logging.getLogger("test.zap"))
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict,
                                           schedule=FakeSchedule(), curve=CurveKeys(public=lpub, secret=lsec), context=ctx))
    svc.linger_s, svc.announce_every_s = 0.3, 0.2
    replies = []

    async def connect(secret_path):
        pub, sec = load_secret(secret_path)
        keys = CurveKeys(public=pub, secret=sec, server_public=load_cert(ks.learner_public)[0])
        d = configure(ctx.socket(zmq.DEALER), curve=keys)
        d.connect(f"tcp://127.0.0.1:{cfg.learner.port}")
        return Requester(AsyncSocket(d))

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                for i in range(9):
                    replies.append(await _ask(await connect(ks.actor_secrets[0]), _hello(f"k1-{i}")))
                replies.append(await _ask(await connect(ks.actor_secrets[1]), _hello("k2-0")))
                n.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        auth.stop()
        ctx.destroy(linger=0)
    assert all(isinstance(r, Welcome) for r in replies[:8]), replies[:8]
    assert isinstance(replies[8], ErrorReply) and replies[8].code == "too_many_actor_ids"
    assert "learner.max_actor_ids_per_key" in replies[8].message
    assert isinstance(replies[9], Welcome)
    assert {a.peer_key for a in svc.actors.values()} == {load_cert(p)[0].decode() for p in ks.actor_secrets}


# ----------------------------------------------------------------------------- one group cannot cost everyone a step


def test_intake_bounds_reward_magnitude_and_refuses_non_finite_logprobs_anywhere():
    """Defaults: ``learner.max_abs_reward`` (1e6) refuses 1e300 with the field and the key
    named, while legal rewards (SciWorld's native -100..100) pass; a NaN log-prob on a
    non-sampled token is refused too (off the mask a log-prob is unused: honest actors send 0)."""
    from dataclasses import replace

    import numpy as np

    cfg = make_cfg(**{"learner.groups_per_step": 5})
    assert cfg.learner.max_abs_reward == 1e6
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict,
                                           schedule=FakeSchedule()))
    leases = svc.leases.grant("a", 5, now=0.0)

    def send(lease, **ep_change):
        g = make_group(lease, actor_id="a", rewards=[1.0, 0.0])
        return svc.leases.intake(replace(g, episodes=[replace(g.episodes[0], **ep_change), g.episodes[1]]), now=0.0)

    huge = send(leases[0], reward=1e300)
    assert (huge.accepted, huge.reason) == (False, "invalid")
    assert huge.problem.startswith("episodes[0].reward: 1e+300 outside [-1e+06, 1e+06]") and "learner.max_abs_reward" in huge.problem
    ep = make_group(leases[1], actor_id="a").episodes[0]
    turns = [replace(t, reward=-1e7) if t.index == 0 else t for t in ep.turns]
    assert send(leases[1], turns=turns).problem.startswith("episodes[0].turns[0].reward: -1e+07 outside")
    lps = ep.logprobs.copy()
    lps[0] = np.nan  # a prompt token
    off = send(leases[2], logprobs=lps)
    assert (off.reason, off.problem) == ("invalid", "episodes[0].logprobs: a non-sampled token's (loss_mask 0: send 0.0) "
                                                    "log-prob at position 0 is not finite")
    assert send(leases[3], reward=-100.0).accepted and send(leases[4], reward=100.0).accepted


def test_groups_the_trainer_drops_as_non_finite_are_reissued_and_ledgered_while_the_rest_train():
    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 0})
    ledger, rows = [], []

    class DropsSecond(FakeTrainer):
        last_dropped: dict = {}

        def train_step(self, groups):
            self.last_dropped = {1: "new log-probs"}
            self.trained += [groups[0].lease_id]
            self.step += 1
            return {"loss/pg": 0.1}

    class Ledger(LedgerLog):
        def write_batch_entry(self, group, *, outcome, **kw):
            ledger.append((group.lease_id, outcome, kw["step"]))

    trainer = DropsSecond()
    parts = ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule(),
                         trajlog=Ledger(), logger=RowLogger(rows))

    async def script(svc, ctx):
        req = await client(ctx, cfg)
        await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
        first, second = (await req.request(LeaseRequest(actor_id="a", max_leases=2), timeout_s=5)).leases
        for lease in (first, second):
            assert (await req.request(make_group(lease, actor_id="a"), timeout_s=5)).accepted
        await _wait_for(lambda: svc.step == 1 and svc.version == 1, "step 1 published")
        (again,) = (await req.request(LeaseRequest(actor_id="a", max_leases=1), timeout_s=5)).leases
        return first, second, again, svc.trained_groups

    _, (first, second, again, trained_groups) = run_service_with(cfg, parts, script)
    assert ledger == [(second.lease_id, "dropped_nonfinite", 1), (first.lease_id, "trained", 1)]
    assert again.task == second.task  # the dropped group's task is played again
    assert trained_groups == 1
    assert sum(r.get("train/groups_dropped/nonfinite", 0) for r in rows) == 1


def test_the_time_each_version_took_to_publish_is_a_metric():
    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 0})
    rows: list[dict] = []

    class SlowPublisher(FakePublisher):
        def publish(self, version, state_dict):
            time.sleep(0.05)
            return super().publish(version, state_dict)

    trainer = FakeTrainer()
    parts = ServiceParts(trainer=trainer, publisher=SlowPublisher(), weights=dict, schedule=FakeSchedule(), logger=RowLogger(rows))

    async def script(svc, ctx):
        req = await client(ctx, cfg)
        await req.request(Hello(actor_id="a", host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
        while svc.step < 2:
            for lease in (await req.request(LeaseRequest(actor_id="a", max_leases=4), timeout_s=5)).leases:
                await req.request(make_group(lease, actor_id="a"), timeout_s=5)
            await trio.sleep(0.01)

    run_service_with(cfg, parts, script)
    times = [r["weights/publish_s"] for r in rows if "weights/publish_s" in r]
    assert times and all(t >= 0.05 for t in times)  # version 0's publication is in step 1's row
