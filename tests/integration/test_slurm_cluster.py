"""A run submitted through ``turnscale slurm`` to a real Slurm (``cluster.slurm.FakeSlurm``:
slurmctld + slurmd on this machine, no munge) trains end to end with actors in two pools.

The learner job runs two ranks (``slurm.learner_ranks=2``: torchrun, gloo, one node; the
autoscaler test below runs the one-rank learner job).  The node's features ``cpu`` and
``cpu2`` stand for two kinds of hardware; the ``cpu2`` pool
runs the hf engine with other settings (``engine.max_batch=2``).  The learner job publishes
its address in the run folder, the envhub job its URL, the two actor arrays find them, the
learner trains its steps and tells the actors to stop; every job ends by itself.  Both pools
report their per-pool metrics, the log-prob gap keys (``learner.poolgap``) finite.  Skips
with the reason when Slurm is not installed or this is not root.
"""

from __future__ import annotations

import math
import subprocess
import time

import pytest

from turnscale.cluster import netns
from turnscale.cluster.slurm import FakeSlurm, Node, available
from turnscale.slurm import parse_actor_id
from tests.integration.test_failures import check_groups, check_ledger, read_jsonl
from tests.slurm_fixtures import learner_address, learner_job, learner_log, run_logs, run_overrides, slurm_session, submit, wait_for, wait_started

OK, WHY = available()
STEPS = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not OK, reason=WHY)
def test_run_submitted_through_the_launcher_trains_with_two_pools(tmp_path, tiny_model_dir):
    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu", "cpu2"), cpus=8)])
    run = tmp_path / "run"
    pools = ('[{name:cpu,count:1,constraint:cpu,cpus_per_task:1},'
             '{name:cpu2,count:1,constraint:cpu2,cpus_per_task:1,overrides:["engine.max_batch=2"]}]')
    overrides = run_overrides(run, tiny_model_dir, pools=pools, steps=STEPS, groups_per_step=2, max_groups=2,
                              extra=["slurm.learner_ranks=2"])  # one learner job, two ranks (torchrun)
    with slurm_session(c, 90, run=run):
        assert "actors-cpu2.sbatch: job" in submit(c, overrides)
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline and c.jobs():
            time.sleep(1)
        assert not c.jobs(), f"jobs still queued: {c.jobs()}\n{run_logs(run)}"
        metrics = read_jsonl(run / "learner" / "metrics.jsonl")
        assert metrics and metrics[-1]["step"] == STEPS, run_logs(run)
        assert all(m["perf/learner_ranks"] == 2 for m in metrics), run_logs(run)
        assert list((c.folder / "tmp").glob("torchelastic_*")), "torchrun's folder is not in the jobs' TMPDIR"
        port = int((run / "learner.addr").read_text().split()[1])  # picked free on the node, and the one bound
        assert port != 5555 and f"control tcp://0.0.0.0:{port}" in learner_log(run), learner_log(run)
        trajs = read_jsonl(run / "learner" / "trajectories.jsonl")
        pools = {parse_actor_id(t["actor_id"])[0] for t in trajs if t["accepted"]}
        assert pools == {"cpu", "cpu2"}, pools
        assert any("pool/cpu/actors" in m for m in metrics) and any("pool/cpu2/actors" in m for m in metrics)
        for pool in ("cpu", "cpu2"):  # learner.poolgap: each pool's trained groups, the real trainer's gap
            for key in ("logprob_gap_mean", "behaviour_weight_mean", "staleness_mean"):
                values = [m[f"pool/{pool}/{key}"] for m in metrics if f"pool/{pool}/{key}" in m]
                assert values, f"no pool/{pool}/{key} in any step\n{run_logs(run)}"
                assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in values), (pool, key, values)
        check_groups(trajs)
        check_ledger(run / "learner")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not OK, reason=WHY)
