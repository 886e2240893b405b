"""``turnscale bench e2e`` end to end, tiny: real envhub, learner and actor processes on
127.0.0.1 in both modes; both train the requested steps and the JSON has the entries."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROLES = ("turnscale.envhub.main", "turnscale.learner.main", "turnscale.actors.main")


def _missing_roles() -> list[str]:
    return [m for m in ROLES if importlib.util.find_spec(m) is None]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(bool(_missing_roles()), reason=f"roles not built in this checkout: {_missing_roles()}")
def test_async_and_sync_both_train_the_requested_steps_and_the_json_has_the_entries(tmp_path: Path):
    out = tmp_path / "e2e.json"
    cmd = [
        sys.executable, "-m", "turnscale", "bench", "e2e", "--json", str(out), "--e2e-dir", str(tmp_path / "runs"),
        "--e2e-parts", "sim", "--e2e-actors", "2", "--e2e-max-groups", "1", "--e2e-group-size", "2",
        "--e2e-steps", "3", "--e2e-turn-limit", "3", "--e2e-max-new-tokens", "16", "--e2e-latency-median", "0.02",
        "--e2e-reset-latency", "0.02", "--e2e-run-timeout", "150",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("async_vs_sync_sim", "async_vs_sync_sim_tokens", "async_efficiency_sim"):
        assert name in results, sorted(results)
    r = results["async_vs_sync_sim"]
    assert r["value"] > 0 and r["baseline_value"] > 0 and r["target"] == 2.5
    assert r["ratio"] == pytest.approx(r["value"] / r["baseline_value"])
    details = json.loads((tmp_path / "runs" / "e2e_runs.json").read_text())
    runs = {d["spec"]["name"]: d for d in details["runs"]}
    assert set(runs) == {"sim_async", "sim_sync"}
    for name, d in runs.items():
        assert d["steps"] == 3, name
        trained = [g for g in d["groups"] if g["accepted"]]
        assert len(trained) >= 3 * 2, name  # every step trained a full batch of 2 groups
        assert all(len(g["episode_s"]) == 2 and max(g["episode_s"]) > 0 for g in trained), name
    # lock-step never runs a group more than 0 versions stale
    assert set(runs["sim_sync"]["staleness_hist"]) <= {"0"}
    assert details["ideal_sim"]["speedup"] >= 1.0
