"""What AgentGym's own env clients do on the wire — a test-only restatement, not their code.

Stated from WooooDyy/AgentGym (commit 3ef9235), ``agentenv/agentenv/envs/``:
``babyai.py`` (``BabyAIEnvClient``), ``textcraft.py`` (``TextCraftEnvClient``),
``sciworld.py`` (``SciworldEnvClient``), ``searchqa.py`` (``SearchQAEnvClient``): the request
each method sends, the fields it reads from the reply, the ``status_code == 200`` assert, and
the action text it sends.  The ``agentenv`` package on PyPI (0.0.1) is an empty placeholder,
so their classes cannot be installed; these mirror them call for call, so a server that
passes here passes theirs.  A missing field raises ``KeyError`` as in their clients.
"""

from __future__ import annotations

import re
from typing import Any

import httpx


class _Client:
    id_key = "id"

    def __init__(self, base: str, timeout: float = 120.0) -> None:
        self.base = base.rstrip("/")
        self.http = httpx.Client(timeout=timeout)
        self.env_id: Any = None

    def _create(self, **kwargs: Any) -> Any:
        ok = self.http.post(f"{self.base}/create", **kwargs)
        if ok.status_code != 200:  # their clients raise RequestException here
            raise ConnectionError(f"Failed to create environment: {ok}")
        return ok.json()

    def _post(self, path: str, data: dict[str, Any]) -> Any:
        data[self.id_key] = self.env_id
        res = self.http.post(f"{self.base}/{path}", json=data)
        assert res.status_code == 200
        return res.json()

    def _get(self, path: str) -> Any:
        res = self.http.get(f"{self.base}/{path}?{self.id_key}={self.env_id}")
        assert res.status_code == 200
        return res.json()

    def close(self) -> Any:
        out = self._post("close", {})
        self.http.close()
        return out


def react_action(text: str) -> str | None:
    """BabyAI / TextCraft clients: the text after the single ``Action:`` up to the line end,
    stripped of everything but letters, digits, commas and spaces; None when there are two."""
    matches = re.findall(r"Action:\s*(.*?)(?=\n|$)", text, re.DOTALL)
    if len(matches) > 1:
        return None
    action = matches[-1] if matches else ""
    action = re.sub(r"[^A-Za-z0-9, ]+", "", action)
    return " ".join(action.split()).strip()


class BabyAIClient(_Client):
    """``BabyAIEnvClient``: ``POST /create`` without a body -> ``["id"]``; reset and step read
    ``observation``, ``reward``, ``score``, ``done``; the step reward it reports is ``score``."""

    def __init__(self, base: str) -> None:
        super().__init__(base)
        self.env_id = self._create()["id"]
        self.info: dict[str, Any] = {}

    def reset(self, data_idx: int = 0) -> dict[str, Any]:
        r = self._post("reset", {"data_idx": data_idx})
        self.info = {"observation": r["observation"], "reward": r["reward"], "score": r["score"], "done": r["done"]}
        return r

    def observe(self) -> str:
        return self.info["observation"]

    def step(self, text: str) -> tuple[str, float, bool]:
        action = react_action(text)
        if action is None:
            return "Error: Only one 'Action' is allowed per response. Please adjust your response.", 0, False
        r = self._post("step", {"action": action})
        self.info = {"observation": r["observation"], "reward": r["reward"], "score": r["score"], "done": r["done"]}
        return r["observation"], r["score"], r["done"]


class TextCraftClient(_Client):
    """``TextCraftEnvClient``: ``POST /create {"minecraft_dir", "commands", "goal"}`` ->
    ``["id"]`` and ``["observation"]`` (the server resets on create); reset reads
    ``observation``; step reads ``observation``, ``reward``, ``done``."""

    def __init__(self, base: str, commands: str | None = None, goal: str | None = None) -> None:
        super().__init__(base)
        ok = self._create(json={"minecraft_dir": "agentenv_textcraft/", "commands": commands, "goal": goal})
        self.env_id = ok["id"]
        self.info = {"observation": ok["observation"], "reward": 0, "done": False}

    def reset(self, idx: int = 0) -> dict[str, Any]:
        r = self._post("reset", {"data_idx": idx})
        self.info.update({"observation": r["observation"], "reward": 0, "done": False})
        return r

    def observe(self) -> str:
        return self.info["observation"]

    def step(self, text: str) -> tuple[str, float, bool]:
        action = react_action(text)
        if action is None:
            return "Error: Only one 'Action' is allowed per response. Please adjust your response.", 0, False
        r = self._post("step", {"action": action})
        self.info = {"observation": r["observation"], "reward": r["reward"], "done": r["done"]}
        return r["observation"], r["reward"], r["done"]


class SciWorldClient(_Client):
    """``SciworldEnvClient``: ``POST /create`` -> ``["id"]``; reset reads ``task_description``
    and ``observation`` and shows ``task_description + "\\n" + observation``; step reads
    ``observation``, ``reward``, ``score``, ``done`` and reports ``score``.  (Its action text
    comes from an adapter that turns the model's output into a ScienceWorld command.)"""

    def __init__(self, base: str) -> None:
        super().__init__(base)
        self.env_id = self._create()["id"]
        self.info: dict[str, Any] = {}

    def reset(self, data_idx: int = 0) -> dict[str, Any]:
        r = self._post("reset", {"data_idx": data_idx})
        self.info = {"observation": r["task_description"] + "\n" + r["observation"], "reward": 0, "score": 0, "done": False}
        return r

    def observe(self) -> str:
        return self.info["observation"]

    def step(self, command: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": command})
        self.info = {"observation": r["observation"], "reward": r["reward"], "score": r["score"], "done": r["done"]}
        return r["observation"], r["score"], r["done"]


class SearchQAClient(_Client):
    """``SearchQAEnvClient``: ``POST /create {"id": 0}`` -> the bare id; everything else is
    keyed ``env_idx``; ``POST /reset {"id": task}`` (reply returned as is, a string);
    ``GET /observation`` is the prompt; step sends the model's raw text and reads
    ``observation``, ``reward``, ``done``."""

    id_key = "env_idx"

    def __init__(self, base: str) -> None:
        super().__init__(base)
        self.env_id = self._create(json={"id": 0})

    def reset(self, id: int) -> Any:  # noqa: A002 (their parameter name)
        return self._post("reset", {"id": id})

    def observe(self) -> Any:
        return self._get("observation")

    def step(self, text: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": text})
        return r["observation"], r["reward"], r["done"]
