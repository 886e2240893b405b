"""``EnvClient(batch_steps=True)``'s coalescing with the wire replaced by a fake
``step_batch`` (the real route and server: ``tests/integration/test_envhub_client.py``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from turnscale.common.envclient import EnvClient, EnvConnectionLost, EnvHTTPError, StepReply


class FakeWire:
    """Records every batch; answers after ``gate`` opens (when set)."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.batches: list[list[tuple[int, str]]] = []
        self.fail = fail
        self.gate: trio.Event | None = None

    async def __call__(self, steps):
        self.batches.append(list(steps))
        self.sender = trio.lowlevel.current_task()  # the step_batch call runs in the sending task
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return [StepReply(f"{i}:{a}", 0.0, False, False, {"success": False}, {}) for i, a in steps]


def client_with(wire: FakeWire) -> EnvClient:
    c = EnvClient("http://127.0.0.1:9", batch_steps=True)
    c.step_batch = wire  # type: ignore[method-assign]
    return c


def test_concurrent_steps_share_one_request_and_each_gets_its_reply():
    wire = FakeWire()
    c = client_with(wire)
    got = {}

    async def main():
        async def one(i):
            got[i] = (await c.step(i, "go")).observation

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(one, i)

    trio.run(main)
    assert got == {i: f"{i}:go" for i in range(20)}
    assert len(wire.batches) == 1 and sorted(i for i, _ in wire.batches[0]) == list(range(20))


def test_two_steps_on_one_instance_never_share_a_batch():
    wire = FakeWire()
    c = client_with(wire)

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for a in ("a", "b", "c"):
                    nursery.start_soon(c.step, 7, a)
                nursery.start_soon(c.step, 8, "x")

    trio.run(main)
    assert all(len({i for i, _ in b}) == len(b) for b in wire.batches)
    assert sorted(a for b in wire.batches for _, a in b) == ["a", "b", "c", "x"]


def test_a_failed_batch_fails_every_step_it_carried():
    wire = FakeWire(fail=EnvHTTPError(422, "invalid_field", "nope"))
    c = client_with(wire)
    errors = []

    async def main():
        async def one(i):
            with pytest.raises(EnvHTTPError) as err:
                await c.step(i, "go")
            errors.append(err.value.code)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(one, i)

    trio.run(main)
    assert errors == ["invalid_field"] * 5


def test_a_cancelled_queued_step_is_never_sent_and_a_cancelled_sender_fails_its_batch_as_lost():
    """Steps 1 and 2 share the batch on the wire; whichever task sends it (trio schedules ready
    tasks in random order) is cancelled: its step is cancelled and the other learns it was lost.
    Step 3, still queued, is cancelled and never sent; step 4 goes in the next batch."""
    wire = FakeWire()
    wire.gate = trio.Event()
    c = client_with(wire)
    outcome = {}

    async def main():
        scopes = {i: trio.CancelScope() for i in (1, 2, 3)}
        tasks = {}

        async def one(i):
            tasks[trio.lowlevel.current_task()] = i
            with scopes.get(i, trio.CancelScope()):
                try:
                    outcome[i] = (await c.step(i, "go")).observation
                except EnvConnectionLost:
                    outcome[i] = "lost"
                return
            outcome[i] = "cancelled"

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 1)
                nursery.start_soon(one, 2)
                await trio.testing.wait_all_tasks_blocked()
                assert len(wire.batches) == 1  # the first batch (ids 1, 2) is on the wire
                nursery.start_soon(one, 3)
                await trio.testing.wait_all_tasks_blocked()
                scopes[3].cancel()  # still queued: removed, never sent
                sender = tasks[wire.sender]
                scopes[sender].cancel()  # the batch in flight is abandoned
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(one, 4)
                await trio.testing.wait_all_tasks_blocked()
                wire.gate.set()
        return sender

    sender = trio.run(main)
    other = 3 - sender
    assert outcome[sender] == "cancelled" and outcome[other] == "lost" and outcome[3] == "cancelled" and outcome[4] == "4:go"
    assert [sorted(i for i, _ in b) for b in wire.batches] == [[1, 2], [4]]
