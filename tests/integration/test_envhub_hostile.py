"""Hostile and buggy clients against real ``turnscale envhub`` processes (issue 21, items 1-8;
issue 31, items 6-9).

Each case is bounded in time and checks that the server stays healthy and keeps serving a
well-behaved client (``GoodClient``, in a thread) meanwhile.  The quota cases (issue 31) run
against a server with DEFAULT settings and measure what an honest client on another peer
address gets WHILE one address attacks: on loopback, 127.0.0.1 (the honest client) and
127.0.0.2, 127.0.0.3, ... (attackers, their sockets bound there) are different addresses.
Memory cases print the server's RSS before/after (run with ``-s`` to see them).
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

pytest.importorskip("minigrid")

from turnscale.benchmarks.envhub_launch import free_port, stop, wait_healthy

HOST = "127.0.0.1"


class Server:
    """One ``turnscale envhub`` child on 127.0.0.1: ``url``, ``port``, ``proc`` (ended by pid), ``log_path``."""

    def __init__(self, env: str, overrides: dict[str, object]) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        args = [sys.executable, "-m", "turnscale", "envhub", f"env={env}", f"host={HOST}", f"port={self.port}"]
        args += [f"++env.{k}={v}" for k, v in overrides.items()]
        fd, self.log_path = tempfile.mkstemp(prefix=f"envhub-hostile-{env}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.proc, 90.0)
        except Exception:
            self.close()
            raise

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        stop(self.proc)
        os.unlink(self.log_path)


def call(url_port: int, method: str, path: str, body: object = None, *, raw: bytes | None = None, headers: dict | None = None,
         timeout: float = 30.0, source: str | None = None, conn: http.client.HTTPConnection | None = None) -> tuple[int, object, dict]:
    """One request from ``source`` (a 127.x address; default 127.0.0.1), on ``conn`` (kept
    open) when given, else on a fresh connection."""
    own = conn is None
    if own:
        conn = connect(url_port, source, timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})} if data is not None else dict(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        text = r.read().decode("utf-8", "replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return r.status, parsed, {k.lower(): v for k, v in r.getheaders()}
    finally:
        if own:
            conn.close()


def connect(port: int, source: str | None = None, timeout: float = 30.0) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(HOST, port, timeout=timeout, source_address=(source, 0) if source else None)


def wait_until(cond, timeout_s: float, what: str, period_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = cond()
        if out:
            return out
        time.sleep(period_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


class GoodClient:
    """Plays short BabyAI/TextCraft episodes in a loop (create, reset, step, close) and counts
    successes and failures; every request has a 30 s client timeout."""

    def __init__(self, port: int, action: str = "turn left", token: str = "good") -> None:
        self.port, self.action, self.headers = port, action, {"X-Envhub-Client": token}
        self.ok, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s, body, _ = call(self.port, "POST", "/v1/create", {}, headers=self.headers)
                assert s == 200, (s, body)
                i = body["id"]
                s, body, _ = call(self.port, "POST", "/v1/reset", {"id": i, "data_idx": self.ok % 7})
                assert s == 200, (s, body)
                s, body, _ = call(self.port, "POST", "/v1/step", {"id": i, "action": self.action})
                assert s == 200, (s, body)
                s, body, _ = call(self.port, "POST", "/v1/close", {"id": i})
                assert s == 200, (s, body)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on
                self.failures.append(repr(exc))
                return

    def __enter__(self) -> "GoodClient":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        wait_until(lambda: self.ok > 0 or self.failures, 60, "the well-behaved client finished one episode")
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "well-behaved client stuck"
        assert not self.failures, self.failures
        assert self.ok > 0


def healthy(port: int) -> bool:
    s, body, _ = call(port, "GET", "/health", timeout=10)
    return s == 200 and body["status"] == "ok"


def metrics(port: int) -> dict:
    return call(port, "GET", "/metrics", timeout=10)[1]


def raw_exchange(port: int, data: bytes, *, timeout: float = 15.0) -> bytes:
    """Send ``data`` (maybe an incomplete request), return what the server answers until it closes or ``timeout``."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        return recv_all(s, timeout)


