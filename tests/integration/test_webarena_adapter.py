"""The WebArena adapter against a stand-in of AgentGym's WebArena server (a real process)."""

from __future__ import annotations

import httpx
import pytest

from turnscale.conf.schema import EnvConfig
from turnscale.envhub.webarena import UpstreamError, make_family

from ._serve import free_port, serve


@pytest.fixture(scope="module")
def upstream():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve(["-m", "tests.integration.webarena_standin", "--port", str(port)], url + "/"):
        yield url


@pytest.fixture
def family(upstream):
    fam = make_family(EnvConfig(name="webarena", options={"upstream_url": upstream, "timeout_s": 10}))
    yield fam
    fam.close()


def test_episode_ends_with_reward_from_the_upstream_evaluator(family, upstream):
    env = family.create()
    r = env.reset(812 + 5)  # wraps to task 5
    assert r.info == {"category": "shopping+reddit", "task_id": 5} and "task 5" in r.observation
    s = env.step("Let's think step-by-step. In summary, the next action I will perform is ```click [12]```")
    assert "URL: http://homepage.com/answers" in s.observation and "PREVIOUS ACTION: click [12]" in s.observation
    assert (s.reward, s.done, s.info["success"]) == (0.0, False, False)
    s = env.step("```stop [answer-5]```")
    assert (s.reward, s.done, s.info["success"]) == (1.0, True, True)
    log = httpx.get(f"{upstream}/log", params={"env_idx": env._idx}).json()
    assert log == ["```click [12]```", "```stop [answer-5]```"]
    env.close()


def test_wrong_stop_answer_ends_with_zero(family):
    env = family.create()
    env.reset(2)
    s = env.step("type [31] [what] ")
    assert s.info["action"] == "type [31] [what] [1]" and not s.done
    s = env.step("```stop [nope]```")
    assert (s.reward, s.done, s.info["success"]) == (0.0, True, False)
    env.close()


def test_invalid_action_is_explained_and_not_sent_upstream(family, upstream):
    env = family.create()
    env.reset(1)
    s = env.step("I will click on the thing ```click on answers```")
    assert s.observation.startswith("Invalid action:") and "click [id]" in s.observation
    assert (s.reward, s.done, s.info["valid"]) == (0.0, False, False)
    assert httpx.get(f"{upstream}/log", params={"env_idx": env._idx}).json() == []
    env.close()


def test_close_releases_the_upstream_env_once(family, upstream):
    env = family.create()
    env.reset(0)
    idx = env._idx
    assert idx in httpx.get(f"{upstream}/live").json()
    env.close()
    env.close()
    assert idx not in httpx.get(f"{upstream}/live").json()


def test_upstream_timeout_error_and_unreachable_server_raise_typed_errors(family):
    env = family.create()
    with pytest.raises(UpstreamError, match="timed out"):
        env.reset(13)
    env.close()
    dead = make_family(EnvConfig(name="webarena", options={"upstream_url": f"http://127.0.0.1:{free_port()}", "timeout_s": 2}))
    with pytest.raises(UpstreamError, match="unreachable"):
        dead.create().reset(0)
    with pytest.raises(ValueError, match="upstream_url"):
        make_family(EnvConfig(name="webarena"))
