"""What limits RL on ``turnscale run``'s default mix: one ``turnscale run`` per lever and seed.

Every run is the learning test's configuration (``turnscale run`` defaults, ``learner.steps``
RL steps, turn limits 3 -> 5) plus the lever's overrides; held-out success is the run's own
400-episode evaluation within ``run.eval_turns`` (3), before RL (the warm start) and after.
A lever that changes the warm start (more SFT steps, a bigger model) reports both, so the
``sft*`` levers are also the "same wall time spent on more SFT" control.  Measured in the
same runs (each run's own SFT and RL metrics): 40 RL steps at turn limits 3 -> 5 took as long
as 76-186 SFT steps (median ~150), 120 RL steps (up to 8 turns) ~540; so SFT 100 + 40 RL
steps is about SFT 250, and SFT 100 + 120 RL steps about SFT 640.

    python -m turnscale.benchmarks.levers --seeds 0,1 --levers base,layers4,sft100,sft300,group16 --out runs/levers

Runs ``--parallel`` at a time (default 2: this machine has 2 cores), skips a run whose
``summary.json`` exists (so an interrupted study resumes), and prints one markdown row per
lever: warm start, after RL and gain as mean ± sd over seeds, the per-seed gains, RL wall
time, and after-RL success per level.  Writes ``<out>/levers.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

LEVERS: dict[str, tuple[str, list[str]]] = {
    "base": ("default (2 layers x 128, SFT 20 steps, 4 groups x 8)", []),
    "layers4": ("4 layers x 128", ["model.tiny.num_layers=4"]),
    "wide": ("2 layers x 256 (heads 8/4, MLP 768)", ["model.tiny.hidden_size=256", "model.tiny.num_heads=8",
                                                     "model.tiny.num_kv_heads=4", "model.tiny.intermediate_size=768"]),
    "layers4_sft100": ("4 layers x 128, SFT 100 steps", ["model.tiny.num_layers=4", "run.warm_start.steps=100"]),
    "sft60": ("SFT 60 steps", ["run.warm_start.steps=60"]),
    "sft100": ("SFT 100 steps", ["run.warm_start.steps=100"]),
    "sft300": ("SFT 300 steps (more than SFT 100 + 40 RL steps take)", ["run.warm_start.steps=300"]),
    "sft100_rl120": ("SFT 100 steps, then 120 RL steps", ["run.warm_start.steps=100", "learner.steps=120"]),
    "sft900": ("SFT 900 steps (~1.4x the wall time of sft100_rl120; its warm start is the figure)",
               ["run.warm_start.steps=900", "learner.steps=2"]),
    "sft570": ("SFT 570 steps (~ the wall time of sft100_rl120; its warm start is the figure)",
               ["run.warm_start.steps=570", "learner.steps=2"]),
    "demos40_sft100": ("40 oracle demos (not 300), SFT 100 steps", ["run.warm_start.episodes=40", "run.warm_start.steps=100"]),
    "demos40_sft100_rl120": ("40 oracle demos, SFT 100 steps, then 120 RL steps",
                             ["run.warm_start.episodes=40", "run.warm_start.steps=100", "learner.steps=120"]),
    "demos40_sft570": ("40 oracle demos, SFT 570 steps (~ the wall time of demos40_sft100_rl120)",
                       ["run.warm_start.episodes=40", "run.warm_start.steps=570", "learner.steps=2"]),
    "noise50_sft100": ("demonstrator takes a random action at 50 % of turns, SFT 100 steps",
                       ["run.warm_start.action_noise=0.5", "run.warm_start.steps=100"]),
    "noise50_sft100_rl120": ("demonstrator 50 % random actions, SFT 100 steps, then 120 RL steps",
                             ["run.warm_start.action_noise=0.5", "run.warm_start.steps=100", "learner.steps=120"]),
    "noise50_sft570": ("demonstrator 50 % random actions, SFT 570 steps (~ the wall time of noise50_sft100_rl120)",
                       ["run.warm_start.action_noise=0.5", "run.warm_start.steps=570", "learner.steps=2"]),
    "noise50_sft60_rl160": ("demonstrator 50 % random actions, SFT 60 steps, then 160 RL steps (~1.2x the wall time of noise50_sft570)",
                            ["run.warm_start.action_noise=0.5", "run.warm_start.steps=60", "learner.steps=160"]),
    "group16": ("groups of 16, 2 per step (same episodes)", ["algo.group_size=16", "learner.groups_per_step=2"]),
    "groups8": ("8 groups x 8 per step (2x episodes)", ["learner.groups_per_step=8"]),
    "lr3e-4": ("lr 3e-4", ["algo.lr=3.0e-4"]),
    "kl": ("KL 0.05 to the warm start", ["algo.kl_coef=0.05"]),
}


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def _cmd(out: Path, lever: str, seed: int, steps: int) -> list[str]:
    """``turnscale run`` for one lever and seed; a lever that sets ``learner.steps`` itself
    replaces the study's ``steps`` (Hydra refuses a key given twice)."""
    overrides = LEVERS[lever][1]
    own_steps = any(o.startswith("learner.steps=") for o in overrides)
    return [sys.executable, "-m", "turnscale", "run", f"run.dir={out / f'{lever}-s{seed}'}", f"learner.seed={seed}",
            *([] if own_steps else [f"learner.steps={steps}"]), "logger.console_every_s=0", *overrides]


