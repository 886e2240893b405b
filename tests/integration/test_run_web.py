"""``turnscale run env=web`` end to end: the web oracle's warm start, the tiny model, a real envhub
``env=web`` server (sites process + chromium), learner and actor processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                 reason="Debian's chromium is not installed (scripts/setup.sh installs it as root)")]
ROOT = Path(__file__).resolve().parents[2]


def _pool_processes() -> list[int]:
    """Pids of chromium processes started by any ``envhub.web_browser.BrowserPool``."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and b"--turnscale-pool=" in Path(f"/proc/{d}/cmdline").read_bytes():
                out.append(int(d))
        except OSError:
            pass
    return out


def test_run_env_web_trains_end_to_end_and_leaves_no_browser(tmp_path):
    before = set(_pool_processes())
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "turnscale", "run", "env=web", f"run.dir={run_dir}", f"model.cache_dir={tmp_path / 'models'}",
           "learner.steps=2", "run.warm_start.steps=2", "run.warm_start.episodes=8", "logger.console_every_s=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["env"]["name"] == "web"
    assert summary["final"]["episodes"] == 40 and summary["final"]["errors"] == 0
    warm = [json.loads(line) for line in (run_dir / "warmstart" / "conversations.jsonl").read_text().splitlines()]
    assert len(warm) == 8 and all(m["content"].startswith("```") for c in warm for m in c["messages"] if m["role"] == "assistant")
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(t["env"] == "web" for t in trajs)
    assert any("OBSERVATION:\nTab 0 (current): " in t["prompt"] for t in trajs)
    assert set(_pool_processes()) <= before  # the envhub's browser went with it
