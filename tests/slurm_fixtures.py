"""Shared by the tests that run a real Slurm (``cluster.slurm.FakeSlurm``):
tests/integration/test_slurm_cluster.py and tests/integration/test_slurm_nodes.py.

- ``slurm_session(c, run=..., net=...)``: starts the cluster, and on the way out closes what
  the test handed to it (``hold(obj)``), the cluster and its namespaces, then asserts that no
  job process and no namespace survived; on a failure it prints the run's logs, slurmctld's
  tail (and ``sinfo`` with namespaces) before the error goes on.
- ``run_overrides`` + ``submit``: a tiny training run through ``turnscale slurm`` (CURVE off,
  two-turn episodes, 16 new tokens); ``learner_address`` reads the address the learner job
  published (it picks a free port); ``wait_for`` bounds every wait; ``wait_started`` waits
  for the learner's first step with one actor.
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from turnscale.cluster import netns
from turnscale.cluster.slurm import FakeSlurm
from tests.conftest import REPO_ROOT

T = TypeVar("T")


@contextmanager
def slurm_session(c: FakeSlurm, start_s: float, *, run: Path | None = None,
                  net: netns.Cluster | None = None) -> Iterator[Callable[[T], T]]:
    """Start ``c`` (within ``start_s``); yields ``hold(obj) -> obj``: ``obj.close()`` runs at
    the end, before the cluster is closed (e.g. a ``LearnerControl``)."""
    held: list[Any] = []

    def hold(obj: T) -> T:
        held.append(obj)
        return obj

    try:
        c.start(start_s)
        yield hold
    except BaseException:
        if run is not None:
            print(run_logs(run))
        print(c.tail("slurmctld", 40))
        if net is not None:
            print(c.run(["sinfo", "-N", "-l"]))
        raise
    finally:
        for obj in reversed(held):
            obj.close()
        c.close()
        if net is not None:
            net.close()
        assert not c.stray_pids(), "a job process survived the teardown"
        if net is not None:
            assert not netns.leftovers(net.prefix), netns.leftovers(net.prefix)


def run_overrides(run: Path, model_dir: str, *, pools: str, steps: int, groups_per_step: int,
                  max_groups: int, extra: Sequence[str] = ()) -> list[str]:
    """``turnscale slurm`` overrides for a tiny run in ``run`` (the jobs pick free ports on
    their node: ``learner_address`` reads the learner's); ``extra`` adds keys the base does not set."""
    return [
        f"slurm.dir={run}", f"slurm.python={sys.executable}", f"slurm.workdir={REPO_ROOT}", "slurm.learner_cpus=1",
        "slurm.envhub_cpus=1", "slurm.wait_s=300", "slurm.poll_s=5", f"slurm.pools={pools}",
        f"model.path={model_dir}", "learner.curve.enabled=false", "actor.curve.enabled=false",
        "schedule.turns=[2]", "sampling.max_new_tokens=16", "algo.group_size=2", f"learner.groups_per_step={groups_per_step}",
        "learner.max_staleness=1", f"learner.steps={steps}", "learner.heartbeat_interval_s=1", "logger.tensorboard=false",
        "logger.console_every_s=0", f"actor.max_groups={max_groups}", "actor.request_timeout_s=10",
        "actor.reconnect_max_backoff_s=1", *extra,
    ]


def submit(c: FakeSlurm, overrides: Sequence[str]) -> str:
    """Run ``turnscale slurm`` against ``c``; returns its stdout (one ``<script>: job <id>`` line per job)."""
    out = subprocess.run([sys.executable, "-m", "turnscale", "slurm", *overrides], env=c.env(), capture_output=True,
                         text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def learner_address(run: Path, timeout_s: float = 180) -> tuple[str, int]:
    """``(host, port)`` the learner job published in ``<run>/learner.addr`` (waited for)."""
    text = wait_for(lambda: (run / "learner.addr").exists() and (run / "learner.addr").read_text().strip(), timeout_s,
                    "learner.addr")
    host, port = text.split()
    return host, int(port)


def learner_job(stdout: str) -> str:
    """The learner's job id in ``submit``'s output."""
    return next(line.split()[-1] for line in stdout.splitlines() if line.startswith("learner.sbatch"))


def wait_for(cond: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.5) -> T:
    """``cond()``'s first true value, polled every ``every_s``; ``AssertionError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def wait_started(control: Any, timeout_s: float = 300) -> None:
    """Wait until the learner (``LearnerControl``) has one actor and a finished step."""
    from turnscale.protocol.errors import PeerTimeout

    def started() -> bool:  # a learner still loading under load answers no status yet
        try:
            st = control.status()
        except PeerTimeout:
            return False
        return len(st.actors) == 1 and st.step >= 1

    wait_for(started, timeout_s, "one actor and a step")


def run_logs(run: Path) -> str:
    """The last 30 lines of every job log of the run."""
    out = []
    for p in sorted((run / "logs").glob("*.log")) if (run / "logs").exists() else []:
        out.append(f"===== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
    return "\n".join(out)


def learner_log(run: Path) -> str:
    """The learner jobs' logs, whole."""
    return "\n".join(p.read_text(errors="replace") for p in (run / "logs").glob("learner-*.log"))