def test_autoscaler_adds_an_actor_through_sbatch_and_drains_one_on_slurm(tmp_path, tiny_model_dir):
    """The learner waits for groups with one actor: the controller asks ``SlurmBackend`` for a
    second (``sbatch --array``), which registers; then the pool's maximum drops to one: the
    least busy actor is drained (no lease after the drain, its groups trained) and its job
    ends by itself.  The learner job is then cancelled (it checkpoints and exits); every
    job ends; nothing was trained twice."""
    from turnscale.control import Autoscaler, LearnerControl
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy
    from turnscale.slurm import SlurmBackend

    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu",), cpus=8)])
    run = tmp_path / "run"
    overrides = run_overrides(run, tiny_model_dir, pools="[{name:cpu,count:1,constraint:cpu,cpus_per_task:1}]",
                              steps=100000, groups_per_step=2, max_groups=1)
    with slurm_session(c, 90, run=run) as hold:
        job = learner_job(submit(c, overrides))
        _, port = learner_address(run)
        control = hold(LearnerControl("127.0.0.1", port, timeout_s=30))
        wait_started(control)

        def sbatch(cmd):
            return subprocess.run(list(cmd), env=c.env(), capture_output=True, text=True, check=True, timeout=60).stdout

        backend = SlurmBackend(run, {"cpu": 1}, runner=sbatch)
        policy = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=2),), window=2, up_idle=0.05,
                               down_idle=0.0, ready_low=2.0, max_leases=1, min_leases=1)
        auto = Autoscaler(control=control, controller=ScalingController(policy, wanted={"cpu": 1}), backend=backend)

        def up() -> bool:
            auto.tick()
            return len([a for a in control.status().actors if not a.draining]) == 2

        wait_for(up, 240, "a second actor from sbatch --array", every_s=2.0)
        assert backend.submitted["cpu"] == 2 and any(d.changed and d.wanted["cpu"] == 2 for d in auto.decisions)

        # the pool's maximum drops to one: the least busy actor is drained and its job ends
        shrink = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=1),), window=2, max_leases=1)
        auto.controller = ScalingController(shrink, wanted={"cpu": 2})
        d = auto.tick()
        assert d is not None and d.wanted == {"cpu": 1}
        drained = backend.drained[-1]
        wait_for(lambda: drained not in {a.actor_id for a in control.status().actors}, 180, f"{drained} leaving")
        wait_for(lambda: len(c.jobs()) == 3, 120,
              "the drained actor's job ending")
        step = control.status().step
        wait_for(lambda: control.status().step >= step + 1, 180, "a step after the drain")
        c.run(["scancel", "--full", job])
        wait_for(lambda: not c.jobs(), 240, "every job ending")
        log = "\n".join(p.read_text(errors="replace") for p in (run / "logs").glob("learner-*.log"))
        assert f"actor {drained} drained" in log
        drain_at = log.index(f"actor {drained} (pool cpu) draining")
        assert f"granted to actor {drained}" not in log[drain_at:], "a lease was granted to a drained actor"
        check_groups(read_jsonl(run / "learner" / "trajectories.jsonl"))
        check_ledger(run / "learner")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not OK, reason=WHY)
def test_slurm_backend_sees_a_cancelled_actor_task_in_squeue_and_replaces_it(tmp_path):
    """Real Slurm: ``SlurmBackend.live`` counts the pool's array tasks from ``squeue``; one
    task killed (``scancel``, as a lost node would end it) is no longer counted, and
    ``refresh`` + ``scale_to`` submit a replacement.  The actor script is a ``sleep``."""
    import os

    from turnscale.slurm import SlurmBackend

    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu",), cpus=4)])
    (tmp_path / "actors-cpu.sbatch").write_text(
        f"#!/bin/bash\n#SBATCH -J ts-actors-cpu\n#SBATCH -o {tmp_path}/a-%A_%a.log\n#SBATCH -c 1\nexec sleep 600\n")
    env = {**os.environ, **c.env()}

    def runner(cmd):
        return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=60, env=env).stdout

    def wait_live(b, n):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and b.live("cpu") != n:
            time.sleep(0.5)
        return b.live("cpu")

    with slurm_session(c, 90):
        b = SlurmBackend(tmp_path, {"cpu": 0}, runner=runner)
        b.scale_to("cpu", 2)
        assert wait_live(b, 2) == 2
        job = runner(["squeue", "--noheader", "--array", "--name=ts-actors-cpu", "--format=%i"]).split()[0]
        runner(["scancel", job])
        assert wait_live(b, 1) == 1
        assert b.refresh() == {"cpu": 1}
        b.scale_to("cpu", 2)
        assert wait_live(b, 2) == 2


