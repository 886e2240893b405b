"""Micro-batches by token budget: sort by length, pack greedily, right-pad.

A micro-batch's cost is its padded size ``rows * longest``; ``plan_micro_batches`` keeps
that within ``token_budget`` (a sequence longer than the budget goes alone).  Sorting by
length (longest first, ties by index, so the plan is deterministic) keeps padding small.
Gradient accumulation needs no rescaling per micro-batch: the losses divide by the
whole batch's loss-token count (``learner.loss`` module docstring), so summed
micro-batch gradients equal the big batch's gradient whatever the packing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches whose padded size
    (``len(group) * max(lengths in group)``) is at most ``token_budget`` (except a single
    over-long sequence).  Every index appears exactly once; groups are longest first."""
    if token_budget <= 0:
        raise ValueError(f"token_budget must be > 0, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    plan: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = int(lengths[i])
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > token_budget:
            plan.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        plan.append(cur)
    return plan


def pad_BT(rows: Sequence[np.ndarray], pad_value: float | int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Right-pad 1-D arrays to ``[len(rows), max_len]``."""
    T = max((len(r) for r in rows), default=0)
    first = np.asarray(rows[0]) if rows else np.zeros(0)
    out = np.full((len(rows), T), pad_value, dtype=first.dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    t = torch.from_numpy(out)
    return t if dtype is None else t.to(dtype)


def accumulation_normaliser(global_tokens: int, world_size: int = 1) -> float:
    """``num_tokens`` to pass to every micro-batch loss so accumulated (and, under DDP,
    rank-averaged) gradients equal the token-mean gradient of the whole batch."""
    return max(float(global_tokens), 1.0) / max(world_size, 1)
