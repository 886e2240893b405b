"""Which tasks an evaluation runs: ``data_idx`` lists from ranges, lists or AgentGym-RL id files.

Accepted task specs (the same strings as ``env.tasks.<split>`` in the config):

- ``"start:stop"``: ``range(start, stop)``;
- ``"3,5,9"``: those indices;
- a path to a JSON file holding AgentGym-RL's ``[{"item_id": "babyai_17"}, ...]`` (the prefix must
  name the env being evaluated) or a plain list of ints.

Order is kept and duplicates are dropped (first occurrence wins).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_ITEM = re.compile(r"^(?P<env>[A-Za-z][\w-]*?)_(?P<idx>\d+)$")


class TaskSpecError(ValueError):
    """A task spec or id file cannot be used; the message says what was expected."""


def parse_task_spec(spec: str, env: str) -> list[int]:
    spec = spec.strip()
    if not spec:
        raise TaskSpecError("empty task spec; give 'start:stop', '1,2,3' or an id file")
    if re.fullmatch(r"\d+:\d+", spec):
        a, b = (int(x) for x in spec.split(":"))
        if b <= a:
            raise TaskSpecError(f"task range {spec!r} is empty")
        return list(range(a, b))
    if re.fullmatch(r"\d+(,\d+)*", spec):
        return _dedupe(int(x) for x in spec.split(","))
    path = Path(spec).expanduser()
    if not path.is_file():
        raise TaskSpecError(f"task spec {spec!r} is neither 'start:stop', a comma list nor an existing id file")
    return parse_id_file(path, env)


def parse_id_file(path: Path, env: str) -> list[int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskSpecError(f"{path}: not a readable JSON id file ({exc})") from None
    if not isinstance(data, list) or not data:
        raise TaskSpecError(f"{path}: expected a non-empty JSON list of {{\"item_id\": \"{env}_N\"}} or of ints")
    out = []
    for i, item in enumerate(data):
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out.append(item)
            continue
        item_id = item.get("item_id") if isinstance(item, dict) else None
        m = _ITEM.match(item_id) if isinstance(item_id, str) else None
        if not m:
            raise TaskSpecError(f"{path}: entry {i} is {item!r}; expected {{\"item_id\": \"{env}_N\"}} or an int")
        if m["env"].lower() != env.lower():
            raise TaskSpecError(f"{path}: entry {i} ({item_id!r}) is for env {m['env']!r}, not {env!r}")
        out.append(int(m["idx"]))
    return _dedupe(out)


def _dedupe(xs) -> list[int]:
    return list(dict.fromkeys(xs))
