"""``turnscale view`` in a real headless browser (Debian's chromium driven by Playwright).

The viewer runs as its own process (``python -m turnscale view DIR --port 0``) over a sample run
directory; the page is loaded in chromium, filtered, an episode replayed turn by turn, two
episodes compared and a curve point clicked.  Screenshots go to pytest's tmp dir and are copied
to ``test-artifacts/`` (git-ignored).  Skips only when no chromium binary is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.sample_runs import write_run_dir
from turnscale.common.procs import stop_process

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/setup.sh installs it as root)")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def start_viewer(path: Path) -> tuple[subprocess.Popen, str]:
    """Start ``turnscale view`` on a free port and return (process, url) once it says where it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "turnscale", "view", str(path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if " at http://127.0.0.1:" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    if not lines or " at http://127.0.0.1:" not in lines[-1]:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"viewer did not start: {lines}")
    return proc, lines[-1].split(" at ")[1].split()[0]


def stop(proc: subprocess.Popen) -> None:
    stop_process(proc, 10)


@pytest.fixture()
def browser_page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.set_default_timeout(15_000)
        yield page, errors
        browser.close()


def save_shot(page, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)
    assert shot.stat().st_size > 10_000
    return shot


def rows(page) -> list[str]:
    return page.locator("[data-testid^=episode-row-]").evaluate_all("els => els.map(e => e.dataset.id)")


