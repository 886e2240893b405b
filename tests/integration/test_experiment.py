"""``turnscale experiment`` end to end on a tiny budget: one warm start shared by the arms, an RL
run per arm with its own turn schedule, evals at several limits, experiment.json and the plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_schedule_experiment_runs_each_arm_on_the_same_warm_start_and_budget(tmp_path):
    out = tmp_path / "exp"
    proc = subprocess.run(
        [sys.executable, "-m", "turnscale", "experiment", "--seeds", "0", "--eval-turns", "2,4", "--arms", "scaling,short",
         "--out", str(out), f"model.cache_dir={tmp_path / 'models'}", "learner.steps=4", "schedule.turns=[2,4]",
         "schedule.every=1", "run.warm_start.steps=2", "run.warm_start.episodes=20", "run.warm_start.rounds=1",
         "run.warm_start.probe_tasks_per_level=1", "run.test_seeds=1000:1001",
         "logger.console_every_s=0"],
        capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "experiment.json").read_text())
    assert [r["arm"] for r in doc["runs"]] == ["scaling", "short"]
    scaling, short = doc["runs"]
    assert scaling["turns"] == [2, 4] and short["turns"] == [2]
    assert scaling["warm_start"] == short["warm_start"]  # one warm start per seed, shared
    assert set(scaling["final"]) == {"2", "4"} and all(0.0 <= v <= 1.0 for v in scaling["final"].values())
    limits = [json.loads(line)["rollout/turn_limit"] for line in (out / "seed-0" / "short" / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert set(limits) == {2}  # the fixed arm never raised its limit
    limits = [json.loads(line)["rollout/turn_limit"] for line in (out / "seed-0" / "scaling" / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert 4 in limits
    # the shared part is turnscale run's: the recipe was fitted (the GoTo mix keeps [2, 4]) and
    # the warm start probed on training tasks
    recipe = scaling["recipe"]
    assert recipe["fit"]["changed"] is False and len(recipe["rounds"]) == 1 and recipe["advice"]["verdict"] in ("enough", "warn")
    assert (out / "seed-0" / "probe_warm_start_1" / "eval.json").exists()
    assert (out / "schedules.png").stat().st_size > 0
    assert "held-out success" in proc.stdout
