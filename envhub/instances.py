"""The instance table of one env server: ids, per-instance locks, limits, idle expiry, metrics.

Invariants:
- Ids are unguessable JSON integers: drawn uniformly from [1, 2**53) by ``secrets`` and never
  reused within a process, so knowing your own ids says nothing about another client's, and
  a restarted server does not hand out ids its predecessor's clients still hold.  Holding
  an id is what lets a client drive an instance (AgentGym's clients send back the bare int).
- Every env call on an instance runs while holding that instance's ``asyncio.Lock``, in a
  worker thread (``envhub.workers``; different ids run in parallel, one id is serialised),
  under the ``call_timeout_s`` deadline.  A call past it answers 504; the instance is taken
  out of the table at once (its lock released, later calls on the id answer 410) and its
  env is closed in the background when the abandoned call finally returns.
- An instance is in exactly one state: ``new`` (created, not reset), ``running``, ``done``
  (episode ended; only ``reset`` or ``close`` allowed), ``broken`` (an env call raised; only
  ``close`` allowed) or gone from the table (closed, expired or timed out; the id is
  remembered so ``close`` stays idempotent and errors can say what happened).
- Each instance belongs to the peer address that created it (``address``; ``client`` adds
  the optional ``X-Envhub-Client`` token, a label); an address holds at most
  ``per_address_limit(limits.max_instances_per_address, max_instances)`` instances, all its
  tokens together, so no token can extend an address's quota and other addresses keep the
  rest of the server.
- Env calls are charged to the peer address of the request that makes them (``CALLER``, set
  per request by the server): an address whose abandoned calls reach
  ``limits.max_overrun_calls_per_address`` gets 429 ``overrun_quota`` for new calls, other
  addresses are served (``envhub.workers``).
- An instance whose creator hung up before the reply (``reclaim``) is closed at once
  rather than left to idle expiry: nobody holds its id.
- The sweeper closes instances idle longer than ``idle_timeout_s`` that are not in use.
- ``step_many`` (the ``/v1/step_batch`` route) steps several distinct instances in ONE worker
  call under ONE ``call_timeout_s`` deadline, holding all their locks (taken in id order, so
  two batches never deadlock); each step keeps its own outcome, state and error as if it had
  been sent alone, except that an overrun of the batch's deadline breaks every instance of
  the batch (504 each).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from turnscale.conf.schema import ServerLimits
from turnscale.envhub.base import Env, EnvBusy, EnvFamily, ResetResult, StepResult
from turnscale.envhub.workers import CallOverran, OwnerOverran, WorkerPool, WorkersExhausted

log = logging.getLogger("envhub")

BUSY_RETRY_AFTER_S = 5
"""``Retry-After`` of a 503 ``busy`` answer (``EnvBusy``) and of a 429 instance limit."""
MAX_ID = 1 << 53
"""Ids stay below 2**53 so every JSON client (doubles included) reads them exactly."""
ADDRESS_SHARE = 7 / 8
"""Share of a server-wide limit (instances, connections) one peer address may take when its
own limit is left at 0: actors behind one host share an address, so the share is large, and
every other address still finds an eighth free."""
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("envhub_caller", default="")
"""Peer address of the request being served (set by the server per request; ``""`` for the
server's own work such as idle expiry); env calls are charged to it."""


def per_address_limit(configured: int, total: int) -> int:
    """``configured``, or when 0 ``ceil(ADDRESS_SHARE * total)`` (at least 1)."""
    return configured or max(1, math.ceil(ADDRESS_SHARE * total))


class ApiError(Exception):
    """An error the server answers with ``status`` and ``{"error": {"code", "message"}}``
    (plus a ``Retry-After`` header when ``retry_after_s`` is set)."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: int | None = None, *, close_connection: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.close_connection = close_connection
        """Answer with ``Connection: close`` (the request's body was not read to its end)."""


@dataclass
class Instance:
    id: int
    env: Env
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: str = "new"
    """``new`` | ``running`` | ``done`` | ``broken``."""
    steps: int = 0
    """Steps in the current episode."""
    last_used: float = field(default_factory=time.monotonic)
    users: int = 0
    """Requests currently holding or waiting for the lock (the sweeper skips busy ones)."""
    closing: bool = False
    address: str = ""
    """Peer address that created it (counts against that address's quota)."""
    client: str = ""
    """``address``, plus ``/token`` when the creator sent an ``X-Envhub-Client`` token."""


class Latency:
    """A bounded window of request latencies (seconds) with percentiles."""

    def __init__(self, window: int = 4096) -> None:
        self.samples: collections.deque[float] = collections.deque(maxlen=window)
        self.count = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"count": self.count}
        xs = sorted(self.samples)

        def pct(p: float) -> float:
            return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 3)

        return {"count": self.count, "mean_ms": round(1000 * sum(xs) / len(xs), 3), "p50_ms": pct(0.5), "p90_ms": pct(0.9), "p99_ms": pct(0.99), "max_ms": round(1000 * xs[-1], 3)}


