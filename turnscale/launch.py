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

Stopping (``turnscale.runcontrol``): ``run.timeout_s`` (default 0: no limit), SIGINT (Ctrl-C),
SIGTERM or SIGHUP end *training* gracefully: the SFT of the warm start is dropped, or the
learner checkpoints (its own SIGTERM handling) and RL ends; the newest checkpoint is then
evaluated held out as after a finished run (a second signal skips that), and ``summary.json``,
the plots and the table are written with the reason (``stopped: time limit after step 44 of
60``).  The exit code is 0 whenever something was evaluated.  Each phase done is recorded in
``<run.dir>/run_state.json`` (the fitted config in ``run_config.yaml``), so
``turnscale run run.resume=true run.dir=<same>`` continues from the learner's checkpoint
without repeating the warm start or its evaluation.  Time estimates of the phases left are
printed once measured (after the first warm-start round, the warm start's evaluation and the
first RL steps) and appended to the progress lines.

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
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from turnscale.conf.schema import Config
from turnscale.common.procs import ChildFailed, ProcessGroup, wait_http_ok
from turnscale.runcontrol import RunPhases, RunStop, RunStopped, duration, eta_line, rl_pace

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


RUN_CONFIG = "run_config.yaml"
"""The run's configuration after the recipe fit, in ``run.dir``; ``run.resume=true`` reads it."""

LEARNER_STOP_GRACE_S = 600.0
"""How long a stopping learner may take to finish its step and checkpoint before SIGKILL."""


