"""The running part of ``turnscale eval``: models x turn limits x tasks x samples -> episode records.

Episodes are played by the actor's own code (``actors.episode.run_episode`` with the engine from
``actors.engines.make_engine``, the renderer, the env's parser and prompt) against an envhub server
through the env client, ``concurrency`` episodes at a time in one trio event loop.  Env sessions
are opened lazily (at most ``concurrency``) and reused across episodes, as actors do.

Invariants:
- Episode ``(data_idx, sample)`` gets the same engine seed under every model and turn limit, so
  checkpoints are compared on the same draws.
- Every played episode becomes one record (the learner's ``trajectories.jsonl`` format plus
  ``checkpoint`` and ``sample``), appended to ``out_jsonl`` as it finishes; the returned list is
  sorted by (model order, env order, turn limit, data_idx, sample).
- Without ``env.url`` an envhub server for each env is started on a free 127.0.0.1 port and
  stopped (by pid) at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Protocol

import numpy as np

from turnscale.common.procs import stop_process
from turnscale.protocol.transport import free_port


class EvalNotBuilt(RuntimeError):
    """A piece the running part of ``turnscale eval`` needs is not available in this build."""


class EvalRunError(RuntimeError):
    """The evaluation could not run (model or env server problem); the message says what to fix."""


class SessionPool(Protocol):
    """Opens env sessions (``actors.episode.EnvSession``) on one env server."""

    async def open(self) -> Any: ...

    async def aclose(self) -> None: ...


# ----------------------------------------------------------------------------- records


def episode_record(ep: Any, *, checkpoint: str, env: str, data_idx: int, split: str, category: str, sample: int,
                   decode: Callable[[list[int]], str] | None) -> dict:
    """One played episode in the learner's ``trajectories.jsonl`` format, plus ``checkpoint`` and ``sample``."""
    from turnscale.learner.trajlog import turn_records

    turns = turn_records(ep)
    ids = np.asarray(ep.token_ids)
    return {
        "checkpoint": checkpoint, "sample": sample, "step": 0, "version": 0, "lease_id": "", "actor_id": "eval",
        "env": env, "data_idx": data_idx, "task_id": f"{env}_{data_idx}", "split": split, "category": category,
        "episode": sample, "group_size": 0, "turn_limit": ep.turn_limit, "finish_reason": ep.finish_reason,
        "reward": float(ep.reward), "success": bool(ep.success), "accepted": True, "drop_reason": "",
        "num_turns": len(ep.turns), "num_tokens": int(len(ids)),
        "prompt": decode(ids[: ep.prompt_len].tolist()) if decode is not None else "", "error": ep.error, "turns": turns,
    }


