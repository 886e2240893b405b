"""Several fake Slurm nodes, one slurmd per network namespace (``FakeSlurm(net=Cluster)``):
jobs land on the nodes whose features they ask for, run inside that node's namespace, a
killed node's jobs leave ``squeue`` and ``SlurmBackend`` replaces them on another node, and a
node that comes up at run time takes the work waiting for it.  The "actors" here are
``sleep`` jobs that report where they run; the learner side of a lost node is
tests/integration/test_slurm_cluster.py.  Skips with the reason without root/Slurm/netns."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from turnscale.cluster import netns
from turnscale.cluster.slurm import FakeSlurm, Node, available
from tests.slurm_fixtures import learner_address, learner_job, learner_log, run_overrides, slurm_session, submit, wait_for, wait_started

OK, WHY = available()
NS_OK, NS_WHY = netns.available()


def _script(folder: Path, pool: str, constraint: str) -> None:
    """A pool's actor script: prints the address of the node it runs on, then sleeps."""
    (folder / f"actors-{pool}.sbatch").write_text(
        f"#!/bin/bash\n#SBATCH -J ts-actors-{pool}\n#SBATCH -o {folder}/{pool}-%A_%a.log\n#SBATCH -c 1\n"
        f"#SBATCH --constraint={constraint}\n#SBATCH --no-requeue\n"
        "hostname -I | awk '{print $1}'\nexec sleep 600\n")


def _where(c: FakeSlurm, pool: str, folder: Path | None = None) -> dict[str, str]:
    """Running array task -> node, from squeue (by the job name of ``folder``'s pool script:
    ``turnscale slurm`` names jobs ``ts-actors-<pool>-<run tag>``)."""
    from turnscale.slurm import job_name

    name = job_name(folder / f"actors-{pool}.sbatch", "") if folder is not None else f"ts-actors-{pool}"
    out = c.run(["squeue", "-h", "--array", f"--name={name}", "--states=RUNNING", "-o", "%i %N"])
    return {w[0]: w[1] for w in (line.split() for line in out.splitlines()) if len(w) == 2}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.skipif(not NS_OK, reason=NS_WHY)