class Launcher:
    def __init__(self, cfg: Config, stop: RunStop | None = None) -> None:
        self.dir = Path(cfg.run.dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessGroup(self.dir / "logs", "turnscale")
        self.t0 = time.monotonic()
        self.stop = stop or RunStop()
        self.phases = RunPhases(self.dir)
        self.cfg = self.resumed_config(cfg) if cfg.run.resume else cfg
        if not cfg.run.resume:
            self.phases.clear()
        self.phase = "preparation"
        """The phase running now (named in a stop's reason)."""
        self.recipe: dict | None = None
        """The fitted recipe (``fit_recipe``), its warm-start rounds and advice; None unless adapted."""
        self.eval_s: float | None = None
        """Wall time of the warm start's held-out evaluation (the final one's estimate)."""

    def resumed_config(self, cfg: Config) -> Config:
        """The stopped run's own configuration (``RUN_CONFIG``, fitted), with this command
        line's ``run.timeout_s``, ``run.resume`` and ``logger.console_every_s``; ``cfg`` itself
        when the run stopped before its config was written (it starts over)."""
        from turnscale import conf

        saved = self.dir / RUN_CONFIG
        if not saved.exists() or not self.phases.get("prepared"):
            self.phases.clear()
            return cfg
        old = conf.load_file(str(saved))
        old.run = dataclasses.replace(old.run, timeout_s=cfg.run.timeout_s, resume=True, dir=cfg.run.dir)
        old.logger = dataclasses.replace(old.logger, console_every_s=cfg.logger.console_every_s)
        return old

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.0f}s] {msg}", flush=True)

    def deadline_left(self) -> float:
        """Seconds to ``run.timeout_s`` (infinite without a limit)."""
        limit = self.cfg.run.timeout_s
        return limit - (time.monotonic() - self.t0) if limit > 0 else float("inf")

    def check_limit(self) -> None:
        """Request a stop once ``run.timeout_s`` has passed."""
        if self.deadline_left() <= 0 and not self.stop.requested:
            self.stop.request("time limit")
            self.say(f"time limit: run.timeout_s={self.cfg.run.timeout_s:.0f} passed during {self.phase}; stopping gracefully")

    def wait(self, child, what: str, training: bool = False) -> None:
        """Wait for a child to exit 0.  A stop ends a ``training`` child at once (SIGTERM) and
        an evaluation only when it skips evaluations (a second signal); either raises ``RunStopped``."""
        while child.alive():
            if training:  # the limit ends training; an evaluation under way finishes
                self.check_limit()
            if self.stop.requested and (training or self.stop.skip_eval):
                child.stop(self.cfg.actor.shutdown_grace_s + 5)
                raise RunStopped(what)
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
        self.wait(self.procs.start(f"warmstart{f'-{round_}' if round_ > 1 else ''}", args), "warm start (turnscale learner algo=sft)",
                  training=True)
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
        t_round = time.monotonic()
        model = self.warm_start(model_path, sft_path)
        if self.recipe is None:
            return model
        turns = self.cfg.schedule.turns[0]
        group = self.cfg.algo.group_size
        sft_steps = 0
        for k in range(1, ws.rounds + 1):
            if k > 1:
                self.say(f"estimate: warm start round {k} of at most {ws.rounds}: under {duration(2 * (time.monotonic() - t_round))} "
                         f"(twice the SFT steps of round {k - 1}, and a probe)")
                t_round = time.monotonic()
                model = self.warm_start(model, sft_path, k)
            sft_steps += recipe.round_steps(ws.steps, k)
            doc = self.evaluate_doc(f"probe_warm_start_{k}", model, files["probe"], env_url, [turns], samples=1, training=True)
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
                     samples: int | None = None, training: bool = False) -> dict:
        """``eval.json`` of one ``turnscale eval`` of ``model_dir`` on ``tasks_file`` (a
        ``training`` evaluation, the warm start's probe, ends at once on a stop)."""
        rc = self.cfg.run
        out = self.dir / name
        args = ["eval", "--model", f"{model_dir}={name}", "--env", self.cfg.env.name, "--tasks", tasks_file,
                "--turns", ",".join(str(t) for t in turns), "--samples", str(samples or rc.eval_samples), "--out", str(out),
                "--no-progress", *child_overrides(self.cfg, ["sampling", "engine"], env__url=env_url),
                *option_overrides("env.options", self.cfg.env.options)]
        self.wait(self.procs.start(name, args, python=self.engine_python()), f"evaluation {name}", training=training)
        return json.loads((out / "eval.json").read_text())

    # phases, each recorded in run_state.json when done

    def execute(self) -> int:
        """Every phase in order; a stop (``RunStopped``) skips the rest, then ``finish``."""
        warm = final = None
        try:
            files, sft_path, model_path = self.prepared()
            env_url = self.in_process(self.start_envhub)
            warm_model = self.warm_started(model_path, sft_path, files, env_url)
            warm = self.warm_evaluated(warm_model, files, env_url)
            ldir = self.trained(warm_model, files, env_url)
            final = self.final_evaluated(ldir, files, env_url)
        except RunStopped:
            pass  # what was evaluated is written below
        return self.finish(warm, final)

    def in_process(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, in-process work with no child to poll (seconds: the oracle's play, the tiny
        model, the envhub's start); a stop requested before or during it raises ``RunStopped``
        once it is done (signal handlers only set a flag: raising from one could leave an
        import half done)."""
        if self.stop.requested:
            raise RunStopped(self.phase)
        out = fn()
        if self.stop.requested:
            raise RunStopped(self.phase)
        return out

    def prepared(self) -> tuple[dict[str, str], str, str]:
        """``prepare`` (signals stop it at once: ``RunStopped``), then the fitted config is saved
        for a resume; on resume, what the stopped run prepared."""
        from turnscale import conf

        done = self.phases.get("prepared")
        if done:
            self.recipe = done["recipe"]
            self.say(f"resume: task files, warm-start data and model {done['model_path']} from the stopped run; "
                     f"its configuration from {self.dir / RUN_CONFIG}")
            return done["files"], done["sft_path"], done["model_path"]
        files, sft_path, model_path = self.in_process(self.prepare)
        conf.save(self.cfg, str(self.dir / RUN_CONFIG))
        self.phases.mark("prepared", {"files": files, "sft_path": sft_path, "model_path": model_path, "recipe": self.recipe})
        self.say_plan(files)
        return files, sft_path, model_path

    def say_plan(self, files: dict[str, str]) -> None:
        """The phases ahead and their sizes (their times follow once measured)."""
        from turnscale.recipe import round_steps

        rc, lc = self.cfg.run, self.cfg.learner
        ws = rc.warm_start
        rounds = ws.rounds if self.recipe is not None else 1
        episodes = len(json.loads(Path(files["test"]).read_text())) * rc.eval_samples
        sft = ", ".join(str(round_steps(ws.steps, k)) for k in range(1, rounds + 1))
        self.say(f"plan: warm start {f'up to {rounds} rounds of {sft}' if rounds > 1 else sft} SFT steps, "
                 f"held-out evaluation of {episodes} episodes, RL {lc.steps} steps, final evaluation of {episodes} episodes; "
                 f"times are estimated as each phase is measured" if ws.steps > 0 else
                 f"plan: no warm start, held-out evaluation of {episodes} episodes, RL {lc.steps} steps, final evaluation")

    def warm_started(self, model_path: str, sft_path: str, files: dict[str, str], env_url: str) -> str:
        """The warm-start model (``warm_start_until_signal``; the base model without SFT steps)."""
        done = self.phases.get("warm_start")
        if done:
            self.recipe = done["recipe"]
            self.say(f"resume: warm start done ({done['model']})")
            return done["model"]
        self.phase = "warm start"
        if self.stop.requested:
            raise RunStopped(self.phase)
        model = self.warm_start_until_signal(model_path, sft_path, files, env_url) if self.cfg.run.warm_start.steps > 0 else model_path
        self.phases.mark("warm_start", {"model": model, "recipe": self.recipe})
        return model

    def warm_evaluated(self, warm_model: str, files: dict[str, str], env_url: str) -> dict:
        """Held-out success of the warm start (runs to its end after a first stop); its wall
        time is the final evaluation's estimate."""
        done = self.phases.get("eval_warm_start")
        if done:
            self.eval_s = done["wall_s"]
            self.say(f"resume: warm start evaluated (held-out success {done['result']['success']:.3f})")
            return done["result"]
        self.phase = "warm-start evaluation"
        t = time.monotonic()
        warm = self.evaluate("eval_warm_start", warm_model, files["test"], env_url)
        self.eval_s = time.monotonic() - t
        self.phases.mark("eval_warm_start", {"result": warm, "wall_s": self.eval_s})
        self.say(f"estimate: a held-out evaluation takes ~{duration(self.eval_s)}; RL's pace is measured after its first steps")
        return warm

    def trained(self, warm_model: str, files: dict[str, str], env_url: str) -> Path:
        """RL until its last step or a stop (not started after one); recorded as done only at
        its last step."""
        ldir = self.dir / "learner"
        self.check_limit()
        if self.phases.get("rl") or self.stop.requested:
            return ldir
        self.phase = "RL"
        self.rl(warm_model, files, env_url)
        if checkpoint_step(ldir) >= self.cfg.learner.steps:
            self.phases.mark("rl", {"done": True})
        return ldir

    def final_evaluated(self, ldir: Path, files: dict[str, str], env_url: str) -> dict | None:
        """Held-out success of the newest RL checkpoint; None when a stop came before one."""
        from turnscale.learner import checkpoint

        ck = checkpoint.latest(str(ldir / "checkpoints"))
        if ck is None:
            if self.stop.requested:
                return None
            raise ChildFailed(f"the learner wrote no checkpoint under {ldir / 'checkpoints'}")
        if self.stop.skip_eval:
            return None
        self.phase = "final evaluation"
        return self.evaluate("eval_final", os.path.join(ck, "model"), files["test"], env_url)

    def stop_reason(self, step: int, final: dict | None) -> str | None:
        """``stopped: <cause> after step N of M`` (or ``during the <phase>``); None when the
        run finished and was evaluated (a first signal during the final evaluation cuts nothing)."""
        if not self.stop.requested or (final is not None and self.phases.get("rl")):
            return None
        where = f"after step {step} of {self.cfg.learner.steps}" if step else f"during the {self.phase}"
        return f"stopped: {self.stop.cause} {where}" + ("; evaluation skipped" if self.stop.skip_eval else "")

    def finish(self, warm: dict | None, final: dict | None) -> int:
        """``summary.json`` (with the stop's reason), plots and the table; the exit code: 0 when
        the run finished, or when a stopped run evaluated something."""
        from turnscale.learner import checkpoint
        from turnscale.report import summary_table, write_plots

        ldir = self.dir / "learner"
        rows = _read_rows(ldir / "metrics.jsonl")
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            src, dst = ldir / name, self.dir / name
            if src.exists():
                if dst.exists() or dst.is_symlink():
                    dst.unlink()
                os.symlink(os.path.relpath(src, self.dir), dst)
        step = checkpoint_step(ldir)
        reason = self.stop_reason(step, final)
        summary = {
            "stopped": reason,
            "warm_start": warm,
            "final": final,
            "steps": step,
            "steps_planned": self.cfg.learner.steps,
            "wall_s": time.monotonic() - self.t0,
            "checkpoint": checkpoint.latest(str(ldir / "checkpoints")) if final is not None else None,
            "recipe": self.recipe,
            "config": dataclasses.asdict(self.cfg),
        }
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plots = write_plots(self.dir, rows) if rows else []
        print("\n" + summary_table(summary), flush=True)
        self.say(f"wrote {self.dir / 'summary.json'}{''.join(', ' + p.name for p in plots)}; browse with: turnscale view {self.dir}")
        if reason is None:
            return 0
        self.say(f"{reason}; continue it with: turnscale run run.resume=true run.dir={self.dir}")
        return self.stop.exit_code(warm is not None or final is not None)

    # 5
    def rl(self, init_from: str, files: dict[str, str], env_url: str) -> Path:
        from turnscale.protocol.transport import free_port

        lc = self.cfg.learner
        ldir = self.dir / "learner"
        ports = dict(learner__port=free_port(), learner__pub_port=free_port(), learner__weights_port=free_port())
        largs = ["learner"] + child_overrides(
            self.cfg, ["env", "model", "algo", "sampling", "schedule", "logger", "learner"],
            learner__dir=str(ldir), learner__init_from=init_from, learner__host="127.0.0.1", learner__resume=self.cfg.run.resume,
            env__url=env_url, env__tasks__train=files["train"], env__tasks__test=files["test"], **ports,
        )
        learner = self.procs.start("learner", largs)
        ck = self.cfg.run.resume and checkpoint_step(ldir)
        self.say(f"learner (pid {learner.pid}): {self.cfg.algo.name}, {lc.steps} steps{f' (resuming at step {ck})' if ck else ''}, "
                 f"max_staleness {lc.max_staleness}, turn limits {self.cfg.schedule.turns} every {self.cfg.schedule.every} steps")
        for i in range(self.cfg.run.actors):
            aargs = ["actor"] + child_overrides(self.cfg, ["engine", "actor"], actor__learner_host="127.0.0.1",
                                                actor__learner_port=ports["learner__port"], actor__actor_id=f"actor-{i}")
            a = self.procs.start(f"actor-{i}", aargs, python=self.engine_python())
            self.say(f"actor-{i} (pid {a.pid})")
        self.follow(learner, ldir / "metrics.jsonl")
        return ldir

    def follow(self, learner, metrics_path: Path) -> None:
        """Progress lines (with the time left) until the learner ends its steps, or until a
        stop: then SIGTERM makes the learner finish its step and checkpoint (``learner.main``)."""
        from turnscale.learner.metrics import format_progress

        start_rows = len(_read_rows(metrics_path))  # a resumed learner appends to its file
        seen, last_print, announced = start_rows, 0.0, False
        every = self.cfg.logger.console_every_s
        while learner.alive():
            self.check_limit()
            if self.stop.requested:
                self.say(f"stopping the learner (pid {learner.pid}): it finishes its step and checkpoints")
                learner.stop(LEARNER_STOP_GRACE_S)
                break
            for c in self.procs.children:
                if c.name.startswith("actor") and not c.alive() and c.popen.returncode not in (0, None):
                    self.say(f"{c.name} exited with {c.popen.returncode} (see {c.log_path})")
            rows = _read_rows(metrics_path)
            if len(rows) > seen and time.monotonic() - last_print >= every:
                seen, last_print = len(rows), time.monotonic()
                pace = rl_pace(rows[start_rows:], self.cfg.learner.steps)
                if pace and not announced:
                    announced = True
                    self.announce_pace(*pace)
                self.say(format_progress(rows[-1]["step"], rows[-1])
                         + (f" | left: RL {duration(pace[1])}, final evaluation {duration(self.eval_s or 0)}" if pace else ""))
            time.sleep(0.5)
        if learner.popen.returncode != 0 and not self.stop.requested:
            raise ChildFailed(f"learner exited with {learner.popen.returncode}:\n{learner.tail()}")
        for c in self.procs.children:
            if c.name.startswith("actor"):
                c.stop(self.cfg.actor.shutdown_grace_s + 5)

    def announce_pace(self, step_s: float, rl_left_s: float) -> None:
        """After the first RL steps: the time to the end of each phase left, and where a time
        limit will stop RL at this pace."""
        self.say(f"estimate: {step_s:.1f} s per RL step; "
                 + eta_line([("RL", rl_left_s), ("final evaluation", self.eval_s)]))
        left = self.deadline_left()
        if left < rl_left_s:
            rows = _read_rows(self.dir / "learner" / "metrics.jsonl")
            at = int(rows[-1]["step"] + left / max(step_s, 1e-9)) if rows else 0
            self.say(f"estimate: run.timeout_s={self.cfg.run.timeout_s:.0f} will stop RL near step {at} of {self.cfg.learner.steps} "
                     f"at this pace (the newest checkpoint is then evaluated; run.resume=true continues)")


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


def checkpoint_step(ldir: Path) -> int:
    """The step of the learner's newest checkpoint under ``ldir`` (0: none)."""
    from turnscale.learner import checkpoint

    ck = checkpoint.latest(str(ldir / "checkpoints"))
    return int(Path(ck).name.removeprefix("step-")) if ck else 0


def run(cfg: Config) -> int:
    """The phases of a run, each skipped when ``run.resume`` finds it done; a stop (time
    limit, signal) ends training and still evaluates and writes the summary (``Launcher.finish``)."""
    stop = RunStop()
    launcher = Launcher(cfg, stop)
    stop.say = launcher.say
    launcher.say(f"turnscale run -> {launcher.dir}" + (" (resuming)" if launcher.phases.done else ""))
    limit = launcher.cfg.run.timeout_s
    launcher.say(f"time limit: run.timeout_s={limit:.0f} s, then training stops gracefully and the newest checkpoint is evaluated"
                 if limit else "no time limit (run.timeout_s=0); Ctrl-C stops gracefully: the newest checkpoint is still evaluated")
    previous = stop.install()
    try:
        launcher.check_engine_python()
        return launcher.execute()
    except ChildFailed as exc:
        print(f"turnscale run: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in previous:  # a further signal must not interrupt the clean-up below
            signal.signal(sig, signal.SIG_IGN)
        try:
            launcher.procs.close()
        except Exception as exc:  # reported, and never in place of the run's own outcome
            print(f"turnscale run: stopping the children: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] = ()) -> int:
    from turnscale import conf
    overrides = list(argv)
    if not any(o.lstrip("+").startswith("experiment=") for o in overrides):
        overrides.insert(0, f"experiment={default_experiment(overrides)}")
    cfg = conf.load(overrides)
    return run(cfg)
