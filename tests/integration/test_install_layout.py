"""The project installs under one namespace, ``turnscale`` (pyproject.toml's package-dir).

A regular wheel holds nothing at the top level but ``turnscale/`` (no generic ``conf``,
``protocol``, ``actors`` ... to collide with other projects in site-packages), and works from
there: the roles import, the Hydra config composes from the packaged YAML, the CLI answers.
The editable install that ``scripts/setup.sh`` makes resolves ``turnscale.<pkg>`` to this
checkout's folders and provides no bare top-level name either.  Its console script, run as a
user types it (from a folder outside the checkout, no ``PYTHONPATH``), answers ``--help`` for
every role and runs ``turnscale bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAPPED = ("protocol", "conf", "common", "envhub", "actors", "learner", "benchmarks", "cluster")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_clean_env(**env), capture_output=True,
                          text=True, timeout=240)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=300, cwd=out)
    if r.returncode != 0 and "No module named" in r.stderr and "setuptools" in r.stderr:
        pytest.skip("setuptools is not installed in this venv (needed to build the wheel without isolation)")
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("turnscale-*.whl")
    return whl


def test_wheel_installs_everything_under_the_turnscale_namespace(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"turnscale", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top
    for pkg in MAPPED:
        assert f"turnscale/{pkg}/__init__.py" in names, f"turnscale.{pkg} missing from the wheel"
    assert any(n.startswith("turnscale/conf/") and n.endswith(".yaml") for n in names), "the Hydra YAML is not packaged"
    assert "turnscale/envhub/data/searchqa/corpus.jsonl" in names


def test_roles_config_and_cli_run_from_the_installed_wheel(wheel: Path, tmp_path: Path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    code = (
        "import turnscale.actors.main, turnscale.learner.main, turnscale.envhub.main, turnscale.protocol.codec\n"
        "import turnscale.actors\n"
        "from turnscale import conf\n"
        "c = conf.load(['env=textcraft'])\n"
        "print(turnscale.actors.__file__)\n"
        "print(c.env.name)\n"
    )
    r = _python(code, tmp_path, PYTHONPATH=str(target))  # cwd outside the checkout: only the wheel is seen
    assert r.returncode == 0, r.stderr[-2000:]
    file, env_name = r.stdout.split()
    assert Path(file).is_relative_to(target) and env_name == "textcraft"
    cli = subprocess.run([sys.executable, "-m", "turnscale", "--help"], cwd=tmp_path, env=_clean_env(PYTHONPATH=str(target)),
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "envhub" in cli.stdout, cli.stderr[-2000:]
    for role in ("run", "bench"):  # the role help reads the packaged conf/; bench imports turnscale.benchmarks.*
        r = subprocess.run([sys.executable, "-m", "turnscale", role, "--help"], cwd=tmp_path, env=_clean_env(PYTHONPATH=str(target)),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: turnscale {role}"), r.stderr[-2000:]
        if role == "run":
            assert "babyai*" in r.stdout and str(target / "turnscale" / "conf" / "schema.py") in r.stdout
        else:
            assert "--transport-sizes" in r.stdout  # the benchmarks' own flags: their modules imported


def test_editable_install_maps_the_namespace_to_this_checkout_and_installs_no_bare_names(tmp_path: Path):
    probe = "import turnscale; print(turnscale.__file__)"
    r = _python(probe, tmp_path)
    if r.returncode != 0:
        pytest.skip(f"turnscale is not installed in this venv ({r.stderr.strip().splitlines()[-1]}); scripts/setup.sh installs it editable")
    if not Path(r.stdout.strip()).is_relative_to(ROOT):
        pytest.skip(f"this venv's editable install is of another checkout ({r.stdout.strip()})")
    code = (
        "import importlib.util, turnscale.actors, turnscale.conf\n"
        "print(turnscale.actors.__file__)\n"
        f"print([p for p in {MAPPED!r} if importlib.util.find_spec(p) is not None])\n"
    )
    r = _python(code, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    file, bare = r.stdout.splitlines()
    assert Path(file) == ROOT / "actors" / "__init__.py"
    assert bare == "[]", f"bare top-level modules importable outside the checkout: {bare}"


def _console_script(tmp_path: Path) -> Path:
    """This venv's ``turnscale`` script, when it is an install of this checkout (else skip)."""
    script = Path(sys.executable).parent / "turnscale"
    if not script.is_file():
        pytest.skip(f"no console script at {script}; scripts/setup.sh installs turnscale into the venv")
    r = _python("import turnscale; print(turnscale.__file__)", tmp_path)
    if r.returncode != 0 or not Path(r.stdout.strip()).is_relative_to(ROOT):
        pytest.skip(f"this venv's turnscale is not this checkout's ({(r.stdout or r.stderr).strip()[-200:]})")
    return script


def _typed(script: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``turnscale <args>`` as a user types it: the console script, cwd outside the checkout, no PYTHONPATH."""
    return subprocess.run([str(script), *args], cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)


def test_the_console_script_sees_no_bare_top_level_package(tmp_path: Path):
    """Precondition of the tests below: a bare ``import benchmarks`` (or ``conf``, ...) inside the
    package fails under the console script, as it does for every installed user (the checkout's
    root is on ``sys.path`` only under pytest and its children, through PYTHONPATH)."""
    script = _console_script(tmp_path)
    python = script.read_text().splitlines()[0].removeprefix("#!").strip()
    code = f"import importlib.util; print([p for p in {MAPPED!r} if importlib.util.find_spec(p) is not None])"
    r = subprocess.run([python, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


def test_every_role_answers_help_as_typed_from_outside_the_checkout(tmp_path: Path):
    from turnscale.cli import ROLES

    script = _console_script(tmp_path)
    top = _typed(script, "--help", cwd=tmp_path)
    assert top.returncode == 0 and all(f"  {role}" in top.stdout for role in ROLES), top.stderr[-2000:]
    for role in ROLES:
        for flag in ("--help", "-h"):
            r = _typed(script, role, flag, cwd=tmp_path)
            assert r.returncode == 0, f"turnscale {role} {flag}: exit {r.returncode}\n{r.stderr[-2000:]}"
            assert r.stdout.startswith(f"usage: turnscale {role}"), f"turnscale {role} {flag}:\n{r.stdout[:500]}"
            assert "Traceback" not in r.stderr and "Lexer" not in r.stdout + r.stderr


def test_bench_runs_as_typed_from_outside_the_checkout_and_writes_the_documented_json(tmp_path: Path):
    """``turnscale bench transport --json out.json`` (shortened to one size for a fraction of a
    second); DESIGN.md section 8's shape.  Its receiver is a child process started with
    ``-m turnscale.benchmarks.transport``."""
    script = _console_script(tmp_path)
    r = _typed(script, "bench", "transport", "--transport-sizes", "64KB", "--transport-seconds", "0.2",
               "--transport-repeats", "1", "--no-transport-ceiling", "--json", "out.json", cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "out.json").read_text())
    assert set(doc) == {"machine", "results"} and {"platform", "python", "cpus"} <= set(doc["machine"])
    keys = {"name", "value", "unit", "baseline", "baseline_value", "ratio", "target", "ok"}
    assert doc["results"] and all(set(res) == keys for res in doc["results"])
    assert [res["name"] for res in doc["results"]] == ["transport_64KB_mb_s", "transport_64KB_groups_s", "transport_64KB_cpu_us"]
