"""The scripted solver of ``env=web``: follows a task's plan (``envhub.web_tasks``) by reading the
current observation, in WebArena's action grammar — the same actions an agent sends.

Plan steps (each becomes one or more actions):

- ``("click", role, name)`` -> ``click [id]`` of the first element ``[id] role 'name'``;
- ``("type", role, name, text, enter)`` -> ``type [id] [text] [1|0]``;
- ``("find_click", role, name)`` -> click it when on the page, else ``click`` the ``Next page``
  link and stay on this step (paginated listings);
- ``("read_stop", regex)`` -> ``stop [group 1 of regex on the observation]``;
- ``("read_click", role, regex)`` -> click the element whose name group 1 of the regex reads;
- ``("stop", answer)``.

When what a step needs is not in the observation (below the window, with ``viewport_only``), the
oracle scrolls down, at most ``MAX_SCROLLS`` times per step, before giving up.

Invariant: the oracle never reads the task's expected answer; answers come from the page.  Call
``next_action`` once per turn and execute what it returns (it advances on the assumption that the
action is executed).  ``OracleLost`` when the page lacks what the plan needs.
"""

from __future__ import annotations

import re


MAX_SCROLLS = 4


class OracleLost(RuntimeError):
    """The observation does not contain what the next plan step needs."""


def element_id(obs: str, role: str, name: str) -> int | None:
    m = re.search(r"\[(-?\d+)\] " + re.escape(f"{role} {name!r}") + r"(?: |$)", obs, re.MULTILINE)
    return int(m.group(1)) if m else None


class WebOracle:
    def __init__(self, plan: tuple[tuple, ...]) -> None:
        self.plan, self.pos, self.scrolls = plan, 0, 0

    def _missing(self, what: str) -> str:
        if self.scrolls >= MAX_SCROLLS:
            raise OracleLost(f"{what} not on the page")
        self.scrolls += 1
        return "scroll [down]"

    def next_action(self, obs: str) -> str:
        action = self._next(obs)
        if action != "scroll [down]":
            self.scrolls = 0
        return action

    def _next(self, obs: str) -> str:
        if self.pos >= len(self.plan):
            return "stop []"
        step = self.plan[self.pos]
        kind = step[0]
        if kind == "stop":
            self.pos += 1
            return f"stop [{step[1]}]"
        if kind == "read_stop":
            m = re.search(step[1], obs)
            if not m:
                return self._missing(f"pattern {step[1]!r}")
            self.pos += 1
            return f"stop [{m.group(1)}]"
        if kind == "read_click":
            m = re.search(step[2], obs)
            if not m:
                return self._missing(f"pattern {step[2]!r}")
            step = ("click", step[1], m.group(1))
        eid = element_id(obs, step[1], step[2])
        if kind == "find_click" and eid is None:
            nxt = element_id(obs, "link", "Next page")
            if nxt is None:
                return self._missing(f"{step[1]} {step[2]!r} or a 'Next page' link")
            return f"click [{nxt}]"
        if eid is None:
            return self._missing(f"{step[1]} {step[2]!r}")
        self.pos += 1
        if kind == "type":
            return f"type [{eid}] [{step[3]}] [{1 if step[4] else 0}]"
        return f"click [{eid}]"
