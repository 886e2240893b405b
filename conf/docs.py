"""``docs/configuration.md``, generated from ``conf/schema.py`` and the Hydra groups in ``conf/``.

One command rewrites it (run it after adding or changing a config key; a unit test fails
while the page is out of date)::

    python -m turnscale.conf.docs            # writes docs/configuration.md of this checkout
    python -m turnscale.conf.docs --check    # exit 1 (and say so) when the page is out of date
    python -m turnscale.conf.docs --stdout   # print the page instead

Every key of ``Config`` is listed with its type (the annotation as written in the schema),
its default and its docstring.  Field docstrings are attribute docstrings (a string literal
right below the field), which Python does not keep at run time, so they are read from the
schema's source with ``ast``; inherited fields (``AlgoConfig`` from ``PPOLossConfig``) take
the docstring of the class that declares them.  The default is what a role uses with no
overrides: ``conf/config.yaml``'s groups composed over the schema (``conf.load([])``); where a
group file changes the schema's own default, both are shown.  The last part lists, per config
group choice, the keys it changes from those defaults (``conf.load([GROUP=CHOICE])``, diffed).

The output depends only on the source tree (no time stamps, no paths), so the check is exact.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from turnscale.conf import schema

COMMAND = "python -m turnscale.conf.docs"
CONF_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = CONF_DIR.parent / "docs" / "configuration.md"


@dataclasses.dataclass(frozen=True)
class ClassSource:
    """What the schema's source says about one dataclass: its docstring, and per field the
    annotation as written and the attribute docstring (empty when the field has none)."""

    doc: str
    annotations: dict[str, str]
    field_docs: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    doc: str


def read_source(text: str) -> dict[str, ClassSource]:
    """Parse the schema module's source: every class's docstring, annotations and field docstrings."""
    out: dict[str, ClassSource] = {}
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef):
            continue
        annotations: dict[str, str] = {}
        docs: dict[str, str] = {}
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                name = stmt.target.id
                annotations[name] = ast.unparse(stmt.annotation)
                nxt = body[i + 1] if i + 1 < len(body) else None
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[name] = nxt.value.value
        out[node.name] = ClassSource(ast.get_docstring(node) or "", annotations, docs)
    return out


def one_line(doc: str) -> str:
    """A docstring as one Markdown table cell: whitespace collapsed, RST ````x```` as ```x```,
    pipes escaped."""
    text = " ".join(doc.split())
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def show(value: Any) -> str:
    """A default as one would type it in a Hydra override (``true``, ``"auto"``, ``[3, 5]``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def cell(value: Any) -> str:
    text = show(value).replace("|", "\\|")
    return f"`{text}`" if text else "``"


def declaring(cls: type, name: str, sources: dict[str, ClassSource]) -> ClassSource:
    """The source of the class in ``cls``'s MRO that declares field ``name``."""
    for base in cls.__mro__:
        src = sources.get(base.__name__)
        if src is not None and name in src.annotations:
            return src
    raise KeyError(f"{cls.__name__}.{name}: no annotation in the schema's source")


def element_class(cls: type, name: str) -> type | None:
    """For a ``list[SomeDataclass]`` field, that dataclass (``slurm.pools`` -> ``PoolConfig``)."""
    m = re.fullmatch(r"list\[(\w+)\]", declaring(cls, name, SOURCES).annotations[name])
    target = getattr(schema, m.group(1), None) if m else None
    return target if isinstance(target, type) and dataclasses.is_dataclass(target) else None


def sections(cls: type, prefix: str, effective: Any, schema_default: Any) -> Iterator[tuple[str, type, list[Row]]]:
    """(dotted name, class, rows of its leaf keys) for ``cls`` and every dataclass below it,
    depth first in declaration order."""
    rows: list[Row] = []
    nested: list[tuple[str, type, Any, Any]] = []
    for f in dataclasses.fields(cls):
        src = declaring(cls, f.name, SOURCES)
        key = f"{prefix}.{f.name}" if prefix else f.name
        eff = getattr(effective, f.name) if effective is not None else None
        base = getattr(schema_default, f.name) if schema_default is not None else None
        if dataclasses.is_dataclass(base):
            nested.append((key, type(base), eff, base))
            continue
        default = cell(eff)
        if show(eff) != show(base):
            default += f" (schema: {cell(base)})"
        rows.append(Row(key, f"`{src.annotations[f.name]}`", default, one_line(src.field_docs.get(f.name, ""))))
        item = element_class(cls, f.name)
        if item is not None:
            nested.append((f"{key}[]", item, None, item()))
    yield prefix, cls, rows
    for key, sub, eff, base in nested:
        yield from sections(sub, key, eff if eff is not None else base, base)


def group_changes() -> list[tuple[str, str, list[str]]]:
    """(group, choice, ``key=value`` it changes from the defaults) for every file of every group."""
    from turnscale.conf import load

    base = flatten(load([]))
    out = []
    for group_dir in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for choice in sorted(f.stem for f in group_dir.glob("*.yaml")):
            cfg = flatten(load([f"{group_dir.name}={choice}"]))
            changed = [f"{k}={show(v)}" for k, v in cfg.items() if show(v) != show(base.get(k))]
            out.append((group_dir.name, choice, changed))
    return out


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key))
        else:
            out[key] = value
    return out


