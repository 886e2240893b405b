"""docs/configuration.md is generated from conf/schema.py (``python -m turnscale.conf.docs``):
it lists every key with its type, default and docstring, and it is never out of date."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from turnscale.conf import docs, schema

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def leaf_keys(cls: type, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            out += leaf_keys(type(value), key)
        else:
            out.append(key)
    return out


@pytest.fixture(scope="module")
def page() -> str:
    return docs.render()


def test_configuration_page_is_up_to_date(page: str):
    expected = page
    current = PAGE.read_text(encoding="utf-8") if PAGE.is_file() else ""
    assert current == expected, (
        f"docs/configuration.md is out of date with conf/schema.py: run `{docs.COMMAND}` "
        "(from the checkout, in its venv: .venv/bin/python -m turnscale.conf.docs) and commit the page")


def test_every_config_key_is_listed_with_its_type_default_and_docstring(page: str):
    rows = {line.split("|")[1].strip().strip("`"): line for line in page.splitlines() if line.startswith("| `")}
    for key in leaf_keys(schema.Config, ""):
        assert key in rows, f"config key {key} is missing from the generated page"
    # an attribute docstring (read from the source with ast) lands in its row, an inherited
    # field's from the class that declares it, and a group file's default beside the schema's
    assert "Deadline of every env call" in rows["env.limits.call_timeout_s"]
    assert "`60.0`" in rows["env.limits.call_timeout_s"] and "`float`" in rows["env.limits.call_timeout_s"]
    assert "eps_low" in rows["algo.clip_low"]
    assert '`"0:4000"` (schema: `"0:1000"`)' in rows["env.tasks.train"]
    assert "slurm.pools[].name" in rows and "Pool name" in rows["slurm.pools[].name"]


def test_the_generator_reads_attribute_docstrings_from_source():
    src = docs.read_source('class A:\n    """Doc of A."""\n\n    x: int = 1\n    """What x is."""\n    y: list[str] = []\n')
    assert src["A"].doc == "Doc of A."
    assert src["A"].annotations == {"x": "int", "y": "list[str]"}
    assert src["A"].field_docs == {"x": "What x is."}


def test_check_mode_names_the_command_when_the_page_is_stale(tmp_path, monkeypatch, capsys, page: str):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n", encoding="utf-8")
    monkeypatch.setattr(docs, "render", lambda: page)
    assert docs.main(["--check", "--out", str(stale)]) == 1
    assert "python -m turnscale.conf.docs" in capsys.readouterr().err
    assert stale.read_text(encoding="utf-8") == "old\n", "--check must not write"
    assert docs.main(["--out", str(stale)]) == 0 and stale.read_text(encoding="utf-8") == page
    assert docs.main(["--check", "--out", str(stale)]) == 0


def test_the_generator_runs_as_the_documented_module(tmp_path):
    r = subprocess.run([sys.executable, "-m", "turnscale.conf.docs", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "--check" in r.stdout, r.stderr[-2000:]


def test_every_config_key_has_a_docstring(page: str):
    """Every key's meaning is written beside it in conf/schema.py (an attribute docstring)."""
    undocumented = [line.split("|")[1].strip() for line in page.splitlines()
                    if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert not undocumented, f"add a docstring below each of these fields in conf/schema.py: {', '.join(undocumented)}"
