"""``turnscale run``: the whole system on one machine, as separate processes over 127.0.0.1.

``run(cfg)`` reads top to bottom:

1. task files for the run's task mix (BabyAI levels, or ``env=web``'s world seeds;
   warm-up, train, held-out test seeds);
2. oracle conversations for the warm start, and the tiny model built on their text
   (``model.path=tiny``; any other ``model.path`` is used as it is); with ``run.adapt``
   (BabyAI) the oracle's play is surveyed first and the turn limits fitted to the level mix
   (``turnscale/recipe.py``);
3. an envhub server; warm start: ``turnscale learner algo=sft`` on those conversations
   (offline SFT), in up to ``run.warm_start.rounds`` rounds until a probe on training tasks
   predicts enough GRPO groups with mixed rewards (else a warning says what to change);
4. held-out success of the warm-started model (``turnscale eval``);
5. RL: ``turnscale learner`` (GRPO, asynchronous, ScalingInter-RL schedule) initialised
   from the warm start, and ``run.actors`` ``turnscale actor`` processes; progress lines
   from the learner's ``metrics.jsonl`` until the learner finishes its steps;
6. held-out success of the final checkpoint; ``summary.json``, plots, the summary table.

Children get the resolved config as explicit ``++key=value`` overrides (``child_overrides``),
so every process sees exactly the launcher's configuration.  Each child is started and
ended by pid (``common.procs``); its log is ``<run.dir>/logs/<name>.log``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from turnscale.conf.schema import Config
from turnscale.common.procs import ChildFailed, ProcessGroup, wait_http_ok

DEFAULT_EXPERIMENT = "run_babyai"


def default_experiment(overrides: Sequence[str]) -> str:
    """``run_<env>`` when the command line names an env that has such an experiment file
    (``turnscale run env=web`` -> ``experiment=run_web``), else ``DEFAULT_EXPERIMENT``."""
    from turnscale import conf
    env = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("env=")), "")
    if env and (Path(conf.__file__).parent / "experiment" / f"run_{env}.yaml").exists():
        return f"run_{env}"
    return DEFAULT_EXPERIMENT


# ----------------------------------------------------------------------------- config


def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _quote(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot pass {type(v).__name__} as an override")


def option_overrides(section: str, options: dict[str, Any], skip: Sequence[str] = ()) -> list[str]:
    """``++<section>.<key>=<value>`` for every leaf of ``options`` (nested dicts flattened),
    leaving out the top-level keys in ``skip``."""
    out: list[str] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        else:
            out.append(f"++{prefix}={_value(obj)}")

    for k, v in options.items():
        if k not in skip:
            walk(f"{section}.{k}", v)
    return out


def child_overrides(cfg: Config, sections: Sequence[str], **changes: Any) -> list[str]:
    """``++key=value`` for every leaf of ``sections`` of ``cfg``, then ``changes``
    (``learner__port=5`` sets ``learner.port``).  Dict-valued fields become one override
    per key."""
    out: dict[str, str] = {}

    def walk(prefix: str, obj: Any) -> None:
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(f"{prefix}.{f.name}", getattr(obj, f.name))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = _value(obj)

    for s in sections:
        walk(s, getattr(cfg, s))
    for key, v in changes.items():
        out[key.replace("__", ".")] = _value(v)
    return [f"++{k}={v}" for k, v in out.items()]


# ----------------------------------------------------------------------------- tasks


def _range(spec: str) -> range:
    a, _, b = spec.partition(":")
    return range(int(a), int(b))


def task_ids(levels: Sequence[int], seeds: str) -> list[int]:
    """BabyAI ids of ``levels`` (``data_idx % 40``) for every seed in ``seeds`` (``a:b``)."""
    return [lvl + 40 * s for s in _range(seeds) for lvl in levels]


def run_task_mix(env) -> tuple[Any, str]:
    """``(seeds 'a:b' -> task ids, description)`` of the run's task mix: BabyAI's levels
    (``env.options.levels``) per seed, or every task of each world seed for ``env=web``."""
    if env.name == "web":
        from turnscale.envhub.web import seed_task_ids

        return (lambda seeds: seed_task_ids(_range(seeds))), "web sites (every template per world seed)"
    from turnscale.envhub.babyai import run_levels

    levels = run_levels(env.options)
    return (lambda seeds: task_ids(levels, seeds)), f"{len(levels)} BabyAI levels"


def write_tasks(path: Path, ids: Sequence[int]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(ids)))
    return str(path)


# ----------------------------------------------------------------------------- stages


class Launcher:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.run.dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessGroup(self.dir / "logs", "turnscale")
        self.t0 = time.monotonic()
        self.recipe: dict | None = None
        """The fitted recipe (``fit_recipe``), its warm-start rounds and advice; None unless adapted."""

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.0f}s] {msg}", flush=True)

    def deadline_left(self) -> float:
        return self.cfg.run.timeout_s - (time.monotonic() - self.t0)

    def wait(self, child, what: str) -> None:
        """Wait for a child to exit 0 within the run's time budget."""
        while child.alive():
            if self.deadline_left() <= 0:
                raise ChildFailed(f"{what}: run.timeout_s={self.cfg.run.timeout_s:.0f} exceeded")
            time.sleep(0.5)
        if child.popen.returncode != 0:
            raise ChildFailed(f"{what} exited with {child.popen.returncode}:\n{child.tail()}")

    def engine_python(self) -> str:
        """The interpreter of engine processes (``run.actor_python``, resolved; empty: ours)."""
        py = self.cfg.run.actor_python
        return os.path.abspath(py) if py and os.sep in py else py  # not resolve(): a venv's python is a symlink

    def check_engine_python(self) -> None:
        """Fail before any work when the engine processes' Python lacks the engine's package."""
        import subprocess

        py = self.engine_python() or sys.executable
        if not (shutil.which(py) or os.access(py, os.X_OK)):
            raise ChildFailed(f"run.actor_python={self.cfg.run.actor_python!r} is not an executable Python")
        if self.cfg.engine.name != "vllm":
            return
        probe = subprocess.run([py, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        if probe.returncode != 0:
            raise ChildFailed(f"engine=vllm: vLLM is not installed for {py}. On CPU: bash scripts/setup_vllm.sh, then "
                              f"run.actor_python=.venv-vllm/bin/python (engine.device=cpu engine.dtype=float32)")

    # 1-2
    def prepare(self, adapt: bool | None = None) -> tuple[dict[str, str], str, str]:
        """Task files, warm-start conversations and the model.  With ``adapt`` (default
        ``run.adapt``; BabyAI only) the oracle's play is surveyed first and the turn limits
        are fitted to the mix (``fit_recipe``), changing ``self.cfg`` before any child starts."""
        from turnscale.common.tinymodel import ensure_model
        from turnscale.warmstart import conversations_from_runs, corpus_from_conversations, oracle_runs, write_conversations

        rc, env = self.cfg.run, self.cfg.env
        adapt = (rc.adapt if adapt is None else adapt) and env.name == "babyai"
        ids_of, mix = run_task_mix(env)
        tasks_dir = self.dir / "tasks"
        train_ids = ids_of(rc.train_seeds)
        files = {
            "warmup": write_tasks(tasks_dir / "warmup.json", ids_of(rc.warmup_seeds)),
            "train": write_tasks(tasks_dir / "train.json", train_ids),
            "test": write_tasks(tasks_dir / "test.json", ids_of(rc.test_seeds)),
        }
        sft_path = self.dir / "warmstart" / "conversations.jsonl"
        warm_ids = json.loads(Path(files["warmup"]).read_text())[: rc.warm_start.episodes]
        cap = max(rc.adapt_max_turns, rc.warm_start.max_turns) if adapt else rc.warm_start.max_turns
        runs = list(oracle_runs(env.name, warm_ids, max_turns=cap, options=dict(env.options)))
        if adapt:
            self.fit_recipe(runs, cap)
            n_levels = len(self.recipe["survey"])
            files["probe"] = write_tasks(tasks_dir / "probe.json", train_ids[: n_levels * rc.warm_start.probe_tasks_per_level])
        noise = rc.warm_start.action_noise
        if noise:  # the fit above surveyed the oracle's own play; the demonstrations fumble
            runs = list(oracle_runs(env.name, warm_ids, max_turns=cap, options=dict(env.options), action_noise=noise))
        n = write_conversations(sft_path, conversations_from_runs(env.name, runs, self.cfg.run.warm_start.max_turns))
        what = f"demonstrations ({noise:.0%} of turns a random action)" if noise else "oracle conversations"
        self.say(f"warm start data: {n} {what} on {mix} -> {sft_path}")
        model_path = ensure_model(self.cfg.model, lambda: corpus_from_conversations(sft_path))
        self.say(f"model: {model_path}")
        if adapt and self.recipe["fit"]["changed"]:  # a mix the schedule covers keeps the calibrated context too
            self.fit_context(model_path, sft_path)
        return files, str(sft_path), model_path

    def fit_context(self, model_path: str, sft_path: Path) -> None:
        """Fit ``sampling.max_context_tokens`` to the fitted horizon (``recipe.fit_context``),
        measured on the warm-start conversations with the model's own tokenizer; when the
        model's positions cannot hold the horizon, the turn limits are capped to what fits."""
        from transformers import AutoConfig, AutoTokenizer

        from turnscale import recipe
        from turnscale.common.renderer import Renderer
        from turnscale.learner.sft_data import conversation_to_episode

        cfg = self.cfg
        renderer = Renderer.for_tokenizer(AutoTokenizer.from_pretrained(model_path))
        lengths = []
        with open(sft_path, encoding="utf-8") as f:
            for line in f:
                msgs = json.loads(line)["messages"]
                first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
                lengths.append((len(renderer.initial(msgs[:first])), len(conversation_to_episode(renderer, msgs).token_ids),
                                sum(m["role"] == "assistant" for m in msgs)))
        model_max = int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 0) or cfg.sampling.max_context_tokens)
        horizon = max(cfg.schedule.turns)
        c = recipe.fit_context(lengths, horizon, cfg.sampling.max_context_tokens, model_max)
        if c.note:
            self.say(f"recipe: {c.note}")
        cfg.sampling = dataclasses.replace(cfg.sampling, max_context_tokens=c.tokens)
        if c.horizon < horizon:
            turns = recipe.stretch(cfg.schedule.turns, min(cfg.schedule.turns[0], c.horizon), c.horizon)
            cfg.schedule = dataclasses.replace(cfg.schedule, turns=list(turns))
            cfg.run = dataclasses.replace(cfg.run, eval_turns=min(cfg.run.eval_turns, c.horizon))
        self.recipe["context"] = dataclasses.asdict(c)

    def fit_recipe(self, runs: list[tuple], cap: int) -> None:
        """Survey the oracle's ``runs`` and fit the turn limits (``recipe.fit``) into
        ``self.cfg``; the survey and the fit go to ``self.recipe`` (``summary.json``)."""
        from turnscale import recipe

        cfg = self.cfg
        surveys = recipe.survey_runs(runs)
        for line in recipe.survey_lines(surveys):
            self.say(f"survey: {line}")
        f = recipe.fit(surveys, cfg.schedule.turns, cfg.run.eval_turns, cfg.run.warm_start.max_turns, cap)
        for note in f.notes:
            self.say(f"recipe: {note}")
        if f.changed:
            cfg.schedule = dataclasses.replace(cfg.schedule, turns=list(f.schedule))
            cfg.run = dataclasses.replace(cfg.run, eval_turns=f.eval_turns)
            if cfg.run.adapt_loss_agg and cfg.run.adapt_loss_agg != cfg.algo.loss_agg:
                self.say(f"recipe: algo.loss_agg {cfg.algo.loss_agg} -> {cfg.run.adapt_loss_agg} for long episodes "
                         f"(run.adapt_loss_agg; every episode weighs the same, whatever its length)")
                cfg.algo = dataclasses.replace(cfg.algo, loss_agg=cfg.run.adapt_loss_agg)
        cfg.run.warm_start = dataclasses.replace(cfg.run.warm_start, max_turns=f.max_turns)
        self.say(f"recipe: turn limits {cfg.schedule.turns} every {cfg.schedule.every} steps, evaluation within "
                 f"{cfg.run.eval_turns} turns, warm-start episodes up to {f.max_turns} turns")
        self.recipe = {"survey": [dataclasses.asdict(s) | {"solve_rate": s.solve_rate} for s in surveys],
                       "fit": dataclasses.asdict(f), "context": None, "rounds": [], "advice": None}

    # 3
    def warm_start(self, model_path: str, sft_path: str, round_: int = 1) -> str:
        """One SFT round from ``model_path``; the model directory of its checkpoint."""
        from turnscale.learner import checkpoint
        from turnscale.recipe import round_steps

        ws = self.cfg.run.warm_start
        steps = round_steps(ws.steps, round_)
        out = self.dir / "warmstart" / (f"round-{round_}" if round_ > 1 else "")
        args = ["learner", "algo=sft"] + child_overrides(
            self.cfg, ["model", "sampling", "logger"],
            model__path=model_path, algo__lr=ws.lr, learner__dir=str(out), learner__steps=steps,
            learner__groups_per_step=ws.batch_episodes, learner__sft_data=sft_path, learner__checkpoint_every=steps,
            learner__keep_checkpoints=1, learner__seed=self.cfg.learner.seed + round_ - 1, logger__tensorboard=False,
        )
        self.say(f"warm start{f' round {round_}' if ws.rounds > 1 else ''}: SFT, {steps} steps of {ws.batch_episodes} conversations")
        self.wait(self.procs.start(f"warmstart{f'-{round_}' if round_ > 1 else ''}", args), "warm start (turnscale learner algo=sft)")
        ck = checkpoint.latest(str(out / "checkpoints"))
        if ck is None:
            raise ChildFailed(f"warm start wrote no checkpoint under {out / 'checkpoints'}")
        return os.path.join(ck, "model")

    def warm_start_until_signal(self, model_path: str, sft_path: str, files: dict[str, str], env_url: str) -> str:
        """SFT rounds until a probe on training tasks predicts enough GRPO groups with mixed
        rewards (``recipe.advice``), at most ``run.warm_start.rounds``; the probe runs at the
        first stage's turn limit, where RL starts.  Without a fitted recipe: one round."""
        from turnscale import recipe

        ws = self.cfg.run.warm_start
        model = self.warm_start(model_path, sft_path)
        if self.recipe is None:
            return model
        turns = self.cfg.schedule.turns[0]
        group = self.cfg.algo.group_size
        sft_steps = 0
        for k in range(1, ws.rounds + 1):
            if k > 1:
                model = self.warm_start(model, sft_path, k)
            sft_steps += recipe.round_steps(ws.steps, k)
            doc = self.evaluate_doc(f"probe_warm_start_{k}", model, files["probe"], env_url, [turns], samples=1)
            success = success_by_category(doc, turns)
            adv = recipe.advice(success, group, ws.min_mixed, ws.rounds - k)
            self.recipe["rounds"].append({"round": k, "sft_steps": sft_steps, "turn_limit": turns, "success": success,
                                          "predicted_mixed": recipe.predicted_mixed(success, group)})
            self.recipe["advice"] = dataclasses.asdict(adv)
            self.say(f"warm start round {k}: probe success " + ", ".join(f"{lvl.removeprefix('BabyAI-')} {p:.2f}" for lvl, p in success.items())
                     + f" within {turns} turns; {adv.message}")
            if adv.verdict != "more_sft":
                break
        return model

    # 4
    def start_envhub(self) -> str:
        """The env server's URL: ``env.url`` when set (a server already running, e.g. AgentGym's
        own with ``env.options.flavor=agentgym``), else a local envhub started with the run's
        ``env.options``."""
        from turnscale.protocol.transport import free_port

        if self.cfg.env.url:
            self.say(f"env server {self.cfg.env.url} ({self.cfg.env.client_flavor}), not started here")
            return self.cfg.env.url
        port = free_port()
        options = option_overrides("env.options", self.cfg.env.options, skip=("flavor",))
        child = self.procs.start("envhub", ["envhub", f"env={self.cfg.env.name}", "host=127.0.0.1", f"port={port}", *options])
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", 120, child)
        self.say(f"envhub {self.cfg.env.name} at {url} (pid {child.pid})")
        return url

    def evaluate(self, name: str, model_dir: str, tasks_file: str, env_url: str) -> dict:
        """Held-out success of one model within ``run.eval_turns``."""
        return self.evaluate_turns(name, model_dir, tasks_file, env_url, [self.cfg.run.eval_turns])[self.cfg.run.eval_turns]

    def evaluate_turns(self, name: str, model_dir: str, tasks_file: str, env_url: str, turns: Sequence[int]) -> dict[int, dict]:
        """Held-out success of one model at each turn limit of ``turns`` (one ``turnscale eval``),
        with success per category (level) under ``by_category``."""
        doc = self.evaluate_doc(name, model_dir, tasks_file, env_url, turns)
        found = {t: held_out_success(doc, t) | {"by_category": success_by_category(doc, t)} for t in turns}
        self.say(f"{name}: held-out success " + ", ".join(f"{v['success']:.3f} within {t} turns" for t, v in found.items())
                 + f" over {found[turns[0]]['episodes']} episodes")
        return found

    def evaluate_doc(self, name: str, model_dir: str, tasks_file: str, env_url: str, turns: Sequence[int],
                     samples: int | None = None) -> dict:
        """``eval.json`` of one ``turnscale eval`` of ``model_dir`` on ``tasks_file``."""
        rc = self.cfg.run
        out = self.dir / name
        args = ["eval", "--model", f"{model_dir}={name}", "--env", self.cfg.env.name, "--tasks", tasks_file,
                "--turns", ",".join(str(t) for t in turns), "--samples", str(samples or rc.eval_samples), "--out", str(out),
                "--no-progress", *child_overrides(self.cfg, ["sampling", "engine"], env__url=env_url),
                *option_overrides("env.options", self.cfg.env.options)]
        self.wait(self.procs.start(name, args, python=self.engine_python()), f"evaluation {name}")
        return json.loads((out / "eval.json").read_text())

    # 5
    def rl(self, init_from: str, files: dict[str, str], env_url: str) -> Path:
        from turnscale.protocol.transport import free_port

        lc = self.cfg.learner
        ldir = self.dir / "learner"
        ports = dict(learner__port=free_port(), learner__pub_port=free_port(), learner__weights_port=free_port())
        largs = ["learner"] + child_overrides(
            self.cfg, ["env", "model", "algo", "sampling", "schedule", "logger", "learner"],
            learner__dir=str(ldir), learner__init_from=init_from, learner__host="127.0.0.1",
            env__url=env_url, env__tasks__train=files["train"], env__tasks__test=files["test"], **ports,
        )
        learner = self.procs.start("learner", largs)
        self.say(f"learner (pid {learner.pid}): {self.cfg.algo.name}, {lc.steps} steps, max_staleness {lc.max_staleness}, "
                 f"turn limits {self.cfg.schedule.turns} every {self.cfg.schedule.every} steps")
        for i in range(self.cfg.run.actors):
            aargs = ["actor"] + child_overrides(self.cfg, ["engine", "actor"], actor__learner_host="127.0.0.1",
                                                actor__learner_port=ports["learner__port"], actor__actor_id=f"actor-{i}")
            a = self.procs.start(f"actor-{i}", aargs, python=self.engine_python())
            self.say(f"actor-{i} (pid {a.pid})")
        self.follow(learner, ldir / "metrics.jsonl")
        return ldir

    def follow(self, learner, metrics_path: Path) -> None:
        from turnscale.learner.metrics import format_progress

        seen, last_print = 0, 0.0
        every = self.cfg.logger.console_every_s
        while learner.alive():
            if self.deadline_left() <= 0:
                raise ChildFailed(f"RL: run.timeout_s={self.cfg.run.timeout_s:.0f} exceeded")
            for c in self.procs.children:
                if c.name.startswith("actor") and not c.alive() and c.popen.returncode not in (0, None):
                    self.say(f"{c.name} exited with {c.popen.returncode} (see {c.log_path})")
            rows = _read_rows(metrics_path)
            if len(rows) > seen and time.monotonic() - last_print >= every:
                seen, last_print = len(rows), time.monotonic()
                self.say(format_progress(rows[-1]["step"], rows[-1]))
            time.sleep(0.5)
        if learner.popen.returncode != 0:
            raise ChildFailed(f"learner exited with {learner.popen.returncode}:\n{learner.tail()}")
        for c in self.procs.children:
            if c.name.startswith("actor"):
                c.stop(self.cfg.actor.shutdown_grace_s + 5)


