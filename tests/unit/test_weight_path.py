"""``actors.weight_path.WeightPath`` on its own, with a hand-written engine whose swaps the test
completes: ``applied`` moves only on an applied swap, a failed swap or pull leaves it, a broken
engine clears it, versions only move forward within an incarnation, and a failed pull withdraws
its buffer from the actor's relay.  The same path under the real actor loop and a real
threaded engine: tests/unit/test_actor_loop.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

from turnscale.actors.actor import ActorStats
from turnscale.actors.engine import EngineBroken, EngineError, WeightSwap
from turnscale.actors.weight_path import WeightPath
from turnscale.actors.weight_sync import ReceiveBuffer, WeightSyncError
from turnscale.conf.schema import ActorConfig
from turnscale.protocol.errors import TurnscaleError
from turnscale.protocol.messages import PolicyAnnouncement
from tests.unit.message_examples import manifest


class SwapEngine:
    """Records every hand-over; the test completes the swaps."""

    def __init__(self) -> None:
        self.swaps: list[WeightSwap] = []
        self.handed = trio.Event()
        """Set at the next hand-over (replace it before each)."""
        self.version = -1

    def load_weights(self, version: int, tensors: Any) -> WeightSwap:
        self.swaps.append(WeightSwap(version))
        self.handed.set()
        return self.swaps[-1]

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class RecordingRelay:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def begin(self, key, manifest, view) -> None:
        self.events.append(("begin", manifest.version))

    def mark(self, key, i) -> None:
        self.events.append(("mark", i))

    def withdraw(self, key) -> None:
        self.events.append(("withdraw",))

    def allow_clients(self, keys) -> None:
        pass


@dataclass
class Deps:
    fail_pulls: int = 0
    relay: Any = None
    pulls: list[int] = field(default_factory=list)

    def new_buffer(self) -> ReceiveBuffer:
        return ReceiveBuffer()

    async def pull(self, sock, manifest, timeout_s, buffer, **kw) -> dict:
        self.pulls.append(manifest.version)
        if self.fail_pulls:
            self.fail_pulls -= 1
            raise WeightSyncError(f"chunk 0 of v{manifest.version} failed its checksum 3 times")
        return {"w": manifest.version}


def policy(version: int, incarnation: str = "A") -> PolicyAnnouncement:
    return PolicyAnnouncement(version=version, step=version, manifest=manifest(version), incarnation=incarnation)


def make_path(deps: Deps) -> tuple[WeightPath, list[int]]:
    woken: list[int] = []
    path = WeightPath(cfg=ActorConfig(verify_weights=False), deps=deps, stats=ActorStats(),
                      on_applied=lambda: woken.append(1))
    return path, woken


async def pull_and_complete(path: WeightPath, engine: SwapEngine, p: PolicyAnnouncement, outcome: str, **kw) -> None:
    """Run ``path.pull`` while completing its swap with ``outcome`` once the engine has it;
    raises what the pull raised."""
    errors: list[TurnscaleError] = []

    async def pull() -> None:
        try:
            await path.pull(None, p, engine)
        except TurnscaleError as exc:
            errors.append(exc)

    engine.handed = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(pull)
        with trio.fail_after(10):
            await engine.handed.wait()
        assert engine.swaps[-1].version == p.version
        assert path.applied != (p.incarnation, p.version)  # queued is not applied
        engine.swaps[-1].complete(outcome, **kw)
    if errors:
        raise errors[0]


def test_applied_moves_only_when_the_engine_reports_the_swap_applied():
    deps, engine = Deps(), SwapEngine()
    path, woken = make_path(deps)

    async def main():
        await pull_and_complete(path, engine, policy(1), WeightSwap.APPLIED)

    trio.run(main)
    assert path.applied == ("A", 1) and woken == [1]
    assert path.stats.weight_pulls == 1 and path.holds("A", 1) and not path.holds("A", 2) and not path.holds("B", 1)


def test_a_failed_swap_keeps_the_applied_version_and_a_broken_engine_clears_it():
    deps, engine = Deps(), SwapEngine()
    path, woken = make_path(deps)

    async def main():
        await pull_and_complete(path, engine, policy(1), WeightSwap.APPLIED)
        with pytest.raises(EngineError):
            await pull_and_complete(path, engine, policy(2), WeightSwap.FAILED, error="bad shape")
        assert path.applied == ("A", 1)
        with pytest.raises(EngineBroken):
            await pull_and_complete(path, engine, policy(3), WeightSwap.FAILED, error="half-loaded", broken=True)
        assert path.applied is None

    trio.run(main)
    assert woken == [1] and path.stats.weight_pulls == 1


def test_versions_only_move_forward_within_an_incarnation_and_another_incarnation_is_pulled_anew():
    deps, engine = Deps(), SwapEngine()
    path, _ = make_path(deps)

    async def main():
        await pull_and_complete(path, engine, policy(5), WeightSwap.APPLIED)
        await path.pull(None, policy(5), engine)  # the same version: nothing to do
        await path.pull(None, policy(3), engine)  # an older one: nothing to do
        assert deps.pulls == [5] and len(engine.swaps) == 1
        assert not path.needs(PolicyAnnouncement(version=9, step=9, manifest=None, incarnation="A"))  # no weights
        await pull_and_complete(path, engine, policy(2, incarnation="B"), WeightSwap.APPLIED)  # a restarted learner

    trio.run(main)
    assert path.applied == ("B", 2) and deps.pulls == [5, 2]


def test_a_failed_pull_withdraws_its_buffer_from_the_relay_and_applies_nothing():
    relay = RecordingRelay()
    deps, engine = Deps(fail_pulls=1, relay=relay), SwapEngine()
    path, woken = make_path(deps)

    async def main():
        with pytest.raises(WeightSyncError):
            await path.pull(None, policy(1), engine)
        assert path.applied is None and not engine.swaps and not woken
        assert relay.events == [("begin", 1), ("withdraw",)]  # registered before a byte landed, withdrawn on failure
        await pull_and_complete(path, engine, policy(1), WeightSwap.APPLIED)

    trio.run(main)
    assert path.applied == ("A", 1) and relay.events[-1] == ("begin", 1)
