"""WebArena's id-based action grammar: a pure parser, validator and formatter.

Grammar (WebArena's ``create_id_based_action`` as AgentGym's server applies it; parameters in
square brackets)::

    click [id]            hover [id]            type [id] [text] [0|1]   (default 1 = press Enter)
    press [key_comb]      scroll [down|up]      new_tab    tab_focus [i]    close_tab
    goto [url]            go_back               go_forward stop [answer]    (answer may be empty)

``extract_action(text)`` takes the agent's reply and returns the content of its first
triple-back-tick block (AgentGym's ``action_splitter``), or the whole text when it has no
block.  ``parse_action`` returns a frozen ``WebAction`` or raises ``ActionError`` whose message
says what is wrong and what is expected.  ``format_action`` renders the canonical form;
``parse_action(format_action(a)) == a``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("click", "hover", "type", "press", "scroll", "new_tab", "tab_focus", "close_tab",
         "goto", "go_back", "go_forward", "stop")
USAGE = (
    "Valid actions: click [id], type [id] [text] [0|1], hover [id], press [key_comb], scroll [down|up], "
    "new_tab, tab_focus [tab_index], close_tab, goto [url], go_back, go_forward, stop [answer]."
)

_BLOCK = re.compile(r"```(.*?)```", re.DOTALL)
_ID = {k: re.compile(rf"^{k} ?\[(\d+)\]$") for k in ("click", "hover")}
_TYPE = re.compile(r"^type ?\[(\d+)\] ?\[(.+)\] ?\[([01])\]$", re.DOTALL)
_PRESS = re.compile(r"^press ?\[(.+)\]$")
_SCROLL = re.compile(r"^scroll ?\[?(up|down)\]?$")
_TAB = re.compile(r"^tab_focus ?\[(\d+)\]$")
_GOTO = re.compile(r"^goto ?\[(.+)\]$")
_STOP = re.compile(r"^stop ?\[(.*)\]$", re.DOTALL)


class ActionError(ValueError):
    """The text is not a valid WebArena action; the message is shown to the agent."""


@dataclass(frozen=True)
class WebAction:
    kind: str
    """One of ``KINDS``."""
    element_id: int | None = None
    """click / hover / type: the accessibility-tree id."""
    text: str = ""
    """type: the text; press: the key combination; goto: the URL; stop: the answer."""
    enter: bool = True
    """type: press Enter after typing (``[1]``)."""
    direction: str = ""
    """scroll: ``up`` or ``down``."""
    tab: int | None = None
    """tab_focus: the tab index."""


def extract_action(reply: str) -> str:
    """The first triple-back-tick block's content (stripped), else the whole reply stripped."""
    m = _BLOCK.search(reply)
    return (m.group(1) if m else reply).strip()


def _kind(action: str) -> str:
    head = action.split("[", 1)[0].strip() if "[" in action else (action.split() or [""])[0]
    return head


def parse_action(action: str) -> WebAction:
    """Parse one action string (already extracted from the reply)."""
    a = action.strip()
    if not a:
        raise ActionError(f"Empty action. {USAGE}")
    kind = _kind(a)
    if kind not in KINDS:
        raise ActionError(f"Unknown action {kind!r} in {a!r}. {USAGE}")
    if kind in ("click", "hover"):
        m = _ID[kind].match(a)
        if not m:
            raise ActionError(f"Invalid {kind} action {a!r}: expected '{kind} [id]' with a numeric id.")
        return WebAction(kind, element_id=int(m.group(1)))
    if kind == "type":
        if not (a.endswith("[0]") or a.endswith("[1]")):
            a += " [1]"
        m = _TYPE.match(a)
        if not m:
            raise ActionError(f"Invalid type action {a!r}: expected 'type [id] [text] [0|1]'.")
        return WebAction(kind, element_id=int(m.group(1)), text=m.group(2), enter=m.group(3) == "1")
    if kind == "press":
        m = _PRESS.match(a)
        if not m:
            raise ActionError(f"Invalid press action {a!r}: expected 'press [key_comb]', e.g. press [Ctrl+v].")
        return WebAction(kind, text=m.group(1))
    if kind == "scroll":
        m = _SCROLL.match(a)
        if not m:
            raise ActionError(f"Invalid scroll action {a!r}: expected 'scroll [down]' or 'scroll [up]'.")
        return WebAction(kind, direction=m.group(1))
    if kind == "tab_focus":
        m = _TAB.match(a)
        if not m:
            raise ActionError(f"Invalid tab_focus action {a!r}: expected 'tab_focus [tab_index]'.")
        return WebAction(kind, tab=int(m.group(1)))
    if kind == "goto":
        m = _GOTO.match(a)
        if not m:
            raise ActionError(f"Invalid goto action {a!r}: expected 'goto [url]'.")
        return WebAction(kind, text=m.group(1))
    if kind == "stop":
        m = _STOP.match(a)
        if not m and a != "stop":
            raise ActionError(f"Invalid stop action {a!r}: expected 'stop [answer]' (the answer may be empty).")
        return WebAction(kind, text=m.group(1) if m else "")
    if a != kind:
        raise ActionError(f"Invalid {kind} action {a!r}: '{kind}' takes no parameters.")
    return WebAction(kind)


def format_action(a: WebAction) -> str:
    """The canonical text of an action (what the adapter sends upstream)."""
    if a.kind in ("click", "hover"):
        return f"{a.kind} [{a.element_id}]"
    if a.kind == "type":
        return f"type [{a.element_id}] [{a.text}] [{1 if a.enter else 0}]"
    if a.kind in ("press", "goto", "stop"):
        return f"{a.kind} [{a.text}]"
    if a.kind == "scroll":
        return f"scroll [{a.direction}]"
    if a.kind == "tab_focus":
        return f"tab_focus [{a.tab}]"
    return a.kind