def readme_quick_start(readme: str, subs: dict[str, str]) -> list[str]:
    """The shell commands of the README's "Quick start: Slurm" section (its first indented
    block), in order, as a user types them: continuation lines joined, trailing ``# comments``
    dropped, ``...same overrides...`` replaced by the first command's arguments (as the
    README says), then the paths in ``subs`` substituted."""
    import re
    import shlex

    section = readme.split("## Quick start: Slurm", 1)[1].split("\n## ", 1)[0]
    block, started = [], False
    for line in section.splitlines():
        if line.startswith("    ") and line.strip():
            block.append(line)
            started = True
        elif started:
            break
    cmds = [re.sub(r"\s+#.*$", "", c).strip() for c in "\n".join(block).replace("\\\n", " ").splitlines() if c.strip()]
    first = [t for t in shlex.split(cmds[0])[2:] if t != "--dry-run"]
    out = []
    for c in cmds:
        if "...same overrides..." in c:
            have = shlex.split(c.replace("...same overrides...", ""))
            c = c.replace("...same overrides...", " ".join(shlex.quote(t) for t in first if t not in have))
        for old, new in subs.items():
            c = c.replace(old, new)
        out.append(" ".join(c.split()))
    return out


def test_readme_quick_start_block_is_read_as_a_user_types_it():
    readme = ("## Quick start: Slurm\n\nFrom a folder:\n\n    turnscale slurm --dry-run slurm.dir=/shared/run1 a=1 \\\n"
              "        'b=[{x:1}]' c=2\n    turnscale slurm slurm.dir=/shared/run1 ...same overrides...     # submits\n\nAfter.\n\n    not this\n## Next")
    assert readme_quick_start(readme, {"/shared/run1": "/t/r"}) == [
        "turnscale slurm --dry-run slurm.dir=/t/r a=1 'b=[{x:1}]' c=2", "turnscale slurm slurm.dir=/t/r a=1 'b=[{x:1}]' c=2"]


