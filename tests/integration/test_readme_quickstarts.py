"""The README's quick starts, run as a user types them: the console script, from a folder outside
the checkout, no ``PYTHONPATH``.  The commands are read from README.md itself, so editing the
README edits the test.  Commands that start long-lived servers on other hosts are checked in
``tests/unit/test_docs.py`` (their overrides compose); here: the key files the several-hosts
quick start makes are the ones its commands name, and the Slurm quick start's dry run prints
the jobs it promises."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.integration.test_install_layout import _console_script, _typed

ROOT = Path(__file__).resolve().parents[2]


def quickstart_commands(title: str) -> list[str]:
    """The commands of the README section whose heading starts with ``title`` (indented code,
    ``\\`` continuations joined, comment lines dropped)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(title)}.*?\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert m, f"README.md has no section '## {title}...'"
    code = "\n".join(line[4:] for line in m.group(1).splitlines() if line.startswith("    "))
    code = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]


def typed(script: Path, command: str, cwd: Path):
    words = shlex.split(command, comments=True)
    assert words[0] == "turnscale", command
    return _typed(script, *words[1:], cwd=cwd)


def test_the_several_hosts_quick_start_makes_every_key_file_its_commands_name(tmp_path: Path):
    script = _console_script(tmp_path)
    commands = quickstart_commands("Quick start: the roles by hand on several hosts")
    (keys_cmd,) = [c for c in commands if c.startswith("turnscale keys ")]
    r = typed(script, keys_cmd, tmp_path)
    assert r.returncode == 0, f"`{keys_cmd}`: exit {r.returncode}\n{r.stderr[-2000:]}"
    named = {p for c in commands if c is not keys_cmd for p in re.findall(r"=(keys/\S+)", c)}
    assert named, commands
    for path in sorted(named):
        assert (tmp_path / path).exists(), f"the quick start names {path}, which `{keys_cmd}` did not make"


def test_the_slurm_quick_start_dry_run_prints_every_job_as_typed(tmp_path: Path):
    script = _console_script(tmp_path)
    (dry,) = [c for c in quickstart_commands("Quick start: Slurm") if "--dry-run" in c]
    r = typed(script, dry, tmp_path)
    assert r.returncode == 0, f"`{dry}`: exit {r.returncode}\n{r.stderr[-2000:]}"
    folder = re.search(r"slurm\.dir=(\S+)", dry).group(1)
    pools = re.findall(r"name:(\w+)", dry)
    for job in ["learner.sbatch", "envhub.sbatch", *(f"actors-{p}.sbatch" for p in pools)]:
        assert f"# ===== {folder}/{job}" in r.stdout, f"`{dry}` printed no {job}:\n{r.stdout[:2000]}"
    assert not Path(folder).exists(), f"the dry run created {folder}"
