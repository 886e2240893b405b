"""WebArena through AgentGym's WebArena server (self-hosted sites), behind our Env interface.

The upstream (``agentenv-webarena``, Quart) speaks an ``env_idx`` API::

    POST /create                                  -> {"env_idx": int}     (starts a browser, ~1 GB)
    POST /reset {"env_idx", "seed", "idx"}        -> {"observation": str, "sites": ..., "object": ...}
    POST /step  {"env_idx", "action"}             -> {"observation", "reward", "terminated", "truncated", "info"}
    POST /close {"env_idx"}                       -> {"closed": ...}
    GET  /                                        -> "ok"

Each of our ``Env`` instances owns one upstream ``env_idx``, created on the first ``reset`` and
closed by ``close``; the envhub server in front gives actors the same API as every other env.

Episode: ``reset(data_idx)`` resets to WebArena task ``data_idx % num_tasks`` (task ids
0-811, ``info["category"]`` = the task's site(s)).  ``step(reply)`` extracts the action from the
reply's first triple-back-tick block (or takes the whole reply), validates it locally with
``envhub.webarena_actions`` — an invalid action is a normal step (reward 0, not done) whose
observation explains the grammar, and is not sent upstream — and sends the canonical action
upstream in a back-tick block (the upstream parses it the same way).  ``done`` = upstream
``terminated``; ``reward`` = upstream reward when terminated (WebArena's evaluator, 0 or 1;
AgentGym's client ignores it otherwise), else 0; ``info["success"]`` = reward >= 1.  An upstream
observation of ``TimeoutError`` at reset (AgentGym's signal of a broken browser) raises
``UpstreamError``, as does any transport failure or non-200 answer.

Options (``env.options``):
  ``upstream_url``: base URL of the AgentGym WebArena server, e.g. ``http://127.0.0.1:8000``
    (required).
  ``timeout_s``: per-request timeout (default 300: resets log in and load pages).
  ``num_tasks``: number of task ids (default 812).
  ``seed``: the ``seed`` sent with every reset (default 0, AgentGym's client).
"""

from __future__ import annotations

import logging
from typing import Any

from turnscale.envhub.base import ResetResult, StepResult
from turnscale.envhub.options import read_options
from turnscale.envhub.webarena_actions import ActionError, extract_action, format_action, parse_action

log = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """The upstream WebArena server failed or answered in an unexpected shape."""


class Upstream:
    """A small synchronous client of the upstream ``env_idx`` API (thread-safe)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import httpx

        if not url:
            raise ValueError("config key 'env.options.upstream_url': required (the AgentGym WebArena server)")
        self.url = url.rstrip("/")
        self._client = httpx.Client(timeout=timeout_s)

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            resp = self._client.post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as e:
            raise UpstreamError(f"WebArena server {self.url} unreachable on {path}: {e}") from e
        if resp.status_code != 200:
            raise UpstreamError(f"WebArena server answered HTTP {resp.status_code} on {path}")
        try:
            data = resp.json()
        except ValueError as e:
            raise UpstreamError(f"WebArena server sent non-JSON on {path}") from e
        if isinstance(data, dict) and "error" in data:
            raise UpstreamError(f"WebArena server error on {path}: {data['error']}")
        return data

    def close(self) -> None:
        self._client.close()


def _field(data: Any, key: str, path: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise UpstreamError(f"WebArena server reply to {path} lacks {key!r}")
    return data[key]


class WebArenaEnv:
    """One upstream browser environment."""

    def __init__(self, family: WebArenaFamily) -> None:
        self._fam = family
        self._idx: int | None = None
        self._obs = ""
        self._closed = False

    def _env_idx(self) -> int:
        if self._idx is None:
            self._idx = int(_field(self._fam.upstream.post("/create"), "env_idx", "/create"))
        return self._idx

    def reset(self, data_idx: int) -> ResetResult:
        task = data_idx % self._fam.n_tasks
        body = {"env_idx": self._env_idx(), "seed": self._fam.seed, "idx": task}
        data = self._fam.upstream.post("/reset", body)
        obs = str(_field(data, "observation", "/reset"))
        if obs == "TimeoutError":
            raise UpstreamError(f"WebArena reset of task {task} timed out upstream; restart the WebArena server")
        sites = data.get("sites")
        category = "+".join(map(str, sites)) if isinstance(sites, list) else str(sites or "webarena")
        self._obs = obs
        return ResetResult(observation=obs, info={"category": category, "task_id": task},
                           extra={"sites": sites, "object": data.get("object")})

    def step(self, action: str) -> StepResult:
        if self._idx is None:
            raise RuntimeError("step() before reset()")
        try:
            parsed = parse_action(extract_action(action))
        except ActionError as e:
            self._obs = f"Invalid action: {e}"
            return StepResult(observation=self._obs, reward=0.0, done=False, info={"success": False, "valid": False})
        data = self._fam.upstream.post("/step", {"env_idx": self._idx, "action": f"```{format_action(parsed)}```"})
        obs = str(_field(data, "observation", "/step"))
        terminated = bool(_field(data, "terminated", "/step"))
        try:
            raw = float(data.get("reward") or 0.0)
        except (TypeError, ValueError) as e:
            raise UpstreamError(f"WebArena server sent a non-numeric reward: {data.get('reward')!r}") from e
        reward = raw if terminated else 0.0
        self._obs = obs
        info = {"success": terminated and reward >= 1.0, "valid": True, "action": format_action(parsed)}
        return StepResult(observation=obs, reward=reward, done=terminated,
                          truncated=bool(data.get("truncated", False)), info=info)

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._idx is not None:
            idx, self._idx = self._idx, None
            try:
                self._fam.upstream.post("/close", {"env_idx": idx})
            except UpstreamError:
                log.warning("closing upstream WebArena env %s failed", idx, exc_info=True)


OPTIONS: dict[str, Any] = {"upstream_url": "", "timeout_s": 300.0, "num_tasks": 812, "seed": 0}
"""Every option this family reads, with its default (documented in the module docstring)."""


class WebArenaFamily:
    name = "webarena"

    def __init__(self, upstream_url: str, timeout_s: float = 300.0, num_tasks: int = 812, seed: int = 0) -> None:
        if num_tasks < 1:
            raise ValueError("config key 'env.options.num_tasks': must be >= 1")
        self.upstream = Upstream(upstream_url, timeout_s)
        self.n_tasks, self.seed = num_tasks, seed

    def create(self) -> WebArenaEnv:
        return WebArenaEnv(self)

    def num_tasks(self) -> int:
        return self.n_tasks

    def close(self) -> None:
        self.upstream.close()


def make_family(cfg) -> WebArenaFamily:
    o = read_options(cfg.options, OPTIONS, "webarena")
    return WebArenaFamily(str(o["upstream_url"]), float(o["timeout_s"]), int(o["num_tasks"]), int(o["seed"]))
