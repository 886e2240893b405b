"""Failures the running system survives: real envhub, learner and actor processes on 127.0.0.1
with the tiny model, started and ended by pid through ``turnscale.procs.ProcessGroup``.

- elastic: a third actor joins mid-run (current weights and turn limit before its first
  lease); an actor SIGKILLed mid-group has its leases re-issued after ``lease_ttl_s``;
- learner restart: SIGKILL, then ``learner.resume=true``; actors reconnect by themselves;
  step, version, turn limit and task cursor continue from the checkpoint;
- env server restart: SIGKILL envhub, restart on the same port; broken episodes end as
  ``env_error``, their groups are dropped as failed and their tasks re-issued;
- backpressure: a slow learner (``learner.debug_step_delay_s``) keeps leases within
  admission control, staleness within ``max_staleness`` and actor memory bounded.

Every test also checks, from ``trajectories.jsonl``, that no group was trained twice and no
partial or failed group was trained (``check_groups``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Callable

import pytest

from protocol.messages import TRAINABLE_FINISH_REASONS
from protocol.transport import free_port
from turnscale.procs import Child, ProcessGroup, wait_http_ok

GROUP_SIZE = 2
GROUPS_PER_STEP = 2
MAX_STALENESS = 1


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


class Cluster:
    """One envhub, one learner (restartable) and named actors, all on 127.0.0.1."""

    def __init__(self, tmp_path: Path, model_dir: str, *extra: str) -> None:
        self.dir = tmp_path / "learner"
        self.procs = ProcessGroup(tmp_path / "logs")
        self.env_port = free_port()
        ports = [free_port() for _ in range(3)]
        self.common = [
            f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
            f"actor.learner_port={ports[0]}", f"env.port={self.env_port}", f"model.path={model_dir}",
            "schedule.turns=[2,3]", "schedule.every=2", "sampling.max_new_tokens=16", f"algo.group_size={GROUP_SIZE}",
            "algo.lr=1e-3", f"learner.groups_per_step={GROUPS_PER_STEP}", f"learner.max_staleness={MAX_STALENESS}",
            f"learner.dir={self.dir}", "learner.heartbeat_interval_s=1", "learner.steps=1000",
            "logger.tensorboard=false", "logger.console_every_s=0", "actor.max_groups=2", "actor.request_timeout_s=5",
            "actor.reconnect_max_backoff_s=1", "actor.shutdown_grace_s=3", "engine.max_batch=8", *extra,
        ]
        self.learners: list[Child] = []
        self.actors: dict[str, Child] = {}

    # -- processes
    def start_envhub(self, name: str = "envhub") -> Child:
        child = self.procs.start(name, ["envhub", "env=babyai", "host=127.0.0.1", f"port={self.env_port}"])
        wait_http_ok(f"{self.env_url}/health", 90, child)
        return child

    @property
    def env_url(self) -> str:
        return f"http://127.0.0.1:{self.env_port}"

    def start_learner(self, *extra: str) -> Child:
        child = self.procs.start(f"learner{len(self.learners) + 1}", ["learner", *self.common, *extra])
        self.learners.append(child)
        return child

    def start_actor(self, actor_id: str) -> Child:
        child = self.procs.start(actor_id, ["actor", *self.common, f"actor.actor_id={actor_id}"])
        self.actors[actor_id] = child
        return child

    def stop_learner(self) -> None:
        """SIGTERM the current learner (it checkpoints and exits 0)."""
        assert self.learners[-1].stop(60, signal.SIGTERM) == 0, self.learners[-1].tail()

    # -- outputs
    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def trajs(self) -> list[dict]:
        return read_jsonl(self.dir / "trajectories.jsonl")

    def step(self) -> int:
        m = self.metrics()
        return int(m[-1]["step"]) if m else 0

    def log(self, child: Child) -> str:
        return child.log_path.read_text(errors="replace")

    def grants(self, learner: Child) -> list[tuple[str, int, int, int, str]]:
        """(lease id, task, turn limit, version, actor) of every lease ``learner`` granted, in order."""
        pat = r"lease (\S+) \(task (\d+), turn limit (\d+), version (\d+)\) granted to actor (\S+)"
        return [(m[0], int(m[1]), int(m[2]), int(m[3]), m[4]) for m in re.findall(pat, self.log(learner))]

    def wait(self, what: str, cond: Callable[[], bool], timeout_s: float, alive: list[Child] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        watch = alive if alive is not None else [self.learners[-1], *self.actors.values()]
        while not cond():
            for c in watch:
                if not c.alive():
                    raise AssertionError(f"{c.name} exited with {c.popen.returncode} while waiting for {what}:\n{c.tail(40)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(0.25)

    def dump(self) -> None:
        for c in self.procs.children:
            print(f"===== {c.name} (pid {c.pid}, rc {c.popen.poll()})\n{c.tail(60)}")


@pytest.fixture
def cluster_factory(tmp_path, tiny_model_dir):
    made: list[Cluster] = []

    def make(*extra: str) -> Cluster:
        c = Cluster(tmp_path, tiny_model_dir, *extra)
        made.append(c)
        return c

    yield make
    for c in made:
        c.procs.close(grace_s=8)


def check_groups(trajs: list[dict]) -> dict[str, list[dict]]:
    """No group trained twice, no partial or failed group trained.  Returns accepted groups by lease."""
    by_lease: dict[str, list[dict]] = defaultdict(list)
    for t in trajs:
        if t["accepted"]:
            by_lease[t["lease_id"]].append(t)
        else:
            assert t["drop_reason"], t["lease_id"]
    for lid, eps in by_lease.items():
        assert sorted(e["episode"] for e in eps) == list(range(GROUP_SIZE)), f"lease {lid}: partial or repeated group"
        assert all(e["finish_reason"] in TRAINABLE_FINISH_REASONS for e in eps), [e["finish_reason"] for e in eps]
        assert all(e["drop_reason"] == "" for e in eps)
    tasks = [eps[0]["data_idx"] for eps in by_lease.values()]
    assert len(tasks) == len(set(tasks)), "a task's group was accepted twice"
    for t in trajs:
        if t["finish_reason"] not in TRAINABLE_FINISH_REASONS:
            assert not t["accepted"] and t["drop_reason"] == "failed", t
    return by_lease


def check_metrics(metrics: list[dict], first_step: int = 1) -> None:
    steps = [m["step"] for m in metrics]
    assert steps == list(range(first_step, first_step + len(steps))), steps
    for m in metrics:
        assert m["rollout/trained_groups_total"] == m["step"] * GROUPS_PER_STEP
        assert m.get("rollout/staleness_max", 0) <= MAX_STALENESS


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ----------------------------------------------------------------------------- elastic


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_joining_actor_gets_current_policy_and_killed_actors_leases_are_reissued(cluster_factory):
    c = cluster_factory("learner.lease_ttl_s=5")
    try:
        c.start_envhub()
        learner = c.start_learner()
        c.start_actor("a1")
        c.start_actor("a2")
        c.wait("step 2 (turn limit 3, version 2)", lambda: c.step() >= 2, 150)

        # a third actor joins: its first lease is played with the current weights and turn limit
        a3 = c.start_actor("a3")
        c.wait("a group from a3", lambda: any(t["actor_id"] == "a3" for t in c.trajs()), 90)
        # the session that played it (an earlier one ends if the versions it was offered
        # were retired while the engine loaded; the actor then says Hello again)
        joined_at = int(re.findall(r"registered with learner run \S+ \(version (\d+)\)", c.log(a3))[-1])
        assert joined_at >= 2
        first = [t for t in c.trajs() if t["actor_id"] == "a3"][0]
        assert first["turn_limit"] == 3
        assert min(turn["policy_version"] for turn in first["turns"]) >= joined_at
        a3_grants = [g for g in c.grants(learner) if g[4] == "a3"]
        assert a3_grants[0][2] == 3 and a3_grants[0][3] >= joined_at
        assert f"pulled weights version {joined_at}" in c.log(a3)

        # SIGKILL a1 while it holds a lease whose group has not arrived
        def a1_busy() -> bool:
            received = {t["lease_id"] for t in c.trajs()}
            return any(g[4] == "a1" and g[0] not in received for g in c.grants(learner))

        c.wait("a1 holding a lease", a1_busy, 60)
        c.actors.pop("a1").kill()
        received = {t["lease_id"] for t in c.trajs()}
        lost = {g[0]: g[1] for g in c.grants(learner) if g[4] == "a1" and g[0] not in received}
        assert lost
        killed_at = c.step()
        for lid in lost:
            c.wait(f"lease {lid} expiring", lambda: f"lease {lid} (task {lost[lid]}) expired; re-issued" in c.log(learner), 30)

        def reissued_and_trained() -> bool:
            acc = {(t["data_idx"], t["lease_id"]) for t in c.trajs() if t["accepted"]}
            return all(any(task == d and lid != lid0 for d, lid in acc) for lid0, task in lost.items())

        c.wait("the lost tasks trained by the others", reissued_and_trained, 120)
        c.wait("two more steps", lambda: c.step() >= killed_at + 2, 120)
        c.stop_learner()

        log = c.log(learner)
        for lid, task in lost.items():
            assert re.search(rf"lease {re.escape(lid)} \(task {task}\) expired; re-issued", log), lid
        trajs = c.trajs()
        assert not any(t["lease_id"] in lost for t in trajs), "a killed actor's lease cannot deliver a group"
        by_lease = check_groups(trajs)
        assert {t["actor_id"] for eps in by_lease.values() for t in eps} == {"a1", "a2", "a3"}
        metrics = c.metrics()
        check_metrics(metrics)
        assert sum(m.get("rollout/leases_expired", 0) for m in metrics) >= len(lost)
        assert "actor a3 registered" in log
    except BaseException:
        c.dump()
        raise
