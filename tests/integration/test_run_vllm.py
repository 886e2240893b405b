"""``turnscale run engine=vllm`` end to end on CPU: the learner and envhub in this venv, the
actor and the evaluations on the real vLLM (CPU build) in ``.venv-vllm``
(``run.actor_python``).  Skipped where ``.venv-vllm`` has not been built
(``bash scripts/setup_vllm.sh``; ``scripts/test.sh`` builds it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

VLLM_PYTHON = os.environ.get("TURNSCALE_VLLM_PYTHON", os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python"))


def _has_vllm(python: str) -> bool:
    if not os.access(python, os.X_OK):
        return False
    probe = [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"]
    return subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True, timeout=60).returncode == 0


@pytest.mark.timeout(600)
def test_short_run_on_vllm_actors_swaps_weights_every_version_with_behaviour_logprobs_equal_to_the_learners(tmp_path):
    if not _has_vllm(VLLM_PYTHON):
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (bash scripts/setup_vllm.sh)")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "turnscale", "run", f"run.dir={run_dir}", f"model.cache_dir={tmp_path / 'models'}",
         "engine=vllm_cpu", "engine.max_batch=32",
         f"run.actor_python={VLLM_PYTHON}", "run.actors=1", "learner.steps=4", "schedule.every=2", "run.warm_start.steps=3",
         "run.warm_start.episodes=30", "run.test_seeds=1000:1002", "run.eval_samples=1", "logger.console_every_s=0"],
        capture_output=True, text=True, timeout=560,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["config"]["engine"]["name"] == "vllm"
    for key in ("warm_start", "final"):
        assert summary[key]["episodes"] == 10 and summary[key]["errors"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["perf/version"] for r in rows] == [0, 1, 2, 3]
    # the actor applied every published version.  Read from its log, not from the step rows:
    # those carry the actor's last heartbeat, which can predate the newest swap on a busy machine.
    log = (run_dir / "logs" / "actor-0.log").read_text()
    applied = {int(v) for v in re.findall(r"applied weights version (\d+)", log)}
    assert {0, 1, 2, 3} <= applied, sorted(applied)
    stopped = [line for line in log.splitlines() if "ActorStats(" in line]
    assert stopped and "weight_failures=0," in stopped[-1] and "torn_weights=0," in stopped[-1], stopped
    assert all(r.get("actors/weight_load_errors", 0) == 0 for r in rows)
    for r in rows:
        if r["rollout/staleness_max"] == 0:  # sampled by the learner's current weights: pi_prox / mu == 1
            assert abs(r["loss/behaviour_weight_max"] - 1) < 1e-3 and abs(r["loss/behaviour_weight_mean"] - 1) < 1e-4, r
    assert "vllm" in log.lower() and "Traceback" not in log
