"""``turnscale autoscale``: the scaling loop for a run submitted with ``turnscale slurm``.

    turnscale autoscale slurm.dir=/shared/run1 ...the same overrides... [--every 10]

Waits for the learner's address (``<slurm.dir>/learner.addr``, at most ``slurm.wait_s``),
then runs ``turnscale.control.Autoscaler.tick`` every ``--every`` seconds — replace actors
Slurm lost, read the learner's signals, decide per pool within ``min_actors``..``max_actors``
(``slurm.pools``), act with ``sbatch --array`` / drain through the learner — until the learner
job writes ``<slurm.dir>/learner.done`` (the run is over: exit 0) or leaves the queue without
it (``<slurm.dir>/learner.job`` no longer pending or running in ``squeue``).  A learner that does not
answer for a round (busy, restarting) is logged and asked again next round; the loop never
crashes on one.  With CURVE towards the learner it connects with ``actor.curve.*`` (an
authorized key), as an actor would; given none, with the run's own ``control`` key pair in
``<slurm.dir>/keys`` (``turnscale.slurm.RunKeys``).  Run it on any host that reaches the learner and can
call ``sbatch``/``squeue`` (a login node).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from turnscale.protocol.errors import PeerTimeout, RemoteError, TransportError

log = logging.getLogger("turnscale.scaling")


def read_address(folder: Path, wait_s: float, sleep: Callable[[float], None] = time.sleep) -> tuple[str, int]:
    """``(host, port)`` from ``<folder>/learner.addr``; ``TimeoutError`` after ``wait_s``."""
    path = folder / "learner.addr"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            host, port = path.read_text().split()
            return host, int(port)
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no learner address in {path} after {wait_s:g}s (is the learner job running?)") from None
            sleep(1.0)


def run_loop(auto, folder: Path, every_s: float, *, max_s: float = float("inf"),
             sleep: Callable[[float], None] = time.sleep, gone: Callable[[], bool] = lambda: False) -> int:
    """Tick ``auto`` every ``every_s`` until ``<folder>/learner.done`` exists or ``gone()`` (the
    learner job has left the queue without it: cancelled, killed, node lost) (returns the
    number of rounds), or ``max_s`` passed; a round the learner does not answer is skipped."""
    rounds, t0 = 0, time.monotonic()
    while not (folder / "learner.done").exists() and not gone() and time.monotonic() - t0 < max_s:
        try:
            d = auto.tick()
            if d is not None and d.changed:
                log.info("wanted actors %s, leases per actor %d", d.wanted, d.max_leases_per_actor)
        except (PeerTimeout, RemoteError, TransportError) as exc:
            log.warning("learner did not answer this round (%s); asking again in %gs", exc, every_s)
        rounds += 1
        sleep(every_s)
    return rounds


def build(cfg, host: str, port: int):
    """The ``Autoscaler`` for ``cfg.slurm`` against the learner at ``host:port``."""
    from turnscale.common.curve import actor_curve
    from turnscale.control import Autoscaler, LearnerControl
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy
    from turnscale.slurm import SlurmBackend

    pools = cfg.slurm.pools
    curve = actor_curve(dataclasses.replace(cfg.actor, learner_host=host))
    control = LearnerControl(host, port, curve=curve.client() if curve is not None else None)
    policy = ScalingPolicy(pools=tuple(PoolPolicy(name=p.name, min_actors=p.min_actors, max_actors=p.max_actors, cost=p.cost)
                                       for p in pools))
    backend = SlurmBackend(Path(cfg.slurm.dir), {p.name: p.count for p in pools})
    return Autoscaler(control=control, controller=ScalingController(policy, wanted={p.name: p.count for p in pools}),
                      backend=backend, backoff_s=cfg.slurm.resubmit_backoff_s, backoff_max_s=cfg.slurm.resubmit_backoff_max_s)


def load_config(overrides: Sequence[str]):
    """The run's config as ``turnscale slurm`` loaded it; when the run uses its own CURVE keys
    (``turnscale.slurm.run_keys``: none given), connect with their ``control`` pair."""
    from turnscale import conf
    from turnscale.slurm import run_keys

    cfg = conf.load(overrides)
    keys = run_keys(cfg)
    return cfg if keys is None else conf.load([*overrides, *keys.control_overrides()])


def main(argv: Sequence[str] = ()) -> int:

    p = argparse.ArgumentParser(prog="turnscale autoscale", description=__doc__.split("\n\n")[0],
                                epilog="Other arguments are the Hydra overrides given to `turnscale slurm`.")
    p.add_argument("--every", type=float, default=10.0, help="seconds between rounds (default 10)")
    args, overrides = p.parse_known_args(list(argv))
    if args.every <= 0:
        p.error("--every must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(overrides)
    folder = Path(cfg.slurm.dir)
    try:
        host, port = read_address(folder, cfg.slurm.wait_s)
    except TimeoutError as exc:
        print(f"turnscale autoscale: {exc}", file=sys.stderr)
        return 1
    auto = build(cfg, host, port)

    def learner_gone() -> bool:
        job = (folder / "learner.job").read_text().strip() if (folder / "learner.job").exists() else ""
        return bool(job) and auto.backend.job_gone(job)

    try:
        rounds = run_loop(auto, folder, args.every, gone=learner_gone)
    finally:
        auto.control.close()
    why = f"the learner is done ({folder / 'learner.done'})" if (folder / "learner.done").exists() else \
        "the learner job has left the queue"
    print(f"turnscale autoscale: {why}; {rounds} rounds")
    return 0