class InstanceTable:
    """All instances of one server process; every public method runs on the event loop."""

    def __init__(self, family: EnvFamily, *, max_instances: int, idle_timeout_s: float, max_env_steps: int = 0, threads: int = 32,
                 limits: ServerLimits | None = None) -> None:
        self.family = family
        self.limits = limits or ServerLimits()
        self.max_instances = max_instances
        self.max_per_address = per_address_limit(self.limits.max_instances_per_address, max_instances)
        self.per_address: collections.Counter[str] = collections.Counter()
        """Instances held (or being created) per peer address; addresses with none are not kept."""
        self.idle_timeout_s = idle_timeout_s
        self.max_env_steps = max_env_steps
        self.instances: dict[int, Instance] = {}
        self.gone: collections.OrderedDict[int, str] = collections.OrderedDict()
        """Recently closed/expired/timed-out ids -> ``closed`` | ``expired`` | ``timed_out`` (bounded)."""
        self.pending_creates = 0
        """Creations awaiting ``family.create`` (they count against the limit)."""
        self.workers = WorkerPool(threads, self.limits.max_overrun_calls, self.limits.call_timeout_s, self.limits.max_overrun_calls_per_address)
        if self.limits.max_overrun_calls < self.limits.max_overrun_calls_per_address + threads:
            log.warning("env.limits.max_overrun_calls (%d) < max_overrun_calls_per_address (%d) + server threads (%d): "
                        "one address's overrunning calls can make every env call answer 503", self.limits.max_overrun_calls,
                        self.limits.max_overrun_calls_per_address, threads)
        self.counters: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.latency: dict[str, Latency] = collections.defaultdict(Latency)
        self.started = time.time()

    # -- helpers ---------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any, on_late: Callable[[Any], None] | None = None) -> Any:
        """``fn(*args)`` in a worker thread under the call deadline (``CallOverran`` past it),
        charged to ``CALLER``."""
        try:
            return await self.workers.call(fn, *args, on_late=on_late, owner=CALLER.get())
        except WorkersExhausted as exc:
            raise ApiError(503, "workers_exhausted", f"the server cannot start env calls now: {exc}; retry later (GET /health says when it recovers)",
                           retry_after_s=BUSY_RETRY_AFTER_S) from None
        except OwnerOverran as exc:
            raise ApiError(429, "overrun_quota", f"{exc} (env.limits.max_overrun_calls_per_address); this address's env calls are refused "
                           "until some of them return; retry later", retry_after_s=BUSY_RETRY_AFTER_S) from None

    def _new_id(self) -> int:
        while True:
            env_id = 1 + secrets.randbelow(MAX_ID - 1)
            if env_id not in self.instances and env_id not in self.gone:
                return env_id

    def health(self) -> str:
        """Empty when the server can serve; else why not."""
        if self.workers.exhausted:
            return (f"workers exhausted: {self.workers.overrun} env calls overran their {self.limits.call_timeout_s:g} s deadline "
                    "and still hold worker threads")
        return ""

    def _get(self, env_id: int) -> Instance:
        inst = self.instances.get(env_id)
        if inst is None or inst.closing:
            why = self.gone.get(env_id)
            if why == "expired":
                msg = f"env instance {env_id} expired after {self.idle_timeout_s:g} s idle; create a new one"
            elif why == "timed_out":
                raise ApiError(410, "broken", f"env instance {env_id} was closed because a call on it overran the {self.limits.call_timeout_s:g} s deadline; create a new one")
            elif why == "reclaimed":
                msg = f"env instance {env_id} was closed because the client that created it hung up before the reply; create a new one"
            elif why == "closed" or (inst is not None and inst.closing):
                msg = f"env instance {env_id} is closed; create a new one"
            else:
                msg = f"no env instance {env_id}; create one with POST /create"
            raise ApiError(404, "not_found", msg)
        return inst

    def _remember_gone(self, env_id: int, why: str) -> None:
        self.gone[env_id] = why
        while len(self.gone) > 100_000:
            self.gone.popitem(last=False)

    def _broken(self, inst: Instance) -> ApiError:
        return ApiError(410, "broken", f"env instance {inst.id} failed with an internal error and cannot continue; close it (POST /close) and create a new one")

    async def _run(self, inst: Instance, kind: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one env call on ``inst`` under its lock; an exception marks it broken (500),
        except ``EnvBusy`` (503, the instance stays usable)."""
        inst.users += 1
        try:
            async with inst.lock:
                self._usable(inst, kind)
                t0 = time.perf_counter()
                try:
                    out = await self._call(fn, *args, on_late=lambda _f: self.workers.submit(inst.env.close))
                except ApiError:
                    raise
                except asyncio.CancelledError:  # shutdown cancelled the request: the call may still run
                    inst.state = "broken"
                    self._abandon(inst, kind, "was cancelled")
                    raise
                except CallOverran:
                    inst.state = "broken"
                    self._abandon(inst, kind)
                    raise ApiError(504, "deadline_exceeded", f"env instance {inst.id}: {kind} did not finish within {self.limits.call_timeout_s:g} s; "
                                   "the instance is broken and was closed: create a new one") from None
                except Exception as exc:
                    raise self._failure(inst, kind, exc) from None
                finally:
                    inst.last_used = time.monotonic()
                self.latency[kind].add(time.perf_counter() - t0)
                return out
        finally:
            inst.users -= 1

    def _failure(self, inst: Instance, kind: str, exc: Exception) -> ApiError:
        """The answer to an env call that raised: ``EnvBusy`` is temporary (503, the instance
        stays usable); anything else breaks the instance (500, the trace is logged, never sent)."""
        if isinstance(exc, EnvBusy):
            if kind == "reset":  # the old episode was given up before the resource ran out
                inst.state = "new"
            log.warning("env instance %d: %s refused: %s", inst.id, kind, exc)
            return ApiError(503, "busy", f"env instance {inst.id}: {kind} cannot run now: {exc}; retry later", retry_after_s=BUSY_RETRY_AFTER_S)
        inst.state = "broken"
        log.error("env instance %d: %s failed", inst.id, kind, exc_info=exc)
        return ApiError(500, "env_error", f"env instance {inst.id} raised {type(exc).__name__} during {kind}; it is now broken: close it and create a new one")

    def _usable(self, inst: Instance, kind: str) -> None:
        """Raise unless ``inst`` (whose lock the caller holds) may run ``kind`` now."""
        if inst.closing or self.instances.get(inst.id) is not inst:
            raise ApiError(404, "not_found", f"env instance {inst.id} was closed while this request waited; create a new one")
        if inst.state == "broken":
            raise self._broken(inst)
        self._check_state(inst, kind)

    def _check_state(self, inst: Instance, kind: str) -> None:
        if kind in ("step", "observation", "expert") and inst.state == "new":
            raise ApiError(409, "not_reset", f"env instance {inst.id} has no episode yet; call POST /reset first")
        if kind in ("step", "expert") and inst.state == "done":
            raise ApiError(409, "episode_done", f"the episode of env instance {inst.id} has ended; call POST /reset to start a new one")

    def _abandon(self, inst: Instance, kind: str, why: str = "") -> None:
        """Take ``inst`` out of the table now; its env is closed when the abandoned call returns."""
        why = why or f"overran the {self.limits.call_timeout_s:g} s deadline"
        log.warning("env instance %d: %s %s; instance closed", inst.id, kind, why)
        inst.closing = True
        self._remember_gone(inst.id, "timed_out")
        self._forget(inst)
        self.counters["timed_out"] += 1

    def _forget(self, inst: Instance) -> None:
        if self.instances.pop(inst.id, None) is inst:
            self._release_quota(inst.address)

    def _release_quota(self, address: str) -> None:
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]

    # -- operations ------------------------------------------------------------------
    async def create(self, address: str = "", token: str = "") -> int:
        """A new instance owned by the peer ``address`` (``token``: its optional
        ``X-Envhub-Client`` label); 429 (with ``Retry-After``) past the server's or the
        address's instance limit."""
        if len(self.instances) + self.pending_creates >= self.max_instances:
            raise ApiError(429, "too_many_instances", f"instance limit reached ({self.max_instances}); close unused instances or raise env.max_instances",
                           retry_after_s=BUSY_RETRY_AFTER_S)
        if self.per_address[address] >= self.max_per_address:
            raise ApiError(429, "client_quota", f"this address ({address or '?'}) holds {self.per_address[address]} instances, its limit "
                           f"(env.limits.max_instances_per_address, all X-Envhub-Client tokens together); close unused instances",
                           retry_after_s=BUSY_RETRY_AFTER_S)
        env_id = self._new_id()
        self.pending_creates += 1
        self.per_address[address] += 1
        created = False
        try:
            env = await self._call(self.family.create, on_late=self._close_late_env)
            created = True
        except ApiError:
            raise
        except CallOverran:
            raise ApiError(504, "deadline_exceeded", f"creating an env instance did not finish within {self.limits.call_timeout_s:g} s; retry later") from None
        except Exception as exc:
            log.exception("creating an env instance failed")
            raise ApiError(500, "env_error", f"creating an env instance failed ({type(exc).__name__}); see the server log") from None
        finally:
            self.pending_creates -= 1
            if not created:
                self._release_quota(address)
        self.instances[env_id] = Instance(env_id, env, address=address, client=f"{address}/{token}" if token else address)
        self.counters["created"] += 1
        return env_id

    async def reclaim(self, env_id: int) -> None:
        """Close ``env_id`` now: its creator hung up before the reply carrying the id."""
        inst = self.instances.get(env_id)
        if inst is not None:
            log.info("env instance %d: its creator (%s) hung up before the reply; closing it", env_id, inst.client or "?")
            await self._dispose(inst, "reclaimed")

    def _close_late_env(self, fut: Any) -> None:
        """A ``family.create`` that returned after its deadline: nobody holds that env."""
        if not fut.cancelled() and fut.exception() is None:
            self.workers.submit(fut.result().close)

    async def reset(self, env_id: int, data_idx: int) -> ResetResult:
        inst = self._get(env_id)
        out: ResetResult = await self._run(inst, "reset", inst.env.reset, data_idx)
        inst.state, inst.steps = "running", 0
        self.counters["resets"] += 1
        return out

    async def step(self, env_id: int, action: str) -> StepResult:
        inst = self._get(env_id)
        out: StepResult = await self._run(inst, "step", inst.env.step, action)
        return self._after_step(inst, out)

    def _after_step(self, inst: Instance, out: StepResult) -> StepResult:
        inst.steps += 1
        self.counters["steps"] += 1
        if self.max_env_steps and inst.steps >= self.max_env_steps and not out.done:
            out.done = out.truncated = True
            out.info = {**out.info, "truncated_by": "env.max_env_steps"}
        if out.done:
            inst.state = "done"
        return out

    async def step_many(self, items: list[tuple[int, str]]) -> list[StepResult | ApiError]:
        """``(id, action)`` steps on distinct instances in one worker call (module docstring);
        per item its ``StepResult`` or the ``ApiError`` it would have got alone, in order."""
        if len({env_id for env_id, _ in items}) != len(items):
            raise ApiError(422, "duplicate_id", "a step batch names an instance more than once; send one step per instance")
        out: list[StepResult | ApiError | None] = [None] * len(items)
        insts: dict[int, Instance] = {}
        for k, (env_id, _) in enumerate(items):
            try:
                insts[k] = self._get(env_id)
            except ApiError as exc:
                out[k] = exc
        order = sorted(insts, key=lambda k: insts[k].id)
        for k in order:
            insts[k].users += 1
        try:
            async with contextlib.AsyncExitStack() as locks:
                for k in order:
                    await locks.enter_async_context(insts[k].lock)
                ready = []
                for k in order:
                    try:
                        self._usable(insts[k], "step")
                        ready.append(k)
                    except ApiError as exc:
                        out[k] = exc
                if ready:
                    await self._step_ready([insts[k] for k in ready], [items[k][1] for k in ready], ready, out)
        finally:
            for k in order:
                insts[k].users -= 1
        return out  # type: ignore[return-value]

    async def _step_ready(self, insts: list[Instance], actions: list[str], slots: list[int], out: list[Any]) -> None:
        """One worker call stepping ``insts`` (locks held, states checked); fills ``out[slots]``."""
        calls = [(inst.env.step, action) for inst, action in zip(insts, actions)]
        t0 = time.perf_counter()
        try:
            results = await self._call(_call_each, calls, on_late=lambda _f: [self.workers.submit(i.env.close) for i in insts])
        except ApiError as exc:  # workers exhausted: nothing ran
            for k in slots:
                out[k] = exc
            return
        except (asyncio.CancelledError, CallOverran) as exc:
            for inst in insts:
                inst.state = "broken"
                self._abandon(inst, "step", "was cancelled" if isinstance(exc, asyncio.CancelledError) else "")
            if isinstance(exc, asyncio.CancelledError):
                raise
            for inst, k in zip(insts, slots):
                out[k] = ApiError(504, "deadline_exceeded", f"env instance {inst.id}: a step batch did not finish within {self.limits.call_timeout_s:g} s; "
                                  "the instance is broken and was closed: create a new one")
            return
        finally:
            now = time.monotonic()
            for inst in insts:
                inst.last_used = now
        self.latency["step_batch"].add(time.perf_counter() - t0)
        for inst, k, (ok, value) in zip(insts, slots, results):
            out[k] = self._after_step(inst, value) if ok else self._failure(inst, "step", value)

    async def observation(self, env_id: int) -> str:
        inst = self._get(env_id)
        return await self._run(inst, "observation", inst.env.observation)

    async def expert(self, env_id: int) -> str:
        """The env's expert action (envs with an ``expert_action()`` method only: else 501)."""
        inst = self._get(env_id)
        fn = getattr(inst.env, "expert_action", None)
        if fn is None:
            raise ApiError(501, "no_expert", f"env {self.family.name!r} has no expert; GET /expert is not available")
        return await self._run(inst, "expert", fn)

    async def action_hint(self, env_id: int) -> dict:
        """AgentGym's valid-action hints (envs with an ``action_hint()`` method only: else 501)."""
        inst = self._get(env_id)
        fn = getattr(inst.env, "action_hint", None)
        if fn is None:
            raise ApiError(501, "no_action_hint", f"env {self.family.name!r} has no action hints; GET /action_hint is not available")
        return await self._run(inst, "action_hint", fn)

    async def call(self, env_id: int, method: str, *args: Any) -> Any:
        """``inst.env.<method>(*args)`` under the instance lock (AgentGym's extra routes); 404
        ``no_route`` when this family's env has no such method."""
        inst = self._get(env_id)
        fn = getattr(inst.env, method, None)
        if fn is None:
            raise ApiError(404, "no_route", f"env {self.family.name!r} has no {method.removeprefix('agentgym_')!r} route")
        return await self._run(inst, "query", fn, *args)

    async def close(self, env_id: int) -> None:
        """Idempotent for any id this server handed out; 404 for ids it never did."""
        if env_id in self.gone:
            return
        inst = self.instances.get(env_id)
        if inst is None:
            raise ApiError(404, "not_found", f"no env instance {env_id} was ever created here")
        await self._dispose(inst, "closed")

    async def _dispose(self, inst: Instance, why: str) -> None:
        if inst.closing:
            return
        inst.closing = True
        self._remember_gone(inst.id, why)
        async with inst.lock:  # wait for an in-flight call to finish (bounded by its deadline)
            self._forget(inst)
            try:
                await self._call(inst.env.close)
            except CallOverran as exc:
                log.warning("closing env instance %d did not complete: %s", inst.id, exc)
            except ApiError:  # workers exhausted: close it when a thread frees up
                self.workers.submit(inst.env.close)
            except Exception:
                log.exception("closing env instance %d failed", inst.id)
        self.counters[why] += 1

    async def sweep_once(self) -> int:
        """Close instances idle longer than ``idle_timeout_s`` and not in use; returns how many."""
        now = time.monotonic()
        stale = [i for i in self.instances.values() if i.users == 0 and not i.closing and now - i.last_used > self.idle_timeout_s]
        for inst in stale:
            log.info("env instance %d expired after %.1f s idle", inst.id, now - inst.last_used)
            await self._dispose(inst, "expired")
        return len(stale)

    async def sweeper(self) -> None:
        period = max(0.05, min(5.0, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.sweep_once()
            except Exception:  # never let the sweeper die silently
                log.exception("idle sweeper failed")

    async def loop_monitor(self, period_s: float = 0.05) -> None:
        """Records how late the event loop wakes a ``period_s`` sleep (``latency["event_loop_lag"]``
        in ``/metrics``): what any request waits at worst behind the work of others."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(period_s)
            self.latency["event_loop_lag"].add(max(0.0, loop.time() - t0 - period_s))

    async def close_all(self, timeout_s: float | None = None) -> None:
        """Close every instance concurrently, giving up after ``timeout_s``
        (``limits.shutdown_timeout_s``); then stop the worker pool without waiting for it."""
        try:
            await asyncio.wait_for(asyncio.gather(*(self._dispose(i, "closed") for i in list(self.instances.values())), return_exceptions=True),
                                   timeout_s or self.limits.shutdown_timeout_s)
        except TimeoutError:
            log.warning("shutdown: %d env instances still closing after %.3g s; leaving them", len(self.instances), timeout_s or self.limits.shutdown_timeout_s)
        self.workers.shutdown()

    def metrics(self) -> dict[str, Any]:
        return {
            "env": self.family.name,
            "instances": len(self.instances),
            "max_instances": self.max_instances,
            "created": self.counters["created"],
            "closed": self.counters["closed"],
            "expired": self.counters["expired"],
            "timed_out": self.counters["timed_out"],
            "client_disconnects": self.counters["client_disconnects"],
            "reclaimed": self.counters["reclaimed"],
            "overrun_calls_running": self.workers.overrun,
            "overrun_addresses": len(self.workers.overrun_by),
            "clients": len(self.per_address),
            "resets": self.counters["resets"],
            "steps": self.counters["steps"],
            "errors": dict(self.errors),
            "latency": {k: v.summary() for k, v in self.latency.items()},
            "uptime_s": round(time.time() - self.started, 3),
            "cpu_s": round(time.process_time(), 4),
            # a family's own counters, when it keeps any (``env=web``: requests its allow-list refused)
            **(self.family.metrics() if hasattr(self.family, "metrics") else {}),
        }


def _call_each(calls: list[tuple[Callable[[Any], Any], Any]]) -> list[tuple[bool, Any]]:
    """Run ``fn(arg)`` for each call in order (in a worker thread); ``(True, result)`` or
    ``(False, exception)`` per call, so one failing env does not stop the others."""
    out: list[tuple[bool, Any]] = []
    for fn, arg in calls:
        try:
            out.append((True, fn(arg)))
        except Exception as exc:
            out.append((False, exc))
    return out
