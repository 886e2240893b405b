"""``turnscale <role> [args]``: one command, one module per role.

Each role is ``<module>:main(argv) -> int``; Hydra roles take ``key=value`` overrides,
``bench`` takes its own flags.  A role whose module is not built yet says so and exits 2.
"""

from __future__ import annotations

import importlib
import sys

ROLES: dict[str, tuple[str, str]] = {
    "envhub": ("turnscale.envhub.main", "serve one env family over HTTP (AgentGym-compatible)"),
    "learner": ("turnscale.learnerapp", "the central learner: leases, training, weight publication"),
    "actor": ("turnscale.actors.main", "one actor process: inference engine + episodes, pointed at a learner"),
    "run": ("turnscale.launch", "everything on one machine: envhub, learner, actors (embedded defaults)"),
    "eval": ("turnscale.evaluate", "success / Avg@k / Pass@k of a checkpoint on an env split"),
    "experiment": ("turnscale.experiment", "ScalingInter-RL vs fixed turn limits: same budget, seeds, error bars"),
    "bench": ("turnscale.benchmarks.main", "throughput benchmarks, as ratios against in-run baselines"),
    "view": ("turnscale.viewer", "browse trajectories of a run directory in a local web app"),
    "slurm": ("turnscale.slurm", "sbatch scripts for a Slurm cluster (learner, envhub, one actor array per pool); --dry-run prints them"),
    "autoscale": ("turnscale.autoscale", "the scaling loop for a run submitted with turnscale slurm (until the learner is done)"),
    "keys": ("turnscale.keys", "write CURVE key files (learner, actors, authorized/) for non-loopback runs"),
}


def usage() -> str:
    lines = ["usage: turnscale <role> [hydra overrides | flags]", "", "roles:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in ROLES.items()]
    lines += ["", "Overrides are Hydra's: turnscale learner env=textcraft algo=ppo learner.steps=300"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    role, rest = argv[0], argv[1:]
    if role not in ROLES:
        print(f"turnscale: unknown role {role!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = ROLES[role][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            print(f"turnscale {role}: not built yet ({module_name} does not exist)", file=sys.stderr)
            return 2
        raise
    from turnscale.conf import ConfigError

    try:
        return int(module.main(rest) or 0)
    except ConfigError as exc:
        print(f"turnscale {role}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
