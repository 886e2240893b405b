"""The async env client the actors use (trio): HTTP/1.1 over trio streams (``common.http11``,
a small pure codec) and a bounded keep-alive connection pool per client.

Retry rule: only connection errors are retried (capped exponential backoff with jitter), and
only when the request cannot have been applied: a failure to connect, or a pooled connection
found closed before anything was sent.  Once a non-idempotent request (``create``, ``step``)
has been written, a dropped connection raises ``EnvConnectionLost`` and is never re-sent;
idempotent ones (``reset``, ``observation``, ``close``, ``health``) are re-sent.  A timeout
raises ``EnvTimeout`` and is not retried.  HTTP errors raise ``EnvHTTPError`` (404:
``EnvNotFound``), also for AgentGym's HTTP-200 ``{"error": "..."}`` bodies.

Batched steps (``batch_steps=True``, flavor ``turnscale`` only): concurrent ``step`` calls of
the tasks sharing this client are coalesced into ``POST /v1/step_batch`` requests (at most
``max_batch`` steps, at most ``MAX_BATCH_SENDERS`` batches in flight, no timer: a step
that finds a sender slot free waits one trio checkpoint for the others, then goes), so
under load one round trip and one server thread hop carry many steps; alone, a step costs
one checkpoint more than ``/v1/step``.  Each step still gets its own reply or its own
``EnvHTTPError``; a batch lost after it was sent raises ``EnvConnectionLost`` in every step
it carried (never re-sent), as a lost single step does.  The server runs a batch's steps one
after another in one thread under one deadline, so batch only fast, CPU-bound envs (BabyAI,
TextCraft): envs whose steps wait on something else (SciWorld's JVMs) run faster one
request per step, in parallel threads.

``expert_action(env_id)`` asks an envhub server for the env's expert move (``GET /expert``;
BabyAI's oracle), for warm starts.

Flavors (what the server speaks):
- ``turnscale``: our envhub servers' own face, under ``/v1`` (real status codes; the root
  speaks AgentGym's shapes and error convention for AgentGym's clients, see ``envhub.server``).
- ``agentgym``: AgentGym's BabyAI / TextCraft / SciWorld servers (``id``-keyed).  Reward is
  read from ``score`` when present (AgentGym's clients do the same); ``success`` is
  ``info.success`` if present, else ``done and reward > 0`` (for a 0-100 ``score`` above 1:
  ``score >= 100``).  TextCraft's create already resets; ``reset`` resets again (harmless).
  A reset reply with ``task_description`` (SciWorld) becomes ``description + "\n" +
  observation``, the first observation AgentGym's ``SciworldEnvClient`` shows.
- ``agentgym_searchqa``: ``env_idx``-keyed; create answers a bare int, reset a bare string,
  and reset sends the task index as ``id``.
- ``agentgym_webarena``: ``env_idx``-keyed; reset sends ``idx``; step answers ``terminated``.
"""

from __future__ import annotations

import json
import random
import select
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import trio

from turnscale.common.http11 import HTTPProtocolError, ResponseParser, build_request
from turnscale.protocol.errors import TurnscaleError

FLAVORS = ("turnscale", "agentgym", "agentgym_searchqa", "agentgym_webarena")
MAX_RESPONSE_BYTES = 64 << 20
MAX_BATCH_SENDERS = 1
"""Step batches in flight at once per client: with one, every step that arrives while a batch is
out rides in the next (measured: 2 in flight made smaller batches and cost ~20 % more CPU per step)."""
IDLE_CONN_MAX_S = 4.0
"""Pooled connections idle longer than this are dropped (uvicorn's default keep-alive is 5 s)."""


class EnvClientError(TurnscaleError):
    """Base of every env client error."""


class EnvUnavailable(EnvClientError):
    """Could not reach the env server after the retries; is it running at that URL?"""


class EnvConnectionLost(EnvUnavailable):
    """The connection dropped after a non-idempotent request was sent: it may or may not
    have been applied, so it is not re-sent.  End the episode as an env error."""


class EnvTimeout(EnvClientError):
    """No reply within ``timeout_s``."""


