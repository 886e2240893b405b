"""Per-pool staleness and behaviour-vs-learner log-prob gap of the groups one step trained.

Actors in different pools run different engines, devices and dtypes, so the log-probs
``mu`` they record for their sampled tokens differ from what the learner computes for the
same tokens with the same weights.  The decoupled-PPO behaviour weight ``pi_prox / mu``
absorbs that difference; these metrics show how large it is, per pool.

For every trained group the trainer reports a ``GroupGap`` (token sums over the group's
loss tokens; ``Trainer.last_group_gaps``, one per group of the step, in batch order), and
the service attributes it to the pool recorded with the group when it was accepted
(``leases.Ready.pool``), so a group whose actor has left since is still counted under its
pool.  ``record_pool_gaps`` writes, per pool ``<name>``:

- ``pool/<name>/staleness_mean``: mean policy lag (learner version at training time minus
  the group's oldest sampled-token version) of the pool's groups trained in the step;
- ``pool/<name>/logprob_gap_mean``: mean over the pool's loss tokens of ``|mu - pi_prox|``
  (nats), all trained groups: engine/device numerics *plus* policy lag;
- ``pool/<name>/behaviour_weight_mean``: mean over the same tokens of
  ``exp(pi_prox - mu)`` before the loss's cap (``algo.behaviour_cap``; the exponent is
  capped at 30 as in the loss), so it can differ from the capped ``loss/behaviour_weight_mean``;
- ``pool/<name>/logprob_gap_mean_staleness0`` and ``.../behaviour_weight_mean_staleness0``:
  the same over the pool's groups sampled entirely at the learner's current version
  (staleness 0) only, written when the step has any.  There ``pi_prox`` is the very policy
  the actor sampled from, so the gap is pure engine/device numerics (plus the rounding of
  ``learner.transfer_dtype`` when it is narrower than the learner's weights): ~0 for a
  float32 hf actor on CPU, larger for bf16 or another engine.

Token-weighted: a pool's mean is its token sums divided by its token count, so micro-batch
boundaries and group sizes do not change it.  Under several learner ranks each rank's
trainer reports its own groups; rank 0's ``learner.ranks.RankedTrainer`` sums them over
the ranks into one entry per group of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["GroupGap", "PoolGroup", "record_pool_gaps"]


@dataclass(frozen=True, slots=True)
class GroupGap:
    """Token sums of one group (or any set of rows) over its loss tokens."""

    tokens: float = 0.0
    """Loss-mask tokens."""
    abs_gap_sum: float = 0.0
    """Sum of ``|mu - pi_prox|`` (nats)."""
    weight_sum: float = 0.0
    """Sum of ``exp(min(pi_prox - mu, 30))``."""

    def __add__(self, other: "GroupGap") -> "GroupGap":
        return GroupGap(self.tokens + other.tokens, self.abs_gap_sum + other.abs_gap_sum,
                        self.weight_sum + other.weight_sum)


@dataclass(frozen=True, slots=True)
class PoolGroup:
    """One trained group as the service attributes it."""

    pool: str
    """The pool of the actor that played it, recorded when the group was accepted."""
    staleness: int
    """Learner version at training time minus the group's oldest sampled-token version."""
    gap: GroupGap | None
    """The trainer's sums for it (None when the trainer reports none, e.g. ``algo=sft``)."""


def record_pool_gaps(m: Any, groups: Sequence[PoolGroup]) -> None:
    """Add the per-pool keys of the module docstring to ``m`` (``metrics.StepMetrics``)."""
    total: dict[str, GroupGap] = {}
    fresh: dict[str, GroupGap] = {}
    for g in groups:
        m.add(f"pool/{g.pool}/staleness_mean", g.staleness, "mean")
        if g.gap is None:
            continue
        total[g.pool] = total.get(g.pool, GroupGap()) + g.gap
        if g.staleness == 0:
            fresh[g.pool] = fresh.get(g.pool, GroupGap()) + g.gap
    for suffix, sums in (("", total), ("_staleness0", fresh)):
        for pool, s in sums.items():
            if s.tokens > 0:
                m.add(f"pool/{pool}/logprob_gap_mean{suffix}", s.abs_gap_sum / s.tokens, "last")
                m.add(f"pool/{pool}/behaviour_weight_mean{suffix}", s.weight_sum / s.tokens, "last")
