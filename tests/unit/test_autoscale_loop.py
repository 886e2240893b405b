"""turnscale autoscale: waits for the learner's address, ticks until learner.done, survives a
round the learner does not answer, and builds its parts from the slurm config."""

from __future__ import annotations

import pytest

from turnscale import conf
from turnscale.autoscale import build, read_address, run_loop
from turnscale.protocol.errors import PeerTimeout
from turnscale.scaling import Decision


class FlakyAuto:
    """Stands in for ``Autoscaler``: the learner misses round 2; the run ends after round 4."""

    def __init__(self, folder):
        self.folder, self.calls = folder, 0

    def tick(self):
        self.calls += 1
        if self.calls == 2:
            raise PeerTimeout("no LearnerStatus within 10s")
        if self.calls == 4:
            (self.folder / "learner.done").write_text("")
        return Decision(wanted={"cpu": 1}, max_leases_per_actor=2, reason="", changed=self.calls == 3)


def test_loop_ticks_until_the_learner_is_done_and_survives_an_unanswered_round(tmp_path, caplog):
    auto = FlakyAuto(tmp_path)
    slept = []
    assert run_loop(auto, tmp_path, 5.0, sleep=slept.append) == 4
    assert auto.calls == 4 and slept == [5.0] * 4
    assert "learner did not answer this round" in caplog.text


def test_loop_is_bounded_in_time_when_the_learner_never_finishes(tmp_path):
    class Quiet:
        def tick(self):
            return None

    assert run_loop(Quiet(), tmp_path, 0.01, max_s=0.05, sleep=lambda s: None) >= 1


def test_address_is_read_from_the_file_or_times_out_clearly(tmp_path):
    with pytest.raises(TimeoutError, match="no learner address in .*learner.addr"):
        read_address(tmp_path, 0.0, sleep=lambda s: None)
    (tmp_path / "learner.addr").write_text("10.0.0.5 5555\n")
    assert read_address(tmp_path, 0.0) == ("10.0.0.5", 5555)


def test_build_takes_pools_bounds_and_counts_from_the_slurm_config(tmp_path):
    cfg = conf.load([f"slurm.dir={tmp_path}",
                     "slurm.pools=[{name:cpu,count:2,min_actors:1,max_actors:4,cost:1.0},{name:big,count:1,max_actors:2,cost:3.0}]"])
    auto = build(cfg, "127.0.0.1", 5555)
    try:
        assert auto.controller.wanted == {"cpu": 2, "big": 1}
        assert {p.name: (p.min_actors, p.max_actors, p.cost) for p in auto.controller.policy.pools} == {
            "cpu": (1, 4, 1.0), "big": (0, 2, 3.0)}
        assert auto.backend.pools == {"cpu": 2, "big": 1} and auto.backend.folder == tmp_path
    finally:
        auto.control.close()


def test_loop_ends_when_the_learner_job_has_left_the_queue_without_learner_done(tmp_path):
    class Quiet:
        def tick(self):
            return None

    calls = []
    assert run_loop(Quiet(), tmp_path, 1.0, sleep=lambda s: None, gone=lambda: calls.append(1) or len(calls) > 3) == 3


def test_slurm_backend_tells_a_job_that_left_the_queue_from_one_still_queued(tmp_path):
    import subprocess

    from turnscale.slurm import SlurmBackend

    answers = {"1": "RUNNING\n", "2": "PENDING\n", "3": "CANCELLED by 0\n", "4": "", "5": "NODE_FAIL\n"}

    def runner(cmd):
        job = cmd[cmd.index("-j") + 1]
        if job == "6":
            raise subprocess.CalledProcessError(1, cmd, "", "slurm_load_jobs error: Invalid job id specified")
        if job == "7":
            raise subprocess.CalledProcessError(1, cmd, "", "slurm_load_jobs error: Unable to contact slurm controller")
        return answers[job]

    b = SlurmBackend(tmp_path, {}, runner=runner)
    assert [b.job_gone(j) for j in "1234567"] == [False, False, True, True, True, True, False]


class FakeControl:
    """A learner's control port: ``idle`` fraction per 10 s interval, ``ready`` groups, one cpu
    actor holding ``held`` leases; records every request; applies a lease limit it is sent."""

    def __init__(self, leases: int, idle: float, ready: int, actors: int = 1):
        self.leases, self.idle, self.ready, self.n = leases, idle, ready, actors
        self.t, self.requests = 0.0, []

    def status(self):
        from turnscale.protocol.messages import ActorStatus, LearnerStatus

        self.t += 10.0
        return LearnerStatus(step=1, version=1, uptime_s=self.t, idle_s=self.t * self.idle, ready_groups=self.ready,
                             live_leases=0, groups_received=0, groups_stale=0, groups_trained=0, staleness_sum=0,
                             max_leases_per_actor=self.leases,
                             actors=[ActorStatus(actor_id=f"cpu-1_{i}", pool="cpu", host="h", leases=2, draining=False,
                                                 tokens_generated=self.t * 10) for i in range(self.n)])

    def request(self, msg):
        self.requests.append(msg)
        if msg.max_leases_per_actor:
            self.leases = msg.max_leases_per_actor
        return self.status()


