"""Several fake Slurm nodes, one slurmd per network namespace (``FakeSlurm(net=Cluster)``):
jobs land on the nodes whose features they ask for, run inside that node's namespace, a
killed node's jobs leave ``squeue`` and ``SlurmBackend`` replaces them on another node, and a
node that comes up at run time takes the work waiting for it.  The "actors" here are
``sleep`` jobs that report where they run; the learner side of a lost node is
tests/integration/test_slurm_cluster.py.  Skips with the reason without root/Slurm/netns."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from turnscale.cluster import netns
from turnscale.cluster.slurm import FakeSlurm, Node, available

OK, WHY = available()
NS_OK, NS_WHY = netns.available()


def _script(folder: Path, pool: str, constraint: str) -> None:
    """A pool's actor script: prints the address of the node it runs on, then sleeps."""
    (folder / f"actors-{pool}.sbatch").write_text(
        f"#!/bin/bash\n#SBATCH -J ts-actors-{pool}\n#SBATCH -o {folder}/{pool}-%A_%a.log\n#SBATCH -c 1\n"
        f"#SBATCH --constraint={constraint}\n#SBATCH --no-requeue\n"
        "hostname -I | awk '{print $1}'\nexec sleep 600\n")


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.5)


def _where(c: FakeSlurm, pool: str) -> dict[str, str]:
    """Running array task -> node, from squeue."""
    out = c.run(["squeue", "-h", "--array", f"--name=ts-actors-{pool}", "--states=RUNNING", "-o", "%i %N"])
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

    try:
        c.start(120)
        assert {n: c.node_states()[n] for n in ("n1", "n2", "n3")} == {"n1": "idle", "n2": "idle", "n3": "idle"}
        assert c.node_states()["n4"].startswith(("down", "unk"))
        for pool, feat in (("cpu", "cpu"), ("cpu2", "cpu2"), ("gpu", "gpu")):
            _script(tmp_path, pool, feat)
        b = SlurmBackend(tmp_path, {"cpu": 0, "cpu2": 0, "gpu": 0}, runner=runner)

        # 1. features choose the nodes; each job runs inside its node's namespace
        b.scale_to("cpu", 2)
        b.scale_to("cpu2", 1)
        _wait(lambda: len(_where(c, "cpu")) == 2 and len(_where(c, "cpu2")) == 1, 120, "three running tasks")
        assert set(_where(c, "cpu").values()) <= {"n1", "n2"} and set(_where(c, "cpu2").values()) == {"n3"}
        addr = _wait(lambda: next((t for t in (p.read_text().strip() for p in tmp_path.glob("cpu2-*.log")) if t), ""),
                     60, "the cpu2 task's output")
        assert addr == net.addr("n3"), (addr, net.addr("n3"))

        # 2. the node of a cpu task dies: its tasks leave squeue, the backend counts them lost
        #    and their replacements run on the other cpu node
        where = _where(c, "cpu")
        victim = sorted(where.values())[0]
        lost = {t for t, n in where.items() if n == victim}
        c.kill_node(victim)
        _wait(lambda: not lost & set(_where(c, "cpu")) and b.live("cpu") == 2 - len(lost), 240,
              f"{sorted(lost)} leaving squeue after {victim} died")
        assert c.node_states()[victim].startswith("down")
        assert b.refresh()["cpu"] == 2 - len(lost)
        b.scale_to("cpu", 2)
        other = ({"n1", "n2"} - {victim}).pop()
        _wait(lambda: sorted(_where(c, "cpu").values()) == [other, other], 120, f"two cpu tasks on {other}")

        # 3. a gpu task waits (no gpu node up) until n4 (declared, DOWN) comes up, then runs there
        b.scale_to("gpu", 1)
        assert b.live("gpu") == 1 and not _where(c, "gpu")
        c.start_node("n4", 120)
        _wait(lambda: list(_where(c, "gpu").values()) == ["n4"], 120, "the gpu task on n4")

        # 4. a node that Slurm did not know joins at run time (dynamic node, slurmd -Z) with a
        #    new feature, tpu; then the tpu pool's task runs there, inside n5's namespace
        #    (sbatch refuses a constraint no node has yet: the pool is scaled after the join)
        assert "n5" not in c.node_states()
        c.join_node(Node("n5", ("tpu",), cpus=2), 120)
        _script(tmp_path, "tpu", "tpu")
        b.pools["tpu"] = 0
        b.scale_to("tpu", 1)
        _wait(lambda: list(_where(c, "tpu").values()) == ["n5"], 120, "the tpu task on the dynamic node n5")
        addr = _wait(lambda: next((t for t in (p.read_text().strip() for p in tmp_path.glob("tpu-*.log")) if t), ""),
                     60, "the tpu task's output")
        assert addr == net.addr("n5"), (addr, net.addr("n5"))
    except BaseException:
        print(c.tail("slurmctld", 40))
        print(c.run(["sinfo", "-N", "-l"]))
        raise
    finally:
        c.close()
        net.close()
        assert not c.stray_pids(), "a job process survived the teardown"
        assert not netns.leftovers(net.prefix), netns.leftovers(net.prefix)