NS_OK, NS_WHY = netns.available()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.skipif(not NS_OK, reason=NS_WHY)
def test_readme_slurm_quick_start_runs_as_written_with_curve_on(tmp_path):
    """The README's quick start, verbatim but for the two paths, on a one-node cluster whose
    node is a network namespace (so the learner binds and publishes a non-loopback address,
    as on a real cluster, and CURVE turns on by default).  It used to stop in every job with
    ``CurveConfigError`` (no keys given).  Now the dry run says the run's keys will be made,
    the submission makes them (secret files 0600) and the learner trains steps with the
    pool's actors connected over CURVE.  The run (300 steps) is then cancelled."""
    import os
    import sys
    from pathlib import Path

    from tests.conftest import REPO_ROOT

    net = netns.Cluster(["n1"])
    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu",), cpus=16)], net=net)
    shared = tmp_path / "shared"
    shared.mkdir()
    run = shared / "run1"
    cmds = readme_quick_start((Path(REPO_ROOT) / "README.md").read_text(),
                              {"/shared/run1": str(run), "/shared/venv/bin/python": sys.executable})
    assert len(cmds) == 2 and "--dry-run" in cmds[0] and "--dry-run" not in cmds[1], cmds
    env = {**c.env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with slurm_session(c, 120, run=run, net=net):
        outs = []
        for cmd in cmds:
            r = subprocess.run(["bash", "-c", cmd], cwd=shared, env=env, capture_output=True, text=True, timeout=180)
            assert r.returncode == 0, (cmd, r.stdout, r.stderr)
            outs.append(r.stdout)
        assert f"creates them in {run}/keys" in outs[0] and "actors-cpu.sbatch: job" in outs[1]
        assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in (run / "keys").glob("*.key_secret"))
        assert len(list((run / "keys").glob("*.key_secret"))) == 3  # learner, the cpu pool, autoscale's control

        def trained() -> bool:
            m = read_jsonl(run / "learner" / "metrics.jsonl") if (run / "learner" / "metrics.jsonl").exists() else []
            return bool(m) and m[-1]["step"] >= 2

        wait_for(trained, 600, "two steps of the quick start's run", every_s=2.0)
        log = "\n".join(p.read_text(errors="replace") for p in (run / "logs").glob("*.log"))
        assert "CURVE on: learner key" in log and "CurveConfigError" not in log
        assert (run / "learner.addr").read_text().split()[0] == net.addr("n1")
        trajs = read_jsonl(run / "learner" / "trajectories.jsonl")
        assert {parse_actor_id(t["actor_id"])[0] for t in trajs if t["accepted"]} == {"cpu"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not OK, reason=WHY)
def test_two_rank_learner_cancelled_resumes_on_resubmission_and_on_requeue_its_actor_follows(tmp_path, tiny_model_dir):
    """A two-rank learner job (torchrun) under ``scancel``: rank 0 checkpoints the step it is
    at, every rank stops, no ``learner.done`` is written, and the envhub and actor jobs end
    because the learner job has left the queue (``slurm.poll_s``).  ``turnscale slurm`` again
    with the same overrides resumes from that checkpoint (``learner.resume`` set by the
    script) with new actors.  Then the learner job is requeued (``scontrol requeue``): it
    resumes again on new ports, and the running actor job restarts its actor against the new
    address (same actor id) and trains on.  Nothing is trained twice within an incarnation."""
    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu",), cpus=8)])
    run = tmp_path / "run"
    overrides = run_overrides(run, tiny_model_dir, pools="[{name:cpu,count:1,constraint:cpu,cpus_per_task:1}]",
                              steps=100000, groups_per_step=1, max_groups=1,
                              extra=["slurm.learner_ranks=2", "learner.checkpoint_every=2"])

    def steps() -> list[int]:
        f = run / "learner" / "metrics.jsonl"
        return [m["step"] for m in read_jsonl(f)] if f.exists() else []

    def log_of(job: str) -> str:
        p = run / "logs" / f"learner-{job}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    with slurm_session(c, 90, run=run):
        job = learner_job(submit(c, overrides))
        wait_for(lambda: max(steps(), default=0) >= 3, 420, "three steps")
        c.run(["scancel", "--full", job])
        wait_for(lambda: not c.jobs(), 240, "every job ending after the learner job was cancelled")
        log = log_of(job)
        assert "learner got SIGTERM; checkpointing and stopping" in log and "stopped by a signal" in log, log[-3000:]
        assert not (run / "learner.done").exists()
        stopped_at = max(steps())
        newest = max(int(p.name.removeprefix("step-")) for p in (run / "learner" / "checkpoints").glob("step-*"))
        assert newest == stopped_at, (newest, stopped_at)  # the stop checkpointed the step it was at

        out = submit(c, overrides)  # resubmission: the run continues
        assert "the learner resumes from" in out, out
        job2 = learner_job(out)
        wait_for(lambda: f"resumed at step {stopped_at}" in log_of(job2), 300, "the resubmitted learner resuming")
        wait_for(lambda: max(steps()) >= stopped_at + 2, 300, "two steps after the resume")
        addr = (run / "learner.addr").read_text()
        actor_jobs = {j for j, name, _ in c.jobs() if name.startswith("ts-actors-")}
        assert actor_jobs, c.jobs()

        c.run(["scontrol", "requeue", job2])  # the same job again: resume, new ports, the actor follows
        wait_for(lambda: (run / "learner.addr").exists() and (run / "learner.addr").read_text() != addr, 300,
                 "the requeued learner publishing its new address")
        at = max(steps())
        wait_for(lambda: max(steps()) >= at + 2, 300, "two steps after the requeue")
        actor_logs = "\n".join(p.read_text(errors="replace") for p in (run / "logs").glob("actors-*.log"))
        assert "the learner moved to" in actor_logs and not (run / "learner.done").exists()
        assert actor_jobs <= {j for j, _, _ in c.jobs()}, "the actor job ended instead of following the learner"
        trajs = read_jsonl(run / "learner" / "trajectories.jsonl")
        check_groups(trajs)
        check_ledger(run / "learner", unique_tasks=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not OK, reason=WHY)
