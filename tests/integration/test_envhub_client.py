"""EnvClient against real sockets: typed errors, the retry rule, and AgentGym-shaped servers
(a stand-in reproducing the shapes of AgentGym's env servers, served by uvicorn on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import trio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from turnscale.common.envclient import EnvClient, EnvConnectionLost, EnvHTTPError, EnvNotFound, EnvTimeout, EnvUnavailable
from tests.envhub_proc import free_port


# -- an AgentGym-shaped stand-in --------------------------------------------------------
def _babyai_app() -> Starlette:
    state = {"next": 0, "envs": {}}

    async def create(request: Request):
        i = state["next"]
        state["next"] += 1
        state["envs"][i] = 0
        return JSONResponse({"id": i})

    async def reset(request: Request):
        body = await request.json()
        if body["id"] not in state["envs"]:
            return JSONResponse({"error": f"The id {body['id']} is not valid."})
        state["envs"][body["id"]] = 0
        return JSONResponse({"observation": f"Your goal: task {body['data_idx']}", "reward": 0, "score": 0, "deleted": False, "done": False})

    async def step(request: Request):
        body = await request.json()
        if body["id"] not in state["envs"]:
            return JSONResponse({"error": f"The id {body['id']} is not valid."})
        if body["action"] == "sleep":
            await asyncio.sleep(2.0)
        done = body["action"] == "go to red ball 1"
        return JSONResponse({"observation": "ok", "reward": 0.0, "score": 0.8875 if done else 0.0, "done": done})

    async def hello(request: Request):
        return JSONResponse("This is environment BabyAI.")

    return Starlette(routes=[Route("/", hello), Route("/create", create, methods=["POST"]), Route("/reset", reset, methods=["POST"]), Route("/step", step, methods=["POST"])])


def _searchqa_app() -> Starlette:
    envs: dict[int, int] = {}

    async def create(request: Request):
        assert (await request.json()) == {"id": 0}
        envs[len(envs)] = -1
        return JSONResponse(len(envs) - 1)

    async def reset(request: Request):
        body = await request.json()
        envs[body["env_idx"]] = body["id"]
        return JSONResponse(f"Question {body['id']}?")

    async def step(request: Request):
        body = await request.json()
        right = body["action"] == f"<answer>{envs[body['env_idx']]}</answer>"
        return JSONResponse({"observation": "", "reward": 1.0 if right else 0.0, "done": right, "info": {}})

    async def close(request: Request):
        envs.pop((await request.json())["env_idx"], None)
        return JSONResponse(True)

    return Starlette(routes=[Route("/create", create, methods=["POST"]), Route("/reset", reset, methods=["POST"]), Route("/step", step, methods=["POST"]), Route("/close", close, methods=["POST"])])


@pytest.fixture(scope="module")
def standin():
    port = free_port()
    app = Starlette(routes=[Mount("/babyai", app=_babyai_app()), Mount("/searchqa", app=_searchqa_app())])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_agentgym_babyai_shapes(standin):
    async def main():
        async with EnvClient(standin + "/babyai", flavor="agentgym", timeout_s=0.5) as c:
            assert await c.health()
            i = await c.create()
            r = await c.reset(i, 3)
            assert r.observation == "Your goal: task 3"
            s = await c.step(i, "turn left")
            assert (s.reward, s.done, s.info["success"]) == (0.0, False, False)
            s = await c.step(i, "go to red ball 1")
            assert (s.reward, s.done, s.info["success"]) == (0.8875, True, True)  # reward from score
            with pytest.raises(EnvHTTPError) as err:  # HTTP 200 {"error": ...}
                await c.step(999, "x")
            assert "not valid" in err.value.message
            with pytest.raises(EnvTimeout):
                await c.step(i, "sleep")

    trio.run(main)


def test_agentgym_searchqa_shapes(standin):
    async def main():
        async with EnvClient(standin + "/searchqa", flavor="agentgym_searchqa") as c:
            i = await c.create()
            assert (await c.reset(i, 42)).observation == "Question 42?"
            assert (await c.step(i, "<answer>7</answer>")).reward == 0.0
            s = await c.step(i, "<answer>42</answer>")
            assert s.reward == 1.0 and s.done and s.info["success"]
            await c.close(i)

    trio.run(main)


# -- the retry rule on raw sockets -------------------------------------------------------
def test_unreachable_server_raises_env_unavailable_after_retries():
    port = free_port()

    async def main():
        c = EnvClient(f"http://127.0.0.1:{port}", max_retries=2, max_backoff_s=0.05)
        t0 = time.monotonic()
        with pytest.raises(EnvUnavailable):
            await c.create()
        assert time.monotonic() - t0 < 5
        assert await c.health() is False

    trio.run(main)


def _serve_raw(port: int, requests: list[bytes], reply: bool):
    """A raw HTTP server: records each request, then replies 200 ``true`` or drops the connection."""

    async def handler(stream: trio.SocketStream) -> None:
        buf = b""
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return
            if not data:
                return
            buf += data
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if not sep:
                continue
            length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")), b"0"))
            if len(rest) < length:
                continue
            requests.append(head.split(b"\r\n")[0])
            buf = rest[length:]
            if not reply:
                await stream.aclose()
                return
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4\r\n\r\ntrue")

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        task_status.started()
        await trio.serve_listeners(handler, listeners)

    return serve


def test_step_is_not_resent_when_the_connection_drops_after_sending():
    port = free_port()
    seen: list[bytes] = []

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(_serve_raw(port, seen, reply=False))
            c = EnvClient(f"http://127.0.0.1:{port}", max_retries=3, max_backoff_s=0.01)
            with pytest.raises(EnvConnectionLost):
                await c.step(0, "move forward")
            assert len(seen) == 1  # sent once, never re-sent
            seen.clear()
            with pytest.raises(EnvUnavailable):  # idempotent: re-sent, then gives up
                await c.observation(0)
            assert len(seen) == 4
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_client_retries_until_the_server_comes_up_and_reuses_connections():
    port = free_port()
    seen: list[bytes] = []

    async def main():
        async with trio.open_nursery() as nursery:
            c = EnvClient(f"http://127.0.0.1:{port}", max_retries=8, max_backoff_s=0.2)

            async def late_server():
                await trio.sleep(0.3)
                await nursery.start(_serve_raw(port, seen, reply=True))

            nursery.start_soon(late_server)
            await c.close(3)  # connect refused first, retried with backoff
            for _ in range(5):
                await c.close(3)
            assert len(seen) == 6 and len(c._idle) == 1  # one keep-alive connection reused
            await c.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_typed_errors_from_envhub(tmp_path):
    pytest.importorskip("minigrid")
    from tests.envhub_proc import envhub_server

    with envhub_server("babyai") as url:

        async def main():
            async with EnvClient(url) as c:
                with pytest.raises(EnvNotFound) as err:
                    await c.step(12345, "turn left")
                assert err.value.status == 404 and err.value.code == "not_found"
                i = await c.create()
                with pytest.raises(EnvHTTPError) as err:
                    await c.step(i, "turn left")
                assert err.value.status == 409
                r = await c.reset(i, 1)
                assert r.info["category"] == "BabyAI-GoToRedBall-v0"
                s = await c.step(i, "go to red ball 1")
                assert s.done and s.info["success"] and 0 < s.reward < 1
                assert await c.observation(i) == s.observation
                await c.close(i)
                await c.close(i)

        trio.run(main)


def test_expert_action_over_http_solves_babyai_tasks():
    pytest.importorskip("minigrid")
    from tests.envhub_proc import envhub_server

    with envhub_server("babyai", **{"env.options.text": "clean"}) as url:  # the oracle speaks the clean text

        async def main():
            async with EnvClient(url) as c:
                i = await c.create()
                for idx in (1, 12, 21, 33):  # GoToRedBall, OpenRedDoor, PutNextLocal, MoveTwoAcross
                    await c.reset(i, idx)
                    for _ in range(40):
                        out = await c.step(i, await c.expert_action(i))
                        if out.done:
                            break
                    assert out.done and out.info["success"], idx

        trio.run(main)


def test_batched_steps_give_every_episode_the_replies_of_single_steps():
    """64 concurrent BabyAI episodes through ``EnvClient(batch_steps=True)`` see exactly what
    the same episodes see one ``/v1/step`` at a time, in far fewer requests."""
    pytest.importorskip("minigrid")
    from tests.envhub_proc import envhub_server

    actions = ("turn left", "move forward", "turn right", "move forward", "check available actions", "pick up the ball")
    n, turns = 64, 6

    async def play(url, batch_steps):
        out: dict[int, list] = {}
        async with EnvClient(url, batch_steps=batch_steps, max_connections=n) as c:
            ids = [await c.create() for _ in range(n)]
            for k, i in enumerate(ids):
                await c.reset(i, k)

            async def episode(k):
                seq = []
                for t in range(turns):
                    r = await c.step(ids[k], actions[(k + t) % len(actions)])
                    seq.append((r.observation, r.reward, r.done))
                    if r.done:
                        break
                out[k] = seq

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for k in range(n):
                        nursery.start_soon(episode, k)
            for i in ids:
                await c.close(i)
        return out

    with envhub_server("babyai", max_instances=512) as url:
        single = trio.run(play, url, False)
        batched = trio.run(play, url, True)
        import json
        import urllib.request

        with urllib.request.urlopen(url + "/v1/metrics", timeout=10) as r:
            latency = json.loads(r.read())["latency"]
    assert batched == single
    steps = sum(len(s) for s in batched.values())
    assert latency["step_batch"]["count"] < steps / 4  # coalesced: many steps per request


def test_batched_step_errors_are_per_step_and_typed():
    pytest.importorskip("minigrid")
    from tests.envhub_proc import envhub_server

    with envhub_server("babyai") as url:

        async def main():
            async with EnvClient(url, batch_steps=True) as c:
                i, fresh = await c.create(), await c.create()
                await c.reset(i, 1)
                got = {}

                async def one(key, env_id):
                    try:
                        got[key] = await c.step(env_id, "turn left")
                    except EnvHTTPError as exc:
                        got[key] = exc

                with trio.fail_after(60):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(one, "ok", i)
                        nursery.start_soon(one, "not_reset", fresh)
                        nursery.start_soon(one, "unknown", 12345)
                assert got["ok"].observation and not got["ok"].done
                assert isinstance(got["not_reset"], EnvHTTPError) and got["not_reset"].status == 409
                assert isinstance(got["unknown"], EnvNotFound)
                with pytest.raises(ValueError, match="batch_steps"):
                    EnvClient(url, flavor="agentgym", batch_steps=True)

        trio.run(main)
