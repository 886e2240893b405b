"""``turnscale bench envhub``: env server throughput, each figure beside a baseline from the same run.

- ``envhub_babyai_steps``: BabyAI steps/s through ``EnvClient`` under trio, ``--episodes``
  (64) concurrent episodes against a server process over HTTP, beside the same env stepped
  in process in one loop (target ratio 0.5).
- ``envhub_babyai_steps_batched``: the same episodes through ``EnvClient(batch_steps=True)``
  (concurrent steps coalesced into ``POST /v1/step_batch``), beside the same in-process
  baseline (target 0.5); ``envhub_babyai_steps_batched_per_cpu_s`` in CPU seconds.
- ``envhub_babyai_steps_per_cpu_s``: the same run counted in CPU seconds (server process +
  client), beside the in-process loop's: less sensitive to a shared, loaded machine.
- ``envhub_client_req_s``: ``EnvClient`` requests/s on ``GET /health`` with 64 concurrent
  tasks, beside the server's capacity measured by a raw-socket keep-alive load generator in a
  second process (target 0.5).
- ``envhub_client_vs_httpx``: the same load through ``httpx.AsyncClient`` under trio, as
  the baseline our client is compared with (reported only).
- ``envhub_sciworld_steps``: only when ``envhub.sciworld`` exists: steps/s ("look around")
  through the client with a pool of JVMs, beside one in-process instance.

``--envhub-url URL --envhub-flavor F`` measures a server that is already running instead (e.g.
AgentGym's own BabyAI server with ``--envhub-flavor agentgym``): only ``envhub_babyai_steps``
(its server CPU is not ours to read), beside the same in-process baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import selectors
import socket
import subprocess
import sys
import time

from turnscale.benchmarks.common import Result, result

ACTIONS = ("turn left", "move forward", "turn right", "move forward", "check available actions")


def add_arguments(parser) -> None:
    parser.add_argument("--envhub-seconds", type=float, default=4.0, help="seconds per envhub figure")
    parser.add_argument("--envhub-episodes", type=int, default=64, help="concurrent episodes")
    parser.add_argument("--envhub-url", default="", help="measure this running BabyAI server instead of starting ours")
    parser.add_argument("--envhub-flavor", default="turnscale", help="what --envhub-url speaks: turnscale | agentgym")


def _inprocess_babyai(seconds: float, tasks: int) -> tuple[float, float]:
    """(steps per wall second, steps per CPU second) of ``tasks`` instances stepped in one loop."""
    from turnscale.envhub.babyai import BabyAIFamily

    family = BabyAIFamily()  # the server's default text
    envs = [family.create() for _ in range(tasks)]
    for k, env in enumerate(envs):
        env.reset(k)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        for k, env in enumerate(envs):
            out = env.step(ACTIONS[n % len(ACTIONS)])
            n += 1
            if out.done:
                env.reset(k)
    return n / (time.perf_counter() - t0), n / max(1e-9, time.process_time() - c0)


def _metrics(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return json.loads(r.read())


def _http_babyai(url: str, seconds: float, episodes: int, flavor: str = "turnscale", *, batch_steps: bool = False) -> tuple[float, float | None]:
    """(steps per wall second, steps per CPU second of server + client) over HTTP; the CPU
    figure is None for servers other than ours (flavor != turnscale: no ``/metrics``)."""
    import trio

    from turnscale.common.envclient import EnvClient

    ours = flavor == "turnscale"

    async def main() -> float:
        async with EnvClient(url, max_connections=episodes, flavor=flavor, batch_steps=batch_steps) as client:
            ids = [await client.create() for _ in range(episodes)]
            for k, i in enumerate(ids):
                await client.reset(i, k)
            count = 0
            m0, c0 = (_metrics(url) if ours else {}), time.process_time()
            t0 = time.perf_counter()

            async def episode(k: int) -> None:
                nonlocal count
                j = 0
                while time.perf_counter() - t0 < seconds:
                    out = await client.step(ids[k], ACTIONS[j % len(ACTIONS)])
                    j += 1
                    count += 1
                    if out.done:
                        await client.reset(ids[k], k)

            async with trio.open_nursery() as nursery:
                for k in range(episodes):
                    nursery.start_soon(episode, k)
            rate = count / (time.perf_counter() - t0)
            client_cpu = time.process_time() - c0
            per_cpu = None
            if ours:
                m1 = _metrics(url)
                steps = m1["steps"] - m0["steps"]
                per_cpu = steps / max(1e-9, client_cpu + m1["cpu_s"] - m0["cpu_s"])
            for i in ids:
                await client.close(i)
            return rate, per_cpu

    return trio.run(main)


def _client_req_s(url: str, seconds: float, concurrency: int) -> float:
    import trio

    from turnscale.common.envclient import EnvClient

    async def main() -> float:
        async with EnvClient(url, max_connections=concurrency) as client:
            count, t0 = 0, time.perf_counter()

            async def worker() -> None:
                nonlocal count
                while time.perf_counter() - t0 < seconds:
                    await client._call("GET", "/health", None, idempotent=True)
                    count += 1

            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
            return count / (time.perf_counter() - t0)

    return trio.run(main)


def _httpx_req_s(url: str, seconds: float, concurrency: int) -> float:
    import httpx
    import trio

    async def main() -> float:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, limits=limits) as client:
            count, t0 = 0, time.perf_counter()

            async def worker() -> None:
                nonlocal count
                while time.perf_counter() - t0 < seconds:
                    r = await client.get("/health")
                    r.raise_for_status()
                    count += 1

            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
            return count / (time.perf_counter() - t0)

    return trio.run(main)


def load_generator(host: str, port: int, seconds: float, conns: int) -> float:
    """Raw keep-alive GET /health on ``conns`` sockets with selectors: requests/s answered.
    Minimal parsing (status line + Content-Length), so the client costs little CPU."""
    request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    sel = selectors.DefaultSelector()
    bufs: dict[socket.socket, bytes] = {}
    for _ in range(conns):
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(request)
        s.setblocking(False)
        bufs[s] = b""
        sel.register(s, selectors.EVENT_READ)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            bufs[s] += s.recv(65536)
            while True:
                head, sep, rest = bufs[s].partition(b"\r\n\r\n")
                if not sep:
                    break
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if len(rest) < length:
                    break
                bufs[s] = rest[length:]
                done += 1
                s.sendall(request)
    elapsed = time.perf_counter() - t0
    for s in bufs:
        s.close()
    return done / elapsed


def _server_capacity(url: str, seconds: float, conns: int) -> float:
    host, port = url.split("//")[1].split(":")
    cmd = [sys.executable, "-m", "turnscale.benchmarks.envhub", "--load", host, port, str(seconds), str(conns)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, env={**os.environ})
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["req_s"])


def _sciworld(seconds: float) -> list[Result]:
    if importlib.util.find_spec("turnscale.envhub.sciworld") is None:
        return []
    import trio

    from turnscale.common.envclient import EnvClient
    from turnscale.benchmarks.envhub_launch import envhub_server
    from turnscale.envhub.registry import make_family

    from turnscale import conf
    family = make_family(conf.load(["env=sciworld"]).env)
    env = family.create()
    env.reset(0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        env.step("look around")
        n += 1
    base = n / (time.perf_counter() - t0)
    env.close()
    family.close()
    episodes = 2
    with envhub_server("sciworld", startup_timeout_s=180) as url:

        async def main() -> float:
            async with EnvClient(url, timeout_s=120) as client:
                ids = [await client.create() for _ in range(episodes)]
                for k, i in enumerate(ids):
                    await client.reset(i, k)
                count, start = 0, time.perf_counter()

                async def run(i: int) -> None:
                    nonlocal count
                    while time.perf_counter() - start < seconds:
                        await client.step(i, "look around")
                        count += 1

                async with trio.open_nursery() as nursery:
                    for i in ids:
                        nursery.start_soon(run, i)
                return count / (time.perf_counter() - start)

        value = trio.run(main)
    return [result("envhub_sciworld_steps", value, "steps/s", "1 in-process SciWorld instance", base)]


def run(args: argparse.Namespace) -> list[Result]:
    from turnscale.benchmarks.envhub_launch import envhub_server

    seconds = getattr(args, "envhub_seconds", 4.0)
    episodes = getattr(args, "envhub_episodes", 64)
    base_steps, base_cpu = _inprocess_babyai(seconds, episodes)
    results = []
    if getattr(args, "envhub_url", ""):
        steps, _ = _http_babyai(args.envhub_url, seconds, episodes, getattr(args, "envhub_flavor", "turnscale"))
        results.append(result("envhub_babyai_steps", steps, "steps/s", f"BabyAI in process, one loop ({episodes} instances)", base_steps, target=0.5))
        return results
    with envhub_server("babyai", max_instances=max(512, episodes)) as url:
        steps, per_cpu = _http_babyai(url, seconds, episodes)
        results.append(result("envhub_babyai_steps", steps, "steps/s", f"BabyAI in process, one loop ({episodes} instances)", base_steps, target=0.5))
        results.append(result("envhub_babyai_steps_per_cpu_s", per_cpu, "steps/CPU-s", "BabyAI in process (server + client CPU vs one loop)", base_cpu, target=0.5))
        steps_b, per_cpu_b = _http_babyai(url, seconds, episodes, batch_steps=True)
        results.append(result("envhub_babyai_steps_batched", steps_b, "steps/s", f"BabyAI in process, one loop ({episodes} instances)", base_steps, target=0.5))
        results.append(result("envhub_babyai_steps_batched_per_cpu_s", per_cpu_b, "steps/CPU-s", "BabyAI in process (server + client CPU vs one loop)", base_cpu, target=0.5))
        ours = _client_req_s(url, seconds, 64)
        capacity = _server_capacity(url, seconds, 64)
        results.append(result("envhub_client_req_s", ours, "req/s", "server capacity (raw keep-alive load generator, 2nd process)", capacity, target=0.5))
        other = _httpx_req_s(url, min(seconds, 3.0), 64)
        results.append(result("envhub_client_vs_httpx", ours, "req/s", "httpx.AsyncClient under trio, 64 tasks", other))
    results += _sciworld(seconds)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--load":
        rate = load_generator(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
        print(json.dumps({"req_s": rate}))
    else:
        raise SystemExit("usage: python -m turnscale.benchmarks.envhub --load HOST PORT SECONDS CONNS (use `turnscale bench envhub`)")
