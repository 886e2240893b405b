"""``turnscale run`` end to end: real envhub, learner and actor processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _run(run_dir: Path, *overrides: str, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "turnscale", "run", f"run.dir={run_dir}", f"model.cache_dir={run_dir.parent / 'models'}", *overrides],
        capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.timeout(600)
def test_short_run_writes_summary_plots_metrics_trajectories_and_checkpoint_and_lr0_changes_nothing(tmp_path):
    """Also the control run: with ``algo.lr=0`` RL must not change the policy, so the final
    held-out success equals the warm start's exactly (evaluation seeds are fixed per task)."""
    run_dir = tmp_path / "run"
    summary = _run(run_dir, "algo.lr=0", "learner.steps=4", "schedule.every=2", "run.warm_start.steps=3", "run.warm_start.episodes=30",
                   "run.test_seeds=1000:1002", "logger.console_every_s=0", timeout=540)
    assert summary["steps"] == 4
    for key in ("warm_start", "final"):
        assert 0.0 <= summary[key]["success"] <= 1.0
        assert summary[key]["episodes"] + summary[key]["errors"] == 10  # 5 levels x 2 seeds
    assert summary["config"]["learner"]["steps"] == 4 and summary["wall_s"] > 0
    assert summary["final"]["success"] == summary["warm_start"]["success"]
    assert summary["final"]["mean_reward"] == pytest.approx(summary["warm_start"]["mean_reward"], abs=1e-9)
    for name in ("learning.png", "turns.png", "throughput.png", "metrics.jsonl", "trajectories.jsonl"):
        assert (run_dir / name).exists(), name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == 4
    limits = {r["rollout/turn_limit"] for r in rows}
    assert 3 in limits and 5 in limits and limits <= {3, 5, 8}  # the schedule advanced at step 2
    eps = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert eps and all(e["env"] == "babyai" for e in eps)
    assert Path(summary["checkpoint"], "model", "config.json").exists()
    assert list((run_dir / "learner" / "tb").iterdir())
