"""The HTTP server of one env family: AgentGym's wire API over ``envhub.base.Env``.

Two faces of the same routes (JSON in, JSON out):

- **AgentGym's routes** at the root (``/create``, ``/reset``, ...): the shapes AgentGym's own
  ``agentenv`` clients read, per family (``family.agentgym``, an ``AgentGymShape``), and
  AgentGym's error convention: an error about the env or the instance (unknown / closed /
  expired id, step before reset or after the end, broken instance, busy, instance limit, the
  env failing) is **HTTP 200 with** ``{"error": "<message>", "error_code": "<code>"}`` —
  their clients assert ``status_code == 200`` and then fail reading the missing field, so a
  4xx would turn into an ``AssertionError`` instead.  ``POST /close`` of an unknown id answers
  ``false`` (as theirs).  Malformed requests keep their status (422 / 413, like FastAPI's
  validation errors), as do unknown routes (404) and wrong methods (405).
- **Our API** under ``/v1`` (``/v1/create``, ``/v1/reset``, ...): the same operations with
  real status codes and ``{"error": {"code", "message"}}`` bodies, a uniform ``/v1/create`` ->
  ``{"id", "env_idx"}`` (no implicit reset) and ``/v1/reset`` -> a dict in every family.
  ``common.envclient.EnvClient`` (flavor ``turnscale``) speaks this one.

``render_error`` is the one place an ``ApiError`` becomes a response (per face).

Routes (both faces unless noted):

- ``POST /create`` -> ``{"id": int, "env_idx": int}``.  AgentGym face per family: TextCraft
  resets the new instance to ``data_idx = id`` (or to the custom task of a ``{"commands",
  "goal"}`` body) and answers ``{"id", "observation", "done", "reward"}``; SearchQA loads task
  ``body.id`` (default 0) and answers the bare int id.  An instance whose creator hung up
  before the reply, or whose create failed after the instance existed, is closed at once
  (``InstanceTable.reclaim``): nobody holds its id.
- ``POST /reset {"id" | "env_idx", "data_idx" | "idx"}`` -> ``{"id", "observation", "done":
  false, "reward": 0, "truncated": false, "info", ...extra}``.  AgentGym's SearchQA client
  sends ``{"env_idx", "id"}`` where ``id`` is the task index: when ``env_idx`` is present it
  names the instance and ``data_idx``/``idx``/``id`` the task.  AgentGym face: SearchQA
  answers the prompt string; ``observation`` is ``extra["observation"]`` where the env sets one
  (SciWorld: the room alone, since AgentGym's client prepends ``task_description`` itself).
- ``POST /step {"id" | "env_idx", "action"}`` -> ``{"observation", "reward", "done",
  "truncated", "info", ...extra}`` (``extra`` holds AgentGym fields such as ``score``)
- ``POST /v1/step_batch {"steps": [{"id", "action"}, ...]}`` (our face only; AgentGym's
  routes are untouched) -> ``{"results": [...]}``, one per step in order: the ``/step`` reply,
  or ``{"error": {"code", "message", "status"}}`` with the status that step alone would have
  got.  At most ``MAX_BATCH_STEPS`` steps on distinct instances, run in one worker call
  (``InstanceTable.step_many``); a malformed batch (not a list, a bad item, a repeated id) is
  a 422 naming the item, and then no step runs.  ``EnvClient(batch_steps=True)`` coalesces
  concurrent ``step`` calls into it.
- ``GET /observation?id=`` -> the observation as a JSON string (AgentGym's shape); AgentGym
  face of BabyAI: ``{"observation", "reward", "score", "done", "deleted"}``.
- AgentGym's per-env extra routes (AgentGym face; 404 ``no_route`` for families without them):
  BabyAI ``POST /render {id}``; TextCraft ``GET /commands``, ``/goal``, ``/detail``;
  SciWorld ``GET /goals``, ``/detail``, ``/task_description``, ``/object_tree``, ``/state``.
- ``GET /action_hint?id=`` -> AgentGym's ``{"possible_actions", "possible_objects"}`` (SciWorld;
  501 for envs without hints).
- ``GET /expert?id=`` -> ``{"action": str}``: the env's expert next action (envs that have
  one, e.g. BabyAI's oracle; others answer 501)
- ``POST /close {"id" | "env_idx"}`` -> ``true`` (idempotent for every id this server issued)
- ``GET /health`` and ``GET /`` -> ``{"status": "ok", "env", "instances"}`` (200 once ready)
- ``GET /metrics`` -> counters, errors by code, latency percentiles per operation

With ``env.exit_after_idle_s`` set, the server ends by itself once no env request (any route
above but ``/health``, ``/`` and ``/metrics``) has arrived for that long: ``IdleExit``.

Errors on ``/v1`` are real status codes with ``{"error": {"code", "message"}}``: 404 unknown /
closed / expired id or route, 405 wrong method, 413 body too large, 422 malformed body (too
deep, too many values, not JSON, lone surrogates) or missing field, 409 step before reset or
after the episode ended, 410 instance broken by an earlier internal error, 429 with
``Retry-After`` for an instance limit (``too_many_instances`` server-wide, ``client_quota``
the address's) or an address whose overrunning calls reached its cap (``overrun_quota``),
408 body too slow, 410 also for an instance closed after a call overran its deadline,
501 no expert for this env, 503 busy (``EnvBusy``: a shared resource such as the SciWorld JVM
pool is exhausted; ``Retry-After`` is set and the instance stays usable;
``workers_exhausted``: too many env calls overran their deadline), 504 an env call overran
``env.limits.call_timeout_s`` (instance closed), 500 internal failure (instance marked
broken).  No stack trace is ever sent; the server logs it.  On AgentGym's face the same
errors about an instance or the env are HTTP 200 with ``{"error", "error_code"}``; errors
about the request itself (408, 413, 422, 405, 404 route) keep their status.

Limits (``env.limits``, docs/security.md): bodies are size- and time-bounded
while they are read and must be shallow, small (``max_json_values``), valid-Unicode JSON,
measured before they are decoded (``envhub.bodies``); every env call has a deadline
(``envhub.workers``).  Quotas are per peer IP address (``client_key``; the optional
``X-Envhub-Client`` header token only labels instances, it never adds quota): instances
(``max_instances_per_address``), connections (``max_connections_per_address``, in the HTTP
protocol, ``envhub.httpserver``, with the header and keep-alive bounds) and env calls that
overran their deadline (``max_overrun_calls_per_address``), so one address flooding leaves
the others served.  A client that disconnects mid-request is logged once, briefly, at a
bounded rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from turnscale.envhub.base import AgentGymShape, EnvFamily
from turnscale.envhub.bodies import encode_json, parse_json_object, read_body
from turnscale.envhub.httpserver import STATS, RateLimitedLog
from turnscale.envhub.instances import CALLER, ApiError, InstanceTable

log = logging.getLogger("envhub")

MAX_ACTION_CHARS = 64 * 1024
MAX_BATCH_STEPS = 256
"""Steps per ``/v1/step_batch`` request."""
CLIENT_HEADER = "x-envhub-client"
"""Optional header: a token naming the client (e.g. one per actor process) for quotas."""
MAX_CLIENT_TOKEN = 64


def _json(data: Any, status: int = 200) -> Response:
    return Response(encode_json(data), status_code=status, media_type="application/json")


def error_response(status: int, code: str, message: str) -> Response:
    return _json({"error": {"code": code, "message": message}}, status)


# -- request parsing (pure) --------------------------------------------------------------
async def _body(request: Request, *, required: bool = True) -> dict[str, Any]:
    limits = _table(request).limits
    return parse_json_object(await read_body(request, limits), limits, required=required)


def client_key(request: Request) -> tuple[str, str]:
    """``(address, token)``: who a request comes from, for quotas.  The quota is the peer IP
    address's; the ``X-Envhub-Client`` token (when sent) only labels the instances it creates
    (metrics, messages), so rotating tokens gains nothing.  Not an authentication: an
    instance id is the capability that lets a client drive an instance."""
    host = request.client.host if request.client else "?"
    token = request.headers.get(CLIENT_HEADER, "")
    if len(token) > MAX_CLIENT_TOKEN or not token.isprintable():
        raise ApiError(422, "invalid_header", f"header X-Envhub-Client must be at most {MAX_CLIENT_TOKEN} printable characters")
    return host, token


def _int_field(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value) < 19:
            value = int(value)
        else:
            raise ApiError(422, "invalid_field", f"field {key!r} must be an integer, got {type(value).__name__}")
    if value < 0 or value >= 2**53:
        raise ApiError(422, "invalid_field", f"field {key!r} must be in [0, 2**53), got {value}")
    return value


def instance_id(data: dict[str, Any]) -> int:
    """The instance named by ``env_idx`` (AgentGym SearchQA/WebArena) or ``id``."""
    for key in ("env_idx", "id"):
        if key in data:
            return _int_field(data, key)
    raise ApiError(422, "missing_field", "missing field 'id' (the env instance id from POST /create)")


def task_index(data: dict[str, Any]) -> int:
    keys = ("data_idx", "idx", "id") if "env_idx" in data else ("data_idx", "idx")
    for key in keys:
        if key in data:
            return _int_field(data, key)
    raise ApiError(422, "missing_field", "missing field 'data_idx' (which task to reset to)")


def action_text(data: dict[str, Any]) -> str:
    if "action" not in data:
        raise ApiError(422, "missing_field", "missing field 'action' (the action text)")
    action = data["action"]
    if not isinstance(action, str):
        raise ApiError(422, "invalid_field", f"field 'action' must be a string, got {type(action).__name__}")
    if len(action) > MAX_ACTION_CHARS:
        raise ApiError(422, "invalid_field", f"field 'action' has {len(action)} characters; the limit is {MAX_ACTION_CHARS}")
    return action


# -- routes ------------------------------------------------------------------------------
V1 = "/v1"
"""Prefix of our own face (real status codes); the root is AgentGym's."""