class EnvHTTPError(EnvClientError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class EnvNotFound(EnvHTTPError):
    """404: the instance id is unknown, closed or expired (create a new one)."""


class EnvBusyError(EnvHTTPError):
    """503 ``busy``: the server could not run the call now (e.g. every SciWorld JVM in use);
    the call was not applied and the instance is still usable."""


@dataclass(frozen=True)
class ResetReply:
    observation: str
    info: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepReply:
    observation: str
    reward: float
    done: bool
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Always has ``success`` (bool)."""
    raw: dict[str, Any] = field(default_factory=dict)


class _NotSent(Exception):
    """The connection failed before any byte of the request was written (safe to retry)."""


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.idle_since = time.monotonic()

    def looks_alive(self) -> bool:
        """An idle keep-alive connection is readable only if the server closed it (EOF) or
        sent something unsolicited: either way it must not be reused."""
        if time.monotonic() - self.idle_since > IDLE_CONN_MAX_S:
            return False
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return not poller.poll(0)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class EnvClient:
    """One env server's client; safe to share among many trio tasks of one trio run.

    ``max_connections`` bounds concurrent requests (each holds one connection).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 30.0, max_retries: int = 5, max_backoff_s: float = 5.0, max_connections: int = 64, flavor: str = "turnscale",
                 batch_steps: bool = False, max_batch: int = 64) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor {flavor!r}: choose one of {FLAVORS}")
        if batch_steps and flavor != "turnscale":
            raise ValueError(f"batch_steps needs an envhub server (flavor 'turnscale'); {flavor!r} servers have no /v1/step_batch")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"env url {base_url!r}: expected http://host:port")
        self.base_url = base_url.rstrip("/")
        self.host = url.hostname
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/") + ("/v1" if flavor == "turnscale" else "")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_backoff_s = max_backoff_s
        self.flavor = flavor
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Conn] = []
        self._closed = False
        self._batcher = _StepBatcher(self, max_batch) if batch_steps else None

    # -- public API -----------------------------------------------------------------
    async def create(self) -> int:
        body = {"id": 0} if self.flavor != "turnscale" else {}
        raw = await self._call("POST", "/create", body, idempotent=False)
        if isinstance(raw, bool) or not isinstance(raw, (int, dict)):
            raise EnvHTTPError(200, "bad_reply", f"/create answered {str(raw)[:200]!r}; expected an id")
        if isinstance(raw, int):
            return raw
        for key in ("id", "env_idx"):
            if isinstance(raw.get(key), int):
                return int(raw[key])
        raise EnvHTTPError(200, "bad_reply", f"/create answered {str(raw)[:200]!r}; expected an id")

    async def reset(self, env_id: int, data_idx: int) -> ResetReply:
        if self.flavor == "agentgym_searchqa":
            body: dict[str, Any] = {"env_idx": env_id, "id": data_idx}
        elif self.flavor == "agentgym_webarena":
            body = {"env_idx": env_id, "seed": 0, "idx": data_idx}
        else:
            body = {"id": env_id, "data_idx": data_idx}
        raw = await self._call("POST", "/reset", body, idempotent=True)
        if isinstance(raw, str):
            return ResetReply(raw, {}, {"observation": raw})
        if not isinstance(raw, dict) or not isinstance(raw.get("observation"), str):
            raise EnvHTTPError(200, "bad_reply", f"/reset answered without an observation: {str(raw)[:200]!r}")
        obs = raw["observation"]
        if self.flavor == "agentgym" and isinstance(raw.get("task_description"), str):
            obs = f"{raw['task_description']}\n{obs}"  # AgentGym's SciWorld client does the same
        return ResetReply(obs, dict(raw.get("info") or {}) if isinstance(raw.get("info"), dict) else {}, raw)

    async def step(self, env_id: int, action: str) -> StepReply:
        if self._batcher is not None:
            return await self._batcher.step(int(env_id), action)
        key = "env_idx" if self.flavor in ("agentgym_searchqa", "agentgym_webarena") else "id"
        raw = await self._call("POST", "/step", {key: env_id, "action": action}, idempotent=False)
        if not isinstance(raw, dict) or not isinstance(raw.get("observation"), str):
            raise EnvHTTPError(200, "bad_reply", f"/step answered without an observation: {str(raw)[:200]!r}")
        return self._step_reply(raw)

    async def step_batch(self, steps: list[tuple[int, str]]) -> list[StepReply | EnvHTTPError]:
        """``POST /v1/step_batch``: one reply or one ``EnvHTTPError`` per ``(id, action)``, in
        order (distinct ids; envhub servers only).  Errors of the request as a whole raise."""
        if self.flavor != "turnscale":
            raise EnvClientError(f"step_batch needs an envhub server (flavor 'turnscale'), not {self.flavor!r}")
        raw = await self._call("POST", "/step_batch", {"steps": [{"id": int(i), "action": a} for i, a in steps]}, idempotent=False)
        results = raw.get("results") if isinstance(raw, dict) else None
        if not isinstance(results, list) or len(results) != len(steps):
            raise EnvHTTPError(200, "bad_reply", f"/step_batch answered {str(raw)[:200]!r}; expected {len(steps)} results")
        out: list[StepReply | EnvHTTPError] = []
        for r in results:
            err = r.get("error") if isinstance(r, dict) else None
            if isinstance(err, dict):
                status = int(err.get("status", 500)) if isinstance(err.get("status"), int) else 500
                cls = {404: EnvNotFound, 503: EnvBusyError}.get(status, EnvHTTPError)
                out.append(cls(status, str(err.get("code", "error")), str(err.get("message", ""))))
            elif isinstance(r, dict) and isinstance(r.get("observation"), str):
                out.append(self._step_reply(r))
            else:
                out.append(EnvHTTPError(200, "bad_reply", f"/step_batch item without an observation: {str(r)[:200]!r}"))
        return out

    async def observation(self, env_id: int) -> str:
        key = "env_idx" if self.flavor in ("agentgym_searchqa", "agentgym_webarena") else "id"
        raw = await self._call("GET", f"/observation?{key}={int(env_id)}", None, idempotent=True)
        if isinstance(raw, dict) and isinstance(raw.get("observation"), str):
            return raw["observation"]
        if not isinstance(raw, str):
            raise EnvHTTPError(200, "bad_reply", f"/observation answered {str(raw)[:200]!r}")
        return raw

    async def expert_action(self, env_id: int) -> str:
        """The env's expert next action (envhub servers whose env has one; else EnvHTTPError 501)."""
        raw = await self._call("GET", f"/expert?id={int(env_id)}", None, idempotent=False)
        if not isinstance(raw, dict) or not isinstance(raw.get("action"), str):
            raise EnvHTTPError(200, "bad_reply", f"/expert answered {str(raw)[:200]!r}")
        return raw["action"]

    async def close(self, env_id: int) -> None:
        key = "env_idx" if self.flavor in ("agentgym_searchqa", "agentgym_webarena") else "id"
        await self._call("POST", "/close", {key: env_id}, idempotent=True)

    async def health(self) -> bool:
        """True when the server answers ``/health`` (or AgentGym's ``/``) with 200."""
        path = "/health" if self.flavor == "turnscale" else "/"
        try:
            await self._call("GET", path, None, idempotent=True, retries=0)
        except EnvClientError:
            return False
        return True

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -- replies --------------------------------------------------------------------
    def _step_reply(self, raw: dict[str, Any]) -> StepReply:
        info = dict(raw.get("info") or {}) if isinstance(raw.get("info"), dict) else {}
        done = bool(raw.get("done", raw.get("terminated", False)))
        truncated = bool(raw.get("truncated", False))
        if self.flavor == "turnscale":
            reward = float(raw.get("reward", 0.0))
            success = bool(info.get("success", False))
        else:
            score = raw.get("score")
            reward = float(score if isinstance(score, (int, float)) else raw.get("reward", 0.0))
            if "success" in info:
                success = bool(info["success"])
            elif isinstance(score, (int, float)) and score > 1:
                success = bool(score >= 100)
            else:
                success = bool(done and reward > 0)
        info["success"] = success
        return StepReply(raw["observation"], reward, done or truncated, truncated, info, raw)

    # -- transport ------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: Any, *, idempotent: bool, retries: int | None = None) -> Any:
        if self._closed:
            raise EnvClientError("this EnvClient is closed")
        payload = b"" if body is None else json.dumps(body).encode()
        retries = self.max_retries if retries is None else retries
        attempt = 0
        while True:
            try:
                status, data = await self._once(method, self.prefix + path, payload, idempotent)
                break
            except _NotSent as exc:
                if attempt >= retries:
                    raise EnvUnavailable(f"env server {self.base_url} unreachable after {attempt + 1} attempts ({exc}); is it running?") from None
            attempt += 1
            await trio.sleep(min(self.max_backoff_s, 0.05 * 2**attempt) * (0.5 + random.random() / 2))
        return _decode(status, data, path)

    async def _once(self, method: str, path: str, payload: bytes, idempotent: bool) -> tuple[int, bytes]:
        async with self._slots:
            try:
                with trio.fail_after(self.timeout_s):
                    conn = await self._checkout()
                    try:
                        status, data, reusable = await self._exchange(conn, method, path, payload, idempotent)
                    except BaseException:
                        await conn.aclose()
                        raise
                    if reusable and not self._closed:
                        conn.idle_since = time.monotonic()
                        self._idle.append(conn)
                    else:
                        await conn.aclose()
                    return status, data
            except trio.TooSlowError:
                raise EnvTimeout(f"{method} {path} on {self.base_url}: no reply within {self.timeout_s:g} s") from None

    async def _checkout(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if conn.looks_alive():
                return conn
            await conn.aclose()
        try:
            stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise _NotSent(f"connect: {exc.strerror or exc}") from None
        try:
            import socket as _socket

            stream.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, True)
        except OSError:
            pass
        return _Conn(stream)

    async def _exchange(self, conn: _Conn, method: str, path: str, payload: bytes, idempotent: bool) -> tuple[int, bytes, bool]:
        request = build_request(method, path, f"{self.host}:{self.port}", payload if method == "POST" else None)
        parser = ResponseParser(max_body=MAX_RESPONSE_BYTES)
        sent = False
        try:
            await conn.stream.send_all(request)
            sent = True
            while parser.result is None:
                data = await conn.stream.receive_some(65536)
                if data:
                    parser.feed(data)
                else:
                    parser.feed_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, HTTPProtocolError) as exc:
            if not sent or idempotent:
                raise _NotSent(f"{type(exc).__name__}: {exc}") from None
            raise EnvConnectionLost(f"{method} {path} on {self.base_url}: connection lost after the request was sent ({exc}); it may have been applied, so it is not re-sent") from None
        reply = parser.result
        return reply.status, reply.body, reply.keep_alive and not parser.leftover


