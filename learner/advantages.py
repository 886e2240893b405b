"""Advantage estimators: pure functions over numpy arrays, shapes in the names.

Suffixes: ``_G`` one value per episode of a group, ``_B`` one per episode of a batch,
``_BT`` per token of a right-padded batch (``mask_BT`` is the loss mask: 1 exactly on
tokens the actor sampled).

Conventions (the learner's trainer relies on them):

- **Outcome reward on the last trainable token.**  ``outcome_rewards_BT`` places each
  episode's return on its last loss-mask token.  (AgentGym-RL places it on the last token
  of the stream, a masked observation token, so GAE and REINFORCE++ silently lose it.)
- **Only loss-mask tokens are steps.**  Multi-turn streams interleave sampled assistant
  tokens with observation tokens the model did not choose.  The token-level estimators
  (``discounted_returns_BT``, ``gae_BT``) run over the subsequence of loss-mask tokens
  only: observation tokens are skipped — they are not time steps, they neither discount
  nor carry value — so the step after the last token of turn k is the first token of turn
  k+1.  Outputs are 0 on tokens outside the mask.
- **Equal-reward groups carry no signal.**  For the group estimators (GRPO, Dr.GRPO,
  RLOO) a group whose rewards are all equal gets zero advantages and is counted
  (``count_degenerate``).  REINFORCE++ zeroes them too and leaves them out of the batch
  statistics (see ``reinforce_pp_BT``).  PPO does not: its critic's baseline makes their
  advantages informative.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo"})
"""Estimators that give one advantage per episode, from its group's rewards."""

EQUAL_ATOL = 1e-8
"""Rewards within this of each other count as equal (a degenerate group)."""


def is_degenerate_G(rewards_G: np.ndarray, atol: float = EQUAL_ATOL) -> bool:
    """True when every reward in the group is equal (or the group has one episode)."""
    r = np.asarray(rewards_G, dtype=np.float64)
    return r.size <= 1 or float(r.max() - r.min()) <= atol


def count_degenerate(groups_rewards: Sequence[np.ndarray], atol: float = EQUAL_ATOL) -> int:
    """Number of groups whose rewards are all equal."""
    return sum(is_degenerate_G(r, atol) for r in groups_rewards)


