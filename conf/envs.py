"""The env table: one ``EnvSpec`` per env, registered once; adding an env touches only here
(plus the env's own server module under ``envhub/``).

Everything an env name means to the rest of the system is read from ``ENVS``:

- ``conf.schema.EnvConfig`` validates ``env.name`` against it;
- ``conf.tasks`` takes the AgentGym item-id prefix (``babyai_17``) from ``agentgym_prefix``;
- ``common.parsing.parser_for`` maps ``action_format`` to the parser of that format;
- ``common.prompts.instruction`` returns ``prompt``;
- ``envhub.registry.make_family`` resolves ``server`` (``"<module>:<factory>"``, a module
  *inside* ``envhub/``, named relative to it so that conf, the bottom layer, holds no
  reference to a role package: only envhub imports it, as ``envhub.<module>``).

It sits in conf because conf is the lowest layer that needs env names (the schema checks them)
and conf may import nothing but protocol; common/ and envhub/ read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvSpec:
    name: str
    """``env.name`` in the config, ``Task.env`` on the wire."""
    server: str
    """``"<module>:<factory>"`` of the env's family inside ``envhub/`` (``factory(EnvConfig) ->
    envhub.base.EnvFamily``), resolved by ``envhub.registry`` as ``envhub.<module>``."""
    action_format: str
    """Name of the action parser's format in ``common.parsing.FORMATS``: ``action_line``
    (ReAct ``Action:``), ``tags`` (``<search>``/``<answer>``) or ``backticks``."""
    prompt: str
    """The instruction sent as the system message of every episode (``common.prompts``)."""
    agentgym_prefix: str
    """Prefix of AgentGym-RL's item ids for this env (``babyai`` in ``babyai_17``; matched case
    aside, so ``BabyAI_8`` is accepted too)."""


_REACT = (
    "Every reply must have the form:\n"
    "Thought: <your reasoning>\n"
    "Action: <exactly one action>\n"
)

_SPECS = (
    EnvSpec(
        name="babyai", server="babyai:make_family", action_format="action_line", agentgym_prefix="babyai",
        prompt=(
            "You are an agent in a grid world (BabyAI). Each observation describes your goal, the "
            "objects you can see (with how many steps ahead, left or right they are) and the "
            "available actions. Reach the goal with as few actions as possible. Use only actions "
            "from the available list, e.g. 'turn left', 'turn right', 'move forward', "
            "'go to red ball 1', 'pickup red ball 1', 'toggle', 'drop', 'check available actions'.\n"
            + _REACT
        ),
    ),
    EnvSpec(
        name="textcraft", server="textcraft:make_family", action_format="action_line", agentgym_prefix="textcraft",
        prompt=(
            "You are crafting items in Minecraft (TextCraft). You are given crafting commands and "
            "a goal item. Valid actions: 'get <count> <item>' to fetch a base item, "
            "'craft <count> <item> using <count> <ingredient>, ...' following a command exactly, "
            "and 'inventory'. Craft the goal item.\n" + _REACT
        ),
    ),
    EnvSpec(
        name="sciworld", server="sciworld:make_family", action_format="action_line", agentgym_prefix="sciworld",
        prompt=(
            "You are an agent in a text-based science simulator (ScienceWorld). Complete the task "
            "described in the observation by interacting with objects, e.g. 'look around', "
            "'go to kitchen', 'pick up thermometer', 'use thermometer on water', 'focus on <object>'. "
            "Type 'check valid actions' to list what is possible.\n" + _REACT
        ),
    ),
    EnvSpec(
        name="searchqa", server="searchqa:make_family", action_format="tags", agentgym_prefix="searchqa",
        prompt=(
            "Answer the question. Reason step by step. When you need knowledge, search with "
            "<search> query </search>; results come back inside <information> ... </information>. "
            "Search as often as you need. When you know the answer, give it as "
            "<answer> short answer </answer>."
        ),
    ),
    EnvSpec(
        name="webarena", server="webarena:make_family", action_format="backticks", agentgym_prefix="webarena",
        prompt=(
            "You are a web agent. Each observation holds the page's accessibility tree, the URL, "
            "the objective and your previous action. Issue one action per turn inside a "
            "triple-back-tick block, e.g. ```click [1234]```, ```type [12] [text] [1]```, "
            "```scroll [down]```, ```goto [url]```, ```go_back```, or ```stop [answer]``` when done."
        ),
    ),
)

_SPECS += (
    EnvSpec(
        name="web", server="web:make_family", action_format="backticks", agentgym_prefix="web",
        prompt=(
            "You are a web agent on local web sites (a shop and a forum). Each observation holds the "
            "page's accessibility tree with numbered elements, the URL, the objective and your "
            "previous action. Issue one action per turn inside a triple-back-tick block, e.g. "
            "```click [12]```, ```type [7] [text] [1]``` (1 presses Enter), ```hover [12]```, "
            "```press [Enter]```, ```scroll [down]```, ```new_tab```, ```tab_focus [0]```, "
            "```close_tab```, ```goto [url]```, ```go_back```, ```go_forward```, and "
            "```stop [answer]``` when done (empty answer when the task asks for no answer)."
        ),
    ),
)

ENVS: dict[str, EnvSpec] = {s.name: s for s in _SPECS}
"""Env name -> its spec, in registration order."""


def env_spec(name: str, *, what: str = "env") -> EnvSpec:
    """The spec of ``name``; ``ValueError`` naming the known envs otherwise (``what`` says which
    lookup failed, e.g. ``"action parser"``)."""
    try:
        return ENVS[name]
    except KeyError:
        raise ValueError(f"no {what} for env {name!r}; known: {sorted(ENVS)}") from None
