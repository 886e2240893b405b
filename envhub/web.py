"""``env=web``: WebArena-style web navigation that runs on one machine — seeded local sites
(``envhub.web_sites``, a sibling process this family starts and stops), a real browser
(``envhub.web_browser``: Debian's chromium through Playwright, one context per instance) and
WebArena's observation, action grammar and evaluator kinds (``envhub.web_tasks``).

Episode: ``reset(data_idx)`` (re)creates this instance's world from the task's seed, clears the
context's cookies and tabs, opens the task's start page and answers the first observation::

    OBSERVATION:
    Tab 0 (current): Shop

    [4] RootWebArea 'Shop' focused: True
    \t[11] link 'Home'
    ...
    URL: http://127.0.0.1:<port>/shop/
    OBJECTIVE: <the task>
    PREVIOUS ACTION: None

The tree is cut at ``obs_max_tokens`` at a line boundary (tokens counted with the local tokenizer
folder in option ``tokenizer`` when set, else as 4 characters each), with
a ``[... N more lines truncated]`` line.  ``step(reply)`` takes the reply's first back-tick
block (``envhub.webarena_actions``); an invalid action, or one naming an element that is not
on the page, is a normal step (reward 0, not done) whose observation starts with the error and
then shows the page.  ``stop [answer]`` ends the episode: the task's evaluator decides
``reward`` (1 or 0) and ``info["success"]``.  The wire is AgentGym's WebArena shape
(``/create`` -> ``{env_idx}``, ``/reset {env_idx, seed, idx}``, ``/step`` -> ``{observation,
reward, terminated, truncated, info}``; ``terminated`` is sent beside ``done``).

Failure: a crashed page or dead browser raises ``BrowserBroken`` from ``step`` (the server
marks the instance broken; the client replaces it); a session found unusable at ``reset`` (crashed, or
made in a browser that has since died and been relaunched) is replaced there.  ``GET /expert`` is the oracle's next action (``envhub.web_oracle``).

Network: the browser reaches only the sites process's origin (``envhub.web_guard``).  A ``goto``
elsewhere is a normal step whose observation starts ``blocked: <url> is outside the allowed
sites ...`` and shows the page it stayed on; a link, form, redirect or script that leaves the
sites gets a "Blocked" page or an aborted request, never the target's content.  Refusals are
counted in ``family.refused()`` (the server's ``GET /metrics``: ``web_refused``).

Options (``env.options``): ``chromium`` (path, default ``/usr/bin/chromium``),
``obs_max_tokens`` (default 2048), ``nav_timeout_s`` (default 20), ``num_tasks`` (default 4400),
``viewport_only`` (default true, WebArena's ``current_viewport_only``: only elements inside the
1280x720 window are listed, so ``scroll`` shows more of a long page).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.request
import uuid
from typing import Any, Callable, Iterator

from turnscale.envhub.base import AgentGymShape, ResetResult, StepResult, play_expert
from turnscale.envhub.options import read_options
from turnscale.envhub.web_browser import BrowserBroken, BrowserPool, ElementError, Session, accessibility_tree, execute, tab_titles
from turnscale.envhub.web_guard import BlockedURL
from turnscale.envhub.web_oracle import WebOracle
from turnscale.envhub.web_tasks import evaluate, needs_state, task
from turnscale.envhub.webarena_actions import ActionError, extract_action, format_action, parse_action

OPTIONS: dict[str, Any] = {"chromium": "/usr/bin/chromium", "obs_max_tokens": 2048, "nav_timeout_s": 20.0, "num_tasks": 4400,
                           "viewport_only": True, "tokenizer": ""}
"""Every option this family reads, with its default (documented in the module docstring)."""
CHARS_PER_TOKEN = 4


def truncate_tree(tree: str, max_tokens: int, count_tokens: Callable[[str], int] | None = None) -> str:
    """``tree`` cut at a line boundary to at most ``max_tokens`` tokens.

    Tokens are counted with ``count_tokens`` (e.g. ``len(tokenizer.encode(text))``) when one is given,
    else estimated as ``CHARS_PER_TOKEN`` characters each (the fallback when no tokenizer is available).
    Invariant: the kept lines are a prefix of ``tree`` and fit the budget under the chosen count."""
    if count_tokens is None:
        def count_tokens(text: str) -> int:
            return len(text) / CHARS_PER_TOKEN  # type: ignore[return-value]  # fractional: exact char budget
    if count_tokens(tree) <= max_tokens:
        return tree
    lines, out, used = tree.split("\n"), [], 0.0
    for line in lines:
        cost = count_tokens(line + "\n")  # per line: linear in the tree, a sum >= the joined count
        if used + cost > max_tokens:
            break
        out.append(line)
        used += cost
    return "\n".join(out) + f"\n[... {len(lines) - len(out)} more lines truncated]"


def token_counter(tokenizer: str) -> Callable[[str], int] | None:
    """The token count of the tokenizer in local folder ``tokenizer`` (no download), or ``None`` for ``""``
    (then the ``CHARS_PER_TOKEN`` estimate is used). A folder without a tokenizer raises ``ValueError``."""
    if not tokenizer:
        return None
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"config key 'env.options.tokenizer': no tokenizer in {tokenizer!r}: {exc}") from exc
    return lambda text: len(tok.encode(text, add_special_tokens=False))


class SiteProcess:
    """The sibling process serving the sites: started here, ended by its pid (``close``); it also
    ends when the thread that started it exits (``PR_SET_PDEATHSIG``, so start it from the
    thread that owns the family, as ``envhub.main`` does) or when its parent process is gone."""

    def __init__(self) -> None:
        from turnscale.common.procs import die_with_parent

        self.token = secrets.token_hex(16)
        env = {**os.environ, "TS_WEB_TOKEN": self.token}
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "turnscale.envhub.web_sites", "--parent-pid", str(os.getpid())],
                                     stdout=subprocess.PIPE, env=env, text=True, preexec_fn=die_with_parent(os.getpid()))
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"the web sites process failed to start (said {line!r}); see its stderr")
        self.base = f"http://127.0.0.1:{int(line.split()[1])}"

    def control(self, path: str, body: dict | None = None) -> Any:
        req = urllib.request.Request(self.base + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"X-Control-Token": self.token, "Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def close(self) -> None:
        from turnscale.common.procs import stop_process

        if self.proc.poll() is None:
            stop_process(self.proc, grace_s=5.0)
        if self.proc.stdout:
            self.proc.stdout.close()


class WebEnv:
    """One instance: a browser context and its own world of the sites."""

    def __init__(self, fam: WebFamily) -> None:
        self.fam = fam
        self.world_id = uuid.uuid4().hex
        self.session: Session | None = None
        self.task = None
        self.obs = ""
        self.prev = "None"
        self.oracle: WebOracle | None = None
        self.url = ""

    # -- helpers -------------------------------------------------------------------------
    def _observe(self, error: str = "") -> str:
        s = self.session
        assert s is not None and self.task is not None

        async def grab() -> tuple[str, str, str]:
            return await tab_titles(s), await accessibility_tree(s, self.fam.viewport_only), s.page.url

        tabs, tree, url = self.fam.pool.call(grab(), timeout_s=self.fam.nav_timeout_s + 10)
        self.url = url
        head = f"{error}\n\n" if error else ""
        self.obs = (f"{head}OBSERVATION:\n{tabs}\n\n{truncate_tree(tree, self.fam.obs_max_tokens, self.fam.count_tokens)}\nURL: {url}\n"
                    f"OBJECTIVE: {self.task.objective}\nPREVIOUS ACTION: {self.prev}")
        return self.obs

    # -- Env ---------------------------------------------------------------------------------
    def reset(self, data_idx: int) -> ResetResult:
        fam = self.fam
        t = task(data_idx % fam.n_tasks)
        if self.session is not None and not fam.pool.usable(self.session):
            fam.pool.close_session(self.session)
            self.session = None
        if self.session is None:
            self.session = fam.pool.new_session()
        s = self.session
        fam.sites.control("/_control/reset", {"world": self.world_id, "seed": t.seed})

        async def fresh() -> None:
            while len(s.pages) > 1:
                await s.pages.pop().close()
            s.active = 0
            await s.context.clear_cookies()
            await s.context.add_cookies([{"name": "tsworld", "value": self.world_id, "url": fam.sites.base}])
            await s.page.goto(fam.sites.base + t.start_path, wait_until="load")

        fam.pool.call(fresh(), timeout_s=fam.nav_timeout_s + 10)
        self.task, self.prev, self.oracle = t, "None", None
        obs = self._observe()
        return ResetResult(observation=obs, info={"category": t.template, "task_id": t.idx, "site": t.site},
                           extra={"sites": [t.site], "object": {"intent": t.objective, "task_id": t.idx}})

    def step(self, action: str) -> StepResult:
        if self.session is None or self.task is None:
            raise RuntimeError("step() before reset()")
        self.fam.pool.check(self.session)
        try:
            a = parse_action(extract_action(action))
        except ActionError as e:
            self.prev = extract_action(action)[:200] or "None"
            return self._result(self._observe(f"Invalid action: {e}"), valid=False)
        self.prev = format_action(a)
        if a.kind == "stop":
            state = self.fam.sites.control(f"/_control/state?world={self.world_id}") if needs_state(self.task.evaluator) else None
            ok = evaluate(self.task.evaluator, answer=a.text, url=self.url, state=state)
            obs = self._observe()
            return StepResult(observation=obs, reward=1.0 if ok else 0.0, done=True,
                              info={"success": ok, "valid": True, "action": self.prev}, extra={"terminated": True})
        try:
            self.fam.pool.call(execute(self.session, a, self.fam.nav_timeout_s), timeout_s=self.fam.nav_timeout_s * 2 + 10)
        except ElementError as e:
            self.fam.pool.check(self.session)
            return self._result(self._observe(f"Invalid action: {e}"), valid=False)
        except BlockedURL as e:  # nothing was fetched: the page stays
            return self._result(self._observe(str(e)), valid=False)
        except Exception as e:
            self.fam.pool.check(self.session)  # raises BrowserBroken when that is why
            return self._result(self._observe(f"The action failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"), valid=False)
        self.fam.pool.check(self.session)
        return self._result(self._observe(), valid=True)

    def _result(self, obs: str, *, valid: bool) -> StepResult:
        return StepResult(observation=obs, reward=0.0, done=False, info={"success": False, "valid": valid, "action": self.prev},
                          extra={"terminated": False})

    def observation(self) -> str:
        return self.obs

    def expert_action(self) -> str:
        if self.task is None:
            raise RuntimeError("expert_action before reset")
        if self.oracle is None:
            self.oracle = WebOracle(self.task.plan)
        return self.oracle.next_action(self.obs)

    def close(self) -> None:
        if self.session is not None:
            s, self.session = self.session, None
            self.fam.pool.close_session(s)
        if self.task is not None:
            self.task = None
            try:
                self.fam.sites.control("/_control/drop", {"world": self.world_id})
            except OSError:
                pass  # the sites process is gone (server shutting down): nothing to free


class WebFamily:
    name = "web"
    agentgym = AgentGymShape()

    def __init__(self, chromium: str = "/usr/bin/chromium", obs_max_tokens: int = 2048, nav_timeout_s: float = 20.0,
                 num_tasks: int = 4400, viewport_only: bool = True, tokenizer: str = "") -> None:
        if num_tasks < 1:
            raise ValueError("config key 'env.options.num_tasks': must be >= 1")
        if obs_max_tokens < 64:
            raise ValueError("config key 'env.options.obs_max_tokens': must be >= 64")
        self.n_tasks, self.obs_max_tokens, self.nav_timeout_s = num_tasks, obs_max_tokens, nav_timeout_s
        self.viewport_only = bool(viewport_only)
        self.count_tokens = token_counter(tokenizer)
        self.sites = SiteProcess()
        try:
            self.pool = BrowserPool(chromium, allowed_origins=(self.sites.base,), nav_timeout_s=nav_timeout_s)
        except Exception:
            self.sites.close()
            raise

    def create(self) -> WebEnv:
        return WebEnv(self)

    def num_tasks(self) -> int:
        return self.n_tasks

    def refused(self) -> dict[str, int]:
        """Requests refused by the allow-list so far, per layer (``goto`` actions, routed
        requests, requests at the guard proxy: redirect hops, workers, CONNECT, and chromium's
        own background requests)."""
        return dict(self.pool.guard.refused)

    def metrics(self) -> dict[str, Any]:
        """This family's part of the server's ``GET /metrics``."""
        return {"web_refused": self.refused()}

    def close(self) -> None:
        try:
            self.pool.close()
        finally:
            self.sites.close()


def make_family(cfg) -> WebFamily:
    o = read_options(cfg.options, OPTIONS, "web")
    return _family(o)


def _family(o: dict[str, Any]) -> WebFamily:
    if not isinstance(o["viewport_only"], bool):
        raise ValueError(f"config key 'env.options.viewport_only': expected true or false, got {o['viewport_only']!r}")
    return WebFamily(str(o["chromium"]), int(o["obs_max_tokens"]), float(o["nav_timeout_s"]), int(o["num_tasks"]), o["viewport_only"])


def seed_task_ids(seeds: range) -> list[int]:
    """Every task id of the world seeds ``seeds`` (``TASKS_PER_SEED`` each): ``turnscale run``'s
    warm-up / train / test files for ``env=web``."""
    from turnscale.envhub.web_tasks import TASKS_PER_SEED

    return [s * TASKS_PER_SEED + k for s in seeds for k in range(TASKS_PER_SEED)]


def play_oracle(task_ids: list[int], max_turns: int = 30, options: dict | None = None) -> Iterator[tuple[int, list[tuple[str, str]], bool, float, str]]:
    """Play the oracle on ``task_ids`` in process with one family (one browser): yields
    ``(data_idx, [(observation, action), ...], success, return, template)`` per task (warm-start
    conversations; the oracle-solves-every-task check)."""
    from turnscale.envhub.web_oracle import OracleLost

    o = read_options({k: v for k, v in (options or {}).items() if k in OPTIONS}, OPTIONS, "web")  # not the client's keys
    fam = _family(o)
    try:
        env = fam.create()
        for idx in task_ids:
            obs = env.reset(idx).observation
            steps, success, ret = play_expert(env, obs, env.expert_action, max_turns, lost=(OracleLost,))
            yield idx, steps, success, ret, env.task.template
        env.close()
    finally:
        fam.close()
