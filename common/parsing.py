"""Per-env action parsers: the model's turn text -> the action string the env receives.

Each env names its format in ``conf.envs`` (``EnvSpec.action_format``).  Formats (AgentGym's
agent side):

- ``action_line`` (BabyAI, TextCraft, SciWorld): ReAct ``Thought: ...\\nAction: ...``; the
  action is the text after ``Action:`` up to the line end.  Zero or several ``Action:``
  markers, or an empty action, is a parse failure.
- ``tags`` (SearchQA): the first ``<search>q</search>`` or ``<answer>a</answer>`` block;
  the raw tag text (``<search>q</search>``) is what the env receives.
- ``backticks`` (WebArena): the first triple-back-tick block's content, stripped.

A failure is ``ParseResult(ok=False, hint=...)``: the hint is sent back to the model as
the observation (the env is not stepped), telling it the expected format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from turnscale.conf.envs import env_spec


@dataclass(frozen=True)
class ParseResult:
    ok: bool
    action: str = ""
    """What to send to the env (empty when ``ok`` is False)."""
    hint: str = ""
    """Observation for the model when ``ok`` is False."""


ActionParser = Callable[[str], ParseResult]
"""``parser(text) -> ParseResult``."""

ACTION_LINE_HINT = (
    "Invalid format. Reply with your reasoning and then exactly one action on its own line, as:\n"
    "Thought: <your reasoning>\nAction: <your action>"
)
TAGS_HINT = (
    "Invalid format. To search, write <search> your query </search>; to give the final answer, "
    "write <answer> your answer </answer>."
)
BACKTICKS_HINT = (
    "Invalid format. Put exactly one action inside a triple-back-tick block, e.g. ```click [1234]```."
)

_ACTION = re.compile(r"Action:")
_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_BACKTICKS = re.compile(r"```(.*?)```", re.DOTALL)


def parse_action_line(text: str) -> ParseResult:
    marks = list(_ACTION.finditer(text))
    if len(marks) != 1:
        return ParseResult(ok=False, hint=ACTION_LINE_HINT)
    action = text[marks[0].end():].split("\n", 1)[0].strip()
    if not action:
        return ParseResult(ok=False, hint=ACTION_LINE_HINT)
    return ParseResult(ok=True, action=action)


def parse_tags(text: str) -> ParseResult:
    m = _TAG.search(text)
    if m is None or not m.group(2).strip():
        return ParseResult(ok=False, hint=TAGS_HINT)
    return ParseResult(ok=True, action=m.group(0))


def parse_backticks(text: str) -> ParseResult:
    m = _BACKTICKS.search(text)
    action = m.group(1).strip() if m else ""
    if not action:
        return ParseResult(ok=False, hint=BACKTICKS_HINT)
    return ParseResult(ok=True, action=action)


FORMATS: dict[str, ActionParser] = {
    "action_line": parse_action_line,
    "tags": parse_tags,
    "backticks": parse_backticks,
}
"""Action format name (``conf.envs.EnvSpec.action_format``) -> its parser."""


def parser_for(env: str) -> ActionParser:
    """The action parser of ``env``: ``FORMATS[conf.envs.ENVS[env].action_format]``."""
    return FORMATS[env_spec(env, what="action parser").action_format]
