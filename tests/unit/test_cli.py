"""``turnscale``: help lists the roles, unbuilt roles say so, bad overrides exit 2 naming
the key.  Runs ``python -m turnscale`` as a subprocess (PYTHONPATH from conftest)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from turnscale import cli

ISSUE_ROLES = ["envhub", "learner", "actor", "run", "eval", "bench", "view"]
HYDRA_ROLES = ["envhub", "learner", "actor", "run", "eval"]


def turnscale(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turnscale", *args], capture_output=True, text=True, timeout=timeout)


def _built(role: str) -> bool:
    try:
        return importlib.util.find_spec(cli.ROLES[role][0]) is not None
    except ModuleNotFoundError:
        return False


def test_help_lists_every_role():
    out = turnscale("--help")
    assert out.returncode == 0
    assert set(ISSUE_ROLES) <= set(cli.ROLES)
    for role, (_, desc) in cli.ROLES.items():
        assert f"  {role}" in out.stdout and desc in out.stdout


def test_no_arguments_prints_usage_and_exits_2():
    out = turnscale()
    assert out.returncode == 2 and "roles:" in out.stdout


def test_unknown_role_exits_2():
    out = turnscale("nosuchrole")
    assert out.returncode == 2 and "unknown role 'nosuchrole'" in out.stderr


@pytest.mark.parametrize("role", ISSUE_ROLES)
def test_every_role_the_issues_ask_for_is_built(role):
    assert _built(role), f"{role}: {cli.ROLES[role][0]} is missing"


@pytest.mark.parametrize("role", HYDRA_ROLES)
def test_bad_override_of_a_built_role_exits_2_naming_the_key(role):
    out = turnscale(role, "nosuch_key=1", timeout=120)
    assert out.returncode == 2, out.stderr
    assert "nosuch_key" in out.stderr


def _with_fake_role(module: str, *args: str) -> subprocess.CompletedProcess:
    code = (
        "import sys; from turnscale import cli; "
        f"cli.ROLES['fake'] = ({module!r}, 'a test role'); "
        "sys.exit(cli.main(sys.argv[1:]))"
    )
    return subprocess.run([sys.executable, "-c", code, "fake", *args], capture_output=True, text=True, timeout=60)


def test_bad_override_exits_2_naming_the_key():
    ok = _with_fake_role("tests.unit.cli_fake_roles", "algo=ppo")
    assert ok.returncode == 0 and "config ok" in ok.stdout, ok.stderr
    for override, key in (("nosuch_key=1", "nosuch_key"), ("algo.lrr=1", "algo.lrr"), ("env.port=abc", "env.port")):
        out = _with_fake_role("tests.unit.cli_fake_roles", override)
        assert out.returncode == 2, (override, out.stderr)
        assert key in out.stderr and "Traceback" not in out.stderr


def test_missing_role_module_is_not_built_yet_but_a_missing_dependency_is_an_error():
    out = _with_fake_role("turnscale.no_such_module")
    assert out.returncode == 2 and "not built yet" in out.stderr
    out = _with_fake_role("tests.unit.cli_fake_broken_role")
    assert out.returncode != 0 and "not built yet" not in out.stderr
    assert "surely_not_an_installed_package" in out.stderr


def test_bench_rejects_an_unknown_flag_and_an_unknown_benchmark():
    out = turnscale("bench", "--nosuch-flag")
    assert out.returncode == 2 and "--nosuch-flag" in out.stderr
    out = turnscale("bench", "nosuchbench")
    assert out.returncode == 2 and "nosuchbench" in out.stderr


def _conf_groups() -> dict[str, list[str]]:
    """The config groups as the conf/ folder has them (read here independently of the CLI)."""
    from pathlib import Path

    from turnscale import conf

    folder = Path(conf.__file__).parent
    return {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in folder.iterdir() if d.is_dir() and any(d.glob("*.yaml"))}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("role", sorted(cli.HYDRA_ROLES))
def test_a_hydra_role_answers_help_with_its_groups_keys_examples_and_reference(role, flag, capsys):
    """Hydra would read ``--help`` as an override (``LexerNoViableAltException``, exit 2)."""
    assert cli.main([role, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: turnscale {role}") and "Lexer" not in out
    groups = _conf_groups()
    assert {"env", "algo", "engine", "model", "schedule"} <= set(groups)
    for group, choices in groups.items():
        (line,) = [ln for ln in out.splitlines() if ln.startswith(f"  {group} ")]
        assert [c.rstrip("*") for c in line.split()[1:] if c != "(default:" and c != "none)"] == choices, line
    assert "  babyai* " in out and "grpo*" in out and "hf*" in out  # config.yaml's defaults are marked
    section = cli.HYDRA_ROLES[role].section
    assert f"{section}.* keys and defaults:" in out
    assert "examples:" in out and all(f"  {e}" in out for e in cli.HYDRA_ROLES[role].examples)
    assert "schema.py" in out


def test_help_anywhere_among_the_overrides_still_answers_help(capsys):
    assert cli.main(["run", "run.dir=/tmp/x", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: turnscale run")


@pytest.mark.parametrize("role", sorted(cli.HYDRA_ROLES))
def test_every_help_example_composes_a_valid_config(role):
    """The examples a user copies from ``--help`` load exactly as the role loads them."""
    from turnscale import conf
    from turnscale.envhub.main import rewrite_overrides
    from turnscale.launch import default_experiment

    for example in cli.HYDRA_ROLES[role].examples:
        words = example.split()
        assert words[:2] == ["turnscale", role], example
        overrides = [w for w in words[2:] if w != "--dry-run"]
        if role == "envhub":
            overrides = rewrite_overrides(overrides)
        if role == "run":
            overrides = [f"experiment={default_experiment(overrides)}", *overrides]
        conf.load(overrides)  # raises ConfigError naming a wrong key or value


def test_help_lists_the_keys_of_the_role_section_with_their_defaults():
    keys = cli.section_keys("learner")
    assert "port=5555" in keys and "steps=100" in keys and "curve.*" in keys
    assert all("=" in k or k.endswith(".*") for k in keys)