def _table(request: Request) -> InstanceTable:
    return request.app.state.table


def _is_v1(request: Request) -> bool:
    return request.url.path.startswith(V1 + "/")


def _shape(request: Request) -> AgentGymShape:
    return getattr(_table(request).family, "agentgym", None) or AgentGymShape()


def _query_id(request: Request) -> int:
    query = dict(request.query_params)
    if "id" not in query and "env_idx" not in query:
        raise ApiError(422, "missing_field", "missing query parameter 'id'")
    return instance_id(query)


async def create(request: Request) -> Response:
    """Create (and on some AgentGym faces reset) an instance; if the client hung up meanwhile,
    nobody will ever learn its id: it is reclaimed at once, not left to idle expiry."""
    data = await _body(request, required=False)
    table = _table(request)
    env_id = await table.create(*client_key(request))
    try:
        reply = await _created(request, table, env_id, data)
    except BaseException:
        await table.reclaim(env_id)  # the id never reaches the client
        raise
    if await request.is_disconnected():
        await table.reclaim(env_id)
    return reply


async def _created(request: Request, table: InstanceTable, env_id: int, data: dict[str, Any]) -> Response:
    """The reply to a create, per face (module docstring)."""
    if _is_v1(request):
        return _json({"id": env_id, "env_idx": env_id})
    shape = _shape(request)
    if shape.create == "reset":  # TextCraft: the new instance is already playing task `id`
        out = await table.reset(env_id, env_id)
        if data.get("commands") is not None and data.get("goal") is not None:
            obs = await table.call(env_id, "agentgym_custom_task", data["commands"], data["goal"])
        else:
            obs = out.observation
        return _json({"id": env_id, "env_idx": env_id, "observation": obs, "done": False, "reward": 0})
    if shape.create == "bare_id":  # SearchQA: the instance holds task `body.id` from the start
        await table.reset(env_id, task_index({"env_idx": env_id, "id": data.get("id", 0)}))
        return _json(env_id)
    return _json({"id": env_id, "env_idx": env_id})


