"""``turnscale envhub env=web`` as a real server process: AgentGym's WebArena wire shape, our
typed client in both flavours, AgentGym's WebArena adapter pointed at it, the oracle over
``/expert``, and a broken instance replaced without touching the others."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import trio

from turnscale.common.envclient import EnvClient
from turnscale.conf.schema import EnvConfig
from turnscale.envhub.webarena import make_family as webarena_family
from tests.envhub_proc import envhub_server

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                reason="Debian's chromium is not installed (scripts/setup.sh installs it as root)")


@pytest.fixture(scope="module")
def server():
    with envhub_server("web", startup_timeout_s=120) as url:
        yield url


def test_agentgym_webarena_wire_shape(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        env_idx = c.post("/create").json()["env_idx"]
        r = c.post("/reset", json={"env_idx": env_idx, "seed": 0, "idx": 4002}).json()
        assert r["observation"].startswith("OBSERVATION:\n") and r["sites"] == ["shop"] and "intent" in r["object"]
        s = c.post("/step", json={"env_idx": env_idx, "action": "Thinking... ```scroll [down]```"}).json()
        assert {"observation", "reward", "terminated", "truncated", "info"} <= set(s)
        assert (s["reward"], s["terminated"], s["truncated"]) == (0.0, False, False)
        bad = c.post("/step", json={"env_idx": env_idx, "action": "```click [123456789]```"}).json()
        assert bad["observation"].startswith("Invalid action: Cannot find element") and bad["terminated"] is False
        for _ in range(20):
            a = c.get("/expert", params={"id": env_idx}).json()["action"]
            s = c.post("/step", json={"env_idx": env_idx, "action": f"```{a}```"}).json()
            if s["terminated"]:
                break
        assert (s["reward"], s["terminated"], s["info"]["success"]) == (1.0, True, True)
        assert c.post("/close", json={"env_idx": env_idx}).json() is True


@pytest.mark.parametrize("flavor", ["turnscale", "agentgym_webarena"])
def test_typed_client_plays_an_oracle_episode(server, flavor):
    async def main() -> tuple[float, bool, int]:
        async with EnvClient(server, flavor=flavor, timeout_s=120) as c:
            eid = await c.create()
            await c.reset(eid, 4005)  # forum_create_post on a held-out seed
            for turn in range(30):
                out = await c.step(eid, "```" + await c.expert_action(eid) + "```")
                if out.done:
                    break
            await c.close(eid)
            return out.reward, out.info["success"], turn

    reward, success, turns = trio.run(main)
    assert (reward, success) == (1.0, True) and turns > 3


def test_agentgyms_webarena_adapter_drives_the_local_sites(server):
    """Our AgentGym-WebArena adapter (``env=webarena``) talks to this server as to AgentGym's."""
    fam = webarena_family(EnvConfig(name="webarena", options={"upstream_url": server, "timeout_s": 120, "num_tasks": 4400}))
    try:
        env = fam.create()
        r = env.reset(4000)  # shop_price
        assert r.info["category"] == "shop" and "OBJECTIVE: What is the price" in r.observation
        s = env.step("```stop [$0.01]```")
        assert (s.done, s.reward, s.info["success"]) == (True, 0.0, False)
        env.close()
    finally:
        fam.close()


def test_the_agent_cannot_crash_the_browser_through_goto(server):
    """``goto`` takes only http(s) URLs (``chrome://crash`` would kill the page); the instance and
    its neighbour go on.  Real crashes and a killed browser: ``test_web_env.py``."""
    with httpx.Client(base_url=server + "/v1", timeout=120) as c:
        a, b = c.post("/create").json()["id"], c.post("/create").json()["id"]
        for eid in (a, b):
            assert c.post("/reset", json={"id": eid, "data_idx": 0}).status_code == 200
        # The agent cannot crash a page through the grammar: chrome:// is outside the allowed sites.
        s = c.post("/step", json={"id": a, "action": "```goto [chrome://crash]```"}).json()
        assert s["observation"].startswith("blocked: chrome://crash is outside the allowed sites") and not s["done"]
        assert c.get("/health").json()["instances"] >= 2
        assert c.post("/step", json={"id": b, "action": "```scroll [down]```"}).status_code == 200
        for eid in (a, b):
            c.post("/close", json={"id": eid})


def test_a_goto_to_a_private_loopback_service_is_blocked_and_counted_in_metrics(server):
    """Issue 31, item 10, through the real server with default settings: the private service
    (this test's, on another 127.0.0.1 port) is never reached, the agent reads why, ``/metrics``
    counts the refusal.  Redirects, scripts and sub-resources: ``test_web_allowlist.py``."""
    secret, hits = "LOOPBACK-SECRET-51c2", []

    class Private(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(secret)))
            self.end_headers()
            self.wfile.write(secret.encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Private)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with httpx.Client(base_url=server + "/v1", timeout=120) as c:
            eid = c.post("/create").json()["id"]
            c.post("/reset", json={"id": eid, "data_idx": 0}).raise_for_status()
            before = c.get("/metrics").json()["web_refused"]["goto"]
            for host in ("127.0.0.1", "localhost"):
                url = f"http://{host}:{srv.server_address[1]}/"
                s = c.post("/step", json={"id": eid, "action": f"```goto [{url}]```"}).json()
                assert s["observation"].startswith(f"blocked: {url} is outside the allowed sites") and secret not in s["observation"]
                assert (s["done"], s["info"]["valid"]) == (False, False)
            assert c.get("/metrics").json()["web_refused"]["goto"] == before + 2
            c.post("/close", json={"id": eid})
    finally:
        srv.shutdown()
        srv.server_close()
    assert hits == []
