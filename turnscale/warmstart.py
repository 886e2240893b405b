"""Warm-start data for ``turnscale run``: oracle conversations and the tokenizer corpus.

A random model cannot act and no pretrained one can be downloaded here, so the default
run first fine-tunes (``algo=sft``) on conversations played by the env's oracle (BabyAI's
``envhub.babyai_oracle``; ``env=web``'s ``envhub.web_oracle``), written in ``learner.sft_data``'s JSONL format.  The same
texts (instruction, observations, actions) train the tiny model's tokenizer, so the
vocabulary fits the env.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from turnscale.common.prompts import initial_messages, instruction


def assistant_text(env: str, action: str) -> str:
    """An action as the model writes it in ``env``'s action format (``conf.envs``)."""
    from turnscale.conf.envs import env_spec

    fmt = env_spec(env).action_format
    if fmt == "backticks":
        return f"```{action}```"
    if fmt == "action_line":
        return f"Action: {action}"
    raise ValueError(f"env {env!r} (action format {fmt!r}) has no oracle conversations")


def oracle_runs(env: str, task_ids: Sequence[int], *, max_turns: int, options: dict | None = None,
                action_noise: float = 0.0) -> Iterable[tuple]:
    """``(data_idx, [(observation, action), ...], success, return, category)`` per task, played
    by the env's built-in oracle (BabyAI's, or ``env=web``'s scripted solver); with
    ``action_noise`` (BabyAI only) a random action replaces the oracle's at that share of turns
    (``envhub.babyai.play_oracle``)."""
    if action_noise and env != "babyai":
        raise ValueError(f"run.warm_start.action_noise is BabyAI's only; env {env!r} needs action_noise=0")
    if env == "web":
        from turnscale.envhub.web import play_oracle as play_web

        yield from play_web(list(task_ids), max_turns, options)
        return
    if env != "babyai":
        raise ValueError(f"env {env!r} has no built-in oracle; give recorded conversations to algo=sft instead")
    from turnscale.envhub.babyai import play_oracle

    for idx in task_ids:
        run = play_oracle(idx, max_turns, action_noise)
        yield idx, list(run.steps), run.success, run.reward, run.level


def oracle_conversations(env: str, task_ids: Sequence[int], *, max_turns: int, options: dict | None = None) -> Iterable[dict]:
    """One conversation per task the oracle solves within ``max_turns`` (failures are skipped)."""
    return conversations_from_runs(env, oracle_runs(env, task_ids, max_turns=max_turns, options=options))


def conversations_from_runs(env: str, runs: Iterable[tuple], max_turns: int | None = None) -> Iterable[dict]:
    """Conversations of the solved runs of ``oracle_runs`` (at most ``max_turns`` turns when given)."""
    prompt = instruction(env)
    for idx, steps, success, ret, category in runs:
        if not success or not steps or (max_turns is not None and len(steps) > max_turns):
            continue
        messages = initial_messages(prompt, steps[0][0])
        for k, (_, action) in enumerate(steps):
            messages.append({"role": "assistant", "content": assistant_text(env, action)})
            if k + 1 < len(steps):
                messages.append({"role": "user", "content": steps[k + 1][0]})
        yield {"messages": messages, "env": env, "data_idx": int(idx), "reward": ret, "success": True, "category": category}


def write_conversations(path: Path, conversations: Iterable[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for conv in conversations:
            f.write(json.dumps(conv, ensure_ascii=False) + "\n")
            n += 1
    return n


def corpus_from_conversations(path: Path) -> list[str]:
    """Texts of every message (tokenizer training corpus)."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                texts.append(m["content"])
    return texts