def grpo_G(rewards_G: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: ``(r - mean) / (std + eps)`` with the unbiased (n-1) std, as verl does.

    Degenerate groups (all rewards equal, or one episode) give zeros.
    """
    r = np.asarray(rewards_G, dtype=np.float64)
    if is_degenerate_G(r):
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=1) + eps)


def dr_grpo_G(rewards_G: np.ndarray) -> np.ndarray:
    """Dr.GRPO: ``r - mean`` (no std normalisation)."""
    r = np.asarray(rewards_G, dtype=np.float64)
    if is_degenerate_G(r):
        return np.zeros_like(r)
    return r - r.mean()


def rloo_G(rewards_G: np.ndarray) -> np.ndarray:
    """RLOO: ``r_i - mean_{j != i} r_j``  (= ``n / (n-1) * (r_i - mean)``)."""
    r = np.asarray(rewards_G, dtype=np.float64)
    if is_degenerate_G(r):
        return np.zeros_like(r)
    n = r.size
    return (r * n - r.sum()) / (n - 1)


def group_advantages_G(name: str, rewards_G: np.ndarray) -> np.ndarray:
    """Dispatch to the group estimator ``name`` (one of ``GROUP_ESTIMATORS``)."""
    if name == "grpo":
        return grpo_G(rewards_G)
    if name == "dr_grpo":
        return dr_grpo_G(rewards_G)
    if name == "rloo":
        return rloo_G(rewards_G)
    raise ValueError(f"{name!r} is not a group estimator; choose one of {sorted(GROUP_ESTIMATORS)}")


def broadcast_BT(values_B: np.ndarray, mask_BT: np.ndarray) -> np.ndarray:
    """Each episode's scalar on every one of its loss-mask tokens, 0 elsewhere."""
    return np.asarray(values_B, dtype=np.float64)[:, None] * (np.asarray(mask_BT) > 0)


def last_mask_index_B(mask_BT: np.ndarray) -> np.ndarray:
    """Index of each row's last loss-mask token; -1 for a row with none."""
    m = np.asarray(mask_BT) > 0
    T = m.shape[1]
    last = T - 1 - np.argmax(m[:, ::-1], axis=1)
    return np.where(m.any(axis=1), last, -1)


def outcome_rewards_BT(rewards_B: np.ndarray, mask_BT: np.ndarray) -> np.ndarray:
    """Per-token rewards: episode ``b``'s return on its last loss-mask token, 0 elsewhere.

    A row without any loss-mask token gets all zeros (it has nothing to train on).
    """
    rewards_B = np.asarray(rewards_B, dtype=np.float64)
    out = np.zeros(np.shape(mask_BT), dtype=np.float64)
    last = last_mask_index_B(mask_BT)
    rows = np.nonzero(last >= 0)[0]
    out[rows, last[rows]] = rewards_B[rows]
    return out


def _check_rewards_on_mask(rewards_BT: np.ndarray, m: np.ndarray) -> None:
    if np.any(rewards_BT[~m] != 0):
        raise ValueError("rewards_BT has non-zero rewards on tokens outside the loss mask; "
                         "put rewards on trainable tokens (see outcome_rewards_BT)")


def discounted_returns_BT(rewards_BT: np.ndarray, mask_BT: np.ndarray, gamma: float) -> np.ndarray:
    """``G_k = r_k + gamma * G_{k+1}`` over the loss-mask tokens of each row (observation
    tokens are skipped, not discounted); 0 outside the mask.  Truncated episodes are not
    bootstrapped (no critic)."""
    r = np.asarray(rewards_BT, dtype=np.float64)
    m = np.asarray(mask_BT) > 0
    _check_rewards_on_mask(r, m)
    out = np.zeros_like(r)
    running = np.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        mt = m[:, t]
        running = np.where(mt, r[:, t] + gamma * running, running)
        out[:, t] = np.where(mt, running, 0.0)
    return out


def reinforce_pp_BT(
    rewards_BT: np.ndarray,
    mask_BT: np.ndarray,
    gamma: float,
    keep_B: np.ndarray | None = None,
    eps: float = 1e-8,
) -> np.ndarray:
    """REINFORCE++: discounted returns, whitened over every loss-mask token of the batch
    (``(G - mean) / (std + eps)``, population std over tokens).

    ``keep_B`` (bool) marks the episodes that enter the statistics; the others (those of
    equal-reward groups) get zero advantages.  Default: all.
    """
    returns = discounted_returns_BT(rewards_BT, mask_BT, gamma)
    m = np.asarray(mask_BT) > 0
    if keep_B is not None:
        m = m & np.asarray(keep_B, dtype=bool)[:, None]
    if not m.any():
        return np.zeros_like(returns)
    vals = returns[m]
    out = np.zeros_like(returns)
    out[m] = (vals - vals.mean()) / (vals.std() + eps)
    return out


def gae_BT(
    rewards_BT: np.ndarray,
    values_BT: np.ndarray,
    mask_BT: np.ndarray,
    gamma: float,
    lam: float,
    bootstrap_B: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over the loss-mask tokens of each row.

    Steps are the loss-mask tokens in order; for step k with value ``V_k = values_BT[t_k]``
    ``delta_k = r_k + gamma * V_{k+1} - V_k`` and ``A_k = delta_k + gamma * lam * A_{k+1}``.
    After the last step ``V_{n+1}`` is ``bootstrap_B[b]``: 0 for an episode that ended
    (``done``), the critic's value of the state after the stream for a truncated one
    (``turn_limit`` / ``context_limit``).  Returns ``(advantages_BT, returns_BT)`` with
    ``returns = advantages + values`` on the mask (the value-loss targets), 0 elsewhere.
    """
    r = np.asarray(rewards_BT, dtype=np.float64)
    v = np.asarray(values_BT, dtype=np.float64)
    m = np.asarray(mask_BT) > 0
    _check_rewards_on_mask(r, m)
    B, T = r.shape
    next_v = np.zeros(B) if bootstrap_B is None else np.asarray(bootstrap_B, dtype=np.float64).copy()
    running = np.zeros(B)
    adv = np.zeros_like(r)
    for t in range(T - 1, -1, -1):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = np.where(mt, delta + gamma * lam * running, running)
        next_v = np.where(mt, v[:, t], next_v)
        adv[:, t] = np.where(mt, running, 0.0)
    returns = np.where(m, adv + v, 0.0)
    return adv, returns