async def reset(request: Request) -> Response:
    data = await _body(request)
    env_id, data_idx = instance_id(data), task_index(data)
    out = await _table(request).reset(env_id, data_idx)
    extra = dict(out.extra)
    agentgym_obs = extra.pop("observation", out.observation)  # AgentGym's own reset text, if it differs
    if _is_v1(request):
        return _json({**extra, "id": env_id, "observation": out.observation, "done": False, "reward": 0.0, "truncated": False, "info": out.info})
    if _shape(request).reset == "text":
        return _json(agentgym_obs)
    return _json({**extra, "id": env_id, "observation": agentgym_obs, "done": False, "reward": 0.0, "truncated": False, "info": out.info})


def _step_payload(out: Any) -> dict[str, Any]:
    info = {**out.info, "success": bool(out.info.get("success", False))}
    return {**out.extra, "observation": out.observation, "reward": float(out.reward), "done": bool(out.done), "truncated": bool(out.truncated), "info": info}


async def step(request: Request) -> Response:
    data = await _body(request)
    env_id, action = instance_id(data), action_text(data)
    return _json(_step_payload(await _table(request).step(env_id, action)))


def batch_items(data: dict[str, Any]) -> list[tuple[int, str]]:
    """``(id, action)`` pairs of a step batch body; 422 naming the first bad item."""
    steps = data.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ApiError(422, "invalid_field", "field 'steps' must be a non-empty list of {\"id\", \"action\"} objects")
    if len(steps) > MAX_BATCH_STEPS:
        raise ApiError(422, "invalid_field", f"field 'steps' has {len(steps)} items; the limit is {MAX_BATCH_STEPS} per request")
    items = []
    for k, item in enumerate(steps):
        try:
            if not isinstance(item, dict):
                raise ApiError(422, "invalid_field", f"must be an object, got {type(item).__name__}")
            if "id" not in item:
                raise ApiError(422, "missing_field", "missing field 'id' (the env instance id from POST /create)")
            items.append((_int_field(item, "id"), action_text(item)))
        except ApiError as exc:
            raise ApiError(exc.status, exc.code, f"steps[{k}]: {exc.message}") from None
    return items


