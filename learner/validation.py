"""Semantic checks of a received group against the run, before it may enter a batch.

The codec already guarantees the *shape* of a ``TrajectoryGroup`` (types, dtypes, equal
array lengths, 0/1 loss mask, turn ranges).  What it cannot know is the run: a group
that decodes can still name token ids the model has no embedding for, carry NaN rewards
or log-probs, claim versions the learner never published, or be longer than the model's
context.  Any of those either kills the train step (an out-of-range id raises inside the
embedding) or silently poisons it (a NaN reward makes the group's advantages NaN), so
intake drops such a group as ``invalid`` (``LeaseManager.intake``) and re-issues its task.

Rewards must also lie within ``GroupLimits.max_abs_reward`` (``learner.max_abs_reward``):
a finite reward of 1e300 overflows the group's statistics (its square is inf) and would
cost the whole step, everyone's groups included.

Log-probs off the loss mask (prompt and observation tokens; honest actors send 0.0 there)
are never read by the trainer (it replaces them by 0), but a non-finite one is refused all
the same: every consumer (loss metrics, the trajectory log, the viewer) can then rely on
every log-prob of an accepted group being finite.  Versions off the loss mask are not
checked (actors send -1 there).  Positivity is checked on sampled tokens only.

``find_problem`` is a pure function of numpy arrays; it returns the first problem as
``"<field>: <what>"`` (for the one log line that names the actor), or ``""``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnscale.protocol.messages import TrajectoryGroup

LOGPROB_TOLERANCE = 1e-4
"""A behaviour log-prob may exceed 0 by float32 rounding, never by more."""


@dataclass(frozen=True, slots=True)
class GroupLimits:
    """What the run allows; ``0`` disables a bound (tests of the loop without a model)."""

    vocab_size: int = 0
    """Token ids must lie in ``[0, vocab_size)`` (the model's embedding rows)."""
    max_tokens: int = 0
    """An episode's whole stream must fit the context (``sampling.max_context_tokens``)."""
    max_abs_reward: float = 0.0
    """Episode and turn rewards must lie in ``[-max_abs_reward, max_abs_reward]``
    (``learner.max_abs_reward``)."""


def find_problem(group: TrajectoryGroup, limits: GroupLimits, version: int) -> str:
    """The first semantic problem of a non-failed ``group`` at learner ``version``, or ""."""
    for i, ep in enumerate(group.episodes):
        problem = _episode_problem(ep, limits, version)
        if problem:
            return f"episodes[{i}].{problem}"
    return ""


def _episode_problem(ep, limits: GroupLimits, version: int) -> str:
    ids = np.asarray(ep.token_ids)
    mask = np.asarray(ep.loss_mask).astype(bool)
    n = len(ids)
    if limits.max_tokens and n > limits.max_tokens:
        return f"token_ids: {n} tokens, the context holds {limits.max_tokens}"
    if n and (int(ids.min()) < 0 or (limits.vocab_size and int(ids.max()) >= limits.vocab_size)):
        bad = ids[(ids < 0) | ((ids >= limits.vocab_size) if limits.vocab_size else False)]
        return f"token_ids: id {int(bad[0])} outside the vocabulary [0, {limits.vocab_size or 'inf'})"
    if mask[:ep.prompt_len].any():
        return f"loss_mask: set on prompt token {int(np.flatnonzero(mask[:ep.prompt_len])[0])}"
    problem = _reward_problem("reward", ep.reward, limits)
    if problem:
        return problem
    for t in ep.turns:
        problem = _reward_problem(f"turns[{t.index}].reward", t.reward, limits)
        if problem:
            return problem
    all_lps = np.asarray(ep.logprobs)
    finite = np.isfinite(all_lps)
    if not finite.all():
        at = int(np.flatnonzero(~finite)[0])
        which = "a sampled token's" if mask[at] else "a non-sampled token's (loss_mask 0: send 0.0)"
        return f"logprobs: {which} log-prob at position {at} is not finite"
    lps = all_lps[mask]
    if lps.size and float(lps.max()) > LOGPROB_TOLERANCE:
        return f"logprobs: {float(lps.max()):.4g} > 0 (a log-probability is at most 0)"
    vers = np.asarray(ep.versions)[mask]
    if vers.size and int(vers.min()) < 0:
        return f"versions: {int(vers.min())} on a sampled token (versions start at 0)"
    if vers.size and int(vers.max()) > version:
        return f"versions: {int(vers.max())} is in the future (the learner is at version {version})"
    return ""


def _reward_problem(name: str, reward: float, limits: GroupLimits) -> str:
    if not np.isfinite(reward):
        return f"{name}: {reward} is not finite"
    bound = limits.max_abs_reward
    if bound and abs(reward) > bound:
        return f"{name}: {reward:.4g} outside [-{bound:g}, {bound:g}] (learner.max_abs_reward)"
    return ""
