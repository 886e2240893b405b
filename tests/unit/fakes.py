"""Hand-written fakes shared by unit tests: groups and episodes built from plain numbers."""

from __future__ import annotations

import numpy as np

from turnscale.protocol.messages import Episode, Lease, Task, TrajectoryGroup, Turn


def make_episode(*, version: int = 0, turn_limit: int = 10, reward: float = 1.0, success: bool = True,
                 finish_reason: str = "done", prompt_len: int = 4, turns: int = 2, tokens_per_turn: int = 3,
                 obs_tokens: int = 2, category: str = "") -> Episode:
    ids, mask, lps, vers, tl = list(range(prompt_len)), [0] * prompt_len, [0.0] * prompt_len, [-1] * prompt_len, []
    for k in range(turns):
        start = len(ids)
        ids += [100 + k] * tokens_per_turn
        mask += [1] * tokens_per_turn
        lps += [-0.5 - 0.1 * j for j in range(tokens_per_turn)]
        vers += [version] * tokens_per_turn
        end = len(ids)
        tl.append(Turn(index=k, token_start=start, token_end=end, output_text=f"Action: go {k}", action=f"go {k}",
                       parse_error=False, observation=f"obs {k}", reward=reward if k == turns - 1 else 0.0,
                       done=k == turns - 1, policy_version=version, gen_latency_s=0.01, env_latency_s=0.002))
        ids += [7] * obs_tokens
        mask += [0] * obs_tokens
        lps += [0.0] * obs_tokens
        vers += [-1] * obs_tokens
    kw = {"category": category} if category and "category" in Episode.__dataclass_fields__ else {}
    return Episode(token_ids=np.array(ids, np.int32), loss_mask=np.array(mask, np.uint8),
                   logprobs=np.array(lps, np.float32), versions=np.array(vers, np.int32), prompt_len=prompt_len,
                   turns=tl, finish_reason=finish_reason, reward=reward, success=success, turn_limit=turn_limit, **kw)


def make_group(lease: Lease, *, actor_id: str = "a1", version: int | None = None, failed: bool = False,
               rewards: list[float] | None = None, **kw) -> TrajectoryGroup:
    v = lease.policy_version if version is None else version
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(lease.group_size)]
    eps = [make_episode(version=v, turn_limit=lease.turn_limit, reward=r, success=r > 0,
                        finish_reason="env_error" if failed and i == 0 else "done", **kw)
           for i, r in enumerate(rewards)]
    return TrajectoryGroup(lease_id=lease.lease_id, actor_id=actor_id, task=lease.task, turn_limit=lease.turn_limit,
                           episodes=eps, failed=failed, error="boom" if failed else "")


def task(i: int = 0) -> Task:
    return Task(env="babyai", data_idx=i)