def test_browse_filter_replay_compare_and_curve_click(tmp_path, browser_page):
    page, errors = browser_page
    run = write_run_dir(tmp_path / "run", steps=10, groups_per_step=2, group_size=3, seed=11)
    eps = run.episodes
    proc, url = start_viewer(tmp_path / "run")
    try:
        # load: counts and the malformed-line banner
        page.goto(url)
        page.wait_for_selector("[data-testid=episode-row-0]")
        assert page.inner_text("[data-testid=counts]") == f"{len(eps)} episodes"
        assert "3 in trajectories, 1 in metrics" in page.inner_text("[data-testid=malformed]")
        assert "no-ckpt" in page.get_attribute("[data-testid=episodes]", "class")  # a training run has no checkpoint column

        # pages of 50
        assert len(eps) == 60 and rows(page) == [str(i) for i in range(50)]
        page.click("[data-testid=next-page]")
        page.wait_for_selector("[data-testid=episode-row-50]")
        assert rows(page) == [str(i) for i in range(50, 60)] and page.inner_text("[data-testid=page-info]") == "51–60 of 60"
        assert page.is_disabled("[data-testid=next-page]")
        page.click("[data-testid=prev-page]")
        page.wait_for_selector("[data-testid=episode-row-0]")

        # filter: env + success
        page.select_option("[data-testid=f-env]", "babyai")
        page.select_option("[data-testid=f-success]", "true")
        page.click("[data-testid=f-apply]")
        want = [str(i) for i, e in enumerate(eps) if e["env"] == "babyai" and e["success"]]
        page.wait_for_function("n => document.querySelector('[data-testid=list-total]').textContent === n + ' matching'", arg=len(want))
        assert rows(page) == want[:50]
        page.click("[data-testid=f-reset]")
        page.wait_for_function("n => document.querySelector('[data-testid=list-total]').textContent === n + ' matching'", arg=len(eps))

        # open an episode with several turns and a sibling of the same task
        eid = next(i for i, e in enumerate(eps) if e["num_turns"] >= 3
                   and any(j != i and f["env"] == e["env"] and f["data_idx"] == e["data_idx"] for j, f in enumerate(eps)))
        ep = eps[eid]
        page.click(f"[data-testid=open-{eid}]")
        page.wait_for_function("t => document.querySelector('[data-testid=ep-title]').textContent.startsWith(t)", arg=f"Episode {eid}:")
        page.wait_for_selector("[data-testid=turn-current]")
        assert f"Episode {eid}: {ep['env']} {ep['task_id']}" in page.inner_text("[data-testid=ep-title]")
        assert page.inner_text("[data-testid=meta-turn-limit] dd") == str(ep["turn_limit"])
        assert page.inner_text("[data-testid=meta-finish] dd") == ep["finish_reason"]
        n = ep["num_turns"]
        for k in range(n):
            assert page.inner_text("[data-testid=turn-pos]") == f"turn {k + 1} / {n}"
            t = ep["turns"][k]
            assert page.inner_text("[data-testid=turn-output]") == t["output_text"]
            assert page.inner_text("[data-testid=turn-observation]") == t["observation"]
            assert page.inner_text("[data-testid=turn-input]") == (ep["prompt"] if k == 0 else ep["turns"][k - 1]["observation"])
            action = page.inner_text("[data-testid=turn-action]")
            assert action == ("(parse error)" if t["parse_error"] else t["action"])
            assert page.inner_text("[data-testid=turn-policy-version]").endswith(str(t["policy_version"]))
            assert page.inner_text("[data-testid=turn-turn-limit-in-force]").endswith(str(ep["turn_limit"]))
            if k == 1:
                save_shot(page, tmp_path, "viewer-episode.png")
            if k < n - 1:
                page.click("[data-testid=turn-next]")
                page.wait_for_function("k => document.querySelector('[data-testid=turn]').dataset.turn === String(k)", arg=k + 1)
        assert page.is_disabled("[data-testid=turn-next]")
        page.click("[data-testid=turn-first]")
        page.wait_for_function("() => document.querySelector('[data-testid=turn]').dataset.turn === '0'")
        page.keyboard.press("ArrowRight")
        page.wait_for_function("() => document.querySelector('[data-testid=turn]').dataset.turn === '1'")
        page.keyboard.press("ArrowLeft")
        page.wait_for_function("() => document.querySelector('[data-testid=turn]').dataset.turn === '0'")

        # compare with a sibling of the same task
        sibling = int(page.locator("[data-testid=same-task] option").first.get_attribute("value"))
        assert eps[sibling]["data_idx"] == ep["data_idx"] and eps[sibling]["env"] == ep["env"]
        page.click("[data-testid=same-task-go]")
        page.wait_for_function("t => document.querySelector('[data-testid=cmp-title]').textContent.startsWith(t)", arg=f"Compare episodes {eid} and {sibling}:")
        page.wait_for_selector("[data-testid=cmp-a] [data-testid=cmp-turn-0]")
        assert page.is_hidden("[data-testid=cmp-warning]")
        assert f"Episode {eid}" in page.inner_text("[data-testid=cmp-a]")
        assert f"Episode {sibling}" in page.inner_text("[data-testid=cmp-b]")
        assert page.locator("[data-testid=cmp-b] [data-testid^=cmp-turn-]").count() == eps[sibling]["num_turns"]
        assert eps[sibling]["turns"][0]["output_text"] in page.inner_text("[data-testid=cmp-b]")
        ta, tb = [t["action"] for t in ep["turns"]], [t["action"] for t in eps[sibling]["turns"]]
        d = next((j for j in range(min(len(ta), len(tb))) if ta[j] != tb[j]), None if len(ta) == len(tb) else min(len(ta), len(tb)))
        if d is None:
            assert page.inner_text("[data-testid=cmp-diverge]") == "Both episodes took the same actions."
        else:
            assert page.inner_text("[data-testid=cmp-diverge]") == f"First different action at turn {d + 1}."
            assert page.locator(".diverge").count() == sum(d < len(x) for x in (ta, tb))
        save_shot(page, tmp_path, "viewer-compare.png")

        # curve click lists that step's episodes
        page.click("[data-testid=nav-runs]")
        page.wait_for_selector("[data-testid='chart-rollout/success']")
        page.click("[data-testid='chart-rollout/success'] circle[data-step='3']")
        page.wait_for_function("() => document.querySelector('[data-testid=list-title]').textContent === 'Episodes of step 3'")
        want = [str(i) for i, e in enumerate(eps) if e["step"] == 3]
        page.wait_for_function("n => document.querySelector('[data-testid=list-total]').textContent === n + ' matching'", arg=len(want))
        assert rows(page) == want
        assert page.locator("[data-testid='chart-rollout/success'] circle.sel").get_attribute("data-step") == "3"

        # compare from the list: tick two episodes of one task
        a, b = want[0], next(w for w in want[1:] if eps[int(w)]["data_idx"] == eps[int(want[0])]["data_idx"])
        page.check(f"[data-testid=pick-{a}]")
        page.check(f"[data-testid=pick-{b}]")
        page.click("[data-testid=compare-go]")
        page.wait_for_function("t => document.querySelector('[data-testid=cmp-title]').textContent.startsWith(t)", arg=f"Compare episodes {a} and {b}:")
        page.wait_for_selector("[data-testid=cmp-b] [data-testid=cmp-turn-0]")

        # a bad link shows a readable error, not a blank page
        page.goto(url + "#/episode/99999")
        page.wait_for_selector("[data-testid=error]:not([hidden])")
        assert "no episode 99999" in page.inner_text("[data-testid=error]")
        page.goto(url + "#/?step=3")
        page.wait_for_selector("[data-testid=episode-row-" + want[0] + "]")
        save_shot(page, tmp_path, "viewer-step.png")

        # a live run grows: reload picks up the new episode
        import json

        with open(run.path / "trajectories.jsonl", "a") as f:
            f.write(json.dumps({**eps[0], "step": 3}) + "\n")
        page.click("[data-testid=reload]")
        page.wait_for_function("n => document.querySelector('[data-testid=counts]').textContent === n + ' episodes'", arg=len(eps) + 1)
        page.wait_for_selector(f"[data-testid=episode-row-{len(eps)}]")
        assert errors == []
    finally:
        stop(proc)


