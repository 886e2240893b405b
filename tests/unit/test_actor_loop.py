"""The actor loop against the real learner service (fake trainer) over 127.0.0.1, with a
real ``ThreadedEngine`` whose swap is deferred and slow (``ChecksumEngine``), fake env
client and fake group player.  Weights travel through a receive buffer the actor chooses,
like production: the fake pull writes the version's weights into it and returns views."""

from __future__ import annotations

import numpy as np
import trio
import zmq

from turnscale.actors.actor import Actor, ActorDeps, Runtime
from turnscale.actors.engine import GenerateRequest
from turnscale.learner.registry import ActorInfo
from turnscale.learner.service import LearnerService, ServiceParts
from turnscale.protocol.messages import SamplingParams
from tests.unit.checksum_engine import ChecksumEngine, version_weights, weights_token
from tests.unit.fakes import make_group
from tests.unit.test_learner_service import FakePublisher, FakeSchedule, FakeTrainer, make_cfg

SIZE = 4096


class Buffer:
    """The receive buffer the actor hands to ``pull`` (one of two; reused across versions)."""

    def __init__(self):
        self.array = np.zeros(SIZE, np.float32)


async def fake_pull(sock, manifest, timeout_s, buffer):
    """Write version ``manifest.version``'s weights into ``buffer`` piece by piece (yielding
    between pieces, like chunks arriving) and return a view of it, as the real pull does."""
    want = version_weights(manifest.version, SIZE)
    for a in range(0, SIZE, SIZE // 8):
        buffer.array[a:a + SIZE // 8] = want[a:a + SIZE // 8]
        await trio.sleep(0)
    return {"w": buffer.array}


class CaptureLogger:
    def __init__(self):
        self.rows = []

    def write(self, step, metrics):
        self.rows.append((step, metrics))

    def close(self):
        pass


class FakeEnvClient:
    def __init__(self, fail_steps=(), step_s=0.001):
        self.n = 0
        self.step_s = step_s
        self.created, self.closed, self.resets, self.steps = [], [], 0, 0
        self.fail_steps = set(fail_steps)

    async def create(self):
        self.n += 1
        self.created.append(self.n)
        return self.n

    async def reset(self, env_id, data_idx):
        self.resets += 1
        return {"observation": f"task {data_idx}", "info": {"category": "GoTo"}}

    async def step(self, env_id, action):
        self.steps += 1
        await trio.sleep(self.step_s)
        if self.steps in self.fail_steps:
            raise ConnectionError("env server hiccup")
        return {"observation": "ok", "reward": 1.0, "done": True}


    async def close(self, env_id):
        self.closed.append(env_id)
        return True


def make_actor(cfg, env_client, engine):
    async def play_group(lease, sessions):
        assert len(sessions) == lease.group_size
        errored = False
        for s in sessions:
            await s.reset(lease.task.data_idx)
            try:
                await s.step("go")
            except ConnectionError:
                errored = True
        return make_group(lease, actor_id=actor.actor_id, version=engine.version, failed=errored)

    async def make_runtime(welcome):
        return Runtime(engine=engine, play_group=play_group)

    actor_cfg = cfg.actor
    actor_cfg.learner_port = cfg.learner.port
    actor_cfg.request_timeout_s = 2.0
    actor_cfg.reconnect_max_backoff_s = 0.5
    def make_env_client(url, flavor):
        env_client.made_with = (url, flavor)
        return env_client

    actor = Actor(cfg=actor_cfg, deps=ActorDeps(make_runtime=make_runtime, pull=fake_pull, make_env_client=make_env_client,
                                                new_buffer=Buffer),
                  engine_name="fake")
    return actor


def run_to_shutdown(svc, actor, timeout_s: float = 60) -> None:
    """Serve ``svc`` until its Shutdown stops ``actor``, which must exit 0 (bounded in time)."""

    async def main():
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                assert await actor.run() == 0

    trio.run(main)


def test_actor_plays_leases_swaps_versions_reuses_envs_and_exits_on_shutdown():
    cfg = make_cfg(**{"learner.steps": 4, "learner.max_staleness": 1, "actor.max_groups": 2, "learner.heartbeat_interval_s": 0.05})
    trainer, pub = FakeTrainer(), FakePublisher()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=pub, weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.5, 0.2
    env, engine = FakeEnvClient(fail_steps={3}, step_s=0.2), ChecksumEngine(size=SIZE)  # slower than a heartbeat
    actor = make_actor(cfg, env, engine)

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                rc = await actor.run()
                assert rc == 0
        return rc

    svc.parts.logger = logger = CaptureLogger()
    trio.run(main)
    assert [st for st, _ in logger.rows] == [1, 2, 3, 4]
    assert any("perf/actor_engine_busy" in m for _, m in logger.rows)  # from heartbeats
    assert trainer.step == 4 and len(trainer.trained) == 8 == len(set(trainer.trained))
    assert engine.applied[0] == 0 and engine.applied[-1] >= 3  # pulled new versions mid-run
    assert engine._closed
    assert actor.stats.groups_accepted >= 8
    assert len(env.created) <= cfg.actor.max_groups * cfg.algo.group_size + 1  # reused, one replaced
    assert len(env.closed) == len(env.created)  # all closed at exit (the broken one at once)
    assert actor.pools["babyai"].replaced >= 1  # the instance that errored (plus any cancelled at shutdown)
    assert actor.stop_reason.startswith("learner shutdown")


def test_actor_env_client_speaks_the_flavor_the_learner_announces():
    """``env.options.flavor=agentgym`` on the learner reaches the actor's env client (through
    ``Welcome.envs``), so actors play on AgentGym's own servers."""
    cfg = make_cfg(**{"learner.steps": 1, "learner.max_staleness": 1, "++env.options.flavor": "agentgym", "env.url": "http://127.0.0.1:36001"})
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.5, 0.2
    env = FakeEnvClient()
    actor = make_actor(cfg, env, ChecksumEngine(size=SIZE))

    run_to_shutdown(svc, actor)
    assert env.made_with == ("http://127.0.0.1:36001", "agentgym")


def test_actor_survives_learner_restart():
    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 1})
    env, engine = FakeEnvClient(), ChecksumEngine(size=SIZE)
    actor = make_actor(cfg, env, engine)
    trainers = []

    def service(steps):
        import copy

        c = copy.deepcopy(cfg)
        c.learner.steps = steps  # the first learner must not finish (and publish Shutdown) before it "dies"
        t = FakeTrainer()
        trainers.append(t)
        s = LearnerService(c, ServiceParts(trainer=t, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
        s.linger_s, s.announce_every_s = 0.5, 0.2
        return s

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(actor.run)
                first = service(1000)
                cs = trio.CancelScope()

                async def first_run():
                    with cs:
                        await first.serve()

                n.start_soon(first_run)
                await first.ready.wait()
                while actor.stats.groups_accepted < 1:
                    await trio.sleep(0.01)
                cs.cancel()  # the learner "dies" (sockets closed)
                await trio.sleep(1.0)
                assert not actor.stopping
                second = service(2)
                await second.serve()  # runs to its end; the actor must reconnect and feed it

    trio.run(main)
    assert actor.stats.sessions >= 2
    assert trainers[1].step == 2


def test_actor_abandons_leases_the_learner_no_longer_holds():
    """A lease the learner expired (its task re-issued) is abandoned by the actor at its next
    heartbeat.  The run is long, so the re-issued task finishing quickly cannot end the run
    (and cancel the stuck lease on Shutdown) before that heartbeat comes: that was the race
    that failed this test on a loaded machine."""
    cfg = make_cfg(**{"learner.steps": 1000, "learner.max_staleness": 0, "actor.max_groups": 2,
                      "learner.heartbeat_interval_s": 0.1})
    trainer = FakeTrainer()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.3, 0.2
    env, engine = FakeEnvClient(), ChecksumEngine(size=SIZE)
    actor = make_actor(cfg, env, engine)
    stuck: dict = {}
    inner = actor.deps.make_runtime

    async def make_runtime(welcome):
        rt = await inner(welcome)
        play = rt.play_group

        async def play_group(lease, sessions):
            if not stuck:
                stuck["lease"] = lease
                await trio.sleep_forever()  # stuck: the learner will forget this lease
            return await play(lease, sessions)

        rt.play_group = play_group
        return rt

    actor.deps.make_runtime = make_runtime

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                n.start_soon(actor.run)
                while "lease" not in stuck or stuck["lease"].lease_id not in svc.leases.live:
                    await trio.sleep(0.01)
                svc.leases.expire(trio.current_time() + 1e6)  # as if its deadline passed (expires any live lease)
                while actor.stats.groups_abandoned < 1:
                    await trio.sleep(0.01)
                while not any(t == stuck["lease"].task for t in trainer.tasks):
                    await trio.sleep(0.01)
                n.cancel_scope.cancel()

    trio.run(main)
    assert actor.stats.groups_abandoned >= 1
    assert stuck["lease"].lease_id not in trainer.trained  # its task was played under a new lease


def test_killed_actor_loses_nothing_its_leases_expire_and_are_reissued():
    cfg = make_cfg(**{"learner.steps": 3, "learner.max_staleness": 1, "actor.max_groups": 2,
                      "learner.heartbeat_interval_s": 0.1, "learner.lease_ttl_s": 1.0})
    trainer = FakeTrainer()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.3, 0.2
    doomed = make_actor(cfg, FakeEnvClient(step_s=60), ChecksumEngine(size=SIZE))  # never finishes a group
    doomed.actor_id = "doomed"
    survivor = make_actor(cfg, FakeEnvClient(), ChecksumEngine(size=SIZE))
    held: list = []

    async def main2():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                kill = trio.CancelScope()

                async def doomed_run():
                    with kill:
                        await doomed.run()

                n.start_soon(doomed_run)
                while doomed.stats.leases_received < 2:
                    await trio.sleep(0.01)
                held.extend(r.lease.task for r in svc.leases.live.values() if r.actor_id == "doomed")
                kill.cancel()  # like SIGKILL: no goodbye, no more heartbeats
                while svc.leases.in_flight:  # its leases expire after lease_ttl_s without heartbeats
                    await trio.sleep(0.05)
                n.start_soon(survivor.run)

    trio.run(main2)
    assert len(held) == 2
    assert trainer.step == 3 and len(trainer.trained) == 6 == len(set(trainer.trained))
    assert all(t in trainer.tasks for t in held)  # the dead actor's tasks were re-issued and trained
    assert doomed.stats.groups_sent == 0


def _episode_from_results(results, turn_limit):
    """An episode whose sampled tokens are exactly the engine's outputs (prompt of 4 tokens)."""
    from turnscale.protocol.messages import Episode

    ids, mask, vers = [1, 2, 3, 4], [0] * 4, [-1] * 4
    for r in results:
        ids += [int(t) for t in r.token_ids]
        mask += [1] * len(r.token_ids)
        vers += [int(v) for v in r.versions()]
    n = len(ids)
    return Episode(token_ids=np.array(ids, np.int32), loss_mask=np.array(mask, np.uint8),
                   logprobs=np.where(np.array(mask) > 0, -0.5, 0.0).astype(np.float32), versions=np.array(vers, np.int32),
                   prompt_len=4, turns=[], finish_reason="turn_limit", reward=1.0, success=True, turn_limit=turn_limit)


import pytest  # noqa: E402


@pytest.mark.parametrize("update_mode", ["between_turns", "inflight"])
def test_every_sampled_token_is_labelled_with_the_version_whose_weights_produced_it(update_mode):
    """Back-to-back publications (a step every few ms) through the real Actor weight path
    into an engine whose swap is deferred and slow: no token is ever sampled from torn
    weights, and every token's version names exactly the weights that produced it."""
    from turnscale.protocol.messages import TrajectoryGroup

    cfg = make_cfg(**{"learner.steps": 12, "learner.max_staleness": 2, "actor.max_groups": 3, "learner.groups_per_step": 1,
                      "learner.heartbeat_interval_s": 0.05})
    trainer, pub = FakeTrainer(), FakePublisher()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=pub, weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.3, 0.1
    engine = ChecksumEngine(size=SIZE, update_mode=update_mode, step_s=0.002, copy_pause_s=0.003)
    env = FakeEnvClient()
    results = []
    actor = make_actor(cfg, env, engine)
    sampling = SamplingParams(max_new_tokens=6)

    async def play_group(lease, sessions):
        episodes = []
        for s in sessions:
            await s.reset(lease.task.data_idx)
            turns = [await engine.generate(GenerateRequest(prompt_ids=[1, 2, 3, 4], sampling=sampling)) for _ in range(3)]
            results.extend(turns)
            episodes.append(_episode_from_results(turns, lease.turn_limit))
        return TrajectoryGroup(lease_id=lease.lease_id, actor_id=actor.actor_id, task=lease.task,
                               turn_limit=lease.turn_limit, episodes=episodes)

    async def make_runtime(welcome):
        return Runtime(engine=engine, play_group=play_group)

    actor.deps.make_runtime = make_runtime

    run_to_shutdown(svc, actor, timeout_s=90)
    assert trainer.step == 12 and len(engine.applied) >= 4  # many swaps happened while sampling
    expected = {v: weights_token(version_weights(v, SIZE)) for v in range(0, 20)}
    by_token = {tok: v for v, tok in expected.items()}
    tokens = np.concatenate([r.token_ids for r in results])
    versions = np.concatenate([r.versions() for r in results])
    assert len(tokens) > 100
    torn = [int(t) for t in tokens if int(t) not in by_token]
    assert not torn, f"{len(torn)} tokens sampled from torn weights"
    mislabelled = [(int(v), by_token[int(t)]) for t, v in zip(tokens, versions) if by_token[int(t)] != int(v)]
    assert not mislabelled, f"token versions that name other weights (label, real): {mislabelled[:5]}"
    assert len(set(versions.tolist())) >= 3


def test_a_failed_swap_keeps_the_old_weights_and_the_actor_pulls_again():
    """The engine refuses version 1 once: the actor must not report or stamp version 1
    until a later pull is applied, and it must not stall the leases waiting for it."""
    cfg = make_cfg(**{"learner.steps": 4, "learner.max_staleness": 1, "actor.max_groups": 2,
                      "learner.heartbeat_interval_s": 0.05})
    trainer, pub = FakeTrainer(), FakePublisher()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=pub, weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.3, 0.1
    engine = ChecksumEngine(size=SIZE)
    fails = {"left": 1}
    real_apply = engine._apply_weights

    def flaky_apply(tensors):
        if engine._applying == 1 and fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("injected: device out of memory")
        real_apply(tensors)

    engine._apply_weights = flaky_apply
    actor = make_actor(cfg, FakeEnvClient(), engine)

    run_to_shutdown(svc, actor)
    assert trainer.step == 4
    assert fails["left"] == 0 and actor.stats.weight_failures >= 1
    # pulled again and applied (v1 itself, or v2 if the learner moved on meanwhile)
    assert actor.applied is not None and actor.applied[1] >= 2  # step 4 needs groups sampled at >= v2


def test_after_a_resume_from_an_older_checkpoint_the_actor_samples_only_the_resumed_learners_weights():
    """Learner 1 publishes v3 (the actor applies it), then dies before checkpointing step 3;
    learner 2 resumes the same run (same run id) from the step-2 checkpoint and publishes
    v2, v3... with other weights.  The actor must drop its v3 and pull: every token it
    samples for learner 2 matches learner 2's weights of the version it is labelled with
    (real publisher, real pull into the actor's buffers, checked by checksum), and no group
    reaches learner 2 with a version from its future."""
    import torch
    import zmq

    from turnscale.actors.weight_sync import ReceiveBuffer, pull_weights
    from turnscale.learner.weights import WeightPublisher
    from turnscale.protocol.messages import TrajectoryGroup
    from tests.unit.test_learner_service import MemCheckpointer

    cfg = make_cfg(**{"learner.steps": 1000, "learner.max_staleness": 1, "learner.groups_per_step": 1,
                      "learner.checkpoint_every": 2, "actor.max_groups": 1, "learner.heartbeat_interval_s": 0.1})
    store, ledgers, learners = [], [], []
    engine = ChecksumEngine(size=SIZE, step_s=0.001)
    env = FakeEnvClient()
    actor = make_actor(cfg, env, engine)
    samples = []  # (incarnation of the learner the actor was serving, results)

    class Ledger:
        def __init__(self):
            self.rows = []

        def write_group(self, group, **kw):
            pass

        def write_batch_entry(self, group, **kw):
            self.rows.append(kw)

        def close(self):
            pass

    def service(salt, steps):
        import copy

        c = copy.deepcopy(cfg)
        c.learner.steps = steps
        trainer = FakeTrainer()
        pub = WeightPublisher(f"tcp://127.0.0.1:{cfg.learner.weights_port}", dtype="float32", context=zmq.Context())
        ledger = Ledger()
        ledgers.append(ledger)
        parts = ServiceParts(trainer=trainer, publisher=pub, schedule=FakeSchedule(), trajlog=ledger,
                             weights=lambda: {"w": torch.from_numpy(version_weights(trainer.step, SIZE, salt))},
                             checkpointer=MemCheckpointer(trainer, store))
        s = LearnerService(c, parts)
        s.linger_s, s.announce_every_s = 0.5, 0.1
        learners.append(s)
        return s

    async def play_group(lease, sessions):
        episodes = []
        inc = actor.welcome.policy.incarnation
        for s in sessions:
            await s.reset(lease.task.data_idx)
            turns = [await engine.generate(GenerateRequest(prompt_ids=[1, 2, 3, 4], sampling=SamplingParams(max_new_tokens=4)))
                     for _ in range(2)]
            samples.append((inc, turns))
            episodes.append(_episode_from_results(turns, lease.turn_limit))
        return TrajectoryGroup(lease_id=lease.lease_id, actor_id=actor.actor_id, task=lease.task,
                               turn_limit=lease.turn_limit, episodes=episodes)

    async def make_runtime(welcome):
        return Runtime(engine=engine, play_group=play_group)

    async def pull(sock, manifest, timeout_s, buffer):
        return await pull_weights(sock, manifest, timeout_s=timeout_s, buffer=buffer)

    actor.deps.make_runtime, actor.deps.pull, actor.deps.new_buffer = make_runtime, pull, ReceiveBuffer

    async def main():
        with trio.fail_after(90):
            async with trio.open_nursery() as n:
                n.start_soon(actor.run)
                first = service(salt=0, steps=1000)
                cs, gone = trio.CancelScope(), trio.Event()

                async def first_run():
                    try:
                        with cs:
                            await first.serve()
                    finally:
                        gone.set()

                n.start_soon(first_run)
                await first.ready.wait()
                while not (first.step >= 3 and actor.applied == (first.incarnation, 3)):
                    await trio.sleep(0.01)
                    assert first.step < 4
                cs.cancel()  # dies after publishing v3, before step 3 is ever checkpointed (every 2)
                await gone.wait()
                first.parts.publisher.close()
                first.parts.publisher._ctx.term()  # returns once the port is released
                assert store[-1][0] == 2
                second = service(salt=1, steps=5)
                assert second.restore() and second.run_id == first.run_id and second.version == 2
                await second.serve()
                n.cancel_scope.cancel()

    trio.run(main)
    second = learners[1]
    assert second.step == 5
    served = [turns for inc, turns in samples if inc == second.incarnation]
    assert served
    expected = {v: weights_token(version_weights(v, SIZE, salt=1)) for v in range(2, 8)}
    for turns in served:
        for r in turns:
            for tok, v in zip(r.token_ids, r.versions()):
                assert expected.get(int(v)) == int(tok), f"token labelled v{v} was not sampled by learner 2's v{v}"
    assert all(row["staleness"] >= 0 for row in ledgers[1].rows)
    assert actor.stats.sessions >= 2


def test_an_engine_that_half_applies_a_swap_is_caught_by_the_weight_checksum_and_pulled_again():
    """A buggy engine copies only part of version 1 yet reports it applied: the actor's
    check after the swap (``actor.verify_weights``) sees the engine's weights differ from
    the pulled bytes, counts ``torn_weights``, does not adopt the version, and pulls again."""
    cfg = make_cfg(**{"learner.steps": 3, "learner.max_staleness": 1, "actor.max_groups": 2,
                      "learner.heartbeat_interval_s": 0.05})
    trainer = FakeTrainer()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.3, 0.1
    engine = ChecksumEngine(size=SIZE)
    bug = {"left": 1}
    real_apply = engine._apply_weights

    def half_apply(tensors):
        if engine._applying == 1 and bug["left"]:
            bug["left"] -= 1
            engine.w[: SIZE // 2] = np.asarray(tensors["w"])[: SIZE // 2]  # the rest stays v0: torn
            return
        real_apply(tensors)

    engine._apply_weights = half_apply
    actor = make_actor(cfg, FakeEnvClient(), engine)

    run_to_shutdown(svc, actor)
    assert bug["left"] == 0 and actor.stats.torn_weights == 1
    assert trainer.step == 3 and max(engine.applied) >= 1  # pulled again: v1, or a later version


def test_actor_that_connects_after_the_run_ended_is_told_on_its_hello_and_exits_0():
    """Seen on a loaded CI machine: an actor whose first session failed re-sent Hello after
    the learner had published its last ``Shutdown``; it registered, missed the (lossy,
    already sent) announcements and waited forever for a learner that had exited.  A Hello
    during shutdown is now answered ``Shutdown``."""
    import zmq

    from turnscale.protocol.messages import Goodbye, Hello, LeaseRequest
    from turnscale.protocol.transport import AsyncSocket, Requester, configure
    from tests.unit.test_learner_service import _wait_for

    cfg = make_cfg(**{"learner.steps": 1, "learner.max_staleness": 1})
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 30.0, 0.2
    actor = make_actor(cfg, FakeEnvClient(), ChecksumEngine(size=SIZE))
    ctx = zmq.Context()

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                d = configure(ctx.socket(zmq.DEALER))
                d.connect(f"tcp://127.0.0.1:{cfg.learner.port}")
                other = Requester(AsyncSocket(d))  # another actor plays the run's only step
                await other.request(Hello(actor_id="x", host="h", pid=1, engine="fake", device="cpu", max_groups=4), timeout_s=5)
                while svc.step < 1:
                    g = await other.request(LeaseRequest(actor_id="x", max_leases=4), timeout_s=5)
                    for lease in g.leases:
                        await other.request(make_group(lease, actor_id="x"), timeout_s=5)
                    await trio.sleep(0.02)
                await _wait_for(lambda: svc.stopping, "stopping")
                await trio.sleep(0.6)  # the published Shutdowns are gone
                with trio.fail_after(15):
                    assert await actor.run() == 0
                await other.request(Goodbye(actor_id="x"), timeout_s=5)

    try:
        trio.run(main)
    finally:
        ctx.destroy(linger=0)
    assert actor.stop_reason.startswith("learner shutdown")
    assert actor.stats.sessions == 0 and actor.stats.leases_received == 0


class RelayBuffer(Buffer):
    def take(self, nbytes):
        return self.array.view(np.uint8)[:nbytes]


class RecordingRelay:
    """Stands in for ``actors.relay.RelayServer``: records what the actor tells it."""

    endpoint = "tcp://10.9.9.9:7000"

    def __init__(self, events):
        self.events = events

    def begin(self, key, manifest, buf):
        self.events.append(("begin", key, manifest.version))

    def mark(self, key, index):
        self.events.append(("mark", key, index))

    def withdraw(self, key):
        self.events.append(("withdraw", key))

    def allow_clients(self, keys):
        self.events.append(("allow", tuple(keys)))

    def close(self):
        self.events.append(("close",))


def test_actor_registers_its_relay_buffer_before_each_pull_and_asks_the_learners_sources():
    cfg = make_cfg(**{"learner.steps": 3, "learner.max_staleness": 1, "learner.heartbeat_interval_s": 0.05,
                      "learner.relay.fanout": 1})
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict,
                                           schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.5, 0.2
    # an earlier relaying actor registered: this one is its child in the chain
    svc.actors.actors["head"] = ActorInfo("head", "h", 1, "sim", 1e18, identity=b"x", relay_endpoint="tcp://10.9.9.1:7000")
    events, engine = [], ChecksumEngine(size=SIZE)
    actor = make_actor(cfg, FakeEnvClient(), engine)
    actor.deps.new_buffer = RelayBuffer
    actor.deps.relay = RecordingRelay(events)
    seen = []

    async def pull(sock, manifest, timeout_s, buffer, **kw):
        assert events[-1] == ("begin", id(next(s for s in actor.weight_path.slots if s.buffer is buffer)), manifest.version)
        seen.append((manifest.version, [s.sock.getsockopt_string(zmq.LAST_ENDPOINT) for s in kw["relays"]]))
        kw["on_chunk"](0)
        kw["report"].from_learner += 1
        return await fake_pull(sock, manifest, timeout_s, buffer)

    actor.deps.pull = pull
    hello = []
    orig = actor._hello

    async def spy(req):
        w = await orig(req)
        hello.append(w.weight_sources)
        return w

    actor._hello = spy
    run_to_shutdown(svc, actor)
    assert hello and hello[0] == ["tcp://10.9.9.1:7000"]  # the Welcome names the parent relay
    assert seen and all(eps == ["tcp://10.9.9.1:7000"] for _, eps in seen)
    begins = [e for e in events if e[0] == "begin"]
    assert [v for _, _, v in begins] == [v for v, _ in seen]  # every pull registered first
    assert ("allow", ()) in events  # the Welcome's relay_clients reach the relay (none: plain relays here)
    events[:] = [e for e in events if e[0] != "allow"]
    assert ("close",) == events[-1] and actor.stats.weight_chunks_from_learner == len(seen)


def test_a_first_pull_of_a_retired_version_pulls_the_newest_announced_without_registering_again():
    """The learner retires the Welcome's version before the actor pulls it (it published
    again meanwhile): the first pull's ``unknown_version`` must send the actor to the newest
    announced version in the same session, not end the session and re-register."""
    from turnscale.protocol.errors import RemoteError

    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 1, "learner.heartbeat_interval_s": 0.05})
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict,
                                           schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.5, 0.1
    engine = ChecksumEngine(size=SIZE)
    actor = make_actor(cfg, FakeEnvClient(), engine)
    refused = []

    async def retiring_pull(sock, manifest, timeout_s, buffer):
        if manifest.version == 0:  # the Welcome's version: gone by the time we ask
            refused.append(manifest.version)
            if svc.version == 0:
                await svc._publish_weights(1)  # the learner moved on (and retired v0)
            raise RemoteError("unknown_version", "version 0 is not served (have [1]); pull the latest announced version")
        return await fake_pull(sock, manifest, timeout_s, buffer)

    actor.deps.pull = retiring_pull
    run_to_shutdown(svc, actor)
    assert refused == [0]  # asked once, then the newest announced version
    assert actor.stats.sessions == 1  # no second Hello
    assert engine.applied[0] == 1 and actor.stats.weight_failures == 1


def test_heartbeats_run_during_the_first_pull_so_a_long_pull_keeps_the_actor_registered():
    """A first pull longer than the learner's actor timeout (big weights over a slow link)
    must not make the learner forget the actor: heartbeats start before the first pull."""
    from turnscale.protocol.messages import Heartbeat

    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 1, "learner.heartbeat_interval_s": 0.05})
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict,
                                           schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.5, 0.1
    actor = make_actor(cfg, FakeEnvClient(), ChecksumEngine(size=SIZE))
    pulling, beats_while_pulling, first = [], [], [True]
    request = actor._request

    async def spy_request(req, msg, expect):
        if isinstance(msg, Heartbeat) and pulling:
            beats_while_pulling.append(msg)
        return await request(req, msg, expect)

    async def slow_first_pull(sock, manifest, timeout_s, buffer):
        if first[0]:
            first[0] = False
            pulling.append(manifest.version)
            with trio.move_on_after(3.0):  # bounded: ends once three heartbeats went out
                while len(beats_while_pulling) < 3:
                    await trio.sleep(0.02)
            pulling.clear()
        return await fake_pull(sock, manifest, timeout_s, buffer)

    actor._request = spy_request
    actor.deps.pull = slow_first_pull
    run_to_shutdown(svc, actor)
    assert len(beats_while_pulling) >= 3 and actor.stats.sessions == 1


