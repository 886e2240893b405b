"""Chaos: one learner, three actors and an envhub (real processes, tiny model, 127.0.0.1);
actors are SIGKILLed and restarted at random, and the learner is SIGKILLed once and resumed
from its checkpoint.  Afterwards, from the learner's training ledger (``batches.jsonl``),
its logs, checkpoints and metrics:

- every trained group's staleness *at training time* is within ``max_staleness`` (and >= 0);
- no group is trained twice (by lease, and by task across the restart);
- every leased task was trained, or re-issued (granted again, or queued for re-issue /
  not yet reached by the cursor in the final checkpoint);
- the actors' weight check never fired (``torn_weights`` stays 0).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from tests.integration.test_failures import MAX_STALENESS, checkpoints, cluster_factory, read_jsonl  # noqa: F401 (fixture)

CHAOS_S = 75.0


def ledger(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "batches.jsonl")


def grants(log: str) -> list[tuple[str, int]]:
    return [(m[0], int(m[1])) for m in re.findall(r"lease (\S+) \(task (\d+), turn limit \d+, version \d+\) granted", log)]


def stream_positions(common: list[str]) -> dict[int, int]:
    """data_idx -> position in epoch 0 of the run's task stream."""
    from turnscale import conf
    from turnscale.learner.tasks import TaskStream, parse_task_spec

    cfg = conf.load(common)
    tasks = parse_task_spec(cfg.env.tasks.train, cfg.env.name, "train")
    s = TaskStream(tasks, seed=cfg.learner.seed)
    return {s.next().data_idx: i for i in range(len(tasks))}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_random_kills_of_actors_and_the_learner_lose_nothing_train_nothing_twice_and_never_exceed_staleness(cluster_factory):
    rng = random.Random(1234)
    c = cluster_factory("learner.checkpoint_every=1", "learner.keep_checkpoints=1000", "learner.lease_ttl_s=6",
                        "learner.transfer_dtype=float32")
    try:
        c.start_envhub()
        l1 = c.start_learner()
        names = ["a1", "a2", "a3"]
        for n in names:
            c.start_actor(n)
        c.wait("step 2", lambda: c.step() >= 2, 180)
        t0, kills, learner_killed = time.monotonic(), 0, False
        while time.monotonic() - t0 < CHAOS_S:
            time.sleep(rng.uniform(4.0, 9.0))
            if not learner_killed and time.monotonic() - t0 > CHAOS_S / 2:
                c.wait("a checkpoint", lambda: checkpoints(c.dir / "checkpoints"), 60)
                l1.kill()
                learner_killed = True
                c.start_learner("learner.resume=true")
                continue
            victim = rng.choice(names)
            c.actors[victim].kill()
            kills += 1
            c.start_actor(victim)
        assert learner_killed and kills >= 3
        l2 = c.learners[-1]
        s_end = c.step()
        c.wait("three steps after the chaos", lambda: c.step() >= s_end + 3, 180)
        c.stop_learner()

        # --- staleness at training time, nothing trained twice
        rows = ledger(c.dir)
        trained = [r for r in rows if r["outcome"] == "trained"]
        assert trained and all(0 <= r["staleness"] <= MAX_STALENESS for r in trained), \
            [r for r in trained if not 0 <= r["staleness"] <= MAX_STALENESS][:3]
        lease_ids = [r["lease_id"] for r in trained]
        assert len(lease_ids) == len(set(lease_ids)), "a group was trained twice"

        # the restart: learner 1's steps after its last checkpoint are gone; nothing before it is redone
        log1, log2 = c.log(l1), c.log(l2)
        s = int(re.search(r"resumed at step (\d+), version \d+", log2)[1])
        grants1, grants2 = grants(log1), grants(log2)
        ids1 = {lid for lid, _ in grants1}
        kept1 = [r for r in trained if r["lease_id"] in ids1 and r["step"] <= s]
        trained2 = [r for r in trained if r["lease_id"] not in ids1]
        assert trained2
        assert not {r["data_idx"] for r in kept1} & {r["data_idx"] for r in trained2}, "a task trained again after the resume"
        assert len({r["data_idx"] for r in trained2}) == len(trained2)

        # every leased task: trained, granted again, queued for re-issue, or beyond the final cursor
        final = checkpoints(c.dir / "checkpoints")[max(checkpoints(c.dir / "checkpoints"))]["extra"]["leases"]["stream"]
        queued = {int(t[1]) for t in final["reissue"]}
        positions = stream_positions(c.common)
        trained_ids = {r["lease_id"] for r in kept1 + trained2}
        all_grants = grants1 + grants2
        for i, (lid, task) in enumerate(all_grants):
            if lid in trained_ids:
                continue
            later = any(t == task for _, t in all_grants[i + 1:])  # re-issued: that grant is checked in turn
            assert later or task in queued or positions[task] >= final["position"], f"lease {lid} (task {task}) was lost"

        # no torn weights, and the metrics agree on staleness
        metrics = c.metrics()
        assert all(m.get("actors/torn_weights", 0) == 0 for m in metrics)
        assert all(m.get("rollout/staleness_max", 0) <= MAX_STALENESS for m in metrics)
        for a in c.actors.values():
            assert "differ from the pulled bytes" not in c.log(a)
        print(json.dumps({"kills": kills, "trained": len(trained), "stale_dropped": sum(r["outcome"] == "stale" for r in rows),
                          "resumed_at": s, "final_step": c.step()}))
    except BaseException:
        c.dump()
        raise
