"""``turnscale <role> [args]``: one command, one module per role.

Each role is ``<module>:main(argv) -> int``; Hydra roles take ``key=value`` overrides,
``bench`` takes its own flags.  A role whose module is not built yet says so and exits 2.

``turnscale <role> --help`` (or ``-h``) prints the role's usage: argparse roles answer it
themselves; a Hydra role (``HYDRA_ROLES``) is answered here, before its module is imported
(Hydra would read ``--help`` as an override and fail): usage, the config groups with their
choices and defaults (read from the installed ``conf/`` folder, so it never goes stale), the
keys of the role's own config section with their defaults, example overrides, and where the
full key reference is.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path

ROLES: dict[str, tuple[str, str]] = {
    "envhub": ("turnscale.envhub.main", "serve one env family over HTTP (AgentGym-compatible)"),
    "learner": ("turnscale.learnerapp", "the central learner: leases, training, weight publication"),
    "actor": ("turnscale.actors.main", "one actor process: inference engine + episodes, pointed at a learner"),
    "run": ("turnscale.launch", "everything on one machine: envhub, learner, actors (embedded defaults)"),
    "eval": ("turnscale.evaluate", "success / Avg@k / Pass@k of a checkpoint on an env split"),
    "export": ("turnscale.learner.export", "a learner checkpoint (sharded or not) as an HF model folder"),
    "experiment": ("turnscale.experiment", "ScalingInter-RL vs fixed turn limits: same budget, seeds, error bars"),
    "bench": ("turnscale.benchmarks.main", "throughput benchmarks, as ratios against in-run baselines"),
    "view": ("turnscale.viewer", "browse trajectories of a run directory in a local web app"),
    "slurm": ("turnscale.slurm", "sbatch scripts for a Slurm cluster (learner, envhub, one actor array per pool); --dry-run prints them"),
    "autoscale": ("turnscale.autoscale", "the scaling loop for a run submitted with turnscale slurm (until the learner is done)"),
    "keys": ("turnscale.keys", "write CURVE key files (learner, actors, authorized/) for non-loopback runs"),
}

HELP_FLAGS = ("-h", "--help")


@dataclasses.dataclass(frozen=True)
class HydraRole:
    """How ``turnscale <role> --help`` describes a role whose arguments are Hydra overrides."""

    usage: str
    section: str
    """The config section the role is mostly set through (its keys are listed)."""
    examples: tuple[str, ...]
    """Whole command lines; each one's overrides compose (tests/unit/test_cli.py)."""
    notes: tuple[str, ...] = ()


HYDRA_ROLES: dict[str, HydraRole] = {
    "envhub": HydraRole(
        "turnscale envhub [env=NAME] [host=HOST] [port=PORT] [env.KEY=VALUE ...]", "env",
        ("turnscale envhub env=babyai host=127.0.0.1 port=8301",
         "turnscale envhub env=textcraft port=8302 env.max_instances=128",
         "turnscale envhub env=babyai env.options.text=clean env.idle_timeout_s=300"),
        ("host= and port= are shorthands for env.host= and env.port=.",
         "GET /health answers 200 once the server is ready; SIGTERM stops it.")),
    "learner": HydraRole(
        "turnscale learner [GROUP=CHOICE ...] [KEY=VALUE ...]", "learner",
        ("turnscale learner env=babyai algo=grpo schedule=scaling",
         "turnscale learner algo=sft learner.sft_data=convs.jsonl",
         "turnscale learner learner.host=0.0.0.0 learner.steps=300 learner.dir=runs/r1"),
        ("Binds learner.host on learner.port / pub_port / weights_port (default 127.0.0.1:5555/5556/5557).",)),
    "actor": HydraRole(
        "turnscale actor [GROUP=CHOICE ...] [KEY=VALUE ...]", "actor",
        ("turnscale actor actor.learner_host=10.0.0.1",
         "turnscale actor actor.learner_host=10.0.0.1 engine=vllm actor.max_groups=8",
         "turnscale actor env.url=http://10.0.0.2:8301 actor.pool=gpu"),
        ("The env, model and engine settings must match the learner's (same groups and overrides).",)),
    "run": HydraRole(
        "turnscale run [GROUP=CHOICE ...] [KEY=VALUE ...]", "run",
        ("turnscale run run.dir=runs/demo",
         "turnscale run env=web run.dir=runs/web",
         "turnscale run engine=vllm_cpu run.actor_python=.venv-vllm/bin/python run.dir=runs/vllm"),
        ("Without experiment=..., run composes experiment=run_<env> when conf/experiment/run_<env>.yaml "
         "exists, else experiment=run_babyai (its embedded one-machine recipe).",)),
    "slurm": HydraRole(
        "turnscale slurm [--dry-run] [GROUP=CHOICE ...] [KEY=VALUE ...]", "slurm",
        ("turnscale slurm --dry-run slurm.dir=/shared/run1",
         "turnscale slurm slurm.dir=/shared/run1 slurm.python=/shared/venv/bin/python",
         "turnscale slurm --dry-run slurm.dir=/shared/run1 slurm.env_url=http://10.0.0.5:8301"),
        ("--dry-run prints the sbatch scripts; without it they are written to slurm.dir and submitted.",
         "Every other override is passed on to the learner, envhub and actor jobs.")),
}