def test_autoscaler_drains_an_actor_when_the_learners_own_signals_say_it_is_saturated(tmp_path, tiny_model_dir):
    """Scale-down from the learner's signals alone (the other autoscaler test forces it with
    ``max_actors=1``): a slow learner (``learner.debug_step_delay_s``) with two actors is never
    idle and groups wait in its ready buffer, so the controller, with the pool's bounds 1..2
    untouched, first lowers the lease limit and then drains one actor; its job ends by itself,
    the drained actor gets no lease after the drain and its groups are trained."""
    from turnscale.control import Autoscaler, LearnerControl
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy
    from turnscale.slurm import SlurmBackend

    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu",), cpus=8)])
    run = tmp_path / "run"
    overrides = run_overrides(run, tiny_model_dir, pools="[{name:cpu,count:2,constraint:cpu,cpus_per_task:1}]",
                              steps=100000, groups_per_step=1, max_groups=1, extra=["learner.debug_step_delay_s=3"])
    with slurm_session(c, 90, run=run) as hold:
        job = learner_job(submit(c, overrides))
        _, port = learner_address(run)
        control = hold(LearnerControl("127.0.0.1", port, timeout_s=30))
        wait_for(lambda: len(control.status().actors) == 2 and control.status().step >= 1, 300, "two actors and a step")
        backend = SlurmBackend(run, {"cpu": 2}, runner=lambda cmd: subprocess.run(
            list(cmd), env=c.env(), capture_output=True, text=True, check=True, timeout=60).stdout)
        policy = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=2),), window=2, up_idle=0.5,
                               down_idle=0.1, ready_low=0.5, ready_high=1.0, min_leases=1, max_leases=1)
        auto = Autoscaler(control=control, controller=ScalingController(policy, wanted={"cpu": 2}), backend=backend)

        def drained() -> bool:
            auto.tick()
            return bool(backend.drained)

        wait_for(drained, 240, "a drain decided from the learner's signals", every_s=2.0)
        d = next(d for d in auto.decisions if d.changed and d.wanted == {"cpu": 1})
        assert d.reason.startswith("saturated") and policy.pools[0].max_actors == 2, d.reason
        gone = backend.drained[-1]
        wait_for(lambda: gone not in {a.actor_id for a in control.status().actors}, 180, f"{gone} leaving")
        wait_for(lambda: sum(1 for _, name, _ in c.jobs() if name.startswith("ts-actors-")) == 1, 120,
                 "the drained actor's task ending")
        c.run(["scancel", "--full", job])
        wait_for(lambda: not c.jobs(), 240, "every job ending")
        log = learner_log(run)
        assert f"actor {gone} drained" in log
        assert f"granted to actor {gone}" not in log[log.index(f"actor {gone} (pool cpu) draining"):]
        check_groups(read_jsonl(run / "learner" / "trajectories.jsonl"))
        check_ledger(run / "learner")