class _Pending:
    """One step waiting in a ``_StepBatcher``: its reply or error once its batch returns."""

    __slots__ = ("env_id", "action", "result", "done", "wake")

    def __init__(self, env_id: int, action: str) -> None:
        self.env_id, self.action = env_id, action
        self.result: Any = None
        self.done = False
        self.wake = trio.Event()
        """Set when this step's batch ended, or when it is first in the queue and a sender slot freed."""


class _StepBatcher:
    """Coalesces concurrent ``EnvClient.step`` calls into ``/v1/step_batch`` (module docstring).

    Invariants: a step is in exactly one of the queue, one in-flight batch, or done; a task
    sends a batch only while it holds one of ``MAX_BATCH_SENDERS`` sender slots; every batch
    that ends (reply, error or cancellation) marks all its steps done and wakes them, and
    wakes the first queued step to send the next batch, so no step waits on a batch that will
    never return (only those tasks wake: a task switch per step, not per waiter per batch); a
    batch carries each id at most once (a second step on the same id waits for the next batch).
    """

    def __init__(self, client: EnvClient, max_batch: int) -> None:
        self.client, self.max_batch = client, max_batch
        self.queue: list[_Pending] = []
        self.senders = 0

    async def step(self, env_id: int, action: str) -> StepReply:
        me = _Pending(env_id, action)
        self.queue.append(me)
        try:
            while not me.done:
                if self.senders < MAX_BATCH_SENDERS:
                    await self._send_one()
                else:
                    me.wake = trio.Event()
                    await me.wake.wait()
        except BaseException:
            if not me.done and me in self.queue:
                self.queue.remove(me)  # never sent: nothing was applied
            raise
        if isinstance(me.result, BaseException):
            raise me.result
        return me.result

    async def _send_one(self) -> None:
        self.senders += 1
        batch: list[_Pending] = []
        try:
            await trio.lowlevel.checkpoint()  # let the other ready tasks queue their steps
            seen: set[int] = set()
            for p in list(self.queue):
                if len(batch) >= self.max_batch:
                    break
                if p.env_id not in seen:
                    seen.add(p.env_id)
                    batch.append(p)
                    self.queue.remove(p)
            if batch:
                replies = await self.client.step_batch([(p.env_id, p.action) for p in batch])
                for p, r in zip(batch, replies):
                    p.result = r
        except Exception as exc:  # the request as a whole failed: every step it carried gets the error
            for p in batch:
                if p.result is None:
                    p.result = exc
        except BaseException:  # cancelled (the sender's own step gave up): the others learn it was lost
            for p in batch:
                if p.result is None:
                    p.result = EnvConnectionLost("a step batch was cancelled after it may have been sent; its steps may have been applied")
            raise
        finally:
            for p in batch:
                p.done = True
                p.wake.set()
            self.senders -= 1
            if self.queue:
                self.queue[0].wake.set()


