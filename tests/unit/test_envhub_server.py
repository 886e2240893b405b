"""The server's contract with a fake env family (ASGI in process): error shapes, broken
instances, parsing rules.  The same contract against the real process: integration tests."""

from __future__ import annotations

import pytest

from turnscale.conf.schema import ServerLimits
from turnscale.envhub.base import EnvBusy, ResetResult, StepResult
from turnscale.common.envclient import EnvBusyError
from turnscale.common.envclient import _decode as client_decode
from turnscale.envhub.main import rewrite_overrides
from turnscale.envhub.server import IdleExit, create_app

pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402


class FakeEnv:
    def __init__(self) -> None:
        self.n = 0
        self.idx = -1

    def reset(self, data_idx):
        if data_idx == 9:
            raise EnvBusy("every worker is in use (raise fake.workers)")
        self.n, self.idx = 0, data_idx
        return ResetResult(f"task {data_idx}", {"category": "fake"}, {"score": 0.0})

    def step(self, action):
        if action == "explode":
            raise RuntimeError("secret internal detail")
        if action == "wait":
            raise EnvBusy("the simulator is saturated")
        self.n += 1
        done = action == "finish"
        return StepResult(f"{self.idx}:{self.n}:{action}", 1.0 if done else 0.0, done, False, {"success": done}, {"score": float(done)})

    def observation(self):
        return f"{self.idx}:{self.n}"

    def close(self):
        pass


class FakeFamily:
    name = "fake"

    def create(self):
        return FakeEnv()

    def num_tasks(self):
        return 10

    def close(self):
        pass


class Cfg:
    max_instances = 3
    idle_timeout_s = 60.0
    max_env_steps = 0
    exit_after_idle_s = 0.0
    limits = ServerLimits()


@pytest.fixture()
def client():
    with TestClient(create_app(FakeFamily(), Cfg()), raise_server_exceptions=False) as c:
        yield c


