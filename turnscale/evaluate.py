"""``turnscale eval``: how good is a checkpoint, per env and sub-task, with test-time scaling sweeps.

Two modes:

- **run**: ``turnscale eval --model PATH[=LABEL] [--model ...] --env babyai[,textcraft] --split test
  [--tasks SPEC] --k 1,2,4,8 --turns 5,10,20,30 [hydra overrides, e.g. env.url=http://...]``
  plays ``max(k)`` (or ``--samples``) episodes per task for every model x turn limit through the
  actor code (``evalrun``), against the envhub server at ``env.url`` or a local one it starts.
- **report**: ``turnscale eval --from-jsonl FILE[=LABEL] ...`` recomputes the report from episode
  records already written (an eval's ``trajectories.jsonl`` or a run's).

Both write, under ``--out DIR`` (default ``runs/eval``): ``eval.json`` (see ``evalreport``),
``report.md``, ``trajectories.jsonl`` (run mode: every episode, with ``checkpoint`` and
``sample``), and ``turn_scaling.png`` / ``pass_at_k.png`` when a sweep has >= 2 points; ``--json``
and ``--markdown`` write extra copies where asked.  ``turnscale view DIR`` browses the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from turnscale.evalmetrics import PASS_RULES, EpisodeResult, report_rows
from turnscale.evalreport import format_markdown, format_table, plot_pass_at_k, plot_turn_scaling, report_json, write_json
from turnscale.evalrun import EvalNotBuilt, EvalRunError
from turnscale.evaltasks import TaskSpecError, parse_task_spec


class EvalError(Exception):
    """A usage or input problem; the message says how to fix it (exit code 2)."""


def _int_list(s: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise EvalError(f"--{name} takes comma-separated positive integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise EvalError(f"--{name} takes comma-separated positive integers, got {s!r}")
    return sorted(dict.fromkeys(vals))


def _labelled(spec: str) -> tuple[str, str]:
    """``PATH=LABEL`` or ``PATH`` (label: the folder or file name)."""
    path, _, label = spec.partition("=")
    if label:
        return path, label
    p = Path(path.rstrip("/"))
    if p.suffix == ".jsonl":
        return path, p.parent.name if p.stem == "trajectories" else p.stem
    return path, p.name or path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turnscale eval", description=__doc__.split("\n\n")[0],
                                 epilog="Other key=value arguments are Hydra overrides (env.url=..., engine.device=cuda, sampling.temperature=0.7).")
    ap.add_argument("--model", "--checkpoint", action="append", default=[], metavar="PATH[=LABEL]",
                    help="checkpoint or HF model folder; repeat to compare several (one line each in the plots)")
    ap.add_argument("--from-jsonl", action="append", default=[], metavar="FILE[=LABEL]",
                    help="report on episode records already written instead of running")
    ap.add_argument("--env", help="env family, or a comma list to evaluate several (default: the config's env)")
    ap.add_argument("--split", default="test", choices=("test", "train"), help="the config's task split (default test)")
    ap.add_argument("--tasks", "--ids", dest="tasks", help="'start:stop', '1,2,3' or an AgentGym-RL id file; overrides --split")
    ap.add_argument("--max-tasks", type=int, default=0, help="use only the first N tasks (0: all)")
    ap.add_argument("--k", default="1", help="comma list of k for Avg@k / Pass@k (default 1)")
    ap.add_argument("--samples", type=int, default=0, help="episodes per task (default: max k)")
    ap.add_argument("--turns", default="", help="comma list of turn limits to sweep (default: the schedule's last)")
    ap.add_argument("--concurrency", type=int, default=16, help="episodes in flight at once")
    ap.add_argument("--pass-on", default="reward", choices=sorted(PASS_RULES), help="what makes a sample pass for Pass@k")
    ap.add_argument("--out", default="runs/eval", help="output folder (eval.json, report.md, trajectories.jsonl, plots)")
    ap.add_argument("--json", help="also write the JSON report here")
    ap.add_argument("--markdown", help="also write the Markdown report here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def load_records(specs: Sequence[str]) -> list[EpisodeResult]:
    """Episode results from JSONL files; malformed lines are skipped and counted on stderr."""
    out: list[EpisodeResult] = []
    for spec in specs:
        path, label = _labelled(spec)
        if not os.path.isfile(path):
            raise EvalError(f"--from-jsonl {path}: no such file")
        bad = 0
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError("not an object")
                    out.append(EpisodeResult.from_record(rec, label))
                except (ValueError, UnicodeDecodeError, TypeError):
                    bad += 1
        if bad:
            print(f"turnscale eval: {path}: skipped {bad} malformed line(s)", file=sys.stderr)
    if not out:
        raise EvalError("no episode records found in " + ", ".join(specs))
    return out


def write_outputs(results: list[EpisodeResult], ks: list[int], pass_on: str, out_dir: Path, *,
                  json_path: str | None, md_path: str | None, trajectories: str = "", config: dict | None = None) -> dict:
    rows = report_rows(results, ks, pass_on)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [p for p in (plot_turn_scaling(rows, out_dir / "turn_scaling.png"),
                         plot_pass_at_k(rows, ks, out_dir / "pass_at_k.png")) if p is not None]
    doc = report_json(rows, ks, pass_on, trajectories=trajectories, config=config)
    write_json(out_dir / "eval.json", doc)
    md = format_markdown(rows, ks, pass_on, [p.name for p in plots], config)
    (out_dir / "report.md").write_text(md)
    if json_path:
        extra = dict(doc)
        if trajectories:
            extra["trajectories"] = os.path.relpath(out_dir / trajectories, Path(json_path).resolve().parent)
        write_json(json_path, extra)
    if md_path:
        Path(md_path).parent.mkdir(parents=True, exist_ok=True)
        Path(md_path).write_text(format_markdown(rows, ks, pass_on, [os.path.relpath(p, Path(md_path).resolve().parent) for p in plots], config))
    print(format_table(rows, ks))
    for p in plots:
        print(f"plot: {p}")
    print(f"report: {out_dir / 'eval.json'}, {out_dir / 'report.md'}")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    bad = [a for a in rest if "=" not in a or a.startswith("-")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    try:
        return _main(args, rest)
    except (EvalError, TaskSpecError, EvalNotBuilt, EvalRunError) as exc:
        print(f"turnscale eval: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, overrides: list[str]) -> int:
    ks = _int_list(args.k, "k")
    out_dir = Path(args.out)
    if overrides:
        from turnscale.conf import load

        load(overrides)  # a wrong key or value stops here, named (ConfigError -> exit 2)
    if args.from_jsonl:
        if args.model:
            raise EvalError("give either --model (run) or --from-jsonl (report), not both")
        results = load_records(args.from_jsonl)
        # one input: the report points at it, so `turnscale view OUT` shows its episodes too
        traj = os.path.relpath(_labelled(args.from_jsonl[0])[0], out_dir.resolve()) if len(args.from_jsonl) == 1 else ""
        write_outputs(results, ks, args.pass_on, out_dir, json_path=args.json, md_path=args.markdown, trajectories=traj)
        return 0
    if not args.model:
        raise EvalError("nothing to evaluate: give --model PATH (a checkpoint or HF model folder) or --from-jsonl FILE")
    samples = args.samples or max(ks)
    if samples < max(ks):
        raise EvalError(f"--samples {samples} is fewer than the largest k ({max(ks)}); Pass@k needs n >= k")
    if args.concurrency < 1:
        raise EvalError("--concurrency must be >= 1")

    from turnscale.conf import load

    envs = list(dict.fromkeys(e.strip() for e in (args.env or "").split(",") if e.strip())) or [None]
    if len(envs) > 1 and any(o.lstrip("+").startswith("env.url=") for o in overrides):
        raise EvalError("env.url names one server; with several --env values let eval start their servers")
    cfgs = [load(([f"env={e}"] if e else []) + overrides) for e in envs]
    tasks = {}
    for cfg in cfgs:
        ids = parse_task_spec(args.tasks or getattr(cfg.env.tasks, args.split), cfg.env.name)
        tasks[cfg.env.name] = ids[: args.max_tasks] if args.max_tasks > 0 else ids
    turns = _int_list(args.turns, "turns") if args.turns else [cfgs[0].schedule.turns[-1]]
    models = [_labelled(m) for m in args.model]
    from turnscale import evalrun

    out_dir.mkdir(parents=True, exist_ok=True)
    traj = out_dir / "trajectories.jsonl"
    records = evalrun.run_eval(cfgs, models, tasks, samples=samples, turn_limits=turns, split=args.split,
                               concurrency=args.concurrency, out_jsonl=traj, progress=not args.no_progress)
    results = [EpisodeResult.from_record(r) for r in records]
    config = {"envs": list(tasks), "split": args.split, "tasks": {e: len(t) for e, t in tasks.items()}, "samples": samples,
              "turns": turns, "models": [{"path": p, "label": lab} for p, lab in models], "overrides": overrides}
    write_outputs(results, ks, args.pass_on, out_dir, json_path=args.json, md_path=args.markdown,
                  trajectories=traj.name, config=config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