def conf_dir() -> Path:
    """The folder of the installed ``turnscale.conf`` package (its YAML groups), found without
    importing it."""
    spec = importlib.util.find_spec("turnscale.conf")
    assert spec is not None and spec.submodule_search_locations, "turnscale.conf is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def config_groups(folder: Path) -> dict[str, tuple[list[str], str]]:
    """``{group: (choices, default)}`` from the config folder: every subfolder holding ``*.yaml``
    is a group; its default comes from ``config.yaml``'s defaults list (``""``: none)."""
    import yaml

    defaults: dict[str, str] = {}
    for item in (yaml.safe_load((folder / "config.yaml").read_text()) or {}).get("defaults", []):
        if isinstance(item, dict):
            for key, value in item.items():
                defaults[key.split()[-1]] = "" if value is None else str(value)
    groups = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        choices = sorted(f.stem for f in sub.glob("*.yaml"))
        if choices:
            groups[sub.name] = (choices, defaults.get(sub.name, ""))
    return groups


def section_keys(section: str) -> list[str]:
    """``key=default`` for every key of one config section (``learner``), nested sections as
    ``name.*``, in the schema's order."""
    from turnscale.conf.schema import Config

    (fld,) = [f for f in dataclasses.fields(Config) if f.name == section]
    default = fld.default_factory()  # type: ignore[misc]
    out = []
    for f in dataclasses.fields(default):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out.append(f"{f.name}.*")
        else:
            shown = repr(value)
            out.append(f"{f.name}={shown if len(shown) <= 40 else '[...]' if isinstance(value, list) else '...'}")
    return out


def role_help(role: str) -> str:
    """The ``--help`` text of a Hydra role."""
    spec = HYDRA_ROLES[role]
    folder = conf_dir()
    lines = [f"usage: {spec.usage}", "", ROLES[role][1] + ".", ""]
    lines += ["Arguments are Hydra overrides: GROUP=CHOICE picks a config file of a group, KEY=VALUE sets",
              "one key (section.key, e.g. learner.steps=300); a misspelled key is refused, naming it.", ""]
    lines += ["config groups (choices; * = default):"]
    for group, (choices, default) in config_groups(folder).items():
        shown = " ".join(f"{c}*" if c == default else c for c in choices)
        lines += textwrap.wrap(f"{group:<11} {shown}" + ("" if default else "   (default: none)"), 96,
                               initial_indent="  ", subsequent_indent=" " * 14)
    from turnscale.conf.schema import Config

    sections = " ".join(f.name for f in dataclasses.fields(Config))
    lines += [""] + textwrap.wrap(f"config sections (KEY=VALUE as section.key): {sections}", 96, subsequent_indent="  ")
    lines += ["", f"{spec.section}.* keys and defaults:"]
    lines += textwrap.wrap("  ".join(section_keys(spec.section)), 96, initial_indent="  ", subsequent_indent="  ")
    if spec.notes:
        lines += [""] + [ln for note in spec.notes for ln in textwrap.wrap(note, 96)]
    lines += ["", "examples:"] + [f"  {e}" for e in spec.examples]
    lines += ["", "Full key reference (every key, its type, default and meaning):",
              f"  conf/schema.py, installed at {folder / 'schema.py'}"]
    generated = folder.parent / "docs" / "configuration.md"  # a source checkout's generated page
    if generated.is_file():
        lines += [f"  docs/configuration.md (generated from it): {generated}"]
    lines += ["", "All roles: turnscale --help"]
    return "\n".join(lines)


def usage() -> str:
    lines = ["usage: turnscale <role> [hydra overrides | flags]", "", "roles:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in ROLES.items()]
    lines += ["", "Overrides are Hydra's: turnscale learner env=textcraft algo=ppo learner.steps=300",
              "turnscale <role> --help: a role's usage, config groups, keys and examples"]
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
    if role in HYDRA_ROLES and any(a in HELP_FLAGS for a in rest):
        print(role_help(role))
        return 0
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
