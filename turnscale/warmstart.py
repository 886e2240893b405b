"""Warm-start data for ``turnscale run``: oracle conversations and the tokenizer corpus.

A random model cannot act and no pretrained one can be downloaded here, so the default
run first fine-tunes (``algo=sft``) on conversations played by the BabyAI oracle
(``envhub.babyai_oracle``), written in ``learner.sft_data``'s JSONL format.  The same
texts (instruction, observations, actions) train the tiny model's tokenizer, so the
vocabulary fits the env.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from common.prompts import initial_messages, instruction


def oracle_conversations(env: str, task_ids: Sequence[int], *, max_turns: int) -> Iterable[dict]:
    """One conversation per task the oracle solves within ``max_turns`` (failures are skipped)."""
    if env != "babyai":
        raise ValueError(f"env {env!r} has no built-in oracle; give recorded conversations to algo=sft instead")
    from envhub.babyai import play_oracle

    prompt = instruction(env)
    for idx in task_ids:
        run = play_oracle(idx, max_turns)
        if not run.success or not run.steps:
            continue
        messages = initial_messages(prompt, run.steps[0][0])
        for k, (_, action) in enumerate(run.steps):
            messages.append({"role": "assistant", "content": f"Action: {action}"})
            if k + 1 < len(run.steps):
                messages.append({"role": "user", "content": run.steps[k + 1][0]})
        yield {"messages": messages, "env": env, "data_idx": int(idx), "reward": run.reward, "success": True, "category": run.level}


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
