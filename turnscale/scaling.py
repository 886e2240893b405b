"""Elastic scaling, backend-neutral: the learner's signals in, a wanted actor count per pool out.

``ScalingController.observe(sample)`` is pure logic (no clock, no I/O): it keeps the last
``window`` samples and decides only on their means, only once the window is full, and
starts a new window after every action (hysteresis: a decision needs ``window`` samples in
a row that agree, and the thresholds for adding and removing leave a dead band between
them).  What it decides, in this order:

1. bounds: a pool below its ``min_actors`` or above its ``max_actors`` is brought back
   inside at once;
2. *starved* (the learner waits for groups: mean ``idle_fraction >= up_idle`` and mean
   ``ready_groups < ready_low``): first raise ``max_leases_per_actor`` back if it is below
   ``max_leases``, else add ``step`` actors to the pool with the best measured throughput per
   configured cost (tokens/s per actor / ``cost``; a pool with no measurement yet is
   credited the mean of the measured ones, so a fresh pool gets a chance);
3. *saturated* (actors outrun the learner: mean ``idle_fraction <= down_idle`` and mean
   ``ready_groups >= ready_high`` or mean ``stale_drop_rate >= stale_high``): first lower
   ``max_leases_per_actor`` (down to ``min_leases``: cheaper than a restart, and the
   learner's admission control already bounds staleness), then remove ``step`` actors
   from the pool with the worst throughput per cost that is above its minimum.

Actors are removed by *draining* (``ScalingBackend.drain``: the learner stops leasing to
the actor, its in-flight groups finish and are trained, then the actor exits by itself),
never by killing one mid-group.  ``pick_drain`` chooses which actors.

``ScalingBackend`` is what a resource manager implements (Slurm: ``sbatch --array`` /
``scancel``; a Ray or Kubernetes adapter would implement the same two calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence


class ScalingConfigError(ValueError):
    """A scaling policy that cannot work (names the field)."""


@dataclass(frozen=True, kw_only=True)
class PoolPolicy:
    """One pool's bounds and price."""

    name: str
    min_actors: int = 0
    max_actors: int = 1
    cost: float = 1.0
    """Relative price of one actor of this pool (e.g. GPU-hours); scale-up maximises
    tokens/s per unit of cost."""

    def __post_init__(self) -> None:
        if not (self.name.isascii() and self.name.replace("_", "").isalnum()):
            raise ScalingConfigError(f"pool.name {self.name!r}: letters, digits and '_' only (actor ids are "
                                     "'<pool>-<job>_<task>')")
        if not 0 <= self.min_actors <= self.max_actors:
            raise ScalingConfigError(f"pool {self.name}: need 0 <= min_actors ({self.min_actors}) <= max_actors ({self.max_actors})")
        if self.cost <= 0:
            raise ScalingConfigError(f"pool {self.name}: cost must be > 0, got {self.cost}")


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    """Thresholds and pace of the controller (see the module docstring)."""

    pools: tuple[PoolPolicy, ...]
    window: int = 6
    """Samples averaged per decision (and waited for after each action)."""
    up_idle: float = 0.3
    """Mean learner idle fraction at or above which it is starved."""
    down_idle: float = 0.05
    """Mean learner idle fraction at or below which it may be saturated."""
    ready_low: float = 1.0
    """Starved only while fewer groups than this wait in the ready buffer."""
    ready_high: float = 4.0
    """Saturated when at least this many groups wait in the ready buffer on average."""
    stale_high: float = 0.1
    """Saturated when at least this fraction of arriving groups is dropped as stale."""
    step: int = 1
    """Actors added or removed per decision."""
    min_leases: int = 1
    max_leases: int = 4
    """Range of ``max_leases_per_actor`` the controller moves in."""

    def __post_init__(self) -> None:
        if not self.pools:
            raise ScalingConfigError("scaling.pools must name at least one pool")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ScalingConfigError(f"scaling.pools: duplicate pool names {names}")
        if self.window < 1 or self.step < 1:
            raise ScalingConfigError("scaling.window and scaling.step must be >= 1")
        if not 0 <= self.down_idle < self.up_idle <= 1:
            raise ScalingConfigError(f"need 0 <= down_idle ({self.down_idle}) < up_idle ({self.up_idle}) <= 1 (the dead band)")
        if not self.ready_low <= self.ready_high:
            raise ScalingConfigError(f"need ready_low ({self.ready_low}) <= ready_high ({self.ready_high})")
        if not 1 <= self.min_leases <= self.max_leases:
            raise ScalingConfigError(f"need 1 <= min_leases ({self.min_leases}) <= max_leases ({self.max_leases})")


