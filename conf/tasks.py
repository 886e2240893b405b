"""The one parser of task specs (``env.tasks.<split>`` in the config, ``--tasks`` of eval).

A task spec is one of:

- ``"start:stop"``: ``range(start, stop)``, ``0 <= start < stop``;
- ``"3,5,9"`` (or a single ``"7"``): those indices, in that order;
- the path of a JSON file holding AgentGym-RL's item list ``[{"item_id": "babyai_17"}, ...]``
  (the prefix, if any, must be the env's ``conf.envs`` ``agentgym_prefix``, case aside) or a plain list of non-negative ints.

An existing file wins over the range/list reading of the same string.  ``parse_task_spec``
returns ``(data_idx, task_id)`` pairs in spec/file order, duplicates kept (``task_id`` is the
item id for AgentGym-RL items, else ``""``); bad specs raise ``TaskSpecError`` naming the
spec and what to give instead.  The learner (``learner/tasks.py``) and eval
(``turnscale/evaltasks.py``) both use it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from turnscale.conf.envs import ENVS

_SHAPES = "give 'start:stop', a comma list '3,5,9' or a JSON id file"


class TaskSpecError(ValueError):
    """A task spec (``env.tasks.*``, eval's ``--tasks``) is not a range, a list or a readable
    task file; the message says what was expected."""


def parse_task_spec(spec: str, env: str, split: str = "") -> list[tuple[int, str]]:
    """``spec`` -> ``(data_idx, task_id)`` pairs of ``env`` (see the module docstring);
    ``split`` only labels error messages."""
    label = f"{env}/{split}" if split else env
    spec = spec.strip()
    if not spec:
        raise TaskSpecError(f"empty task spec for {label}: {_SHAPES}")
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return _load_task_file(path, env, label)
    if ":" in spec:
        start_s, _, stop_s = spec.partition(":")
        try:
            start, stop = int(start_s), int(stop_s)
        except ValueError:
            raise TaskSpecError(f"task range {spec!r} for {label}: expected 'start:stop' with integers") from None
        if not 0 <= start < stop:
            raise TaskSpecError(f"task range {spec!r} for {label}: need 0 <= start < stop")
        return [(i, "") for i in range(start, stop)]
    parts = [p.strip() for p in spec.split(",")]
    if all(p.isascii() and p.isdigit() for p in parts):
        return [(int(p), "") for p in parts]
    raise TaskSpecError(f"task spec {spec!r} for {label} is neither 'start:stop', a comma list '3,5,9' "
                        "nor an existing JSON id file")


def _load_task_file(path: str, env: str, label: str) -> list[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise TaskSpecError(f"task file {path!r} for {label} is not a readable JSON file: {exc}") from None
    if not isinstance(items, list) or not items:
        raise TaskSpecError(f"task file {path!r} for {label}: expected a non-empty JSON list of ints or of "
                            f"{{\"item_id\": \"{env}_<n>\"}}")
    return [_item(it, f"task file {path!r} entry {i}", env) for i, it in enumerate(items)]


def _agentgym_prefix(env: str) -> str:
    """AgentGym-RL's item-id prefix for ``env`` (``conf.envs``; the env name itself for an env
    not in the table)."""
    spec = ENVS.get(env)
    return spec.agentgym_prefix if spec else env


def _item(item: Any, where: str, env: str) -> tuple[int, str]:
    if isinstance(item, int) and not isinstance(item, bool):
        if item < 0:
            raise TaskSpecError(f"{where}: data_idx {item} is negative")
        return item, ""
    if isinstance(item, dict) and isinstance(item.get("item_id"), str):
        item_id = item["item_id"]
        prefix, _, num = item_id.rpartition("_")
        if not (num.isascii() and num.isdigit()):
            raise TaskSpecError(f"{where}: item_id {item_id!r} is not '{env}_<n>'")
        if prefix and prefix.lower() != _agentgym_prefix(env).lower():
            raise TaskSpecError(f"{where}: item_id {item_id!r} is for env {prefix!r}, not {env!r}")
        return int(num), item_id
    raise TaskSpecError(f"{where}: expected an int or {{\"item_id\": \"{env}_<n>\"}}, got {item!r}")
