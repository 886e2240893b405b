"""A run submitted through ``turnscale slurm`` to a real Slurm (``cluster.slurm.FakeSlurm``:
slurmctld + slurmd on this machine, no munge) trains end to end with actors in two pools.

The node's features ``cpu`` and ``cpu2`` stand for two kinds of hardware; the ``cpu2`` pool
runs the hf engine with other settings (``engine.max_batch=2``).  The learner job publishes
its address in the run folder, the envhub job its URL, the two actor arrays find them, the
learner trains its steps and tells the actors to stop; every job ends by itself.  Skips
with the reason when Slurm is not installed or this is not root.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.slurm import FakeSlurm, Node, available
from protocol.transport import free_port
from tests.conftest import REPO_ROOT
from tests.integration.test_failures import check_groups, check_ledger, read_jsonl

OK, WHY = available()
STEPS = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not OK, reason=WHY)
def test_run_submitted_through_the_launcher_trains_with_two_pools(tmp_path, tiny_model_dir):
    c = FakeSlurm(tmp_path / "slurm", [Node("n1", ("cpu", "cpu2"), cpus=8)])
    run = tmp_path / "run"
    ports = [free_port() for _ in range(4)]
    overrides = [
        f"slurm.dir={run}", f"slurm.python={sys.executable}", f"slurm.workdir={REPO_ROOT}", "slurm.learner_cpus=1",
        "slurm.envhub_cpus=1", "slurm.wait_s=300",
        'slurm.pools=[{name:cpu,count:1,constraint:cpu,cpus_per_task:1},'
        '{name:cpu2,count:1,constraint:cpu2,cpus_per_task:1,overrides:["engine.max_batch=2"]}]',
        f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}", f"env.port={ports[3]}",
        f"model.path={tiny_model_dir}", "learner.curve.enabled=false", "actor.curve.enabled=false",
        "schedule.turns=[2]", "sampling.max_new_tokens=16", "algo.group_size=2", "learner.groups_per_step=2",
        "learner.max_staleness=1", f"learner.steps={STEPS}", "learner.heartbeat_interval_s=1", "logger.tensorboard=false",
        "logger.console_every_s=0", "actor.max_groups=2", "actor.request_timeout_s=10", "actor.reconnect_max_backoff_s=1",
    ]
    try:
        c.start(90)
        out = subprocess.run([sys.executable, "-m", "turnscale", "slurm", *overrides], env=c.env(), capture_output=True,
                             text=True, timeout=120, cwd=REPO_ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "actors-cpu2.sbatch: job" in out.stdout
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline and c.jobs():
            time.sleep(1)
        assert not c.jobs(), f"jobs still queued: {c.jobs()}\n{_logs(run)}"
        metrics = read_jsonl(run / "learner" / "metrics.jsonl")
        assert metrics and metrics[-1]["step"] == STEPS, _logs(run)
        assert (run / "learner.addr").read_text().split()[1] == str(ports[0])
        trajs = read_jsonl(run / "learner" / "trajectories.jsonl")
        pools = {t["actor_id"].split("-", 1)[0] for t in trajs if t["accepted"]}
        assert pools == {"cpu", "cpu2"}, pools
        assert any("pool/cpu/actors" in m for m in metrics) and any("pool/cpu2/actors" in m for m in metrics)
        check_groups(trajs)
        check_ledger(run / "learner")
    except BaseException:
        print(_logs(run))
        print(c.tail("slurmctld", 40))
        raise
    finally:
        c.close()
        assert not c.stray_pids(), "a job process survived the teardown"


def _logs(run: Path) -> str:
    out = []
    for p in sorted((run / "logs").glob("*.log")) if (run / "logs").exists() else []:
        out.append(f"===== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
    return "\n".join(out)