@dataclass(frozen=True, kw_only=True)
class Sample:
    """The learner's signals over one interval (computed from two ``LearnerStatus`` replies)."""

    idle_fraction: float
    """Fraction of the interval the learner waited for groups."""
    ready_groups: float
    """Accepted groups waiting for a batch (at the end of the interval)."""
    stale_drop_rate: float = 0.0
    """Groups dropped as stale / groups that arrived, over the interval."""
    policy_lag: float = 0.0
    """Mean versions between sampling and training of the groups trained in the interval."""
    lease_backlog: float = 0.0
    """Leases granted and not yet answered by a group."""
    actors: Mapping[str, int] = field(default_factory=dict)
    """Pool -> actors registered (draining ones excluded)."""
    tokens_per_s: Mapping[str, float] = field(default_factory=dict)
    """Pool -> tokens generated per second over the interval (all its actors)."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do now.  ``wanted`` names every pool; ``max_leases_per_actor`` is the value
    the learner should use from now on; ``reason`` says why (for the log)."""

    wanted: dict[str, int]
    max_leases_per_actor: int
    reason: str
    changed: bool


class ScalingBackend(Protocol):
    """What a resource manager implements (Slurm, later Ray or Kubernetes)."""

    def scale_to(self, pool: str, n: int) -> None:
        """Have ``n`` actors of ``pool`` running or starting (only ever used to add: removal drains)."""

    def drain(self, actor_id: str) -> None:
        """Release one actor's job/pod/worker once the actor has left.  The caller
        (``turnscale.control.Autoscaler``) has already told the learner to drain it: no new
        lease, its in-flight groups finish, then the learner tells it ``Shutdown("drained")``
        and it exits by itself (a Slurm array task then simply ends)."""


