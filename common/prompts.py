"""Per-env instruction prompts and the first messages of an episode.

AgentGym sends each env's fixed instruction as the first user turn and answers it with a
canned assistant "OK".  We put the instruction in a **system message** instead and the
env's first observation in the first user message: the same information, two fewer
template turns, and no fake assistant tokens in the stream (they would be masked anyway).
"""

from __future__ import annotations

_REACT = (
    "Every reply must have the form:\n"
    "Thought: <your reasoning>\n"
    "Action: <exactly one action>\n"
)

INSTRUCTIONS: dict[str, str] = {
    "babyai": (
        "You are an agent in a grid world (BabyAI). Each observation describes your goal, the "
        "objects you can see (with how many steps ahead, left or right they are) and the "
        "available actions. Reach the goal with as few actions as possible. Use only actions "
        "from the available list, e.g. 'turn left', 'turn right', 'move forward', "
        "'go to red ball 1', 'pickup red ball 1', 'toggle', 'drop', 'check available actions'.\n"
        + _REACT
    ),
    "textcraft": (
        "You are crafting items in Minecraft (TextCraft). You are given crafting commands and "
        "a goal item. Valid actions: 'get <count> <item>' to fetch a base item, "
        "'craft <count> <item> using <count> <ingredient>, ...' following a command exactly, "
        "and 'inventory'. Craft the goal item.\n" + _REACT
    ),
    "sciworld": (
        "You are an agent in a text-based science simulator (ScienceWorld). Complete the task "
        "described in the observation by interacting with objects, e.g. 'look around', "
        "'go to kitchen', 'pick up thermometer', 'use thermometer on water', 'focus on <object>'. "
        "Type 'check valid actions' to list what is possible.\n" + _REACT
    ),
    "searchqa": (
        "Answer the question. Reason step by step. When you need knowledge, search with "
        "<search> query </search>; results come back inside <information> ... </information>. "
        "Search as often as you need. When you know the answer, give it as "
        "<answer> short answer </answer>."
    ),
    "webarena": (
        "You are a web agent. Each observation holds the page's accessibility tree, the URL, "
        "the objective and your previous action. Issue one action per turn inside a "
        "triple-back-tick block, e.g. ```click [1234]```, ```type [12] [text] [1]```, "
        "```scroll [down]```, ```goto [url]```, ```go_back```, or ```stop [answer]``` when done."
    ),
}


def instruction(env: str) -> str:
    try:
        return INSTRUCTIONS[env]
    except KeyError:
        raise ValueError(f"no instruction prompt for env {env!r}; known: {sorted(INSTRUCTIONS)}") from None


def initial_messages(prompt: str, observation: str) -> list[dict]:
    """``[system: prompt, user: observation]`` (no system message when ``prompt`` is empty)."""
    msgs = [{"role": "system", "content": prompt}] if prompt else []
    return msgs + [{"role": "user", "content": observation}]
