"""The README and docs/ stay what a newcomer can trust: the README is short, every link in them
leads somewhere, every ``turnscale <role> KEY=VALUE ...`` command they show composes a
valid config exactly as the role loads it, and every flag-style command (``turnscale eval``,
``bench``, ``keys``, ``python -m turnscale.<module>`` ...) parses with its module's own argparse
(a renamed or misspelled key or flag fails here, naming the page and the command).  The quick
starts that can run here run as typed in ``tests/integration/test_readme_quickstarts.py``."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HYDRA_ROLES = ("envhub", "learner", "actor", "run", "slurm")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(h) for h in HEADING.findall(text)}


def code_lines(text: str) -> list[str]:
    """Command lines shown as code: fenced blocks and 4-space indented blocks (continuations
    joined), and inline code spans."""
    out: list[str] = []
    block = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    indented = [m for m in re.findall(r"(?:^(?: {4}).*\n?)+", text, flags=re.M)]
    for chunk in block + indented:
        out += re.sub(r"\\\n\s*", " ", chunk).splitlines()
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return [line.strip() for line in out]


def overrides_of(command: str) -> tuple[str, list[str]]:
    """(role, overrides) of a command as the shell splits it (quotes, ``# comments``); a word
    with ``...`` is a placeholder (``...same overrides...``) and is left out."""
    words = shlex.split(command, comments=True)
    return words[1], [w for w in words[2:] if w != "--dry-run" and "..." not in w]


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every ``turnscale <hydra role> ...`` shown in the README and docs/,
    once per distinct (role, overrides)."""
    found: dict[tuple[str, ...], tuple[str, str]] = {}
    for page in PAGES:
        for line in code_lines(page.read_text(encoding="utf-8")):
            m = re.match(r"^(?:\S*/)?turnscale (\w+)( .*)?$", line)
            if m and m.group(1) in HYDRA_ROLES and "<" not in line:
                role, overrides = overrides_of(line)
                found.setdefault((role, *overrides), (page.relative_to(ROOT).as_posix(), line))
    return list(found.values())


def test_readme_is_a_five_minute_read():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; keep it <= 200 and move detail to a page under docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path):
    text = page.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link ({target}) leads to no file"
        if anchor:
            assert anchor in anchors(dest), f"{page.name}: link ({target}): no heading with that anchor in {dest.name}"


def test_the_docs_show_commands_of_every_hydra_role():
    roles = {re.match(r"^(?:\S*/)?turnscale (\w+)", cmd).group(1) for _, cmd in documented_commands()}
    assert set(HYDRA_ROLES) <= roles, roles


@pytest.mark.parametrize("page,command", documented_commands(), ids=lambda v: v if v.endswith(".md") else "")
def test_every_documented_command_composes_a_valid_config(page: str, command: str):
    """The overrides as typed, through each role's own argument handling."""
    from turnscale import conf
    from turnscale.envhub.main import rewrite_overrides
    from turnscale.launch import default_experiment

    role, overrides = overrides_of(command)
    if role == "envhub":
        overrides = rewrite_overrides(overrides)
    if role == "run":
        overrides = [f"experiment={default_experiment(overrides)}", *overrides]
    try:
        cfg = conf.load(overrides)
        if role == "slurm":
            from turnscale.slurm import pool_configs

            pool_configs(cfg, overrides)
    except conf.ConfigError as exc:
        pytest.fail(f"{page}: `{command}` does not compose: {exc}")


class Parsed(Exception):
    """Raised in place of running a command, once its arguments have parsed."""


def argparse_commands() -> list[tuple[str, str]]:
    """(page, command) for every argparse command the README and docs/ show with arguments:
    ``turnscale <eval|view|keys|bench|experiment|autoscale> ...`` and ``python -m turnscale.<module> ...``.
    ``<placeholders>`` stand for a value (``<same overrides>`` for none); ``[a|b]`` is expanded into one command per choice;
    ``[--flag x]`` (an optional part) is left out."""
    found: dict[str, tuple[str, str]] = {}
    for page in PAGES:
        for line in code_lines(page.read_text(encoding="utf-8")):
            m = re.match(r"^(?:\S*/)?turnscale (\w+) (.+)$", line) or re.match(r"^python -m (turnscale\.[\w.]+) (.+)$", line)
            if not m or m.group(1) in HYDRA_ROLES or m.group(2).startswith("#"):
                continue
            line = re.sub(r" \[--[^\]]*\]", "", line)
            choices = re.search(r"\[(\w+(?:\|\w+)+)\]", line)
            for choice in choices.group(1).split("|") if choices else [None]:
                cmd = line.replace(choices.group(0), choice) if choice else line
                found.setdefault(cmd, (page.relative_to(ROOT).as_posix(), cmd))
    return list(found.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page,command", argparse_commands(), ids=lambda v: v if v.endswith(".md") else "")
def test_every_documented_argparse_command_parses(page: str, command: str, monkeypatch):
    """Each command's words (as the shell splits them) go to its module's ``main`` exactly as the
    CLI passes them; argparse must accept them (an unknown or renamed flag fails here), and the
    ``KEY=VALUE`` overrides a role takes beside its flags must compose.  Nothing runs: parsing
    raises ``Parsed`` instead of returning."""
    import argparse
    import importlib

    from turnscale import cli

    words = shlex.split(re.sub(r"<[^>]+>", "PLACEHOLDER", re.sub(r"<[^>]*overrides>", "", command)), comments=True)
    if words[0] == "python":
        module, argv = words[2], words[3:]
    else:
        module, argv = cli.ROLES[words[1]][0], words[2:]
    inside = {"parse_args": False}
    orig_args, orig_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):
        inside["parse_args"] = True
        try:
            ns = orig_args(self, args, namespace)
        finally:
            inside["parse_args"] = False
        raise Parsed(ns)

    def parse_known_args(self, args=None, namespace=None):
        result = orig_known(self, args, namespace)
        if inside["parse_args"]:
            return result
        raise Parsed(*result)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    main = importlib.import_module(module).main
    try:
        main(argv)
    except Parsed as parsed:
        rest = parsed.args[1] if len(parsed.args) > 1 else []
        # parse_known_args: what is left must be Hydra overrides (KEY=VALUE), and they must compose
        bad = [a for a in rest if "=" not in a or a.startswith("-")]
        assert not bad, f"{page}: `{command}`: unrecognized arguments {bad}"
        if rest:
            from turnscale import conf

            conf.load(rest)
        return
    except SystemExit as exc:
        pytest.fail(f"{page}: `{command}`: its arguments do not parse (exit {exc.code}; argparse said why above)")
    pytest.fail(f"{page}: `{command}`: {module}.main returned without parsing arguments with argparse")