def run_all(out: Path, levers: Sequence[str], seeds: Sequence[int], steps: int, parallel: int, timeout_s: float) -> None:
    """Each (lever, seed) once, ``parallel`` at a time, each bounded by ``timeout_s``."""
    todo = [(lv, s) for s in seeds for lv in levers if _finished(out / f"{lv}-s{s}" / "summary.json") is None]
    running: list[tuple[subprocess.Popen, float, str]] = []
    while todo or running:
        while todo and len(running) < parallel:
            lv, s = todo.pop(0)
            log = open(out / f"{lv}-s{s}.log", "w")
            running.append((subprocess.Popen(_cmd(out, lv, s, steps), stdout=log, stderr=subprocess.STDOUT), time.monotonic(), f"{lv}-s{s}"))
            print(f"started {lv}-s{s}", flush=True)
        time.sleep(2.0)
        for p, t0, name in list(running):
            if p.poll() is None and time.monotonic() - t0 > timeout_s:
                p.kill()
                p.wait()
            if p.poll() is not None:
                running.remove((p, t0, name))
                print(f"{name}: rc {p.returncode} after {time.monotonic() - t0:.0f} s", flush=True)


def _finished(path: Path) -> dict | None:
    """The summary of a run that finished (a stopped run's ``summary.json`` has ``stopped``
    set and is left out: the study runs it again)."""
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    return None if doc.get("stopped") or not doc.get("final") else doc


def collect(out: Path, levers: Sequence[str], seeds: Sequence[int]) -> list[dict]:
    rows = []
    for lv in levers:
        runs = []
        for s in seeds:
            doc = _finished(out / f"{lv}-s{s}" / "summary.json")
            if doc is not None:
                runs.append({"seed": s, "warm": doc["warm_start"]["success"], "final": doc["final"]["success"],
                             "wall_s": doc["wall_s"], "by_level": doc["final"].get("by_category", {})})
        if runs:
            rows.append({"lever": lv, "what": LEVERS[lv][0], "runs": runs})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| lever | seeds | warm start | after RL | gain | gains per seed | run wall | after RL per level |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        runs = r["runs"]
        w, f = mean_sd([x["warm"] for x in runs]), mean_sd([x["final"] for x in runs])
        g = mean_sd([x["final"] - x["warm"] for x in runs])
        gains = ", ".join(f"{x['final'] - x['warm']:+.3f}" for x in runs)
        levels = sorted({k for x in runs for k in x["by_level"]})
        per_level = ", ".join(f"{k.removeprefix('BabyAI-').removesuffix('-v0')} "
                              f"{sum(x['by_level'].get(k, 0) for x in runs) / len(runs):.2f}" for k in levels)
        lines.append(f"| {r['what']} (`{r['lever']}`) | {len(runs)} | {w[0]:.3f} ± {w[1]:.3f} | {f[0]:.3f} ± {f[1]:.3f} | "
                     f"{g[0]:+.3f} ± {g[1]:.3f} | {gains} | "
                     f"{sum(x['wall_s'] for x in runs) / len(runs):.0f} s | {per_level} |")
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m turnscale.benchmarks.levers", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=_ints, default=[0, 1])
    p.add_argument("--levers", default="base,layers4,sft100,sft300,group16", help=f"from {','.join(LEVERS)}")
    p.add_argument("--steps", type=int, default=40, help="RL steps per run (the learning test's 40)")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    p.add_argument("--out", default="runs/levers")
    p.add_argument("--table-only", action="store_true", help="summarise the runs already in --out")
    a = p.parse_args(argv)
    levers = [x for x in a.levers.split(",") if x]
    unknown = [x for x in levers if x not in LEVERS]
    if unknown:
        p.error(f"unknown lever(s) {', '.join(unknown)}: choose from {', '.join(LEVERS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.table_only:
        run_all(out, levers, a.seeds, a.steps, a.parallel, a.timeout_s)
    rows = collect(out, levers, a.seeds)
    (out / "levers.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
