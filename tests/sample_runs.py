"""Realistic run directories for viewer and eval tests, written the way the learner writes them.

``write_run_dir(path, ...)`` writes ``trajectories.jsonl`` (one episode per line, the learner's
format) and ``metrics.jsonl`` (one object per learner step).  Everything is deterministic in
``seed``, so tests can compute expected counts from the returned ``SampleRun``.

Episodes are grouped as the learner receives them: one lease = one task x ``group_size``
episodes, all sampled under one turn limit; policy versions lag the step by 0..1 (async).
BabyAI-like and TextCraft-like observations/outputs make the pages look like real runs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

BABYAI_LEVELS = ["GoToRedBallGrey", "GoToObj", "PickupLoc", "UnlockPickup"]
BABYAI_ACTIONS = ["turn left", "turn right", "move forward", "go to red ball 1", "pickup red ball 1", "toggle"]
TEXTCRAFT_ITEMS = [("oak planks", 1), ("stick", 2), ("crafting table", 2), ("wooden pickaxe", 3)]


@dataclass
class SampleRun:
    path: Path
    episodes: list[dict] = field(default_factory=list)
    """Every valid episode record in file order (its index is the viewer's episode id)."""
    metrics: list[dict] = field(default_factory=list)
    malformed_lines: int = 0


def _babyai_obs(rng: random.Random, mission: str) -> str:
    ahead = rng.randint(1, 4)
    return (
        f"Your goal: {mission}\n"
        f"In front of you in this room, you can see several objects: "
        f"There is a red ball 1 {ahead} steps in front of you and {rng.randint(0, 2)} steps to your left. "
        f"The room has walls around you. You are facing a wall {ahead + 2} steps away. "
        f"You are not carrying anything.\n"
        f"Available actions: [\"turn left\", \"turn right\", \"move forward\", \"go to red ball 1\", \"pickup red ball 1\", \"check available actions\"]"
    )


def _textcraft_obs(item: str) -> str:
    return (
        "Crafting commands:\ncraft 4 oak planks using 1 oak logs\ncraft 4 stick using 2 oak planks\n"
        f"craft 1 crafting table using 4 oak planks\n\nGoal: craft {item}."
    )


def make_episode(rng: random.Random, *, env: str, data_idx: int, step: int, version: int, turn_limit: int,
                 lease_id: str, actor_id: str, episode: int, group_size: int, split: str = "train") -> dict:
    """One episode record in the learner's ``trajectories.jsonl`` format."""
    if env == "babyai":
        category = BABYAI_LEVELS[data_idx % len(BABYAI_LEVELS)]
        mission = "go to the red ball"
        prompt = _babyai_obs(rng, mission)
        actions = BABYAI_ACTIONS
    else:
        item, depth = TEXTCRAFT_ITEMS[data_idx % len(TEXTCRAFT_ITEMS)]
        category = f"depth{depth}"
        prompt = _textcraft_obs(item)
        actions = ["get 1 oak logs", "craft 4 oak planks using 1 oak logs", "inventory", f"craft 1 {item} using 2 oak planks"]
    p_success = min(0.9, 0.2 + 0.04 * step)
    success = rng.random() < p_success
    n_turns = rng.randint(1, turn_limit) if success else turn_limit if rng.random() < 0.7 else rng.randint(1, turn_limit)
    finish = "done" if success else ("turn_limit" if n_turns == turn_limit else rng.choice(["done", "context_limit", "env_error"]))
    turns = []
    for t in range(n_turns):
        last = t == n_turns - 1
        action = actions[rng.randrange(len(actions))]
        parse_error = rng.random() < 0.08
        thought = rng.choice(["I should explore.", "The ball is ahead of me.", "Let me check the recipe.", "I need more items."])
        output_text = f"Thought: {thought}\nAction: {action}" if not parse_error else f"Thought: {thought} I will {action}"
        reward = round(1 - 0.9 * (t + 1) / 64, 4) if (last and success) else 0.0
        ntok = rng.randint(12, 60)
        lp = -rng.random() * 1.5
        turns.append({
            "index": t,
            "output_text": output_text,
            "action": "" if parse_error else action,
            "parse_error": parse_error,
            "observation": (_babyai_obs(rng, "go to the red ball") if env == "babyai" else f"Got 1 oak logs\nInventory: [oak logs] ({t + 1})"),
            "reward": reward,
            "done": last and finish == "done",
            "policy_version": max(0, version - (1 if t == 0 and rng.random() < 0.2 else 0)),
            "gen_latency_s": round(rng.uniform(0.05, 0.4), 4),
            "env_latency_s": round(rng.uniform(0.001, 0.02), 4),
            "num_tokens": ntok,
            "logprob_mean": round(lp, 4),
            "logprob_min": round(lp - rng.uniform(0.5, 6.0), 4),
        })
    accepted = finish != "env_error"
    return {
        "step": step, "version": version, "lease_id": lease_id, "actor_id": actor_id,
        "env": env, "data_idx": data_idx, "task_id": f"{env}_{data_idx}", "split": split, "category": category,
        "episode": episode, "group_size": group_size, "turn_limit": turn_limit, "finish_reason": finish,
        "reward": sum(t["reward"] for t in turns), "success": success, "accepted": accepted,
        "drop_reason": "" if accepted else "env_error in group",
        "num_turns": n_turns, "num_tokens": sum(t["num_tokens"] for t in turns), "prompt": prompt, "turns": turns,
    }


def write_run_dir(path: Path, *, steps: int = 6, groups_per_step: int = 2, group_size: int = 2,
                  envs: tuple[str, ...] = ("babyai", "textcraft"), seed: int = 0, malformed: bool = True,
                  turn_schedule: tuple[int, ...] = (4, 6), every: int = 3) -> SampleRun:
    """Write ``trajectories.jsonl`` and ``metrics.jsonl`` for a small async run under ``path``.

    With ``malformed`` a truncated JSON line, a non-object line and a binary line are mixed in
    (the viewer must skip and count them: 3 bad lines)."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    run = SampleRun(path=path)
    lines: list[str] = []
    lease = 0
    for step in range(steps):
        turn_limit = turn_schedule[min(step // every, len(turn_schedule) - 1)]
        step_eps = []
        for g in range(groups_per_step):
            env = envs[(step + g) % len(envs)]
            data_idx = rng.randrange(12)
            version = max(0, step - rng.randint(0, 1))
            lease += 1
            for e in range(group_size):
                ep = make_episode(rng, env=env, data_idx=data_idx, step=step, version=version, turn_limit=turn_limit,
                                  lease_id=f"L{lease:04d}", actor_id=f"actor-{g % 2}", episode=e, group_size=group_size)
                step_eps.append(ep)
                run.episodes.append(ep)
                lines.append(json.dumps(ep))
        if malformed and step == 1:
            lines.append('{"step": 1, "env": "babyai", "turns": [')  # truncated write
            lines.append("[1, 2, 3]")  # valid JSON, not an episode object
            run.malformed_lines += 2
        succ = [float(e["success"]) for e in step_eps]
        rets = [e["reward"] for e in step_eps]
        run.metrics.append({
            "step": step, "time": round(1.79e9 + 12.5 * step, 3), "rollout/success": sum(succ) / len(succ), "rollout/return": sum(rets) / len(rets),
            "rollout/turns": sum(e["num_turns"] for e in step_eps) / len(step_eps),
            "schedule/turn_limit": turn_limit, "loss/policy": round(rng.uniform(-0.1, 0.1), 4),
            "perf/tokens_per_s": round(rng.uniform(500, 900), 1),
        })
    with open(path / "trajectories.jsonl", "wb") as f:
        for i, line in enumerate(lines):
            f.write(line.encode() + b"\n")
            if malformed and i == 3:
                f.write(b"\xff\xfe not utf8 \x00\n")
                run.malformed_lines += 1
    with open(path / "metrics.jsonl", "w") as f:
        for m in run.metrics:
            f.write(json.dumps(m) + "\n")
        if malformed:
            f.write("{not json\n")
    return run


if __name__ == "__main__":  # python -m tests.sample_runs DIR [STEPS]: a demo run dir for `turnscale view DIR`
    import sys

    out = write_run_dir(Path(sys.argv[1]), steps=int(sys.argv[2]) if len(sys.argv) > 2 else 30, groups_per_step=4, group_size=4,
                        turn_schedule=(6, 13, 20), every=10)
    print(f"{out.path}: {len(out.episodes)} episodes, {len(out.metrics)} steps, {out.malformed_lines} malformed lines")
