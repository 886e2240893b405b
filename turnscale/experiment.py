"""``turnscale experiment``: ScalingInter-RL against fixed horizons, on the same budget, with seeds.

The paper's schedule claim: raising the turn limit in stages beats a fixed long horizon on the
same budget.  For each seed this runs ``turnscale run``'s pipeline once up to the warm start
(tasks, oracle data, tiny model, SFT, envhub, held-out eval of the warm start: shared by the
arms, which differ only in RL), then one RL run per *arm* with the same budget — the same
``learner.steps`` x ``learner.groups_per_step`` x ``algo.group_size`` episodes — and a
held-out eval of its final checkpoint at every limit of ``--eval-turns``:

- ``scaling``: the configured schedule (``schedule.turns`` raised every ``schedule.every``
  steps; ``turnscale run``'s default is 3 -> 5 -> 8 every 20 steps);
- ``short``: ``schedule.turns[0]`` fixed;
- ``long``: ``schedule.turns[-1]`` fixed.

Per run it records held-out success by eval limit, the training success curve, *collapse
events* (``collapses``: the 5-step rolling training success falling below half of its best
so far, after the best reached 0.1) and wall time.  Writes ``<out>/experiment.json``,
``<out>/schedules.png`` (mean ± sd over seeds per arm and eval limit) and prints the table.
Episodes are equal across arms; wall time is not (longer horizons cost more), so it is
reported beside each arm.

    turnscale experiment --seeds 0,1,2 --eval-turns 3,6,12 --out runs/schedules [overrides]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from turnscale.conf.schema import Config

ARMS = ("scaling", "short", "long")
COLLAPSE_WINDOW = 5
COLLAPSE_FLOOR = 0.1


def arm_schedule(cfg: Config, arm: str) -> tuple[list[int], int]:
    """The (turns, every) of ``arm`` for the configured schedule."""
    turns, every = list(cfg.schedule.turns), cfg.schedule.every
    if arm == "scaling":
        return turns, every
    if arm == "short":
        return [turns[0]], every
    if arm == "long":
        return [turns[-1]], every
    raise ValueError(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")


def collapse_events(success_by_step: Sequence[float], window: int = COLLAPSE_WINDOW, floor: float = COLLAPSE_FLOOR) -> int:
    """How many times the rolling mean of training success fell below half of its best so
    far (once the best reached ``floor``); a new event needs a recovery above half first."""
    best, events, down = 0.0, 0, False
    for i in range(len(success_by_step)):
        chunk = success_by_step[max(0, i - window + 1): i + 1]
        mean = sum(chunk) / len(chunk)
        best = max(best, mean)
        low = best >= floor and mean < best / 2
        if low and not down:
            events += 1
        down = low
    return events


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def aggregate(runs: list[dict], eval_turns: Sequence[int]) -> list[dict]:
    """One row per (arm, eval limit): mean ± sd over seeds of held-out success, plus the
    warm start's, collapses and wall time."""
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        for t in eval_turns:
            m, sd = mean_sd([r["final"][str(t)] for r in mine])
            wm, _ = mean_sd([r["warm_start"][str(t)] for r in mine])
            rows.append({"arm": arm, "eval_turns": t, "seeds": len(mine), "success_mean": m, "success_sd": sd,
                         "warm_start_mean": wm, "collapses": sum(r["collapses"] for r in mine),
                         "wall_s_mean": mean_sd([r["wall_s"] for r in mine])[0]})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'arm':<8} {'eval turns':>10} {'seeds':>5} {'held-out success':>18} {'warm start':>10} {'collapses':>9} {'wall s':>7}"]
    for r in rows:
        lines.append(f"{r['arm']:<8} {r['eval_turns']:>10} {r['seeds']:>5} {r['success_mean']:>10.3f} ± {r['success_sd']:.3f} "
                     f"{r['warm_start_mean']:>10.3f} {r['collapses']:>9} {r['wall_s_mean']:>7.0f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    turns = sorted({r["eval_turns"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        mine = {r["eval_turns"]: r for r in rows if r["arm"] == arm}
        xs = [j + i * width for j in range(len(turns))]
        ax.bar(xs, [mine[t]["success_mean"] for t in turns], width, yerr=[mine[t]["success_sd"] for t in turns],
               capsize=3, label=arm)
    ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(turns))], [str(t) for t in turns])
    ax.set_xlabel("eval turn limit")
    ax.set_ylabel("held-out success (mean ± sd over seeds)")
    ax.set_title("ScalingInter-RL vs fixed horizons, same episodes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _success_curve(metrics_path: Path) -> list[float]:
    from turnscale.report import read_metrics

    return [float(r["rollout/success"]) for r in read_metrics(metrics_path) if "rollout/success" in r]


def run_seed(base: Config, seed: int, arms: Sequence[str], eval_turns: Sequence[int] | None,
             out: Path) -> tuple[list[dict], Config, list[int]]:
    """Warm start once for ``seed``, then each arm's RL and held-out evals: one record per arm,
    the config the arms derive from and the eval limits used.

    With ``run.adapt`` the shared part is ``turnscale run``'s: the recipe is fitted to the level
    mix (turn limits, context, loss aggregation; ``turnscale/recipe.py``) and the warm start
    runs in probed rounds, so the arms are the fitted schedule, its first stage and its last
    stage.  A mix the calibrated schedule covers keeps it (the GoTo default).  ``eval_turns``
    None: the (fitted) schedule's limits."""
    from turnscale.learner import checkpoint
    from turnscale.launch import Launcher

    sdir = out / f"seed-{seed}"
    cfg = dataclasses.replace(base, run=dataclasses.replace(base.run, dir=str(sdir)),
                              learner=dataclasses.replace(base.learner, seed=seed))
    shared = Launcher(cfg)
    try:
        files, sft_path, model_path = shared.prepare()
        cfg = shared.cfg  # fitted to the mix when run.adapt changed anything
        eval_turns = list(eval_turns) if eval_turns else sorted(set(cfg.schedule.turns))
        env_url = shared.start_envhub()
        warm_model = (shared.warm_start_until_signal(model_path, sft_path, files, env_url)
                      if cfg.run.warm_start.steps > 0 else model_path)
        warm = shared.evaluate_turns("eval_warm_start", warm_model, files["test"], env_url, eval_turns)
        records = []
        for arm in arms:
            turns, every = arm_schedule(cfg, arm)
            acfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(sdir / arm)),
                                       schedule=dataclasses.replace(cfg.schedule, turns=turns, every=every))
            launcher = Launcher(acfg)
            try:
                t0 = time.monotonic()
                ldir = launcher.rl(warm_model, files, env_url)
                wall = time.monotonic() - t0
                ck = checkpoint.latest(str(ldir / "checkpoints"))
                if ck is None:
                    raise RuntimeError(f"{arm}: the learner wrote no checkpoint under {ldir / 'checkpoints'}")
                final = launcher.evaluate_turns("eval_final", str(Path(ck) / "model"), files["test"], env_url, eval_turns)
            finally:
                launcher.procs.close()
            curve = _success_curve(ldir / "metrics.jsonl")
            records.append({"arm": arm, "seed": seed, "turns": turns, "every": every, "wall_s": wall,
                            "warm_start": {str(t): v["success"] for t, v in warm.items()},
                            "final": {str(t): v["success"] for t, v in final.items()},
                            "train_success": curve, "collapses": collapse_events(curve), "recipe": shared.recipe})
            shared.say(f"seed {seed} {arm}: " + ", ".join(f"{final[t]['success']:.3f}@{t}" for t in eval_turns)
                       + f" (warm start " + ", ".join(f"{warm[t]['success']:.3f}@{t}" for t in eval_turns) + f"), {wall:.0f}s")
        return records, cfg, eval_turns
    finally:
        shared.procs.close()


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def main(argv: Sequence[str] = ()) -> int:
    from turnscale import conf
    from turnscale.common.procs import ChildFailed
    from turnscale.launch import DEFAULT_EXPERIMENT

    p = argparse.ArgumentParser(prog="turnscale experiment", description=__doc__.split("\n\n")[0],
                                epilog="Other arguments are Hydra overrides of `turnscale run`'s config.")
    p.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--eval-turns", type=_ints, default=None, help="held-out eval limits (default: the schedule's turns)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument("--out", default="runs/schedules", help="output folder")
    args, overrides = p.parse_known_args(list(argv))
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        p.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    if not any(o.lstrip("+").startswith("experiment=") for o in overrides):
        overrides.insert(0, f"experiment={DEFAULT_EXPERIMENT}")
    cfg = conf.load(overrides)
    eval_turns = args.eval_turns
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    fitted = cfg
    try:
        for seed in args.seeds:
            records, fitted, eval_turns = run_seed(cfg, seed, arms, eval_turns, out)  # later seeds use the first's limits
            runs.extend(records)
            _write(out, runs, eval_turns, fitted)  # partial results survive a later failure
    except (ChildFailed, RuntimeError) as exc:
        print(f"turnscale experiment: {exc}", file=sys.stderr)
        return 1
    rows = _write(out, runs, eval_turns, fitted)
    print("\n" + table(rows))
    print(f"wrote {out / 'experiment.json'}, {plot(rows, out / 'schedules.png')}")
    return 0


def _write(out: Path, runs: list[dict], eval_turns: Sequence[int], cfg: Config) -> list[dict]:
    rows = aggregate(runs, eval_turns)
    doc: dict[str, Any] = {"eval_turns": list(eval_turns), "rows": rows, "runs": runs,
                           "budget": {"steps": cfg.learner.steps, "groups_per_step": cfg.learner.groups_per_step,
                                      "group_size": cfg.algo.group_size},
                           "schedule": {"turns": list(cfg.schedule.turns), "every": cfg.schedule.every}}
    (out / "experiment.json").write_text(json.dumps(doc, indent=2))
    return rows