def test_a_group_refused_as_busy_is_sent_again_and_trained():
    """The learner answers a retryable ``busy`` while another client floods its queue of large
    messages: the actor sends the played group again (capped backoff) instead of dropping it."""
    from turnscale.protocol.messages import ErrorReply, TrajectoryGroup

    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 1, "actor.max_groups": 2,
                      "learner.heartbeat_interval_s": 0.1})
    trainer = FakeTrainer()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.5, 0.2
    refused: list[str] = []
    taken: set[str] = set()
    handle = svc.handle

    def busy_twice(msg, identity=b""):
        """The first two groups are refused twice each, then handled as usual."""
        if isinstance(msg, TrajectoryGroup) and refused.count(msg.lease_id) < 2 and (
                len(set(refused)) < 2 or msg.lease_id in refused):
            refused.append(msg.lease_id)
            return ErrorReply(code="busy", message="8 large messages wait to be decoded", retryable=True)
        reply = handle(msg, identity)
        if isinstance(msg, TrajectoryGroup) and getattr(reply, "accepted", False):
            taken.add(msg.lease_id)
        return reply

    svc.handle = busy_twice
    actor = make_actor(cfg, FakeEnvClient(), ChecksumEngine(size=SIZE))
    run_to_shutdown(svc, actor)
    assert trainer.step == 2 and len(refused) == 4
    assert set(refused) <= taken  # every group refused as busy was accepted when sent again
    assert actor.stats.groups_resent == len(refused)


def test_an_actor_without_a_learner_gives_up_after_the_timeout_and_says_why(caplog):
    """A learner killed without a goodbye (or never started) no longer leaves the actor
    reconnecting until its job's time limit: exit code 4 after ``actor.learner_lost_timeout_s``."""
    import logging
    import socket
    import time

    from turnscale.actors.actor import EXIT_LEARNER_GONE

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_cfg(**{"actor.learner_port": port, "actor.request_timeout_s": 0.3, "actor.reconnect_max_backoff_s": 0.2,
                      "actor.learner_lost_timeout_s": 1.5})
    actor = make_actor(cfg, FakeEnvClient(), ChecksumEngine(size=SIZE))
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="turnscale.actor"):
        assert trio.run(actor.run) == EXIT_LEARNER_GONE
    assert 1.5 <= time.monotonic() - t0 < 15
    assert actor.stop_reason == "no learner"
    assert any("actor.learner_lost_timeout_s" in r.getMessage() for r in caplog.records)