class NullBackend:
    def __init__(self):
        self.scaled = []

    def scale_to(self, pool, n):
        self.scaled.append((pool, n))

    def drain(self, actor_id):
        pass


def _autoscaler(control, max_actors=2):
    from turnscale.control import Autoscaler
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy

    policy = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=max_actors),), window=2)
    return Autoscaler(control=control, controller=ScalingController(policy, wanted={"cpu": 1}), backend=NullBackend())


def test_the_learners_lease_limit_is_left_alone_unless_a_decision_changes_it():
    """The first decision used to send the policy's ``max_leases`` (4) to a learner at its default
    64, throttling actors that could hold more.  Balanced or starved, 64 stays (starved adds an
    actor instead); only a saturated learner gets a lower limit, into the policy's range."""
    balanced = FakeControl(leases=64, idle=0.15, ready=2)
    auto = _autoscaler(balanced)
    for _ in range(5):
        auto.tick()
    assert not [r for r in balanced.requests if r.max_leases_per_actor] and balanced.leases == 64

    starved = FakeControl(leases=64, idle=0.8, ready=0)
    auto = _autoscaler(starved)
    for _ in range(3):
        auto.tick()
    assert not [r for r in starved.requests if r.max_leases_per_actor] and auto.backend.scaled == [("cpu", 2)]

    saturated = FakeControl(leases=64, idle=0.0, ready=8)
    auto = _autoscaler(saturated)
    for _ in range(3):
        auto.tick()
    assert [r.max_leases_per_actor for r in saturated.requests if r.max_leases_per_actor] == [4]


def test_a_pool_whose_actors_keep_failing_is_resubmitted_with_exponential_back_off():
    """Its tasks crash before registering and leave the queue: every round used to resubmit.
    Now 30 s, 60 s, 120 s ... (capped) pass between resubmissions, each one logged; once its
    actors register the next loss is replaced at once again."""
    from turnscale.control import Autoscaler
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy

    class Failing:
        def __init__(self):
            self.submitted = []

        def refresh(self):
            return {"cpu": 0}  # whatever was submitted has failed and left the queue

        def scale_to(self, pool, n):
            self.submitted.append(now[0])

        def drain(self, actor_id):
            pass

    now = [0.0]
    b = Failing()
    policy = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=2),))
    auto = Autoscaler(control=None, controller=ScalingController(policy, wanted={"cpu": 1}), backend=b,  # type: ignore[arg-type]
                      backoff_s=30.0, backoff_max_s=100.0, clock=lambda: now[0])
    for t in range(0, 400, 10):
        now[0] = float(t)
        auto.replace_lost()
    assert b.submitted == [0.0, 30.0, 90.0, 190.0, 290.0, 390.0]  # waits 30, 60, 100 (cap), 100, 100
    assert auto.failures["cpu"][0] == 6

    control = FakeControl(leases=4, idle=0.15, ready=2, actors=1)  # its actor registered
    auto.last = control.status()
    now[0] = 395.0
    auto.replace_lost()
    assert b.submitted[-1] == 395.0 and auto.failures["cpu"][0] == 1  # afresh: at once, count restarted


def test_autoscale_connects_with_the_runs_own_control_key(tmp_path):
    """``turnscale slurm`` made the run's CURVE keys (none given): ``turnscale autoscale`` with the
    same overrides connects as the authorized ``control`` client (its ``LearnerControl`` socket
    uses CURVE towards the published, non-loopback learner address)."""
    from turnscale import slurm
    from turnscale.autoscale import load_config
    from turnscale.common.curve import actor_curve

    overrides = [f"slurm.dir={tmp_path}", "slurm.pools=[{name:cpu,count:1}]"]
    assert slurm.main(overrides, runner=lambda cmd: "7\n") == 0
    cfg = load_config(overrides)
    assert cfg.actor.curve.secret_key == str(tmp_path / "keys" / "control.key_secret")
    import dataclasses
    setup = actor_curve(dataclasses.replace(cfg.actor, learner_host="10.0.0.5"))
    assert setup is not None and (tmp_path / "keys" / "authorized" / "control.key").exists()
    auto = build(cfg, "10.0.0.5", 5555)
    auto.control.close()
    off = load_config([*overrides, "learner.curve.enabled=false", "actor.curve.enabled=false"])
    assert off.actor.curve.secret_key == ""