def _read_rows(path: Path) -> list[dict]:
    from turnscale.report import read_metrics

    return read_metrics(path)


def held_out_success(doc: dict, turn_limit: int | None = None) -> dict:
    """Overall success of one checkpoint from an ``eval.json`` (``turnscale.evalreport``):
    the row with ``category == ""`` (all sub-tasks of the env), at ``turn_limit`` (any when None)."""
    rows = [r for r in doc.get("rows", []) if r.get("category") == "" and r.get("env")
            and (turn_limit is None or int(r.get("turn_limit", -1)) == turn_limit)]
    if not rows or rows[0].get("success") is None:
        raise ChildFailed("evaluation wrote no overall row (every episode failed?)")
    r = rows[0]
    return {"success": float(r["success"]), "mean_reward": float(r["mean_reward"] or 0.0), "episodes": int(r["episodes"]),
            "errors": int(r["errors"]), "mean_turns": float(r["mean_turns"] or 0.0), "turn_limit": int(r["turn_limit"])}


def success_by_category(doc: dict, turn_limit: int) -> dict[str, float]:
    """Success per category (BabyAI: level) at ``turn_limit`` from an ``eval.json``."""
    return {r["category"]: float(r["success"]) for r in doc.get("rows", [])
            if r.get("category") and r.get("success") is not None and int(r.get("turn_limit", -1)) == turn_limit}