def test_jobs_follow_node_features_a_killed_node_is_replaced_and_late_and_dynamic_nodes_take_work(tmp_path):
    from turnscale.slurm import SlurmBackend

    net = netns.Cluster(["n1", "n2", "n3", "n4", "n5"])
    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu",), cpus=2), Node("n2", ("cpu",), cpus=2),
                                       Node("n3", ("cpu2",), cpus=2), Node("n4", ("gpu",), cpus=2, start=False)],
                  net=net, max_nodes=8)

    def runner(cmd):
        return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=60, env=c.env()).stdout

    with slurm_session(c, 120, net=net):
        assert {n: c.node_states()[n] for n in ("n1", "n2", "n3")} == {"n1": "idle", "n2": "idle", "n3": "idle"}
        assert c.node_states()["n4"].startswith(("down", "unk"))
        for pool, feat in (("cpu", "cpu"), ("cpu2", "cpu2"), ("gpu", "gpu")):
            _script(tmp_path, pool, feat)
        b = SlurmBackend(tmp_path, {"cpu": 0, "cpu2": 0, "gpu": 0}, runner=runner)

        # 1. features choose the nodes; each job runs inside its node's namespace
        b.scale_to("cpu", 2)
        b.scale_to("cpu2", 1)
        wait_for(lambda: len(_where(c, "cpu")) == 2 and len(_where(c, "cpu2")) == 1, 120, "three running tasks")
        assert set(_where(c, "cpu").values()) <= {"n1", "n2"} and set(_where(c, "cpu2").values()) == {"n3"}
        addr = wait_for(lambda: next((t for t in (p.read_text().strip() for p in tmp_path.glob("cpu2-*.log")) if t), ""),
                     60, "the cpu2 task's output")
        assert addr == net.addr("n3"), (addr, net.addr("n3"))

        # 2. the node of a cpu task dies: its tasks leave squeue, the backend counts them lost
        #    and their replacements run on the other cpu node
        where = _where(c, "cpu")
        victim = sorted(where.values())[0]
        lost = {t for t, n in where.items() if n == victim}
        c.kill_node(victim)
        wait_for(lambda: not lost & set(_where(c, "cpu")) and b.live("cpu") == 2 - len(lost), 240,
              f"{sorted(lost)} leaving squeue after {victim} died")
        assert c.node_states()[victim].startswith("down")
        assert b.refresh()["cpu"] == 2 - len(lost)
        b.scale_to("cpu", 2)
        other = ({"n1", "n2"} - {victim}).pop()
        wait_for(lambda: sorted(_where(c, "cpu").values()) == [other, other], 120, f"two cpu tasks on {other}")

        # 3. a gpu task waits (no gpu node up) until n4 (declared, DOWN) comes up, then runs there
        b.scale_to("gpu", 1)
        assert b.live("gpu") == 1 and not _where(c, "gpu")
        c.start_node("n4", 120)
        wait_for(lambda: list(_where(c, "gpu").values()) == ["n4"], 120, "the gpu task on n4")

        # 4. a node that Slurm did not know joins at run time (dynamic node, slurmd -Z) with a
        #    new feature, tpu; then the tpu pool's task runs there, inside n5's namespace
        #    (sbatch refuses a constraint no node has yet: the pool is scaled after the join)
        assert "n5" not in c.node_states()
        c.join_node(Node("n5", ("tpu",), cpus=2), 120)
        _script(tmp_path, "tpu", "tpu")
        b.pools["tpu"] = 0
        b.scale_to("tpu", 1)
        wait_for(lambda: list(_where(c, "tpu").values()) == ["n5"], 120, "the tpu task on the dynamic node n5")
        addr = wait_for(lambda: next((t for t in (p.read_text().strip() for p in tmp_path.glob("tpu-*.log")) if t), ""),
                     60, "the tpu task's output")
        assert addr == net.addr("n5"), (addr, net.addr("n5"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.skipif(not NS_OK, reason=NS_WHY)
def test_node_killed_mid_run_learner_reissues_its_leases_and_autoscaler_replaces_the_actor_on_another_node(
        tmp_path, tiny_model_dir):
    """A run through ``turnscale slurm`` on three fake nodes (learner + envhub on ``n1``, the
    cpu pool's actor on ``n2`` or ``n3``).  The actor's node dies (every process on it
    SIGKILLed) while the actor holds a lease: the learner re-issues that lease after
    ``lease_ttl_s``, ``Autoscaler.tick`` (``SlurmBackend.refresh`` from squeue) submits a
    replacement that runs on the other cpu node and trains; nothing is trained twice."""
    from turnscale.control import Autoscaler, LearnerControl
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy
    from turnscale.slurm import SlurmBackend
    from tests.integration.test_failures import check_groups, check_ledger, read_jsonl

    net = netns.Cluster(["n1", "n2", "n3"])
    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("svc",), cpus=2), Node("n2", ("cpu",), cpus=1),
                                       Node("n3", ("cpu",), cpus=1)], net=net)
    run = tmp_path / "run"
    overrides = run_overrides(run, tiny_model_dir, pools="[{name:cpu,count:1,constraint:cpu,cpus_per_task:1}]",
                              steps=100000, groups_per_step=1, max_groups=1,
                              extra=["slurm.learner_constraint=svc", "learner.lease_ttl_s=15", "actor.weights_shm=false"])
    with slurm_session(c, 120, run=run, net=net) as hold:
        job = learner_job(submit(c, overrides))
        host, port = learner_address(run)
        assert host == net.addr("n1")
        control = hold(LearnerControl(host, port, timeout_s=30))
        wait_started(control)
        first = control.status().actors[0].actor_id
        where = _where(c, "cpu", run)
        assert len(where) == 1
        victim = next(iter(where.values()))
        other = ({"n2", "n3"} - {victim}).pop()

        backend = SlurmBackend(run, {"cpu": 1}, runner=lambda cmd: subprocess.run(
            list(cmd), env=c.env(), capture_output=True, text=True, check=True, timeout=60).stdout)
        policy = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=1),), window=2, max_leases=1)
        auto = Autoscaler(control=control, controller=ScalingController(policy, wanted={"cpu": 1}), backend=backend)
        auto.tick()
        assert backend.submitted["cpu"] == 1  # nothing lost yet: nothing submitted

        wait_for(lambda: any(a.actor_id == first and a.leases > 0 for a in control.status().actors), 120,
              f"{first} holding a lease")
        killed_at = control.status().step
        c.kill_node(victim)

        def replaced() -> bool:
            auto.tick()
            return any(a.actor_id != first for a in control.status().actors)

        wait_for(lambda: replaced(), 420, "a replacement actor registering")
        assert backend.submitted["cpu"] == 2
        assert list(_where(c, "cpu", run).values()) == [other]
        wait_for(lambda: control.status().step >= killed_at + 2, 300, "two steps after the node died")
        wait_for(lambda: "expired; re-issued" in learner_log(run), 120, "the dead actor's lease re-issued")
        c.run(["scancel", "--full", job])
        wait_for(lambda: not c.jobs(), 300, "every job ending")
        log = learner_log(run)
        trajs = read_jsonl(run / "learner" / "trajectories.jsonl")
        assert {t["actor_id"] for t in trajs if t["accepted"]} >= {first}
        assert any(t["actor_id"] != first and t["accepted"] for t in trajs), "the replacement trained nothing"
        assert "expired; re-issued" in log
        check_groups(trajs)
        check_ledger(run / "learner")
