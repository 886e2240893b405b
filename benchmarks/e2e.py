"""``turnscale bench e2e``: asynchronous against synchronous training, end to end.

Real processes on 127.0.0.1 — one envhub server (BabyAI with the simulated long-tail
workload of ``envhub.simwork``), one learner, N actors — started and ended by pid
(``common.procs``).  Every run gets fresh processes and a fresh envhub (so each run
faces the same per-task costs), the same tasks (``learner.seed``), the same model and
the same number of actors; only ``learner.max_staleness`` differs:

* async: ``max_staleness = 2`` (leases flow while at most 2 versions ahead);
* sync: ``max_staleness = 0`` — one batch of ``groups_per_step`` leases per version and a
  barrier per step, AgentGym-RL's lock-step, through the same code.

Figures (``benchmarks.common.Result``):

* ``async_vs_sync_sim`` / ``async_vs_sync_hf``: async groups trained/s, baseline sync,
  ratio = speed-up (target 2.5 for sim);  ``..._tokens``: the same for generated tokens/s;
* ``async_efficiency_sim``: achieved speed-up over the ideal one that the sync run's own
  sampled costs allow (``benchmarks.makespan``: lock-step makespan over work-conserving
  makespan with the same slots; each group costs its slot the wall time from lease grant
  to arrival, logged by the learner; the optimizer step time is measured), target 0.85;
* ``scaling_sim_<n>actors``: groups/s with n actors against 1 actor (one learner, actors
  joining in phases; the workload without its per-task factor);
  ``learner_busy_<n>actors``: the learner's busy fraction at the largest n (ratio =
  1/busy, target 2: the learner is busy at most half the time, so it is not the bottleneck);
  ``scaling_cpu_<role>_<n>actors``: cores used over each phase's window by all actors, the
  learner, the envhub server and the whole machine (``machine``: every process on the box,
  other sessions' too), from ``/proc`` (``benchmarks.cpuprobe``), against the machine's
  cores: where the CPU went when scaling falls short;
* per run: learner busy fraction, actor engine busy fraction, staleness mean, weight
  sync seconds per version (actors' pull and load); the full detail (staleness
  histogram, dropped groups, every group's slot time, episode durations and turns) goes
  to ``<e2e-dir>/e2e_runs.json``.

Sizes are flags (``--e2e-*``); the default suite is sized for ~6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from turnscale.benchmarks.common import Result, result
from turnscale.protocol.transport import free_port
from turnscale.benchmarks.e2e_stats import RunStats, load_run, read_jsonl
from turnscale.benchmarks.makespan import ideal_speedup, lockstep_makespan, work_conserving_makespan


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The long-tail workload the envhub serves (``env.options.sim_latency``)."""

    seed: int = 0
    median_s: float = 0.2
    sigma: float = 0.8
    max_s: float = 8.0
    task_sigma: float = 2.0
    reset_s: float = 0.5
    steps_median: float = 1.0
    steps_sigma: float = 1.0
    steps_max: int = 10

    def override(self) -> str:
        body = ", ".join(f"{k}: {v}" for k, v in asdict(self).items())
        return "+env.options.sim_latency={" + body + "}"


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One end-to-end run: a learner and ``actors`` actor processes."""

    name: str
    engine: str = "sim"
    """Actor engine: ``sim`` (cost model, no math) or ``hf`` (the tiny model for real)."""
    actors: int = 4
    max_groups: int = 1
    """Leases each actor runs at once."""
    group_size: int = 4
    groups_per_step: int = 4
    steps: int = 10
    max_staleness: int = 2
    turn_limit: int = 16
    max_new_tokens: int = 48
    decode_s_per_step: float = 0.005
    """Sim engine: seconds per decoding step of the whole batch."""
    mean_new_tokens: int = 24
    long_tail: float = 0.2
    seed: int = 0
    warmup: int = 1
    """Steps excluded from rates (start-up)."""

    @property
    def slots(self) -> int:
        return self.actors * self.max_groups


def envhub_args(workload: Workload, port: int) -> list[str]:
    return ["envhub", "env=babyai", "host=127.0.0.1", f"port={port}", workload.override()]


BENCH_MODEL = ("model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
               "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64")
"""The benchmark's tiny model (0.14M parameters, the tiny tokenizer's 2048-token vocabulary):
its step costs little next to rollouts."""


def learner_args(spec: RunSpec, env_port: int, ports: tuple[int, int, int], learner_dir: Path, model_path: str = "") -> list[str]:
    model = [f"model.path={model_path}"] if model_path else list(BENCH_MODEL)
    return [
        "learner", "env=babyai", *model, f"env.port={env_port}", f"engine={spec.engine}", "algo=grpo",
        f"algo.group_size={spec.group_size}", "algo.lr=1e-4",
        f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
        f"learner.max_staleness={spec.max_staleness}", f"learner.groups_per_step={spec.groups_per_step}",
        f"learner.steps={spec.steps}", f"learner.seed={spec.seed}", f"learner.dir={learner_dir}",
        f"learner.checkpoint_every={spec.steps + 1000}", "learner.save_trajectories=true",
        f"schedule.turns=[{spec.turn_limit}]", f"sampling.max_new_tokens={spec.max_new_tokens}",
        "learner.heartbeat_interval_s=1", "logger.tensorboard=false", "logger.console_every_s=5",
    ]


def actor_args(spec: RunSpec, learner_port: int, index: int) -> list[str]:
    return [
        "actor", f"engine={spec.engine}", f"engine.sim.seed={spec.seed * 1000 + index}",
        f"engine.sim.decode_s_per_step={spec.decode_s_per_step}", f"engine.sim.mean_new_tokens={spec.mean_new_tokens}",
        f"engine.sim.long_tail={spec.long_tail}",
        "actor.learner_host=127.0.0.1", f"actor.learner_port={learner_port}",
        f"actor.max_groups={spec.max_groups}", f"actor.actor_id={spec.name}-a{index}",
    ]


def prepare_model() -> str:
    """Build (once, cached) the benchmark's tiny model as the learner would, and return its
    folder, so every learner of the suite loads it instead of rebuilding the corpus."""
    from turnscale import conf
    from turnscale.envhub.corpus import play_texts
    from turnscale.learner.main import resolve_model_path

    return resolve_model_path(conf.load(["env=babyai", *BENCH_MODEL]), play=play_texts)


def fresh_run_dir(run_dir: Path) -> None:
    """Empty ``run_dir`` (one run's folder inside ``--e2e-dir``): a learner finding an earlier
    run's checkpoints and ``metrics.jsonl`` there would resume from them and append to them,
    and the figures would mix the two runs."""
    import shutil

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


class Cluster:
    """One envhub server and one learner for ``spec``; actors are added with ``add_actors``.
    Every child is started here and ended by pid on exit (actors, learner, envhub)."""

    def __init__(self, spec: RunSpec, workload: Workload, run_dir: Path, model_path: str = "") -> None:
        from turnscale.common.procs import ProcessGroup

        self.spec, self.workload, self.run_dir, self.model_path = spec, workload, run_dir, model_path
        self.learner_dir = run_dir / "learner"
        self.env_port, self.ports = free_port(), (free_port(), free_port(), free_port())
        self.pg = ProcessGroup(run_dir / "logs", "turnscale")
        self.actors: list[Any] = []

    def __enter__(self) -> "Cluster":
        from turnscale.common.procs import wait_http_ok

        fresh_run_dir(self.run_dir)
        try:
            self.env = self.pg.start("envhub", envhub_args(self.workload, self.env_port))
            self.learner = self.pg.start("learner", learner_args(self.spec, self.env_port, self.ports, self.learner_dir, self.model_path))
            wait_http_ok(f"http://127.0.0.1:{self.env_port}/health", timeout_s=60.0, child=self.env)
        except BaseException:
            self.pg.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pg.close()

    def add_actors(self, n: int) -> None:
        """Start actors until ``n`` run."""
        while len(self.actors) < n:
            i = len(self.actors)
            self.actors.append(self.pg.start(f"actor{i}", actor_args(self.spec, self.ports[0], i)))

    def check(self, deadline: float, what: str) -> None:
        """Raise ``ChildFailed`` past ``deadline`` or when a child died with an error."""
        from turnscale.common.procs import ChildFailed

        if time.monotonic() > deadline:
            raise ChildFailed(f"{self.spec.name}: timed out waiting for {what}:\n{self.learner.tail()}")
        for c in [self.env, *self.actors]:
            if not c.alive() and c.popen.returncode != 0:
                raise ChildFailed(f"{self.spec.name}: {c.name} exited with {c.popen.returncode}:\n{c.tail()}")

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.learner_dir / "metrics.jsonl")

    def cpu_roles(self) -> dict[str, list[int]]:
        """Pids per role, for ``benchmarks.cpuprobe``."""
        return {"actors": [a.popen.pid for a in self.actors], "learner": [self.learner.popen.pid], "envhub": [self.env.popen.pid]}


def run_one(spec: RunSpec, workload: Workload, root: Path, timeout_s: float, model_path: str = "") -> RunStats:
    """Start envhub, learner and ``spec.actors`` actors; wait for the learner to finish its
    steps (bounded by ``timeout_s``); end every child by pid; read the learner's files."""
    from turnscale.common.procs import ChildFailed

    deadline = time.monotonic() + timeout_s
    with Cluster(spec, workload, root / spec.name, model_path) as c:
        c.add_actors(spec.actors)
        while c.learner.alive():
            c.check(deadline, f"{spec.steps} learner steps")
            time.sleep(0.25)
        if c.learner.popen.returncode != 0:
            raise ChildFailed(f"{spec.name}: learner exited with {c.learner.popen.returncode}:\n{c.learner.tail()}")
    return load_run(c.learner_dir, spec.groups_per_step, spec.warmup)


@dataclass(frozen=True)
class Phase:
    """One actor count of the scaling run."""

    actors: int
    steps: int
    window_s: float
    groups_per_s: float
    learner_busy: float
    cpu_cores: dict[str, float] = field(default_factory=dict)
    """Cores used over the phase's window (``benchmarks.cpuprobe``): ``actors`` (all),
    ``learner``, ``envhub``, and ``machine`` (every process on the box, other sessions' too)."""


def phase_figures(records: Sequence[Mapping[str, Any]], actors: int, groups_per_step: int, warmup: int,
                  settle_s: float = 0.0) -> Phase | None:
    """Rates over the steps logged while exactly ``actors`` actors were registered.  The
    window starts at the end of the ``warmup``-th such step, or later: at the first one at
    least ``settle_s`` after the phase's first step (joining actors load their engine for a
    few seconds after registering and take CPU from the rest).  None until one step is
    measured."""
    mine = [r for r in records if r.get("actors/count") == actors and "time" in r]
    if warmup < 1 or len(mine) < warmup + 1:
        return None
    t_first = float(mine[0]["time"])
    i0 = next((i for i in range(warmup - 1, len(mine)) if float(mine[i]["time"]) - t_first >= settle_s), None)
    if i0 is None or i0 + 1 >= len(mine):
        return None
    start, inside = mine[i0], mine[i0 + 1:]
    window = float(inside[-1]["time"]) - float(start["time"])
    if window <= 0:
        return None
    busy = sum(float(r.get("perf/step_time_s", 0.0)) for r in inside)
    return Phase(actors, len(inside), window, groups_per_step * len(inside) / window, busy / window)


def run_scaling(spec: RunSpec, counts: Sequence[int], workload: Workload, root: Path, steps_per_phase: int,
                timeout_s: float, model_path: str = "", settle_s: float = 4.0, min_window_s: float = 8.0) -> list[Phase]:
    """One learner; actors join in phases (``counts``, ascending).  Each phase lasts until
    ``steps_per_phase`` steps, and at least ``min_window_s`` seconds, were logged with that
    many actors registered after one warm-up step and ``settle_s`` seconds (new actors
    start up meanwhile; steps come in bursts when several groups are buffered).  Actors may join at any time, so this
    measures the same thing as separate runs without paying the start-up per count."""
    from turnscale.benchmarks import cpuprobe

    phases: list[Phase] = []
    deadline = time.monotonic() + timeout_s
    with Cluster(spec, workload, root / spec.name, model_path) as c:
        samples: list[cpuprobe.CpuSample] = []
        for n in counts:
            c.add_actors(n)
            first = len(samples)
            while True:
                c.check(deadline, f"{steps_per_phase} steps with {n} actors")
                samples.append(cpuprobe.sample(c.cpu_roles()))
                ph = phase_figures(c.metrics(), n, spec.groups_per_step, warmup=1, settle_s=settle_s)
                if ph is not None and ph.steps >= steps_per_phase and ph.window_s >= min_window_s:
                    samples.append(cpuprobe.sample(c.cpu_roles()))
                    end = max(float(r["time"]) for r in c.metrics() if r.get("actors/count") == n and "time" in r)
                    mine = samples[first:]
                    cores = cpuprobe.cores_between(mine, end - ph.window_s, end) or cpuprobe.cores_between(mine, mine[0].t, mine[-1].t)
                    if not cores:
                        print(f"   (no CPU figures for {n} actors: {len(mine)} samples, window {end - ph.window_s:.3f}..{end:.3f})", flush=True)
                    phases.append(replace(ph, cpu_cores=cores))
                    break
                time.sleep(0.5)
    return phases


@dataclass
class Outcome:
    spec: RunSpec
    stats: RunStats


def _details(o: Outcome) -> dict[str, Any]:
    s = o.stats
    return {
        "spec": asdict(o.spec), "steps": s.steps, "window_s": s.window_s, "groups_trained": s.groups_trained,
        "groups_per_s": s.groups_per_s, "tokens_per_s": s.tokens_per_s, "learner_busy": s.learner_busy,
        "step_time_s": s.step_time_s, "staleness_hist": s.staleness_hist, "dropped": s.dropped, "extra": s.extra,
        "groups": [{"lease_id": g.lease_id, "data_idx": g.data_idx, "accepted": g.accepted,
                    "lease_s": g.lease_s, "episode_s": list(g.episode_s), "turns": list(g.turns), "sampled_tokens": g.sampled_tokens} for g in s.groups],
    }


def ideal(sync: Outcome, other: Outcome | None = None) -> tuple[float, float, float]:
    """(ideal speed-up, lock-step makespan, work-conserving makespan) of the sync run's own
    trained groups (each costs its slot the lease's wall time), with its slots and batch.
    The optimizer step time is the mean over both runs' measured steps (the same training
    work; on a shared machine either run alone is noisy)."""
    d, sp = sync.stats.trained_durations, sync.spec
    runs = [r for r in (sync, other) if r is not None]
    n = sum(r.stats.steps for r in runs)
    st = sum(r.stats.step_time_s * r.stats.steps for r in runs) / max(n, 1)
    return (ideal_speedup(d, sp.slots, sp.groups_per_step, st),
            lockstep_makespan(d, sp.slots, sp.groups_per_step, st),
            work_conserving_makespan(d, sp.slots, sp.groups_per_step, st))


def compare(tag: str, a: Outcome, s: Outcome, target: float | None, efficiency_target: float | None) -> list[Result]:
    """Results of one async/sync pair."""
    out = [
        result(f"async_vs_sync_{tag}", a.stats.groups_per_s, "groups/s", f"sync lock-step (max_staleness=0), {s.spec.actors} actors",
               s.stats.groups_per_s, target=target),
        result(f"async_vs_sync_{tag}_tokens", a.stats.tokens_per_s, "sampled tokens/s", "sync lock-step", s.stats.tokens_per_s),
    ]
    speedup = a.stats.groups_per_s / s.stats.groups_per_s if s.stats.groups_per_s > 0 else float("nan")
    best, _, _ = ideal(s, a)
    out.append(result(f"async_efficiency_{tag}", speedup, "speed-up", "ideal speed-up of the sampled costs", best, target=efficiency_target))
    return out


def per_run(o: Outcome) -> list[Result]:
    s, n = o.stats, o.spec.name
    out = [result(f"{n}_learner_busy", s.learner_busy, "fraction", "always busy", 1.0)]
    if s.staleness_hist:
        total = sum(s.staleness_hist.values())
        mean = sum(k * v for k, v in s.staleness_hist.items()) / max(total, 1)
        out.append(result(f"{n}_staleness_mean", mean, "versions", f"max_staleness={o.spec.max_staleness}", max(o.spec.max_staleness, 1)))
    if "actor_engine_busy" in s.extra:
        out.append(result(f"{n}_actor_engine_busy", s.extra["actor_engine_busy"], "fraction", "always busy", 1.0))
    if "weight_sync_s" in s.extra:
        out.append(result(f"{n}_weight_sync_s", s.extra["weight_sync_s"], "s/version", "learner step time", s.step_time_s, lower_is_better=True))
    return out


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--e2e-parts", default="sim,hf,scaling", help="comma list of: sim (async vs sync, sim engine), hf (same, tiny model), scaling")
    a("--e2e-actors", type=int, default=4, help="actors in the async/sync comparisons")
    a("--e2e-max-groups", type=int, default=2, help="leases per actor (slots = actors x this)")
    a("--e2e-group-size", type=int, default=2, help="episodes per group (GRPO n)")
    a("--e2e-groups-per-step", type=int, default=0, help="0: one group per slot (actors x max-groups)")
    a("--e2e-steps", type=int, default=6, help="optimizer steps per sim run (the first is warm-up)")
    a("--e2e-hf-steps", type=int, default=4)
    a("--e2e-hf-actors", type=int, default=2, help="actors in the hf comparison (each loads torch and the model)")
    a("--e2e-hf-turn-limit", type=int, default=4)
    a("--e2e-hf-max-new-tokens", type=int, default=16)
    a("--e2e-turn-limit", type=int, default=10)
    a("--e2e-max-new-tokens", type=int, default=48)
    a("--e2e-staleness", type=int, default=2, help="max_staleness of the async runs")
    a("--e2e-scaling", default="1,2,4,8", help="actor counts for the scaling runs")
    a("--e2e-scaling-steps", type=int, default=2, help="least measured steps per scaling phase (after one warm-up step)")
    a("--e2e-scaling-window", type=float, default=8.0, help="least seconds measured per scaling phase")
    a("--e2e-scaling-groups-per-step", type=int, default=2, help="batch of the scaling run")
    a("--e2e-scaling-task-sigma", type=float, default=0.0, help="per-task latency spread in the scaling run")
    a("--e2e-latency-median", type=float, default=Workload.median_s, help="median env step latency, s")
    a("--e2e-latency-sigma", type=float, default=Workload.sigma)
    a("--e2e-task-sigma", type=float, default=Workload.task_sigma, help="spread of the per-task latency factor")
    a("--e2e-reset-latency", type=float, default=Workload.reset_s, help="median env reset latency, s")
    a("--e2e-episode-steps-median", type=float, default=Workload.steps_median, help="median env steps per task")
    a("--e2e-episode-steps-sigma", type=float, default=Workload.steps_sigma)
    a("--e2e-decode-s", type=float, default=RunSpec.decode_s_per_step, help="sim engine: seconds per decoding step")
    a("--e2e-seed", type=int, default=0)
    a("--e2e-dir", default="runs/bench_e2e", help="run folders, logs and e2e_runs.json go here")
    a("--e2e-run-timeout", type=float, default=180.0, help="seconds one run may take")


def run(args) -> list[Result]:
    root = Path(args.e2e_dir)
    root.mkdir(parents=True, exist_ok=True)
    parts = {p.strip() for p in args.e2e_parts.split(",") if p.strip()}
    workload = Workload(seed=args.e2e_seed, median_s=args.e2e_latency_median, sigma=args.e2e_latency_sigma,
                        task_sigma=args.e2e_task_sigma, reset_s=args.e2e_reset_latency,
                        steps_median=args.e2e_episode_steps_median, steps_sigma=args.e2e_episode_steps_sigma,
                        steps_max=args.e2e_turn_limit)
    base = RunSpec(name="", actors=args.e2e_actors, max_groups=args.e2e_max_groups, group_size=args.e2e_group_size,
                   groups_per_step=args.e2e_groups_per_step or args.e2e_actors * args.e2e_max_groups,
                   steps=args.e2e_steps, turn_limit=args.e2e_turn_limit, max_new_tokens=args.e2e_max_new_tokens,
                   decode_s_per_step=args.e2e_decode_s, seed=args.e2e_seed)
    t0, load0 = time.monotonic(), os.getloadavg()
    model_path = prepare_model()
    print(f"   e2e model {model_path} ({time.monotonic() - t0:.0f}s)", flush=True)
    outcomes: list[Outcome] = []
    results: list[Result] = []

    def go(spec: RunSpec) -> Outcome:
        t0 = time.monotonic()
        print(f"   e2e run {spec.name}: {spec.engine}, {spec.actors} actors x {spec.max_groups} leases, "
              f"max_staleness={spec.max_staleness}, {spec.steps} steps", flush=True)
        o = Outcome(spec, run_one(spec, workload, root, args.e2e_run_timeout, model_path))
        print(f"   -> {o.stats.groups_per_s:.3g} groups/s, {o.stats.tokens_per_s:.4g} tok/s, learner busy {o.stats.learner_busy:.2f}"
              f" ({time.monotonic() - t0:.0f}s)", flush=True)
        outcomes.append(o)
        return o

    failed: list[str] = []

    def part(name: str, fn) -> None:
        """Run one part; a child that fails is reported (with its log's tail) and the
        part's figures are left out, so the rest of the suite still runs."""
        if name not in parts:
            return
        from turnscale.common.procs import ChildFailed

        try:
            fn()
        except (ChildFailed, ValueError) as exc:
            failed.append(name)
            print(f"   e2e part {name} FAILED (logs under {root}): {exc}", file=sys.stderr, flush=True)

    def sim() -> None:
        a = go(replace(base, name="sim_async", max_staleness=args.e2e_staleness))
        s = go(replace(base, name="sim_sync", max_staleness=0))
        results.extend(compare("sim", a, s, target=2.5, efficiency_target=0.85))

    def hf() -> None:
        spec = replace(base, engine="hf", actors=args.e2e_hf_actors, groups_per_step=args.e2e_hf_actors * base.max_groups,
                       steps=args.e2e_hf_steps, turn_limit=args.e2e_hf_turn_limit, max_new_tokens=args.e2e_hf_max_new_tokens)
        a = go(replace(spec, name="hf_async", max_staleness=args.e2e_staleness))
        s = go(replace(spec, name="hf_sync", max_staleness=0))
        results.extend(compare("hf", a, s, target=None, efficiency_target=None))

    phases: list[Phase] = []

    def scale() -> None:
        phases.extend(scaling_phases(args, base, workload, root, model_path))
        results.extend(scaling_results(phases))

    part("sim", sim)
    part("hf", hf)
    part("scaling", scale)
    for o in outcomes:
        results += per_run(o)
    details: dict[str, Any] = {"workload": asdict(workload), "model_path": model_path, "wall_s": time.monotonic() - t0,
                               "failed_parts": failed,
                               "loadavg_start": load0, "loadavg_end": os.getloadavg(), "runs": [_details(o) for o in outcomes],
                               "scaling": [asdict(p) for p in phases]}
    for tag in ("sim", "hf"):
        s = next((o for o in outcomes if o.spec.name == f"{tag}_sync"), None)
        a = next((o for o in outcomes if o.spec.name == f"{tag}_async"), None)
        if s is not None:
            sp, ls, ws = ideal(s, a)
            details[f"ideal_{tag}"] = {"speedup": sp, "lockstep_makespan_s": ls, "work_conserving_makespan_s": ws}
    (root / "e2e_runs.json").write_text(json.dumps(details, indent=1))
    print(f"   details: {root / 'e2e_runs.json'}", flush=True)
    return results


def scaling_phases(args, base: RunSpec, workload: Workload, root: Path, model_path: str) -> list[Phase]:
    """Actors (one lease each, async) join one learner in phases of 1, 2, 4, 8 (``--e2e-scaling``),
    on the workload without its per-task factor (``--e2e-scaling-task-sigma``, default 0):
    a few steps per phase then measure capacity rather than which rare slow task was drawn.
    ``max_staleness`` is raised where needed so that admission lets every actor work
    (``(max_staleness + 1) * groups_per_step >= actors``)."""
    counts = sorted({int(c) for c in args.e2e_scaling.split(",") if c.strip()})
    if not counts:
        return []
    gps = args.e2e_scaling_groups_per_step
    spec = replace(base, name="scaling", actors=max(counts), max_groups=1, groups_per_step=gps, steps=100_000,
                   max_staleness=max(args.e2e_staleness, math.ceil(max(counts) / gps) - 1))
    t0 = time.monotonic()
    print(f"   e2e run scaling: actors join in phases {counts}, {gps} groups/step, max_staleness={spec.max_staleness}", flush=True)
    light = replace(workload, task_sigma=args.e2e_scaling_task_sigma)
    phases = run_scaling(spec, counts, light, root, args.e2e_scaling_steps, args.e2e_run_timeout * 2, model_path,
                         min_window_s=args.e2e_scaling_window)
    for ph in phases:
        print(f"   -> {ph.actors} actors: {ph.groups_per_s:.3g} groups/s, learner busy {ph.learner_busy:.2f} over {ph.steps} steps", flush=True)
    print(f"   scaling took {time.monotonic() - t0:.0f}s", flush=True)
    return phases


def scaling_results(phases: Sequence[Phase]) -> list[Result]:
    """Groups/s with n actors against the first phase; learner busy fraction at the last."""
    if not phases:
        return []
    one, top = phases[0], phases[-1]
    out = [result(f"scaling_sim_{p.actors}actors", p.groups_per_s, "groups/s", f"{one.actors} actor(s)", one.groups_per_s)
           for p in phases]
    out.append(result(f"learner_busy_{top.actors}actors", top.learner_busy, "fraction", "always busy (1.0)", 1.0,
                      target=2.0, lower_is_better=True))
    cores = float(os.cpu_count() or 1)
    for p in phases:
        for role, used in sorted(p.cpu_cores.items()):
            out.append(result(f"scaling_cpu_{role}_{p.actors}actors", used, "cores", f"the machine's {int(cores)} cores", cores))
    return out
