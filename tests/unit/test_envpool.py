"""``EnvPool`` closing: bounded in time even when the env server never answers (a stopping
actor must not outlive Slurm's ``KillWait`` closing instances on a dead server).  Virtual
time (trio's ``MockClock``), a fake client that hangs on ``close``."""

from __future__ import annotations

import trio
import trio.testing

from turnscale.actors.envpool import EnvPool


class HangingClient:
    """Creates instances; ``close`` never returns (a server that accepts and never answers)."""

    def __init__(self) -> None:
        self.n = 0
        self.close_calls: list[int] = []

    async def create(self) -> int:
        self.n += 1
        return self.n

    async def reset(self, env_id: int, data_idx: int):  # pragma: no cover - not used here
        raise NotImplementedError

    async def step(self, env_id: int, action: str):  # pragma: no cover - not used here
        raise NotImplementedError

    async def close(self, env_id: int) -> None:
        self.close_calls.append(env_id)
        await trio.sleep_forever()


def test_pool_close_tries_every_instance_and_returns_within_its_timeout():
    client = HangingClient()
    pool = EnvPool(client)
    took: list[float] = []

    async def main() -> None:
        sessions = await pool.acquire(4)
        await pool.release(sessions[:2])  # two idle, two busy
        t0 = trio.current_time()
        await pool.close(timeout_s=3.0)
        took.append(trio.current_time() - t0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(client.close_calls) == [1, 2, 3, 4]
    assert took[0] <= 3.0 + 1e-6  # virtual seconds: all four at once, one deadline
    assert not pool.idle and not pool.busy


def test_releasing_broken_sessions_closes_them_at_once_within_one_bound():
    client = HangingClient()
    pool = EnvPool(client)
    took: list[float] = []

    async def main() -> None:
        sessions = await pool.acquire(3)
        for s in sessions:
            s.broken = True
        t0 = trio.current_time()
        await pool.release(sessions)
        took.append(trio.current_time() - t0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(client.close_calls) == [1, 2, 3]
    assert took[0] <= 2.0 + 1e-6  # one close bound for all of them, not one each
    assert pool.replaced == 3 and not pool.busy and not pool.idle