def default_groups() -> dict[str, str]:
    import yaml

    chosen = {}
    for item in (yaml.safe_load((CONF_DIR / "config.yaml").read_text()) or {}).get("defaults", []):
        if isinstance(item, dict):
            for k, v in item.items():
                chosen[k.split()[-1]] = v
    return chosen


HEADER = """\
# Configuration reference

<!-- GENERATED by `{command}` from conf/schema.py and conf/*/*.yaml: do not edit by hand;
     change the schema's docstrings and run the command (tests/unit/test_config_docs.py checks it). -->

Every role (`turnscale envhub`, `learner`, `actor`, `run`, `slurm`, ...) reads one typed config:
the Hydra groups in `conf/` composed over the dataclasses of `conf/schema.py`, checked once at
start-up (a misspelled key or a bad value stops the program naming the key).  Set any key on
the command line as `section.key=value` (`learner.steps=300`, `'env.options.levels=[0,2]'`),
pick a group file as `group=choice` (`algo=ppo`), and see a role's groups, keys and examples
with `turnscale <role> --help`.

**Default** is what a role uses with no overrides: the schema's default, or the value the
default group file sets (`conf/config.yaml`: {defaults}); where a group file changes the
schema's own default, the schema's value follows in parentheses.  `turnscale run` adds
`experiment=run_babyai` (`env=web`: `experiment=run_web`); what each group choice changes is
listed at the end.  Types are the annotations as written in the schema.

"""


def render() -> str:
    """The whole page."""
    from turnscale.conf import load

    effective = load([])
    defaults = ", ".join(f"`{k}={v}`" for k, v in default_groups().items() if v is not None)
    lines = [HEADER.format(command=COMMAND, defaults=defaults)]
    lines.append("Sections: " + ", ".join(f"[`{f.name}`](#{f.name})" for f in dataclasses.fields(schema.Config)) + ".\n")
    for f in dataclasses.fields(schema.Config):
        sub_default = getattr(schema.Config(), f.name)
        for name, cls, rows in sections(type(sub_default), f.name, getattr(effective, f.name), sub_default):
            level = "##" if "." not in name else "###"
            lines.append(f"{level} {name}\n")
            doc = SOURCES[cls.__name__].doc
            if doc:
                lines.append(f"{one_line(doc)} (`{cls.__name__}`)\n")
            else:
                lines.append(f"(`{cls.__name__}`)\n")
            if rows:
                lines.append("| key | type | default | meaning |")
                lines.append("| --- | --- | --- | --- |")
                lines += [f"| `{r.key}` | {r.type} | {r.default} | {r.doc} |" for r in rows]
                lines.append("")
    lines.append("## Config groups\n")
    lines.append("What `group=choice` changes from the defaults above (keys it sets to the value it already has are not listed).\n")
    lines.append("| group=choice | changes |")
    lines.append("| --- | --- |")
    for group, choice, changed in group_changes():
        text = "<br>".join(f"`{c}`".replace("|", "\\|") for c in changed) or "(the defaults)"
        lines.append(f"| `{group}={choice}` | {text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description="Write docs/configuration.md from conf/schema.py.")
    p.add_argument("--check", action="store_true", help="exit 1 when the page is out of date; write nothing")
    p.add_argument("--stdout", action="store_true", help="print the page instead of writing it")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    args = p.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


SOURCES = read_source(Path(schema.__file__).read_text(encoding="utf-8"))

if __name__ == "__main__":
    raise SystemExit(main())