def _decode(status: int, data: bytes, path: str) -> Any:
    try:
        body = json.loads(data) if data else None
    except ValueError:
        body = None
        if status < 400:
            raise EnvHTTPError(status, "bad_reply", f"{path}: reply is not JSON: {data[:200]!r}") from None
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            code, message = str(err.get("code", "error")), str(err.get("message", ""))
        elif isinstance(body, dict) and "detail" in body:  # FastAPI's own shape (AgentGym)
            code, message = "http_error", str(body["detail"])[:500]
        else:
            code, message = "http_error", data[:500].decode("utf-8", "replace")
        cls = {404: EnvNotFound, 503: EnvBusyError}.get(status, EnvHTTPError)
        raise cls(status, code, message)
    if isinstance(body, dict) and "error" in body and len(body) <= 2 and "observation" not in body and status < 400:
        err = body["error"]  # AgentGym: HTTP 200 with {"error": "..."}
        if isinstance(err, dict):
            raise EnvHTTPError(status, str(err.get("code", "error")), str(err.get("message", "")))
        code = body.get("error_code")  # envhub's AgentGym face names the code beside it
        code = str(code) if isinstance(code, str) else "agentgym_error"
        cls = {"not_found": EnvNotFound, "busy": EnvBusyError}.get(code, EnvHTTPError)
        raise cls(status, code, str(err)[:500])
    return body
