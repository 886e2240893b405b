"""``turnscale eval`` running a real tiny HF model through the actor code against a real envhub BabyAI server."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import trio

from tests.envhub_proc import envhub_server
from turnscale.evalclient import ClientPool


class _Cfg:
    class env:  # noqa: N801 (a stand-in for conf.schema.Config.env)
        options: dict = {}
        client_flavor = "turnscale"


def test_client_sessions_reset_and_step_a_real_babyai_server():
    with envhub_server("babyai") as url:
        async def play():
            pool = ClientPool("babyai", url, _Cfg)
            try:
                a, b = await pool.open(), await pool.open()
                obs, info = await a.reset(0)
                obs_b, _ = await b.reset(41)
                step = await a.step("turn left")
                return obs, info, obs_b, step, list(pool.ids)
            finally:
                await pool.aclose()

        obs, info, obs_b, (obs2, reward, done, sinfo), ids = trio.run(play)
    assert obs.startswith("Your goal:") and info["category"] and obs_b.startswith("Your goal:")
    assert len(set(ids)) == 2 and isinstance(reward, float) and "success" in sinfo and obs2


@pytest.mark.slow
def test_eval_cli_runs_two_turn_limits_on_a_local_server_and_writes_a_viewable_report(tmp_path, tiny_model_dir):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "turnscale", "eval", "--model", f"{tiny_model_dir}=tiny", "--env", "babyai",
           "--tasks", "0:3", "--k", "1,2", "--turns", "1,2", "--concurrency", "4", "--out", str(out),
           "--json", str(tmp_path / "copy.json"), "++sampling.max_new_tokens=12", "++sampling.max_context_tokens=3000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "12/12 episodes" in proc.stderr  # the progress bar reached the end
    assert "Pass@2 %" in proc.stdout
    recs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(recs) == 3 * 2 * 2
    assert {(r["turn_limit"], r["data_idx"], r["sample"]) for r in recs} == {(t, i, s) for t in (1, 2) for i in range(3) for s in range(2)}
    for r in recs:
        assert r["checkpoint"] == "tiny" and r["env"] == "babyai" and r["category"]  # the server's BabyAI level
        assert 1 <= r["num_turns"] <= r["turn_limit"] and r["finish_reason"] in ("done", "turn_limit", "context_limit")
        assert r["prompt"] and r["turns"][0]["output_text"] is not None and r["turns"][0]["num_tokens"] > 0
        assert r["turns"][0]["logprob_mean"] < 0
    assert len({(r["data_idx"], r["category"]) for r in recs}) == 3  # one level per task
    doc = json.loads((out / "eval.json").read_text())
    assert doc["turns"] == [1, 2] and doc["checkpoints"] == ["tiny"] and doc["trajectories"] == "trajectories.jsonl"
    env_rows = [r for r in doc["rows"] if r["env"] == "babyai" and r["category"] == ""]
    assert [r["turn_limit"] for r in env_rows] == [1, 2] and all(r["episodes"] + r["errors"] == 6 for r in env_rows)
    assert (out / "turn_scaling.png").stat().st_size > 0 and (out / "pass_at_k.png").stat().st_size > 0
    copy = json.loads((tmp_path / "copy.json").read_text())
    assert (tmp_path / copy["trajectories"]).resolve() == (out / "trajectories.jsonl").resolve()

    from turnscale.viewer import serve

    server = serve(out)  # the viewer opens the eval output
    try:
        import urllib.request

        with urllib.request.urlopen(server.url + "api/episodes?checkpoint=tiny&limit=1") as r:
            assert json.loads(r.read())["total"] == 12
    finally:
        server.close()


@pytest.mark.slow
def test_eval_uses_a_running_server_given_by_env_url(tmp_path, tiny_model_dir):
    with envhub_server("babyai") as url:
        cmd = [sys.executable, "-m", "turnscale", "eval", "--model", tiny_model_dir, "--env", "babyai", "--tasks", "5,6",
               "--out", str(tmp_path / "o"), "--no-progress", f"++env.url={url}", "++sampling.max_new_tokens=8", "++sampling.max_context_tokens=3000"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "o" / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(r["data_idx"] for r in recs) == [5, 6]


def test_eval_with_an_unreachable_env_url_fails_with_a_clear_message(tmp_path, tiny_model_dir):
    cmd = [sys.executable, "-m", "turnscale", "eval", "--model", tiny_model_dir, "--tasks", "0:1", "--out", str(tmp_path),
           "++env.url=http://127.0.0.1:9"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not answer GET /health" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("turnscale.envhub.textcraft") is None, reason="the TextCraft env family is not in this build")
def test_eval_runs_two_env_families_in_one_report(tmp_path, tiny_model_dir):
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "turnscale", "eval", "--model", f"{tiny_model_dir}=tiny", "--env", "babyai,textcraft",
           "--tasks", "0:2", "--turns", "1", "--out", str(out), "--no-progress",
           "++sampling.max_new_tokens=8", "++sampling.max_context_tokens=3000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "eval.json").read_text())
    overall = [(r["env"], r["category"]) for r in doc["rows"] if r["category"] == ""]
    assert overall == [("babyai", ""), ("textcraft", ""), ("", "")]
    recs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert sorted((r["env"], r["data_idx"]) for r in recs) == [("babyai", 0), ("babyai", 1), ("textcraft", 0), ("textcraft", 1)]
    assert all(r["category"] for r in recs)


def test_eval_with_an_engine_that_is_not_installed_says_so(tmp_path, tiny_model_dir):
    pytest.importorskip("turnscale.actors.engine")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    cmd = [sys.executable, "-m", "turnscale", "eval", "--model", tiny_model_dir, "--tasks", "0:1", "--out", str(tmp_path), "engine=vllm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "engine 'vllm'" in proc.stderr and "Traceback" not in proc.stderr
