"""The project installs under one namespace, ``turnscale`` (pyproject.toml's package-dir).

A regular wheel holds nothing at the top level but ``turnscale/`` (no generic ``conf``,
``protocol``, ``actors`` ... to collide with other projects in site-packages), and works from
there: the roles import, the Hydra config composes from the packaged YAML, the CLI answers.
The editable install that ``scripts/setup.sh`` makes resolves ``turnscale.<pkg>`` to this
checkout's folders and provides no bare top-level name either.
"""

from __future__ import annotations

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