async def step_batch(request: Request) -> Response:
    items = batch_items(await _body(request))
    table = _table(request)
    results = await table.step_many(items)
    for r in results:
        if isinstance(r, ApiError):
            table.errors[r.code] += 1  # as the error handler counts a single step's
    return _json({"results": [
        {"error": {"code": r.code, "message": r.message, "status": r.status}} if isinstance(r, ApiError) else _step_payload(r)
        for r in results
    ]})


async def observation(request: Request) -> Response:
    env_id = _query_id(request)
    if not _is_v1(request) and _shape(request).observation == "dict":
        return _json(await _table(request).call(env_id, "agentgym_observation"))
    return _json(await _table(request).observation(env_id))


async def expert(request: Request) -> Response:
    return _json({"action": await _table(request).expert(_query_id(request))})


async def action_hint(request: Request) -> Response:
    return _json(await _table(request).action_hint(_query_id(request)))


async def agentgym_extra(request: Request) -> Response:
    """One of AgentGym's per-env extra routes (``GET /<name>?id=`` or ``POST /<name> {id}``)."""
    name = request.url.path.rsplit("/", 1)[-1]
    if name not in _shape(request).extra_routes:
        raise ApiError(404, "no_route", f"{request.method} {request.url.path}: the {_table(request).family.name} server has no such route")
    env_id = instance_id(await _body(request)) if request.method == "POST" else _query_id(request)
    return _json(await _table(request).call(env_id, "agentgym_" + name))


async def close(request: Request) -> Response:
    data = await _body(request)
    env_id = instance_id(data)
    try:
        await _table(request).close(env_id)
    except ApiError as exc:
        if exc.code == "not_found" and not _is_v1(request):
            return _json(False)  # AgentGym: closing an unknown id answers false
        raise
    return _json(True)


async def health(request: Request) -> Response:
    table = _table(request)
    problem = table.health()
    if problem:
        return _json({"status": "unhealthy", "reason": problem, "env": table.family.name, "instances": len(table.instances)}, 503)
    return _json({"status": "ok", "env": table.family.name, "instances": len(table.instances)})