def test_eval_report_page_shows_every_row(tmp_path, browser_page):
    from turnscale.evaluate import main as eval_main

    import json

    page, errors = browser_page
    run = write_run_dir(tmp_path / "run", seed=4, group_size=4, malformed=False)
    traj = run.path / "trajectories.jsonl"
    traj.write_text("".join(json.dumps({**e, "checkpoint": "base", "sample": e["episode"]}) + "\n" for e in run.episodes))
    out = tmp_path / "eval"
    assert eval_main(["--from-jsonl", str(traj), "--k", "1,2", "--out", str(out)]) == 0
    doc = json.loads((out / "eval.json").read_text())
    assert doc["trajectories"] == "../run/trajectories.jsonl"
    proc, url = start_viewer(out)
    try:
        page.goto(url)
        page.wait_for_selector("[data-testid=nav-eval]:not([hidden])")
        page.click("[data-testid=nav-eval]")
        page.wait_for_selector("[data-testid=eval-table] tbody tr")
        cells = page.locator("[data-testid=eval-table] tbody tr").evaluate_all(
            "trs => trs.map(tr => [...tr.children].map(td => td.textContent))")
        assert len(cells) == len(doc["rows"])
        first = doc["rows"][0]
        assert cells[0][1:5] == [first["checkpoint"], str(first["turn_limit"]), first["env"], "(all)"]
        assert float(cells[0][8]) == round(first["success"], 3)
        last = doc["rows"][-1]
        assert last["env"] == "" and cells[-1][3:5] == ["(all)", "(all)"]  # the all-envs row
        assert "Pass@2" in page.inner_text("[data-testid=eval-table] thead")
        for plot in ("turn_scaling.png", "pass_at_k.png"):  # the report's plots, loaded from the server
            page.wait_for_function("t => { const i = document.querySelector(`[data-testid='plot-${t}']`); return i && i.complete && i.naturalWidth > 100; }", arg=plot)
        save_shot(page, tmp_path, "viewer-eval.png")

        # a row links to its episodes
        page.click("[data-testid=eval-link-0]")
        page.wait_for_selector("[data-testid=episodes]:not(.no-ckpt)")  # eval episodes show their checkpoint
        want = [i for i, e in enumerate(run.episodes) if e["turn_limit"] == first["turn_limit"] and e["env"] == first["env"]]
        page.wait_for_function("n => document.querySelector('[data-testid=list-total]').textContent === n + ' matching'", arg=len(want))
        assert len(want) == first["episodes"] + first["errors"]
        assert page.input_value("[data-testid=f-turn-limit]") == str(first["turn_limit"])
        assert page.input_value("[data-testid=f-checkpoint]") == "base"
        assert errors == []
    finally:
        stop(proc)
