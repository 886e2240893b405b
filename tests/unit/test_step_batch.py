"""``POST /v1/step_batch`` against a fake env family (ASGI in process): every step keeps its
own outcome, bad batches are refused whole, AgentGym's routes are untouched.  The same route
through ``EnvClient(batch_steps=True)`` against the real server: integration tests."""

from __future__ import annotations

import pytest

from turnscale.envhub.server import MAX_BATCH_STEPS, create_app
from tests.unit.test_envhub_server import Cfg, FakeFamily

pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402


@pytest.fixture()
def client():
    with TestClient(create_app(FakeFamily(), Cfg()), raise_server_exceptions=False) as c:
        yield c


def _ready(client, n):
    ids = [client.post("/v1/create").json()["id"] for _ in range(n)]
    for k, i in enumerate(ids):
        assert client.post("/v1/reset", json={"id": i, "data_idx": k}).status_code == 200
    return ids


def test_a_batch_answers_each_step_as_if_it_were_sent_alone(client):
    a, b, c = _ready(client, 3)
    r = client.post("/v1/step_batch", json={"steps": [{"id": b, "action": "go"}, {"id": a, "action": "finish"}, {"id": c, "action": "go"}]})
    assert r.status_code == 200
    got = r.json()["results"]
    assert [g["observation"] for g in got] == ["1:1:go", "0:1:finish", "2:1:go"]
    assert got[1]["done"] is True and got[1]["info"]["success"] is True and got[1]["score"] == 1.0  # AgentGym's extra fields kept
    # the episode that finished is done; the others go on
    assert client.post("/v1/step", json={"id": a, "action": "go"}).status_code == 409
    assert client.post("/v1/step", json={"id": b, "action": "go"}).json()["observation"] == "1:2:go"
    assert client.get("/v1/metrics").json()["steps"] == 4


def test_a_failing_step_does_not_fail_the_others_in_its_batch(client):
    a, b, c = _ready(client, 3)
    r = client.post("/v1/step_batch", json={"steps": [
        {"id": a, "action": "explode"}, {"id": b, "action": "wait"}, {"id": c, "action": "go"}, {"id": 12345, "action": "go"}]})
    assert r.status_code == 200 and "secret internal detail" not in r.text and "Traceback" not in r.text
    errs = [g.get("error") for g in r.json()["results"]]
    assert errs[0]["status"] == 500 and errs[0]["code"] == "env_error"
    assert errs[1]["status"] == 503 and errs[1]["code"] == "busy"
    assert errs[2] is None and r.json()["results"][2]["observation"] == "2:1:go"
    assert errs[3]["status"] == 404 and errs[3]["code"] == "not_found"
    assert client.get("/v1/metrics").json()["errors"] == {"env_error": 1, "busy": 1, "not_found": 1}
    assert client.post("/v1/step", json={"id": a, "action": "go"}).status_code == 410  # broken, as alone
    assert client.post("/v1/step", json={"id": b, "action": "go"}).json()["observation"] == "1:1:go"  # busy: still usable


def test_a_step_before_reset_in_a_batch_is_409(client):
    (a,) = _ready(client, 1)
    fresh = client.post("/v1/create").json()["id"]
    got = client.post("/v1/step_batch", json={"steps": [{"id": fresh, "action": "go"}, {"id": a, "action": "go"}]}).json()["results"]
    assert got[0]["error"]["status"] == 409 and got[0]["error"]["code"] == "not_reset"
    assert got[1]["observation"] == "0:1:go"


@pytest.mark.parametrize("body, where", [
    ({}, "'steps'"),
    ({"steps": []}, "'steps'"),
    ({"steps": "go"}, "'steps'"),
    ({"steps": [{"id": 1, "action": "go"}, 7]}, "steps[1]: must be an object"),
    ({"steps": [{"action": "go"}]}, "steps[0]: missing field 'id'"),
    ({"steps": [{"id": 1}]}, "steps[0]: missing field 'action'"),
    ({"steps": [{"id": "x", "action": "go"}]}, "steps[0]: field 'id' must be an integer"),
    ({"steps": [{"id": 1, "action": 5}]}, "steps[0]: field 'action' must be a string"),
    ({"steps": [{"id": 1, "action": "go"}] * (MAX_BATCH_STEPS + 1)}, "the limit is"),
])
def test_a_malformed_batch_is_422_naming_the_item_and_runs_nothing(client, body, where):
    (a,) = _ready(client, 1)
    if body.get("steps") and isinstance(body["steps"], list) and isinstance(body["steps"][0], dict) and body["steps"][0].get("id") == 1:
        body = {"steps": [dict(s, id=a) if isinstance(s, dict) and "id" in s else s for s in body["steps"]]}
    r = client.post("/v1/step_batch", json=body)
    assert r.status_code == 422 and where in r.json()["error"]["message"], r.text
    assert client.get("/v1/metrics").json()["steps"] == 0


def test_a_batch_naming_an_instance_twice_is_refused_whole(client):
    a, b = _ready(client, 2)
    r = client.post("/v1/step_batch", json={"steps": [{"id": a, "action": "go"}, {"id": b, "action": "go"}, {"id": a, "action": "go"}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "duplicate_id"
    assert client.post("/v1/step", json={"id": a, "action": "go"}).json()["observation"] == "0:1:go"  # nothing ran


def test_agentgym_face_has_no_batch_route(client):
    assert client.post("/step_batch", json={"steps": []}).status_code == 404