async def metrics(request: Request) -> Response:
    return _json({**_table(request).metrics(), "http": dict(STATS)})


# -- errors ------------------------------------------------------------------------------
_REQUEST_ERRORS = frozenset({405, 408, 413, 422})
"""Statuses about the request itself: kept on AgentGym's face too (FastAPI answers 422 for a
body its models reject)."""


def render_error(request: Request, status: int, code: str, message: str, retry_after_s: int | None = None, *,
                 close: bool = False) -> Response:
    """The one place an error becomes a response.  ``/v1``: the status and ``{"error": {"code",
    "message"}}``.  AgentGym's face: errors about the env or the instance are HTTP 200 with
    ``{"error": message, "error_code": code}`` (AgentGym's convention); request errors (405, 413,
    422) and unknown routes keep their status."""
    request.app.state.table.errors[code] += 1
    if not _is_v1(request) and status not in _REQUEST_ERRORS and code not in ("no_route", "internal"):
        resp = _json({"error": message, "error_code": code})
    else:
        resp = error_response(status, code, message)
    if retry_after_s is not None:
        resp.headers["Retry-After"] = str(retry_after_s)
    if close:  # e.g. a refused body whose rest is not read
        resp.headers["Connection"] = "close"
    return resp


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return render_error(request, exc.status, exc.code, exc.message, exc.retry_after_s, close=exc.close_connection)


_gone_log = RateLimitedLog(log, per_s=1.0, burst=5)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client disconnected mid-request: not a server error.  One short line, rate-limited."""
    request.app.state.table.counters["client_disconnects"] += 1
    _gone_log.info("client %s disconnected during %s %s", request.client.host if request.client else "?", request.method, request.url.path)
    return Response(status_code=400)  # never delivered


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "no_route", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return render_error(request, exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}")


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return render_error(request, 500, "internal", f"internal server error ({type(exc).__name__}); see the server log")


_OPS: tuple[tuple[str, Any, list[str]], ...] = (
    ("/create", create, ["POST"]),
    ("/reset", reset, ["POST"]),
    ("/step", step, ["POST"]),
    ("/observation", observation, ["GET"]),
    ("/close", close, ["POST"]),
    ("/expert", expert, ["GET"]),
    ("/action_hint", action_hint, ["GET"]),
    ("/health", health, ["GET"]),
    ("/metrics", metrics, ["GET"]),
)
AGENTGYM_EXTRA: tuple[tuple[str, list[str]], ...] = (
    ("/render", ["POST"]),
    ("/commands", ["GET"]),
    ("/goal", ["GET"]),
    ("/detail", ["GET"]),
    ("/goals", ["GET"]),
    ("/task_description", ["GET"]),
    ("/object_tree", ["GET"]),
    ("/state", ["GET"]),
)
"""AgentGym's per-env extra routes (root face only); a family serves those in its
``agentgym.extra_routes``."""
_PATHS = frozenset([p for p, _, _ in _OPS] + [V1 + p for p, _, _ in _OPS] + [p for p, _ in AGENTGYM_EXTRA] + ["/", V1 + "/step_batch"])


_NOT_ENV_REQUESTS = frozenset(["/", "/health", "/metrics", V1 + "/health", V1 + "/metrics"])
"""Routes that do not count as a client's use for ``IdleExit`` (probes, supervisors)."""


