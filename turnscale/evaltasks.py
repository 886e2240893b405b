"""Which tasks an evaluation runs: ``data_idx`` lists from ranges, lists or AgentGym-RL id files.

The specs are the same strings as ``env.tasks.<split>`` in the config, parsed by the one
parser, ``conf.tasks.parse_task_spec`` (the learner uses it too):

- ``"start:stop"``: ``range(start, stop)``;
- ``"3,5,9"``: those indices;
- a path to a JSON file holding AgentGym-RL's ``[{"item_id": "babyai_17"}, ...]`` (the prefix must
  name the env being evaluated) or a plain list of ints.

Eval runs each task once: order is kept and duplicates are dropped (first occurrence wins).
"""

from __future__ import annotations

from turnscale.conf import tasks as conf_tasks
from turnscale.conf.tasks import TaskSpecError

__all__ = ["TaskSpecError", "parse_task_spec"]


def parse_task_spec(spec: str, env: str) -> list[int]:
    return list(dict.fromkeys(i for i, _ in conf_tasks.parse_task_spec(spec, env)))