def test_internal_failure_is_500_without_trace_then_instance_is_broken(client):
    i = client.post("/v1/create").json()["id"]
    client.post("/v1/reset", json={"id": i, "data_idx": 0})
    r = client.post("/v1/step", json={"id": i, "action": "explode"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "env_error"
    assert "Traceback" not in r.text and "secret internal detail" not in r.text
    for path, body in (("/v1/step", {"id": i, "action": "x"}), ("/v1/reset", {"id": i, "data_idx": 1})):
        r = client.post(path, json=body)
        assert r.status_code == 410 and "close it" in r.json()["error"]["message"]
    assert client.post("/v1/close", json={"id": i}).json() is True
    assert client.post("/v1/step", json={"id": i, "action": "x"}).status_code == 404


def test_busy_env_is_503_with_retry_after_and_the_instance_stays_usable(client):
    i = client.post("/v1/create").json()["id"]
    client.post("/v1/reset", json={"id": i, "data_idx": 0})
    r = client.post("/v1/step", json={"id": i, "action": "wait"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "busy" and r.headers["Retry-After"] == "5"
    assert "saturated" in r.json()["error"]["message"] and "Traceback" not in r.text
    with pytest.raises(EnvBusyError, match="HTTP 503 busy"):  # what our client makes of it
        client_decode(r.status_code, r.content, "/step")
    assert client.post("/v1/step", json={"id": i, "action": "go"}).json()["observation"] == "0:1:go"  # episode intact
    r = client.post("/v1/reset", json={"id": i, "data_idx": 9})
    assert r.status_code == 503 and "raise fake.workers" in r.json()["error"]["message"]
    # the old episode was given up: no step until a reset succeeds, which it then does
    assert client.post("/v1/step", json={"id": i, "action": "go"}).status_code == 409
    assert client.post("/v1/reset", json={"id": i, "data_idx": 1}).status_code == 200
    assert client.post("/v1/step", json={"id": i, "action": "go"}).json()["observation"] == "1:1:go"
    assert client.get("/v1/metrics").json()["errors"]["busy"] == 2


def test_searchqa_shape_env_idx_names_instance_and_id_names_task(client):
    i = client.post("/create", json={"id": 0}).json()["env_idx"]
    r = client.post("/reset", json={"env_idx": i, "id": 7}).json()
    assert r["observation"] == "task 7" and r["id"] == i and r["done"] is False and r["reward"] == 0
    assert client.post("/step", json={"env_idx": i, "action": "a"}).json()["observation"] == "7:1:a"
    r = client.post("/reset", json={"env_idx": i, "idx": 5}).json()
    assert r["observation"] == "task 5"


def test_step_reply_keeps_agentgym_fields(client):
    i = client.post("/v1/create").json()["id"]
    client.post("/v1/reset", json={"id": i, "data_idx": 2})
    r = client.post("/v1/step", json={"id": i, "action": "finish"}).json()
    assert r == {"score": 1.0, "observation": "2:1:finish", "reward": 1.0, "done": True, "truncated": False, "info": {"success": True}}
    assert client.get(f"/v1/observation?id={i}").json() == "2:1"


def test_validation_errors_use_our_shape_not_fastapis(client):
    for body in (b"{", b"[1]", b'"x"', b"", b'{"id": "abc", "action": "x"}', b'{"id": true, "action": "x"}', b'{"id": 0}', b'{"action": "x"}', b'{"id": 0, "action": 5}', b'{"id": -1, "action": "x"}'):
        r = client.post("/v1/step", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, body
        err = r.json()["error"]
        assert set(err) == {"code", "message"} and err["message"]


def test_unknown_route_and_method_are_json_errors(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_route"
    r = client.get("/v1/step")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_host_and_port_shorthands_become_env_keys():
    assert rewrite_overrides(["env=babyai", "host=0.0.0.0", "port=9000", "env.max_instances=3", "++env.url=x", "algo=ppo"]) == ["env=babyai", "++env.host=0.0.0.0", "++env.port=9000", "++env.max_instances=3", "++env.url=x", "algo=ppo"]


def test_misspelled_env_key_is_still_refused():
    from turnscale import conf
    cfg = conf.load(rewrite_overrides(["env=babyai", "port=9001", "env.max_instances=7"]))
    assert (cfg.env.port, cfg.env.max_instances, cfg.env.host) == (9001, 7, "127.0.0.1")
    with pytest.raises(conf.ConfigError, match="max_instancez"):
        conf.load(rewrite_overrides(["env=babyai", "env.max_instancez=7"]))


def test_env_without_expert_answers_501(client):
    i = client.post("/v1/create").json()["id"]
    client.post("/v1/reset", json={"id": i, "data_idx": 0})
    r = client.get(f"/v1/expert?id={i}")
    assert r.status_code == 501 and r.json()["error"]["code"] == "no_expert"


def test_server_step_cap_truncates_episode():
    class Capped(Cfg):
        max_env_steps = 2

    with TestClient(create_app(FakeFamily(), Capped()), raise_server_exceptions=False) as c:
        i = c.post("/v1/create").json()["id"]
        c.post("/v1/reset", json={"id": i, "data_idx": 0})
        assert c.post("/v1/step", json={"id": i, "action": "a"}).json()["done"] is False
        r = c.post("/v1/step", json={"id": i, "action": "a"}).json()
        assert r["done"] is True and r["truncated"] is True and r["info"]["success"] is False
        assert c.post("/v1/step", json={"id": i, "action": "a"}).status_code == 409
        c.post("/v1/reset", json={"id": i, "data_idx": 1})  # a new episode gets a fresh budget
        assert c.post("/v1/step", json={"id": i, "action": "a"}).json()["done"] is False


def test_concurrent_creates_respect_the_instance_limit():
    import asyncio
    import time

    from turnscale.envhub.instances import ApiError, InstanceTable

    class SlowFamily(FakeFamily):
        def create(self):
            time.sleep(0.05)
            return FakeEnv()

    async def main():
        table = InstanceTable(SlowFamily(), max_instances=3, idle_timeout_s=60)
        results = await asyncio.gather(*(table.create() for _ in range(8)), return_exceptions=True)
        ok = [r for r in results if isinstance(r, int)]
        refused = [r for r in results if isinstance(r, ApiError)]
        assert len(ok) == 3 and len(refused) == 5 and all(r.status == 429 for r in refused)
        await table.close_all()

    asyncio.run(main())


def test_a_restarted_server_does_not_reuse_its_predecessors_instance_ids():
    import asyncio

    from turnscale.envhub.instances import ApiError, InstanceTable

    async def main():
        old = InstanceTable(FakeFamily(), max_instances=8, idle_timeout_s=60)
        held = [await old.create() for _ in range(4)]  # ids a client still holds when the server dies
        await old.close_all()
        new = InstanceTable(FakeFamily(), max_instances=8, idle_timeout_s=60)
        fresh = [await new.create() for _ in range(4)]
        assert not set(held) & set(fresh)
        with pytest.raises(ApiError) as err:
            await new.reset(held[0], 0)
        assert err.value.status == 404
        await new.close_all()

    asyncio.run(main())


def test_env_without_action_hints_answers_501(client):
    i = client.post("/v1/create").json()["id"]
    client.post("/v1/reset", json={"id": i, "data_idx": 0})
    r = client.get(f"/v1/action_hint?id={i}")
    assert r.status_code == 501 and r.json()["error"]["code"] == "no_action_hint"
    assert client.get("/v1/action_hint").status_code == 422


# -- AgentGym's face (the root): their clients assert HTTP 200 and read fields ----------------
def test_agentgym_face_answers_env_errors_with_200_and_an_error_field(client):
    """AgentGym's servers answer 200 + {"error": ...} for a bad id or a finished episode; the
    same calls on /v1 keep their status codes."""
    i = client.post("/create").json()["id"]
    r = client.post("/step", json={"id": i, "action": "x"})
    assert r.status_code == 200 and r.json()["error_code"] == "not_reset" and "POST /reset" in r.json()["error"]
    client.post("/reset", json={"id": i, "data_idx": 0})
    client.post("/step", json={"id": i, "action": "finish"})
    r = client.post("/step", json={"id": i, "action": "x"})
    assert r.status_code == 200 and r.json()["error_code"] == "episode_done" and "observation" not in r.json()
    assert client.post("/v1/step", json={"id": i, "action": "x"}).status_code == 409
    r = client.post("/step", json={"id": 10**9, "action": "x"})
    assert r.status_code == 200 and r.json()["error_code"] == "not_found"
    assert client.post("/close", json={"id": 10**9}).json() is False  # theirs: false, not an error
    assert client.post("/v1/close", json={"id": 10**9}).status_code == 404
    assert client.post("/step", content=b"{", headers={"content-type": "application/json"}).status_code == 422


def test_agentgym_face_env_failure_is_200_error_without_trace(client):
    i = client.post("/create").json()["id"]
    client.post("/reset", json={"id": i, "data_idx": 0})
    r = client.post("/step", json={"id": i, "action": "explode"})
    assert r.status_code == 200 and r.json()["error_code"] == "env_error" and "secret internal detail" not in r.text


def test_agentgym_error_bodies_become_typed_client_errors(client):
    from turnscale.common.envclient import EnvNotFound

    r = client.post("/step", json={"id": 10**9, "action": "x"})
    with pytest.raises(EnvNotFound, match="not_found"):
        client_decode(r.status_code, r.content, "/step")


def test_extra_agentgym_routes_are_404_for_families_without_them(client):
    i = client.post("/create").json()["id"]
    client.post("/reset", json={"id": i, "data_idx": 0})
    for path in ("/commands", "/goals", "/detail", "/state"):
        r = client.get(f"{path}?id={i}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_route", path
    assert client.get(f"/v1/commands?id={i}").status_code == 404


def test_the_server_raises_its_open_files_limit_to_fit_its_connections():
    """With the common soft limit of 1024, accept() would fail (EMFILE) before the 1024
    connections of ``env.limits.max_connections`` and their per-address share."""
    import resource
    import subprocess
    import sys

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"hard open-files limit {hard}")
    code = ("import resource; from turnscale.envhub.main import raise_open_files_limit; "
            "raise_open_files_limit(1024); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 1024 + 256


def test_idle_exit_clock_starts_at_the_first_env_request_and_stands_still_while_one_runs():
    """``env.exit_after_idle_s``'s clock (the real process: tests/integration/test_envhub_idle_exit.py)."""
    idle = IdleExit(5.0, lambda: None)
    assert idle.idle_s() == 0.0  # nobody has used it yet: the actors may still be queued
    idle.begin()
    idle.last -= 100.0
    assert idle.idle_s() == 0.0  # a long env call is use
    idle.end()
    assert 0.0 <= idle.idle_s() < 5.0
    idle.last -= 10.0
    assert idle.idle_s() >= 10.0


def test_health_and_metrics_are_not_env_requests_for_the_idle_clock():
    class Idle(Cfg):
        exit_after_idle_s = 3600.0

    with TestClient(create_app(FakeFamily(), Idle(), on_idle=lambda: None), raise_server_exceptions=False) as c:
        idle = c.app.state.idle_exit
        for path in ("/health", "/", "/metrics", "/v1/health", "/v1/metrics", "/no-such-route"):
            c.get(path)
        assert idle.last is None
        c.post("/v1/create", json={})
        assert idle.last is not None and idle.running == 0
