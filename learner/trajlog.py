"""``<dir>/trajectories.jsonl``: one JSON object per episode of every received group.

The trajectory viewer reads exactly this format; keep it stable (add keys, never rename).
Every group the learner receives is written, accepted or dropped, in arrival order; the
episodes of one group are consecutive lines.  One line::

    {
      "step": int,            learner optimizer steps done when the group arrived
      "version": int,         learner policy version when the group arrived
      "lease_id": str, "actor_id": str,
      "env": str, "data_idx": int, "task_id": str, "split": str,
      "category": str,        env sub-task (level / depth / task type); "" if unknown
      "episode": int,         index of the episode in its group, from 0
      "group_size": int,      episodes in the group
      "turn_limit": int,      turn limit in force for the lease
      "finish_reason": str,   done | truncated | turn_limit | context_limit | env_error | aborted | render_error
      "reward": float, "success": bool,
      "accepted": bool,       whether the group entered training
      "drop_reason": str,     "" when accepted, else unknown_lease | duplicate | expired | mismatch | failed | invalid | stale
      "lease_s": float,       seconds from the lease's grant to the group's arrival (learner clock); -1 if unknown
      "num_turns": int,
      "num_tokens": int,      tokens in the whole stream (prompt, outputs, observations)
      "prompt": str,          the decoded first prompt (system + task); "" without a tokenizer
      "error": str,           what went wrong for env_error / render_error / aborted
      "turns": [{
        "index": int, "output_text": str, "action": str, "parse_error": bool,
        "observation": str, "reward": float, "done": bool, "policy_version": int,
        "gen_latency_s": float, "env_latency_s": float,
        "num_tokens": int,    sampled tokens of the turn
        "logprob_mean": float, "logprob_min": float   behaviour log-probs of those tokens (0.0 when none)
      }, ...]
    }

Lines are flushed per group, so a viewer can tail the file while the run goes on.

``<dir>/batches.jsonl``: the training ledger, one line per accepted group when it leaves
the ready buffer (``LearnerService``), in order::

    {"step": int,        the optimizer step (1-based) the batch was formed for; for "trained", the
                         step that trained it (in a checkpoint of step s iff step <= s)
     "version": int,     policy version the batch trained at
     "lease_id": str, "actor_id": str, "env": str, "data_idx": int,
     "staleness": int,   version - oldest sampled-token version, at training time
     "outcome": str}     trained | stale | skipped_nonfinite | skipped_empty

A lease id appears at most once with ``trained``; ``stale`` groups' tasks were re-issued.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import numpy as np

from turnscale.protocol.messages import Episode, TrajectoryGroup

Decode = Callable[[list[int]], str]


def turn_records(ep: Episode) -> list[dict[str, Any]]:
    """The ``turns`` list of an episode record, with each turn's behaviour log-prob summary."""
    lps = np.asarray(ep.logprobs, dtype=np.float64)
    turns = []
    for t in ep.turns:
        seg = lps[t.token_start:t.token_end]
        turns.append({
            "index": t.index, "output_text": t.output_text, "action": t.action, "parse_error": t.parse_error,
            "observation": t.observation, "reward": t.reward, "done": t.done, "policy_version": t.policy_version,
            "gen_latency_s": round(t.gen_latency_s, 6), "env_latency_s": round(t.env_latency_s, 6),
            "num_tokens": int(t.token_end - t.token_start),
            "logprob_mean": float(seg.mean()) if len(seg) else 0.0,
            "logprob_min": float(seg.min()) if len(seg) else 0.0,
        })
    return turns


def episode_record(group: TrajectoryGroup, i: int, ep: Episode, *, step: int, version: int, accepted: bool,
                   drop_reason: str, decode: Decode | None, lease_s: float = -1.0) -> dict[str, Any]:
    """The JSON-ready record of one episode (see the module docstring)."""
    ids = np.asarray(ep.token_ids)
    turns = turn_records(ep)
    return {
        "step": step, "version": version, "lease_id": group.lease_id, "actor_id": group.actor_id,
        "env": group.task.env, "data_idx": group.task.data_idx, "task_id": group.task.task_id,
        "split": group.task.split, "category": getattr(ep, "category", ""), "episode": i,
        "group_size": len(group.episodes), "turn_limit": ep.turn_limit, "finish_reason": ep.finish_reason,
        "reward": ep.reward, "success": bool(ep.success), "accepted": accepted, "drop_reason": drop_reason,
        "lease_s": round(float(lease_s), 6), "num_turns": len(ep.turns), "num_tokens": int(len(ids)),
        "prompt": decode(ids[: ep.prompt_len].tolist()) if decode is not None else "",
        "error": ep.error, "turns": turns,
    }


class TrajectoryLog:
    """Appends episode records to ``<dir>/trajectories.jsonl``."""

    def __init__(self, run_dir: str, decode: Decode | None = None) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "trajectories.jsonl")
        self.decode = decode
        self._f = open(self.path, "a", encoding="utf-8")
        self._ledger = open(os.path.join(run_dir, "batches.jsonl"), "a", encoding="utf-8")

    def write_batch_entry(self, group: TrajectoryGroup, *, step: int, version: int, staleness: int, outcome: str) -> None:
        rec = {"step": step, "version": version, "lease_id": group.lease_id, "actor_id": group.actor_id,
               "env": group.task.env, "data_idx": group.task.data_idx, "staleness": staleness, "outcome": outcome}
        self._ledger.write(json.dumps(rec) + "\n")
        self._ledger.flush()

    def write_group(self, group: TrajectoryGroup, *, step: int, version: int, accepted: bool, drop_reason: str = "",
                    lease_s: float = -1.0) -> None:
        for i, ep in enumerate(group.episodes):
            rec = episode_record(group, i, ep, step=step, version=version, accepted=accepted,
                                 drop_reason=drop_reason, decode=self.decode, lease_s=lease_s)
            self._f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
        self._ledger.close()


class NullTrajectoryLog:
    def write_group(self, group: TrajectoryGroup, **kw: Any) -> None:
        pass

    def write_batch_entry(self, group: TrajectoryGroup, **kw: Any) -> None:
        pass

    def close(self) -> None:
        pass
