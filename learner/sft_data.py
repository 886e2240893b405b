"""Expert or recorded conversations -> token-exact ``Episode`` records for ``algo=sft``.

Input: JSONL, one conversation per line::

    {"messages": [{"role": "system", "content": ...}, {"role": "user", "content": obs0},
                  {"role": "assistant", "content": "Action: go to red ball 1"},
                  {"role": "user", "content": obs1}, ...],
     "env": "babyai", "data_idx": 17, "reward": 1.0, "success": true}

Everything before the first assistant message is the prompt.  Each assistant message is
encoded as its content followed by the end-of-turn token (so the model learns to stop)
with ``loss_mask`` 1; every user message after it is the renderer's observation delta
with ``loss_mask`` 0.  The stream is built exactly as ``actors.episode`` builds it from
sampled ids, so SFT trains on the same token layout the actors later produce.

``turnscale.warmstart`` writes such files from an env's oracle; any env with expert or
recorded trajectories can use the same format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from turnscale.protocol.messages import Episode, Task, TrajectoryGroup, Turn


class SFTDataError(ValueError):
    """A conversation file is malformed; the message names the line."""


def conversation_to_episode(renderer: Any, messages: list[dict], *, reward: float = 0.0, success: bool = False) -> Episode:
    """Render one conversation (see the module docstring) into an ``Episode``."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise SFTDataError("a conversation needs a prompt (system/user) and at least one assistant message")
    prompt_msgs = messages[:first]
    ids = list(renderer.initial(prompt_msgs))
    mask = [0] * len(ids)
    prompt_len = len(ids)
    turns: list[Turn] = []
    seen = list(prompt_msgs)
    i = first
    while i < len(messages):
        msg = messages[i]
        if msg.get("role") != "assistant":
            raise SFTDataError(f"message {i}: expected an assistant message, got role {msg.get('role')!r}")
        out = renderer.encode(msg["content"]) + [renderer.end_of_turn_id]
        start = len(ids)
        ids += out
        mask += [1] * len(out)
        obs = ""
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        if nxt is not None:
            if nxt.get("role") != "user":
                raise SFTDataError(f"message {i + 1}: expected a user message after the assistant, got {nxt.get('role')!r}")
            obs = nxt["content"]
            delta = renderer.extend(ids[:start], out, True, obs, messages=seen)
            seen += [{"role": "assistant", "content": msg["content"]}, {"role": "user", "content": obs}]
            ids += delta
            mask += [0] * len(delta)
        turns.append(Turn(index=len(turns), token_start=start, token_end=start + len(out), output_text=msg["content"],
                          action="", parse_error=False, observation=obs, reward=0.0, done=nxt is None,
                          policy_version=0, gen_latency_s=0.0, env_latency_s=0.0))
        i += 2
    n = len(ids)
    mask_arr = np.asarray(mask, dtype=np.uint8)
    return Episode(
        token_ids=np.asarray(ids, dtype=np.int32),
        loss_mask=mask_arr,
        logprobs=np.zeros(n, dtype=np.float32),
        versions=np.where(mask_arr == 1, 0, -1).astype(np.int32),
        prompt_len=prompt_len,
        turns=turns,
        finish_reason="done",
        reward=float(reward),
        success=bool(success),
        turn_limit=len(turns),
    )


def read_conversations(path: str | Path) -> Iterable[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SFTDataError(f"{path}:{lineno}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                raise SFTDataError(f"{path}:{lineno}: expected an object with a 'messages' list")
            yield lineno, row


def load_sft_groups(path: str | Path, renderer: Any, *, max_tokens: int = 0) -> list[TrajectoryGroup]:
    """Every conversation of ``path`` as a one-episode group (SFT ignores grouping).
    Conversations longer than ``max_tokens`` (when > 0) are skipped and counted in the
    returned groups' absence; a malformed line raises ``SFTDataError`` naming it."""
    groups = []
    for lineno, row in read_conversations(path):
        try:
            ep = conversation_to_episode(renderer, row["messages"], reward=float(row.get("reward", 0.0)), success=bool(row.get("success", False)))
        except SFTDataError as exc:
            raise SFTDataError(f"{path}:{lineno}: {exc}") from None
        if max_tokens and len(ep.token_ids) > max_tokens:
            continue
        task = Task(env=str(row.get("env", "")), data_idx=int(row.get("data_idx", 0)), split="sft")
        groups.append(TrajectoryGroup(lease_id=f"sft-{lineno}", actor_id="sft", task=task, turn_limit=ep.turn_limit, episodes=[ep]))
    return groups