def recv_all(s: socket.socket, timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError, socket.timeout):
            break
        if not chunk:
            break
        out += chunk
        if b"\r\n\r\n" in out and b"content-length" in out.lower():
            head, _, rest = out.partition(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(rest) >= n:
                break
    return out


def new_instance(port: int, data_idx: int = 0, token: str = "") -> int:
    s, body, _ = call(port, "POST", "/v1/create", {}, headers={"X-Envhub-Client": token} if token else None)
    assert s == 200, body
    i = body["id"]
    s, body, _ = call(port, "POST", "/v1/reset", {"id": i, "data_idx": data_idx}, timeout=60)
    assert s == 200, body
    return i


# -- BabyAI with tight limits: shared by most cases ------------------------------------------
LIMITS = {
    "max_instances": 8,
    "limits.call_timeout_s": 10,
    "limits.body_timeout_s": 4,
    "limits.header_timeout_s": 4,
    "limits.keepalive_timeout_s": 4,
    "limits.max_connections": 64,
}


@pytest.fixture(scope="module")
def babyai() -> Iterator[Server]:
    server = Server("babyai", {**LIMITS, "options.text": "clean"})  # the oracle (/expert) speaks the clean text
    try:
        yield server
    finally:
        server.close()


def test_expert_call_where_minigrids_bot_loops_answers_within_the_deadline(babyai):
    """Task 1948 (UnlockToUnlock seed 48): minigrid's bot ``replan`` never returns."""
    rss0 = babyai.rss_mb()
    with GoodClient(babyai.port):
        i = new_instance(babyai.port, 1948)
        t0 = time.monotonic()
        s, body, _ = call(babyai.port, "GET", f"/v1/expert?id={i}", timeout=40)
        took = time.monotonic() - t0
        assert s in (200, 504), body
        if s == 200:  # the bounded oracle gave up on the bot and its script answered
            assert isinstance(body["action"], str) and body["action"]
            assert call(babyai.port, "GET", f"/v1/observation?id={i}")[0] == 200
        else:
            assert body["error"]["code"] == "deadline_exceeded"
        assert call(babyai.port, "POST", "/v1/close", {"id": i}, timeout=10)[:2] == (200, True)
    assert healthy(babyai.port)
    print(f"\n[memory] expert on task 1948: server RSS {rss0:.1f} -> {babyai.rss_mb():.1f} MB ({took:.2f} s, status {s})")
    assert babyai.rss_mb() - rss0 < 64


def test_content_length_over_the_limit_is_refused_before_the_body_is_read(babyai):
    head = b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
    with socket.create_connection((HOST, babyai.port), timeout=15) as s:
        s.sendall(head + b'{"id": 1')
        reply = recv_all(s, 15)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"body_too_large" in reply and b"Traceback" not in reply
        t0 = time.monotonic()  # the rest of the body never comes: the server stops waiting for it
        assert recv_all(s, 20) == b""
        assert time.monotonic() - t0 < 20
    assert healthy(babyai.port)


def test_a_client_that_writes_its_whole_oversized_body_before_reading_gets_the_413(babyai):
    big = json.dumps({"id": 1, "action": "x" * (8 << 20)}).encode()
    for _ in range(5):
        s, body, _ = call(babyai.port, "POST", "/v1/step", raw=big)  # http.client sends it all, then reads
        assert s == 413 and body["error"]["code"] == "body_too_large", (s, body)
    assert healthy(babyai.port)


def _send_chunked(port: int, total: int, results: list) -> None:
    """A chunked body (no Content-Length) of ``total`` bytes; records the status line seen."""
    piece = b"x" * 65536
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    try:
        with socket.create_connection((HOST, port), timeout=30) as s:
            s.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            sent = 0
            try:
                while sent < total:
                    s.sendall(chunk)
                    sent += len(piece)
                s.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # the server stopped reading and closed: expected
            reply = recv_all(s, 15)
            results.append(reply.split(b"\r\n", 1)[0])
    except OSError as exc:
        results.append(repr(exc).encode())


def test_streamed_bodies_over_the_limit_are_cut_off_while_reading(babyai):
    rss0 = babyai.rss_mb()
    results: list = []
    with GoodClient(babyai.port):
        threads = [threading.Thread(target=_send_chunked, args=(babyai.port, 50 << 20, results)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        rss1 = babyai.rss_mb()
    print(f"\n[memory] 8 x 50 MB chunked bodies: server RSS {rss0:.1f} -> {rss1:.1f} MB; replies {sorted(set(results))}")
    assert rss1 - rss0 < 48
    assert any(r.startswith(b"HTTP/1.1 413") for r in results), results
    small: list = []
    _send_chunked(babyai.port, 2 << 20, small)
    assert small[0].startswith(b"HTTP/1.1 413"), small
    assert healthy(babyai.port)


def test_a_body_that_never_finishes_gets_408_after_the_body_timeout(babyai):
    with GoodClient(babyai.port):
        head = b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        t0 = time.monotonic()
        reply = raw_exchange(babyai.port, head + b'{"id": 1, ', timeout=20)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"body_timeout" in reply
        assert time.monotonic() - t0 < 20


def test_deeply_nested_json_is_422_without_a_traceback(babyai):
    log0 = len(babyai.log())
    for raw, code in ((b"[" * 100_000 + b"]" * 100_000, "too_deep"), (b'{"id": ' + b"[" * 40 + b"]" * 40 + b"}", "too_deep"),
                      (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "too_many_values")):  # 50k keys: refused before its depth is measured
        s, body, _ = call(babyai.port, "POST", "/v1/step", raw=raw)
        assert s == 422 and body["error"]["code"] == code, (s, body)
    assert "Traceback" not in babyai.log()[log0:]
    assert healthy(babyai.port)


def test_client_disconnects_are_logged_briefly_and_rate_limited(babyai):
    log0 = len(babyai.log())
    gone0 = metrics(babyai.port)["client_disconnects"]
    with GoodClient(babyai.port):
        for _ in range(200):
            with socket.create_connection((HOST, babyai.port), timeout=10) as s:
                s.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"id\": 1")
        wait_until(lambda: metrics(babyai.port)["client_disconnects"] - gone0 >= 200, 60, "200 disconnects counted")
    added = babyai.log()[log0:]
    print(f"\n[log] 200 client disconnects added {len(added)} bytes of server log")
    assert "Traceback" not in added and "ERROR" not in added
    assert len(added) < 4096, added


def test_malformed_requests_get_400_and_a_bounded_log(babyai):
    log0 = len(babyai.log())
    with GoodClient(babyai.port):
        for n in range(300):
            reply = raw_exchange(babyai.port, b"GARBAGE\x00 /step HTTP/1.1\r\n\r\n" if n % 2 else b"POST /step HTTP/1.1\r\nContent-Length: x\r\n\r\n", timeout=10)
            assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
    added = babyai.log()[log0:]
    print(f"\n[log] 300 malformed requests added {len(added)} bytes of server log")
    assert "Traceback" not in added and len(added) < 4096, added


def test_lone_surrogates_are_refused_at_the_door_and_the_instance_stays_usable():
    server = Server("textcraft", {})
    try:
        i = new_instance(server.port, 0)
        raw = json.dumps({"id": i, "action": "craft 1 \ud800stick using 1 planks"}).encode()  # ascii-escaped lone surrogate
        s, body, _ = call(server.port, "POST", "/v1/step", raw=raw)
        assert s == 422 and body["error"]["code"] == "invalid_text" and "U+D800" in body["error"]["message"], (s, body)
        s, body, _ = call(server.port, "GET", f"/v1/observation?id={i}")
        assert s == 200 and isinstance(body, str)
        s, body, _ = call(server.port, "POST", "/v1/step", {"id": i, "action": "inventory"})
        assert s == 200 and isinstance(body["observation"], str)
        s, body, _ = call(server.port, "POST", "/v1/step", {"id": i, "action": "get 1 \u00e9t\u00e9 \U0001F600"})  # valid non-ASCII passes
        assert s == 200, body
        assert healthy(server.port)
    finally:
        server.close()


def test_instance_ids_are_unguessable_json_integers(babyai):
    ids = [new_instance(babyai.port, 0, token="ids") for _ in range(3)]
    try:
        assert all(isinstance(i, int) and 0 < i < 2**53 for i in ids)
        gaps = [abs(a - b) for n, a in enumerate(ids) for b in ids[n + 1:]]
        assert min(gaps) > 2**20, ids  # not a counter
        for i in ids:
            for guess in (i - 1, i + 1):
                s, body, _ = call(babyai.port, "POST", "/v1/step", {"id": guess, "action": "turn left"})
                assert s == 404, (guess, s, body)
    finally:
        for i in ids:
            call(babyai.port, "POST", "/v1/close", {"id": i})


def test_a_request_head_that_never_finishes_is_closed_at_the_header_timeout(babyai):
    timeouts0 = metrics(babyai.port)["http"].get("header_timeouts", 0)
    with socket.create_connection((HOST, babyai.port), timeout=10) as s:
        s.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
        t0 = time.monotonic()
        assert recv_all(s, 20) == b""
        assert time.monotonic() - t0 < 20
    assert metrics(babyai.port)["http"]["header_timeouts"] == timeouts0 + 1


def test_idle_keepalive_connections_are_closed(babyai):
    with socket.create_connection((HOST, babyai.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert recv_all(s, 10).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert recv_all(s, 20) == b""  # closed by the server after keepalive_timeout_s
        assert time.monotonic() - t0 < 20


# -- SearchQA: the regex bomb ------------------------------------------------------------------
def test_searchqa_action_of_repeated_search_tags_does_not_stall_the_server():
    server = Server("searchqa", {})
    try:
        bombs = ["<search>" * 8192, "<answer>x</answer>" + "<answer>" * 8000 + "</search>"]
        replies: list = []

        def bomb(i: int, action: str) -> None:
            replies.append(call(server.port, "POST", "/v1/step", {"env_idx": i, "action": action}, timeout=60)[0])

        threads = [threading.Thread(target=bomb, args=(new_instance(server.port, n), bombs[n % 2])) for n in range(4)]
        for t in threads:
            t.start()
        worst = 0.0
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            assert healthy(server.port)  # 10 s client timeout: the quadratic regex held the GIL ~16 s
            worst = max(worst, time.monotonic() - t0)
        for t in threads:
            t.join(60)
        assert replies == [200] * 4, replies
        print(f"\n[time] /health during 4 SearchQA regex bombs: worst {worst * 1000:.0f} ms")
    finally:
        server.close()


# -- a call that never returns: deadline, broken instance, exhaustion, bounded shutdown ---------
def test_env_calls_past_the_deadline_break_only_their_instance_and_shutdown_stays_bounded():
    hang = "{median_s:1000,sigma:0,max_s:1000,steps_median:0}"  # every step sleeps 1000 s
    server = Server("babyai", {"limits.call_timeout_s": 2, "limits.max_overrun_calls": 2, "options.server_threads": 2,
                               "options.sim_latency": hang, "limits.shutdown_timeout_s": 3})
    try:
        port = server.port
        stuck = [new_instance(port, n) for n in range(3)]
        other = new_instance(port, 5)
        t0 = time.monotonic()
        s, body, _ = call(port, "POST", "/v1/step", {"id": stuck[0], "action": "turn left"}, timeout=30)
        assert s == 504 and body["error"]["code"] == "deadline_exceeded", body
        assert time.monotonic() - t0 < 30
        # the instance is gone at once: its lock is free, its id answers 410, close stays idempotent
        assert call(port, "GET", f"/v1/observation?id={stuck[0]}", timeout=10)[0] == 410
        assert call(port, "POST", "/v1/close", {"id": stuck[0]}, timeout=10)[:2] == (200, True)
        # other instances and calls keep working (resets do not sleep)
        assert call(port, "POST", "/v1/reset", {"id": other, "data_idx": 6}, timeout=10)[0] == 200
        assert call(port, "GET", f"/v1/observation?id={other}", timeout=10)[0] == 200
        assert healthy(port)
        assert call(port, "POST", "/v1/step", {"id": stuck[1], "action": "turn left"}, timeout=30)[0] == 504
        # two abandoned calls still sleep: the pool is exhausted, and says so
        s, body, _ = call(port, "GET", "/health", timeout=10)
        assert s == 503 and body["status"] == "unhealthy" and "overran" in body["reason"], body
        s, body, hdrs = call(port, "POST", "/v1/reset", {"id": other, "data_idx": 7}, timeout=10)
        assert s == 503 and body["error"]["code"] == "workers_exhausted" and "retry-after" in hdrs, body
        assert metrics(port)["timed_out"] == 2
        t0 = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        rc = server.proc.wait(timeout=30)
        print(f"\n[time] shutdown with 2 env calls stuck: {time.monotonic() - t0:.2f} s, rc {rc}")
        assert rc == 0
    finally:
        server.close()


# -- issue 31: quotas per peer address, with DEFAULT settings, checked DURING the attack ---------
@pytest.fixture(scope="module")
def defaults() -> Iterator[Server]:
    server = Server("babyai", {})
    try:
        yield server
    finally:
        server.close()


def _flood(stop: threading.Event, worker, n: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=worker, args=(k, stop), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads


def _join(stop: threading.Event, threads: list[threading.Thread]) -> None:
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an attacking thread is stuck"


def test_an_address_rotating_tokens_leaves_instances_for_other_addresses_and_429s_are_counted_once(defaults):
    """Default quota: 448 of 512 per address (7/8).  Before: one address took all 512 (tokens
    rotated past any per-token cap) and an honest client got 429 for every create."""
    port = defaults.port
    held: list[int] = []
    refusals: list[tuple[int, str, str]] = []
    stop = threading.Event()
    capped = threading.Event()

    def attacker(k: int, stop: threading.Event) -> None:
        conn, n = connect(port, "127.0.0.2"), 0
        try:
            while not stop.is_set():
                n += 1
                s, body, hdrs = call(port, "POST", "/v1/create", {}, headers={"X-Envhub-Client": f"rot-{k}-{n}"}, conn=conn)
                if s == 200:
                    held.append(body["id"])
                else:
                    refusals.append((s, body["error"]["code"], hdrs.get("retry-after", "")))
                    capped.set()
                    time.sleep(0.01)
        finally:
            conn.close()

    errors0 = metrics(port)["errors"].get("client_quota", 0)
    mine: list[int] = []
    try:
        threads = _flood(stop, attacker, 4)
        try:
            assert capped.wait(60), "the attacker was never refused"
            for _ in range(16):  # an actor's group, while the attacker holds its cap and keeps asking
                s, body, _ = call(port, "POST", "/v1/create", {})
                assert s == 200, (s, body)
                mine.append(body["id"])
            assert call(port, "POST", "/v1/reset", {"id": mine[0], "data_idx": 1})[0] == 200
            assert call(port, "POST", "/v1/step", {"id": mine[0], "action": "go to red ball 1"})[0] == 200
        finally:
            _join(stop, threads)
        assert len(held) == 448, len(held)
        assert {(s, code) for s, code, _ in refusals} == {(429, "client_quota")} and all(int(r) > 0 for _, _, r in refusals)
        assert metrics(port)["errors"]["client_quota"] == errors0 + len(refusals)  # counted once each
        while True:  # the server-wide limit comes next, for a third address
            s, body, hdrs = call(port, "POST", "/v1/create", {}, source="127.0.0.3")
            if s != 200:
                break
            held.append(body["id"])
        assert len(held) == 512 - 16 and s == 429 and body["error"]["code"] == "too_many_instances" and int(hdrs["retry-after"]) > 0
    finally:
        conn = connect(port)
        for i in held + mine:
            call(port, "POST", "/v1/close", {"id": i}, conn=conn)
        conn.close()
    assert metrics(port)["instances"] == 0


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} open files (RLIMIT_NOFILE hard limit {hard})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def test_an_address_flooding_slow_connections_leaves_another_address_served(defaults):
    """1,100 half-open connections from 127.0.0.2, re-opened as the server closes them.  Default
    caps: 1024 connections, 896 per address.  Before: the flood filled all 1024 and an honest
    client on 127.0.0.1 was refused nearly every time."""
    _raise_fd_limit(4096)
    port = defaults.port
    fds0 = defaults.fds()
    refused0 = metrics(port)["http"].get("refused_connections_per_address", 0)
    socks: list[socket.socket] = []
    head = b"POST /v1/step HTTP/1.1\r\nHost: x\r\n"  # never finishes its head

    def open_one() -> socket.socket:
        s = socket.create_connection((HOST, port), timeout=5, source_address=("127.0.0.2", 0))
        try:
            s.sendall(head)
        except OSError:
            pass  # already refused by the server: seen as closed below
        s.setblocking(False)
        return s

    def closed_by_server(s: socket.socket) -> bool:
        try:
            return s.recv(1) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    try:
        socks = [open_one() for _ in range(1100)]
        peak = defaults.fds()
        reopened = 0
        with GoodClient(port):
            t_end = time.monotonic() + 3
            while time.monotonic() < t_end:  # the attack goes on: re-open what the server closes
                for k, s in enumerate(socks):
                    if closed_by_server(s):
                        s.close()
                        socks[k] = open_one()
                        reopened += 1
                for _ in range(5):  # and the honest client's health checks are answered
                    assert healthy(port)
                peak = max(peak, defaults.fds())
    finally:
        for s in socks:
            s.close()
    refused = metrics(port)["http"]["refused_connections_per_address"] - refused0
    print(f"\n[connections] 1100 half-open from one address: server fds {fds0} -> peak {peak}; refused {refused}, re-opened {reopened}")
    assert refused >= 1100 - 896 and peak - fds0 <= 896 + 16, (refused, fds0, peak)
    wait_until(lambda: defaults.fds() <= fds0 + 4, 20, "server fds back to the baseline")


def _health_latencies(port: int, seconds: float) -> list[float]:
    """``GET /health`` round trips (s), one every ~10 ms on a kept-alive connection from 127.0.0.1."""
    conn, out = connect(port, timeout=30), []
    try:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            s, _, _ = call(port, "GET", "/health", conn=conn)
            out.append(time.perf_counter() - t0)
            assert s == 200
            time.sleep(0.01)
    finally:
        conn.close()
    return out


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_bodies_packed_with_values_are_refused_cheaply_and_health_stays_fast(defaults):
    """Three addresses send legal-size (1 MiB) bodies holding 520k-element arrays.  Before:
    each body held the event loop ~0.9 s and /health took up to 2.9 s.  Now the body's shape
    is measured on its bytes (a few ms) and it is refused with 422 ``too_many_values``."""
    port = defaults.port
    body = b'{"id": 1, "action": [' + b",".join([b"0"] * 520_000) + b"]}"
    assert len(body) <= 1 << 20
    replies: list[tuple[int, str]] = []
    stop = threading.Event()

    def send(conn: http.client.HTTPConnection) -> None:
        s, reply, _ = call(port, "POST", "/v1/step", raw=body, conn=conn)
        replies.append((s, reply["error"]["code"] if isinstance(reply, dict) else str(reply)[:80]))

    def attacker(k: int, stop: threading.Event) -> None:
        """A body every 0.5 s: 6 a second from the three, which kept the old server's loop
        blocked all the time, and which leave this shared box's CPU to the server now."""
        conn = connect(port, f"127.0.0.{k + 2}")
        try:
            while True:
                send(conn)
                if stop.wait(0.5):
                    break
        finally:
            conn.close()

    with GoodClient(port):  # an honest client plays episodes throughout
        baseline = _health_latencies(port, 1.5)
        threads = _flood(stop, attacker, 3)
        try:
            during = _health_latencies(port, 3.0)
        finally:
            _join(stop, threads)
        baseline += _health_latencies(port, 1.5)
    p99, p99_alone = _p99(during), _p99(baseline)
    print(f"\n[latency] /health p99: {1000 * p99_alone:.1f} ms without, {1000 * p99:.1f} ms during 3 floods "
          f"({len(replies)} bodies refused, {len(during)} health checks)")
    # The bound is 100 ms at p99.  Allowed on top: twice the same-run p99 without the
    # flood, measured before and after it (on 2 shared cores this test's client threads and
    # other work delay the server, flood or not, and that delay drifts within seconds: under
    # a load average of 12 the p99 without the flood ranged 70-320 ms).  Before the fix a body
    # held the event loop ~0.9 s of CPU: the p99 was 1.4 s or more.
    assert p99 < 0.1 + 2 * p99_alone, (p99_alone, p99)
    assert replies and set(replies) == {(422, "too_many_values")}, set(replies)
    cpu0, conn = metrics(port)["cpu_s"], connect(port, "127.0.0.2")
    for _ in range(5):
        send(conn)
    conn.close()
    per_body = (metrics(port)["cpu_s"] - cpu0) / 5
    print(f"[cpu] server CPU per refused 1 MiB body: {1000 * per_body:.1f} ms")
    assert per_body < 0.05, per_body  # ~10 ms here (half of it receiving the MiB); before: ~900 ms


def test_an_instance_whose_creator_hung_up_before_the_reply_is_reclaimed_at_once(defaults):
    """Before: it lived until idle expiry (900 s by default), counting against the quotas."""
    port = defaults.port
    base = metrics(port)
    for _ in range(20):
        with socket.create_connection((HOST, port), timeout=10, source_address=("127.0.0.2", 0)) as s:
            s.sendall(b"POST /v1/create HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    wait_until(lambda: metrics(port)["created"] >= base["created"] + 20, 20, "20 creates done")
    wait_until(lambda: metrics(port)["instances"] == base["instances"], 5, "every orphaned instance closed")
    assert metrics(port)["reclaimed"] == base["reclaimed"] + 20


def _task_latencies(sim: dict, n: int) -> list[float]:
    from turnscale.envhub.simwork import SimWorkload, step_latency

    w = SimWorkload(**sim)
    return [step_latency(w, idx, 0, 0) for idx in range(n)]


def test_an_address_whose_calls_overrun_is_refused_while_other_addresses_are_served():
    """An attacker on 127.0.0.2 plays the tasks whose steps take 30 s; calls overrun their
    deadline and are abandoned.  Before: after 8 abandoned calls (from anyone) the whole
    server answered 503.  Now one address may have 4 (``max_overrun_calls_per_address``) and
    the server 16.  Every limit is the default except ``call_timeout_s``, 1 s instead of 60 s
    so that calls overrun within the test; the slow tasks are the simulated workload's
    (``options.sim_latency``: a per-task factor spread wide, so a few tasks are slow)."""
    sim = {"median_s": 0.001, "sigma": 0, "max_s": 30, "task_sigma": 4, "steps_median": 0}
    latency = _task_latencies(sim, 4000)
    slow = [i for i, t in enumerate(latency) if t >= 30][:12]
    fast = [i for i, t in enumerate(latency) if t < 0.005][:4]
    assert len(slow) == 12 and len(fast) == 4
    spec = "{" + ",".join(f"{k}:{v}" for k, v in sim.items()) + "}"
    server = Server("babyai", {"limits.call_timeout_s": 1, "options.sim_latency": spec})
    try:
        port = server.port
        ids = []
        for idx in slow:
            i = new_instance_from(port, "127.0.0.2")
            assert call(port, "POST", "/v1/reset", {"id": i, "data_idx": idx}, source="127.0.0.2")[0] == 200
            ids.append(i)
        replies: list[tuple[int, str]] = []

        def slow_step(i: int) -> None:
            s, body, _ = call(port, "POST", "/v1/step", {"id": i, "action": "turn left"}, source="127.0.0.2", timeout=60)
            replies.append((s, body["error"]["code"] if s != 200 else "ok"))

        burst = [threading.Thread(target=slow_step, args=(i,), daemon=True) for i in ids]
        for t in burst:  # all at once: 8 run, 4 queue for a worker thread
            t.start()
        for t in burst:
            t.join(60)
        codes = sorted(replies)
        print(f"\n[overrun] 12 slow steps from one address: {codes}")
        assert {c for _, c in codes} <= {"deadline_exceeded", "overrun_quota"} and (429, "overrun_quota") in codes, codes
        s, body, _ = call(port, "POST", "/v1/create", {}, source="127.0.0.2")  # the attacker stays refused
        assert (s, body["error"]["code"]) == (429, "overrun_quota"), body
        m = metrics(port)
        assert 4 <= m["overrun_calls_running"] < 16 and m["overrun_addresses"] == 1, m
        # the abandoned calls still sleep: another address is served, and the server is healthy
        assert healthy(port)
        for idx in fast:
            i = new_instance(port, idx)
            s, body, _ = call(port, "POST", "/v1/step", {"id": i, "action": "turn left"}, timeout=30)
            assert s == 200, body
            assert call(port, "POST", "/v1/close", {"id": i})[0] == 200
    finally:
        server.close()


def new_instance_from(port: int, source: str) -> int:
    s, body, _ = call(port, "POST", "/v1/create", {}, source=source)
    assert s == 200, body
    return body["id"]
