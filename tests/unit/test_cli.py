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
