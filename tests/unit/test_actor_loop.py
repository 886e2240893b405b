"""The actor loop against the real learner service (fake trainer) over 127.0.0.1, with a
fake engine, fake env client and fake group player."""

from __future__ import annotations

import trio

from actors.actor import Actor, ActorDeps, Runtime
from learner.service import LearnerService, ServiceParts
from tests.unit.fakes import make_group
from tests.unit.test_learner_service import FakePublisher, FakeSchedule, FakeTrainer, make_cfg


class FakeEngine:
    def __init__(self):
        self.version = 0
        self.loaded: list[int] = []
        self.closed = False

    def load_weights(self, version, tensors):
        self.loaded.append(version)
        self.version = version

    def stats(self):
        return {"engine_busy": 0.5, "tokens_generated": 10.0 * len(self.loaded)}

    def close(self):
        self.closed = True


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

    async def pull(sock, manifest, timeout_s):
        return {}

    actor_cfg = cfg.actor
    actor_cfg.learner_port = cfg.learner.port
    actor_cfg.request_timeout_s = 2.0
    actor_cfg.reconnect_max_backoff_s = 0.5
    def make_env_client(url, flavor):
        env_client.made_with = (url, flavor)
        return env_client

    actor = Actor(cfg=actor_cfg, deps=ActorDeps(make_runtime=make_runtime, pull=pull, make_env_client=make_env_client),
                  engine_name="fake")
    return actor


def test_actor_plays_leases_swaps_versions_reuses_envs_and_exits_on_shutdown():
    cfg = make_cfg(**{"learner.steps": 4, "learner.max_staleness": 1, "actor.max_groups": 2, "learner.heartbeat_interval_s": 0.05})
    trainer, pub = FakeTrainer(), FakePublisher()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=pub, weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.5, 0.2
    env, engine = FakeEnvClient(fail_steps={3}, step_s=0.2), FakeEngine()  # slower than a heartbeat
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
    assert any(m.get("perf/actor_engine_busy") == 0.5 for _, m in logger.rows)  # from heartbeats
    assert trainer.step == 4 and len(trainer.trained) == 8 == len(set(trainer.trained))
    assert engine.loaded[0] == 0 and engine.loaded[-1] >= 3  # pulled new versions mid-run
    assert engine.closed
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
    actor = make_actor(cfg, env, FakeEngine())

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                assert await actor.run() == 0

    trio.run(main)
    assert env.made_with == ("http://127.0.0.1:36001", "agentgym")


def test_actor_survives_learner_restart():
    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 1})
    env, engine = FakeEnvClient(), FakeEngine()
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
    cfg = make_cfg(**{"learner.steps": 1, "learner.max_staleness": 0, "actor.max_groups": 2,
                      "learner.heartbeat_interval_s": 0.1})
    trainer = FakeTrainer()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.3, 0.2
    env, engine = FakeEnvClient(), FakeEngine()
    actor = make_actor(cfg, env, engine)
    slow = {"first": True}
    inner = actor.deps.make_runtime

    async def make_runtime(welcome):
        rt = await inner(welcome)
        play = rt.play_group

        async def play_group(lease, sessions):
            if slow.pop("first", False):
                await trio.sleep(30)  # stuck: the learner will forget this lease
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
                while svc.leases.in_flight != 1 or actor.stats.groups_accepted < 1:
                    await trio.sleep(0.01)
                stuck = list(svc.leases.live.values())[0].lease
                svc.leases.expire(trio.current_time() + 1e6)  # as if its deadline passed
                while actor.stats.groups_abandoned < 1:
                    await trio.sleep(0.01)
                return stuck

    trio.run(main)
    assert actor.stats.groups_abandoned == 1
    assert trainer.step == 1 and len(trainer.trained) == 2  # the re-issued task was played by a new lease


def test_killed_actor_loses_nothing_its_leases_expire_and_are_reissued():
    cfg = make_cfg(**{"learner.steps": 3, "learner.max_staleness": 1, "actor.max_groups": 2,
                      "learner.heartbeat_interval_s": 0.1, "learner.lease_ttl_s": 1.0})
    trainer = FakeTrainer()
    svc = LearnerService(cfg, ServiceParts(trainer=trainer, publisher=FakePublisher(), weights=dict, schedule=FakeSchedule()))
    svc.linger_s, svc.announce_every_s = 0.3, 0.2
    doomed = make_actor(cfg, FakeEnvClient(step_s=60), FakeEngine())  # never finishes a group
    doomed.actor_id = "doomed"
    survivor = make_actor(cfg, FakeEnvClient(), FakeEngine())
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