class IdleExit:
    """Ends a server that no client calls any more (``env.exit_after_idle_s``): a run whose
    learner died leaves no actors to call it, and nothing else tells the envhub.

    ``begin``/``end`` bracket every env request (``_Timing``: a route of ``_PATHS`` outside
    ``_NOT_ENV_REQUESTS``; an unknown route, a port scan, does not count).  The clock starts
    at the first env request (a server nobody has used yet waits for its clients: actor jobs
    may be queued far longer than the limit) and does not run while a request runs.
    ``watch`` (a task of the app's lifespan) logs why, sets ``fired`` (``serve`` then exits
    ``EXIT_IDLE``) and calls ``on_idle`` once (``serve``: uvicorn's graceful shutdown, which
    ends the lifespan: instances closed, then the family)."""

    def __init__(self, limit_s: float, on_idle: Callable[[], None]) -> None:
        self.limit_s, self.on_idle = limit_s, on_idle
        self.running = 0
        self.last: float | None = None
        """``time.monotonic()`` when the last env request began or ended; None before the first."""
        self.fired = False

    def begin(self) -> None:
        self.running += 1
        self.last = time.monotonic()

    def end(self) -> None:
        self.running -= 1
        self.last = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the last env request ended; 0 while one runs or before the first."""
        if self.running or self.last is None:
            return 0.0
        return time.monotonic() - self.last

    async def watch(self) -> None:
        while self.idle_s() < self.limit_s:
            await asyncio.sleep(min(1.0, self.limit_s / 4))
        self.fired = True
        log.warning("no request for %g s (env.exit_after_idle_s): no learner's actors left; exiting", self.limit_s)
        self.on_idle()


class _Timing:
    """ASGI middleware: request latency per route into the table's metrics; sets ``CALLER``
    (the peer address env calls are charged to) for the request; brackets env requests for
    ``idle`` (``IdleExit``, when set)."""

    def __init__(self, app: Any, table: InstanceTable, idle: IdleExit | None = None) -> None:
        self.app, self.table, self.idle = app, table, idle

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client")
        CALLER.set(client[0] if client else "?")
        path = scope.get("path", "")
        idle = self.idle if path in _PATHS and path not in _NOT_ENV_REQUESTS else None
        if idle is not None:
            idle.begin()
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            if idle is not None:
                idle.end()
            self.table.latency["http " + (path if path in _PATHS else "other")].add(time.perf_counter() - t0)


async def _close_family(family: EnvFamily, timeout_s: float) -> None:
    """``family.close()`` in a daemon thread, waited for at most ``timeout_s``."""
    import threading

    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def run() -> None:
        try:
            family.close()
        except Exception:
            log.exception("closing the env family failed")
        finally:
            with contextlib.suppress(RuntimeError):  # the loop already closed: nobody waits
                loop.call_soon_threadsafe(done.set)

    threading.Thread(target=run, name="family-close", daemon=True).start()
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    except TimeoutError:
        log.warning("shutdown: closing the env family took over %.3g s; leaving it", timeout_s)


def create_app(family: EnvFamily, cfg: Any, *, threads: int = 32, on_idle: Callable[[], None] | None = None) -> Starlette:
    """The ASGI app serving ``family`` with the limits of ``cfg`` (``conf.schema.EnvConfig``).

    Startup starts the idle sweeper, the event-loop lag monitor and, with
    ``cfg.exit_after_idle_s`` and ``on_idle`` (how to stop serving) both given, the
    ``IdleExit`` watch (``app.state.idle_exit``, else None); shutdown stops them, closes every
    instance, then the family.
    """
    table = InstanceTable(family, max_instances=cfg.max_instances, idle_timeout_s=cfg.idle_timeout_s, max_env_steps=cfg.max_env_steps, threads=threads,
                          limits=cfg.limits)
    idle = IdleExit(cfg.exit_after_idle_s, on_idle) if cfg.exit_after_idle_s > 0 and on_idle is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        tasks = [asyncio.create_task(table.sweeper(), name="idle-sweeper"), asyncio.create_task(table.loop_monitor(), name="loop-monitor")]
        if idle is not None:
            tasks.append(asyncio.create_task(idle.watch(), name="idle-exit"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            log.info("shutdown: closing %d env instance(s), then the %s family", len(table.instances), family.name)
            await table.close_all()
            await _close_family(family, table.limits.shutdown_timeout_s)

    routes = [Route(prefix + path, fn, methods=methods) for prefix in ("", V1) for path, fn, methods in _OPS]
    routes.append(Route(V1 + "/step_batch", step_batch, methods=["POST"]))
    routes += [Route(path, agentgym_extra, methods=methods) for path, methods in AGENTGYM_EXTRA]
    routes.append(Route("/", health, methods=["GET"]))
    handlers = {ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.table = table
    app.state.idle_exit = idle
    app.add_middleware(_Timing, table=table, idle=idle)
    return app