def run(cfg: Config) -> int:
    from turnscale.learner import checkpoint
    from turnscale.report import summary_table, write_plots

    launcher = Launcher(cfg)
    say = launcher.say
    say(f"turnscale run -> {launcher.dir}")
    previous = _exit_on_signals()
    try:
        launcher.check_engine_python()
        files, sft_path, model_path = launcher.prepare()
        env_url = launcher.start_envhub()
        warm_model = (launcher.warm_start_until_signal(model_path, sft_path, files, env_url)
                      if cfg.run.warm_start.steps > 0 else model_path)
        warm = launcher.evaluate("eval_warm_start", warm_model, files["test"], env_url)
        ldir = launcher.rl(warm_model, files, env_url)
        ck = checkpoint.latest(str(ldir / "checkpoints"))
        if ck is None:
            raise ChildFailed(f"the learner wrote no checkpoint under {ldir / 'checkpoints'}")
        final = launcher.evaluate("eval_final", os.path.join(ck, "model"), files["test"], env_url)
        rows = _read_rows(ldir / "metrics.jsonl")
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            src, dst = ldir / name, launcher.dir / name
            if src.exists():
                if dst.exists() or dst.is_symlink():
                    dst.unlink()
                os.symlink(os.path.relpath(src, launcher.dir), dst)
        summary = {
            "warm_start": warm,
            "final": final,
            "steps": int(rows[-1]["step"]) if rows else 0,
            "wall_s": time.monotonic() - launcher.t0,
            "checkpoint": ck,
            "recipe": launcher.recipe,
            "config": dataclasses.asdict(cfg),
        }
        (launcher.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plots = write_plots(launcher.dir, rows)
        print("\n" + summary_table(summary))
        say(f"wrote {launcher.dir / 'summary.json'}, {', '.join(p.name for p in plots)}; browse with: turnscale view {launcher.dir}")
        return 0
    except ChildFailed as exc:
        print(f"turnscale run: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in previous:  # a second signal must not interrupt the clean-up below
            signal.signal(sig, signal.SIG_IGN)
        try:
            launcher.procs.close()
        except Exception as exc:  # reported, and never in place of the run's own outcome (e.g. exit 143)
            print(f"turnscale run: stopping the children: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_on_signals() -> dict[int, Any]:
    """SIGTERM and SIGHUP (``kill``, ``timeout``, a batch scheduler, a closed terminal) end
    the run through its ``finally``, which stops every child by pid; Python's default would
    exit at once and leave them running.  Returns the handlers replaced (none off the main
    thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, frame: Any) -> None:
        print(f"turnscale run: {signal.Signals(signum).name}; stopping the envhub, learner and actors", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}


def main(argv: Sequence[str] = ()) -> int:
    from turnscale import conf
    overrides = list(argv)
    if not any(o.lstrip("+").startswith("experiment=") for o in overrides):
        overrides.insert(0, f"experiment={default_experiment(overrides)}")
    cfg = conf.load(overrides)
    return run(cfg)
