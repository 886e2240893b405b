"""Failures the running system survives: real envhub, learner and actor processes on 127.0.0.1
with the tiny model, started and ended by pid through ``common.procs.ProcessGroup``.

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
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Callable

import pytest

from turnscale.protocol.messages import TRAINABLE_FINISH_REASONS
from turnscale.protocol.transport import free_port
from turnscale.common.procs import Child, ProcessGroup, wait_http_ok

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
        self.procs = ProcessGroup(tmp_path / "logs", "turnscale")
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
    """No group accepted twice, no partial or failed group accepted.  Returns accepted groups by
    lease.  (A task may be accepted twice: a group accepted on arrival that turned stale before
    its batch formed is dropped and its task re-issued; ``check_ledger`` checks that no task is
    *trained* twice.)"""
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
    for t in trajs:
        if t["finish_reason"] not in TRAINABLE_FINISH_REASONS:
            assert not t["accepted"] and t["drop_reason"] == "failed", t
    return by_lease


def check_metrics(metrics: list[dict], first_step: int = 1) -> None:
    """Steps in order; staleness (recorded when each group is *trained*) within the bound."""
    steps = [m["step"] for m in metrics]
    assert steps == list(range(first_step, first_step + len(steps))), steps
    for m in metrics:
        assert m["rollout/trained_groups_total"] == m["step"] * GROUPS_PER_STEP
        assert m.get("rollout/staleness_max", 0) <= MAX_STALENESS
        assert m.get("actors/torn_weights", 0) == 0


def check_ledger(run_dir: Path, *, unique_tasks: bool = True) -> list[dict]:
    """From ``batches.jsonl``: every trained group within staleness at training time, none twice,
    and (``unique_tasks``; not across a resume, which retrains the steps after its checkpoint)
    no task trained twice."""
    rows = read_jsonl(run_dir / "batches.jsonl")
    trained = [r for r in rows if r["outcome"] == "trained"]
    assert all(0 <= r["staleness"] <= MAX_STALENESS for r in trained), [r for r in trained if r["staleness"] > MAX_STALENESS]
    ids = [r["lease_id"] for r in trained]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    tasks = [r["data_idx"] for r in trained]
    assert not unique_tasks or len(tasks) == len(set(tasks)), "a task was trained twice"
    return trained


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def live_rss_mb(pid: int) -> float | None:
    """``rss_mb`` of a running process; None once it has exited (no ``/proc`` entry, or a
    zombie not yet reaped, which has no VmRSS).  Actors now exit as soon as the learner
    answers them ``Shutdown``, while the learner still lingers for goodbyes."""
    try:
        return rss_mb(pid)
    except (OSError, RuntimeError):
        return None


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
        # the weights it loaded for that session: the version it was offered, or a newer one
        # when that version was retired before its first pull (the pull then takes the newest)
        session_log = c.log(a3).rsplit("registered with learner run", 1)[1]
        applied = [int(v) for v in re.findall(r"applied weights version (\d+)", session_log)]
        assert applied and applied[0] >= joined_at

        # SIGKILL a1 while it holds a lease whose group has not arrived
        def a1_busy() -> bool:
            received = {t["lease_id"] for t in c.trajs()}
            return any(g[4] == "a1" and g[0] not in received for g in c.grants(learner))

        # frozen first (SIGSTOP), so the leases it holds cannot land while we look: a group
        # already in the kernel's socket buffer still may, so the snapshot waits for the
        # learner's trajectory log to stop changing; a1 is thawed and tried again if every
        # lease it held landed meanwhile
        held: dict[str, int] = {}
        for _ in range(10):
            c.wait("a1 holding a lease", a1_busy, 60)
            a1 = c.actors["a1"]
            os.kill(a1.pid, signal.SIGSTOP)
            seen, stable_since, give_up = -1, time.monotonic(), time.monotonic() + 30
            while time.monotonic() - stable_since < 2.0 and time.monotonic() < give_up:
                n = sum(1 for t in c.trajs() if t["actor_id"] == "a1")  # only a1's, frozen now
                if n != seen:
                    seen, stable_since = n, time.monotonic()
                time.sleep(0.2)
            received = {t["lease_id"] for t in c.trajs()}
            held = {g[0]: g[1] for g in c.grants(learner) if g[4] == "a1" and g[0] not in received}
            if held:
                break
            os.kill(a1.pid, signal.SIGCONT)
        assert held, "a1 never held a lease that had not landed"
        c.actors.pop("a1").kill()
        killed_at = c.step()

        # each lease a1 held ends one way: a group it sent just before dying lands, or it expires
        def settled(lid: str) -> bool:
            return (lid in {t["lease_id"] for t in c.trajs()}
                    or f"lease {lid} (task {held[lid]}) expired; re-issued" in c.log(learner))

        for lid in held:
            c.wait(f"lease {lid} landing or expiring", lambda: settled(lid), 30)
        received = {t["lease_id"] for t in c.trajs()}
        lost = {lid: task for lid, task in held.items() if lid not in received}
        assert lost

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
        check_ledger(c.dir)
        assert sum(m.get("rollout/leases_expired", 0) for m in metrics) >= len(lost)
        assert "actor a3 registered" in log
    except BaseException:
        c.dump()
        raise


# ----------------------------------------------------------------------------- learner restart


def checkpoints(root: Path) -> dict[int, dict]:
    """step -> meta.json of every complete checkpoint under ``root``."""
    out = {}
    for p in root.glob("step-*"):
        meta = p / "meta.json"
        if meta.exists():
            out[int(p.name.split("-")[1])] = json.loads(meta.read_text())
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkilled_learner_resumes_from_checkpoint_and_actors_reconnect(cluster_factory):
    from turnscale import conf
    from turnscale.learner.tasks import TaskStream, parse_task_spec

    c = cluster_factory("learner.checkpoint_every=1", "learner.keep_checkpoints=100")
    try:
        c.start_envhub()
        l1 = c.start_learner()
        a1, a2 = c.start_actor("a1"), c.start_actor("a2")
        # metrics are written before the step's checkpoint: wait for the checkpoint itself
        c.wait("checkpoint of step 3", lambda: max(checkpoints(c.dir / "checkpoints"), default=0) >= 3, 150)
        l1.kill()
        before = c.metrics()
        trajs1 = c.trajs()
        cks = checkpoints(c.dir / "checkpoints")
        s = max(cks)
        extra = cks[s]["extra"]
        sched = cks[s]["schedule"]  # the turn limit follows from the step and the schedule
        assert s >= 3 and extra["step"] == s and sched["turns"][sched["stage"]] == 3

        l2 = c.start_learner("learner.resume=true")
        resumed = f"resumed at step {s}, version {extra['version']}, turn limit 3"
        c.wait("the resumed learner", lambda: resumed in c.log(l2), 90)
        c.wait("both actors back", lambda: all(c.log(a).count("registered with learner run") >= 2 for a in (a1, a2)), 60)
        c.wait("two steps after the restart", lambda: c.step() >= s + 2 and len(c.metrics()) >= len(before) + 2, 120)
        c.wait("groups from both actors after the restart",
               lambda: {t["actor_id"] for t in c.trajs()[len(trajs1):] if t["accepted"]} == {"a1", "a2"}, 60)
        c.stop_learner()
        assert a1.alive() and a2.alive(), "actors survive their learner dying"

        # step, version, turn limit continue from the checkpoint
        after = c.metrics()[len(before):]
        check_metrics(after, first_step=s + 1)
        check_ledger(c.dir, unique_tasks=False)  # tasks across the restart: checked below
        assert after[0]["perf/version"] == extra["version"]  # recorded before the step's publication
        assert [m["perf/version"] for m in after] == list(range(extra["version"], extra["version"] + len(after)))
        assert all(m["rollout/turn_limit"] == 3 for m in after)

        # the task cursor continues: the first leases come from the checkpoint's stream
        cfg = conf.load(c.common)
        stream = TaskStream.from_state(parse_task_spec(cfg.env.tasks.train, cfg.env.name, "train"), extra["leases"]["stream"])
        expect = [stream.next().data_idx for _ in range(4)]
        grants2 = c.grants(l2)
        assert [g[1] for g in grants2[:4]] == expect
        assert all(g[2] == 3 and g[3] >= extra["version"] for g in grants2)

        # nothing trained before the checkpoint is trained again; no partial or twice-trained group
        trajs = c.trajs()
        ids1 = {g[0] for g in c.grants(l1)}
        old = [t for t in trajs if t["lease_id"] in ids1]
        new = [t for t in trajs if t["lease_id"] not in ids1]
        assert len(old) + len(new) == len(trajs) and new
        acc1 = check_groups(old)
        acc2 = check_groups(new)
        trained_before = [eps[0]["data_idx"] for eps in acc1.values()][: s * GROUPS_PER_STEP]
        assert not set(trained_before) & {eps[0]["data_idx"] for eps in acc2.values()}
    except BaseException:
        c.dump()
        raise


# ----------------------------------------------------------------------------- env server restart


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_env_server_restart_fails_broken_groups_reissues_them_and_training_continues(cluster_factory):
    c = cluster_factory()
    try:
        c.start_envhub()
        status, probe = post(c.env_url + "/v1/create", {})
        assert status == 200
        learner = c.start_learner()
        c.start_actor("a1")
        c.start_actor("a2")
        c.wait("step 2", lambda: c.step() >= 2, 150)

        c.procs.children[0].kill()  # envhub, SIGKILL: every instance and connection is gone
        restarted_at = c.step()
        time.sleep(1.0)
        c.start_envhub("envhub2")
        n_before = len(c.trajs())
        # actors count replaced instances when they release them, after the failed group is
        # sent, and report the count in their next heartbeat: wait for a step row to carry it
        c.wait("env errors, replaced instances and training after the restart",
               lambda: any(t["finish_reason"] == "env_error" for t in c.trajs())
               and any(t["accepted"] for t in c.trajs()[n_before:]) and c.step() >= restarted_at + 3
               and any(m.get("actors/env_instances_replaced", 0) >= 1 for m in c.metrics()), 150)
        c.stop_learner()

        trajs = c.trajs()
        check_groups(trajs)
        errors = [t for t in trajs if t["finish_reason"] == "env_error"]
        assert errors and all(not t["accepted"] and t["drop_reason"] == "failed" for t in errors)
        # the failed groups' tasks were leased again
        granted = defaultdict(int)
        for g in c.grants(learner):
            granted[g[1]] += 1
        assert all(granted[t["data_idx"]] >= 2 for t in errors), [t["data_idx"] for t in errors]
        metrics = c.metrics()
        check_metrics(metrics)
        check_ledger(c.dir)
        assert sum(m.get("rollout/dropped/failed", 0) for m in metrics) >= 1
        assert max(m.get("actors/env_instances_replaced", 0) for m in metrics) >= 1
        # an instance id of the old server does not name some other client's new instance
        status, _ = post(c.env_url + "/v1/reset", {"id": probe["id"], "data_idx": 0})
        assert status == 404
    except BaseException:
        c.dump()
        raise


# ----------------------------------------------------------------------------- backpressure


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_slow_learner_bounds_leases_staleness_and_actor_memory(cluster_factory):
    steps = 6
    c = cluster_factory("learner.debug_step_delay_s=2.5", f"learner.steps={steps}", "actor.max_groups=4")
    try:
        c.start_envhub()
        learner = c.start_learner()
        actors = [c.start_actor("a1"), c.start_actor("a2")]
        c.wait("step 1", lambda: c.step() >= 1, 150)
        base = {a.name: rss_mb(a.pid) for a in actors}
        peak = dict(base)
        deadline = time.monotonic() + 120
        while learner.alive():
            assert time.monotonic() < deadline, "the slow learner did not finish"
            for a in actors:
                rss = live_rss_mb(a.pid)
                if rss is not None:
                    peak[a.name] = max(peak[a.name], rss)
            time.sleep(0.5)
        assert learner.popen.returncode == 0, learner.tail()

        metrics = c.metrics()
        check_metrics(metrics)
        check_ledger(c.dir)
        assert len(metrics) == steps
        assert not any(m.get("rollout/dropped/stale", 0) for m in metrics)
        trajs = c.trajs()
        by_lease = check_groups(trajs)
        # admission control: groups accepted while the policy was at version v never exceed
        # (max_staleness + v + 1) * groups_per_step, however fast the actors are
        accepted_by_version = defaultdict(int)
        for eps in by_lease.values():
            accepted_by_version[eps[0]["version"]] += 1
        total = 0
        for v in sorted(accepted_by_version):
            total += accepted_by_version[v]
            assert total <= (MAX_STALENESS + v + 1) * GROUPS_PER_STEP, (v, total)
        grants = c.grants(learner)
        # re-issued tasks add grants: expired, failed, and leases taken back from an actor
        # above its fair share when the other one asked (learner.control)
        assert len(grants) <= (MAX_STALENESS + steps + 1) * GROUPS_PER_STEP + sum(
            m.get("rollout/leases_expired", 0) + m.get("rollout/dropped/failed", 0)
            + m.get("rollout/leases_revoked", 0) for m in metrics)
        assert max(m["perf/leases_in_flight"] for m in metrics) <= (MAX_STALENESS + 1) * GROUPS_PER_STEP
        # idle actors wait for leases instead of piling up work: memory stays flat
        for name in base:
            assert peak[name] - base[name] < 150, (name, base[name], peak[name])
    except BaseException:
        c.dump()
        raise
