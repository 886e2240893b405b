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