class _Recording:
    """An env session that remembers the sub-task (``info["category"]``) of its last reset."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.category = ""

    async def reset(self, data_idx: int):
        obs, info = await self.inner.reset(data_idx)
        self.category = str((info or {}).get("category", "") or "")
        return obs, info

    async def step(self, action: str):
        return await self.inner.step(action)


class Progress:
    """A one-line progress bar on stderr (redrawn at most 5 times a second)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.ok = 0
        self.t0 = self._last = time.monotonic()

    def update(self, rec: dict) -> None:
        self.done += 1
        self.ok += bool(rec.get("success"))
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or self.done == self.total):
            self._last = now
            frac = self.done / max(1, self.total)
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            rate = self.done / max(1e-9, now - self.t0)
            print(f"\r{self.label} [{bar}] {self.done}/{self.total} episodes, success {100 * self.ok / self.done:.1f}%, "
                  f"{rate:.2f} ep/s", end="\n" if self.done == self.total else "", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- models


def resolve_model_dir(path: str) -> str:
    """The HF model folder ``path`` stands for: the folder itself (it has ``config.json``), a learner
    checkpoint ``step-N/`` (its ``model/``), or a checkpoint root (the highest ``step-N/model``)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return str(p)
    if (p / "model" / "config.json").is_file():
        return _loadable(p)
    steps = sorted((int(c.name[5:]), c) for c in p.glob("step-*") if c.name[5:].isdigit() and (c / "model" / "config.json").is_file()) if p.is_dir() else []
    if steps:
        return _loadable(steps[-1][1])
    if not p.exists():
        raise EvalRunError(f"--model {path}: no such folder; give a checkpoint or HF model folder (nothing is downloaded)")
    raise EvalRunError(f"--model {path}: no config.json there, in model/, or in a step-N/model/ below it")


def _loadable(step: Path) -> str:
    """The HF folder of the checkpoint ``step``: its ``model/``, or, for a sharded checkpoint
    (``learner.strategy=fsdp``: ``model/`` holds config and tokenizer only), its policy
    exported once to ``step/hf/`` (``learner.checkpoint.export_hf``; written to a temporary
    folder and renamed, so an interrupted export is redone, never half-read)."""
    if not (step / "sharded").is_dir():
        return str(step / "model")
    out = step / "hf"
    if not (out / "config.json").is_file():
        import shutil
        import tempfile

        from turnscale.learner.checkpoint import export_hf

        tmp = tempfile.mkdtemp(prefix=".hf-", dir=step)
        try:
            export_hf(str(step), tmp)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# ----------------------------------------------------------------------------- playing


def eval_seed(base: int, data_idx: int, sample: int) -> int:
    from turnscale.actors.episode import episode_seed

    return episode_seed(base * 1_000_003 + data_idx, sample)


async def play_all(*, engine: Any, renderer: Any, parser: Any, prompt: str, sampling: Any, pool: SessionPool,
                   checkpoint: str, env: str, split: str, jobs: list[tuple[int, int, int]], concurrency: int,
                   seed: int = 0, on_record: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """Play every ``(turn_limit, data_idx, sample)`` job, ``concurrency`` at a time; records in job order."""
    import trio

    from turnscale.actors.episode import run_episode
    from turnscale.protocol.messages import Task

    limiter = trio.CapacityLimiter(concurrency)
    idle: list[_Recording] = []
    out: list[dict | None] = [None] * len(jobs)

    async def one(j: int, turn_limit: int, data_idx: int, sample: int) -> None:
        async with limiter:
            session = idle.pop() if idle else _Recording(await pool.open())
            ep = await run_episode(engine=engine, renderer=renderer, env=session,
                                   task=Task(env=env, data_idx=data_idx, split=split, task_id=f"{env}_{data_idx}"),
                                   turn_limit=turn_limit, sampling=sampling, parser=parser, prompt=prompt,
                                   seed=eval_seed(seed, data_idx, sample))
            idle.append(session)
        rec = episode_record(ep, checkpoint=checkpoint, env=env, data_idx=data_idx, split=split,
                             category=session.category, sample=sample, decode=renderer.decode)
        out[j] = rec
        on_record(rec)

    async with trio.open_nursery() as nursery:
        for j, (turn_limit, data_idx, sample) in enumerate(jobs):
            nursery.start_soon(one, j, turn_limit, data_idx, sample)
    return [r for r in out if r is not None]


def plan(task_ids: list[int], samples: int, turn_limits: list[int]) -> list[tuple[int, int, int]]:
    """Jobs ``(turn_limit, data_idx, sample)`` sorted the way records are returned."""
    return [(tl, idx, s) for tl in turn_limits for idx in task_ids for s in range(samples)]


# ----------------------------------------------------------------------------- env server


def _healthy(url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def env_server(env_name: str, url: str, *, start_timeout_s: float = 120.0, flavor: str = "turnscale",
               options: dict | None = None) -> Iterator[str]:
    """Yield the env server URL: ``url`` when given (checked with ``GET /health``, or AgentGym's
    ``GET /`` for another ``flavor``), else a local ``turnscale envhub`` subprocess with the env
    ``options`` on a free 127.0.0.1 port, stopped by pid on exit."""
    if url:
        probe = "/health" if flavor == "turnscale" else "/"
        if not _healthy(url, probe):
            raise EvalRunError(f"env server {url} does not answer GET {probe}; start it with "
                               f"'turnscale envhub env={env_name}' or drop env.url to let eval start one")
        yield url
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    from turnscale.launch import option_overrides

    extra = option_overrides("env.options", dict(options or {}), skip=("flavor",))
    proc = subprocess.Popen([sys.executable, "-m", "turnscale", "envhub", f"env={env_name}", "host=127.0.0.1",
                             f"port={port}", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                err = (proc.stderr.read() if proc.stderr else "")[-2000:]
                raise EvalRunError(f"the local envhub server for {env_name} exited with {proc.returncode}: {err.strip()}")
            if time.monotonic() > deadline:
                raise EvalRunError(f"the local envhub server for {env_name} was not healthy after {start_timeout_s:.0f}s")
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)


def _require_client() -> None:
    try:
        from turnscale.common.envclient import EnvClient  # noqa: F401
    except ImportError:
        raise EvalNotBuilt("turnscale eval: running models needs common/envclient.py, which is not built yet; "
                           "report on recorded episodes with --from-jsonl FILE") from None


def make_pool(env_name: str, url: str, cfg: Any) -> SessionPool:
    """Env sessions on ``url`` through the envhub client (``common/envclient.py``)."""
    _require_client()
    from turnscale.evalclient import ClientPool

    return ClientPool(env_name, url, cfg)


# ----------------------------------------------------------------------------- whole run


def run_eval(cfgs: list[Any], models: list[tuple[str, str]], tasks: dict[str, list[int]], *, samples: int,
             turn_limits: list[int], split: str, concurrency: int, out_jsonl: Path, progress: bool = True,
             pool_factory: Callable[[str, str, Any], SessionPool] = make_pool) -> list[dict]:
    """Play every model on every env's jobs; returns the records (also written to ``out_jsonl``).

    ``cfgs``: one config per env (they differ only in ``env``; engine, model and sampling settings
    come from the first).  ``tasks[env]``: that env's ``data_idx`` list.  Env servers start once;
    each model is loaded once and plays the envs in order."""
    try:
        import trio  # noqa: F401

        from turnscale.actors.engines import make_engine  # noqa: F401
        from turnscale.actors.episode import run_episode  # noqa: F401
    except ImportError as exc:
        raise EvalNotBuilt(f"turnscale eval: running models needs the actor code ({exc.name} is missing)") from None
    models = [(resolve_model_dir(path), label) for path, label in models]
    if cfgs[0].engine.name == "vllm" and importlib.util.find_spec("vllm") is None:  # fail before starting servers
        raise EvalRunError("engine 'vllm' needs vllm, which is not installed here (engine=hf runs anywhere)")
    if pool_factory is make_pool:
        _require_client()
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    with open(out_jsonl, "w", encoding="utf-8") as sink, ExitStack() as servers:
        urls = {cfg.env.name: servers.enter_context(env_server(cfg.env.name, cfg.env.url, flavor=cfg.env.client_flavor,
                                                               options=cfg.env.options)) for cfg in cfgs}

        def write(rec: dict) -> None:
            sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
            sink.flush()

        plans = [(cfg, urls[cfg.env.name], plan(tasks[cfg.env.name], samples, turn_limits)) for cfg in cfgs]
        for path, label in models:
            records += _run_model(cfgs[0], path, label, plans, split, concurrency, progress, write, pool_factory)
    return records


def _run_model(cfg, path, label, plans, split, concurrency, progress, write, pool_factory) -> list[dict]:
    import trio

    from turnscale.actors.engine import EngineError
    from turnscale.actors.engines import make_engine
    from turnscale.common.parsing import parser_for
    from turnscale.common.prompts import instruction
    from turnscale.common.renderer import Renderer
    from turnscale.protocol.messages import SamplingParams

    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(1)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise EvalRunError(f"--model {path}: cannot load a tokenizer ({exc}); give a checkpoint or HF model folder") from None
    renderer = Renderer.for_tokenizer(tokenizer, cfg.model.renderer)
    s = cfg.sampling
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_new_tokens=s.max_new_tokens, max_context_tokens=s.max_context_tokens)
    try:
        engine = make_engine(cfg.engine, path)
    except EngineError as exc:
        raise EvalRunError(f"engine {cfg.engine.name!r} for {path}: {exc}") from None
    except ImportError as exc:
        raise EvalRunError(f"engine {cfg.engine.name!r} needs {exc.name}, which is not installed here "
                           f"(engine=hf runs anywhere)") from None
    bar = Progress(sum(len(jobs) for _, _, jobs in plans), f"eval {label}", progress)

    def on_record(rec: dict) -> None:
        write(rec)
        bar.update(rec)

    async def main() -> list[dict]:
        out: list[dict] = []
        for env_cfg, url, jobs in plans:
            env = env_cfg.env.name
            pool = pool_factory(env, url, env_cfg)
            try:
                out += await play_all(engine=engine, renderer=renderer, parser=parser_for(env), prompt=instruction(env),
                                      sampling=sampling, pool=pool, checkpoint=label, env=env, split=split, jobs=jobs,
                                      concurrency=concurrency, seed=cfg.learner.seed, on_record=on_record)
            finally:
                await pool.aclose()
        return out

    try:
        return trio.run(main)
    finally:
        engine.close()
