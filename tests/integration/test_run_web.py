"""``turnscale run env=web`` end to end: the web oracle's warm start, the tiny model, a real envhub
``env=web`` server (sites process + chromium), learner and actor processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_viewer_browser import browser_page, save_shot, start_viewer  # noqa: F401 (browser_page: a fixture)
from turnscale.common.procs import stop_process

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                 reason="Debian's chromium is not installed (scripts/setup.sh installs it as root)")]
ROOT = Path(__file__).resolve().parents[2]


def _pool_processes(markers: tuple[bytes, ...] = (b"--turnscale-pool=",)) -> list[int]:
    """Pids of chromium processes started by a ``envhub.web_browser.BrowserPool`` whose marker
    switch is one of ``markers`` (default: any pool's)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes() if d.isdigit() else b""
        except OSError:
            continue
        if any(m in argv for m in markers):
            out.append(int(d))
    return out


def _run_markers(run_dir: Path) -> tuple[bytes, ...]:
    """The pool markers the run's own processes logged at each chromium launch (another test
    or session on this machine may run browsers of its own meanwhile)."""
    found = set()
    for log in (run_dir / "logs").glob("*.log"):
        found.update(re.findall(r"chromium launched \((--turnscale-pool=[0-9a-f]+)\)", log.read_text(errors="replace")))
    return tuple(m.encode() for m in sorted(found))


@pytest.fixture(scope="module")
def web_run(tmp_path_factory) -> tuple[Path, set[int]]:
    """One short ``turnscale run env=web`` (shared by the tests below): its run dir and the pool
    chromium pids that existed before it."""
    tmp_path = tmp_path_factory.mktemp("web-run")
    before = set(_pool_processes())
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "turnscale", "run", "env=web", f"run.dir={run_dir}", f"model.cache_dir={tmp_path / 'models'}",
           "learner.steps=2", "run.warm_start.steps=2", "run.warm_start.episodes=8", "logger.console_every_s=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, before


def test_run_env_web_trains_end_to_end_and_leaves_no_browser(web_run):
    run_dir, _ = web_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["env"]["name"] == "web"
    assert summary["final"]["episodes"] == 40 and summary["final"]["errors"] == 0
    warm = [json.loads(line) for line in (run_dir / "warmstart" / "conversations.jsonl").read_text().splitlines()]
    assert len(warm) == 8 and all(m["content"].startswith("```") for c in warm for m in c["messages"] if m["role"] == "assistant")
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(t["env"] == "web" for t in trajs)
    assert any("OBSERVATION:\nTab 0 (current): " in t["prompt"] for t in trajs)
    markers = _run_markers(run_dir)
    assert markers, "the run's envhub logged no chromium launch"
    assert _pool_processes(markers) == []  # the envhub's browser went with it


def test_a_new_user_watches_a_web_episode_in_turnscale_view(web_run, tmp_path, browser_page):
    """The issue's "done when": the run's web episodes open in ``turnscale view`` (a real viewer
    process, Debian's chromium through Playwright) with their accessibility-tree observations,
    URLs and WebArena actions shown turn by turn."""
    run_dir, _ = web_run
    page, errors = browser_page
    eps = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines() if line.strip()]
    eid = max(range(len(eps)), key=lambda i: eps[i]["num_turns"])  # the longest episode
    ep = eps[eid]
    assert ep["env"] == "web" and ep["num_turns"] >= 1
    proc, url = start_viewer(run_dir)
    try:
        page.goto(url)
        page.wait_for_selector("[data-testid=episode-row-0]")
        assert page.inner_text("[data-testid=counts]") == f"{len(eps)} episodes"
        page.goto(f"{url}#/episode/{eid}")
        page.wait_for_function("t => document.querySelector('[data-testid=ep-title]').textContent.startsWith(t)", arg=f"Episode {eid}:")
        page.wait_for_selector("[data-testid=turn-current]")
        assert f"Episode {eid}: web {ep['task_id']}" in page.inner_text("[data-testid=ep-title]")
        shown = page.inner_text("[data-testid=turn-input]")
        assert shown == ep["prompt"] and "OBSERVATION:\nTab 0 (current): " in shown and "\nURL: http://127.0.0.1:" in shown
        assert "\nOBJECTIVE: " in shown
        for k, t in enumerate(ep["turns"]):
            assert page.inner_text("[data-testid=turn-pos]") == f"turn {k + 1} / {ep['num_turns']}"
            assert page.inner_text("[data-testid=turn-output]") == t["output_text"]
            assert page.inner_text("[data-testid=turn-observation]") == t["observation"]
            assert page.inner_text("[data-testid=turn-action]") == ("(parse error)" if t["parse_error"] else t["action"])
            if k == 0:
                save_shot(page, tmp_path, "viewer-web-episode.png")
            if k < ep["num_turns"] - 1:
                page.click("[data-testid=turn-next]")
                page.wait_for_function("k => document.querySelector('[data-testid=turn]').dataset.turn === String(k)", arg=k + 1)
        assert errors == []
    finally:
        stop_process(proc, 10)
