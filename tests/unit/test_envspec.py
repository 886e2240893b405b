"""The env table (``conf.envs``) is the one registry of env names: every env there has all
its parts, and no other module keeps its own list of env names."""

import ast
import inspect
from pathlib import Path

import pytest

from turnscale.common.parsing import FORMATS, parser_for
from turnscale.common.prompts import instruction
from turnscale.conf.envs import ENVS, EnvSpec
from turnscale.conf.schema import EnvConfig
from turnscale.conf.tasks import TaskSpecError, parse_task_spec
from turnscale.envhub.registry import family_factory

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "conf", "common", "envhub", "actors", "learner", "turnscale", "benchmarks")


@pytest.mark.parametrize("name", sorted(ENVS))
def test_every_env_has_all_its_parts(name):
    spec = ENVS[name]
    assert isinstance(spec, EnvSpec) and spec.name == name
    factory = family_factory(name)  # importable by envhub, no family built (no env deps needed)
    assert callable(factory) and inspect.getmodule(factory).__name__ == f"turnscale.envhub.{spec.server.split(':')[0]}"
    assert spec.action_format in FORMATS and parser_for(name) is FORMATS[spec.action_format]
    assert instruction(name) == spec.prompt and spec.prompt.strip()
    assert EnvConfig(name=name).name == name
    assert spec.agentgym_prefix and "_" not in spec.agentgym_prefix


def test_agentgym_item_ids_use_the_specs_prefix(tmp_path):
    f = tmp_path / "ids.json"
    for name, spec in ENVS.items():
        f.write_text(f'[{{"item_id": "{spec.agentgym_prefix.upper()}_8"}}, {{"item_id": "{spec.agentgym_prefix}_31"}}]')
        assert parse_task_spec(str(f), name) == [(8, f"{spec.agentgym_prefix.upper()}_8"), (31, f"{spec.agentgym_prefix}_31")]
    f.write_text('[{"item_id": "textcraft_3"}]')
    with pytest.raises(TaskSpecError, match="is for env 'textcraft'"):
        parse_task_spec(str(f), "babyai")


def test_unknown_envs_are_refused_everywhere():
    for lookup in (parser_for, instruction):
        with pytest.raises(ValueError, match="known: "):
            lookup("chess")
    with pytest.raises(ValueError, match="env.name"):
        EnvConfig(name="chess")


def _env_name_collections(tree: ast.AST) -> list[int]:
    """Lines of list/tuple/set/dict literals naming two or more registered envs as strings."""
    out = []
    for n in ast.walk(tree):
        items = n.keys if isinstance(n, ast.Dict) else n.elts if isinstance(n, (ast.List, ast.Tuple, ast.Set)) else []
        names = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)} & set(ENVS)
        if len(names) >= 2:
            out.append(n.lineno)
    return out


def test_no_other_module_lists_env_names():
    """Only ``conf/envs.py`` enumerates envs; everyone else reads ``ENVS`` (tests may list
    envs as test data)."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "conf" / "envs.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            found += [f"{path.relative_to(ROOT)}:{line}" for line in _env_name_collections(tree)]
    assert not found, "env names listed outside conf/envs.py (register the env there instead): " + ", ".join(found)
    assert len(_env_name_collections(ast.parse((ROOT / "conf" / "envs.py").read_text()))) == 0  # built from records
    assert len(_env_name_collections(ast.parse('X = {"babyai": 1, "webarena": 2}'))) == 1  # the check sees dicts
