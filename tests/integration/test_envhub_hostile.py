"""Hostile and buggy clients against real ``turnscale envhub`` processes (issue 21, items 1-8).

Each case is bounded in time and checks that the server stays healthy and keeps serving a
well-behaved client (``GoodClient``, in a thread, with its own quota token) meanwhile.
Memory cases print the server's RSS before/after (run with ``-s`` to see them).
"""

from __future__ import annotations

import http.client
import json
import os
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
         timeout: float = 30.0) -> tuple[int, object, dict]:
    conn = http.client.HTTPConnection(HOST, url_port, timeout=timeout)
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
        conn.close()


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
    "limits.max_instances_per_client": 3,
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
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"id": ' + b"[" * 40 + b"]" * 40 + b"}"):
        s, body, _ = call(babyai.port, "POST", "/v1/step", raw=raw)
        assert s == 422 and body["error"]["code"] == "too_deep", (s, body)
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


def test_per_client_quota_and_instance_limit_answer_429_with_retry_after_counted_once(babyai):
    port = babyai.port
    held: list[int] = []
    try:
        for token in ("a", "b"):
            for _ in range(3):
                s, body, _ = call(port, "POST", "/v1/create", {}, headers={"X-Envhub-Client": token})
                assert s == 200, body
                held.append(body["id"])
            before = metrics(port)["errors"].get("client_quota", 0)
            s, body, hdrs = call(port, "POST", "/v1/create", {}, headers={"X-Envhub-Client": token})
            assert s == 429 and body["error"]["code"] == "client_quota" and int(hdrs["retry-after"]) > 0, (s, body, hdrs)
            assert metrics(port)["errors"]["client_quota"] == before + 1
        for _ in range(2):  # the server-wide limit (8) comes before this client's quota
            s, body, _ = call(port, "POST", "/v1/create", {}, headers={"X-Envhub-Client": "c"})
            assert s == 200, body
            held.append(body["id"])
        before = metrics(port)["errors"].get("too_many_instances", 0)
        s, body, hdrs = call(port, "POST", "/v1/create", {}, headers={"X-Envhub-Client": "c"})
        assert s == 429 and body["error"]["code"] == "too_many_instances" and int(hdrs["retry-after"]) > 0, (s, body, hdrs)
        assert metrics(port)["errors"]["too_many_instances"] == before + 1
    finally:
        for i in held:
            call(port, "POST", "/v1/close", {"id": i})
    assert call(port, "POST", "/v1/create", {}, headers={"X-Envhub-Client": "a"})[0] == 200  # closing freed the quota
    assert metrics(port)["instances"] == 1


def test_half_open_connections_are_closed_and_capped(babyai):
    fds0, rss0 = babyai.fds(), babyai.rss_mb()
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection((HOST, babyai.port), timeout=10)
            s.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
            socks.append(s)
        peak = babyai.fds()
        assert peak - fds0 <= LIMITS["limits.max_connections"] + 8, (fds0, peak)
        for s in socks:  # every one is closed by the server: at once past the cap, else at the header timeout
            assert recv_all(s, 20) == b""
        wait_until(lambda: babyai.fds() <= fds0 + 4, 20, "server fds back to the baseline")
    finally:
        for s in socks:
            s.close()
    print(f"\n[memory] 200 half-open connections: server fds {fds0} -> peak {peak} -> {babyai.fds()}; RSS {rss0:.1f} -> {babyai.rss_mb():.1f} MB")
    with GoodClient(babyai.port):
        pass
    assert metrics(babyai.port)["http"]["header_timeouts"] > 0


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