class ScalingController:
    """See the module docstring.  ``observe`` is the only entry; state: the window, the
    current wanted counts and the current lease limit."""

    def __init__(self, policy: ScalingPolicy, *, leases: int | None = None, wanted: Mapping[str, int] | None = None) -> None:
        self.policy = policy
        self.leases = policy.max_leases if leases is None else max(policy.min_leases, min(policy.max_leases, leases))
        self.wanted = {p.name: p.min_actors for p in policy.pools}
        if wanted:
            self.wanted.update({k: int(v) for k, v in wanted.items() if k in self.wanted})
        self._window: list[Sample] = []
        self._rate: dict[str, float] = {}
        """Pool -> last measured tokens/s per actor (kept while a pool has no actors)."""

    def observe(self, sample: Sample) -> Decision:
        for name, n in sample.actors.items():
            tps = sample.tokens_per_s.get(name, 0.0)
            if n > 0 and tps > 0:
                self._rate[name] = tps / n
        fixed = self._clamp()
        if fixed:
            return self._act(fixed)
        self._window.append(sample)
        if len(self._window) < self.policy.window:
            return self._hold("collecting")
        w, p = self._window, self.policy
        idle = sum(s.idle_fraction for s in w) / len(w)
        ready = sum(s.ready_groups for s in w) / len(w)
        stale = sum(s.stale_drop_rate for s in w) / len(w)
        self._window = w[1:]  # sliding until an action resets it
        if idle >= p.up_idle and ready < p.ready_low:
            why = f"learner idle {idle:.0%}, ready {ready:.1f}"
            if self.leases < p.max_leases:
                self.leases += 1
                return self._act(f"starved ({why}): max_leases_per_actor -> {self.leases}")
            pool = self._best_to_add()
            if pool is None:
                return self._hold(f"starved ({why}) but every pool is at max_actors")
            self.wanted[pool] += min(p.step, self._room(pool))
            return self._act(f"starved ({why}): {pool} -> {self.wanted[pool]}")
        if idle <= p.down_idle and (ready >= p.ready_high or stale >= p.stale_high):
            why = f"learner idle {idle:.0%}, ready {ready:.1f}, stale drops {stale:.0%}"
            if self.leases > p.min_leases:
                self.leases = min(self.leases - 1, p.max_leases)  # from a limit above the range: into it
                return self._act(f"saturated ({why}): max_leases_per_actor -> {self.leases}")
            pool = self._worst_to_remove()
            if pool is None:
                return self._hold(f"saturated ({why}) but every pool is at min_actors")
            floor = self._pool(pool).min_actors
            self.wanted[pool] = max(floor, self.wanted[pool] - p.step)
            return self._act(f"saturated ({why}): {pool} -> {self.wanted[pool]}")
        return self._hold(f"balanced (idle {idle:.0%}, ready {ready:.1f}, stale drops {stale:.0%})")

    def adopt_leases(self, n: int) -> None:
        """Start from the learner's own ``max_leases_per_actor`` (``Autoscaler`` calls this on its
        first status), so the limit stays what it is until a decision changes it: a limit above
        ``max_leases`` (the learner's default is 64) is never raised and is lowered into the range
        only when saturated; one below is raised one step at a time when starved."""
        self.leases = max(1, int(n))

    # -- helpers
    def _pool(self, name: str) -> PoolPolicy:
        return next(p for p in self.policy.pools if p.name == name)

    def _room(self, name: str) -> int:
        return self._pool(name).max_actors - self.wanted[name]

    def _clamp(self) -> str:
        out = []
        for p in self.policy.pools:
            n = max(p.min_actors, min(p.max_actors, self.wanted[p.name]))
            if n != self.wanted[p.name]:
                out.append(f"{p.name} -> {n} (bounds {p.min_actors}..{p.max_actors})")
                self.wanted[p.name] = n
        return "; ".join(out)

    def _value(self, name: str) -> float:
        """Measured tokens/s per actor per unit cost; unmeasured pools get the mean measured rate."""
        rate = self._rate.get(name)
        if rate is None:
            rate = sum(self._rate.values()) / len(self._rate) if self._rate else 1.0
        return rate / self._pool(name).cost

    def _best_to_add(self) -> str | None:
        cands = [p.name for p in self.policy.pools if self._room(p.name) > 0]
        return max(cands, key=lambda n: (self._value(n), -self._order(n)), default=None)

    def _worst_to_remove(self) -> str | None:
        cands = [p.name for p in self.policy.pools if self.wanted[p.name] > p.min_actors]
        return min(cands, key=lambda n: (self._value(n), -self._order(n)), default=None)

    def _order(self, name: str) -> int:
        return [p.name for p in self.policy.pools].index(name)

    def _act(self, reason: str) -> Decision:
        self._window = []
        return Decision(wanted=dict(self.wanted), max_leases_per_actor=self.leases, reason=reason, changed=True)

    def _hold(self, reason: str) -> Decision:
        return Decision(wanted=dict(self.wanted), max_leases_per_actor=self.leases, reason=reason, changed=False)


def pick_drain(actors: Sequence[tuple[str, str, int]], pool: str, n: int) -> list[str]:
    """Which ``n`` actors of ``pool`` to drain, from ``(actor_id, pool, leases_held)``: those
    holding the fewest leases first (they finish soonest), ties by id for determinism."""
    mine = sorted((held, aid) for aid, p, held in actors if p == pool)
    return [aid for _, aid in mine[:max(0, n)]]
